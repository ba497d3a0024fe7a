"""The vLLM path: kvstream_hicache as ONE LMCache L2 adapter (LMCache 0.5.6 multiprocess mode).

LMCache's ``lmcache server`` keeps L1 (a shared-memory arena) and hands L2 adapters store, lookup-and-lock
and load tasks; vLLM talks to that server through ``LMCacheMPConnector``. This module plugs the engine
in as one ``{"type": "plugin", ...}`` adapter, so LMCache's inter-adapter policies never see the tiers:
replication and completion-driven routing stay inside :class:`~kvstream_hicache.engine.Engine`, the same
engine and router the SGLang adapter drives (docs/lmcache.md)::

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "kvstream_hicache.lmcache_adapter",
                                     "class_name": "KVStreamL2Adapter",
                                     "adapter_params": {"tiers": ["/nvme/kv", "/pfs/kv"]}}'

Lifecycle of a task (each kind has its own eventfd; a task's result is handed out exactly once)::

    submit_store_task(keys, objs) -> id     store worker: engine.put (replicate to every tier)
        pop_completed_store_tasks()          {id: L2StoreResult}: one verdict per task, as LMCache wants
    submit_lookup_and_lock_task(keys) -> id  answered at once from the engine's index; hits are pinned
        query_lookup_and_lock_result(id)     Bitmap (1 = held and pinned against eviction)
    submit_load_task(keys, objs) -> id       load worker: engine.get straight into the L1 buffers;
        query_load_result(id)                Bitmap per key. Load tasks waiting together are pooled
    submit_unlock(keys)                      into ONE routed engine batch (LMCache keeps up to 8
                                             requests in flight); unlock never fails.

Keys. An LMCache ``ObjectKey`` (model, kv rank, object group, chunk hash, cache salt) plus the object's
layout (shapes and dtypes) is hashed to a 64-hex engine key (:func:`engine_key`), so models, ranks,
groups, salts and layouts never share a page; the engine's :class:`~kvstream_hicache.layout.Namespace`
(``integration: lmcache-mp`` plus the ``namespace`` adapter parameter) keeps the directory apart from
SGLang's pages in shared tiers.

Errors. Nothing raises into LMCache's controller threads: a failing page is a 0 in its bitmap, a failing
store fails its task, every unexpected exception becomes that verdict plus a warning and a counter
(``report_status()['errors']``). Only construction raises (bad configuration: ``KVStreamError``).

The LMCache-facing class is built on first access (module ``__getattr__``), so this module imports
without LMCache or torch: :class:`L2Core` (the task machinery, plain keys and ``(address, nbytes)``
segments) and :func:`bench_read` also serve ``kvstream bench`` from the SGLang environment.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

log = logging.getLogger("kvstream")

Segment = tuple[int, int]  # (address, nbytes)

KEY_SCHEME = "sha256(model@rank@group@hash@salt#layout)/1"  # changes only with a new key format
INTEGRATION = "lmcache-mp"
# adapter_params that belong to the adapter; every other key is an engine setting (config.SETTINGS).
ADAPTER_PARAMS = {
    "namespace": "dict merged into the engine namespace (e.g. {'deployment': 'prod-a'}): pages written "
                 "under another namespace are never found",
    "pool_loads": "true (default): load tasks waiting together are read as one routed batch",
    "max_pool_pages": "largest pooled load batch, pages (default 4096)",
}
DEFAULT_MAX_POOL_PAGES = 4096


# ------------------------------------------------------------------------------------------- keys
def layout_tag(shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]) -> str:
    """Canonical text of an object layout: ``2x16x104:bfloat16`` per tensor, ``;``-joined.
    The same for a stored ``MemoryObj`` (``get_shapes/get_dtypes``) and a lookup's ``MemoryLayoutDesc``."""
    return ";".join("x".join(str(int(d)) for d in shape) + ":" + str(dtype).removeprefix("torch.")
                    for shape, dtype in zip(shapes, dtypes, strict=True))


def engine_key(key: Any, layout: str) -> str:
    """64-hex engine key of an LMCache ``ObjectKey`` under ``layout`` (see :func:`layout_tag`).

    '@' cannot occur in ``model_name`` or ``cache_salt`` (LMCache rejects it), so the string form is
    unambiguous; sha256 makes it a valid engine key of fixed length whatever the model name."""
    text = (f"{key.model_name}@{key.kv_rank:x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
            f"@{key.cache_salt}#{layout}")
    return hashlib.sha256(text.encode()).hexdigest()


def namespace_fields(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Engine namespace of the LMCache MP path (``extra`` may not override the two fixed fields)."""
    fields = dict(extra or {})
    fields.update(integration=INTEGRATION, keys=KEY_SCHEME)
    return fields


def split_params(params: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter options, engine settings) from LMCache's ``adapter_params``."""
    params = dict(params or {})
    adapter = {k: params.pop(k) for k in list(params) if k in ADAPTER_PARAMS}
    return adapter, params


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def _open_engine(config: Any, namespace: Any) -> Any:
    """Build the engine (one module-level seam: tests swap it to inject rings and faults)."""
    from .engine import Engine

    return Engine(config, namespace)


def open_engine(engine_params: Mapping[str, Any], namespace_extra: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> Any:
    """Config (explicit params > ``KVSTREAM_*`` > defaults) + namespace -> a started engine.

    :raises KVStreamError: bad setting or unusable tier, the message names it and the fix."""
    from .config import Config
    from .layout import Namespace

    config = Config.from_sources(engine_params, environ)
    return _open_engine(config, Namespace(namespace_fields(namespace_extra)))


# ------------------------------------------------------------------------------------------ core
class _Task:
    __slots__ = ("id", "keys", "pages", "result")

    def __init__(self, task_id: int, keys: list[str | None], pages: list[Sequence[Segment] | None]):
        self.id = task_id
        self.keys = keys
        self.pages = pages
        self.result = [False] * len(keys)


class L2Core:
    """LMCache-free task machinery over one engine: the adapter minus LMCache's types.

    Keys are engine keys (``None`` = a key that could not be mapped: always a miss), pages are lists of
    ``(address, nbytes)`` segments. ``on_store/on_lookup/on_load(task_id)`` run after a task's result
    is ready (the adapter notifies its eventfds there). Two daemon workers: stores (one ``engine.put``
    per task, FIFO) and loads (every load task queued when the worker comes round is read as one
    ``engine.get`` batch when ``pool_loads``; otherwise one batch per task). Thread-safe.
    """

    def __init__(self, engine: Any, *, on_store: Callable[[int], None] | None = None,
                 on_lookup: Callable[[int], None] | None = None, on_load: Callable[[int], None] | None = None,
                 pool_loads: bool = True, max_pool_pages: int = DEFAULT_MAX_POOL_PAGES):
        self.engine = engine
        self.pool_loads = pool_loads
        self.max_pool_pages = max(1, int(max_pool_pages))
        self._on_store, self._on_lookup, self._on_load = on_store, on_lookup, on_load
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._stores: deque[_Task] = deque()
        self._loads: deque[_Task] = deque()
        self._stores_done: dict[int, tuple[bool, int]] = {}
        self._lookups_done: dict[int, list[bool]] = {}
        self._loads_done: dict[int, list[bool]] = {}
        self._done = threading.Condition(self._lock)
        self._pins: dict[Any, list[Any]] = {}  # lock key -> pin handles, one per outstanding lock
        self._closing = False
        self.counters = {k: 0 for k in ("store_tasks", "stored_pages", "store_failed_pages", "lookups",
                                        "lookup_keys", "lookup_hits", "unlocks", "load_tasks", "load_batches",
                                        "loaded_pages", "load_failed_pages", "pooled_tasks_max", "errors")}
        self._pin, self._unpin = _pin_functions(engine)
        self._workers = [threading.Thread(target=self._store_loop, name="kvstream-l2-store", daemon=True),
                         threading.Thread(target=self._load_loop, name="kvstream-l2-load", daemon=True)]
        for w in self._workers:
            w.start()

    # -- store ----------------------------------------------------------------------------------
    def submit_store(self, keys: list[str | None], pages: list[Sequence[Segment] | None]) -> int:
        """Queue a store task; the caller keeps ``pages`` valid until its result is out."""
        return self._enqueue(self._stores, keys, pages)

    def pop_stores(self) -> dict[int, tuple[bool, int]]:
        """Completed store tasks: ``{id: (ok, bytes written)}``; ok only when every page was stored."""
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done

    # -- lookup and lock ------------------------------------------------------------------------
    def submit_lookup(self, keys: Sequence[str | None], lock_keys: Sequence[Any] | None = None) -> int:
        """Look up and pin ``keys`` from the engine's index (no disk access); the result is ready
        before this returns (``on_lookup`` has run). Each hit holds one lock under ``lock_keys[i]``
        (default: the engine key), released by :meth:`unlock` with the same lock key."""
        task_id = next(self._ids)
        lock_keys = keys if lock_keys is None else lock_keys
        hits = [False] * len(keys)
        try:
            present = [i for i, k in enumerate(keys) if k is not None]
            handles = self._pin([keys[i] for i in present]) if present else []
            # Pinned first, then checked: a page held only by a failed tier is a miss (unpinned now).
            good = [h is not None and self.engine.contains(keys[i]) for i, h in zip(present, handles)]
            stale = [h for h, g in zip(handles, good) if h is not None and not g]
            if stale:
                self._unpin(stale)
            with self._lock:
                for i, handle, g in zip(present, handles, good, strict=True):
                    if g:
                        hits[i] = True
                        self._pins.setdefault(lock_keys[i], []).append(handle)
                self.counters["lookups"] += 1
                self.counters["lookup_keys"] += len(keys)
                self.counters["lookup_hits"] += sum(hits)
        except Exception:  # adapter boundary: a miss for LMCache, a warning and a counter for us
            self.report_error("lookup")
            hits = [False] * len(keys)
        with self._lock:
            self._lookups_done[task_id] = hits
        self._signal(self._on_lookup, task_id)
        return task_id

    def pop_lookup(self, task_id: int) -> list[bool] | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def unlock(self, lock_keys: Sequence[Any]) -> None:
        """Release one lock per lock key; keys holding no lock are ignored. Never raises."""
        try:
            handles = []
            with self._lock:
                for key in lock_keys:
                    held = self._pins.get(key)
                    if held:
                        handles.append(held.pop())
                        if not held:
                            del self._pins[key]
                self.counters["unlocks"] += len(lock_keys)
            if handles:
                self._unpin(handles)
        except Exception:
            self.report_error("unlock")

    # -- load -----------------------------------------------------------------------------------
    def submit_load(self, keys: list[str | None], pages: list[Sequence[Segment] | None]) -> int:
        """Queue a load task into ``pages`` (kept valid by the caller until its result is out)."""
        return self._enqueue(self._loads, keys, pages)

    def submit_loads(self, tasks: Sequence[tuple[list[str | None], list[Sequence[Segment] | None]]]) -> list[int]:
        """Queue several load tasks at once (the worker sees them together, as when LMCache's
        in-flight requests submit back to back)."""
        return self._enqueue_many(self._loads, tasks)

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
        """Finish queued tasks, stop the workers, release every pin. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._work.notify_all()
        for w in self._workers:
            w.join()
        with self._lock:
            handles = [h for held in self._pins.values() for h in held]
            self._pins.clear()
        if handles:
            try:
                self._unpin(handles)
            except Exception:
                self.report_error("unlock at close")

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
            out["locked_keys"] = len(self._pins)
            out["queued_loads"] = len(self._loads)
            out["queued_stores"] = len(self._stores)
        return out

    # -- workers --------------------------------------------------------------------------------
    def _enqueue(self, queue: deque, keys: list[str | None], pages: list[Sequence[Segment] | None]) -> int:
        return self._enqueue_many(queue, [(keys, pages)])[0]

    def _enqueue_many(self, queue: deque, specs: Sequence[tuple[list, list]]) -> list[int]:
        tasks = []
        for keys, pages in specs:
            keys, pages = list(keys), list(pages)
            if len(pages) != len(keys):  # a caller bug: every page of the task fails, nothing raises
                log.warning("kvstream lmcache: task with %d keys and %d buffers; failed", len(keys), len(pages))
                keys = [None] * len(keys)
                pages = [None] * len(keys)
            tasks.append(_Task(next(self._ids), keys, pages))
        with self._lock:
            closing = self._closing
            if not closing:
                queue.extend(tasks)
                self._work.notify_all()
        if closing:  # after close(): fail at once rather than hang the caller
            self._finish(queue is self._stores, tasks)
        return [t.id for t in tasks]

    def _next(self, queue: deque, pooled: bool) -> list[_Task] | None:
        with self._lock:
            self._work.wait_for(lambda: queue or self._closing)
            if not queue:
                return None
            batch = [queue.popleft()]
            pages = len(batch[0].keys)
            while pooled and queue and pages + len(queue[0].keys) <= self.max_pool_pages:
                pages += len(queue[0].keys)
                batch.append(queue.popleft())
            return batch

    def _store_loop(self) -> None:
        while (batch := self._next(self._stores, False)) is not None:
            self._run(self._run_store, batch, "store")
            self._finish(True, batch)

    def _load_loop(self) -> None:
        while (batch := self._next(self._loads, self.pool_loads)) is not None:
            self._run(self._run_loads, batch, "load")
            self._finish(False, batch)

    def _run(self, work: Callable[[list[_Task]], None], batch: list[_Task], what: str) -> None:
        """Run ``work`` on a batch; any exception fails the whole batch (the worker lives on)."""
        try:
            work(batch)
        except Exception:
            self.report_error(what)
            for task in batch:
                task.result = [False] * len(task.keys)

    def _run_store(self, batch: list[_Task]) -> None:
        (task,) = batch
        idx = [i for i, (k, p) in enumerate(zip(task.keys, task.pages)) if k is not None and p is not None]
        if idx:
            ok = self.engine.put([task.keys[i] for i in idx], [task.pages[i] for i in idx])
            for i, good in zip(idx, ok, strict=True):
                task.result[i] = bool(good)

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
        for j, task, i in copies:
            task.result[i] = bool(ok[j]) and _copy_segments(pages[j], task.pages[i])

    def _finish(self, store: bool, batch: list[_Task]) -> None:
        with self._lock:
            for task in batch:
                good = sum(task.result)
                bad = len(task.result) - good
                if store:
                    nbytes = sum(_nbytes(p) for p, r in zip(task.pages, task.result) if r)
                    self._stores_done[task.id] = (bad == 0, nbytes)
                    self.counters["store_tasks"] += 1
                    self.counters["stored_pages"] += good
                    self.counters["store_failed_pages"] += bad
                else:
                    self._loads_done[task.id] = task.result
                    self.counters["load_tasks"] += 1
                    self.counters["loaded_pages"] += good
                    self.counters["load_failed_pages"] += bad
            self._done.notify_all()
        for task in batch:
            self._signal(self._on_store if store else self._on_load, task.id)

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


def _pin_functions(engine: Any) -> tuple[Callable, Callable]:
    """(pin(keys) -> [handle | None], unpin(handles)) over the engine's index: a pinned page is
    never an eviction victim. Prefers ``engine.pin/unpin``; falls back to ``engine.index``."""
    pin = getattr(engine, "pin", None)
    unpin = getattr(engine, "unpin", None)
    if callable(pin) and callable(unpin):
        return pin, unpin
    index = engine.index
    return index.pin, index.unpin


def _nbytes(page: Sequence[Segment] | None) -> int:
    return sum(n for _, n in page) if page else 0


def _copy_segments(src: Sequence[Segment], dst: Sequence[Segment]) -> bool:
    """Copy the payload of ``src`` into ``dst`` (same total length), segment boundaries may differ."""
    if _nbytes(src) != _nbytes(dst):
        return False
    si, s_off = 0, 0
    for d_addr, d_len in dst:
        done = 0
        while done < d_len:
            s_addr, s_len = src[si]
            n = min(d_len - done, s_len - s_off)
            ctypes.memmove(d_addr + done, s_addr + s_off, n)
            done += n
            s_off += n
            if s_off == s_len:
                si, s_off = si + 1, 0
    return True


# ----------------------------------------------------------------------------------------- bench
class BenchRead(NamedTuple):
    found: list[bool]  # per key, as engine.get returns
    tasks: int  # load tasks submitted together
    batches: int  # engine batches they became (1 when pooled into one)


def bench_read(engine: Any, keys: Sequence[str], buffers: Sequence[Sequence[Segment]], *, tasks: int = 8,
               pool: bool = True, namespace: Any = None) -> BenchRead:
    """Read ``keys`` into ``buffers`` the way the LMCache adapter does, for ``kvstream bench``.

    The batch is cut into ``tasks`` contiguous load tasks submitted back to back (LMCache's prefetch
    controller keeps up to 8 requests in flight) and read through :class:`L2Core`: pooled into one
    routed engine batch (``pool=True``, the adapter's default) or one batch per task. Compare its time
    with ``engine.get(keys, buffers)`` for the adapter's overhead. No LMCache needed.

    :param engine: a started Engine (kept open), or a Config / settings dict (opened and closed here,
        on ``namespace``: a Namespace or its fields; default the LMCache MP path's namespace).
    :param keys: engine keys already stored (as the bench wrote them).
    :param buffers: per key the ``(address, nbytes)`` segments to fill, as for ``engine.get``.
    """
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys for {len(buffers)} buffers")
    from .config import Config

    own = isinstance(engine, (Config, Mapping))
    if own:
        from .engine import Engine
        from .layout import Namespace

        config = engine if isinstance(engine, Config) else Config.from_sources(engine)
        if not isinstance(namespace, Namespace):
            namespace = Namespace(namespace_fields() if namespace is None else namespace)
        engine = Engine(config, namespace)
    core = L2Core(engine, pool_loads=pool)
    try:
        n = len(keys)
        tasks = max(1, min(tasks, n or 1))
        bounds = [round(t * n / tasks) for t in range(tasks + 1)]
        # Queued together, as when 8 requests' load tasks arrive back to back: the worker then reads
        # them as one batch (pooled) or one by one (not pooled).
        ids = core.submit_loads([(list(keys[a:b]), list(buffers[a:b])) for a, b in zip(bounds, bounds[1:])])
        found: list[bool] = []
        for task_id in ids:
            found += core.wait_load(task_id) or []
        return BenchRead(found, len(ids), core.counters["load_batches"])
    finally:
        core.close()
        if own:
            engine.close()


# -------------------------------------------------------------------------------------- LMCache
def __getattr__(name: str) -> Any:
    """``KVStreamL2Adapter`` is built on first access: importing this module needs no LMCache."""
    classes = _lmcache_classes() if name in _LMCACHE_CLASSES else None
    if classes is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals().update(classes)
    return classes[name]


_LMCACHE_CLASSES = ("KVStreamL2Adapter",)


@functools.cache
def _lmcache_classes() -> dict[str, type]:
    try:
        from lmcache.lmcache_native import Bitmap
        from lmcache.v1.distributed.internal_api import L2StoreResult
        from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
        from lmcache.v1.platform import create_event_notifier
    except ImportError as exc:
        raise ImportError(f"kvstream_hicache.lmcache_adapter.KVStreamL2Adapter needs lmcache 0.5.6 ({exc}); "
                          "install it with scripts/setup-lmcache-env.sh (a separate venv)") from exc

    def bitmap(bits: list[bool]) -> Any:
        out = Bitmap(len(bits))
        out.batched_set([i for i, bit in enumerate(bits) if bit])
        return out

    class KVStreamL2Adapter(L2AdapterInterface):
        """LMCache L2 adapter over a kvstream engine (see the module docstring).

        :param params: LMCache's ``adapter_params``: engine settings (``tiers``, ``capacity``,
            ``policy``, ... as ``KVSTREAM_*``; explicit wins over the variable) and the adapter's own
            (:data:`ADAPTER_PARAMS`).
        :param l1_memory_desc: LMCache's L1 arena (unused: the engine stages reads in its own aligned
            buffers and copies into L1, so no registration is needed).
        :param engine: an engine to use instead of opening one (tests, embedding); not closed here.
        :raises KVStreamError: bad setting or unusable tier (LMCache then fails to start the server).
        """

        def __init__(self, params: Mapping[str, Any] | None = None, l1_memory_desc: Any = None, *,
                     engine: Any = None, environ: Mapping[str, str] | None = None):
            super().__init__(max_capacity_bytes=0)  # the engine evicts per tier; LMCache must not
            opts, settings = split_params(params)
            self._own_engine = engine is None
            self.engine = open_engine(settings, opts.get("namespace"), environ) if engine is None else engine
            self._efds = [create_event_notifier() for _ in range(3)]  # store, lookup, load: distinct fds
            self._closed = False
            self.core = L2Core(self.engine, on_store=lambda _t: self._efds[0].notify(),
                               on_lookup=lambda _t: self._efds[1].notify(),
                               on_load=lambda _t: self._efds[2].notify(),
                               pool_loads=_flag(opts.get("pool_loads", True)),
                               max_pool_pages=int(opts.get("max_pool_pages", DEFAULT_MAX_POOL_PAGES)))
            self._store_keys: dict[int, tuple[list, list[int]]] = {}  # task -> (ObjectKeys, sizes)
            self._load_keys: dict[int, list] = {}
            self._meta_lock = threading.Lock()
            config = getattr(self.engine, "config", None)
            log.info("kvstream lmcache: L2 adapter up; %s; pooled loads %s; namespace %s",
                     config.summary() if config is not None else "engine given",
                     "on" if self.core.pool_loads else "off",
                     getattr(getattr(self.engine, "namespace", None), "digest", "?"))

        # -- event fds --------------------------------------------------------------------------
        def get_store_event_fd(self) -> int:
            return self._efds[0].fileno()

        def get_lookup_and_lock_event_fd(self) -> int:
            return self._efds[1].fileno()

        def get_load_event_fd(self) -> int:
            return self._efds[2].fileno()

        # -- store ------------------------------------------------------------------------------
        def submit_store_task(self, keys: list, objects: list) -> int:
            ekeys, pages = self._map_objects(keys, objects)
            task_id = self.core.submit_store(ekeys, pages)
            with self._meta_lock:
                self._store_keys[task_id] = (list(keys), [_nbytes(p) for p in pages])
            return task_id

        def pop_completed_store_tasks(self) -> dict:
            out = {}
            for task_id, (ok, nbytes) in self.core.pop_stores().items():
                with self._meta_lock:
                    keys, sizes = self._store_keys.pop(task_id, ([], []))
                if ok and keys:
                    self._notify_safely(self._notify_keys_stored, keys, sizes)
                out[task_id] = L2StoreResult(ok, nbytes)
            return out

        # -- lookup and lock --------------------------------------------------------------------
        def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: dict) -> int:
            ekeys: list[str | None] = []
            tags: dict[int, str | None] = {}
            for key in keys:
                try:
                    group = key.object_group_id
                    if group not in tags:
                        desc = (group_layout_descs or {}).get(group)
                        tags[group] = None if desc is None else layout_tag(desc.shapes, desc.dtypes)
                    ekeys.append(None if tags[group] is None else engine_key(key, tags[group]))
                except Exception:
                    self.core.report_error("lookup key mapping")
                    ekeys.append(None)
            # Locks are kept under the ObjectKey: unlock carries no layout to rebuild the engine key.
            return self.core.submit_lookup(ekeys, lock_keys=keys)

        def query_lookup_and_lock_result(self, task_id: int) -> Any:
            hits = self.core.pop_lookup(task_id)
            return None if hits is None else bitmap(hits)

        def submit_unlock(self, keys: list) -> None:
            self.core.unlock(keys)

        # -- load -------------------------------------------------------------------------------
        def submit_load_task(self, keys: list, objects: list) -> int:
            ekeys, pages = self._map_objects(keys, objects)
            task_id = self.core.submit_load(ekeys, pages)
            with self._meta_lock:
                self._load_keys[task_id] = list(keys)
            return task_id

        def query_load_result(self, task_id: int) -> Any:
            found = self.core.pop_load(task_id)
            if found is None:
                return None
            with self._meta_lock:
                keys = self._load_keys.pop(task_id, [])
            hit = [k for k, f in zip(keys, found) if f]
            if hit:
                self._notify_safely(self._notify_keys_accessed, hit)
            return bitmap(found)

        # -- housekeeping -----------------------------------------------------------------------
        def report_status(self) -> dict:
            status: dict[str, Any] = {"is_healthy": False, "type": "KVStreamL2Adapter"}
            status.update(self.core.stats())
            try:
                engine = status["engine"] = self.engine.stats()
                status["is_healthy"] = not self._closed and any(t["healthy"] for t in engine["tiers"])
            except Exception:  # closed engine, or a stats bug: report, never raise into LMCache
                status["engine"] = "unavailable"
            return status

        def close(self) -> None:
            if self._closed:
                return
            self._closed = True
            self.core.close()
            if self._own_engine:
                self.engine.close()
            for efd in self._efds:
                efd.close()

        # -- helpers ----------------------------------------------------------------------------
        def _map_objects(self, keys: list, objects: list) -> tuple[list[str | None], list]:
            """ObjectKeys + MemoryObjs -> engine keys + one-segment pages of the object's logical
            bytes (L1 objects are 4096-aligned; the engine stages O_DIRECT reads itself, so the
            padding between get_size() and get_physical_size() is never touched)."""
            ekeys: list[str | None] = []
            pages: list = []
            for i, key in enumerate(keys):
                try:
                    obj = objects[i]
                    ekeys.append(engine_key(key, layout_tag(obj.get_shapes(), obj.get_dtypes())))
                    pages.append([(obj.data_ptr, obj.get_size())])
                except Exception:  # a key or buffer we cannot map: that page fails, the task goes on
                    self.core.report_error("key/buffer mapping")
                    ekeys.append(None)
                    pages.append(None)
            return ekeys, pages

        def _notify_safely(self, notify: Callable, *args: Any) -> None:
            try:
                notify(*args)
            except Exception:
                self.core.report_error("LMCache listener")

    KVStreamL2Adapter.__qualname__ = "KVStreamL2Adapter"  # built in a function; name it as imported
    KVStreamL2Adapter.__module__ = __name__
    return {"KVStreamL2Adapter": KVStreamL2Adapter}
