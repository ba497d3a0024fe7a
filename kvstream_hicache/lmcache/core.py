"""The LMCache adapter's task machinery over one engine (:class:`L2Core`), without LMCache's types.

Lifecycle of a task (each kind has its own eventfd in the adapter; a task's result is handed out
exactly once)::

    submit_store_task(keys, objs) -> id     engine.put_deferred: queued in the engine and written to
                                             each tier when it has no read in flight (M2); waits only
                                             while the engine's write_backlog is full (back-pressure)
        pop_completed_store_tasks()          {id: L2StoreResult}: one verdict per task, as LMCache wants,
                                             once every page is committed (LMCache keeps the L1
                                             objects read-locked until then)
    submit_lookup_and_lock_task(keys) -> id  answered at once from the engine's index, a key it lacks looked
                                             up on the tiers (per row, its leading keys held); hits pinned
        query_lookup_and_lock_result(id)     Bitmap (1 = held and pinned against eviction)
    submit_load_task(keys, objs) -> id       load worker: engine.get straight into the L1 buffers;
        query_load_result(id)                Bitmap per key. Load tasks waiting together are pooled
    submit_unlock(keys)                      into ONE routed engine batch (LMCache keeps up to 8
                                             requests in flight); unlock never fails.

Errors. Nothing raises into LMCache's controller threads: a failing page is a 0 in its bitmap, a failing
store fails its task, every unexpected exception becomes that verdict plus a warning and a counter
(``report_status()['errors']``). Only construction raises (bad configuration: ``KVStreamError``).

Plain keys and ``(address, nbytes)`` segments, no LMCache or torch: :class:`L2Core` also serves
``kvstream bench`` (``tools/bench/contenders.py``) from the SGLang environment.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..io import forks
from ..locks import ranked_lock
from ..memory import CallerGate
from ..segments import Segment, copy_payload, nbytes
from ..stats import Every
from ..errors import ConfigError
from .keys import ADAPTER_PARAMS, namespace_fields

log = logging.getLogger("kvstream")

DEFAULT_MAX_POOL_PAGES = 4096
MARK_LOADED_S = 1.0  # the load worker marks the chunks it loaded when idle, or at least this often, s
SMALL_CAPACITY = 1 << 20  # bytes: a tier capacity below this is said at start-up (_check_capacities)


def _open_engine(config: Any, namespace: Any) -> Any:
    """Build the engine (one module-level seam: tests swap it to inject rings and faults)."""
    from ..engine import Engine

    return Engine(config, namespace)


def open_engine(engine_params: Mapping[str, Any], namespace_extra: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> Any:
    """Config (explicit params > ``KVSTREAM_*`` > defaults) + namespace -> a started engine.

    :raises KVStreamError: bad setting or unusable tier, the message names it and the fix."""
    from ..config import SETTINGS, Config
    from ..layout import Namespace

    unknown = sorted(set(engine_params) - set(SETTINGS))
    if unknown:  # in LMCache's terms: its adapter_params hold the adapter's own keys too
        raise ConfigError(f"unknown kvstream setting(s) {', '.join(map(repr, unknown))} in LMCache's adapter_params; "
                          f"valid keys: {', '.join([*SETTINGS, *ADAPTER_PARAMS])}")
    config = Config.from_sources(engine_params, environ, ignore=frozenset(),
                                 labels={key: f"adapter_params '{key}'" for key in SETTINGS})
    _warn_small_capacities(config)
    return _open_engine(config, Namespace(namespace_fields(namespace_extra)))


def _warn_small_capacities(config: Any) -> None:
    """A capacity below 1 MiB is most likely a bare number meant as GB ("capacity": 100), which is bytes:
    every store of a real chunk would fail. Said, not refused: LMCache's own adapter suites run with
    capacities of a few KiB (2000 bytes, 10240), and the adapter does not know the chunk size."""
    from ..config import setting_source

    for tier in config.tiers:
        n = tier.capacity.nbytes
        if n is not None and n < SMALL_CAPACITY:
            log.warning("kvstream lmcache: %s: %d for tier %s is %d bytes (a bare number means bytes); if you meant "
                        "GiB, write '%dG'", setting_source(config.sources, "capacity"), n, tier.path, n, n)


# ------------------------------------------------------------------------------------------ core
class _Task:
    """One task. ``hold`` keeps the caller's buffers (LMCache's MemoryObjs) alive until the task
    completes: the engine reads and writes their memory by address, and a caller that drops them after
    submitting must not have that memory freed under the I/O. ``done(result)`` runs at completion,
    before the task's completion is signalled. ``open``: a store task counted in ``_stores_open``, until
    its verdict (the count closes once, whoever ends the task first)."""
    __slots__ = ("id", "keys", "pages", "result", "hold", "done", "open")

    def __init__(self, task_id: int, keys: list[str | None], pages: list[Sequence[Segment] | None],
                 hold: Any = None, done: Callable[[list[bool]], None] | None = None):
        self.id = task_id
        self.keys = keys
        self.pages = pages
        self.result = [False] * len(keys)
        self.hold = hold
        self.done = done
        self.open = False


class L2Core:
    """LMCache-free task machinery over one engine: the adapter minus LMCache's types.

    Keys are engine keys (``None`` = a key that could not be mapped: always a miss), pages are lists of
    ``(address, nbytes)`` segments. ``on_store/on_lookup/on_load(task_id)`` run after a task's result
    is ready (the adapter notifies its eventfds there). Stores go to ``engine.put_deferred`` (the
    engine's writer thread completes them); one daemon worker reads loads (every load task queued
    when the worker comes round is read as one ``engine.get`` batch when ``pool_loads``; otherwise
    one batch per task). Thread-safe.
    """

    def __init__(self, engine: Any, *, on_store: Callable[[int], None] | None = None,
                 on_lookup: Callable[[int], None] | None = None, on_load: Callable[[int], None] | None = None,
                 pool_loads: bool = True, max_pool_pages: int = DEFAULT_MAX_POOL_PAGES):
        self.engine = engine
        self.pool_loads = pool_loads
        self.max_pool_pages = max(1, int(max_pool_pages))
        self._on_store, self._on_lookup, self._on_load = on_store, on_lookup, on_load
        self._ids = itertools.count(1)
        self._fresh_locks()
        self._stores_open = 0  # store tasks submitted and not completed
        # Completions being signalled and copies into callers' buffers still running: close() waits for
        # them, and none starts once it has returned (_closed): the adapter closes its eventfds then, and
        # LMCache frees L1 (a notify on a closed or reused fd, a copy into freed memory, never happen).
        self._busy = 0
        self._loads: deque[_Task] = deque()
        self._stores_done: dict[int, tuple[bool, int]] = {}
        self._lookups_done: dict[int, list[bool]] = {}
        self._loads_done: dict[int, list[bool]] = {}
        self._pins: dict[Any, list[Any]] = {}  # lock key -> pin handles, one per outstanding lock
        self._closing = False  # close() began: tasks submitted from now on fail at once, lookups pin nothing
        self._closed = False  # close() returned (or is returning): no callback, signal or copy any more
        # The stores' memory (LMCache's L1), which the engine's writer reads while it holds this gate:
        # close() shuts it when it gives up on stores a hung tier holds the writer for (put_deferred's gate)
        self._gate = CallerGate("source")
        self._too_large_said = Every(log)  # (under _lock) a task too large for the tiers: one line in a while
        self.let_go_at: float | None = None  # when close() began, if it let go of stores still open
        self._forks = forks()  # a forked child sees another count (_forked)
        self.counters = {k: 0 for k in ("store_tasks", "stored_pages", "store_failed_pages", "lookups",
                                        "lookup_keys", "lookup_hits", "unlocks", "load_tasks", "load_batches",
                                        "loaded_pages", "load_failed_pages", "pooled_tasks_max", "errors")}
        self._workers = [threading.Thread(target=self._load_loop, name="kvstream-l2-load", daemon=True)]
        for w in self._workers:
            w.start()

    # -- store ----------------------------------------------------------------------------------
    def submit_store(self, keys: list[str | None], pages: list[Sequence[Segment] | None], hold: Any = None) -> int:
        """Queue a store task in the engine (deferred writes); ``pages`` stay unchanged until its result
        is out (``hold``: what keeps their memory alive until then). Waits while the engine's write
        backlog is full. A task larger than every tier's capacity fails whole before any page is
        written (a part of it stored would be a failed task whose pages still evict others)."""
        (task,) = self._tasks([(keys, pages, hold)])
        with self._lock:
            closing = self._closing
            if not closing:
                self._stores_open += 1
                task.open = True
        if closing:  # after close(): fail at once rather than hang the caller
            self._finish(True, [task])
            return task.id
        try:
            idx = [i for i, (k, p) in enumerate(zip(task.keys, task.pages)) if k is not None and p is not None]
            if self._too_large(task, idx):
                idx = []
            if not idx:
                self._store_done(task, idx, [])
            else:
                self.engine.put_deferred([task.keys[i] for i in idx], [task.pages[i] for i in idx],
                                         lambda ok: self._store_done(task, idx, ok), self._gate)
        except Exception:  # adapter boundary: a failed task for LMCache, a warning and a counter for us
            self.report_error("store")
            self._store_done(task, [], [])
        except BaseException:  # KeyboardInterrupt, SystemExit (while it waits for backlog room): the task
            # is over, or close() would wait for it for ever; no verdict (the caller gets no task id)
            with self._lock:
                if task.open:
                    task.open = False
                    self._stores_open -= 1
                    self._done.notify_all()
            raise
        return task.id

    def _store_done(self, task: _Task, idx: list[int], ok: list[bool]) -> None:
        """The engine committed (or failed) every page of the task: its verdict goes out now."""
        for i, good in zip(idx, ok, strict=True):
            task.result[i] = bool(good)
        self._finish(True, [task], queued=True)

    def _too_large(self, task: _Task, idx: list[int]) -> bool:
        """Whether the task's pages not yet held exceed the largest tier's capacity (an unlimited tier's: its
        file system's size; never when such a tier cannot tell it): they could never all be stored, so none is."""
        limit = self.engine.capacity_limit()
        if limit is None or sum(nbytes(task.pages[i]) for i in idx) <= limit:
            return False
        new = sum(nbytes(task.pages[i]) for i in idx if not self.engine.held(task.keys[i]))
        if new <= limit:
            return False
        # (the file systems' sizes asked again before a refusal: one grown since the last look, an online resize,
        # held the size of before, and every such task failed for good)
        limit = self.engine.capacity_limit(fresh=True)
        if limit is None or new <= limit:
            return False
        with self._lock:  # (said once in a while: a deployment whose chunks outgrow the tiers fails every such
            # task, and a line each flooded the log)
            self._too_large_said.warning(
                "kvstream lmcache: a store task of %d bytes exceeds every tier's capacity (%d bytes at most: the "
                "largest tier's capacity, or its file system's size); failed, nothing written: raise the tiers' "
                "capacity or their file systems, or store smaller chunks (LMCache's --chunk-size)", new, limit)
        return True

    def pop_stores(self, pages: bool = False) -> dict[int, tuple]:
        """Completed store tasks: ``{id: (ok, bytes written)}``; ok only when every page was stored.
        With ``pages``: ``{id: (ok, bytes written, [stored, per page])}``."""
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done if pages else {t: r[:2] for t, r in done.items()}

    # -- lookup and lock ------------------------------------------------------------------------
    def submit_lookup(self, keys: Sequence[str | None], lock_keys: Sequence[Any] | None = None,
                      rows: Sequence[Any] | None = None) -> int:
        """Look up and pin ``keys``; the result is ready before this returns (``on_lookup`` has run).
        Each hit holds one lock under ``lock_keys[i]`` (default: the engine key), released by
        :meth:`unlock` with the same lock key.

        Answered from the engine's index. Keys it lacks are looked up on the tiers (:meth:`_discover`:
        another server's pages on a shared tier, pages of before a restart the start-up scan has not
        read yet), per row of keys, ``rows[i]`` naming the row of ``keys[i]`` (LMCache: an object group
        on a kv rank; None: one row), as far as the row's leading keys are held: a row of absent keys
        costs one failed lookup per tier. A page the index has only on a failed tier costs one header
        lookup per healthy tier (Engine.contains)."""
        task_id = next(self._ids)
        lock_keys = keys if lock_keys is None else lock_keys
        hits = [False] * len(keys)
        handles: list = []  # this call's pins: any not recorded as a lock are released below
        good: list[bool] = []
        try:
            self._discover(keys, rows)
            present = [i for i, k in enumerate(keys) if k is not None]
            handles = self.engine.pin([keys[i] for i in present]) if present else []
            # Pinned first, then checked: a page held only by a failed tier is a miss (unpinned now).
            good = [h is not None and self._readable(keys[i]) for i, h in zip(present, handles)]
            # The locks are gathered here, every lock key hashed, before _pins changes: a bad lock key
            # (an unhashable ObjectKey) fails the lookup with nothing recorded, so all its pins go back
            # below; recorded, they would outlive the all-miss answer (LMCache never unlocks a miss).
            mine: dict[Any, list[Any]] = {}
            for i, handle, g in zip(present, handles, good):
                if g:
                    mine.setdefault(lock_keys[i], []).append(handle)
            with self._lock:
                if self._closing:  # close() has released its pins (or is about to): hold none
                    good, mine = [False] * len(good), {}
                self.counters["lookups"] += 1
                self.counters["lookup_keys"] += len(keys)
                self.counters["lookup_hits"] += sum(good)
                for lock_key, held in mine.items():  # last: nothing after it can fail
                    self._pins.setdefault(lock_key, []).extend(held)
            for i, g in zip(present, good):
                hits[i] = g
        except Exception:  # adapter boundary: a miss for LMCache, a warning and a counter for us
            self.report_error("lookup")
            hits, good = [False] * len(keys), []  # (no lock recorded: every pin of this call goes back)
        stale = [h for h, g in itertools.zip_longest(handles, good) if h is not None and not g]
        if stale:
            try:
                self.engine.unpin(stale)
            except Exception:
                self.report_error("lookup")
        with self._lock:
            self._lookups_done[task_id] = hits
            signal = self._enter_under_lock()
        if signal:
            try:
                self._signal(self._on_lookup, task_id)
            finally:
                self._leave()
        return task_id

    def _discover(self, keys: Sequence[str | None], rows: Sequence[Any] | None) -> None:
        """Have the engine index the pages of ``keys`` it lacks that a tier holds, row by row, as
        SGLang's prefix query does (Engine.prefix_len: the index, then the first key it lacks looked up
        on each healthy tier, and on while found). LMCache serves a prefix of each row; the keys after a
        row's first key held nowhere are answered by the index alone. Keys of a row are taken in order,
        wherever they sit in ``keys``; an unmapped key (None) ends its row. The engine's ``discover``
        setting holds: off, nothing is looked up once the start-up scan is done. An error is counted,
        and the lookup answers from the index."""
        try:
            runs: dict[Any, list[str]] = {}
            ended: set = set()
            for i, key in enumerate(keys):
                row = None if rows is None else rows[i]
                if row in ended:
                    continue
                if key is None:
                    ended.add(row)
                else:
                    runs.setdefault(row, []).append(key)
            for run in runs.values():
                self.engine.prefix_len(run)
        except Exception:
            self.report_error("lookup on the tiers")

    def _readable(self, key: str) -> bool:
        """Whether a usable tier still holds ``key``; an error is a miss (the pin is then released)."""
        try:
            return self.engine.contains(key)
        except Exception:
            self.report_error("lookup")
            return False

    def pop_lookup(self, task_id: int) -> list[bool] | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def unlock(self, lock_keys: Sequence[Any]) -> None:
        """Release one lock per lock key; keys holding no lock are ignored. Never raises."""
        handles: list = []
        try:
            keys = []
            for key in lock_keys:
                try:
                    hash(key)
                except Exception:  # an unhashable key holds no lock: skipped alone, the others are released
                    self.report_error("unlock")
                    continue
                keys.append(key)
            with self._lock:
                for key in keys:
                    held = self._pins.get(key)
                    if held:
                        handles.append(held.pop())
                        if not held:
                            del self._pins[key]
                self.counters["unlocks"] += len(keys)
        except Exception:
            self.report_error("unlock")
        if handles:  # whatever left _pins is unpinned, even if a later key failed
            try:
                self.engine.unpin(handles)
            except Exception:
                self.report_error("unlock")

    # -- load -----------------------------------------------------------------------------------
    def submit_load(self, keys: list[str | None], pages: list[Sequence[Segment] | None], hold: Any = None,
                    done: Callable[[list[bool]], None] | None = None) -> int:
        """Queue a load task into ``pages`` (``hold`` keeps their memory alive until it completes;
        ``done(result)`` runs then, on the load worker, before the completion is signalled)."""
        return self._enqueue_loads([(keys, pages, hold, done)])[0]

    def submit_loads(self, tasks: Sequence[tuple[list[str | None], list[Sequence[Segment] | None]]]) -> list[int]:
        """Queue several load tasks at once (the worker sees them together, as when LMCache's
        in-flight requests submit back to back)."""
        return self._enqueue_loads(tasks)

    def pop_load(self, task_id: int) -> list[bool] | None:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    def wait_completed(self, kind: str, count: int, timeout: float | None = None) -> bool:
        """Block until ``count`` tasks of ``kind`` ('store' or 'load') have completed since start
        (tests and tools wait on completions instead of sleeping). False on timeout."""
        counter = {"store": "store_tasks", "load": "load_tasks"}[kind]
        with self._done:
            return self._done.wait_for(lambda: self.counters[counter] >= count, timeout)

    def wait_load(self, task_id: int, timeout: float | None = None) -> list[bool] | None:
        """Block until the load task is done, then pop its result (None on timeout)."""
        with self._done:
            self._done.wait_for(lambda: task_id in self._loads_done, timeout)
            return self._loads_done.pop(task_id, None)

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued tasks (stores: until committed), stop the worker, release every pin. Idempotent.

        Stores are waited for as long as the engine's writer makes progress: with write_timeout=0 a
        tier's file-system calls run in place, unbounded, and one on a hung tier (a create on a FUSE
        mount whose daemon stopped) holds the writer, and every store behind it, for ever. Once the
        writer made no progress for EXIT_HANG_S (Engine.stalled, the exit hook's bound), close() lets
        go of the stores still open: it shuts their gate (a read of L1 in progress ends first), says
        which tier holds the writer, and goes on. The writer, back from its call, reads no more of
        their memory, and commits none of their pages (put_deferred's gate); they get no verdict.

        The load worker is waited for CLOSE_DRAIN_S (the engine's own bound on reads still in flight at
        its close): a load whose read into the caller's memory is held by a hung tier may wait for ever
        (a read into L1 must land before its task completes, docs/lmcache.md), and LMCache's shutdown
        must not. Past that bound the loads still queued fail, and that load never completes: once this
        returns, nothing is signalled, called back or copied into a caller's buffer any more (the
        adapter closes its eventfds next, LMCache frees L1). A read the kernel still holds lands in the
        pages it pinned (registered memory, or an O_DIRECT read), wherever the freed range is mapped
        again."""
        from ..engine import CLOSE_DRAIN_S, EXIT_HANG_S

        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._work.notify_all()
            if self._forked():
                # The tasks still open here (stores, loads queued, signals being sent) are the parent's: the
                # threads that end them (the engine's writer, the load worker) run there, and they are not
                # this process's to fail or signal (a signal on the eventfds, shared across fork(), would
                # wake the parent's LMCache), nor are the pins its to release.
                self._loads.clear()
                self._closed = True
                return
            bounded = bool(self._stores_open)
            if bounded:  # (with write_timeout=0, a hung tier held them, and LMCache's shutdown, for ever)
                self.engine.bound_writes()
            start, hung = time.monotonic(), None
            try:
                while not self._done.wait_for(lambda: not self._stores_open and not self._busy, 1.0):
                    if self._stores_open and (hung := self.engine.stalled(start)):
                        break  # (a call on a hung tier holds the writer: nothing will end it)
            finally:  # (an engine it was given goes on as its owner set it)
                if bounded:
                    self.engine.bound_writes(False)
        if hung:
            if not self._gate.close(CLOSE_DRAIN_S):  # (a read of L1 does not wait for a tier: never seen)
                log.warning("kvstream lmcache: close(): the writer is still reading a store's memory")
            self.let_go_at = start
            log.warning("kvstream lmcache: close(): the engine's writer made no progress for %.0f s, held in a call "
                        "on %s (a hung tier); closing without the %d store tasks still open: "
                        "their chunks are not stored, and their L1 memory is no longer read", EXIT_HANG_S, hung,
                        self.stats()["queued_stores"])
        deadline = time.monotonic() + CLOSE_DRAIN_S
        for w in self._workers:
            w.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            stuck = sum(w.is_alive() for w in self._workers)
            left = list(self._loads)
            self._loads.clear()
        if stuck:
            log.warning("kvstream lmcache: close(): a load still waits for a tier after %.0f s (a hung tier); closing "
                        "without it, %d load tasks queued behind it failed", CLOSE_DRAIN_S, len(left))
        if left:
            self._finish(False, left)
        with self._lock:
            self._closed = True
            self._done.wait_for(lambda: not self._busy)  # (no engine call in there: short)
            handles = [h for held in self._pins.values() for h in held]
            self._pins.clear()
        if handles:
            try:
                self.engine.unpin(handles)
            except Exception:
                self.report_error("unlock at close")

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
            out["locked_keys"] = len(self._pins)
            out["queued_loads"] = len(self._loads)
            out["queued_stores"] = self._stores_open
        return out

    # -- workers --------------------------------------------------------------------------------
    def _tasks(self, specs: Sequence[tuple]) -> list[_Task]:
        """Tasks from ``(keys, pages[, hold[, done]])``."""
        tasks = []
        for keys, pages, *extra in specs:
            keys, pages = list(keys), list(pages)
            if len(pages) != len(keys):  # a caller bug: every page of the task fails, nothing raises
                log.warning("kvstream lmcache: task with %d keys and %d buffers; failed", len(keys), len(pages))
                keys = [None] * len(keys)
                pages = [None] * len(keys)
            tasks.append(_Task(next(self._ids), keys, pages, *extra))
        return tasks

    def _enqueue_loads(self, specs: Sequence[tuple[list, list]]) -> list[int]:
        tasks = self._tasks(specs)
        with self._lock:
            # after close(), or in a forked child (the load worker is the parent's thread, absent here):
            # fail at once rather than hang the caller
            closing = self._closing or self._forked()
            if not closing:
                self._loads.extend(tasks)
                self._work.notify_all()
        if closing:
            self._finish(False, tasks)
        return [t.id for t in tasks]

    def _fresh_locks(self) -> None:
        """New locks: at construction, and in a forked child at their first use there (a thread of the
        parent may have held them as it forked: the engine's writer ending a store in _finish, the load
        worker, an LMCache thread; its holder is not in the child, and would never release them)."""
        lock = ranked_lock("lmcache.core")
        self._locks = (lock, threading.Condition(lock), threading.Condition(lock))
        self._locks_forks = forks()

    def _locks_here(self) -> tuple:
        if self._locks_forks != forks():
            self._fresh_locks()
        return self._locks

    _lock = property(lambda self: self._locks_here()[0])  # the state below; _work: the load worker waits
    _work = property(lambda self: self._locks_here()[1])  # for loads or close(); _done: close() waits for
    _done = property(lambda self: self._locks_here()[2])  # the stores open and the signals on their way

    def _forked(self) -> bool:
        """This is a forked child of the process that built the core: its engine refuses every call
        (EngineClosedError: stores fail, lookups miss) and its threads stayed in the parent."""
        return forks() != self._forks

    def _next_loads(self) -> list[_Task] | None:
        queue = self._loads
        with self._lock:
            self._work.wait_for(lambda: queue or self._closing)
            if not queue:
                return None
            batch = [queue.popleft()]
            pages = len(batch[0].keys)
            while self.pool_loads and queue and pages + len(queue[0].keys) <= self.max_pool_pages:
                pages += len(queue[0].keys)
                batch.append(queue.popleft())
            return batch

    def _load_loop(self) -> None:
        loaded: dict[str, None] = {}  # chunks loaded since they were last marked used (_mark_loaded)
        marked = time.monotonic()
        while (batch := self._next_loads()) is not None:
            try:
                self._run_loads(batch)
            except Exception:  # the whole batch fails; the worker lives on
                self.report_error("load")
                for task in batch:
                    task.result = [False] * len(task.keys)
            self._finish(False, batch)
            loaded.update((key, None) for task in batch for key, ok in zip(task.keys, task.result) if ok)
            if not self._loads or time.monotonic() - marked > MARK_LOADED_S:  # (no load waits behind them)
                self._mark_loaded(loaded, every=bool(self._loads))
                marked = time.monotonic()

    def _mark_loaded(self, loaded: dict[str, None], every: bool) -> None:
        """After their tasks are answered: the chunks loaded that another instance of the model wrote on a
        shared tier are marked used, so that its eviction spares them while this one reads them
        (Engine.mark_used, at most once a second a chunk; before, the writer evicted them by its own uses).
        A chunk at a time, taken from ``loaded``: a load queued meanwhile goes first, the rest are marked
        after it (review: a load waited for every mark of the chunks loaded before, a metadata write each on
        a network tier), unless ``every`` (loads waited a second of marks: all go now)."""
        while loaded and (every or not self._loads) and not self._closing:  # (closing: a hint no one needs)
            key = next(iter(loaded))
            del loaded[key]
            try:
                self.engine.mark_used([key])
            except Exception:  # (a closed engine, a tier's error: a hint lost, never LMCache's problem)
                log.debug("kvstream lmcache: marking loaded chunks used failed", exc_info=True)
                loaded.clear()

    def _run_loads(self, batch: list[_Task]) -> None:
        # One engine batch of unique keys; a key asked for twice (two tasks for the same chunk) is
        # read once and copied to the other buffer, since a batch item has one destination.
        keys: list[str] = []
        pages: list[Sequence[Segment]] = []
        first: dict[str, int] = {}
        owner: list[tuple[_Task, int]] = []
        copies: list[tuple[int, _Task, int]] = []
        for task in batch:
            for i, (key, page) in enumerate(zip(task.keys, task.pages, strict=True)):
                if key is None or page is None:
                    continue
                j = first.get(key)
                if j is None:
                    first[key] = len(keys)
                    keys.append(key)
                    pages.append(page)
                    owner.append((task, i))
                else:
                    copies.append((j, task, i))
        with self._lock:
            self.counters["load_batches"] += 1
            self.counters["pooled_tasks_max"] = max(self.counters["pooled_tasks_max"], len(batch))
        ok = self.engine.get(keys, pages) if keys else []
        for (task, i), good in zip(owner, ok, strict=True):
            task.result[i] = bool(good)
        if not copies:
            return
        with self._lock:  # (a get that outlived close(): the buffers may be freed, no copy)
            copy = self._enter_under_lock()
        if copy:
            try:
                for j, task, i in copies:
                    task.result[i] = bool(ok[j]) and copy_payload(pages[j], task.pages[i])
            finally:
                self._leave()

    def _finish(self, store: bool, batch: list[_Task], queued: bool = False) -> None:
        """The tasks' verdicts out: the counters (and, ``queued``, the store tasks queued) in one lock
        hold, so a status never shows a task stored and still queued; then the callbacks and signals,
        which close() waits for (the adapter closes the store eventfd after it: never under a notify
        still on its way)."""
        with self._lock:
            if queued:  # once per task: one whose submit was interrupted after the engine took it is over
                batch = [task for task in batch if task.open]
                for task in batch:
                    task.open = False
                self._stores_open -= len(batch)
            signal = self._enter_under_lock()  # (after close() returned: counted, never signalled)
            for task in batch:
                # The engine is done with the buffers: the caller's lifetime again, before a waiter
                # learns the task is done (it may drop its objects and expect them gone at once).
                task.hold = None
                good = sum(task.result)
                bad = len(task.result) - good
                if store:
                    written = sum(nbytes(p) for p, r in zip(task.pages, task.result) if r)
                    self._stores_done[task.id] = (bad == 0, written, task.result)
                    self.counters["store_tasks"] += 1
                    self.counters["stored_pages"] += good
                    self.counters["store_failed_pages"] += bad
                else:
                    self._loads_done[task.id] = task.result
                    self.counters["load_tasks"] += 1
                    self.counters["loaded_pages"] += good
                    self.counters["load_failed_pages"] += bad
            self._done.notify_all()
        if not signal:
            return
        try:
            for task in batch:
                if task.done is not None:
                    try:
                        task.done(task.result)
                    except Exception:
                        self.report_error("completion callback")
                self._signal(self._on_store if store else self._on_load, task.id)
        finally:
            self._leave()

    def _enter_under_lock(self) -> bool:
        """Begin a completion's signals or a copy into a caller's buffer, which close() waits for;
        False once close() has returned (then it must not happen). :meth:`_leave` ends it."""
        if self._closed:
            return False
        self._busy += 1
        return True

    def _leave(self) -> None:
        with self._lock:
            self._busy -= 1
            self._done.notify_all()

    def _signal(self, callback: Callable[[int], None] | None, task_id: int) -> None:
        if callback is None:
            return
        try:
            callback(task_id)
        except Exception:
            self.report_error("completion callback")

    def report_error(self, what: str) -> None:
        """The adapter boundary's one rule: count, warn (with the traceback), carry on."""
        with self._lock:
            self.counters["errors"] += 1
        log.warning("kvstream lmcache: %s failed; reported per task to LMCache", what, exc_info=True)
