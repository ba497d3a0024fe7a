"""Index: per-tier LRU, capacity reservations, pins, holders masks. Pure logic."""
from __future__ import annotations

import random
import threading
import time
from array import array

import pytest

from kvstream_hicache.index import THEIRS, Index

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


def test_a_victim_another_process_used_since_is_spared_and_the_next_one_goes():
    """next_victims names what reserve would evict, with when this process last used each; spare makes one the
    most recent (another process marked its file used since: jobs.py), so reserve evicts the next instead. Another
    process's copy (THEIRS) is never spared, being never a victim."""
    index = Index([300])
    for key in "abc":
        add(index, key, 0)
    assert index.next_victims(0, 0, 8) == []  # (it fits: nothing would go)
    before = time.time_ns()
    (key, used), = index.next_victims(0, 100, 8)
    assert key == "a" and used <= before  # (a's write is its last use here)
    assert [k for k, _ in index.next_victims(0, 200, 8)] == ["a", "b"]
    assert [k for k, _ in index.next_victims(0, 200, 1)] == ["a"]
    assert index.spare("a", 0)
    assert [k for k, _ in index.next_victims(0, 300, 8)] == ["b", "c", "a"]
    assert index.next_victims(0, 300, 8)[-1][1] >= before  # (spared: used now)
    assert add(index, "d", 0) == ["b"] and index.holders("a") == 1
    assert not index.spare("b", 0) and not index.spare("zz", 0)  # (gone, never held: nothing to spare)
    index.commit("t", 0, 90, 4096, CRCS, 100, reserved=False, mark=index.mark("t"), stamp=(time.time_ns(), 0))
    assert index.is_theirs("t", 0) and not index.spare("t", 0)
    assert index.others_in(["a", "t", "zz"]) == [("t", 0)]


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


# -- the packed table (a tier of millions of pages) ----------------------------------------------
HEX = [f"{i:064x}" for i in range(6)]


def scanned(index, key, tier=0, created=0, crcs=CRCS, mark=None):
    mark = index.mark(key) if mark is None else mark
    return index.add_scanned(key, tier, 90, 4096, crcs, 100, created, index.epoch, mark)


def test_hex_and_other_keys_round_trip_and_slots_are_reused():
    index = Index([None])
    keys = HEX[:3] + ["short", "A" * 64]  # 'A'*64: hex digits, not lowercase: kept as it is
    for k in keys:
        add(index, k, 0)
    assert index.keys(0) == keys and all(index.contains(k) for k in keys)
    assert not index.contains(HEX[3]) and not index.contains("a" * 64)
    assert index.remove(HEX[1], 0) and index.remove("short", 0)
    add(index, HEX[4], 0)  # reuses a freed slot (and its CRC run)
    add(index, "other", 0, crcs=(5, 6))
    assert index.keys(0) == [HEX[0], HEX[2], "A" * 64, HEX[4], "other"]
    assert index.get("other").crcs == (5, 6) and index.get(HEX[4]).crcs == CRCS
    assert len(index) == 5 and index.used == [500]


def test_many_keys_grow_the_sub_tables():
    index = Index([None])
    keys = [f"{i:064x}" for i in range(20_000)]
    for k in keys:
        index.commit(k, 0, 90, 4096, CRCS, 100, reserved=False)
    for k in keys[::2]:
        index.remove(k, 0)
    assert len(index) == 10_000 and all(index.contains(k) for k in keys[1::2])
    assert not any(index.contains(k) for k in keys[::2])


def test_a_page_removed_while_pinned_keeps_its_row_until_unpinned():
    index = Index([None])
    add(index, "a", 0)
    infos = index.pin(["a"])
    assert index.remove("a", 0) and index.get("a") is None
    add(index, "b", 0)  # must not take a's row: a reader still holds it
    index.unpin(infos)
    assert index.get("b").pins == 0 and index.keys(0) == ["b"]
    add(index, "c", 0)  # a's row, free now
    assert index.keys(0) == ["b", "c"]


def test_pins_taken_before_clear_are_void_after_it():
    index = Index([None])
    add(index, "a", 0)
    infos = index.pin(["a"])
    index.clear()
    add(index, "b", 0)
    index.unpin(infos)
    assert index.get("b").pins == 0


def test_scanned_pages_are_older_than_used_ones_and_settle_by_write_time():
    index = Index([400])
    add(index, "new", 0)
    slots = [scanned(index, k, created=c) for k, c in (("s1", 30), ("s2", 10), ("s3", 20))]
    assert index.keys(0) == ["s1", "s2", "s3", "new"] and index.old_pages(0) == (0, 3)
    assert index.touch("s3")
    from array import array

    assert index.settle(0, array("i", slots), index.epoch) == 2  # s3 was used: it keeps its place
    assert index.keys(0) == ["s2", "s1", "new", "s3"] and index.old_pages(0) == (2, 0)
    assert add(index, "x", 0) == ["s2"]  # the oldest write goes first


def test_the_scan_never_overrides_what_the_index_knows():
    index = Index([None, None])
    add(index, "a", 0, crcs=(1,))
    assert scanned(index, "a", 0, crcs=(1,)) == -1  # that copy already
    assert scanned(index, "a", 1, crcs=(2,), created=1) == -1  # another version, older than a write
    assert scanned(index, "a", 1, crcs=(1,)) >= 0 and index.holders("a") == 0b11
    assert scanned(index, "b", 0, crcs=(1,), created=5) >= 0
    assert scanned(index, "b", 1, crcs=(2,), created=9) >= 0  # a newer version: it wins
    assert index.holders("b") == 0b10 and index.get("b").crcs == (2,)
    epoch = index.epoch
    index.clear()
    assert index.add_scanned("c", 0, 90, 4096, CRCS, 100, 0, epoch, index.mark("c")) == -1


def test_a_copy_that_left_the_index_after_the_scan_read_it_is_read_again():
    from kvstream_hicache.index import RETRY

    index = Index([None])
    add(index, "a", 0)
    mark = index.mark("a")  # the scan reads a's file now...
    assert index.remove("a", 0)  # ...a read finds it damaged and deletes it
    assert scanned(index, "a", mark=mark) == RETRY and index.get("a") is None
    assert scanned(index, "a") >= 0  # read again (here: still there)


def test_a_background_copy_is_the_least_recent_and_reserve_without_eviction_refuses():
    """commit(oldest=True) (a catch-up copy, replication.py) goes first when room is needed, before
    the pages of before the restart too; reserve(evict=False) never evicts."""
    index = Index([300])
    index.add_scanned("old", 0, 90, 4096, CRCS, 100, 5, index.epoch, index.mark("old"))
    add(index, "hot", 0)
    assert index.reserve(0, 100) == []
    index.commit("copy", 0, 90, 4096, CRCS, 100, oldest=True)
    assert index.keys(0) == ["copy", "old", "hot"]
    assert index.reserve(0, 100, evict=False) is None and len(index) == 3
    assert add(index, "new", 0) == ["copy"]


def test_lacking_walks_the_pages_a_tier_lacks_by_slot_in_bounded_steps(monkeypatch):
    """Background replication's sweep: the keys some tier holds and tier k lacks, ``limit`` at a time,
    SWEEP_SLOTS slots per step, to the end (-1); count_lacking agrees from any slot. ``holding`` walks
    the keys tier k holds alike (a rejoin's walk, engine._forget_lost)."""
    from kvstream_hicache import index as index_module

    monkeypatch.setattr(index_module, "SWEEP_SLOTS", 4)
    index = Index([None, None])
    keys = [f"{i:064x}" for i in range(10)] + ["odd-key"]
    for i, key in enumerate(keys):
        add(index, key, 0 if i % 3 else 1)  # every third page on tier 1 alone
    add(index, keys[1], 1)  # on both
    index.remove(keys[4], 0)  # gone: held nowhere
    lacking1 = [k for k in keys if index.holders(k) == 0b01]
    lacking0 = [k for k in keys if index.holders(k) == 0b10]
    for tier, want in ((1, lacking1), (0, lacking0)):
        assert index.count_lacking(tier) == len(want)
        got, at, steps = [], 0, 0
        while at >= 0:
            batch, nxt = index.lacking(tier, at, 2)
            assert len(batch) <= 2 and (nxt > at or nxt == -1)
            assert index.count_lacking(tier, at) == len(want) - len(got)
            got += batch
            at, steps = nxt, steps + 1
        assert got == want and steps >= 3
        got, at = [], 0
        while at >= 0:
            batch, at = index.holding(tier, at, 2)
            assert len(batch) <= 2
            got += batch
        assert got == [k for k in keys if index.holders(k) >> tier & 1]


class SameHash(str):
    """A key whose hash every other one shares: each lookup walks a probe chain of keys alike."""

    def __hash__(self):
        return 12345


def test_keys_of_one_hash_are_told_apart_by_the_key_itself():
    index = Index([None])
    keys = [SameHash(f"{i:064x}") for i in range(40)] + [SameHash(f"odd-{i}") for i in range(10)]
    for k in keys:
        add(index, k, 0)
    for k in keys[::3]:  # deleted entries stay in the chain: lookups probe past them
        index.remove(k, 0)
    kept = [k for i, k in enumerate(keys) if i % 3]
    assert all(index.contains(k) for k in kept) and not any(index.contains(k) for k in keys[::3])
    assert index.prefix_len(kept) == len(kept) and index.prefix_len(keys) == 0
    assert not index.contains(SameHash("f" * 64)) and not index.contains(SameHash("odd-99"))
    assert index.keys(0) == kept


def test_a_key_is_kept_as_32_bytes_exactly_when_it_is_64_lowercase_hex():
    from kvstream_hicache._uring import unhex

    good = "0123456789abcdef" * 4
    assert unhex(good) == bytes.fromhex(good)
    for other in ("0123456789ABCDEF" * 4, good[:-1], good + "0", good[:-1] + "g", good[:-2] + " 0",
                  good[:-1] + "\u00e9", good[:-1] + "\u0660", "", 1234, b"00" * 32):
        assert unhex(other) is None, other
    index = Index([None])
    assert not index.contains(1234) and index.prefix_len([good, 1234]) == 0  # never raises on a non-str


def test_existence_queries_run_no_python_code_per_key():
    """SGLang's prefetch thread asks batch_exists/prefix_len on its critical path: a lookup is C
    (_uring.KeyTable), as fast as a dict's, not a probe written in Python (several times slower)."""
    import sys

    index = Index([None])
    keys = [f"{i:064x}" for i in range(1000)]
    for k in keys:
        index.commit(k, 0, 90, 4096, CRCS, 100, reserved=False)
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        n = index.prefix_len(keys)
        held = [index.contains(k) for k in keys[:100]] + [index.holders(k) for k in keys[:100]]
    finally:
        sys.setprofile(None)
    assert n == 1000 and all(held)
    frames = [c for c in calls if c != "<listcomp>"]
    assert not frames, frames[:10]  # the lookups are C from the call on


def test_lookups_without_the_lock_see_every_held_key_while_the_table_changes():
    """A reader never takes the index lock; writers grow, shrink and reuse rows meanwhile."""
    index = Index([None])
    stable = [f"{i:064x}" for i in range(500)]
    for k in stable:
        index.commit(k, 0, 90, 4096, CRCS, 100, reserved=False)
    churn = [f"{i:063x}z" if i % 2 else f"{i + 10**6:064x}" for i in range(3000)]  # odd and hex keys
    done = threading.Event()
    wrong = []

    def read():
        while not done.is_set():
            if index.prefix_len(stable) != len(stable) or not all(index.holders(k) == 1 for k in stable[::7]):
                wrong.append("a held key was missed")
            if index.contains("never-held"):
                wrong.append("a key never held was found")

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3):
            for k in churn:
                index.commit(k, 0, 90, 4096, CRCS, 100, reserved=False)
            for k in churn:
                index.remove(k, 0)
    finally:
        done.set()
        reader.join()
    assert not wrong and len(index) == len(stable)


@pytest.mark.parametrize("between", ["settle", "touch", "discovered"])
def test_a_copy_read_from_a_file_being_removed_leaves_the_index(between):
    """Evicted (out of the index, its file not yet unlinked), then read from that file (the scan, or
    discovery), then the unlink: the copy leaves the index again wherever it moved meanwhile (before:
    only while still on the scanned list; a settled, touched or discovered one stayed, with no file)."""
    from array import array

    key, crcs = "ab" * 32, (7,)
    index = Index([None])
    index.reserve(0, 100)
    index.commit(key, 0, 100, 4096, crcs, 100)
    assert index.evict(0, 100) == [key]
    mark = index.mark(key)
    if between == "discovered":
        assert index.commit(key, 0, 100, 4096, crcs, 100, reserved=False, mark=mark) == []
    else:
        slot = index.add_scanned(key, 0, 100, 4096, crcs, 100, 1, index.epoch, mark)
        if between == "settle":
            index.settle(0, array("i", [slot]), index.epoch)
        else:
            index.touch(key)
    index.file_removed(key, 0)
    assert index.holders(key) == 0 and index.used == [0]
    assert index.commit(key, 0, 100, 4096, crcs, 100, reserved=False, mark=mark) is None  # read before: again


def test_on_gone_is_called_for_every_key_clear_removes():
    index = Index([None])
    gone = []
    index.on_gone = gone.append
    keys = [f"{i:064x}" for i in range(3)]
    for key in keys:
        index.commit(key, 0, 4096, 4096, (1,), 4096, reserved=False)
    index.clear()
    assert sorted(gone) == keys and len(index) == 0


def test_on_own_is_called_when_a_key_held_only_as_another_process_s_copy_gains_its_own():
    """LMCache's usage counts a key stored where only another process's copy was held once this process's own
    copy is written (a catch-up copy to tier 0); a key's first copy, and a copy added beside an own one, fire none."""
    index = Index([None, None])
    own = []
    index.on_own = own.append
    theirs, mine = f"{1:064x}", f"{2:064x}"
    now = time.time_ns()
    index.commit(theirs, 1, 90, 4096, CRCS, 100, reserved=False, mark=index.mark(theirs), stamp=(now, now))
    assert index.is_theirs(theirs, 1) and not own
    index.commit(mine, 1, 90, 4096, CRCS, 100, reserved=False)
    index.commit(mine, 0, 90, 4096, CRCS, 100, reserved=False)
    assert not own
    index.commit(theirs, 0, 90, 4096, CRCS, 100, reserved=False, oldest=True)
    assert own == [theirs] and index.holds_own(theirs)


def test_crc_runs_freed_by_pages_of_one_size_are_reused_by_pages_of_another():
    """Pages of 1 block, all evicted, then of 2, ... 8 (LMCache's short last chunks): the CRC column
    stays within twice what the live pages hold (before: a run per block count ever seen)."""
    index = Index([None])
    n, serial = 2_000, 0
    for blocks in range(1, 9):
        index.evict(0, 1 << 62)
        for _ in range(n):
            index.commit(f"{serial:064x}", 0, blocks * 4096, 4096, tuple(range(1, blocks + 1)), blocks * 4096,
                         reserved=False)
            serial += 1
    assert len(index) == n and len(index._crcs) <= 2 * n * 8
    assert index.get(f"{serial - 1:064x}").crcs == tuple(range(1, 9))


def test_a_found_copy_of_a_page_the_index_holds_there_keeps_its_place_and_count():
    """A lookup (discovery) that read the file of this process's put before the put indexed it indexes it
    after: the index knows that copy (this process wrote it), so it stays counted, a victim of this
    process's eviction. It went to THEIRS: its own page, counted and evicted by no process."""
    index = Index([1000])
    key = "ab" * 32
    mark = index.mark(key)  # (the lookup's, before it reads the file)
    add(index, key, 0)  # the put's commit
    assert index.commit(key, 0, 90, 4096, CRCS, 100, reserved=False, mark=mark, stamp=(0, time.time_ns())) == []
    assert (index.used[0], index.theirs(0), index.pages_on(0)) == (100, 0, 1)
    assert index.reserve(0, 1000) == [key]  # still this process's to evict


def test_used_bytes_are_the_counted_copies_whatever_moves_them_between_lists():
    """Copies move between THEIRS and the counted lists (a found copy, a put of the same key or another
    version, the scan, touch, settle, removal, eviction, clear, a slot reused): ``used`` stays the sum of
    the counted copies' bytes, and the per-list lengths and counts agree with the copies held."""
    rng = random.Random(7)
    index = Index([None, 2000])
    keys = [f"{i:064x}" for i in range(12)]
    for _ in range(20_000):
        op, key, tier = rng.randrange(9), rng.choice(keys), rng.randrange(2)
        crcs = (rng.randrange(2), 2)  # two versions of each key, of two sizes
        nbytes = 100 if crcs[0] == 0 else 300
        written = rng.choice([time.time_ns(), index.started_ns - 10, 0])  # another process's, older, none
        if op == 0:
            if index.reserve(tier, nbytes) is not None:
                index.commit(key, tier, nbytes, 4096, crcs, nbytes, oldest=rng.random() < 0.3)
        elif op == 1:
            index.commit(key, tier, nbytes, 4096, crcs, nbytes, reserved=False, mark=index.mark(key),
                         stamp=(written, written))
        elif op == 2:
            slot = index.add_scanned(key, tier, nbytes, 4096, crcs, nbytes, written, index.epoch,
                                     index.mark(key), rng.random() < 0.5)
            if slot >= 0 and rng.random() < 0.5:
                index.settle(tier, array("i", [slot]), index.epoch)
        elif op == 3:
            index.touch(key)
        elif op == 4:
            index.remove(key, tier)
        elif op == 5:
            index.file_removed(key, tier)
        elif op == 6:
            index.evict(tier, rng.randrange(500))
        elif op == 7:
            index.evict_excess(tier, 1000)
        elif rng.random() < 0.01:
            index.clear()
        for t in range(2):
            held = [s for s in range(len(index._tiers)) if index._tiers[s] >> t & 1]
            lists = [index._on[t][s] for s in held]
            assert index.used[t] == sum(index._nbytes[s] for s, on in zip(held, lists) if on != THEIRS)
            assert index._len[t] == [lists.count(where) for where in range(4)] and index.pages_on(t) == len(held)


def test_a_copy_found_once_the_scan_listed_every_tier_is_another_process_s_whatever_its_stamps_say():
    """Another node whose clock runs a minute behind this one's (within the honest skew) stamps a page it puts
    after this process began as older than this start: found by discovery or a catch-up look before the
    start-up scan is done, it passes for a page of before the restart (counted, evicted by this process);
    found once the scan has listed every tier, it was not there then: THEIRS, unless this process wrote it."""
    index = Index([None])
    behind = index.started_ns - 60 * 10**9

    def found(key: str, since: bool, look: str = "discovery") -> int:
        before = index.used[0]
        if look == "discovery":
            index.commit(key, 0, 90, 4096, CRCS, 100, reserved=False, mark=index.mark(key), stamp=(behind, behind),
                         since=since)
        else:  # catch-up's look (replication._learn) and the scan
            index.add_scanned(key, 0, 90, 4096, CRCS, 100, behind, index.epoch, index.mark(key),
                              stamp=(behind, behind), since=since)
        return index.used[0] - before

    assert found("during-scan", False) == 100 and found("during-scan-look", False, "look") == 100
    assert found("after-scan", True) == 0 and found("after-scan-look", True, "look") == 0
    index.wrote("mine", 0, behind)  # (this process's own copy, its index entry lost, found again)
    assert found("mine", True) == 100
    index.wrote("mine-look", 0, behind)
    assert found("mine-look", True, "look") == 100

