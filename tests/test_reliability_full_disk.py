"""A full disk, for real: tier 0 is a small ext4 file system on a loop device with no capacity
configured, so the engine learns it is full only from ENOSPC (out of blocks, or of inodes). It
evicts least-recently-used pages and keeps accepting writes; when eviction cannot make room (every
page pinned by reads in flight, or one page larger than the file system) the write fails cleanly for
that tier only: the page is stored on the other tier, counted under-replicated, no leftover, no page
evicted for nothing, the tier stays healthy (full is not failed).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
import time

import pytest

from kvstream_hicache.errors import KVStreamError
from kvstream_hicache.faults import Fault
from kvstream_hicache.io import OP_READ
from kvstream_hicache.layout import HEADER_SIZE, file_size
from kvstream_hicache.router import SingleTier

from helpers import FakeClock, PageSet, TierFaultPlan, content, loop_fs, make_engine, page_files, put_items, \
    owner_mapping_tier, tier_stats_once, tmp_files, wait_for_fault, wait_until  # noqa: F401

MIB = 1 << 20
FS_BYTES = 64 * MIB
WAIT_S = 60.0


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: str, leave: int) -> str:
    """Take all but ``leave`` bytes of the file system with a file kvstream does not own (its path)."""
    filler = os.path.join(path, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(_free(path) - leave, 4096))
    finally:
        os.close(fd)
    return filler


def _fill_all(path: str) -> None:
    """Take every block left with a file kvstream does not own, a MiB then a block at a time until ENOSPC (one
    fallocate of what statvfs says is free can fail: the file's extent tree takes blocks too, in free space that
    evictions left fragmented)."""
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        end = 0
        for step in (MIB, 4096):
            while True:
                try:
                    os.posix_fallocate(fd, end, step)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                end += step
    finally:
        os.close(fd)


def _take_inodes(path: str, leave: int) -> None:
    """Take all but ``leave`` of the file system's free inodes with empty files kvstream does not own."""
    filler = os.path.join(path, "inodes")
    os.mkdir(filler)
    for i in range(os.statvfs(path).f_ffree - leave):
        os.close(os.open(os.path.join(filler, str(i)), os.O_WRONLY | os.O_CREAT, 0o600))


def test_full_tier_evicts_lru_and_keeps_accepting_writes(tier_root, loop_fs):
    fs = loop_fs(FS_BYTES, "full")
    other = os.path.join(tier_root, "disk")
    os.makedirs(other)
    pages = PageSet(MIB)
    batches = [pages.keys(10, 10 * b) for b in range(10)]  # ~100 MiB through a 64 MiB file system
    with make_engine([fs.mnt, other]) as engine:
        for keys in batches:
            assert pages.put(engine, keys) == [True] * 10
        stats = engine.stats()
        t0 = stats["tiers"][0]
        assert t0["healthy"] and t0["evictions"] > 0 and t0["write_failures"] == 0
        assert stats["under_replicated"] == 0 and stats["pages_failed"] == 0
        order = [k for keys in batches for k in keys]
        kept = [b for b, keys in enumerate(batches) for k in keys if engine.index.holders(k) & 1]
        evicted = [b for b, keys in enumerate(batches) for k in keys if not engine.index.holders(k) & 1]
        # LRU: every evicted page is from a batch no newer than any kept page (within a batch, the
        # order of completion decides), and the tier is still full of recent pages
        assert len(kept) >= 40 and max(evicted) <= min(kept)
        assert len(page_files(fs.mnt)) == len(kept) and tmp_files(fs.mnt) == []
        newest = batches[-1]
        assert pages.checked_get(engine, newest, policy=SingleTier(0)) == [True] * 10
        assert pages.checked_get(engine, order) == [True] * len(order)
        assert engine.check() == []


def test_page_larger_than_the_file_system_fails_for_that_tier_only(tier_root, loop_fs):
    fs = loop_fs(32 * MIB, "small")
    other = os.path.join(tier_root, "disk")
    os.makedirs(other)
    small, huge = PageSet(MIB, salt="s"), PageSet(40 * MIB, salt="h")
    with make_engine([fs.mnt, other]) as engine:
        assert small.put(engine, small.keys(8)) == [True] * 8
        assert huge.put(engine, huge.keys(1)) == [True]  # stored on the other tier
        stats = engine.stats()
        t0 = stats["tiers"][0]
        assert t0["healthy"] and t0["write_failures"] == 1 and stats["under_replicated"] == 1
        assert engine.index.holders(huge.keys(1)[0]) == 0b10
        assert t0["evictions"] == 0 and t0["pages"] == 8, "nothing evicted for a page that can never fit"
        assert tmp_files(fs.mnt) == []
        assert huge.checked_get(engine, huge.keys(1)) == [True]
        assert small.checked_get(engine, small.keys(8), policy=SingleTier(0)) == [True] * 8
        assert small.put(engine, small.keys(4, 8)) == [True] * 4  # the tier still takes what fits
        assert all(engine.index.holders(k) == 0b11 for k in small.keys(4, 8))
        assert engine.check() == []
    with make_engine([fs.mnt]) as engine:  # alone, the page is not stored at all: False, not an error
        assert huge.put(engine, huge.keys(1, 1)) == [False]
        assert engine.stats()["tiers"][0]["healthy"] and engine.index.pages_on(0) == 12


def test_a_tier_out_of_inodes_evicts_lru_and_keeps_accepting_writes(loop_fs):
    """Tier 0 has bytes to spare but no inode left (another program's small files): a new temporary
    file fails with ENOSPC, so the engine evicts its least recent page and creates the file again, as
    on a full disk. Every page is stored, the tier stays healthy (before: once the inodes ran out every
    page was refused, write_failures, nothing evicted). One shard directory (keys 'aa...'): an empty
    shard left by an eviction keeps its inode, which would leave fewer pages than shards. Found by a
    review."""
    fs = loop_fs(FS_BYTES, "inodes")
    keys = [f"aa{i:04d}" for i in range(40)]
    with make_engine([fs.mnt]) as engine:
        _take_inodes(fs.mnt, leave=16)
        assert [put_items(engine, [(k, content(k, 8192), True)]) for k in keys] == [[True]] * len(keys)
        t0 = engine.stats()["tiers"][0]
        assert t0["healthy"] and t0["evictions"] > 0 and t0["write_failures"] == 0
        assert tmp_files(fs.mnt) == [] and engine.index.holders(keys[-1]) == 1


@pytest.mark.parametrize("limit", ["enospc", "capacity"])
def test_every_page_pinned_by_reads_fails_the_write_for_that_tier_only(tier_root, loop_fs, limit):
    """Reads in flight pin their pages (a page being read is never evicted). With every page of
    the full tier pinned, a new page cannot get room there: it goes to the other tier only."""
    fs = loop_fs(FS_BYTES, "pinned")
    other = os.path.join(tier_root, "disk")
    os.makedirs(other)
    pages = PageSet(MIB)
    page_file = HEADER_SIZE + MIB
    if limit == "enospc":
        _fill(fs.mnt, leave=6 * page_file + page_file // 2)  # room for 6 pages and a half
        settings = {}
    else:
        settings = {"capacity": [6 * page_file, ""]}
    plan = TierFaultPlan()
    stored = pages.keys(6)
    with make_engine([fs.mnt, other], fault_plan=plan, read_timeout=0, **settings) as engine:
        assert pages.put(engine, stored) == [True] * 6
        assert all(engine.index.holders(k) == 0b11 for k in stored)

        plan.on(fs.mnt, Fault.hold(), opcode=OP_READ)  # tier 0 reads stall: the get holds its pins
        results: list = []
        reader = threading.Thread(target=lambda: results.append(
            pages.checked_get(engine, stored, policy=SingleTier(0))))
        reader.start()
        # the reader has pinned its pages and submitted its reads
        wait_for_fault(plan, WAIT_S, "the reader never reached the ring")
        try:
            new = pages.keys(1, 100)
            assert pages.put(engine, new) == [True]
            stats = engine.stats()
            t0 = stats["tiers"][0]
            assert engine.index.holders(new[0]) == 0b10 and stats["under_replicated"] == 1
            assert t0["healthy"] and t0["evictions"] == 0
            assert t0["write_failures" if limit == "enospc" else "skipped_writes"] == 1
            assert all(engine.index.holders(k) == 0b11 for k in stored), "no pinned page was evicted"
            assert tmp_files(fs.mnt) == []
        finally:
            plan.clear()
            plan.release()
            reader.join(WAIT_S)
        assert not reader.is_alive(), "the released reader did not finish"
        assert results == [[True] * 6]
        # unpinned now: the next page evicts the least recent one and is stored on both tiers
        later = pages.keys(1, 200)
        assert pages.put(engine, later) == [True]
        assert engine.index.holders(later[0]) == 0b11 and engine.stats()["tiers"][0]["evictions"] >= 1
        assert engine.check() == []


def test_enospc_on_a_tier_never_marks_it_failed(tier_dirs):
    """ENOSPC injected on every write of tier 0 (a quota, a thin pool): tier 0 is full, not failed;
    the pages are stored on tier 1 and tier 0 is used again as soon as writes succeed."""
    plan = TierFaultPlan().on(tier_dirs[0], Fault.error(errno.ENOSPC), opcode=None)
    pages = PageSet()
    with make_engine(tier_dirs[:2], fault_plan=plan) as engine:
        assert pages.put(engine, pages.keys(4)) == [True] * 4
        assert engine.stats()["tiers"][0]["healthy"] and engine.stats()["under_replicated"] == 4
        plan.clear()
        assert pages.put(engine, pages.keys(4, 4)) == [True] * 4
        assert all(engine.index.holders(k) == 0b11 for k in pages.keys(4, 4))
        assert engine.check() == []



def test_a_tier_that_refuses_every_write_for_room_while_serving_says_so_once(tier_dirs, caplog):
    """A shared tier another node's files filled while the server ran (two SGLang servers on one GlusterFS
    volume, the brick at its reserve): every page written there failed for room, 112 of 119 pages of a
    prompt, counted in tier_errors_total, and not one line in the log said why (only the start-up probe
    said a tier was full). Now one warning per tier per interval names it, the error and what to do."""
    plan = TierFaultPlan().on(tier_dirs[0], Fault.error(errno.ENOSPC), opcode=None)
    pages = PageSet()
    caplog.set_level("WARNING", logger="kvstream")
    with make_engine(tier_dirs[:2], fault_plan=plan) as engine:
        assert pages.put(engine, pages.keys(4)) == [True] * 4
        assert pages.put(engine, pages.keys(4, 4)) == [True] * 4
        assert engine.stats()["tiers"][0]["healthy"] and engine.stats()["under_replicated"] == 8
    full = [r.getMessage() for r in caplog.records if "refuses writes for room" in r.getMessage()]
    assert len(full) == 1, caplog.text  # (8 pages refused: one line, not one a page)
    assert tier_dirs[0] in full[0] and "No space left on device" in full[0] and "free space" in full[0], full

def test_replicas_a_full_file_system_refused_are_written_once_it_has_room(tier_root, loop_fs):
    """Tier 1 is a file system another program filled (nothing of this engine to evict there): puts
    land on tier 0 only, and their replicas stay owed (replication_pending), those of puts made while it
    is full too, with the tier's catch-up looking at its free space once a second. Once the other
    program frees its space, catch-up writes them. Before: each replica was dropped when catch-up came
    to it (replication_dropped; one a second) and never written while the engine ran. Found by a
    review."""
    fs = loop_fs(32 * MIB, "full1")
    t0 = os.path.join(tier_root, "t0")
    os.makedirs(t0)
    pages = PageSet(MIB)
    first, later = pages.keys(4), pages.keys(4, 100)
    with make_engine([t0, fs.mnt], replicate="all") as engine:
        filler = _fill(fs.mnt, leave=64 * 1024)
        assert pages.put(engine, first) == [True] * 4
        assert all(engine.index.holders(k) == 0b01 for k in first)
        # catch-up came to tier 1 and found it full (its next look is a second away)
        wait_until(lambda: engine._replicas._next[1] > 0, WAIT_S, "catch-up never looked at tier 1")
        assert pages.put(engine, later) == [True] * 4
        stats = engine.stats()["tiers"][1]
        assert stats["healthy"] and stats["replication_done"] == 0 and stats["replication_dropped"] == 0
        assert stats["replication_pending"] == 8  # owed, not given up
        os.unlink(filler)
        keys = first + later
        wait_until(lambda: all(engine.index.holders(k) == 0b11 for k in keys), WAIT_S,
                   f"the replicas never reached tier 1 once it had room: {engine.stats()['tiers'][1]}")
        wait_until(lambda: engine.stats()["tiers"][1]["replication_pending"] == 0, WAIT_S, "still owed")
        stats = tier_stats_once(engine, 1, "replication_done", 8)  # (counted after the commit: helpers.py)
        assert stats["replication_done"] == 8 and stats["replication_dropped"] == 0
        assert pages.checked_get(engine, keys, policy=SingleTier(1)) == [True] * 8
        assert tmp_files(fs.mnt) == []


def test_a_replica_larger_than_the_file_system_holds_up_no_other(tier_root, loop_fs):
    """A page owed to a full tier whose file system could never hold it is dropped (replication_dropped),
    and the pages owed there with it are written once the tier has room: it never keeps the tier's
    catch-up waiting for room that cannot come."""
    fs = loop_fs(32 * MIB, "full1")
    t0 = os.path.join(tier_root, "t0")
    os.makedirs(t0)
    pages, huge = PageSet(MIB), PageSet(40 * MIB, salt="h")
    with make_engine([t0, fs.mnt], replicate="all") as engine:
        filler = _fill(fs.mnt, leave=64 * 1024)
        assert huge.put(engine, huge.keys(1)) == [True]
        assert pages.put(engine, pages.keys(4)) == [True] * 4
        wait_until(lambda: engine.stats()["tiers"][1]["replication_dropped"] >= 1, WAIT_S, "the huge page stays owed")
        os.unlink(filler)
        wait_until(lambda: all(engine.index.holders(k) == 0b11 for k in pages.keys(4)), WAIT_S,
                   f"the replicas never reached tier 1 once it had room: {engine.stats()['tiers'][1]}")
        assert engine.index.holders(huge.keys(1)[0]) == 0b01 and tmp_files(fs.mnt) == []


@contextlib.contextmanager
def _out_of_inodes(tier_root: str, loop_fs, name: str):
    """An engine on a directory (tier 0) and a loop file system ``name`` with bytes free and every inode taken
    (tier 1), and 4 small pages put, on tier 0 alone: (engine, tier 1's mount, their keys)."""
    fs = loop_fs(32 * MIB, name)
    t0 = os.path.join(tier_root, "t0")
    os.makedirs(t0)
    keys = [f"{name}-{i:04d}" for i in range(4)]
    with make_engine([t0, fs.mnt], replicate="all") as engine:
        _take_inodes(fs.mnt, leave=0)
        assert [put_items(engine, [(k, content(k, 8192), True)]) for k in keys] == [[True]] * len(keys)
        yield engine, fs.mnt, keys


def test_catchup_copies_a_tier_out_of_inodes_refuses_stay_owed_and_count_no_failure(tier_root, loop_fs,
                                                                                     monkeypatch):
    """Tier 1 has bytes to spare but no inode left, nothing of this engine to evict there, and the catch-up's
    look at its file system sees bytes only (as for a quota on files, which statvfs does not show: the look is
    narrowed so, the refusal is the kernel's): each catch-up copy's temporary file is refused (ENOSPC). The
    copies stay owed, and a refusal counts nowhere, as a full tier's refusal of a copy's write does (a copy
    never evicts). Before: every try, one a second while the tier stayed full, counted a write failure and an
    error. Found by a review."""
    from kvstream_hicache import replication

    monkeypatch.setattr(replication, "_fs_short", lambda tier, length: False)
    with _out_of_inodes(tier_root, loop_fs, "inodes1") as (engine, mnt, keys):
        # a catch-up copy tried and refused (the tier taken for full, its next look a back-off away)
        wait_until(lambda: engine._replicas._refused[1] > 0 and engine._replicas._busy[1] is None, WAIT_S,
                   "catch-up never tried tier 1")
        stats = engine.stats()["tiers"][1]
        assert stats["healthy"] and stats["replication_pending"] == len(keys)
        assert stats["write_failures"] == len(keys) and stats["errors"] == len(keys), stats  # the puts' only
        assert all(engine.index.holders(k) == 0b01 for k in keys) and tmp_files(mnt) == []


def test_a_tier_out_of_inodes_is_looked_at_without_reading_a_page_each_time(tier_root, loop_fs):
    """Tier 1 has bytes free but no inode: every catch-up copy would be refused at its temporary file. As for a
    tier full of bytes (Replicator._full, _room_again: one statvfs a look), the catch-up reads no page from
    its holder, checks no block and hands nothing to the writer while nothing changes: its look at the file
    system counts free inodes (review final, stop 51: a page read every second, for as long as the tier
    stayed so). Once inodes are free, the copies are written."""
    with _out_of_inodes(tier_root, loop_fs, "inodes2") as (engine, mnt, keys):
        looks = []  # the tier's next look, each time it was set again (one a FAILED_BACKOFF_S)
        wait_until(lambda: (looks.append(engine._replicas._next[1]) or len(set(looks)) > 5), WAIT_S,
                   "the catch-up stopped looking at tier 1")
        stats = engine.stats()["tiers"]
        assert stats[0].get("replication_read_bytes", 0) == 0, (
            f"{stats[0]['replication_read_bytes'] // file_size(8192)} page reads of tier 0 for copies tier 1 "
            f"could not take ({len(set(looks))} looks)")
        assert stats[1]["replication_pending"] == len(keys) and tmp_files(mnt) == []
        shutil.rmtree(os.path.join(mnt, "inodes"))  # (_take_inodes' files)
        wait_until(lambda: all(engine.index.holders(k) == 0b11 for k in keys), WAIT_S,
                   "the copies were never written once tier 1 had inodes")


def test_a_tier_that_keeps_refusing_copies_it_seems_to_have_room_for_is_tried_less_often(tier_dirs):
    """A quota (EDQUOT) or a thin pool refuses every write of tier 1 while statvfs shows room: each refusal
    marks the tier full (Replicator._finished) and its next look, which reads a page to try again, comes
    later each time (doubling from FAILED_BACKOFF_S), where it came every second (review final, stop 51).
    No refusal counts as a failure of the tier."""
    from kvstream_hicache.replication import FAILED_BACKOFF_S

    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 4
    plan = TierFaultPlan().on(tier_dirs[1], Fault.error(errno.EDQUOT), opcode=None)
    with make_engine(tier_dirs[:2], fault_plan=plan) as engine:
        replicas = engine._replicas
        wait_until(lambda: replicas._refused[1] >= 3, WAIT_S, "tier 1 never refused three copies")
        with replicas._lock:
            wait = replicas._next[1] - replicas.clock()
            full = replicas._full[1]
        assert full and wait > 2 * FAILED_BACKOFF_S, (full, wait)
        stats = engine.stats()["tiers"][1]
        assert stats["healthy"] and stats["write_failures"] == 0 and stats["errors"] == 0, stats
        plan.clear()


def test_a_tier_that_refused_copies_takes_them_without_the_back_off_once_it_rejoins(tier_dirs):
    """Tier 1 refuses every copy for a quota until its catch-up looks back off to REFUSED_BACKOFF_MAX (64 s);
    then it fails (its server gone) and rejoins with room (remounted, the quota raised): what it lacks is owed
    again, and written within a second, as to any tier that rejoins. Before, the back-off of the tier as it was
    held: its copies waited up to 64 s more after the rejoin. Found by a review."""
    from kvstream_hicache.io import OP_WRITE
    from kvstream_hicache.replication import FAILED_BACKOFF_S, REFUSED_BACKOFF_MAX

    within_s = 10 * FAILED_BACKOFF_S  # (5 copies, paced: seconds, not the back-off's 64)

    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 4
    plan = TierFaultPlan().on(tier_dirs[1], Fault.error(errno.EDQUOT), opcode=None)
    with make_engine(tier_dirs[:2], fault_plan=plan, tier_retry=0.1) as engine:
        replicas = engine._replicas
        clock = replicas.clock = FakeClock(time.monotonic())  # (the catch-up's back-offs: moved, not waited for)
        while replicas._refused[1] <= REFUSED_BACKOFF_MAX.bit_length():  # (its back-off at the most)
            refused = replicas._refused[1]
            clock.advance(REFUSED_BACKOFF_MAX + 1)
            with replicas._lock:
                replicas._work.notify()
            wait_until(lambda: replicas._refused[1] > refused and replicas._busy[1] is None, WAIT_S,
                       "tier 1 stopped trying its copies")
        plan.clear()
        plan.on(tier_dirs[1], Fault.error(errno.EIO), opcode=OP_WRITE)
        extra = pages.keys(1, 100)
        assert pages.put(engine, extra) == [True]  # tier 1 fails on it
        assert not engine.tiers[1].healthy
        plan.clear()
        wait_until(lambda: engine.get([], []) == [] and engine.tiers[1].healthy, WAIT_S, "tier 1 never rejoined")
        rejoined = clock()

        def copied() -> bool:  # (the catch-up's clock moves on by 10 ms a look with no copy under way: its pacing)
            if replicas._busy[1] is None:
                clock.advance(0.01)
            with replicas._lock:
                replicas._work.notify()
            return all(engine.index.holders(k) == 0b11 for k in keys + extra) or clock() > rejoined + within_s

        wait_until(copied, WAIT_S, "the catch-up stopped")
        assert clock() <= rejoined + within_s, (
            f"the rejoined tier 1 got {engine.stats()['tiers'][1]['replication_done']} copies of 5 in {within_s} s: "
            f"its next look {replicas._next[1] - clock():.0f} s away ({replicas._refused[1]} refusals before)")


def test_a_promoted_copy_a_tier_refused_leaves_memory_and_is_written_from_a_holder_once_it_has_room(tier_dirs,
                                                                                                   monkeypatch):
    """Tier 0 refuses every write (a quota: statvfs shows room) and holds nothing of this engine to evict; the
    pages are on tier 1 alone. A get of them promotes them to tier 0: their sources are kept in memory (the
    caller's copy, which may evict) and written there ahead of the rest. Tier 0 refuses each: evicting made
    no room. The source then leaves memory (the sweep owes the page again, from its holder, once the tier
    has room). Before, it stayed for as long as the tier refused (tried every 64 s at most), and sources so
    held filled promote_bytes, after which no page read was promoted with its copy to any tier (review
    refused, stop 51)."""
    from kvstream_hicache import replication

    monkeypatch.setattr(replication, "REFUSED_BACKOFF_MAX", 1)  # (a try a second: the test's time only)
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine(tier_dirs[1:2]) as engine:
        assert pages.put(engine, keys) == [True] * 2
    plan = TierFaultPlan().on(tier_dirs[0], Fault.error(errno.EDQUOT), opcode=None)
    with make_engine(tier_dirs[:2], fault_plan=plan) as engine:
        replicas = engine._replicas
        wait_until(lambda: replicas._refused[0] >= 1 and replicas._busy[0] is None, WAIT_S,
                   "tier 0 never refused a catch-up copy")
        assert pages.checked_get(engine, keys) == [True] * 2
        assert set(replicas._copies) == set(keys)  # promoted, their sources in memory
        refused = replicas._refused[0]
        wait_until(lambda: replicas._refused[0] >= refused + 4 and replicas._busy[0] is None, WAIT_S,
                   "tier 0 stopped trying its copies")
        assert all(engine.index.holders(k) == 0b10 for k in keys)
        with replicas._lock:
            held, held_bytes = sorted(replicas._copies), replicas._copy_bytes
        assert held == [] and held_bytes == 0, (
            f"promoted sources held in memory after tier 0 refused {replicas._refused[0] - refused} copies: "
            f"{held} ({held_bytes} bytes)")
        stats = engine.stats()["tiers"][0]
        assert stats["healthy"] and stats["write_failures"] == 0 and stats["replication_pending"] == 2, stats
        plan.clear()
        wait_until(lambda: all(engine.index.holders(k) == 0b11 for k in keys), WAIT_S,
                   "the copies never reached tier 0 once it took writes again")


def test_a_server_restarts_on_a_tier_its_own_earlier_pages_filled(tier_root, loop_fs, caplog):
    """A fleet's shared tier fills with the servers' pages (no capacity, or capacities that add up past
    the file system): a server killed and started again found no room for its start-up probe's 4 KiB
    and was refused (TierError "test write failed (No space left on device)"), in a crash loop while the
    tier stayed full, though the pages filling it were its own to evict. Full is not failed: it starts,
    serves the pages, and a put evicts the oldest to make room."""
    fs = loop_fs(FS_BYTES, "full")
    other = os.path.join(tier_root, "disk")
    os.makedirs(other)
    pages = PageSet(MIB)
    keys = pages.keys(80)  # ~80 MiB through a 64 MiB file system: it ends full
    with make_engine([fs.mnt, other]) as engine:
        for b in range(0, len(keys), 10):
            assert pages.put(engine, keys[b:b + 10]) == [True] * 10
    _fill_all(fs.mnt)  # what the last writes left (another file, another process's page)
    assert page_files(fs.mnt)
    caplog.set_level("WARNING", logger="kvstream")
    with make_engine([fs.mnt, other], catchup="off") as engine:  # (no copy of what tier 0 lacks takes the room)
        assert engine.stats()["tiers"][0]["healthy"]
        # said once, with what to do if the room is not the engine's to make (a quota, another program's files)
        full = [r.getMessage() for r in caplog.records if "is full (its test write" in r.getMessage()]
        assert len(full) == 1 and "No space left on device" in full[0] and "free space" in full[0], caplog.text
        new = pages.keys(4, 1000)
        assert pages.put(engine, new) == [True] * 4
        assert pages.checked_get(engine, new, policy=SingleTier(0)) == [True] * 4
        assert engine.stats()["tiers"][0]["evictions"] > 0


def _beside_a_small_fs(tier_root: str, loop_fs, name: str) -> tuple:
    """A 32 MiB ext4 loop device and two tier directories: a plain one, then one on that file system."""
    fs = loop_fs(32 * MIB, name)
    t0, t1 = os.path.join(tier_root, "t0"), os.path.join(fs.mnt, "kv")
    os.makedirs(t0)
    os.makedirs(t1)
    return fs, t0, t1


def _flap(engine, fs, pages: PageSet) -> None:
    """Tier 1's file system unmounted (`umount -l`: a put fails the tier) and mounted again; back once it rejoins."""
    subprocess.run(["umount", "-l", fs.mnt], check=True)
    assert pages.put(engine, pages.keys(2, 100)) == [True] * 2  # tier 1 gone: it fails
    assert not engine.stats()["tiers"][1]["healthy"]
    fs.mount()
    wait_until(lambda: pages.put(engine, pages.keys(1, 200 + int(time.monotonic() * 1000))) == [True]
               and engine.stats()["tiers"][1]["healthy"], 20, f"tier 1 never rejoined: {engine.stats()['tiers'][1]}")


@pytest.mark.parametrize("out_of", ["blocks", "inodes"])
def test_a_full_tier_that_flapped_rejoins_and_evicts(tier_root, loop_fs, out_of):
    """Tier 1's file system is full of this engine's pages (it evicts on ENOSPC) when it is unmounted and
    mounted again (`umount -l`, `mount`: an operator, a flaky mount). Its probe cannot write its 4 KiB file
    there (ENOSPC at the write: no block; at the creation: no inode), yet the tier is full, not broken: it
    rejoins, and a put evicts there as before. Before (flap trial), the probe's ENOSPC kept it failed for good
    (the back-off doubling to 300 s), and nothing could make room, since only a healthy tier's writes evict;
    16f6ca6 let the write's ENOSPC pass, the creation's (out of inodes) still kept the tier out."""
    fs, t0, t1 = _beside_a_small_fs(tier_root, loop_fs, "flap")
    pages = PageSet(MIB)
    with make_engine([t0, t1], replicate="all", tier_retry=0.2) as engine:
        for b in range(5):  # ~50 MiB through a 32 MiB file system: full of this engine's pages
            assert pages.put(engine, pages.keys(10, 10 * b)) == [True] * 10
        assert engine.stats()["tiers"][1]["evictions"] > 0
        if out_of == "blocks":
            _fill(fs.mnt, leave=0)  # (the few KiB the last eviction left: not even a probe's 4 KiB free)
        else:
            _take_inodes(fs.mnt, leave=0)  # (another program's empty files: not even the probe's inode free)
        _flap(engine, fs, pages)
        keys = pages.keys(3, 300)
        assert pages.put(engine, keys) == [True] * 3
        assert all(engine.index.holders(k) & 0b10 for k in keys), "tier 1 made no room for new pages"
        assert pages.checked_get(engine, keys, policy=SingleTier(1)) == [True] * 3
        assert engine.check() == []


def test_a_server_restarts_on_a_tier_with_no_inode_left_for_its_probe(tier_root, loop_fs, caplog):
    """A server restarts on a tier full of pages, with no inode left for its start-up probe's file (out of
    inodes; a full GlusterFS volume refuses every new file the same way, storage.reserve: trial lmgluster, both
    LMCache servers in a crash loop on their shared tier). It was refused, 'is not writable (No space left on
    device): fix its permissions or mount'; full is not failed, as when a tier rejoins: it starts, says the tier is
    full, serves its pages, and a put evicts the oldest to make room."""
    fs, t0, t1 = _beside_a_small_fs(tier_root, loop_fs, "noinode")
    pages = PageSet(MIB)
    keys = pages.keys(10)
    with make_engine([t0, t1], replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * 10
    _take_inodes(fs.mnt, leave=0)
    caplog.set_level("WARNING", logger="kvstream")
    with make_engine([t0, t1], replicate="all", catchup="off") as engine:
        assert engine.stats()["tiers"][1]["healthy"]
        said = [r.getMessage() for r in caplog.records if "is full (its test write" in r.getMessage()]
        assert len(said) == 1 and t1 in said[0] and "No space left on device" in said[0], caplog.text
        assert pages.checked_get(engine, keys, policy=SingleTier(1)) == [True] * 10
        new = pages.keys(2, 100)
        assert pages.put(engine, new) == [True] * 2
        assert all(engine.index.holders(k) & 0b10 for k in new), "tier 1 made no room for new pages"
        assert engine.stats()["tiers"][1]["evictions"] > 0


def test_a_server_restarts_on_a_tier_that_reports_its_probe_s_refusal_for_room_at_the_read(tier_root, monkeypatch,
                                                                                          caplog):
    """A full GlusterFS volume takes the probe's 4 KiB O_DIRECT write and reports its refusal at the next call on
    the file, the read back (trial lmgluster: 'test read failed (No space left on device)', an LMCache server
    refused at every restart while the nodes' pages filled the shared tier). A refusal for room is full, not
    failed, whichever call reports it: the read's (here, only the probe's file answers so) or the close's."""
    t0, t1 = os.path.join(tier_root, "t0"), os.path.join(tier_root, "t1")
    os.makedirs(t0)
    os.makedirs(t1)
    real = os.preadv

    def preadv(fd, buffers, offset, *args):
        where = os.readlink(f"/proc/self/fd/{fd}")
        if where.startswith(t1) and "/probe." in where:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", preadv)
    caplog.set_level("WARNING", logger="kvstream")
    with make_engine([t0, t1]) as engine:
        monkeypatch.setattr(os, "preadv", real)
        assert [t["healthy"] for t in engine.stats()["tiers"]] == [True, True]
        said = [r.getMessage() for r in caplog.records if "is full (its test write" in r.getMessage()]
        assert len(said) == 1 and t1 in said[0] and "No space left on device" in said[0], caplog.text
    assert tmp_files(t1) == []


def test_a_tier_that_rejoins_with_no_room_for_its_probe_says_so(tier_root, loop_fs, caplog):
    """Tier 1 fails (unmounted) and comes back with no inode for this user (another program's files, an inode
    quota of 0) and none of this engine's pages to evict. Its probe's file cannot be made (ENOSPC at 'create'):
    it rejoins (full is not failed), and every put to it then fails for room, counted but never logged (a write
    refused for room is no tier error). Start-up warns of a tier refusing its probe for room (its write or its
    file's creation); a rejoin must at least say it (before: only 'recovered', every write failing
    without a word): the writes refused for room say so, once in 30 s (Jobs._failed_under_writer)."""
    fs, t0, t1 = _beside_a_small_fs(tier_root, loop_fs, "quota")
    pages = PageSet(MIB)
    with make_engine([t0, t1], replicate="all", tier_retry=0.2) as engine:
        _take_inodes(fs.mnt, leave=0)  # (none of this engine's pages there: nothing to evict)
        _flap(engine, fs, pages)
        assert pages.put(engine, pages.keys(3, 300)) == [True] * 3
        assert engine.stats()["tiers"][1]["write_failures"] > 0  # (it takes nothing)
        said = [r.getMessage() for r in caplog.records if r.name.startswith("kvstream") and r.levelno >= 30
                and "tier 1" in r.getMessage() and "for room" in r.getMessage()]
        assert said, "a rejoined tier that refuses every write for room said nothing"


def test_a_page_larger_than_the_file_system_evicts_nothing_put_beside_it(tier_root, loop_fs, caplog):
    """A page the tier's file system could never hold is not written there at all: written, it filled the
    file system to its last block before its ENOSPC, and the pages put with it, which had room, hit ENOSPC
    in turn and evicted the tier's valid pages for it (an LMCache soak: 32 MiB chunks on a 32 MiB tier 0)."""
    fs = loop_fs(32 * MIB, "huge")
    other = os.path.join(tier_root, "disk")
    os.makedirs(other)
    small, huge = PageSet(MIB, salt="s"), PageSet(40 * MIB, salt="h")
    with make_engine([fs.mnt, other]) as engine:
        assert small.put(engine, small.keys(8)) == [True] * 8
        items = [(k, huge.data(k), True) for k in huge.keys(1)] + [(k, small.data(k), True) for k in small.keys(8, 8)]
        assert put_items(engine, items) == [True] * 9
        t0 = engine.stats()["tiers"][0]
        assert t0["evictions"] == 0, f"pages evicted for a page that can never fit: {t0}"
        assert all(engine.index.holders(k) & 1 for k in small.keys(16)) and tmp_files(fs.mnt) == []
        assert small.checked_get(engine, small.keys(16), policy=SingleTier(0)) == [True] * 16
    # the warning names the cause (it blamed another program's files, a quota or a reserve) and the fix
    assert "larger than the tier's whole file system" in caplog.text and "another program" not in caplog.text


def _sizeless(monkeypatch, tier: str, asked: list | None = None) -> str:
    """Make ``tier`` (created) a file system that does not say its size, as os.statvfs reports it (f_blocks and
    every count 0: some FUSE and cloud-storage mounts; such a mount cannot be made here); each call on it is
    listed in ``asked``. Returns its real path."""
    statvfs, real = os.statvfs, os.path.realpath(tier)
    os.makedirs(real)

    def sizeless(path, *args):
        st = statvfs(path, *args)
        if not os.path.realpath(path).startswith(real):
            return st
        if asked is not None:
            asked.append(path)
        return os.statvfs_result([st.f_bsize, st.f_frsize, 0, 0, 0, 0, 0, 0, st.f_flag, st.f_namemax])

    monkeypatch.setattr(os, "statvfs", sizeless)
    return real


def test_a_tier_whose_file_system_does_not_say_its_size_takes_every_page(tier_root, monkeypatch):
    """A file system that reports no size (statvfs's f_blocks 0: some FUSE and cloud-storage mounts) bounds
    nothing: its tier takes every page. Taken for a file system of 0 bytes, every page was larger than it and
    refused there, the tier written never (the check that keeps pages larger than the file system out). The
    size is os.statvfs's, made 0 for that tier: such a mount cannot be made here."""
    fuse = _sizeless(monkeypatch, os.path.join(tier_root, "fuse"))
    pages = PageSet(MIB)
    with make_engine([fuse]) as engine:
        assert pages.put(engine, pages.keys(4)) == [True] * 4
        assert engine.stats()["tiers"][0]["write_failures"] == 0
        assert pages.checked_get(engine, pages.keys(4)) == [True] * 4


def test_catch_up_copies_to_a_tier_whose_file_system_does_not_say_its_size(tier_root, monkeypatch):
    """A file system that reports no size (statvfs all 0: some FUSE and cloud-storage mounts) bounds nothing for
    catch-up either: the replicas owed to its tier are written there. Taken for 0 bytes (Room.size, f_bavail 0),
    every one was dropped as larger than the file system (replication_dropped), the tier never caught up."""
    fuse, t0 = _sizeless(monkeypatch, os.path.join(tier_root, "fuse2")), os.path.join(tier_root, "t0")
    os.makedirs(t0)
    pages = PageSet(MIB)
    keys = pages.keys(4)
    with make_engine([t0]) as engine:
        assert pages.put(engine, keys) == [True] * 4
    with make_engine([t0, fuse], replicate="all") as engine:
        engine.wait_scan(WAIT_S)
        wait_until(lambda: all(engine.index.holders(k) == 0b11 for k in keys) or
                   engine.stats()["tiers"][1]["replication_dropped"], WAIT_S, "catch-up never ended")
        stats = engine.stats()["tiers"][1]
        assert stats["replication_dropped"] == 0, stats
        assert all(engine.index.holders(k) == 0b11 for k in keys)
        assert pages.checked_get(engine, keys, policy=SingleTier(1)) == [True] * 4


def test_a_tier_whose_file_system_does_not_say_its_size_is_not_asked_per_page(tier_root, monkeypatch):
    """The check that keeps pages larger than the file system out asks statvfs once, not once per page: on a file
    system that does not say its size (f_blocks 0: a FUSE or cloud-storage mount, where a statvfs may be a round
    trip), the size it never learnt sent a statvfs from the writer before every page's file was made."""
    asked: list[str] = []
    fuse = _sizeless(monkeypatch, os.path.join(tier_root, "fuse3"), asked)
    pages = PageSet(MIB)
    with make_engine([fuse]) as engine:
        before = len(asked)
        assert pages.put(engine, pages.keys(16)) == [True] * 16
        assert len(asked) - before <= 1, f"{len(asked) - before} statvfs calls for 16 pages"


def test_a_promoted_page_larger_than_the_faster_tier_s_file_system_holds_up_none_of_its_catch_up(tier_root,
                                                                                                 monkeypatch):
    """A page read from tier 1 is promoted to tier 0, whose whole file system is smaller than it: the writer
    refuses it there (never fits). That copy alone is dropped; what tier 0 lacks besides is copied there as
    before. Taken for a refusal for room (a quota, out of inodes), tier 0 was marked full until it had room for
    that very page, which it never has: its catch-up stopped for good (replicas it missed never came)."""
    statvfs, small = os.statvfs, os.path.realpath(os.path.join(tier_root, "small"))
    t1 = os.path.join(tier_root, "t1")
    os.makedirs(small)
    os.makedirs(t1)

    def four_mib(path, *args):
        st = statvfs(path, *args)
        if not os.path.realpath(path).startswith(small):
            return st
        blocks = (4 * MIB) // st.f_frsize
        return os.statvfs_result([st.f_bsize, st.f_frsize, blocks, blocks, blocks, st.f_files, st.f_ffree,
                                  st.f_favail, st.f_flag, st.f_namemax])

    monkeypatch.setattr(os, "statvfs", four_mib)
    little, big = PageSet(64 * 1024, salt="l"), PageSet(8 * MIB, salt="b")
    plan = TierFaultPlan()
    with make_engine([small, t1], replicate="all", memory="256M", fault_plan=plan) as engine:
        (huge,) = big.keys(1)
        assert big.put(engine, [huge]) == [True]  # (on tier 1 only: larger than tier 0's file system)
        wait_until(lambda: engine.stats()["tiers"][0]["replication_pending"] == 0, WAIT_S, "catch-up never ended")
        assert engine.index.holders(huge) == 0b10
        assert big.checked_get(engine, [huge]) == [True]  # promoted to tier 0, which refuses it
        wait_until(lambda: engine._replicas._busy[0] is None and not engine._replicas._owed[0], WAIT_S,
                   "the promoted copy never ended")
        plan.on(small, Fault.error(errno.ENOSPC), opcode=None)  # (a moment's quota: tier 0 misses these)
        keys = little.keys(4)
        assert little.put(engine, keys) == [True] * 4
        assert all(engine.index.holders(k) == 0b10 for k in keys)
        plan.clear()
        wait_until(lambda: all(engine.index.holders(k) == 0b11 for k in keys), 20,
                   f"tier 0 never caught up: {engine.stats()['tiers'][0]}, catch-up full for "
                   f"{engine._replicas._full[0]} bytes")
        assert engine.index.holders(huge) == 0b10 and tmp_files(small) == []



def test_a_share_capacity_on_a_file_system_that_does_not_say_its_size_is_refused_naming_why(tier_root, monkeypatch):
    """capacity '50%' on a file system that does not say its size (f_blocks 0) is a share of nothing: refused at
    start-up, naming why and the fix. Taken for a share of 0 bytes, the refusal said the tier's capacity "is 0
    bytes, less than one page ... give at least 1 bytes", a fix that is none (the size 0 means unknown
    elsewhere: Tier.fs_bytes)."""
    fuse = _sizeless(monkeypatch, os.path.join(tier_root, "fuse4"))
    with pytest.raises(KVStreamError) as refused:
        make_engine([fuse], capacity="50%")
    assert "does not say its size" in str(refused.value) and "0 bytes" not in str(refused.value), refused.value


def test_an_owner_mapping_tier_with_no_inode_left_for_its_probe_is_refused_naming_the_fix(tier_root, loop_fs):
    """As above, on a file system that maps owners (bindfs --force-user; NFS root squash): the engine's own files
    there come out owned by the mapped uid, which the start-up probe learns from its file. With no inode left the
    probe's file cannot be made, and the owner cannot be learnt: a kvstream/ of another uid may be this engine's
    own, mapped, or another user's, and trusting it on a guess would let this engine evict another user's pages
    (review rev3 learnt it from the tier's root: a root another user owns would have made that user this
    engine). Refused at start, naming the cause and the fix (before: 'a user this engine does not trust')."""
    mapped_uid = 54323
    fs = loop_fs(32 * MIB, "mapnoino")
    t0, src, mnt = os.path.join(tier_root, "t0"), os.path.join(fs.mnt, "src"), os.path.join(tier_root, "mapped")
    os.makedirs(t0)
    with owner_mapping_tier(src, mnt, mapped_uid) as t1:
        pages = PageSet(MIB)
        keys = pages.keys(4)
        with make_engine([t0, t1], replicate="all") as engine:
            assert pages.put(engine, keys) == [True] * 4
        assert os.stat(os.path.join(t1, "kvstream")).st_uid == mapped_uid
        _take_inodes(fs.mnt, leave=0)
        with pytest.raises(KVStreamError, match=r"is full .* uid 54323's: .* free space \(or an inode\) there"):
            make_engine([t0, t1], replicate="all", catchup="off").close()


def test_a_full_tier_of_another_user_s_is_still_refused_when_its_probe_makes_no_file(tier_root, loop_fs):
    """A tier whose root and kvstream/ are another user's (a local file system: no owner is mapped), with no inode
    left for the probe's file: this user's alone is trusted, and the other user's kvstream/ is refused."""
    fs, t0, t1 = _beside_a_small_fs(tier_root, loop_fs, "theirs")
    other = 54321
    os.makedirs(os.path.join(t1, "kvstream", "tmp"), 0o700)
    for path in (t1, os.path.join(t1, "kvstream"), os.path.join(t1, "kvstream", "tmp")):
        os.chmod(path, 0o700)
        os.chown(path, other, other)
    _take_inodes(fs.mnt, leave=0)
    with pytest.raises(KVStreamError, match="belongs to a user this engine does not trust"):
        make_engine([t0, t1]).close()


def _seal_refused(tier, times: int, err: int = errno.ENOSPC):
    """Tier's next ``times`` seals close the file and raise ``err`` (GlusterFS's write-behind: a write refused
    for room reported at the close)."""
    real, left = tier._seal, [times]

    def seal(fd, ran):
        if left[0] <= 0:
            return real(fd, ran)
        left[0] -= 1
        ran.append(True)
        os.close(fd)
        raise OSError(err, f"close: {os.strerror(err)}")

    tier._seal = seal
    return left


def test_a_page_refused_for_room_at_its_seal_is_written_again_after_an_eviction(tier_root):
    t0 = os.path.join(tier_root, "t0")
    os.makedirs(t0)
    pages = PageSet(MIB)
    old, new = pages.keys(4), pages.keys(1, 100)
    with make_engine([t0]) as engine:
        assert pages.put(engine, old) == [True] * 4
        left = _seal_refused(engine.tiers[0], 1)
        assert pages.put(engine, new) == [True]
        assert left[0] == 0 and engine.index.holders(new[0]) == 1
        t = engine.stats()["tiers"][0]
        assert t["healthy"] and t["evictions"] == 1 and t["write_failures"] == 0, t
        assert pages.checked_get(engine, new) == [True]
        assert engine.check() == []
    assert tmp_files(t0) == []


def test_a_tier_that_hangs_at_the_rewrite_of_a_page_refused_at_its_seal_fails_as_hung(tier_root):
    """The new temporary file of a page refused for room at its seal did not come within write_timeout (a hung
    tier, bounded.py: ETIMEDOUT): the tier fails as hung, as at any other creation, and the error is not taken for
    the seal's refusal for room (full, not failed: the hung tier stayed in service)."""
    t0 = os.path.join(tier_root, "t0")
    os.makedirs(t0)
    pages = PageSet(MIB)
    with make_engine([t0]) as engine:
        assert pages.put(engine, pages.keys(4)) == [True] * 4
        tier = engine.tiers[0]
        _seal_refused(tier, 1)
        real, calls = tier.create_tmp, []

        def create_tmp():
            calls.append(1)
            if len(calls) == 2:  # (the rewrite's)
                raise OSError(errno.ETIMEDOUT, "did not answer in time")
            return real()

        tier.create_tmp = create_tmp
        assert pages.put(engine, pages.keys(1, 100)) == [False]
        t = engine.stats()["tiers"][0]
        assert len(calls) == 2 and not t["healthy"] and t["write_timeouts"] == 1, t
        tier.create_tmp = real
