"""Index: per-tier LRU, capacity reservations, pins, holders masks. Pure logic."""
from __future__ import annotations

import threading

from kvstream_hicache.index import Index

CRCS = (1, 2)


def add(index, key, tier, nbytes=100, crcs=CRCS):
    victims = index.reserve(tier, nbytes)
    assert victims is not None
    index.commit(key, tier, nbytes - 10, 4096, crcs, nbytes)
    return victims


def test_commit_holders_contains_prefix():
    index = Index([None, None])
    add(index, "a", 0)
    add(index, "a", 1)
    add(index, "b", 1)
    assert index.holders("a") == 0b11 and index.holders("b") == 0b10 and index.holders("c") == 0
    assert index.contains("b") and not index.contains("b", mask=0b01)
    assert index.prefix_len(["a", "b", "c", "a"]) == 2
    assert index.prefix_len(["a", "b"], mask=0b01) == 1
    assert index.used == [100, 200] and index.reserved == [0, 0]


def test_lru_eviction_within_capacity():
    index = Index([300])
    for key in "abc":
        assert add(index, key, 0) == []
    index.touch("a")  # a is now the most recent: b is the oldest
    assert add(index, "d", 0) == ["b"]
    assert sorted(index.keys(0)) == ["a", "c", "d"]
    assert index.evictions == [1]
    assert index.get("b") is None


def test_pinned_pages_are_never_victims():
    index = Index([300])
    for key in "abc":
        add(index, key, 0)
    infos = index.pin(["a", "b"])
    assert add(index, "d", 0) == ["c"]
    infos += index.pin(["d"])
    assert index.reserve(0, 100) is None  # only pinned pages left: refuse, evict nothing
    assert sorted(index.keys(0)) == ["a", "b", "d"]
    index.unpin(infos)
    assert index.reserve(0, 100) == ["a"]


def test_page_larger_than_tier_is_refused():
    index = Index([300])
    add(index, "a", 0)
    assert index.reserve(0, 400) is None
    assert index.keys(0) == ["a"]


def test_reservations_count_against_capacity():
    index = Index([300])
    assert index.reserve(0, 200) == []
    assert index.reserve(0, 200) is None  # 400 > 300 with nothing committed to evict
    index.abort(0, 200)
    assert index.reserved == [0]


def test_evict_for_enospc_ignores_capacity():
    index = Index([None])
    for key in "abcd":
        add(index, key, 0)
    assert index.evict(0, 150) == ["a", "b"]
    assert index.evict(0, 10_000) == ["c", "d"]
    assert index.evict(0, 1) == []
    assert index.used == [0]


def test_remove_drops_one_tier_then_the_page():
    index = Index([None, None])
    add(index, "a", 0)
    add(index, "a", 1)
    assert index.remove("a", 0) and not index.remove("a", 0)
    assert index.holders("a") == 0b10
    assert index.remove("a", 1)
    assert index.get("a") is None and len(index) == 0 and index.used == [0, 0]


def test_commit_of_other_content_displaces_other_tiers():
    index = Index([None, None])
    add(index, "a", 0, crcs=(1,))
    index.reserve(1, 100)
    displaced = index.commit("a", 1, 90, 4096, (9,), 100)
    assert displaced == [0]
    assert index.holders("a") == 0b10 and index.get("a").crcs == (9,)


def test_recommit_counts_bytes_once():
    index = Index([None])
    add(index, "a", 0)
    index.commit("a", 0, 90, 4096, CRCS, 100, reserved=False)
    assert index.used == [100]


def test_clear():
    index = Index([None])
    add(index, "a", 0)
    index.clear()
    assert len(index) == 0 and index.keys(0) == [] and index.used == [0]


def test_concurrent_reserve_commit_keeps_accounting():
    index = Index([10_000, None])

    def worker(w):
        for i in range(300):
            key = f"{w}-{i}"
            for tier in (0, 1):
                if index.reserve(tier, 100) is not None:
                    index.commit(key, tier, 90, 4096, CRCS, 100)
            infos = index.pin([key])
            index.unpin(infos)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert index.used[0] <= 10_000 and index.reserved == [0, 0]
    assert index.used[0] == 100 * len(index.keys(0))
    assert index.used[1] == 100 * 900
