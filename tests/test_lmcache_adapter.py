"""The LMCache L2 adapter driven by LMCache 0.5.6's real MP StorageManager (on CPU, in .venv-lmcache).

Every test writes through L1 (reserve_write -> fill -> finish_write: LMCache's store controller hands
the objects to the adapter, which replicates them through the engine), drops L1, prefetches back (lookup
and lock, then a load task straight into fresh L1 buffers) and compares bytes. Faults are injected at
the engine's ring (``FaultPlan``) or on disk; each test ends with the engine's own ``check()``.

Run: ``.venv-lmcache/bin/python -m pytest -q -m lmcache tests/test_lmcache_adapter.py``
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import time

import numpy as np
import pytest

from kvstream_hicache.lmcache import core as l2core, keys as l2keys
from kvstream_hicache.faults import Fault, FaultPlan
from kvstream_hicache.io import OP_READ
from kvstream_hicache.layout import HEADER_SIZE, Namespace

from helpers import flip_byte, lockable, uring_available
from lmcache_fixtures import (  # noqa: F401  (lmc, server_factory: fixtures)
    L1_GB, WAIT_S, Server, chunk_keys, layout_of, lmc, make_tiers, page_path, random_payloads, server_factory,
)

# opentelemetry (imported by LMCache) warns about its own LoggingHandler: not ours to fix
pytestmark = [pytest.mark.lmcache, pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

# --------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("n_tiers", [2, 3])
@pytest.mark.parametrize("heads_dim", [128, 104], ids=["8KiB", "6.5KiB-padded"])
def test_round_trip_through_l1_and_l2(lmc, server_factory, tier_root, n_tiers, heads_dim):
    tiers = make_tiers(tier_root, n_tiers)
    server = server_factory(tiers)
    layout = layout_of(lmc, 16, heads_dim)
    keys = chunk_keys(lmc, 6)
    size = 4 * 16 * heads_dim  # 8192, or 6656: not a multiple of 4096, L1 pads the object to 8192
    payloads = random_payloads(len(keys), size, seed=n_tiers)
    server.write_through(keys, layout, payloads)

    engine = server.engine
    for key in keys:  # replicated: every tier holds every page
        for tier in tiers:
            assert os.path.exists(page_path(server, tier, key, layout))
    hits, got = server.prefetch(keys, layout)
    assert hits == len(keys)
    assert got == payloads
    status = server.adapter.report_status()
    assert status["errors"] == 0 and status["locked_keys"] == 0  # every lock was released
    assert status["load_failed_pages"] == 0
    assert engine.stats()["pages"] == len(keys)
    assert engine.check() == []


def test_loads_land_in_lmcache_l1_in_place_on_one_tier(lmc, server_factory, tier_root):
    """LMCache's L1 arena, as its StorageManager builds it, is registered with the engine's read ring
    when LMCache creates the adapter, so a chunk one tier alone holds loads straight into L1: every
    byte served is read in place (no staging copy), and the bytes are exact."""
    if not uring_available():
        pytest.skip("io_uring_setup refused on this host: no registered memory")
    lockable(int(float(L1_GB) * 2**30))
    server = server_factory(make_tiers(tier_root, 1))
    engine = server.engine
    assert engine._reads.io.ring.fixed_bytes > 0  # (the arena, pinned once)
    layout = layout_of(lmc, 16, 128)
    keys = chunk_keys(lmc, 4)
    payloads = random_payloads(len(keys), 8192, seed=5)
    server.write_through(keys, layout, payloads)
    assert server.prefetch(keys, layout) == (len(keys), payloads)
    tier = engine.stats()["tiers"][0]
    assert tier["bytes_served"] == tier["bytes_in_place"] == len(keys) * 8192
    assert engine.check() == []


@pytest.mark.parametrize("shared,stable,registered", [
    (True, None, "all"),  # LMCache's POSIX-shm arena: no stable size named, allocated whole
    (False, "half", "half"),  # a lazy arena: the prefix pinned so far
    (False, None, "none"),  # a lazy arena not grown yet: its final size is not allocated
], ids=["shm-arena", "lazy-prefix", "lazy-empty"])
def test_the_l1_range_registered_is_the_one_that_stays(tier_root, shared, stable, registered):
    """What the adapter registers of the L1 arena LMCache describes (``L1MemoryDesc``): the stable
    range where LMCache names one; else the whole arena only if it is shared memory, never a private
    arena that may still grow (pinning it would allocate all of it at start)."""
    import mmap

    if not uring_available():
        pytest.skip("io_uring_setup refused on this host: no registered memory")

    from lmcache.v1.distributed.internal_api import L1MemoryDesc

    from kvstream_hicache.lmcache.adapter import KVStreamL2Adapter, _shared_mapping

    size = 8 << 20
    lockable(size)
    arena = mmap.mmap(-1, size, flags=(mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | mmap.MAP_ANONYMOUS)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    assert _shared_mapping(ptr, size) == shared
    desc = L1MemoryDesc(ptr=ptr, size=size, align_bytes=4096,
                        stable_registration_size=size // 2 if stable == "half" else None)
    adapter = KVStreamL2Adapter({"tiers": make_tiers(tier_root, 1)}, desc)
    try:
        fixed = adapter.engine._reads.io.ring.fixed_bytes
        assert fixed == {"all": size, "half": size // 2, "none": 0}[registered]
    finally:
        adapter.close()
        arena.close()


def test_shared_mapping_means_the_whole_range():
    """A range counts as shared memory only if shared mappings cover all of it: a shared first page
    followed by private memory is not (its private tail would be allocated and pinned)."""
    import mmap

    from kvstream_hicache.lmcache.adapter import _shared_mapping

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    rw, private = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    base = libc.mmap(None, 3 * page, rw, private, -1, 0)
    try:  # page 0 shared, pages 1-2 private
        assert libc.mmap(base, page, rw, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | 0x10, -1, 0) == base  # MAP_FIXED
        assert _shared_mapping(base, page) and not _shared_mapping(base, 2 * page)
        assert not _shared_mapping(base + page, page)
    finally:
        libc.munmap(base, 3 * page)


def test_old_module_path_loads_the_same_adapter(lmc, server_factory, tier_root):
    """Configurations written before the layout changed name ``kvstream_hicache.lmcache_adapter``: LMCache
    loads the very same class from it, and it serves."""
    from kvstream_hicache import lmcache_adapter
    from kvstream_hicache.lmcache import adapter

    server = server_factory(make_tiers(tier_root, 2), module_path="kvstream_hicache.lmcache_adapter")
    assert type(server.adapter) is adapter.KVStreamL2Adapter is lmcache_adapter.KVStreamL2Adapter
    layout = layout_of(lmc, 16, 128)
    keys = chunk_keys(lmc, 2)
    payloads = random_payloads(len(keys), 4 * 16 * 128, seed=7)
    server.write_through(keys, layout, payloads)
    assert server.prefetch(keys, layout) == (len(keys), payloads)


def test_lookup_answers_from_the_index_and_pins(lmc, server_factory, tier_root):
    server = server_factory(make_tiers(tier_root, 2))
    layout = layout_of(lmc, 16, 128)
    keys = chunk_keys(lmc, 3)
    server.write_through(keys, layout, random_payloads(3, 8192, seed=1))
    adapter = server.adapter
    other = chunk_keys(lmc, 1, model="other/model")  # same chunk hash, another model: a miss
    other_rank = chunk_keys(lmc, 1, rank=1)
    other_layout = {0: lmc.MemoryLayoutDesc(shapes=[lmc.torch.Size([2, 16, 64])], dtypes=[lmc.torch.bfloat16])}

    probe = keys + other + other_rank
    task = adapter.submit_lookup_and_lock_task(probe, {0: layout})
    bits = adapter.query_lookup_and_lock_result(task)
    assert [bits.test(i) for i in range(len(probe))] == [True, True, True, False, False]
    assert adapter.query_lookup_and_lock_result(task) is None  # handed out once
    task = adapter.submit_lookup_and_lock_task(keys[:1], other_layout)  # the layout is a hint: still a hit
    assert adapter.query_lookup_and_lock_result(task).test(0)
    adapter.submit_unlock(keys[:1])

    index = server.engine.index
    ekeys = [l2keys.engine_key(k) for k in keys]
    assert [index.get(k).pins for k in ekeys] == [1, 1, 1]
    adapter.submit_unlock(keys + other)  # unlock of keys never locked: ignored, never raises
    adapter.submit_unlock(keys)  # more unlocks than locks: ignored too
    assert [index.get(k).pins for k in ekeys] == [0, 0, 0]
    assert adapter.report_status()["errors"] == 0


def test_a_chunk_another_server_stored_is_prefetched(lmc, server_factory, tier_root):
    """Another server of the model (an engine of the same namespace) stores chunks on the shared tiers
    after this one started: its index never listed them, yet LMCache's lookup finds them on disk and
    they load exact (docs/guarantees.md: processes sharing a tier find each other's pages)."""
    from kvstream_hicache.engine import Engine
    from kvstream_hicache.config import Config

    tiers = make_tiers(tier_root, 2)
    server = server_factory(tiers)
    layout, keys = layout_of(lmc, 16, 128), chunk_keys(lmc, 3)
    payloads = random_payloads(len(keys), 8192, seed=50)
    bufs = [np.frombuffer(p, dtype=np.uint8).copy() for p in payloads]
    with Engine(Config.from_sources({"tiers": tiers}, {}), Namespace(l2keys.namespace_fields())) as theirs:
        assert all(theirs.put([l2keys.engine_key(k) for k in keys], [[(b.ctypes.data, b.nbytes)] for b in bufs]))
    assert server.prefetch(keys, layout) == (len(keys), payloads)



def test_a_chunk_another_server_stored_counts_in_the_usage_once_its_prefetch_writes_this_server_s_copy(
        lmc, server_factory, tier_root):
    """Another server stores chunks on the shared tier 1; this server (a private tier 0) prefetches them: the read
    promotes each to tier 0, a copy of this server's that LMCache's eviction (delete()) evicts. LMCache's usage must
    count it (LMCache loaded it: its ObjectKey is known), else it said 0 while tier 0 held the chunks, which its
    eviction could never free."""
    from kvstream_hicache.engine import Engine
    from kvstream_hicache.config import Config

    b0, shared = make_tiers(tier_root, 2)
    server = server_factory([b0, shared])
    layout, keys = layout_of(lmc, 16, 128), chunk_keys(lmc, 3)
    payloads = random_payloads(len(keys), 8192, seed=51)
    bufs = [np.frombuffer(p, dtype=np.uint8).copy() for p in payloads]
    ekeys = [l2keys.engine_key(k) for k in keys]
    with Engine(Config.from_sources({"tiers": [shared]}, {}), Namespace(l2keys.namespace_fields())) as theirs:
        assert all(theirs.put(ekeys, [[(b.ctypes.data, b.nbytes)] for b in bufs]))
    assert server.prefetch(keys, layout) == (len(keys), payloads)
    deadline = time.monotonic() + WAIT_S
    while not all(server.engine.holds_own(e) for e in ekeys):  # (promoted to tier 0 behind the reads)
        assert time.monotonic() < deadline, server.engine.stats()["tiers"][0]
        time.sleep(0.05)
    assert server.adapter.get_usage().total_bytes_used == sum(map(len, payloads))


def test_after_a_restart_the_chunks_stored_before_are_prefetched_at_once(lmc, server_factory, tier_root):
    """A restarted server serves before its start-up scan has read a file: LMCache's lookup finds the
    chunks stored before the restart on disk."""
    tiers = make_tiers(tier_root, 2)
    layout, keys = layout_of(lmc, 16, 128), chunk_keys(lmc, 3)
    payloads = random_payloads(len(keys), 8192, seed=51)
    first = Server(lmc, tiers)
    first.write_through(keys, layout, payloads)
    first.close()
    server = server_factory(tiers, scan_rate=0.001)  # the scan reads no file while the test runs
    assert server.prefetch(keys, layout) == (len(keys), payloads)
    assert server.engine.stats()["discovered"] == len(keys)


def test_tier_lost_mid_batch(lmc, server_factory, tier_root, monkeypatch):
    """Tier 1 of 3 serves a few reads, then fails with EIO for the rest of the batch: every page
    still arrives (from the other replicas), and the tier is marked failed."""
    tiers = make_tiers(tier_root, 3)
    plan = TierDeath(tiers[1], after_reads=2)
    monkeypatch.setattr(l2core, "_open_engine", engine_opener(fault_plan=plan))
    server = server_factory(tiers)
    layout = layout_of(lmc, 64, 128)  # 32 KiB pages: 8 routing blocks each
    keys = chunk_keys(lmc, 8)
    payloads = random_payloads(len(keys), 4 * 64 * 128, seed=7)
    server.write_through(keys, layout, payloads)

    hits, got = server.prefetch(keys, layout)
    assert hits == len(keys) and got == payloads
    assert plan.failed_reads > 0  # the tier really died mid-batch
    stats = server.engine.stats()
    assert not stats["tiers"][1]["healthy"]
    assert server.adapter.report_status()["load_failed_pages"] == 0


def test_tier_directory_removed_between_store_and_load(lmc, server_factory, tier_root):
    tiers = make_tiers(tier_root, 3)
    server = server_factory(tiers)
    layout = layout_of(lmc, 16, 128)
    keys = chunk_keys(lmc, 5)
    payloads = random_payloads(len(keys), 8192, seed=3)
    server.write_through(keys, layout, payloads)
    shutil.rmtree(os.path.join(tiers[0], "kvstream"))  # the fastest tier is gone (unmounted, wiped)
    hits, got = server.prefetch(keys, layout)
    assert hits == len(keys) and got == payloads


@pytest.mark.parametrize("damaged_on", ["one", "all"])
def test_damaged_page_is_never_served(lmc, server_factory, tier_root, damaged_on):
    tiers = make_tiers(tier_root, 2)
    # Reads go to tier 1 first (the damaged copy is certainly read), falling back to tier 0 per block.
    server = server_factory(tiers, policy="tier1")
    layout = layout_of(lmc, 16, 128)
    keys = chunk_keys(lmc, 4)
    payloads = random_payloads(len(keys), 8192, seed=11)
    server.write_through(keys, layout, payloads)
    victim = len(keys) - 1  # the last chunk, so the prefix before it still loads
    for tier in tiers if damaged_on == "all" else tiers[1:]:
        flip_byte(page_path(server, tier, keys[victim], layout), HEADER_SIZE + 5000, 0xFF)

    hits, got = server.prefetch(keys, layout)
    assert got[:victim] == payloads[:victim]
    if damaged_on == "one":
        assert hits == len(keys) and got[victim] == payloads[victim]  # served from the intact replica
    else:
        assert got[victim] is None  # never served: not resident in L1 at all
        assert server.adapter.report_status()["load_failed_pages"] >= 1
    assert sum(t["quarantined"] for t in server.engine.stats()["tiers"]) >= 1
    assert server.engine.check() == []  # the damaged copies were removed


def test_submit_never_raises_into_lmcache(lmc, server_factory, tier_root, monkeypatch):
    """An exception inside the engine is a per-task failure, a warning and a counter."""
    server = server_factory(make_tiers(tier_root, 2))
    layout = layout_of(lmc, 16, 128)
    keys = chunk_keys(lmc, 2)
    payloads = random_payloads(len(keys), 8192, seed=5)
    server.write_through(keys, layout, payloads)

    def boom(*_a, **_k):
        raise RuntimeError("injected")

    monkeypatch.setattr(server.engine, "get", boom)
    hits, got = server.prefetch(keys, layout)
    assert got == [None, None]
    assert server.adapter.report_status()["errors"] >= 1
    monkeypatch.undo()
    hits, got = server.prefetch(keys, layout)  # the adapter keeps working afterwards
    assert got == payloads


# -------------------------------------------------------------------------------- deferred writes (M2)
def write_l1(server: Server, keys, layout, payloads) -> None:
    """L1 write only: LMCache's store controller hands the objects to the adapter; nothing is awaited."""
    objs = server.sm.reserve_write(keys, layout)
    for key, data in zip(keys, payloads):
        np.frombuffer(objs[key].byte_array, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    server.sm.finish_write(keys)


def lookup(server: Server, keys, layout) -> list[bool]:
    adapter = server.adapter
    bits = adapter.query_lookup_and_lock_result(adapter.submit_lookup_and_lock_task(keys, {0: layout}))
    adapter.submit_unlock(keys)
    return [bits.test(i) for i in range(len(keys))]


def test_store_task_completes_only_when_its_pages_are_committed(lmc, server_factory, tier_root, monkeypatch):
    """The store task is queued in the engine; while its writes are held in the ring it is not
    complete (LMCache keeps its L1 objects read-locked) and lookups miss; once committed it completes,
    lookups hit and the bytes load back."""
    from kvstream_hicache.faults import TierFaultPlan
    from kvstream_hicache.io import OP_WRITE
    from helpers import wait_for_fault

    tiers = make_tiers(tier_root, 2)
    plan = TierFaultPlan()
    monkeypatch.setattr(l2core, "_open_engine", engine_opener(fault_plan=plan))
    server = server_factory(tiers)
    layout = layout_of(lmc, 16, 128)
    keys = chunk_keys(lmc, 4)
    payloads = random_payloads(len(keys), 8192, seed=21)
    for tier in tiers:
        plan.on(tier, Fault.hold(), opcode=OP_WRITE)
    try:
        write_l1(server, keys, layout, payloads)
        wait_for_fault(plan, WAIT_S, "the store's writes never reached the ring")
        status = server.adapter.report_status()
        assert status["store_tasks"] == 0 and status["queued_stores"] == 1
        assert lookup(server, keys, layout) == [False] * 4  # queued, not committed: not visible
    finally:
        plan.clear()
        plan.release()
    assert server.adapter.core.wait_completed("store", 1, WAIT_S)
    assert server.adapter.report_status()["stored_pages"] == 4
    assert lookup(server, keys, layout) == [True] * 4
    server.drop_l1(keys)
    assert server.prefetch(keys, layout) == (len(keys), payloads)
    assert server.engine.check() == []


def test_store_tasks_beyond_the_backlog_wait_and_none_is_lost(lmc, server_factory, tier_root, monkeypatch):
    """write_backlog of two pages, writes held: LMCache's store controller waits in submit_store_task
    (back-pressure) instead of a task being dropped; released, every task completes and every page
    loads back."""
    from kvstream_hicache.faults import TierFaultPlan
    from kvstream_hicache.io import OP_WRITE
    from helpers import wait_for_fault

    tiers = make_tiers(tier_root, 2)
    plan = TierFaultPlan()
    monkeypatch.setattr(l2core, "_open_engine", engine_opener(fault_plan=plan))
    server = server_factory(tiers, write_backlog="16K")
    layout = layout_of(lmc, 16, 128)
    batches = [chunk_keys(lmc, 2, salt=f"b{i}") for i in range(3)]
    payloads = [random_payloads(2, 8192, seed=30 + i) for i in range(3)]
    plan.on(tiers[0], Fault.hold(), opcode=OP_WRITE)
    try:
        # The first batch is a store task of its own, held, before the others come (LMCache joins L1
        # writes that queue up into one task, and one task alone is never held back: it would wait
        # for nothing)
        write_l1(server, batches[0], layout, payloads[0])
        wait_for_fault(plan, WAIT_S, "the store's writes never reached the ring")
        for keys, data in zip(batches[1:], payloads[1:]):
            write_l1(server, keys, layout, data)
        deadline = time.monotonic() + WAIT_S
        while not server.engine.stats()["backpressure_waits"]:
            assert time.monotonic() < deadline, "no store task waited for the backlog"
            time.sleep(0.005)
        assert server.adapter.report_status()["store_tasks"] == 0
    finally:
        plan.clear()
        plan.release()
    # (LMCache's store controller may join L1 writes that queue up into one task: count pages)
    deadline = time.monotonic() + WAIT_S
    while server.adapter.report_status()["stored_pages"] < 6:
        assert time.monotonic() < deadline, "a store task never completed"
        time.sleep(0.005)
    status = server.adapter.report_status()
    assert status["store_failed_pages"] == 0 and status["stored_pages"] == 6 and status["queued_stores"] == 0
    for keys, data in zip(batches, payloads):
        server.drop_l1(keys)
        assert server.prefetch(keys, layout) == (len(keys), data)


def test_a_store_whose_tiers_hang_fails_within_write_timeout_and_close_returns(lmc, tier_root, monkeypatch):
    """Every tier hangs in its writes (a FUSE tier): the store task completes, failed, once write_timeout
    passes, its chunks miss, and LMCache's shutdown returns with the writes still held."""
    from kvstream_hicache.faults import TierFaultPlan
    from kvstream_hicache.io import OP_WRITE

    tiers = make_tiers(tier_root, 2)
    plan = TierFaultPlan()
    monkeypatch.setattr(l2core, "_open_engine", engine_opener(fault_plan=plan))
    server = Server(lmc, tiers, write_timeout=0.5)
    layout, keys = layout_of(lmc, 16, 128), chunk_keys(lmc, 2)
    for tier in tiers:
        plan.on(tier, Fault.hold(), opcode=OP_WRITE)
    try:
        write_l1(server, keys, layout, random_payloads(len(keys), 8192, seed=52))
        assert server.adapter.core.wait_completed("store", 1, WAIT_S)
        status = server.adapter.report_status()
        assert status["store_failed_pages"] == 2 and status["queued_stores"] == 0
        assert lookup(server, keys, layout) == [False, False]
        plan.clear()
        t0 = time.monotonic()
        server.close()
        assert time.monotonic() - t0 < 10
    finally:
        plan.release()


def test_status_is_unhealthy_while_every_tier_is_failed(lmc, server_factory, tier_root, monkeypatch):
    from kvstream_hicache.faults import TierFaultPlan
    from kvstream_hicache.io import OP_WRITE

    tiers = make_tiers(tier_root, 2)
    plan = TierFaultPlan()
    monkeypatch.setattr(l2core, "_open_engine", engine_opener(fault_plan=plan))
    server = server_factory(tiers, tier_retry=0.2)
    layout = layout_of(lmc, 16, 128)
    for tier in tiers:
        plan.on(tier, Fault.error(errno.EIO), opcode=OP_WRITE)
    write_l1(server, chunk_keys(lmc, 1), layout, random_payloads(1, 8192, seed=53))
    assert server.adapter.core.wait_completed("store", 1, WAIT_S)
    assert not server.adapter.report_status()["is_healthy"]
    plan.clear()
    time.sleep(0.3)  # past tier_retry: the next store probes the tiers, and they are back
    server.stores = 1
    server.write_through(chunk_keys(lmc, 1, salt="b"), layout, random_payloads(1, 8192, seed=54))
    assert server.adapter.report_status()["is_healthy"]


# ------------------------------------------------------------------------------------ helpers
def engine_opener(**kwargs):
    from kvstream_hicache.engine import Engine

    def open_engine(config, namespace):
        return Engine(config, namespace, **kwargs)

    return open_engine


class TierDeath(FaultPlan):
    """Reads from files under ``root`` succeed ``after_reads`` times, then fail with EIO."""

    def __init__(self, root: str, after_reads: int):
        super().__init__()
        self.root = os.path.realpath(root) + os.sep
        self.after_reads = after_reads
        self.ok_reads = 0
        self.failed_reads = 0

    def decide(self, opcode, fd, offset, length):
        if opcode != OP_READ or not fd_path(fd).startswith(self.root):
            return None
        with self._lock:
            if self.ok_reads < self.after_reads:
                self.ok_reads += 1
                return None
            self.failed_reads += 1
        return Fault.error(errno.EIO)


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_namespace_keeps_integration_apart():
    assert Namespace(l2keys.namespace_fields()).digest != Namespace(l2keys.namespace_fields({"deployment": "b"})).digest
    fields = l2keys.namespace_fields({"integration": "sglang"})  # cannot be overridden
    assert fields["integration"] == l2keys.INTEGRATION
