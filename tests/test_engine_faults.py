"""Engine under faults: a stalled tier, damaged pages, failing and vanishing tiers, a full disk.

Faults are injected per tier through the ring's FaultyRing hook (a plan that maps each op's file
descriptor to its tier by path) or made for real on the files. No timing assertions: a stalled
tier is a held completion, and the test waits on completions.
"""
from __future__ import annotations

import errno
import os
import shutil
import time

import numpy as np
import pytest

from kvstream_hicache.faults import Fault, FaultPlan, TierFaultPlan
from kvstream_hicache.io import OP_READ, OP_WRITE
from kvstream_hicache.layout import HEADER_SIZE
from kvstream_hicache.router import SingleTier

from helpers import (ARRAY_CHUNK, FakeClock, Pages, flip_byte, gone_or_restored, key, make_array_engine as make_engine,
                     messages, segments_of, tier_stats_once, tmp_files, wait_until)

SENTINEL = 0xAB


def stored(tier_dirs, n=8, io_engine="uring", plan=None, aligned=True, **settings):
    pages = Pages(n, aligned=aligned)
    keys = [key(i, "faults") for i in range(n)]
    engine = make_engine(tier_dirs, io_engine, fault_plan=plan, **settings)
    assert engine.put(keys, pages.src_segments) == [True] * n
    return engine, pages, keys


# -- the stalled tier and buffer ownership --------------------------------------------------------
def test_stalled_tier_does_not_hold_the_batch_and_never_writes_after_return(tier_dirs, io_engine):
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 8, io_engine, plan)
    with engine:
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_READ)  # tier 1 stops completing reads
        assert engine.get(keys, pages.dst_segments) == [True] * 8  # tier 0 stole tier 1's items
        assert all(pages.equal(i) for i in range(8))
        held = engine.stats()["orphan_reads_in_flight"]
        assert held > 0  # the stalled reads are still in flight, engine-owned
        batch = engine.last_batch
        assert batch["tiers"][1]["bytes"] == 0 and batch["found"] == 8

        for page in pages.dst:  # the caller reuses its buffers at once
            for a in page:
                a[:] = SENTINEL
        plan.clear()
        plan.release()  # the stalled tier wakes up: its reads complete into staging buffers
        other = Pages(1)
        assert engine.get(keys[:1], other.dst_segments) == [True]  # this call reaps the orphans
        assert engine._reads.drain(30) == 0
        assert engine.stats()["orphan_reads"] >= held  # (+ tail duplicates of the last call)
        assert all((a == SENTINEL).all() for page in pages.dst for a in page)  # never written after return
        assert engine.check() == []


def test_read_timeout_returns_misses_and_keeps_buffers_safe(tier_dirs):
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 4, plan=plan, read_timeout=0.2)
    with engine:
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ).on(tier_dirs[1], Fault.hold(), opcode=OP_READ)
        assert engine.get(keys, pages.dst_segments) == [False] * 4
        assert engine.stats()["read_timeouts"] == 1
        for page in pages.dst:
            for a in page:
                a[:] = SENTINEL
        plan.clear()
        plan.release()
        assert engine._reads.drain(30) == 0
        assert all((a == SENTINEL).all() for page in pages.dst for a in page)
        assert engine.get(keys, pages.dst_segments) == [True] * 4 and pages.equal(3)


def test_a_tier_that_times_out_every_get_logs_one_line_not_one_a_get(tier_dirs, caplog):
    """A slow tier (a blkio throttle of 1 MB/s, read_timeout 1 s) times out every get for as long as it is slow:
    hours of SGLang prefetches. Each is counted (read_timeouts); the log says it once per 30 s, naming the
    setting, with how many more there were. Before, every get added a warning (12 gets, 12 lines: flap trial)."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 2, plan=plan, read_timeout=0.05)
    with engine:
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ).on(tier_dirs[1], Fault.hold(), opcode=OP_READ)
        for _ in range(4):
            assert engine.get(keys, pages.dst_segments) == [False] * 2
        assert engine.stats()["read_timeouts"] == 4
        said = messages(caplog, "timed out")
        assert len(said) == 1 and "read_timeout" in said[0], said
        plan.clear()
        plan.release()
        assert engine._reads.drain(30) == 0
        assert engine.get(keys, pages.dst_segments) == [True] * 2 and pages.equal(1)


# -- damaged pages -------------------------------------------------------------------------------
def _flip_on_disk(engine, tier: int, k: str, offset: int) -> None:
    flip_byte(engine.tiers[tier].layout.page_path(k), offset, 0x10)


def test_corrupted_block_is_served_from_the_other_tier_and_quarantined(tier_dirs, io_engine):
    engine, pages, keys = stored(tier_dirs[:2], 4, io_engine)
    with engine:
        _flip_on_disk(engine, 0, keys[2], HEADER_SIZE + 70_000)  # inside block 1 of page 2
        assert engine.get(keys, pages.dst_segments, policy=SingleTier(0)) == [True] * 4
        assert all(pages.equal(i) for i in range(4))
        t0 = engine.stats()["tiers"][0]
        assert t0["corrupted"] == 1 and t0["quarantined"] == 1 and t0["replica_retries"] >= 1
        assert gone_or_restored(engine, 0, keys[2])  # removed; a fresh copy may be back (catch-up)
        wait_until(lambda: engine.index.holders(keys[2]) == 0b11, what="tier 0's copy was never written again")
        assert gone_or_restored(engine, 0, keys[2])
        assert tier_stats_once(engine, 0, "replication_done", 1)["replication_done"] == 1  # (counted after the commit)
        assert engine.check() == []


def test_damaged_on_every_tier_is_a_miss_never_wrong_bytes(tier_dirs):
    engine, pages, keys = stored(tier_dirs[:2], 2)
    with engine:
        for tier in (0, 1):
            _flip_on_disk(engine, tier, keys[0], HEADER_SIZE + 5)
        for a in pages.dst[0]:
            a[:] = 0
        assert engine.get(keys, pages.dst_segments) == [False, True]
        assert not engine.contains(keys[0])
        assert engine.check() == []


def test_transfer_corruption_is_retried_and_the_intact_file_kept(tier_dirs, io_engine):
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 2, io_engine, plan)
    with engine:
        plan.on(tier_dirs[0], Fault.corrupt(), opcode=OP_READ, times=1)
        assert engine.get(keys, pages.dst_segments, policy=SingleTier(0)) == [True, True]
        assert pages.equal(0) and pages.equal(1)
        t0 = engine.stats()["tiers"][0]
        assert t0["corrupted"] == 1 and t0["quarantined"] == 0
        assert engine.index.holders(keys[0]) == 0b11


def test_truncated_file_is_not_served(tier_dirs):
    engine, pages, keys = stored(tier_dirs[:2], 2)
    with engine:
        os.truncate(engine.tiers[0].layout.page_path(keys[1]), HEADER_SIZE + 4096)
        assert engine.get(keys, pages.dst_segments, policy=SingleTier(0)) == [True, True]
        assert pages.equal(1)
        assert engine.stats()["tiers"][0]["quarantined"] == 1
        assert engine.check() == []


# -- tier failure and recovery ----------------------------------------------------------------
def test_read_errors_fail_the_tier_until_a_probe_succeeds(tier_dirs, io_engine, caplog):
    plan = TierFaultPlan()
    clock = FakeClock()
    engine, pages, keys = stored(tier_dirs[:2], 6, io_engine, plan, clock=clock)
    with engine:
        plan.on(tier_dirs[0], Fault.error(errno.EIO), opcode=OP_READ, times=1)
        assert engine.get(keys, pages.dst_segments) == [True] * 6  # retried on tier 1
        assert all(pages.equal(i) for i in range(6))
        stats = engine.stats()
        assert not stats["tiers"][0]["healthy"] and stats["tiers"][0]["errors"] == 1
        assert stats["tiers"][0]["replica_retries"] >= 1
        more = Pages(2, seed=5)
        new_keys = [key(i, "more") for i in range(2)]
        assert engine.put(new_keys, more.src_segments) == [True, True]  # tier 1 only
        assert engine.stats()["under_replicated"] == 2
        assert engine.index.holders(new_keys[0]) == 0b10
        assert [r.message for r in caplog.records].count(
            next(r.message for r in caplog.records if "failed" in r.message)) == 1  # logged once
        clock.now += 10  # past the back-off: the next call probes tier 0, which works again
        assert engine.get(keys, pages.dst_segments) == [True] * 6
        assert engine.stats()["tiers"][0]["healthy"]
        assert any("recovered" in r.message for r in caplog.records)
        assert engine.check() == []


def test_write_errors_count_the_missing_replica(tier_dirs, io_engine):
    plan = TierFaultPlan()
    engine = make_engine(tier_dirs[:2], io_engine, fault_plan=plan)
    with engine:
        pages = Pages(3)
        keys = [key(i, "w") for i in range(3)]
        plan.on(tier_dirs[1], Fault.error(errno.EIO), opcode=OP_WRITE)
        assert engine.put(keys, pages.src_segments) == [True] * 3
        stats = engine.stats()
        assert stats["under_replicated"] == 3 and not stats["tiers"][1]["healthy"]
        assert stats["tiers"][1]["write_failures"] >= 1
        assert engine.get(keys, pages.dst_segments) == [True] * 3 and pages.equal(2)
        assert engine.check() == []
        assert tmp_files(tier_dirs[1]) == []  # failed temp files removed (helpers.tmp_files: the mark aside)


def test_tier_directory_removed_then_recreated(tier_dirs, io_engine):
    clock = FakeClock()
    engine, pages, keys = stored(tier_dirs[:2], 4, io_engine, clock=clock)
    with engine:
        shutil.rmtree(os.path.join(tier_dirs[0], "kvstream"))
        assert engine.get(keys, pages.dst_segments) == [True] * 4
        assert all(pages.equal(i) for i in range(4))
        assert not engine.stats()["tiers"][0]["healthy"]
        more = Pages(1, seed=9)
        assert engine.put([key(0, "x")], more.src_segments) == [True]
        assert not os.path.exists(os.path.join(tier_dirs[0], "kvstream"))  # never re-created by the engine
        clock.now += 10
        assert engine.get(keys[:1], pages.dst_segments[:1]) == [True]
        assert not engine.stats()["tiers"][0]["healthy"]  # still gone: stays out
        os.mkdir(os.path.join(tier_dirs[0], "kvstream"))  # the operator restores it (e.g. remount)
        clock.now += 1000
        later = Pages(1, seed=10)  # (held across the put: its segments are this object's memory)
        assert engine.put([key(1, "x")], later.src_segments) == [True]
        assert engine.stats()["tiers"][0]["healthy"]
        assert engine.index.holders(key(1, "x")) == 0b11
        # the lost pages are forgotten on rejoin and written there again, with the page put while the
        # tier was out (background replication: 5 copies)
        wait_until(lambda: all(engine.index.holders(k) == 0b11 for k in [*keys, key(0, "x")]),
                   what="the lost pages were never written to tier 0 again")
        assert tier_stats_once(engine, 0, "replication_done", 5)["replication_done"] == 5  # (counted after the commit)
        assert engine.check() == []


# -- full disk -----------------------------------------------------------------------------------
def test_enospc_evicts_lru_and_retries(tier_dirs, io_engine):
    plan = TierFaultPlan()
    # (no catch-up: the start-up sweep, if the puts kept it back until the eviction, owes the evicted
    # page to tier 0 and writes it back in idle time, racing the look at the holders)
    engine, pages, keys = stored(tier_dirs[:2], 4, io_engine, plan, catchup=False)
    with engine:
        plan.on(tier_dirs[0], Fault.error(errno.ENOSPC), opcode=OP_WRITE, times=1)
        more = Pages(1, seed=3)
        k = key(0, "new")
        assert engine.put([k], more.src_segments) == [True]
        stats = engine.stats()
        assert engine.index.holders(k) == 0b11 and stats["under_replicated"] == 0
        assert stats["tiers"][0]["evictions"] == 1 and stats["tiers"][0]["healthy"]
        assert engine.index.holders(keys[-1]) == 0b10  # the least recent page (the batch's tail) made room
        assert engine.check() == []


def test_enospc_with_nothing_to_free_fails_that_tier_only(tier_dirs, io_engine):
    plan = TierFaultPlan().on(tier_dirs[0], Fault.error(errno.ENOSPC), opcode=OP_WRITE)
    engine = make_engine(tier_dirs[:2], io_engine, fault_plan=plan)
    with engine:
        pages = Pages(2)
        keys = [key(i, "full") for i in range(2)]
        assert engine.put(keys, pages.src_segments) == [True, True]
        stats = engine.stats()
        assert stats["under_replicated"] == 2 and stats["tiers"][0]["write_failures"] == 2
        assert stats["tiers"][0]["healthy"]  # a full tier is not a failed tier
        assert engine.get(keys, pages.dst_segments) == [True, True] and pages.equal(1)
        assert engine.check() == []


def test_many_batches_with_random_read_faults_never_serve_wrong_bytes(tier_dirs):
    """Reads fail or corrupt at random on both tiers; every page returned True is byte-exact."""
    rng = np.random.default_rng(7)

    class RandomPlan(FaultPlan):
        def decide(self, opcode, fd, offset, length):
            if opcode != OP_READ:
                return None
            r = rng.random()
            return Fault.corrupt() if r < 0.1 else Fault.error(errno.EAGAIN) if r < 0.2 else None

    engine, pages, keys = stored(tier_dirs[:2], 6, plan=RandomPlan())
    with engine:
        for _ in range(8):
            dst = pages.fresh()
            ok = engine.get(keys, segments_of(dst))
            assert all(pages.equal(i, dst) for i in range(6) if ok[i])
        assert engine.stats()["tiers"][0]["corrupted"] + engine.stats()["tiers"][1]["corrupted"] > 0


# -- crash mid-write -------------------------------------------------------------------------------
WRITER = r"""
import sys, hashlib, numpy as np
from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.io import AlignedBuffer
dirs = sys.argv[1:]
engine = Engine(Config.from_sources({"tiers": dirs, "chunk": "64K"}, environ={}), Namespace({"model": "crash"}))
bufs = [AlignedBuffer(256 << 10) for _ in range(8)]
for batch in range(10_000):
    keys = [hashlib.sha256(f"{batch}-{i}".encode()).hexdigest() for i in range(8)]
    for i, b in enumerate(bufs):
        np.frombuffer(b, dtype=np.uint8)[:] = (batch * 8 + i) % 251
    if all(engine.put(keys, [[(b.address, b.nbytes)] for b in bufs])):
        print(batch, flush=True)
"""


def test_sigkill_during_writes_loses_no_acknowledged_page(tier_dirs):
    import signal
    import subprocess
    import sys

    from kvstream_hicache import Config, Engine, Namespace

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, *tier_dirs[:2]], stdout=subprocess.PIPE, text=True,
                            env=env)
    acked = []
    try:
        for line in proc.stdout:
            acked.append(int(line))
            if len(acked) == 6:
                proc.send_signal(signal.SIGKILL)  # mid-stream: the next batch is in flight
                break
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes its stdout
    assert len(acked) == 6
    import hashlib

    config = Config.from_sources({"tiers": tier_dirs[:2], "chunk": "64K"}, environ={})
    with Engine(config, Namespace({"model": "crash"})) as engine:
        for batch in acked:
            keys = [hashlib.sha256(f"{batch}-{i}".encode()).hexdigest() for i in range(8)]
            dst = [np.zeros(256 << 10, dtype=np.uint8) for _ in range(8)]
            assert engine.get(keys, [[(d.ctypes.data, d.nbytes)] for d in dst]) == [True] * 8
            assert all((d == (batch * 8 + i) % 251).all() for i, d in enumerate(dst))
        assert engine.check() == []  # temporary leftovers were cleaned at start-up, nothing torn is indexed


# -- a real full file system -----------------------------------------------------------------------
@pytest.fixture
def small_fs(tier_root):
    """A 24 MiB ext4 file system on a loop device (root only), removed afterwards."""
    import subprocess

    if os.geteuid() != 0 or not shutil.which("losetup") or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root, losetup and mkfs.ext4 for a small loop-device file system")
    image = os.path.join(tier_root, "small.img")
    with open(image, "wb") as f:
        f.truncate(24 << 20)
    mnt = os.path.join(tier_root, "small")
    os.mkdir(mnt)
    dev = subprocess.run(["losetup", "--find", "--show", image], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", dev], check=True, capture_output=True)
        subprocess.run(["mount", dev, mnt], check=True, capture_output=True)
        try:
            yield mnt
        finally:
            subprocess.run(["umount", mnt], check=False)
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def test_real_enospc_evicts_lru_then_fails_that_tier_only(small_fs, tier_dirs, io_engine):
    engine = make_engine([small_fs, tier_dirs[0]], io_engine)
    with engine:
        pages = Pages(4, size=1 << 20)
        written = []
        for batch in range(12):  # 48 MiB into a 24 MiB file system, no capacity configured
            keys = [key(i, f"enospc{batch}") for i in range(4)]
            assert engine.put(keys, pages.src_segments) == [True] * 4
            written += keys
        t0 = engine.stats()["tiers"][0]
        assert t0["healthy"] and t0["evictions"] > 0
        assert engine.index.holders(written[-1]) == 0b11  # the newest pages are on the full tier
        assert engine.get(written[-4:], pages.dst_segments, policy=SingleTier(0)) == [True] * 4
        assert engine.last_batch["tiers"][1]["bytes"] == 0 and pages.equal(3)
        assert engine.check() == []

        # Now fill the file system with a file that is not ours: eviction cannot free anything.
        engine.clear()
        with open(os.path.join(small_fs, "ballast"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        keys = [key(i, "after-ballast") for i in range(2)]
        evictions = engine.stats()["tiers"][0]["evictions"]
        assert engine.put(keys, pages.src_segments[:2]) == [True, True]  # stored on tier 1
        t0 = engine.stats()["tiers"][0]
        assert t0["healthy"] and t0["write_failures"] >= 2
        assert [engine.index.holders(k) for k in keys] == [0b10, 0b10]
        # Owed to tier 0 now (background replication): its copies meet the same full file system and
        # stay owed, never evicting, never leaving a temporary file behind, until the file system has
        # room again (before: dropped, and never written while the engine ran).
        wait_until(lambda: engine._replicas._next[0] > 0, 60, "catch-up never looked at the full tier")
        assert [engine.index.holders(k) for k in keys] == [0b10, 0b10]
        assert engine.stats()["replication_pending"] == 2 and engine.stats()["tiers"][0]["evictions"] == evictions
        assert tmp_files(small_fs) == []  # (the engine's mark may be there: its catch-up still writes to the tier)
        os.unlink(os.path.join(small_fs, "ballast"))
        wait_until(lambda: [engine.index.holders(k) for k in keys] == [0b11, 0b11], 60,
                   "the owed copies never reached the tier once it had room")
        assert engine.stats()["tiers"][0]["replication_dropped"] == 0 and tmp_files(small_fs) == []
        assert engine.check() == []


def test_a_get_counts_one_read_timeout_whatever_its_second_chance_finds(tier_dirs):
    """read_timeout bounds the whole get (design.md, Bounded reads): the second chance (a failed tier
    that holds the missed pages, probed after the first pass) reads only within what is left of it.
    Before, it read with a read_timeout of its own: a get whose tiers both stall took two."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 2, plan=plan, read_timeout=0.3, replicate="all")
    with engine:
        engine.tiers[1].fail(errno.EIO, "test: failed before the get")  # answers a probe: second chance
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ).on(tier_dirs[1], Fault.hold(), opcode=OP_READ)
        assert engine.get(keys, pages.dst_segments) == [False] * 2
        assert engine.stats()["read_timeouts"] == 1
        plan.clear()
        plan.release()
        assert engine._reads.drain(30) == 0
        assert engine.get(keys, pages.dst_segments) == [True] * 2 and pages.equal(1)


def test_a_stalled_tiers_late_reads_count_in_its_bytes_read(tier_dirs):
    """design.md, Stats: a tier's bytes_read and blocks_read count every transfer. Reads a stalled tier
    completes after its get returned (orphans) counted in blocks_read and requests, and never in
    bytes_read (added only for the calls a get records): a tier that moved 21 blocks read 0 bytes."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:3], 12, plan=plan, replicate="all")
    with engine:
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_READ)
        assert engine.get(keys, pages.dst_segments) == [True] * 12  # tiers 0 and 2 deliver it all
        assert all(pages.equal(i) for i in range(12)) and engine.stats()["orphan_reads_in_flight"] > 0
        plan.clear()
        plan.release()
        assert engine._reads.drain(30) == 0
        tier1 = engine.stats()["tiers"][1]
        assert tier1["blocks_read"] > 0 and tier1["bytes_read"] >= tier1["blocks_read"] * ARRAY_CHUNK, tier1
