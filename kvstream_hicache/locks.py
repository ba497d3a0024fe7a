"""The engine's lock order, written once, and a check of it that the tests turn on.

Every lock of the core and its adapters is built by :func:`ranked_lock` (or :func:`ranked_rlock`,
:func:`ranked_condition`) under a name from :data:`ORDER`. A thread may take a lock only while every
lock it holds comes earlier in ORDER: two threads can then never wait for each other in a cycle.
docs/design.md ("Locks") has the table: what each lock guards and what may be taken under it.

In production the factories return plain ``threading`` locks: the check costs nothing. With
``KVSTREAM_LOCK_CHECK=1`` in the environment when a lock is built (tests/conftest.py sets it for the
whole suite) they return a checking lock that records, per thread, the locks held, and on a blocking
acquire out of order records a :class:`LockOrderError` in :data:`VIOLATIONS` and raises it. Recorded as
well as raised: the adapters turn any exception into a miss, and the conftest fails the test from
the record. A non-blocking acquire is never out of order (it cannot wait, so it closes no cycle).
"""
from __future__ import annotations

import os
import threading

# Outermost first. Adapter locks, then the engine's paths, then what the paths share, then leaves:
# a leaf takes no other lock while held (stats, pools, rings, fault plans, metrics).
ORDER = (
    "sglang.sync",  # SGLang adapter: one stats snapshot + export at a time
    "sglang.adapter",  # SGLang adapter: attach/close state (the engine opens under it), counters, samples
    "lmcache.store",  # LMCache L2 adapter: a store submit and its task -> keys table
    "lmcache.held",  # LMCache L2 adapter: the keys LMCache's byte accounting counts (asks the index under it)
    "read",  # ReadPath: the read ring, its pool, a whole get (also clear/check, with write), registering memory
    "caller",  # CallerGate: a get touching its caller's memory, against close() giving up on it (memory.py)
    "write",  # WritePath: the write ring, its pool, jobs in flight (the writer thread's step)
    "replicator",  # Replicator: pages owed per tier, promoted sources (hands a copy to the queue under it)
    "queue",  # WriteQueue: the per-tier FIFOs, backlog, closing flag (callers and the writer, briefly)
    "lmcache.core",  # LMCache core: tasks, results, pins (a put's done callback runs under write/queue)
    "tier",  # Tier: health state, back-off, probe schedule (only clock under it: probes and rejoins run outside)
    "placing",  # Engine: a tier that did not answer at start-up checked against the others as it answers (a
    # tier's calls thread; bounded stats of the tiers under it, nothing else)
    "index",  # Index: key -> tiers, LRU, capacity, pins
    "priority",  # ReadPriority: readers per tier (listeners are called with it released)
    "scan",  # BackgroundScan: tiers left to scan, its progress file (scan.py; takes nothing under it)
    "source",  # CallerGate of a deferred put's caller (L2Core): the writer's reads of its memory (nothing under it)
    "owed",  # OwedClears: the record of the clear()s failed tiers owe (owed.py; local file I/O, nothing under it)
    "mark",  # Tier: its temporary files in flight and the mark held while there are any (local file I/O, nothing
    # under it: tmpfiles.hold_mark)
    "staging",  # BufferPool: free and held staging buffers
    "stats",  # Stats: counters
    "ring",  # ThreadRing: completions of the thread-pool I/O engine
    "faults",  # fault plans (tests): rules and holds
    "metrics",  # Prometheus families and the exporter's last snapshot
    "clock",  # trust.wall_ns: the last wall-clock time this process answered
)
# Not ranked: memory.HugePageMap._reading, a flag more than a lock (taken without waiting by the thread
# that starts a refresh, released by the refresh thread; waited for only by refresh(), which callers run
# holding no lock: ReadPath.register_memory), so it closes no cycle.
RANK = {name: rank for rank, name in enumerate(ORDER)}
CHECK_ENV = "KVSTREAM_LOCK_CHECK"

VIOLATIONS: list[str] = []  # every out-of-order acquire seen in this process (the check on)


class LockOrderError(RuntimeError):
    """A thread took a lock while holding one that comes later in ORDER (or another of its rank)."""


def ranked_lock(name: str):
    """A lock of rank ``name``: ``threading.Lock()``, or a checking lock under KVSTREAM_LOCK_CHECK=1."""
    rank = _rank(name)
    return _Checked(name, rank, threading.Lock()) if _checking() else threading.Lock()


def ranked_rlock(name: str):
    """A reentrant lock of rank ``name`` (taking it again in the thread that holds it is in order)."""
    rank = _rank(name)
    return _Checked(name, rank, threading.RLock()) if _checking() else threading.RLock()


def ranked_condition(name: str) -> threading.Condition:
    """A condition over a new reentrant lock of rank ``name`` (what ``threading.Condition()`` builds)."""
    return threading.Condition(ranked_rlock(name))


def _rank(name: str) -> int:
    try:
        return RANK[name]
    except KeyError:
        raise ValueError(f"lock name {name!r} is not in kvstream_hicache.locks.ORDER") from None


def _checking() -> bool:
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


_local = threading.local()


def _held() -> list["_Checked"]:
    held = getattr(_local, "held", None)
    if held is None:
        held = _local.held = []
    return held


class _Checked:
    """A lock that checks the order on every blocking acquire. It keeps the list of the thread that
    took it, so a release from another thread (a plain lock allows it) clears that one."""

    def __init__(self, name: str, rank: int, lock):
        self.name, self.rank, self._lock = name, rank, lock
        self._holder: list[_Checked] | None = None
        self._depth = 0  # acquisitions by the holder (a reentrant lock's count)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        held = _held()
        again = self._holder is held and self._depth > 0
        if blocking and not again:
            late = [h for h in held if h is not self and h.rank >= self.rank]
            if late:
                message = (f"lock {self.name!r} taken while holding {', '.join(repr(h.name) for h in late)} "
                           f"(thread {threading.current_thread().name}): the order is {' > '.join(ORDER)}")
                VIOLATIONS.append(message)
                raise LockOrderError(message)
        if not self._lock.acquire(blocking, timeout):
            return False
        if not again:
            self._holder = held
            held.append(self)
        self._depth += 1
        return True

    def release(self) -> None:
        holder = self._holder
        self._depth -= 1
        if self._depth == 0:
            self._holder = None
            if holder is not None and self in holder:
                holder.remove(self)
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    def locked(self) -> bool:
        return self._depth > 0

    # threading.Condition's protocol: wait() releases the lock whatever its depth, then takes it back.
    def _is_owned(self) -> bool:
        return self._depth > 0 and self._holder is _held()

    def _release_save(self):
        depth, self._depth = self._depth, 1
        self.release()
        if depth > 1:  # a reentrant lock held several times: release the rest
            for _ in range(depth - 1):
                self._lock.release()
        return depth

    def _acquire_restore(self, depth) -> None:
        self.acquire()
        for _ in range(depth - 1):
            self._lock.acquire()
        self._depth = depth

    def __repr__(self) -> str:
        return f"<ranked lock {self.name!r} rank {self.rank}{' held' if self._depth else ''}>"
