"""Processes of one namespace sharing tiers and storing the same keys with different bytes (two sglang
servers of one model: their KV for one prefix need not be bit-identical). A copy whose bytes differ
from what this process's index says, but which is intact against its own header and checksums, is
the other writer's version of the page: it is served (or the indexed copy is) and never deleted; only
a copy that fails its own header or checksums is quarantined. Real processes, real files.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from kvstream_hicache import check_tiers
from kvstream_hicache import index as index_module
from kvstream_hicache import tiers as tiers_module
from kvstream_hicache.integrity import unpack_header
from kvstream_hicache.layout import HEADER_SIZE, file_size
from kvstream_hicache.router import SingleTier
from kvstream_hicache.trust import CLOCK_SKEW_NS

from helpers import (
    CREATED_OFF, PAGE_BYTES, VERSION_OFF, PageSet, flip_byte, make_engine, page_files, set_header_field, spawn,
    loop_fs, store_at_once, tier_stats_once, twin_content, wait_until,
)

WAIT_S = 240
N = 64
SHORT_SKEW_NS = 50_000_000  # a clock skew short enough to wait out in a test (Index.mine_file)


def test_two_processes_storing_one_key_with_other_bytes_delete_nothing(tier_dirs, tier_root):
    """The issue's case: two processes put the same 64 keys at the same moment with different bytes
    (their writes are held until both have written every temporary file, so both puts store every
    key and each rename replaces the other's file on one tier or the other), then each reads every
    key back. Every page is found, with one writer's bytes, and no file is deleted."""
    tiers = tier_dirs[:2]
    go = os.path.join(tier_root, "go")
    outs = [os.path.join(tier_root, f"twin{who}.json") for who in range(2)]
    children = [spawn("twin", os.pathsep.join(tiers), str(who), str(N), outs[who], go) for who in range(2)]
    results = store_at_once(children, outs, go, WAIT_S)
    for who, result in enumerate(results):
        assert result["stored"] == [True] * N, who
        assert result["found"] == [True] * N, f"process {who} missed pages both processes stored"
        assert None not in result["versions"], "a page was served with bytes neither process wrote"
        assert result["quarantined"] == 0, "an intact copy was taken for a damaged one"
        # its own index describes its own bytes; the other's valid files differ: never a problem
        assert {p["kind"] for p in result["problems"]} <= {"index_stale"}, result["problems"]
    # each (key, tier) holds one writer's version, so one process or the other met a foreign copy
    assert sum(r["other_versions"] for r in results) >= N
    for tier in tiers:
        assert len(page_files(tier)) == N, f"page files deleted from {tier}"
    versions = {k: {twin_content(k, 0), twin_content(k, 1)} for k in PageSet(salt="twin").keys(N)}
    pages = PageSet(PAGE_BYTES, salt="twin")
    with make_engine(tiers) as engine:  # a fresh process: every page, each one writer's bytes
        assert engine.prefix_len(list(versions)) == N
        found, got = pages.get(engine, list(versions))
        assert found == [True] * N
        assert all(data in versions[k] for k, data in zip(versions, got))
        assert engine.check() == []
    assert check_tiers(engine.config) == []


def _twins(n=6):
    """Process A's and process B's pages for the same ``n`` keys (B's engine is opened before A stores
    and looks nothing up, so B writes its own version over A's files where they share a tier, as when
    both store at once). Returns (A's pages, B's pages, keys)."""
    a = PageSet(PAGE_BYTES, salt="shared", data=lambda k: twin_content(k, 0))
    b = PageSet(PAGE_BYTES, aligned=False, salt="shared", data=lambda k: twin_content(k, 1))
    return a, b, a.keys(n)


def test_another_writers_version_is_served_in_place_of_the_indexed_one(tier_dirs):
    """Both tiers now hold B's version: A's reads find its indexed copies replaced, each intact against
    its own header; A indexes B's version and serves it in the same call, and deletes nothing."""
    a, b, keys = _twins()
    with make_engine(tier_dirs[:2]) as engine_a, make_engine(tier_dirs[:2], discover=False) as engine_b:
        assert a.put(engine_a, keys) == [True] * 6
        assert b.put(engine_b, keys) == [True] * 6
        assert b.checked_get(engine_a, keys) == [True] * 6  # B's bytes, verified against B's checksums
        stats = engine_a.stats()
        assert sum(t["quarantined"] for t in stats["tiers"]) == 0
        assert sum(t.get("other_versions", 0) for t in stats["tiers"]) == 12
        assert [engine_a.index.holders(k) for k in keys] == [0b11] * 6
        assert engine_a.last_batch["second_chance"] == 1
        assert engine_a.check() == []
    for tier in tier_dirs[:2]:
        assert len(page_files(tier)) == 6


def test_another_writers_version_on_a_shared_tier_is_kept(tier_dirs, tier_root):
    """Two servers with private tier 0s sharing tier 1: B's version replaced A's on the shared tier.
    A serves its own bytes from its private tier and keeps B's file; B serves its own; a third
    process that shares only tier 1 finds B's version there. A's read of tier 1 owed it the pages again,
    and A's catch-up, finding B's file under each name, leaves it alone: A keeps its own copies indexed
    and counted on its private tier (a review found that learning B's newer version, the start-up scan's
    rule, took them out of A's index, there too: never evicted, bytes its capacity did not count)."""
    shared = tier_dirs[2]
    a, b, keys = _twins()
    with make_engine([tier_dirs[0], shared]) as engine_a:
        with make_engine([tier_dirs[1], shared], discover=False) as engine_b:
            assert a.put(engine_a, keys) == [True] * 6
            assert b.put(engine_b, keys) == [True] * 6
            # A reads the shared tier first: B's version there, then its own bytes from its tier 0
            assert a.checked_get(engine_a, keys, policy=SingleTier(1)) == [True] * 6
            assert b.checked_get(engine_b, keys) == [True] * 6
            assert engine_a.stats()["tiers"][1]["quarantined"] == 0  # B's intact file was not taken for damage
            assert engine_a.stats()["tiers"][1]["other_versions"] == 6
            assert [engine_a.index.holders(k) for k in keys] == [0b01] * 6  # B's file: out of A's index
            wait_until(lambda: engine_a.stats()["replication_pending"] == 0, what="A's catch-up never ended")
            assert [engine_a.index.holders(k) for k in keys] == [0b01] * 6
            assert engine_a.index.used[0] == 6 * PAGE_BYTES
            assert engine_a.check() == [] and engine_b.check() == []  # a valid other version is no problem
    assert [len(page_files(d)) for d in (tier_dirs[0], tier_dirs[1], shared)] == [6, 6, 6]
    with make_engine([shared]) as reader:
        assert b.checked_get(reader, keys) == [True] * 6


def test_start_up_keeps_every_version_and_indexes_the_newest(tier_dirs):
    """A restart over tiers holding two versions of a page indexes the newer one (header time) and
    leaves the older file alone: it is valid, and found again when no indexed copy is left."""
    a, b, keys = _twins()
    with make_engine(tier_dirs[:2]) as engine_a, make_engine(tier_dirs[1:2], discover=False) as engine_b:
        assert a.put(engine_a, keys) == [True] * 6
        assert b.put(engine_b, keys) == [True] * 6  # B shares tier 1 only
        # A's index still describes its own bytes on tier 1: check says so, and fixes it as a read
        # would (forgets that copy, keeps the file)
        assert {(p.kind, p.tier) for p in engine_a.check(fix=True)} == {("index_stale", tier_dirs[1])}
        assert engine_a.check() == [] and engine_b.check() == []
    # (no catch-up: after the second-chance read below it would write tier 1's replica back in idle
    # time, racing the look at which tiers hold the pages; its own tests are in test_replication.py)
    with make_engine(tier_dirs[:2], catchup=False) as engine:
        assert engine.wait_scan(30)
        assert [engine.index.holders(k) for k in keys] == [0b10] * 6  # B's, the newer
        assert b.checked_get(engine, keys) == [True] * 6
        assert engine.wait_scan(30)
        assert engine.scan["damaged_removed"] == 0
        assert engine.check() == []  # tier 0's older version: valid, not indexed, no problem
        for k in keys:  # the indexed copies go (evicted by another process): the older version is found
            os.unlink(engine.tiers[1].layout.page_path(k))
        assert a.checked_get(engine, keys) == [True] * 6
        assert engine.last_batch["second_chance"] == 1
        assert [engine.index.holders(k) for k in keys] == [0b01] * 6
        assert engine.check() == []
    assert len(page_files(tier_dirs[0])) == 6


def test_a_copy_that_fails_its_own_checksums_is_still_quarantined(tier_dirs):
    """The other side of the rule: a copy of another writer's version whose payload no longer matches
    its own header is damaged, and goes."""
    a, b, keys = _twins()
    with make_engine(tier_dirs[:2]) as engine_a:
        with make_engine(tier_dirs[1:2], discover=False) as engine_b:
            assert b.put(engine_b, keys[:1]) == [True]
            flip_byte(engine_b.tiers[0].layout.page_path(keys[0]), HEADER_SIZE + 100)
            assert b.get(engine_b, keys[:1])[0] == [False]  # its own damaged copy: removed by B
            assert b.put(engine_b, keys[:1]) == [True]
        assert a.put(engine_a, keys[1:]) == [True] * 5
        assert a.put(engine_a, keys[:1]) == [True]  # discovered: B's version, on tier 1 only
        flip_byte(engine_a.tiers[1].layout.page_path(keys[0]), HEADER_SIZE + 100)
        assert a.get(engine_a, keys[:1])[0] == [False]  # damaged, no other copy: a miss, never B's bytes
        stats = engine_a.stats()["tiers"][1]
        assert stats["quarantined"] == 1 and stats["other_versions"] == 0
        assert not os.path.exists(engine_a.tiers[1].layout.page_path(keys[0]))
        assert engine_a.check() == []


@pytest.mark.leaves_problems("B's pages of format version 2 left on tier 0 on purpose (check names them)")
def test_a_later_formats_page_renamed_over_an_indexed_copy_is_kept_and_never_served(tier_dirs):
    """A node of the next format (B, a rolling upgrade) stores the keys over A's files on the tier they
    share, its pages of format version 2 (other bytes). A's reads fail the indexed checksums there; the
    copy on disk is a later format's page, which A cannot check: not served, not taken for damage (its
    file stays), its copy forgotten, and the page read from A's copy on its other tier. Before, the
    read judged it damaged and removed it (the node that wrote it lost its page)."""
    a, b, keys = _twins(3)
    shared = tier_dirs[0]
    # (no catch-up: it would write A's replica back over B's file in idle time, as any put of the key may)
    with make_engine(tier_dirs[:2], catchup=False) as engine_a, make_engine([shared], discover=False) as engine_b:
        assert a.put(engine_a, keys) == [True] * 3
        assert b.put(engine_b, keys) == [True] * 3  # (B knows nothing of A's: it writes its own over them)
        for k in keys:
            set_header_field(engine_a.tiers[0].layout.page_path(k), VERSION_OFF, 2)
        # it reads the shared tier first: B's page there, then its own bytes from tier 1
        assert a.checked_get(engine_a, keys, policy=SingleTier(0)) == [True] * 3
        stats = engine_a.stats()["tiers"][0]
        assert stats["quarantined"] == 0 and stats["other_versions"] == 3
        assert [engine_a.index.holders(k) for k in keys] == [0b10] * 3
        assert [p.kind for p in engine_a.check(fix=True)] == ["newer_format"] * 3
    assert len(page_files(shared)) == 3
    with make_engine([shared]) as old_node:  # a node of this version with no other copy: a miss, never B's bytes
        assert b.get(old_node, keys)[0] == [False] * 3 and a.get(old_node, keys)[0] == [False] * 3
    assert len(page_files(shared)) == 3


def test_a_later_formats_page_put_under_a_counted_pages_name_with_its_times_kept_is_never_evicted(tier_dirs):
    """A rolling upgrade: a node of the next format has its version of key X (format version 2) put under the
    name on the tier this node shares, with its file's times kept (rsync -a, cp -p, tar: moved or restored
    from where it was written an hour ago). This node counts X (its own put) and evicts it once the tier is
    at its capacity: the file under the name is a later format's page, which an eviction never takes
    (docs/design.md "On-disk format"). Before, the eviction took a file whose mtime was older than this
    start for one found at it (Index.mine_file, no header read) and removed the other version's page."""
    pages = PageSet()
    x, y, z = pages.keys(3)
    with make_engine(tier_dirs[:1], capacity=str(2 * PAGE_BYTES)) as a:
        assert pages.put(a, [x]) == [True] and pages.put(a, [y]) == [True]
        path = a.tiers[0].layout.page_path(x)
        theirs = path + ".next"  # (the next format's copy, renamed over X's name as any writer of a key does)
        with open(path, "rb") as src, open(theirs, "wb") as dst:
            dst.write(src.read())
        set_header_field(theirs, VERSION_OFF, 2)
        an_hour_ago = time.time_ns() - 3600 * 10**9
        os.utime(theirs, ns=(an_hour_ago, an_hour_ago))
        os.rename(theirs, path)
        assert pages.put(a, [z]) == [True]  # X, the least recent, is evicted
        assert not a.contains(x) and a.stats()["tiers"][0]["evictions"] == 1
        assert os.path.exists(path), "the eviction removed a later format's page put under X's name"
        with open(path, "rb") as f:
            assert f.read(HEADER_SIZE)[8:10] == (2).to_bytes(2, "little")
        os.remove(path)  # (a check at close would name it)


def test_a_newer_version_of_another_size_does_not_hide_a_copy_of_the_callers_size(tier_dirs):
    """Promise 2 across deployments of one namespace (LMCache's namespace names no KV dtype: a page of
    another size is another deployment's): tier 0 holds a newer 12 KiB version, tier 1 the caller's 48
    KiB copy. A restart indexes the newer; a get of 48 KiB finds tier 1's copy in its second chance,
    and both files stay (each valid)."""
    mine, theirs = PageSet(size=48 << 10, salt="v"), PageSet(size=12 << 10, salt="v")
    keys = mine.keys(2)
    with make_engine(tier_dirs[:2], replicate="all") as engine:
        assert mine.put(engine, keys) == [True] * 2
    with make_engine(tier_dirs[2:3]) as other:  # the other deployment, its pages then copied onto tier 0
        assert theirs.put(other, keys) == [True] * 2
        for k in keys:
            with open(other.tiers[0].layout.page_path(k), "rb") as src:
                data = src.read()
            with open(os.path.join(tier_dirs[0], os.path.relpath(other.tiers[0].layout.page_path(k), tier_dirs[2])),
                      "wb") as dst:
                dst.write(data)
    with make_engine(tier_dirs[:2], catchup=False) as engine:
        assert engine.wait_scan(30)
        assert [engine.index.get(k).length for k in keys] == [12 << 10] * 2  # the newer version
        assert mine.checked_get(engine, keys) == [True] * 2
        assert engine.last_batch["second_chance"] == 1
        assert theirs.checked_get(engine, keys) == [True] * 2  # and back: each finds its own size
    assert len(page_files(tier_dirs[0])) == len(page_files(tier_dirs[1])) == 2


def test_a_size_mismatch_with_no_copy_of_the_callers_size_discovers_nothing(tier_dirs):
    """'discovered' counts pages found on the tiers that the index lacked: a get of another size than the
    indexed page, for which no tier holds a copy of that size, discovers nothing (it counted one a get)."""
    mine, theirs = PageSet(size=48 << 10, salt="v"), PageSet(size=12 << 10, salt="v")
    keys = mine.keys(2)
    with make_engine(tier_dirs[:2], replicate="all") as engine:
        assert mine.put(engine, keys) == [True] * 2
        for _ in range(3):
            assert theirs.checked_get(engine, keys) == [False] * 2
        stats = engine.stats()
        assert stats["size_mismatch"] == 6 and stats["discovered"] == 0


def test_pages_another_process_wrote_since_a_reader_began_are_read_not_counted_nor_removed(tier_dirs):
    """A reader (it never writes: an MLA rank, LMCache loading only) with a capacity of 4 pages on tier 1
    finds 8 pages another process wrote on both tiers after it began. They are indexed and read, but are
    the writer's bytes, not the reader's: tier 1's used bytes stay 0, nothing is removed, and a page the
    reader lacks there is still copied there by its catch-up (its own bytes, within its capacity). Before,
    they counted: used 8 pages against 4 for good, catch-up "full" for good (nothing copied); and a trim
    to the capacity (stop 49, reverted: docs/data/learncap-49) removed live pages of the writer's."""
    pages = PageSet()
    both, lone = pages.keys(8), pages.keys(2, start=100)
    cap = 4 * PAGE_BYTES
    with make_engine(tier_dirs[:2], capacity=f"{os.pathsep}{cap}") as reader:
        with make_engine(tier_dirs[:2]) as writer:
            assert pages.put(writer, both) == [True] * 8
        with make_engine(tier_dirs[:1]) as writer:  # (two pages on tier 0 alone: the reader lacks them on 1)
            assert pages.put(writer, lone) == [True] * 2
        assert reader.prefix_len(both + lone) == 10
        assert pages.checked_get(reader, both + lone) == [True] * 10  # (read: owes the two to tier 1)
        stats = tier_stats_once(reader, 1, "replication_done", 2)
        assert stats["replication_done"] == 2 and stats["used_bytes"] == reader.index.used[1] == 2 * PAGE_BYTES
        assert reader.index.theirs(1) == 8 and stats["evictions"] == 0
        assert len(page_files(tier_dirs[1])) == 10 and len(page_files(tier_dirs[0])) == 10  # nothing removed
        assert pages.checked_get(reader, both + lone) == [True] * 10
        assert reader.check() == []


@pytest.mark.leaves_problems("B's index lacks the pages A wrote (index_missing: another process's pages, "
                             "never read by B, which discovery finds when asked)")
def test_a_writers_eviction_never_takes_the_pages_another_process_wrote_since_it_began(tier_dirs):
    """Two servers on one directory, each with a capacity of 4 pages. A reads the 4 pages B wrote after A
    began (another process's: not A's bytes), then puts 4 of its own and 2 more: its eviction takes its own
    least recent pages, never B's, which B still holds and reads. Before, B's pages were A's least recent
    and went first: B's next gets missed (SGLang recomputes), with the directory within B's capacity."""
    pages = PageSet()
    theirs, mine = pages.keys(4), pages.keys(6, start=100)
    cap = 4 * PAGE_BYTES
    with make_engine(tier_dirs[:1], capacity=str(cap)) as a, make_engine(tier_dirs[:1], capacity=str(cap)) as b:
        assert pages.put(b, theirs) == [True] * 4
        assert pages.checked_get(a, theirs) == [True] * 4  # discovered: B's
        for k in mine:  # one put each: their write times order them
            assert pages.put(a, [k]) == [True]
        assert a.index.used[0] == cap and a.index.evictions == [2] and a.index.theirs(0) == 4
        assert [a.contains(k) for k in mine] == [False] * 2 + [True] * 4  # A's own oldest went
        assert pages.checked_get(b, theirs) == [True] * 4  # B's pages: all there
        assert len(page_files(tier_dirs[0])) == 8
        assert a.check() == []  # (B's index lacks A's pages: they are A's, never read by B)


@pytest.mark.leaves_problems("A's index lacks the page B wrote after the prefix (index_missing: another process's "
                             "page, never read by A)")
def test_a_writer_spares_the_pages_another_process_marks_used_and_still_keeps_its_capacity(tier_dirs):
    """A writes 4 pages, its capacity; B reads them (another process's copies) and marks the first two used, as
    a write after them as a prefix does (touch_prefix(mark=True)). A's next puts evict its own least recent
    pages but the two marked ones, which go only once they age again in A's LRU; a mark moves the file's
    access time alone (its mtime, a writer's stamp, stays). Before, A evicted the marked pages first."""
    pages = PageSet()
    keys, more = pages.keys(4), pages.keys(4, start=100)
    cap = 4 * PAGE_BYTES
    with make_engine(tier_dirs[:1], capacity=str(cap)) as a, make_engine(tier_dirs[:1], capacity=str(cap)) as b:
        for k in keys:  # one put each: keys[0] is A's least recent
            assert pages.put(a, [k]) == [True]
        assert pages.checked_get(b, keys) == [True] * 4 and b.index.theirs(0) == 4
        path = a.tiers[0].layout.page_path(keys[0])
        mtime = os.stat(path).st_mtime_ns
        b.touch_prefix(keys[:2], mark=True)
        b.touch_prefix(keys[:2], mark=True)  # (marked already, within MARK_EVERY_S: no second metadata write)
        assert b.stats()["tiers"][0]["used_marks"] == 2 and os.stat(path).st_mtime_ns == mtime
        assert pages.put(a, more[:2]) == [True, True]
        assert [a.contains(k) for k in keys] == [True, True, False, False]  # the unmarked ones went
        assert a.stats()["tiers"][0]["evictions_spared"] == 2 and a.index.used[0] == cap
        assert pages.put(a, more[2:]) == [True, True]  # spared once: they aged again, unmarked since
        assert [a.contains(k) for k in keys] == [False] * 4 and a.index.used[0] == cap
        assert len(page_files(tier_dirs[0])) == 4


def test_a_use_mark_follows_no_link_and_an_ordinary_read_is_no_mark(tier_dirs, tier_root):
    """mark_used sets a page file's access time alone, to a time marked_at tells from an ordinary read's
    (relatime: the scan's, a check's read would else spare every page once); at a link under a page's name it
    marks the link, never the file it points to."""
    pages = PageSet()
    key, linked = pages.keys(2)
    with make_engine(tier_dirs[:1]) as a:
        assert pages.put(a, [key, linked]) == [True, True]
        tier = a.tiers[0]
        assert pages.checked_get(a, [key]) == [True]
        st = os.stat(tier.layout.page_path(key))  # an ordinary access time (a read's, relatime), not ending its
        os.utime(tier.layout.page_path(key), ns=(st.st_mtime_ns // 10**6 * 10**6 + 10**9 + 123_000, st.st_mtime_ns))
        assert tier.marked_at(key) is None  # millisecond at microsecond 999 (a read's does, 1 in 1000: set here)
        assert tier.mark_used(key) and tier.marked_at(key) is not None
        outside = os.path.join(tier_root, "outside")
        with open(outside, "w"):
            pass
        os.utime(outside, ns=(10**18, 10**18))
        path = tier.layout.page_path(linked)
        os.unlink(path)
        os.symlink(outside, path)
        tier.mark_used(linked)
        assert tier.marked_at(linked) is None and os.stat(outside).st_atime_ns == 10**18
        os.unlink(path)
        assert not tier.mark_used(linked) and tier.marked_at(linked) is None  # (gone: nothing to mark)
        a.delete([linked])


@pytest.mark.leaves_problems("B's index lists the page A evicted and lacks A's new one (another process's eviction "
                             "and page: index_stale, index_missing)")
def test_a_writer_whose_every_victim_is_marked_still_makes_its_room(tier_dirs):
    """Another process (or user) that marks every page used cannot hold eviction up: a write looks at
    SPARE_LOOKS victims at most, then evicts as before, and the tier stays within its capacity."""
    from kvstream_hicache.jobs import SPARE_LOOKS

    pages = PageSet()
    n = SPARE_LOOKS + 4
    keys = pages.keys(n)
    cap = n * PAGE_BYTES
    with make_engine(tier_dirs[:1], capacity=str(cap)) as a, make_engine(tier_dirs[:1]) as b:
        assert pages.put(a, keys) == [True] * n
        assert pages.checked_get(b, keys) == [True] * n
        b.touch_prefix(keys, mark=True)
        assert pages.put(a, pages.keys(1, start=1000)) == [True]
        assert a.stats()["tiers"][0]["evictions_spared"] == SPARE_LOOKS
        assert a.index.used[0] == cap and len(page_files(tier_dirs[0])) == n


@pytest.mark.leaves_problems("each index lacks the pages the other wrote, A's lists the head B evicted (another "
                             "process's pages and eviction: index_missing, index_stale)")
def test_pages_both_processes_found_at_start_are_marked_and_spared_but_never_by_a_process_s_own_mark(tier_dirs):
    """The pages of an earlier run (a server restarted, DP ranks started together on a tier that holds pages):
    A and B both find them at start and count them (their own copies, not THEIRS). B writes after the head
    as a prefix: it marks the head (it may be another live process's page: found, not written by B, on a tier
    where B has met a page another process wrote since it began), and A's eviction spares it; B's own eviction is not held up by B's own marks (its mark is its use). Review of
    05fc333: only THEIRS copies were marked, so A evicted the head B used, as docs/guarantees.md says it no
    longer does ("unless that process marked it used")."""
    pages = PageSet()
    head, more, peer = pages.keys(4), pages.keys(8, start=100), pages.keys(1, start=300)
    cap = 8 * PAGE_BYTES
    with make_engine(tier_dirs[:1]) as earlier:
        assert pages.put(earlier, head) == [True] * 4
    with make_engine(tier_dirs[:1]) as alone:  # a server restarted over its pages, alone on its tier: it marks
        alone.touch_prefix(head, mark=True)  # nothing (a metadata write a page and second, for no one)
        assert alone.stats()["tiers"][0]["used_marks"] == 0
    with make_engine(tier_dirs[:1], capacity=str(cap)) as a, make_engine(tier_dirs[:1], capacity=str(cap)) as b:
        assert a.index.theirs(0) == b.index.theirs(0) == 0 and a.index.used[0] == b.index.used[0] == 4 * PAGE_BYTES
        assert pages.checked_get(b, head) == [True] * 4
        assert pages.put(a, more[:3] + peer) == [True] * 4  # (A's capacity: the head is its least recent)
        assert pages.checked_get(b, peer) == [True] and b.index.theirs(0) == 1  # (B meets a page of A's: a peer)
        b.touch_prefix(head, mark=True)
        assert pages.put(a, more[4:6]) == [True] * 2  # 2 pages go, not the head B marked
        assert [a.contains(k) for k in head] == [True] * 4 and a.stats()["tiers"][0]["evictions_spared"] == 4
        assert b.stats()["tiers"][0]["used_marks"] == 4
        assert pages.put(b, more[6:]) == [True] * 2  # (B holds 6 pages: the head, touched, the least recent)
        assert pages.put(b, pages.keys(4, start=200)) == [True] * 4  # B over its capacity: 2 of the head go
        assert b.stats()["tiers"][0]["evictions_spared"] == 0 and sum(b.contains(k) for k in head) == 2


@pytest.mark.leaves_problems("B's index lacks the pages A wrote after the head (another process's pages, never "
                             "read by B: index_missing)")
def test_a_writer_on_a_full_file_system_spares_the_pages_another_process_marks_used(loop_fs):
    """A tier with no capacity set (the default) evicts when its file system says ENOSPC (Jobs._evict_under_writer),
    not at reserve: that eviction spares a page another process marked used since A's last use as reserve's does.
    Review of 05fc333: only reserve's looked at the marks, so with the default capacity A evicted B's head first."""
    fs = loop_fs(64 << 20, "spare")
    pages = PageSet(1 << 20)
    fit = os.statvfs(fs.mnt).f_bavail * os.statvfs(fs.mnt).f_frsize // file_size(1 << 20)
    head, rest = pages.keys(4), pages.keys(fit + 4, start=100)
    with make_engine([fs.mnt]) as a, make_engine([fs.mnt]) as b:
        assert pages.put(a, head) == [True] * 4
        assert pages.checked_get(b, head) == [True] * 4 and b.index.theirs(0) == 4
        b.touch_prefix(head, mark=True)
        for k in rest:
            assert pages.put(a, [k]) == [True]
        row = a.stats()["tiers"][0]
        assert row["evictions"] > 4 and row["evictions_spared"] == 4, row
        assert [a.contains(k) for k in head] == [True] * 4


@pytest.mark.leaves_problems("the reader's index lists the page the writer evicted (index_stale: another "
                             "process's eviction, harmless, docs/guarantees.md)")
def test_a_reader_never_removes_a_page_the_writer_holds(tier_dirs):
    """A writer and a reader (MLA ranks, two servers) with the same capacity, 4 pages, on one tier. The
    reader reads the writer's 4 pages; the writer reads its first page again (its most recent) and puts a
    fifth, evicting its least recent page. The directory holds 4 pages, its capacity; the reader finds the
    fifth. Its index still lists the page the writer evicted: were those pages the reader's bytes, its view
    would be over its capacity and a trim would remove a live page of the writer's (stop 49's reverted
    trim did: the writer's get of its most recent page missed; review trim2)."""
    pages = PageSet()
    keys = pages.keys(5)
    cap = 4 * PAGE_BYTES
    with make_engine(tier_dirs[:1], capacity=str(cap)) as reader, \
            make_engine(tier_dirs[:1], capacity=str(cap)) as writer:
        assert pages.put(writer, keys[:4]) == [True] * 4
        assert pages.checked_get(reader, keys[:4]) == [True] * 4  # discovered, read
        assert pages.checked_get(writer, keys[:1]) == [True]  # the writer's most recent page
        assert pages.put(writer, keys[4:]) == [True]  # evicts keys[3], the writer's least recent (the batch's tail)
        assert reader.prefix_len(keys[4:]) == 1
        assert reader.index.used[0] == 0 and reader.stats()["tiers"][0]["evictions"] == 0
        assert len(page_files(tier_dirs[0])) == 4
        assert pages.checked_get(writer, [*keys[:3], keys[4]]) == [True] * 4


@pytest.mark.leaves_problems("A2's index lacks the pages B wrote (index_missing: another process's pages, never "
                             "read by A2)")
def test_a_catchup_copy_another_process_made_since_a_writer_began_is_never_its_victim(tier_dirs):
    """A page written before B began (A1, on tier 0 only) is copied to B's tier by A2's catch-up after B
    began: the copy is A2's bytes (A2 counts it), its file written since B began, though its header keeps
    the page's first write time. B reads it, then fills its capacity of 4 pages with its own: the copy is
    not B's to count or evict. Before (review theirs2), its old header made it B's (SCANNED, counted) and
    B's first victim: B deleted A2's live replica, the directory below B's capacity."""
    pages = PageSet()
    old, mine = pages.keys(1), pages.keys(4, start=100)
    cap = 4 * PAGE_BYTES
    with make_engine(tier_dirs[:1]) as a1:
        assert pages.put(a1, old) == [True]
    with make_engine(tier_dirs[1:2], capacity=str(cap)) as b:
        with make_engine(tier_dirs[:2]) as a2:  # began after B: its catch-up copies the page to B's tier
            stats = tier_stats_once(a2, 1, "replication_done", 1)
            assert stats["replication_done"] == 1 and a2.index.get(old[0]).tiers == 0b11
            assert pages.checked_get(b, old) == [True]  # B discovers A2's copy
            for k in mine:  # B fills its capacity with its own pages
                assert pages.put(b, [k]) == [True]
            assert (b.stats()["tiers"][0]["evictions"], len(page_files(tier_dirs[1]))) == (0, 5)
            assert (b.index.used[0], b.index.theirs(0)) == (cap, 1)
            assert a2.index.used[1] == PAGE_BYTES


def test_a_lookup_racing_this_process_s_put_leaves_its_page_counted_and_evicted(tier_dirs):
    """This engine's put renames its page into place; a lookup of that key at that moment (another caller's
    exists, get or put of it: SGLang's prefetch of a prefix being backed up, LMCache's lookup of a chunk
    being stored) reads the file before the put indexes it, and indexes it after. The file is this
    engine's: counted, and evicted to keep its capacity (2 pages). Before, the lookup moved it to the
    pages another process wrote (not counted, never evicted): 3 pages stayed on the tier, the
    raced one for good. The order is forced (the index calls are the real ones)."""
    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(tier_dirs[:1], capacity=str(2 * PAGE_BYTES)) as engine:
        index, real = engine.index, engine.index.commit
        reached, release = threading.Event(), threading.Event()
        lookup = threading.Thread(target=engine.contains, args=(keys[0],))

        def commit(key, *args, **kw):
            if key == keys[0] and kw.get("mark") is None and not lookup.is_alive() and not release.is_set():
                lookup.start()  # the put's commit: the lookup reads the file first
                assert reached.wait(30), "the lookup never came to index the file"
                try:
                    return real(key, *args, **kw)
                finally:
                    release.set()
            if key == keys[0] and kw.get("mark") is not None and not reached.is_set():  # the lookup's
                reached.set()
                assert release.wait(30)
            return real(key, *args, **kw)

        index.commit = commit
        try:
            assert pages.put(engine, keys[:1]) == [True]
            lookup.join(30)
        finally:
            del index.commit
        assert reached.is_set() and not lookup.is_alive()
        for k in keys[1:]:  # one put each: the tier keeps the 2 most recent
            assert pages.put(engine, [k]) == [True]
        assert (len(page_files(tier_dirs[0])), index.theirs(0)) == (2, 0)
        assert [engine.contains(k) for k in keys] == [False] * 2 + [True] * 2


@pytest.mark.leaves_problems("B's index lacks the pages A wrote (index_missing: another process's pages, "
                             "never read by B)")
def test_a_page_another_process_wrote_under_a_key_this_one_evicted_is_never_its_victim(tier_dirs):
    """Two servers on one directory (one model: a shared prefix gives both the same keys). A (capacity 2
    pages) puts X, then Y and Z: its eviction removes X's file. B puts X since (B's bytes, B's live page). A
    reads X (discovery): another process's page written since A began, not A's to count or evict
    (docs/guarantees.md "Capacity is per process"). Before (review mine), A's filter of what it wrote
    (Index.wrote, on (key, tier) alone) said X there "may be mine" (it was, once): X was counted, and A's
    next puts evicted it: B's get of X missed."""
    pages = PageSet()
    x, y, z, w, v = pages.keys(5)
    cap = 2 * PAGE_BYTES
    with make_engine(tier_dirs[:1], capacity=str(cap)) as a, make_engine(tier_dirs[:1]) as b:
        for k in (x, y, z):  # one put each: X is A's least recent, evicted by Z's
            assert pages.put(a, [k]) == [True]
        assert not a.contains(x) and len(page_files(tier_dirs[0])) == 2
        assert pages.put(b, [x]) == [True]  # B's own page now
        assert pages.checked_get(a, [x]) == [True]  # A discovers and reads B's page
        assert a.index.theirs(0) == 1, "B's page, written since A began, counted as A's"
        for k in (w, v):
            assert pages.put(a, [k]) == [True]
        assert pages.checked_get(b, [x]) == [True], "A evicted B's live page"
        assert os.path.exists(b.tiers[0].layout.page_path(x))


def test_another_process_s_catch_up_copy_under_a_key_this_one_evicted_is_never_its_victim(tier_dirs):
    """A (tier d0, capacity 2 pages) and B (tiers d1, d0: d0 shared with A). A puts X. B starts, its scan finds
    X on d0 and its catch-up copies it to d1 (keeping X's header ``created``, A's). A's eviction removes its X
    on d0. B's read of X there misses and B's catch-up copies X back to d0 from d1: B's live page, B's bytes,
    written after A began, its header's ``created`` still A's put's. A reads X (discovery): it must be another
    process's copy (THEIRS: docs/design.md "a page another process wrote since under a key this one evicted
    there ... stays THEIRS"), and A's next evictions must leave B's file in place. Before (review simp, stop
    51), Index.wrote's filter, keyed by (key, tier, created), took the copy, which carries A's ``created``, for
    A's: counted by A and A's victim. A copy's header carries its own stamp now (PageHeader.copied_ns)."""
    pages = PageSet()
    x, y, z, w, v = pages.keys(5)
    d0, d1 = tier_dirs[:2]
    with make_engine([d0], capacity=str(2 * PAGE_BYTES)) as a:
        assert pages.put(a, [x]) == [True]
        with make_engine([d1, d0]) as b:  # (X found by B's scan: its sweep copies it to d1, created kept)
            wait_until(lambda: b.index.holders(x) == 0b11, what="B's catch-up never copied X to d1")
            for k in (y, z):  # A's eviction removes its own X on d0
                assert pages.put(a, [k]) == [True]
            path = a.tiers[0].layout.page_path(x)
            assert not a.contains(x) and not os.path.exists(path)
            pages.get(b, [x], SingleTier(1))  # B misses on d0 (reads d1): owes d0 a copy
            wait_until(lambda: b.index.holders(x) == 0b11 and os.path.exists(path),
                       what="B's catch-up never copied X back to d0")
            b_file = os.stat(path)
            assert pages.checked_get(a, [x]) == [True]  # A discovers B's copy
            theirs, used = a.index.theirs(0), a.index.used[0]
            for k in (w, v):
                assert pages.put(a, [k]) == [True]
            survived = os.path.exists(path) and os.stat(path).st_ino == b_file.st_ino
            b.delete([x])  # (both indexes consistent at close, whatever happened)
            assert pages.get(a, [x])[0] == [False]
            for k in (y, z, w, v):  # (each index learns the other's pages on d0)
                a.contains(k), b.contains(k)
            assert (theirs, used) == (1, 2 * PAGE_BYTES), "B's catch-up copy, written since A began, counted as A's"
            assert survived, "A's eviction removed B's live copy"


def test_this_process_s_own_catch_up_copies_stay_counted_when_found_again_and_after_a_restart(tier_dirs):
    """The other side of the copy's stamp (review copied, stop 51): this process's own catch-up copies carry
    its own stamp (PageHeader.copied_ns, in its filter: Index.wrote), so one whose index entry was lost and
    is found again (catch-up's look after a read, check --fix) stays counted here, and after a restart the
    scan counts the earlier run's copies and evicts them with their files."""
    pages = PageSet()
    x, y, z, w = pages.keys(4)
    d0, d1 = tier_dirs[:2]

    def header(path):
        with open(path, "rb") as f:
            return unpack_header(f.read(HEADER_SIZE))

    with make_engine([d1]) as p:
        assert pages.put(p, [x, y]) == [True, True]
    cap = os.pathsep.join(["", str(2 * PAGE_BYTES)])
    with make_engine([d1, d0], capacity=cap) as a:
        wait_until(lambda: all(a.index.holders(k) == 0b11 for k in (x, y)), what="no catch-up copy")
        assert all(header(f).copied_ns for f in page_files(d0))
        a.index.remove(x, 1)  # (a copy whose index entry was lost)
        assert pages.checked_get(a, [x]) == [True]  # (read from d1: owes d0 the page; catch-up finds the file)
        wait_until(lambda: a.index.holders(x) == 0b11, what="catch-up never learned its own copy back")
        assert (a.index.used[1], a.index.theirs(1)) == (2 * PAGE_BYTES, 0), "own copy taken for another's"
        a.index.remove(y, 1)
        assert a.contains(y)  # (held on d1: no lookup)
        assert a.check(fix=True) is not None
        assert (a.index.used[1], a.index.theirs(1)) == (2 * PAGE_BYTES, 0), "own copy, check --fix: another's"
    with make_engine([d1, d0], capacity=cap) as a2:
        assert (a2.index.used[1], a2.index.theirs(1)) == (2 * PAGE_BYTES, 0)
        assert pages.put(a2, [z, w]) == [True, True]
        assert len(page_files(d0)) <= 2, "an earlier run's copies not evicted with their files"
        assert a2.index.theirs(1) == 0


def test_a_page_another_process_stored_again_after_removing_this_ones_is_never_its_victim(tier_dirs):
    """Two servers on one directory. A (capacity 2 pages) puts X; B, begun after (its scan counts X), deletes X
    and puts it again: B's live page under the name, the same bytes (one model, one prefix). A's index still
    lists X as its own copy; A's next puts evict X there: the file under X's name is B's, and stays (its
    header's ``created`` is not one A wrote, its file was written since A began: Index.mine). A forgets X and
    finds B's page when it reads X again (another's: not counted). Before (review dfs, stop 49), A's eviction
    removed the file: B's get of X missed."""
    pages = PageSet()
    x, y, z = pages.keys(3)
    cap = 2 * PAGE_BYTES
    with make_engine(tier_dirs[:1], capacity=str(cap)) as a:
        assert pages.put(a, [x]) == [True]
        with make_engine(tier_dirs[:1]) as b:
            assert b.index.holders(x) == 1  # (found at B's start: B's to count, evict or delete)
            b.delete([x])
            assert pages.put(b, [x]) == [True]  # B's page now
            path = b.tiers[0].layout.page_path(x)
            b_file = os.stat(path)
            for k in (y, z):  # Z's room: A's least recent, X, is evicted
                assert pages.put(a, [k]) == [True]
            assert a.stats()["tiers"][0]["evictions"] == 1 and not a.index.holders(x)
            assert pages.checked_get(b, [x]) == [True], "A's eviction removed B's live page"
            assert os.stat(path).st_ino == b_file.st_ino
            assert pages.checked_get(a, [x]) == [True]  # A finds B's page: read, not counted
            assert (a.index.used[0], a.index.theirs(0)) == (cap, 1)
            assert b.contains(y) and b.contains(z)  # (B indexes A's pages: its check at close is clean)


def test_an_earlier_runs_page_stamped_ahead_beyond_the_skew_is_evicted_with_its_file(tier_dirs):
    """An earlier run's pages whose header ``created`` was stamped by a clock then ahead by over the 300 s of
    honest skew (a node booted before NTP stepped it back): the start-up scan takes the claim for no time
    and counts them (written before this run). Once the clock reaches the claim, this run's eviction of
    them must remove their files, as it counts them: else the tier holds more than its capacity."""
    pages = PageSet()
    old, new = pages.keys(2), pages.keys(2, start=2)
    with make_engine(tier_dirs[:1]) as a:
        assert pages.put(a, old) == [True, True]
    ahead = time.time_ns() + CLOCK_SKEW_NS + 2 * 10**9  # 2 s past the skew: no time at B's start
    for path in page_files(tier_dirs[0]):
        set_header_field(path, CREATED_OFF, ahead, 8)
    with make_engine(tier_dirs[:1], capacity=str(2 * PAGE_BYTES)) as b:
        assert [b.index.holders(k) for k in old] == [1, 1] and b.index.theirs(0) == 0  # counted: b's
        while time.time_ns() + CLOCK_SKEW_NS <= ahead:  # (the claim becomes a time: the clock caught up)
            time.sleep(0.1)
        assert pages.put(b, new) == [True, True]  # room made by evicting the two old pages
        assert b.stats()["tiers"][0]["evictions"] == 2
        assert not any(b.index.holders(k) for k in old)
        left = page_files(tier_dirs[0])
        assert len(left) == 2, f"{len(left)} page files on a tier of 2 pages' capacity: evicted pages' files stay"


def test_an_eviction_knows_this_process_s_own_files_by_their_stat(tier_dirs, monkeypatch):
    """An eviction of pages this process committed on a local tier, or found there at its start, reads no
    header: their stat tells them (Index.mine_file: the inode and mtime it sealed, or a file older than its
    start). The header read, a disk read for a file written O_DIRECT, cost a fifth more CPU per page put at
    full eviction churn on this machine's disk (docs/benchmarks.md). A file another process wrote under the
    name since is still judged by its header, and stays."""
    reads: list[int] = []
    real = tiers_module.unpack_header
    monkeypatch.setattr(tiers_module, "unpack_header", lambda data: (reads.append(1), real(data))[1])
    pages = PageSet()
    old, new, x = pages.keys(2), pages.keys(4, start=2), pages.keys(1, start=9)
    with make_engine(tier_dirs[:1]) as a:
        assert pages.put(a, old) == [True, True]
    # An earlier run's: written and put under its name before this start by more than the skew (Index.mine_file
    # takes the later of the mtime and the ctime, which no utime sets back: the skew shortened, then waited out).
    monkeypatch.setattr(index_module, "CLOCK_SKEW_NS", SHORT_SKEW_NS)
    changed = max(max(st.st_mtime_ns, st.st_ctime_ns) for st in map(os.stat, page_files(tier_dirs[0])))
    while time.time_ns() <= changed + 2 * SHORT_SKEW_NS:
        time.sleep(0.01)
    with make_engine(tier_dirs[:1], capacity=str(2 * PAGE_BYTES)) as a:
        for k in new:  # evicts the two found at start, then the first two it wrote
            assert pages.put(a, [k]) == [True]
        assert a.stats()["tiers"][0]["evictions"] == 4 and len(page_files(tier_dirs[0])) == 2
        assert reads == [], "an eviction of this process's own files read their headers"
        with make_engine(tier_dirs[:1]) as b:
            b.delete(new[2:3])  # B replaces A's page with its own (the same bytes)
            assert pages.put(b, new[2:3]) == [True]
            assert pages.put(a, x) == [True]  # A evicts new[2]: B's file, judged by its header
            assert reads == [1] and pages.checked_get(b, new[2:3]) == [True]
            assert b.contains(new[3]) and b.contains(x[0])  # (each indexes the other's pages: their checks
            assert a.contains(new[2]) and a.index.theirs(0) == 1  # at close are clean)


def _at_a_second_s_start(after: float = 0.0) -> None:
    """Wait for a wall-clock second to begin (later than ``after``): what follows runs within it."""
    while int(time.time()) <= after or time.time() % 1 > 0.2:
        time.sleep(0.02)


def test_an_eviction_leaves_another_process_s_page_on_this_one_s_reused_inode_within_its_second(loop_fs):
    """Two servers share a local tier on a file system keeping whole seconds (ext4 with 128-byte inodes, an
    ext3-era one). B deletes a page A wrote and puts its own under the name: ext4 hands B's file the inode
    A's freed, and its mtime is A's second. A's eviction of its copy must leave B's live page (review stat:
    its (inode, mtime) matched what A's commit sealed, and B's page was deleted)."""
    fs = loop_fs(inode_size=128)
    tier = os.path.join(fs.mnt, "tier0")
    os.makedirs(tier)
    pages = PageSet()
    k, y = pages.keys(2)
    with make_engine([tier], capacity=str(PAGE_BYTES)) as a, make_engine([tier]) as b:
        _at_a_second_s_start(after=time.time())  # (a second after A began: its start is not what judges)
        assert pages.put(a, [k]) == [True]
        path = a.tiers[0].layout.page_path(k)
        mine = os.stat(path)
        b.delete([k])
        assert pages.put(b, [k]) == [True]
        theirs = os.stat(path)
        assert (theirs.st_ino, theirs.st_mtime_ns) == (mine.st_ino, mine.st_mtime_ns)  # the case: one stat
        assert pages.put(a, [y]) == [True]  # A evicts k
        assert pages.checked_get(b, [k]) == [True], "A's eviction deleted B's page: its stat passed for A's"
        assert b.contains(y) and a.contains(k)  # (each indexes the other's pages: their checks at close are clean)


def test_an_eviction_leaves_another_process_s_page_written_in_the_second_this_one_began(loop_fs):
    """On a file system keeping whole seconds, a page B writes in the second A began has an mtime before A's
    start: it is not an earlier run's (found at A's start), and A's eviction of its own copy of the key, which
    B replaced, must leave it (review stat: A took it for one older than its start and deleted it)."""
    fs = loop_fs(inode_size=128)
    tier = os.path.join(fs.mnt, "tier0")
    os.makedirs(tier)
    pages = PageSet()
    k, x, y = pages.keys(3)
    with make_engine([tier]) as b:
        _at_a_second_s_start()
        with make_engine([tier], capacity=str(PAGE_BYTES)) as a:
            assert pages.put(a, [k]) == [True]
            path = a.tiers[0].layout.page_path(k)
            mine = os.stat(path)
            b.delete([k])
            assert pages.put(b, [x, k]) == [True, True]  # (x takes the inode A's copy freed)
            theirs = os.stat(path)
            assert theirs.st_ino != mine.st_ino and theirs.st_mtime_ns < a.index.started_ns  # the case
            assert pages.put(a, [y]) == [True]  # A evicts k
            assert pages.checked_get(b, [k]) == [True], "A's eviction deleted B's page, written since it began"
            assert b.contains(y) and a.contains(k) and a.contains(x)


def test_an_eviction_tells_another_process_s_page_on_a_reused_inode_in_the_same_clock_tick(tier_dirs):
    """ext4 hands the inode A's deleted page freed to the next file at once; B's page put under the name
    within the kernel's clock tick (4 ms) of A's last write has A's inode and mtime too (the tick forced here
    with utime: the coincidence a busy host meets). The inode's generation, new at each reuse, tells them
    apart (trust.sealed_identity): A's eviction reads the header and leaves B's live page. On (inode, mtime)
    alone it was deleted (review stat's suspicion)."""
    pages = PageSet()
    k, y = pages.keys(2)
    with make_engine(tier_dirs[:1], capacity=str(PAGE_BYTES)) as a, make_engine(tier_dirs[:1]) as b:
        assert pages.put(a, [k]) == [True]
        path = a.tiers[0].layout.page_path(k)
        mine = os.stat(path)
        b.delete([k])
        assert pages.put(b, [k]) == [True]
        os.utime(path, ns=(mine.st_atime_ns, mine.st_mtime_ns))  # (B's last write in A's tick)
        theirs = os.stat(path)
        assert (theirs.st_ino, theirs.st_mtime_ns) == (mine.st_ino, mine.st_mtime_ns)  # ext4: the inode reused
        assert pages.put(a, [y]) == [True]  # A evicts k
        assert pages.checked_get(b, [k]) == [True], "A's eviction deleted B's page on A's reused inode"
        assert b.contains(y) and a.contains(k)  # (each indexes the other's pages: their checks at close are clean)


def test_a_get_discovering_another_process_s_pages_keeps_them_when_the_tier_grew_since_the_start(tier_dirs,
                                                                                                   monkeypatch):
    """Another process's copies a reader indexes on a tier add up to at most its file system's size, asked at
    start-up (Index.theirs_limits). A file system grown since (an online resize, a tmpfs remount) held the
    bound of before: one get of 30 live pages, 30 MiB on a tier of 16 MiB then, discovered them all and forgot
    the first 14 as it indexed the rest (theirs_forgotten 14), and missed them; check() found them on disk,
    never indexed (review rev2). The size is asked again before anything is forgotten. (The file system's
    size is os.statvfs's, made 16 MiB while the reader starts: growing a real one needs root.)"""
    statvfs, small = os.statvfs, [True]

    def sized(path, *args):
        st = statvfs(path, *args)
        if not small[0] or not os.path.realpath(path).startswith(os.path.realpath(tier_dirs[0])):
            return st
        fields = list(st)
        fields[2] = (16 << 20) // st.f_frsize  # f_blocks
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", sized)
    pages = PageSet(1 << 20)
    keys = pages.keys(30)
    with make_engine(tier_dirs[:1]) as reader:
        assert reader.index.theirs_limits == [16 << 20]
        small[0] = False  # the file system grows
        with make_engine(tier_dirs[:1]) as writer:
            assert pages.put(writer, keys) == [True] * 30
            assert pages.checked_get(reader, keys) == [True] * 30
            row = reader.stats()["tiers"][0]
            assert (row["theirs_pages"], row["theirs_forgotten"]) == (30, 0), row
