"""LMCache's L2 adapter interface over :class:`~kvstream_hicache.lmcache.core.L2Core`: ``KVStreamL2Adapter``.

The class is built on first access (module ``__getattr__``), so this module imports without LMCache or
torch; LMCache itself loads it by name (``module_path`` / ``class_name`` of a plugin adapter).
"""
from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..config import parse_flag, parse_number
from ..segments import nbytes
from .core import DEFAULT_MAX_POOL_PAGES, L2Core, open_engine
from .keys import engine_key, layout_tag, split_params

log = logging.getLogger("kvstream")


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
        raise ImportError(f"kvstream_hicache.lmcache.adapter.KVStreamL2Adapter needs lmcache 0.5.6 ({exc}); "
                          "install it with scripts/setup-lmcache-env.sh (a separate venv)") from exc

    def bitmap(bits: list[bool]) -> Any:
        out = Bitmap(len(bits))
        out.batched_set([i for i, bit in enumerate(bits) if bit])
        return out

    class KVStreamL2Adapter(L2AdapterInterface):
        """LMCache L2 adapter over a kvstream engine (see the module docstring).

        :param params: LMCache's ``adapter_params``: engine settings (``tiers``, ``capacity``,
            ``policy``, ... as ``KVSTREAM_*``; explicit wins over the variable) and the adapter's own
            (:data:`~kvstream_hicache.lmcache.keys.ADAPTER_PARAMS`).
        :param l1_memory_desc: LMCache's L1 arena: registered with the engine so that reads of chunks
            one tier alone holds land in L1 directly from the first load when the arena is huge-page
            backed (:meth:`Engine.register_memory`); every other read is staged and copied.
        :param engine: an engine to use instead of opening one (tests, embedding); not closed here.
        :raises KVStreamError: bad setting or unusable tier (LMCache then fails to start the server).
        """

        def __init__(self, params: Mapping[str, Any] | None = None, l1_memory_desc: Any = None, *,
                     engine: Any = None, environ: Mapping[str, str] | None = None):
            super().__init__(max_capacity_bytes=0)  # the engine evicts per tier; LMCache must not
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
            self._store_keys: dict[int, tuple[list, list[int]]] = {}  # task -> (ObjectKeys, sizes)
            self._load_keys: dict[int, list] = {}
            # One lock per direction: a store submit may wait for write_backlog, and a load's result
            # must not wait behind it.
            self._store_lock = threading.Lock()
            self._load_lock = threading.Lock()
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
            sizes = [nbytes(p) for p in pages]
            # Submitted and recorded under one lock: a task can complete before submit returns (pages
            # already held), and its pop must still find its keys (the pop waits for this lock).
            with self._store_lock:
                task_id = self.core.submit_store(ekeys, pages)
                self._store_keys[task_id] = (list(keys), sizes)
            return task_id

        def pop_completed_store_tasks(self) -> dict:
            out = {}
            for task_id, (ok, nbytes) in self.core.pop_stores().items():
                with self._store_lock:
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
            with self._load_lock:  # as for stores: the result's pop finds the keys
                task_id = self.core.submit_load(ekeys, pages)
                self._load_keys[task_id] = list(keys)
            return task_id

        def query_load_result(self, task_id: int) -> Any:
            found = self.core.pop_load(task_id)
            if found is None:
                return None
            with self._load_lock:
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
            self._release()

        def _release(self) -> None:
            if self._own_engine:
                self.engine.close()
            for efd in self._efds:
                efd.close()

        # -- helpers ----------------------------------------------------------------------------
        def _register_l1(self, desc: Any) -> bool:
            """Tell the engine where loads land (a lazy arena: the part pinned so far). Only a speed-up:
            a failure is logged and reads are staged."""
            if desc is None:
                return False
            try:
                size = getattr(desc, "stable_registration_size", None) or desc.size
                return bool(self.engine.register_memory(int(desc.ptr), int(size)))
            except Exception as exc:
                log.warning("kvstream lmcache: could not register the L1 arena (%s); reads are staged", exc)
                return False

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
