"""Review dfs: capacity accounting (index THEIRS) on a real GlusterFS, node A this process, node B a
child process on the other mount (tests/node.py), as in test_reliability_dfs.py."""
from __future__ import annotations

import os
import shutil
import uuid

import pytest

from helpers import PAGE_BYTES, Node, PageSet, make_engine, page_files, wait_until


@pytest.fixture
def dfs(glusterfs, tier_root):
    share = f"share-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(glusterfs.mount("a"), share))
    a = [os.path.join(tier_root, "a0"), os.path.join(glusterfs.mount("a"), share)]
    b = [os.path.join(tier_root, "b0"), os.path.join(glusterfs.mount("b"), share)]
    for d in (a[0], b[0]):
        os.makedirs(d)
    node = Node()
    try:
        yield glusterfs, a, b, node
    finally:
        node.stop()
        shutil.rmtree(os.path.join(glusterfs.mount("a"), share), ignore_errors=True)


TWO_AND_A_HALF = str(PAGE_BYTES * 5 // 2)  # room for two pages on the shared tier, not three


def _names(share: str) -> set[str]:
    return {os.path.basename(p) for p in page_files(share)}


def test_a_page_another_node_stored_again_after_removing_ours_is_never_our_victim(dfs):
    """A stores K on the shared tier; B (opened after: its scan finds K) deletes K and stores K again,
    its own page written after A began. A's index still lists K as its own copy; A, full, evicts K:
    B's live page (guarantees.md 7: "a page another process wrote since a process began is never
    evicted by it")."""
    fs, a, b, node = dfs
    pages = PageSet()
    k0, k1, k2 = pages.keys(3)
    with make_engine(a, replicate="all", capacity=os.pathsep.join(["", TWO_AND_A_HALF])) as engine:
        assert pages.put(engine, [k0]) == [True]
        wait_until(lambda: engine.index.holders(k0) & 0b10, what="A's page never reached the shared tier")
        assert node("open", b, {"replicate": "all"})["pages"] == 1
        assert node("delete", "p", 0, 1)["held"] == 1
        assert node("put", "p", 0, 1, 0)["stored"] == [True]  # B's page now, the same bytes
        wait_until(lambda: len(page_files(a[1])) == 1, what="B's page never reached the shared tier")
        b_file = _names(a[1])
        assert pages.put(engine, [k1, k2]) == [True, True]
        wait_until(lambda: all(engine.index.holders(k) & 0b10 for k in (k1, k2)), what="A's puts never landed")
        assert b_file <= _names(a[1]), "A evicted the page node B stored after A began (B's live page)"


def test_a_restart_counts_and_trims_the_tier_as_found(dfs):
    """A (an earlier process) and B each left two pages on the shared tier; A starts again with room
    for two: the start-up scan counts the four and trims to two (guarantees.md "Capacity is per
    process")."""
    fs, a, b, node = dfs
    mine = PageSet(salt="a-old")
    with make_engine(a, replicate="all") as engine:
        assert mine.put(engine, mine.keys(2)) == [True, True]
        wait_until(lambda: all(engine.index.holders(k) & 0b10 for k in mine.keys(2)))
    node("open", b, {"replicate": "all"})
    assert node("put", "b-pages", 0, 2, 0)["stored"] == [True, True]
    wait_until(lambda: len(page_files(a[1])) == 4, what="B's pages never reached the shared tier")
    node("close")
    with make_engine(a, replicate="all", capacity=os.pathsep.join(["", TWO_AND_A_HALF])) as engine:
        row = engine.stats()["tiers"][1]
        assert row["theirs_pages"] == 0, row
        assert row["used_bytes"] <= row["capacity_bytes"], row
        assert len(page_files(a[1])) == 2


def test_local_a_page_another_process_stored_again_after_removing_ours_is_never_our_victim(tier_root):
    """The first test's steps with B a second process on the same local directories (two servers of
    one model on one host's shared tier)."""
    a = [os.path.join(tier_root, "a0"), os.path.join(tier_root, "shared")]
    b = [os.path.join(tier_root, "b0"), a[1]]
    for d in (*a, b[0]):
        os.makedirs(d)
    node = Node()
    try:
        pages = PageSet()
        k0, k1, k2 = pages.keys(3)
        with make_engine(a, replicate="all", capacity=os.pathsep.join(["", TWO_AND_A_HALF])) as engine:
            assert pages.put(engine, [k0]) == [True]
            wait_until(lambda: engine.index.holders(k0) & 0b10, what="A's page never reached the shared tier")
            assert node("open", b, {"replicate": "all"})["pages"] == 1
            assert node("delete", "p", 0, 1)["held"] == 1
            assert node("put", "p", 0, 1, 0)["stored"] == [True]  # B's page now, the same bytes
            wait_until(lambda: len(page_files(a[1])) == 1, what="B's page never reached the shared tier")
            b_file = _names(a[1])
            assert pages.put(engine, [k1, k2]) == [True, True]
            wait_until(lambda: all(engine.index.holders(k) & 0b10 for k in (k1, k2)), what="A's puts never landed")
            assert b_file <= _names(a[1]), "A evicted the page process B stored after A began (B's live page)"
    finally:
        node.stop()
