"""The LMCache adapter's machinery without LMCache's controllers: key mapping, lock/unlock, pooled loads,
errors at the boundary, close, bench_read. Real engine on real tier directories.

Run: ``.venv-lmcache/bin/python -m pytest -q -m lmcache tests/test_lmcache_core.py``
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest

from kvstream_hicache.lmcache import adapter as l2adapter, core as l2core, keys as l2keys
from kvstream_hicache.config import Config
from kvstream_hicache.layout import Namespace, is_valid_key
from kvstream_hicache.tools.bench.contenders import bench_read

from helpers import make_engine, run_child, wait_until

# opentelemetry (imported by LMCache) warns about its own LoggingHandler: not ours to fix
pytestmark = [pytest.mark.lmcache, pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

WAIT_S = 30.0
PAGE = 8192


class Pages:
    """Numpy-backed page buffers and their (address, nbytes) segments."""

    def __init__(self, n: int, size: int = PAGE, seed: int | None = None):
        rng = np.random.default_rng(seed)
        self.arrays = [rng.integers(0, 256, size, dtype=np.uint8) if seed is not None else np.zeros(size, np.uint8)
                       for _ in range(n)]
        self.segments = [[(a.ctypes.data, a.nbytes)] for a in self.arrays]


@pytest.fixture
def engine(tier_dirs):
    from kvstream_hicache.engine import Engine

    eng = Engine(Config.from_sources({"tiers": tier_dirs[:2], "chunk": "4K"}, {}),
                 Namespace(l2keys.namespace_fields({"test": "core"})))
    yield eng
    eng.close()


def stored(engine, n: int, seed: int = 1) -> tuple[list[str], Pages]:
    keys = [f"{i:064x}" for i in range(1, n + 1)]
    src = Pages(n, seed=seed)
    assert all(engine.put(keys, src.segments))
    return keys, src


# ------------------------------------------------------------------------------------------- keys
def test_engine_keys_are_valid_and_keep_everything_apart():
    from lmcache.v1.distributed.api import ObjectKey

    def key(**kw):
        base = dict(chunk_hash=b"\x01" * 32, model_name="org/m", kv_rank=0, object_group_id=0, cache_salt="")
        base.update(kw)
        return ObjectKey(**base)

    variants = [l2keys.engine_key(key()), l2keys.engine_key(key(model_name="org/n")),
                l2keys.engine_key(key(kv_rank=1)), l2keys.engine_key(key(object_group_id=1)),
                l2keys.engine_key(key(cache_salt="user1")), l2keys.engine_key(key(chunk_hash=b"\x02" * 32))]
    assert len(set(variants)) == len(variants)
    assert all(is_valid_key(k) and len(k) == 64 for k in variants)
    assert l2keys.engine_key(key()) == l2keys.engine_key(key())  # stable across calls and processes


def test_split_params_separates_adapter_options_from_engine_settings():
    opts, settings = l2keys.split_params({"tiers": ["/a"], "pool_loads": False, "namespace": {"d": 1}, "policy": "tier0"})
    assert opts == {"pool_loads": False, "namespace": {"d": 1}}
    assert settings == {"tiers": ["/a"], "policy": "tier0"}


# --------------------------------------------------------------------------------- lookup / lock
@pytest.mark.leaves_problems("B's index lacks A's chunks it never loaded (index_missing: another process's pages)")
def test_chunks_another_instance_loads_are_spared_by_their_writers_eviction(tier_dirs):
    """Two vLLM instances of one model share a tier: A stores 4 chunks (its capacity), B's LMCache loads 2 of
    them (another process's copies there). A's next stores evict its own least recent chunks but the 2 that B
    loaded since, which B's load worker marked used once idle (Engine.mark_used); before, A evicted them first
    by its own uses alone, and B's next lookups missed chunks it read every request."""
    from kvstream_hicache.engine import Engine

    def start(capacity: str | None) -> Engine:
        settings = {"tiers": tier_dirs[:1], "chunk": "4K", **({"capacity": capacity} if capacity else {})}
        return Engine(Config.from_sources(settings, {}), Namespace(l2keys.namespace_fields({"test": "core"})))

    keys = [f"{i:064x}" for i in range(1, 9)]
    src = Pages(8, seed=3)
    with start(None) as probe:  # (one chunk's bytes on the tier, header included)
        assert probe.put(keys[:1], src.segments[:1]) == [True]
        chunk = probe.index.used[0]
        probe.delete(keys[:1])
    a, b = start(str(4 * chunk)), start(None)
    core = l2core.L2Core(b)
    try:
        for i in range(4):  # one put each: keys[0] is A's least recent
            assert a.put(keys[i:i + 1], src.segments[i:i + 1]) == [True]
        dst = Pages(2)
        assert core.wait_load(core.submit_load(keys[:2], dst.segments), WAIT_S) == [True, True]
        wait_until(lambda: b.stats()["tiers"][0]["used_marks"] == 2, WAIT_S, "B never marked the chunks it loaded")
        assert a.put(keys[4:6], src.segments[4:6]) == [True, True]
        assert [a.contains(k) for k in keys[:4]] == [True, True, False, False]
        assert a.stats()["tiers"][0]["evictions_spared"] == 2
    finally:
        core.close()
        a.close()
        b.close()


def test_a_load_queued_while_the_worker_marks_loaded_chunks_goes_before_the_other_marks(tier_dirs):
    """B's load worker marks the chunks it loaded that A wrote (one metadata write each: a network tier's round
    trip) once no load waits. A load queued during those marks goes after the chunk being marked, not after
    them all: before, it waited for every mark (here the second one is held until the end: the load never ran)."""
    from kvstream_hicache.engine import Engine

    def start() -> Engine:
        settings = {"tiers": tier_dirs[:1], "chunk": "4K"}
        return Engine(Config.from_sources(settings, {}), Namespace(l2keys.namespace_fields({"test": "core"})))

    keys = [f"{i:064x}" for i in range(1, 4)]
    src, dst = Pages(3, seed=4), Pages(3)  # (dst: held while the loads write it)
    a, b = start(), start()
    core = l2core.L2Core(b)
    marking, queued, release = threading.Event(), threading.Event(), threading.Event()
    real = b.tiers[0].mark_used

    def mark_used(key: str):
        if not marking.is_set():
            marking.set()
            queued.wait(WAIT_S)  # (the first mark: until the test queued a load)
        else:
            release.wait(WAIT_S)  # (every later one: held till the end)
        return real(key)

    b.tiers[0].mark_used = mark_used
    try:
        assert a.put(keys, src.segments) == [True] * 3
        assert core.wait_load(core.submit_load(keys[:2], dst.segments[:2]), WAIT_S) == [True, True]
        assert marking.wait(WAIT_S), "B never marked the chunks it loaded"
        later = core.submit_load(keys[2:], dst.segments[2:])
        queued.set()
        assert core.wait_load(later, WAIT_S) == [True], "the load waited for the marks of the chunks before it"
    finally:
        release.set()
        core.close()
        a.close()
        b.close()


def test_lookup_pins_and_unlock_releases(engine):
    keys, _ = stored(engine, 3)
    core = l2core.L2Core(engine)
    try:
        task = core.submit_lookup(keys + ["f" * 64, None])
        assert core.pop_lookup(task) == [True, True, True, False, False]
        assert core.pop_lookup(task) is None
        assert [engine.index.get(k).pins for k in keys] == [1, 1, 1]
        core.submit_lookup(keys[:1])  # locks nest
        core.unlock(keys)
        assert [engine.index.get(k).pins for k in keys] == [1, 0, 0]
        core.unlock(keys + ["nope", None])  # more unlocks than locks, unknown keys: ignored
        assert engine.index.get(keys[0]).pins == 0
        core.submit_lookup(keys)
    finally:
        core.close()  # releases the locks still held
    assert [engine.index.get(k).pins for k in keys] == [0, 0, 0]


def test_a_bad_lock_key_leaves_no_pin_behind(engine):
    """A lookup that fails after pinning (an unhashable lock key) answers all-miss and takes back every
    pin it took; an unlock with an unhashable key among good ones releases the good ones."""
    keys, _ = stored(engine, 2)
    core = l2core.L2Core(engine)
    try:
        task = core.submit_lookup(keys, lock_keys=[keys[0], ["unhashable"]])
        assert core.pop_lookup(task) == [False, False]
        assert [engine.index.get(k).pins for k in keys] == [0, 0] and core.stats()["locked_keys"] == 0
        assert core.pop_lookup(core.submit_lookup(keys)) == [True, True]
        core.unlock([keys[0], ["unhashable"], keys[1]])
        assert [engine.index.get(k).pins for k in keys] == [0, 0] and core.stats()["locked_keys"] == 0
        assert core.stats()["errors"] == 2  # one per bad key, nothing raised
    finally:
        core.close()


class Asked:
    """Delegates to an engine and records its existence queries."""

    def __init__(self, engine):
        self.engine, self.asked = engine, []

    def prefix_len(self, keys):
        self.asked.append(list(keys))
        return self.engine.prefix_len(keys)

    def contains(self, key):
        self.asked.append(key)
        return self.engine.contains(key)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_a_lookup_looks_on_disk_for_what_the_index_lacks_once_per_row(engine, tier_dirs):
    """Another engine of the namespace stores keys after this one started: a lookup finds them on the
    tiers. It asks the engine's prefix query once per row (LMCache: an object group on a kv rank; one
    lookup per tier at the row's first key held nowhere, Engine.prefix_len), never a key of its own:
    rows of 40 absent keys cost two lookups per tier. With ``discover`` off nothing is found once the
    start-up scan is done."""
    from kvstream_hicache.engine import Engine

    blind = Engine(Config.from_sources({"tiers": tier_dirs[:2], "chunk": "4K", "discover": "off"}, {}),
                   engine.namespace)
    assert blind.wait_scan(WAIT_S)
    with Engine(engine.config, engine.namespace) as theirs:
        held, _ = stored(theirs, 3)
    absent = [f"{i:064x}" for i in range(1000, 1080)]
    a, b = held[:2] + absent[:40], held[2:] + absent[40:]
    keys = [k for pair in zip(a, b) for k in pair] + a[len(b):]  # the rows interleaved
    rows = ["a" if k in a else "b" for k in keys]
    for eng, found in ((engine, held), (blind, [])):
        asked = Asked(eng)
        core = l2core.L2Core(asked)
        try:
            hits = core.pop_lookup(core.submit_lookup(keys, rows=rows))
            assert sorted(k for k, hit in zip(keys, hits) if hit) == found
            assert asked.asked[:2] == [a, b] and sorted(asked.asked[2:]) == found  # (then each hit: contains)
        finally:
            core.close()
    blind.check(fix=True)  # (it never looked: the pages are on disk, not in its index)
    blind.close()


def test_pinned_pages_are_not_evicted(tier_dirs):
    from kvstream_hicache.engine import Engine

    cap = 3 * (4096 + PAGE)  # three pages per tier
    eng = Engine(Config.from_sources({"tiers": tier_dirs[:2], "capacity": str(cap)}, {}),
                 Namespace(l2keys.namespace_fields({"test": "evict"})))
    core = l2core.L2Core(eng)
    try:
        keys, _ = stored(eng, 3)
        assert core.pop_lookup(core.submit_lookup(keys[2:])) == [True]  # pin the least recent (the batch's tail)
        more = [f"{i:064x}" for i in range(100, 102)]
        src = Pages(2, seed=2)  # (held across the put: the segments are its memory)
        assert all(eng.put(more, src.segments))
        assert eng.contains(keys[2])  # pinned: survived although least recent
        assert not eng.contains(keys[1])
        core.unlock(keys[2:])
    finally:
        core.close()
        eng.close()


# ----------------------------------------------------------------------------------------- loads
class GatedEngine:
    """Delegates to an engine; the first get blocks until released, so tasks queue up meanwhile."""

    def __init__(self, engine):
        self.engine = engine
        self.pin, self.unpin = engine.pin, engine.unpin
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[int] = []

    def get(self, keys, pages):
        self.batches.append(len(keys))
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return self.engine.get(keys, pages)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("pool", [True, False], ids=["pooled", "one-batch-per-task"])
def test_load_tasks_outstanding_together_are_pooled(engine, pool):
    keys, src = stored(engine, 16, seed=4)
    gated = GatedEngine(engine)
    done = threading.Semaphore(0)
    core = l2core.L2Core(gated, pool_loads=pool, on_load=lambda _t: done.release())
    try:
        dst = Pages(16)
        first = core.submit_load(keys[:2], dst.segments[:2])
        assert gated.entered.wait(WAIT_S)  # the worker is inside the first batch
        rest = [core.submit_load(keys[i:i + 2], dst.segments[i:i + 2]) for i in range(2, 16, 2)]
        gated.release.set()
        for _ in range(8):
            assert done.acquire(timeout=WAIT_S)
        results = [core.pop_load(t) for t in [first] + rest]
        assert results == [[True, True]] * 8
        assert all(np.array_equal(a, b) for a, b in zip(src.arrays, dst.arrays))
        assert gated.batches == ([2, 14] if pool else [2] * 8)
        assert core.stats()["pooled_tasks_max"] == (7 if pool else 1)
    finally:
        core.close()


def test_same_key_in_two_pooled_tasks_fills_both_buffers(engine):
    keys, src = stored(engine, 2, seed=6)
    gated = GatedEngine(engine)
    core = l2core.L2Core(gated)
    try:
        a, b, c = Pages(1), Pages(2), Pages(1)
        t0 = core.submit_load(keys[:1], a.segments)
        assert gated.entered.wait(WAIT_S)
        t1 = core.submit_load(keys, b.segments)
        t2 = core.submit_load(keys[1:], c.segments)  # keys[1] again, in the same pooled batch
        gated.release.set()
        assert [core.wait_load(t, WAIT_S) for t in (t0, t1, t2)] == [[True], [True, True], [True]]
        assert gated.batches == [1, 2]  # the repeated key was read once
        assert np.array_equal(c.arrays[0], src.arrays[1]) and np.array_equal(b.arrays[1], src.arrays[1])
    finally:
        core.close()


def test_missing_and_wrong_size_pages_fail_alone(engine):
    keys, src = stored(engine, 2, seed=8)
    core = l2core.L2Core(engine)
    try:
        small = Pages(1, size=4096)
        good = Pages(1)
        task = core.submit_load([keys[0], "e" * 64, keys[1], None], [good.segments[0], good.segments[0],
                                                                    small.segments[0], None])
        assert core.wait_load(task, WAIT_S) == [True, False, False, False]
        assert np.array_equal(good.arrays[0], src.arrays[0])
        assert core.stats()["errors"] == 0
    finally:
        core.close()


# ----------------------------------------------------------------------------- errors and close
class Exploding:
    """An engine whose I/O calls raise (a bug or an unexpected OSError deep inside)."""

    def __init__(self, engine):
        self.engine = engine
        self.pin, self.unpin = engine.pin, engine.unpin

    def get(self, *_):
        raise RuntimeError("injected get failure")

    def put_deferred(self, *_):
        raise OSError(5, "injected put failure")

    def contains(self, key):
        return self.engine.contains(key)


def test_engine_exceptions_become_task_failures(engine):
    keys, _ = stored(engine, 2)
    events = []
    core = l2core.L2Core(Exploding(engine), on_store=events.append, on_load=events.append)
    try:
        dst = Pages(2)
        load = core.submit_load(keys, dst.segments)
        assert core.wait_load(load, WAIT_S) == [False, False]
        store = core.submit_store(keys, dst.segments)
        assert core.wait_completed("store", 1, WAIT_S)
        assert core.pop_stores() == {store: (False, 0)}
        assert sorted(events) == sorted([load, store])  # completions still signalled
        assert core.stats()["errors"] == 2
    finally:
        core.close()


def test_close_is_idempotent_and_later_tasks_fail_at_once(engine):
    keys, _ = stored(engine, 1)
    core = l2core.L2Core(engine)
    core.close()
    core.close()
    dst = Pages(1)
    assert core.wait_load(core.submit_load(keys, dst.segments), 0) == [False]
    store = core.submit_store(keys, dst.segments)
    assert core.pop_stores() == {store: (False, 0)}


def test_close_waits_for_a_store_completion_still_being_signalled(engine):
    """close() returns only after every store's completion callback has run: the adapter closes its
    eventfds right after, and a notify still on its way would write to a closed (or reused) fd."""
    entered, release = threading.Event(), threading.Event()

    def on_store(_task):  # the adapter's eventfd notify, slowed down
        entered.set()
        assert release.wait(WAIT_S)

    core = l2core.L2Core(engine, on_store=on_store)
    src = Pages(1, seed=13)
    core.submit_store([f"{300:064x}"], src.segments)
    assert entered.wait(WAIT_S)
    closer = threading.Thread(target=core.close)
    closer.start()
    closer.join(0.5)
    returned_early = not closer.is_alive()
    release.set()
    closer.join(WAIT_S)
    assert not returned_early, "close() returned while a store completion was still being signalled"
    assert not closer.is_alive()


@pytest.mark.leaves_problems("a get held by a hung tier holds the read path at close: check() would wait for it")
def test_close_returns_while_a_load_into_l1_hangs_on_its_tier(tier_dirs, monkeypatch):
    """A hung tier holds a read that lands in LMCache's registered L1 (one tier: read in place). Its load
    may wait for it (docs/lmcache.md), but close() (LMCache's shutdown, `lmcache server` on SIGINT)
    returns after the engine's bound (CLOSE_DRAIN_S, docs/guarantees.md), and once it has, the load that
    completes later calls nothing of LMCache's (its listener, its closed eventfds) and touches no byte of
    L1, which LMCache frees then (the engine's CallerGate: the get, back from its wait, ends there)."""
    import mmap

    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc

    from helpers import lockable, uring_available, wait_for_fault
    from kvstream_hicache import engine as engine_module
    from kvstream_hicache.faults import Fault, TierFaultPlan
    from kvstream_hicache.io import OP_READ

    if not uring_available():
        pytest.skip("io_uring_setup refused on this host: no registered memory")
    size, page = 4 << 20, 65536
    lockable(size)
    arena = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    plan = TierFaultPlan()
    monkeypatch.setattr(l2core, "_open_engine", lambda config, ns: engine_module.Engine(config, ns, fault_plan=plan))
    monkeypatch.setattr(engine_module, "CLOSE_DRAIN_S", 1.0)
    adapter = l2adapter.KVStreamL2Adapter({"tiers": tier_dirs[:1], "read_timeout": 1},
                                          L1MemoryDesc(ptr=base, size=size, align_bytes=4096))
    accessed = []
    adapter.register_listener(type("L", (), {"on_l2_keys_accessed": lambda _s, keys: accessed.append(keys)})())
    worker = adapter.core._workers[0]
    try:
        arena[:page] = os.urandom(page)
        key = ObjectKey(chunk_hash=b"\x09" * 32, model_name="m", kv_rank=0)
        adapter.submit_store_task([key], [ArenaObj(base, page)])
        assert adapter.core.wait_completed("store", 1, WAIT_S)
        assert adapter.engine._reads.io.ring.fixed_bytes == size  # L1 registered: the read lands in place
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ)
        adapter.submit_load_task([key], [ArenaObj(base + page, page)])
        wait_for_fault(plan, WAIT_S, "the load's read never reached the ring")
        closer = threading.Thread(target=adapter.close, daemon=True)
        closer.start()
        closer.join(15)
        assert not closer.is_alive(), "close() waits for a read held by a hung tier"
        arena.close()  # LMCache frees L1 once the adapter closed: the load must not touch it after (or: SIGSEGV)
    finally:
        plan.clear()
        plan.release()  # (its read lands in the pages the ring pinned; the get ends, touching nothing)
        worker.join(WAIT_S)
        adapter.close()
    assert not worker.is_alive() and accessed == [] and adapter.core.stats()["load_tasks"] == 1


def test_close_returns_while_a_store_is_held_by_a_hung_tier_with_write_timeout_0(tier_dirs, monkeypatch):
    """write_timeout=0 (a slow tier is never given up on) and a store whose writes a tier holds (it stopped
    answering): close() (LMCache's shutdown: `lmcache server` on SIGTERM or SIGINT) waits for its store
    tasks, but the engine gives the hung tier up after CLOSE_HANG_S without progress, as write_timeout
    would: the store is answered (stored on the tier that answers) and close() returns. Before, close()
    waited for the store for ever, and the server never exited."""
    from lmcache.v1.distributed.api import ObjectKey

    from helpers import wait_for_fault
    from kvstream_hicache import engine as engine_module
    from kvstream_hicache.faults import Fault, TierFaultPlan
    from kvstream_hicache.io import OP_WRITE

    page = 65536
    plan = TierFaultPlan()
    monkeypatch.setattr(l2core, "_open_engine", lambda config, ns: engine_module.Engine(config, ns, fault_plan=plan))
    monkeypatch.setattr(engine_module, "CLOSE_HANG_S", 1.0)
    adapter = l2adapter.KVStreamL2Adapter({"tiers": tier_dirs[:2], "write_timeout": 0})
    memory = np.frombuffer(os.urandom(2 * page), dtype=np.uint8).copy()
    base = memory.ctypes.data + (-memory.ctypes.data) % 4096
    try:
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)
        task = adapter.submit_store_task([ObjectKey(chunk_hash=b"\x0a" * 32, model_name="m", kv_rank=0)],
                                         [ArenaObj(base, page // 2)])
        wait_for_fault(plan, WAIT_S, "the store's write never reached the ring")
        closer = threading.Thread(target=adapter.close, daemon=True)
        closer.start()
        closer.join(WAIT_S)
        assert not closer.is_alive(), "close() waits for a store held by a hung tier (write_timeout=0)"
        assert adapter.core.pop_stores() == {task: (True, page // 2)}
    finally:
        plan.clear()
        plan.release()
        adapter.close()


def test_closing_the_core_leaves_the_write_timeout_of_an_engine_it_was_given_as_set(tier_dirs, monkeypatch):
    """close() with a store held by a hung tier and write_timeout=0 bounds the engine's writes for its wait
    (the test above); an engine the core was given (embedding) goes on as its owner set it: a slow tier is
    waited for again. Before, the engine's write_timeout stayed CLOSE_HANG_S: it failed, for good, any
    tier whose writes paused that long."""
    from kvstream_hicache import engine as engine_module
    from kvstream_hicache.faults import Fault, TierFaultPlan
    from kvstream_hicache.io import OP_WRITE

    monkeypatch.setattr(engine_module, "CLOSE_HANG_S", 1.0)
    plan = TierFaultPlan()
    engine = make_engine(tier_dirs[:2], fault_plan=plan, write_timeout=0)
    core = l2core.L2Core(engine)
    try:
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)  # tier 1 stops answering
        src = Pages(1, seed=3)  # (held while the store may read it)
        task = core.submit_store([f"{1:064x}"], src.segments)
        wait_until(lambda: plan.hits, what="the store's write never started")
        core.close()  # returns once tier 1 is given up
        assert core.pop_stores() == {task: (True, PAGE)}  # (stored on tier 0)
        assert engine._writes.write_timeout == 0, engine._writes.write_timeout
    finally:
        plan.clear()
        plan.release()
        core.close()
        engine.close()


@pytest.mark.leaves_problems("the engine closes in the background once the hung tier answers: check() would wait "
                             "for the writer held in its create")
def test_close_lets_go_of_a_store_whose_writer_is_held_in_a_call_on_a_hung_tier(tier_dirs, fuse_tier, monkeypatch):
    """write_timeout=0 and a tier whose file system stops answering (a FUSE daemon stopped) while the engine's
    writer is in a call there (a store's create): nothing ends that call, and the writer's own hang check
    (CLOSE_HANG_S) sees only writes on the ring. close() (LMCache's shutdown) lets go of the store once the
    writer made no progress for EXIT_HANG_S and returns; LMCache frees L1 then. The writer, back from its
    call once the tier answers, reads no byte of that memory (or: SIGSEGV) and commits none of the store's
    pages (its verdict, recorded after close: failed). Before, close() waited for ever (found in the review
    of stop 45)."""
    import mmap
    import signal

    from lmcache.v1.distributed.api import ObjectKey

    from kvstream_hicache import engine as engine_module

    network, daemon = fuse_tier
    monkeypatch.setattr(engine_module, "CLOSE_HANG_S", 1.0)
    monkeypatch.setattr(engine_module, "EXIT_HANG_S", 2.0)
    page = 65536
    adapter = l2adapter.KVStreamL2Adapter({"tiers": [tier_dirs[0], network], "write_timeout": 0, "discover": 0})
    arena = mmap.mmap(-1, page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # L1: page-aligned
    arena[:] = os.urandom(page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    writer = adapter.engine._writes._thread
    closer = threading.Thread(target=adapter.close, daemon=True)
    try:
        adapter.engine.wait_scan(WAIT_S)
        os.kill(daemon.pid, signal.SIGSTOP)  # the FUSE tier stops answering: the writer's create there never returns
        task = adapter.submit_store_task([ObjectKey(chunk_hash=b"\x0b" * 32, model_name="m", kv_rank=0)],
                                         [ArenaObj(base, page // 2)])
        writes = adapter.engine._writes  # tier 0's job started, the page not yet out of tier 1's FIFO: the writer
        wait_until(lambda: writes.jobs.active[0] and writes.queue.fifo[1], WAIT_S, "no create on tier 1")  # is in its create
        closer.start()
        closer.join(15)
        assert not closer.is_alive(), "close() waits for ever for a store whose writer is in a call on a hung tier"
        arena.close()  # LMCache frees L1 once the adapter closed: the writer must not read it after (or: SIGSEGV)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        if closer.ident:
            closer.join(WAIT_S)
        writer.join(WAIT_S)  # (the engine's close goes on once the create returns)
        adapter.close()
    assert not writer.is_alive(), "the engine's writer never ended after the tier answered"
    assert adapter.core.pop_stores() == {task: (False, 0)}  # no page of it committed, on either tier


def test_the_adapter_starts_waiting_for_a_hung_tier_once(tier_dirs, fuse_tier, monkeypatch):
    """LMCache's adapter started while a FUSE tier hangs: the tier is waited for once (its real path, as the
    settings are read; the engine starts it failed, probe.look_at), not again by the capacity the adapter
    reports to LMCache (Engine.usage: a tier that did not answer at start-up bounds nothing, unasked).
    Before, usage()'s statvfs there waited write_timeout too: the start cost twice write_timeout. Counted,
    not timed: the calls of realpath and statvfs on the tier. From the review of 06fddc1."""
    import signal
    import time

    network, daemon = fuse_tier
    asked = []
    for module, name in ((os.path, "realpath"), (os, "statvfs")):
        def counted(path, *args, _call=getattr(module, name), _name=name, **kwargs):
            if str(path).startswith(network):
                asked.append(_name)
            return _call(path, *args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    os.kill(daemon.pid, signal.SIGSTOP)
    time.sleep(2)  # (past FUSE's 1 s attribute cache: every look reaches the stopped daemon)
    out = []
    start = threading.Thread(target=lambda: out.append(l2adapter.KVStreamL2Adapter(
        {"tiers": [tier_dirs[0], network], "write_timeout": 1}, environ={})), daemon=True)
    start.start()
    start.join(WAIT_S)
    try:
        assert out, "the adapter never started"
        assert asked == ["realpath"], asked
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        start.join(WAIT_S)
        for adapter in out:
            adapter.close()


def test_close_waits_for_a_store_that_a_long_load_holds_back(tier_dirs, monkeypatch, caplog):
    """A load (a long get: its reads complete every 0.3 s) holds the tier's writes back (read priority)
    while close() (LMCache's shutdown) waits for a store queued behind it. The writer is in no call and
    nothing hangs: the store commits once the reads end, and close() waits for it. Before, the time the
    writes waited for the reads counted as the writer's stall (Engine.stalled): close() let go of the
    store after EXIT_HANG_S, as if a hung tier held the writer, and it failed (found in the review of
    stop 46)."""
    from kvstream_hicache import engine as engine_module
    from kvstream_hicache.faults import Fault, TierFaultPlan
    from kvstream_hicache.io import OP_READ

    monkeypatch.setattr(engine_module, "EXIT_HANG_S", 2.0)
    size, n = 1 << 20, 60
    memory = np.zeros((2 * n + 1) * size + 4096, np.uint8)
    base = memory.ctypes.data + (-memory.ctypes.data) % 4096
    memory[:] = np.random.default_rng(5).integers(0, 256, memory.size, dtype=np.uint8)
    segments = [[(base + i * size, size)] for i in range(2 * n + 1)]  # n pages, n to read into, the store's
    plan = TierFaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan, memory="8M")  # (a read window of 4 pages)
    core = l2core.L2Core(engine)
    closer = threading.Thread(target=core.close, daemon=True)
    try:
        keys = [f"{i:064x}" for i in range(1, n + 1)]
        assert all(engine.put(keys, segments[:n]))
        plan.on(tier_dirs[0], Fault.delay(0.3), opcode=OP_READ)  # a slow tier, answering all along
        got = []
        reader = threading.Thread(target=lambda: got.append(engine.get(keys, segments[n:2 * n])), daemon=True)
        reader.start()
        wait_until(lambda: plan.hits, WAIT_S, "the load never read")
        task = core.submit_store([f"{99:064x}"], segments[2 * n:])
        closer.start()
        reader.join(WAIT_S)
        closer.join(WAIT_S)
        assert not closer.is_alive() and got and all(got[0])
        assert core.pop_stores() == {task: (True, size)}, "close() let go of a store that a read held back"
        assert engine.held(f"{99:064x}") and core.let_go_at is None
        assert not [r for r in caplog.records if "made no progress" in r.getMessage()]
    finally:
        plan.clear()
        plan.release()
        core.close()
        engine.close()


def test_tasks_submitted_in_a_forked_child_end(engine):
    """A process forked after the adapter started (a fork-start-method worker, any os.fork()) inherits the
    core, but not its load worker nor the engine's writer thread, and the engine refuses every call there
    (EngineClosedError naming the fork, guarantees.md 8). Each task the child submits still ends: a lookup
    misses, a store fails, a load fails at once and is signalled, so LMCache's wait on the load eventfd
    ends. The parent loads as before. Before, the child's load was queued for the parent's worker thread
    and never completed: LMCache waited for its eventfd for ever."""
    keys, src = stored(engine, 4)
    signalled: list[int] = []
    core = l2core.L2Core(engine, on_load=signalled.append)
    try:
        dst = Pages(4)
        assert core.wait_load(core.submit_load(keys, dst.segments), WAIT_S) == [True] * 4

        def child() -> int:
            if core.pop_lookup(core.submit_lookup(keys)) != [False] * 4:
                return 2
            store = core.submit_store(keys, dst.segments)
            if core.pop_stores() != {store: (False, 0)}:
                return 3
            into = Pages(4)  # (held while the load may write it)
            task = core.submit_load(keys, into.segments)
            result = core.wait_load(task, 10)
            return 0 if result == [False] * 4 and task in signalled else 4

        assert run_child(child, WAIT_S) == 0, "a task the forked child submitted did not end (4: the load)"
        dst = Pages(4)  # the parent goes on
        assert core.wait_load(core.submit_load(keys, dst.segments), WAIT_S) == [True] * 4
        assert all((a == b).all() for a, b in zip(dst.arrays, src.arrays))
    finally:
        core.close()


def test_usage_in_a_forked_child_does_not_raise(tier_dirs):
    """get_usage (and pop_completed_store_tasks, delete) in a child forked while a key's gone event was queued:
    its accounting asked the engine, which refuses every call there, and EngineClosedError went out of
    get_usage into the caller (LMCache's L2 eviction controller polls it)."""
    from lmcache.v1.distributed.api import ObjectKey

    adapter = l2adapter.KVStreamL2Adapter({"tiers": tier_dirs[:1], "chunk": "4K"}, environ={})
    try:
        src = Pages(1, 4096, seed=3)
        key = ObjectKey(chunk_hash=b"forked-1", model_name="m", kv_rank=0, cache_salt="")

        class Obj:  # the two things the adapter asks of a MemoryObj
            data_ptr = src.segments[0][0][0]

            def get_size(self):
                return 4096

        task = adapter.submit_store_task([key], [Obj()])
        assert adapter.core.wait_completed("store", 1, WAIT_S)
        assert adapter.pop_completed_store_tasks()[task].is_successful()
        adapter.engine.delete([l2keys.engine_key(key)])  # its gone event waits for the next accounting

        def child() -> int:
            try:
                usage = adapter.get_usage()
                adapter.pop_completed_store_tasks()
                adapter.delete([key])
            except BaseException:
                return 2
            return 0 if usage.total_bytes_used == 4096 else 3  # (cannot tell: still counted)

        assert run_child(child, WAIT_S) == 0, "2: a call raised in the forked child"
        assert adapter.get_usage().total_bytes_used == 0  # the parent accounts as before
    finally:
        adapter.close()


def test_close_in_a_forked_child_returns_while_the_parent_s_store_is_open(tier_dirs):
    """A child forked while a store task of the parent's is open (its writes in flight) closes the
    adapter (a worker's shutdown): close() returns at once. That store is the parent's, ended by the
    engine's writer thread there; the child neither waits for it nor signals the eventfds it shares with
    the parent. The parent's store completes and its close() works as before. Before, the child's close()
    waited for that store for ever."""
    from kvstream_hicache.faults import Fault, FaultPlan
    from kvstream_hicache.io import OP_WRITE

    plan = FaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    core = l2core.L2Core(engine)
    try:
        plan.add(Fault.hold(), opcode=OP_WRITE)
        keys, src = [f"{i:064x}" for i in range(1, 3)], Pages(2, seed=5)
        task = core.submit_store(keys, src.segments)
        wait_until(lambda: plan.hits, what="the store's writes never started")

        def child() -> int:
            core.close()
            return 0

        assert run_child(child, WAIT_S) == 0
        plan.release()
        assert core.wait_completed("store", 1, WAIT_S)
        assert core.pop_stores() == {task: (True, 2 * PAGE)}
    finally:
        plan.release()
        core.close()
        engine.close()


def test_a_store_interrupted_while_it_waits_for_backlog_room_does_not_hang_close(tier_dirs):
    """A store task waits in ``put_deferred`` for write-backlog room (back-pressure) when a
    KeyboardInterrupt (Ctrl-C) ends it in the submitting thread. The interrupt reaches the caller; the
    task is over (no verdict: the caller never got its id), and LMCache's shutdown, which closes the
    adapter, returns once the other stores completed. Before, the interrupted task stayed counted as open
    (``queued_stores`` 1) and ``L2Core.close()`` waited for it for ever."""
    import signal

    from kvstream_hicache.faults import Fault, FaultPlan
    from kvstream_hicache.io import OP_WRITE

    plan = FaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan, write_backlog="128K")
    core = l2core.L2Core(engine)
    closer = None
    try:
        plan.add(Fault.hold(), opcode=OP_WRITE)
        keys = [f"{i:064x}" for i in range(1, 5)]
        src = Pages(4, size=64 << 10, seed=7)
        first = core.submit_store(keys[:2], src.segments[:2])  # 128 KiB queued, writes held: the backlog is full
        wait_until(lambda: plan.hits, what="the first store's writes never started")

        def ctrl_c():  # the next store waits for room: interrupt it
            wait_until(lambda: engine.stats()["backpressure_waits"], what="the store never waited for room")
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=ctrl_c).start()
        with pytest.raises(KeyboardInterrupt):
            core.submit_store(keys[2:], src.segments[2:])
        plan.release()
        assert core.wait_completed("store", 1, WAIT_S), "the first store never completed"
        assert core.pop_stores() == {first: (True, 2 * (64 << 10))}
        closer = threading.Thread(target=core.close, daemon=True)
        closer.start()
        closer.join(WAIT_S)
        assert not closer.is_alive(), (
            f"L2Core.close() still waits after the last store completed: it counts the interrupted store as "
            f"open for ever (queued_stores={core.stats()['queued_stores']})")
    finally:
        plan.release()
        if closer is None or not closer.is_alive():
            core.close()
        engine.close()


class ArenaObj:
    """What the adapter asks of a MemoryObj (data_ptr, get_size), over an L1-like arena."""

    def __init__(self, address: int, size: int):
        self.data_ptr, self.size = address, size

    def get_size(self) -> int:
        return self.size


def test_store_task_reports_bytes_and_verdict(engine):
    core = l2core.L2Core(engine)
    try:
        src = Pages(3, seed=9)
        keys = [f"{i:064x}" for i in range(200, 203)]
        ok_task = core.submit_store(keys, src.segments)
        bad_task = core.submit_store([keys[0], None], [src.segments[0], None])  # an unmappable key
        assert core.wait_completed("store", 2, WAIT_S)
        assert core.pop_stores() == {ok_task: (True, 3 * PAGE), bad_task: (False, PAGE)}
        assert all(engine.contains(k) for k in keys)
    finally:
        core.close()


# ----------------------------------------------------------------------------------------- bench
@pytest.mark.parametrize("pool", [True, False])
def test_bench_read(engine, pool):
    keys, src = stored(engine, 16, seed=10)
    dst = Pages(16)
    result = bench_read(engine, keys, dst.segments, tasks=8, pool=pool)
    assert result.found == [True] * 16 and result.tasks == 8
    assert result.batches == (1 if pool else 8)
    assert all(np.array_equal(a, b) for a, b in zip(src.arrays, dst.arrays))


def test_bench_read_opens_its_own_engine_from_settings(tier_dirs):
    from kvstream_hicache.engine import Engine

    settings = {"tiers": tier_dirs[:2]}
    namespace = Namespace({"model": "bench-model"})
    with Engine(Config.from_sources(settings, {}), namespace) as eng:
        keys, src = stored(eng, 4, seed=12)
    dst = Pages(4)
    result = bench_read(settings, keys, dst.segments, tasks=2, namespace=namespace)
    assert result.found == [True] * 4
    assert all(np.array_equal(a, b) for a, b in zip(src.arrays, dst.arrays))


# ------------------------------------------------------------------------------ LMCache class
def test_adapter_class_loads_lazily_and_closes_twice(tier_dirs):
    cls = l2adapter.KVStreamL2Adapter
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

    assert issubclass(cls, L2AdapterInterface) and cls.__qualname__ == "KVStreamL2Adapter"
    adapter = cls({"tiers": tier_dirs[:2], "pool_loads": "false"})
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3
    assert adapter.core.pool_loads is False
    assert adapter.report_status()["is_healthy"]
    adapter.close()
    adapter.close()
    assert not adapter.report_status()["is_healthy"]


def test_bad_settings_raise_at_construction(tmp_path):
    from kvstream_hicache.errors import KVStreamError

    with pytest.raises(KVStreamError, match="tier"):
        l2adapter.KVStreamL2Adapter({"tiers": [str(tmp_path / "missing")]})
    with pytest.raises(KVStreamError, match="unknown kvstream setting"):
        l2adapter.KVStreamL2Adapter({"tiers": [str(tmp_path)], "tierz": 1})
    # the engine settings' flag parser: a typo is an error, not "true" (refused before an engine opens)
    with pytest.raises(KVStreamError, match="pool_loads.*'flase'"):
        l2adapter.KVStreamL2Adapter({"tiers": [str(tmp_path)], "pool_loads": "flase"})


def _adapter_child(code: str, tiers: list[str]) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter (logging as the process sets it up, not as pytest does), the tiers
    as its arguments; it must succeed."""
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code, *tiers], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_the_start_up_line_is_logged_where_no_one_configured_logging(tier_dirs):
    """As in ``lmcache server``: LMCache sets up its own loggers only. The adapter's start-up line (L1
    registered or staged, trust) went nowhere, even with log_level INFO, and warnings came out bare."""
    code = ("import sys; from kvstream_hicache.lmcache.adapter import KVStreamL2Adapter as A; "
            "A({'tiers': sys.argv[1:]}, environ={}).close()")
    out = _adapter_child(code, tier_dirs[:2])
    up = [line for line in out.stderr.splitlines() if "kvstream lmcache: L2 adapter up" in line]
    assert len(up) == 1 and " INFO " in up[0], out.stderr[-3000:]
    warned = [line for line in out.stderr.splitlines() if "are on the same file system" in line]
    assert warned and " WARNING kvstream: " in warned[0], out.stderr[-3000:]  # with a time and a level


def test_a_host_that_configures_logging_after_the_adapter_gets_each_line_once(tier_dirs):
    """A script that makes the adapter, then configures logging (logging.basicConfig): every kvstream line
    came out twice, once through the adapter's own handler and once through the host's. Found by a review."""
    code = ("import logging, sys; from kvstream_hicache.lmcache.adapter import KVStreamL2Adapter as A; "
            "A({'tiers': sys.argv[1:]}, environ={}).close(); logging.basicConfig(format='HOST %(message)s'); "
            "logging.getLogger('kvstream').warning('kvstream: a warning after the host configured logging')")
    out = _adapter_child(code, tier_dirs[:1])
    lines = [line for line in out.stderr.splitlines() if "after the host configured logging" in line]
    assert lines == ["HOST kvstream: a warning after the host configured logging"], out.stderr[-3000:]


def test_adapter_params_errors_speak_lmcache_terms(tier_dirs, caplog):
    """A typo listed SGLang's 'extra config' and no adapter option; a string namespace failed with a bare
    'dictionary update sequence element'; a capacity of 100 (meant as GB) started without a word, and
    every store failed (now said at start-up: LMCache's own suites run with capacities of 2000 bytes)."""
    from kvstream_hicache.errors import ConfigError

    def refused(params):
        with pytest.raises(ConfigError) as info:
            l2adapter.KVStreamL2Adapter({"tiers": tier_dirs[:1], **params}, environ={})
        return str(info.value)

    text = refused({"pool_load": False})
    assert "adapter_params" in text and "extra config" not in text and "'pool_load'" in text
    assert all(k in text for k in ("capacity", "namespace", "pool_loads", "max_pool_pages"))
    assert "adapter_params 'capacity'" in refused({"capacity": "10 gigs"})
    for bad in ("prod-a", ["prod-a"]):
        text = refused({"namespace": bad})
        assert "adapter_params 'namespace'" in text and "expected a mapping" in text and repr(bad) in text
    assert "is not JSON" in refused({"namespace": {"d": {1, 2}}})
    caplog.clear()
    l2adapter.KVStreamL2Adapter({"tiers": tier_dirs[:1], "capacity": 2000}, environ={}).close()  # as LMCache's tests
    said = [r.getMessage() for r in caplog.records if "a bare number means bytes" in r.getMessage()]
    assert said and all(p in said[0] for p in ("adapter_params 'capacity'", "2000 bytes", "'2000G'")), said


@contextmanager
def _held_by_another_thread(lock):
    """``lock`` held by another thread of this process for as long as the block runs (as the engine's
    writer, ending a store in L2Core._finish, or the load worker holds the core's lock for a moment)."""
    taken, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join(10)


@pytest.mark.parametrize("call", ["close", "load"])
def test_a_forked_child_s_close_and_load_end_while_a_parent_thread_held_the_core_lock(engine, call):
    """fork() while a thread of the parent holds the core's lock: in the child that holder does not exist
    and the lock is never released. The child's close() returns and its load fails at once, as in any
    forked child (the core's locks are new there: a fork hook). Before, both took that lock and hung for
    ever (from the review of this stop's changes)."""
    keys = [f"{i:064x}" for i in range(1, 3)]
    core = l2core.L2Core(engine, on_load=lambda _: None)
    try:
        arrays = [np.zeros(8192, np.uint8) for _ in keys]
        segments = [[(a.ctypes.data, a.nbytes)] for a in arrays]

        def child() -> int:
            if call == "close":
                core.close()
                return 0
            task = core.submit_load(keys, segments)
            return 0 if core.wait_load(task, 10) == [False, False] else 4

        with _held_by_another_thread(core._lock):
            code = run_child(child, 20.0)  # (a hang fails the test: "the forked child hung")
        assert code == 0
    finally:
        core.close()
