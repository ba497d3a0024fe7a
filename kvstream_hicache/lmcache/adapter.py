"""LMCache's L2 adapter interface over :class:`~kvstream_hicache.lmcache.core.L2Core`: ``KVStreamL2Adapter``.

The class is built on first access (module ``__getattr__``), so this module imports without LMCache or
torch; LMCache itself loads it by name (``module_path`` / ``class_name`` of a plugin adapter).
"""
from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..config import parse_flag, parse_number
from ..locks import ranked_lock
from ..segments import nbytes
from .core import DEFAULT_MAX_POOL_PAGES, L2Core, open_engine
from .keys import ADAPTER_PARAMS, engine_key, split_params

log = logging.getLogger("kvstream")


def _shared_mapping(address: int, nbytes: int) -> bool:
    """Whether ``[address, address + nbytes)`` lies wholly in shared mappings of this process
    (/proc/self/maps, in address order: ``rw-s`` ones, one after another with no gap)."""
    end = address + nbytes
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split(None, 2)[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if hi <= address:
                    continue
                if lo > address or not perms.endswith("s"):
                    return False  # a gap, or private memory, before the end
                address = hi
                if address >= end:
                    return True
    except OSError:  # (no procfs: not registered, reads are staged)
        pass
    return False


class _Fallback(logging.StreamHandler):
    """_log_somewhere's handler: it writes a record only while no handler of the host's would (one configured
    later, logging.basicConfig in a script: each line came out twice)."""

    def emit(self, record: logging.LogRecord) -> None:
        at: logging.Logger | None = log
        while at is not None:  # (as Logger.callHandlers walks them)
            if any(h is not self for h in at.handlers):
                return
            at = at.parent if at.propagate else None
        super().emit(record)


def _log_somewhere() -> None:
    """Give the 'kvstream' logger a handler where the process configured none: ``lmcache server`` sets up
    only LMCache's own loggers (each with its handler, at INFO), so the adapter's start-up line (tiers,
    L1 registered or staged, trust) and every INFO line went nowhere, even with ``log_level: INFO``,
    and warnings came out bare through Python's last resort. A host that configured logging (SGLang,
    pytest, a root handler) is left as it set it."""
    if log.hasHandlers():
        return
    handler = _Fallback()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(message)s"))  # (each says "kvstream")
    log.addHandler(handler)
    if log.level == logging.NOTSET:  # LMCache's own default level (LMCACHE_LOG_LEVEL); log_level overrides it
        log.setLevel(logging.INFO)


def _row(key: Any, i: int) -> Any:
    """The row of a lookup key: LMCache's lookup holds one row of chunk keys per object group and kv
    rank (its GroupedObjectKeys), and serves a prefix of each (L2Core._discover). A key without those
    fields is a row of its own."""
    try:
        return key.model_name, key.kv_rank, key.object_group_id, key.cache_salt
    except Exception:
        return "key", i


def __getattr__(name: str) -> Any:
    """``KVStreamL2Adapter`` is built on first access: importing this module needs no LMCache."""
    classes = _lmcache_classes() if name in _LMCACHE_CLASSES else None
    if classes is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals().update(classes)
    return classes[name]


_LMCACHE_CLASSES = ("KVStreamL2Adapter", "KVStreamL2AdapterConfig")


@functools.cache
def _lmcache_classes() -> dict[str, type]:
    try:
        from lmcache.lmcache_native import Bitmap
        from lmcache.v1.distributed.internal_api import L2StoreResult
        from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
        from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
        from lmcache.v1.platform import create_event_notifier
    except ImportError as exc:
        raise ImportError(f"kvstream_hicache.lmcache.adapter.KVStreamL2Adapter needs lmcache 0.5.6 ({exc}); "
                          "install it with scripts/setup-lmcache-env.sh (a separate venv)") from exc

    def bitmap(bits: list[bool]) -> Any:
        out = Bitmap(len(bits))
        out.batched_set([i for i, bit in enumerate(bits) if bit])
        return out

    class KVStreamL2AdapterConfig(L2AdapterConfigBase):
        """``adapter_params`` as LMCache's plugin factory hands them over: it finds this class by the
        ``<class_name>Config`` convention and passes ``from_dict(adapter_params)`` to the adapter."""

        def __init__(self, params: Mapping[str, Any] | None = None):
            self.params = dict(params or {})

        @classmethod
        def from_dict(cls, d: dict) -> "KVStreamL2AdapterConfig":
            return cls(d)

        @classmethod
        def help(cls) -> str:
            return ("KVStreamL2Adapter adapter_params: engine settings (tiers, capacity, policy, ...; see "
                    "docs/design.md) and " + ", ".join(f"{k} ({v})" for k, v in ADAPTER_PARAMS.items()))

    class KVStreamL2Adapter(L2AdapterInterface):
        """LMCache L2 adapter over a kvstream engine (see the module docstring).

        :param params: LMCache's ``adapter_params``: engine settings (``tiers``, ``capacity``,
            ``policy``, ... as ``KVSTREAM_*``; explicit wins over the variable) and the adapter's own
            (:data:`~kvstream_hicache.lmcache.keys.ADAPTER_PARAMS`).
        :param l1_memory_desc: LMCache's L1 arena: registered with the engine so that reads of chunks
            one tier alone holds land in L1 directly from the first load (:meth:`Engine.register_memory`:
            pinned once with the read ring, or huge-page backed); every other read is staged and copied.
        :param engine: an engine to use instead of opening one (tests, embedding); not closed here.
        :raises KVStreamError: bad setting or unusable tier (LMCache then fails to start the server).
        """

        def __init__(self, params: Mapping[str, Any] | None = None, l1_memory_desc: Any = None, *,
                     engine: Any = None, environ: Mapping[str, str] | None = None):
            super().__init__()  # the capacity is the engine's, known once it is open (below)
            if isinstance(params, KVStreamL2AdapterConfig):
                params = params.params
            _log_somewhere()  # first: the start-up's own warnings and errors go there too
            opts, settings = split_params(params)
            # The adapter's own options are checked before the engine opens: a bad one leaves nothing open.
            pool_loads = parse_flag(opts.get("pool_loads", True), "adapter_params 'pool_loads'")
            max_pool_pages = parse_number(opts.get("max_pool_pages", DEFAULT_MAX_POOL_PAGES),
                                          "adapter_params 'max_pool_pages'", int, 1,
                                          " (the largest pooled load, in pages; e.g. 4096)")
            self._own_engine = engine is None
            self.engine = open_engine(settings, opts.get("namespace"), environ) if engine is None else engine
            self._efds: list = []
            self._closed = False
            try:
                for _ in range(3):  # store, lookup, load: distinct fds
                    self._efds.append(create_event_notifier())
                self.core = L2Core(self.engine, on_store=lambda _t: self._efds[0].notify(),
                                   on_lookup=lambda _t: self._efds[1].notify(),
                                   on_load=lambda _t: self._efds[2].notify(), pool_loads=pool_loads,
                                   max_pool_pages=max_pool_pages)
            except BaseException:  # LMCache fails to start; the engine and fds opened so far close
                self._release()
                raise
            in_place = self._register_l1(l1_memory_desc)
            self._store_keys: dict[int, tuple[list, list[str | None], list[int]]] = {}  # task -> keys
            # A store submit may wait for write_backlog: nothing else waits behind this lock.
            self._store_lock = ranked_lock("lmcache.store")
            # LMCache's byte accounting (base class) follows what the engine holds: a key counts once,
            # from the store that put it there until delete() or the engine's eviction removes it.
            self._held: dict[str, tuple[Any, int]] = {}  # engine key -> (ObjectKey, size)
            self._held_lock = ranked_lock("lmcache.held")
            self._gone: deque[str] = deque()  # engine keys the index dropped (its lock held: no work there)
            self.engine.on_gone(self._gone.append)
            # Keys stored while held only as another process's copies (not counted), until this process writes
            # its own (catch-up: the index queues them to _own, counted then) or they leave the index.
            self._theirs: dict[str, tuple[Any, int]] = {}
            self._own: deque[str] = deque()
            self.engine.on_own(self._own.append)
            # (ObjectKey, engine key, size) of the chunks loads read: accounted as stored (_account): a chunk
            # read from another process's copy gains one of this process's (promotion, catch-up), delete()'s
            self._loaded: deque[tuple[Any, str | None, int]] = deque()
            self._max_capacity_bytes = self.engine.usage()[1]
            config = getattr(self.engine, "config", None)
            log.info("kvstream lmcache: L2 adapter up; %s; pooled loads %s; %s; namespace %s; %s",
                     config.summary() if config is not None else "engine given",
                     "on" if self.core.pool_loads else "off",
                     "reads of single-tier chunks land in L1" if in_place else "reads staged and copied into L1",
                     getattr(getattr(self.engine, "namespace", None), "digest", "?"),
                     self.engine.trust_summary() if hasattr(self.engine, "trust_summary") else "trust not known")

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
            sizes = [nbytes(p) if p is not None else 0 for p in pages]
            # Submitted and recorded under one lock: a task can complete before submit returns (pages
            # already held), and its pop must still find its keys (the pop waits for this lock).
            with self._store_lock:
                task_id = self.core.submit_store(ekeys, pages, hold=list(objects))
                self._store_keys[task_id] = (list(keys), ekeys, sizes)
            return task_id

        def pop_completed_store_tasks(self) -> dict:
            out = {}
            for task_id, (ok, written, stored) in self.core.pop_stores(pages=True).items():
                with self._store_lock:
                    keys, ekeys, sizes = self._store_keys.pop(task_id, ([], [], []))
                self._account([(k, e, n) for k, e, n, good in zip(keys, ekeys, sizes, stored) if good])
                out[task_id] = L2StoreResult(ok, written)
            return out

        # -- lookup and lock --------------------------------------------------------------------
        def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: dict | None = None) -> int:
            # group_layout_descs is a hint (LMCache's base class: "most adapters ignore it"): the key
            # alone finds the page, and a load checks its size.
            ekeys = [self._engine_key(key, "lookup key mapping") for key in keys]
            return self.core.submit_lookup(ekeys, lock_keys=keys, rows=[_row(key, i) for i, key in enumerate(keys)])

        def query_lookup_and_lock_result(self, task_id: int) -> Any:
            hits = self.core.pop_lookup(task_id)
            return None if hits is None else bitmap(hits)

        def submit_unlock(self, keys: list) -> None:
            self.core.unlock(keys)

        # -- load -------------------------------------------------------------------------------
        def submit_load_task(self, keys: list, objects: list) -> int:
            ekeys, pages = self._map_objects(keys, objects)
            keys = list(keys)

            def accessed(found: list[bool]) -> None:  # when the load completes, before its eventfd
                hit = [k for k, f in zip(keys, found) if f]
                self._loaded.extend((k, e, nbytes(p)) for k, e, p, f in zip(keys, ekeys, pages, found) if f and p)
                if hit:
                    self._notify_safely(self._notify_keys_accessed, hit)

            return self.core.submit_load(ekeys, pages, hold=list(objects), done=accessed)

        def query_load_result(self, task_id: int) -> Any:
            found = self.core.pop_load(task_id)
            return None if found is None else bitmap(found)

        def debug_has_key(self, key: Any) -> bool:
            """Whether a healthy tier holds ``key`` (no lock taken): the probe LMCache's storage-manager
            tests call on their mock adapter to wait for a store to land."""
            ekey = self._engine_key(key, "debug key mapping")
            return ekey is not None and self.engine.contains(ekey)

        # -- delete and usage -------------------------------------------------------------------
        def delete(self, keys: list) -> None:
            """Evict the keys (LMCache 0.5.6 calls this from its L2 eviction only): this process's copies
            go, another process's copy on a shared tier stays (Engine.evict); ``on_l2_keys_deleted`` fires
            for those that were held. Never raises (a key that fails stays, and is counted in ``errors``)."""
            ekeys = [self._engine_key(key, "delete key mapping") for key in keys]
            try:
                self.engine.evict([e for e in ekeys if e is not None])
            except Exception:
                self.core.report_error("delete")
            self._account([])

        def get_usage(self) -> Any:
            """The bytes of the keys stored through this adapter that the tiers still hold (the base
            class's count, per cache_salt too) against the largest tier's capacity (``Engine.usage``).
            Not every page the index holds: pages of an earlier run and another server's pages found on
            a shared tier are not LMCache's to delete (it never stored them; the ObjectKey is not
            recoverable from the engine key), so an LMCache eviction policy counting them deleted every
            chunk this server stored, at each pass, while they stayed. The engine's capacity eviction
            takes them (the earlier run's first)."""
            self._account([])
            base = super().get_usage()
            try:
                _, capacity = self.engine.usage()
            except Exception:  # closed engine: LMCache's own count
                return base
            return AdapterUsage(total_bytes_used=base.total_bytes_used, total_capacity_bytes=capacity,
                                bytes_by_cache_salt=base.bytes_by_cache_salt)

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
            self._release()

        def _release(self) -> None:
            if self._own_engine:
                self._close_engine()
            elif getattr(self, "_gone", None) is not None:
                self.engine.on_gone(None)
                self.engine.on_own(None)
            for efd in self._efds:
                efd.close()

        def _close_engine(self) -> None:
            """The engine's close. Where the core let go of stores that a hung tier holds the writer for
            (L2Core.close), that close would wait for the same call: it runs on a thread of its own,
            left once it is past the reads (no get touches L1 any more: LMCache frees it next) while
            the writer is still held; it ends when the tier answers (or with the process)."""
            since = getattr(getattr(self, "core", None), "let_go_at", None)  # (no core: its start failed)
            if since is None:
                self.engine.close()
                return
            closing = threading.Thread(target=self.engine.close, name="kvstream-lmcache-close", daemon=True)
            closing.start()
            while closing.is_alive() and not (self.engine.reads_drained and self.engine.stalled(since)):
                closing.join(1.0)
            if closing.is_alive():
                log.warning("kvstream lmcache: close(): the engine finishes closing in the background, once the "
                            "hung tier answers")

        # -- helpers ----------------------------------------------------------------------------
        def _register_l1(self, desc: Any) -> bool:
            """Tell the engine where loads land: the range LMCache says stays mapped and pinned (a lazy
            arena: the part pinned so far), or, where it names none, the whole arena if it is a shared
            mapping (LMCache's POSIX-shm arena, allocated whole at start; LMCache's own RawBlock adapter
            skips it, but Linux registers shared memory). A private arena without a stable range (a
            lazy one not grown yet) is not registered: pinning its final size would allocate all of it
            now. Only a speed-up: a failure is logged and reads are staged."""
            if desc is None:
                return False
            try:
                size = getattr(desc, "stable_registration_size", None)
                if not size and _shared_mapping(int(desc.ptr), int(desc.size)):
                    size = desc.size
                return bool(size) and bool(self.engine.register_memory(int(desc.ptr), int(size)))
            except Exception as exc:
                log.warning("kvstream lmcache: could not register the L1 arena (%s); reads are staged", exc)
                return False

        def _engine_key(self, key: Any, what: str) -> str | None:
            try:
                return engine_key(key)
            except Exception:  # a key we cannot map: a miss for that key, the task goes on
                self.core.report_error(what)
                return None

        def _account(self, stored: list[tuple[Any, str | None, int]]) -> None:
            """Bring LMCache's accounting and listeners in line with the engine: ``stored`` (ObjectKey,
            engine key, size) were just stored (and the chunks loads read since, as stored), and every key the
            engine dropped since (delete, eviction, damage) is gone. A key counts once however often it is
            stored."""
            new: list[tuple[Any, int]] = []
            gone: list[tuple[Any, int]] = []
            with self._held_lock:
                loaded = []  # (a chunk loaded counts as one stored: its copy of this process's, if any)
                while self._loaded:
                    loaded.append(self._loaded.popleft())
                for key, ekey, size in (*stored, *loaded):
                    # Counted only if the engine still holds it: a key evicted or deleted between its
                    # commit and LMCache's pop had its gone event drained (by any get_usage/delete)
                    # while not yet in _held, and would stay counted for good. The index drops a key
                    # before it queues the key's gone event, so a drop after this check leaves its event
                    # queued, and the drain below (or the next one) removes the key again.
                    # A key whose only copies are another process's (found on a shared tier: nothing
                    # written) is not counted: delete() evicts, which leaves them (Engine.evict), and counted
                    # they made LMCache's eviction delete this server's own chunks instead.
                    # Its own copy written later counts then (_own below: before, it never counted).
                    if ekey is None or ekey in self._held:
                        continue
                    own = self._engine_holds(ekey, own=True)
                    if own:
                        self._held[ekey] = (key, size)
                        new.append((key, size))
                        # (stored earlier while held only as another's: its own copy's on_own, still queued,
                        # must not count it again)
                        self._theirs.pop(ekey, None)
                    elif own is False and self._engine_holds(ekey):
                        self._theirs[ekey] = (key, size)
                while self._own:
                    ekey = self._own.popleft()
                    if ekey in self._theirs and self._engine_holds(ekey, own=True):
                        self._held[ekey] = self._theirs.pop(ekey)
                        new.append(self._held[ekey])
                while self._gone:
                    ekey = self._gone.popleft()
                    if ekey in self._theirs and self._engine_holds(ekey) is False:
                        del self._theirs[ekey]
                    if ekey in self._held and self._engine_holds(ekey, own=True) is False:  # (another
                        # process's copies left alone: delete() would only forget them, Engine.evict)
                        gone.append(self._held.pop(ekey))
                        if self._engine_holds(ekey):  # (counted again if its own copy is written again)
                            self._theirs[ekey] = gone[-1]
            if new:
                self._notify_safely(self._notify_keys_stored, [k for k, _ in new], [n for _, n in new])
            if gone:
                self._notify_safely(self._notify_keys_deleted, [k for k, _ in gone], [n for _, n in gone])

        def _engine_holds(self, ekey: str, own: bool = False) -> bool | None:
            """engine.held (with ``own``, engine.holds_own), None where it fails: a forked child's engine refuses
            every call, and get_usage, pop_completed_store_tasks and delete (which account through here) never
            raise into LMCache."""
            try:
                return self.engine.holds_own(ekey) if own else self.engine.held(ekey)
            except Exception:
                self.core.report_error("usage accounting")
                return None

        def _map_objects(self, keys: list, objects: list) -> tuple[list[str | None], list]:
            """ObjectKeys + MemoryObjs -> engine keys + one-segment pages of the object's logical
            bytes: only ``data_ptr`` and ``get_size()``, which every MemoryObj has, whatever its
            metadata (L1 objects are 4096-aligned; the engine stages O_DIRECT reads itself, so the
            padding between get_size() and get_physical_size() is never touched)."""
            ekeys: list[str | None] = []
            pages: list = []
            for i, key in enumerate(keys):
                try:
                    obj = objects[i]
                    page = [(int(obj.data_ptr), int(obj.get_size()))]
                    ekeys.append(engine_key(key))
                    pages.append(page)
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

    classes = {"KVStreamL2Adapter": KVStreamL2Adapter, "KVStreamL2AdapterConfig": KVStreamL2AdapterConfig}
    for name, cls in classes.items():  # built in a function; name them as imported
        cls.__qualname__ = name
        cls.__module__ = __name__
    return classes
