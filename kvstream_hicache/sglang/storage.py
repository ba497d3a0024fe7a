"""The sglang HiCache L3 storage backend: ``KVStreamHiCacheStorage`` (the only module importing sglang/torch).

sglang's HiCache controller calls a backend from three threads of every scheduler process: the prefetch
thread (``batch_exists``: the hit query, on the scheduler's path, thousands of keys), the prefetch IO
thread (``batch_get_v1``: read pages into the host KV pool) and the backup thread (``batch_set_v1``:
write pages out of the host pool). This class maps those calls onto one :class:`~kvstream_hicache.engine.Engine`:

* a *page* is one sglang page of the host pool; its payload is the concatenation of the host pool's page
  segments from ``get_page_buffer_meta`` (K then V for MHA page_first, one chunk for MLA page_first,
  ``2L``/``L`` small per-layer chunks for layer_first), ordered so the payload equals sglang's flat page
  (``get_data_page``): the zero-copy and the legacy paths store identical bytes and can read each other's;
* segments go to the engine as ``(address, nbytes)``; the engine writes 4096-aligned ones with O_DIRECT
  straight from the host pool and stages the rest through aligned buffers;
* keys are sglang's 64-hex page hashes; the engine's namespace (model, layout, dtype, page geometry,
  TP rank/size for MHA, PP and CP rank/size) keeps pages of different models, layouts and ranks apart;
  MLA pages are shared by every TP rank: sglang backs them up from the storage-writer rank only (its
  controller skips the others' backups); a rank that is asked to store them anyway stores them (the same
  bytes), so a True from a set is always a page that ``exists`` finds. Background replication (a write
  too) runs on the writer rank only: the others' engines have ``catchup`` off.

Failure rule: nothing raises into sglang's threads. Any exception in a data-path method becomes the
method's "nothing happened" answer (False per page, 0 hits, None), one rate-limited warning and a counter.
Configuration errors do raise, from the constructor or the attach (``register_mem_pool_host``), which is
where sglang expects a backend to refuse to start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from contextlib import suppress
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransferResult,
)

from ..config import LOADER_KEYS, Config
from ..layout import ALIGN, Namespace, is_valid_key
from ..locks import ranked_lock
from ..segments import Segment

log = logging.getLogger("kvstream.sglang")

NAME = "kvstream"
# Keys sglang itself leaves in storage_config.extra_config (its `dynamic` loader's, --file-storage-path,
# the shm allocator switch, and the controller's knobs if an older parser left them): not ours to validate.
SGLANG_KEYS = LOADER_KEYS | frozenset({
    "file_storage_path", "allocator", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})
WARN_INTERVAL_S = 30.0  # at most one warning per (method, error) in this many seconds
METRICS_INTERVAL_S = 1.0  # engine stats -> Prometheus at most this often
MAX_STORAGE_SAMPLES = 4096  # per-call samples kept for get_stats() between two polls


class KVStreamHiCacheStorage(HiCacheStorage):
    """sglang HiCache storage backend over kvstream's replicated tiers.

    :param storage_config: sglang's ``HiCacheStorageConfig`` (ranks, MLA flag, model name, extra config).
    :param mem_pool_host: the host KV pool (plugin path), or ``{}`` (sglang's ``dynamic`` loader passes an
        empty kwargs dict); the pool always arrives through :meth:`register_mem_pool_host` as well.
    :raises kvstream_hicache.errors.ConfigError: bad extra config or ``KVSTREAM_*`` variable.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, mem_pool_host: Any = None, **_: Any):
        self.storage_config = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.enable_metrics = bool(storage_config.enable_storage_metrics)
        extra = dict(storage_config.extra_config or {})
        self.config = Config.from_sources(extra, os.environ, ignore=SGLANG_KEYS)
        if self.is_mla and not self.is_writer:
            # Every rank reads the shared MLA pages and sglang writes them from the writer rank only;
            # catch-up is a write too, so the writer rank's engine does it (replication.py).
            self.config = dataclasses.replace(self.config, catchup=False)
            if not self.config.discover:
                # This rank finds the writer's pages by discovery alone: index-only, it found none written
                # after its scan, and sglang's MIN over the ranks' hits made every L3 lookup a miss.
                log.warning("kvstream: discover=0 (KVSTREAM_DISCOVER) ignored on MLA TP rank %d: it never writes and "
                            "finds the pages TP rank 0 stores only by discovery (off, every L3 lookup of the "
                            "server would miss)", storage_config.tp_rank)
                self.config = dataclasses.replace(self.config, discover=True)
        self.mem_pool_host = None
        self.engine = None
        self.namespace: Namespace | None = None
        self.registered_pools: dict = {}
        self._sidecars: list[str] = []
        self._refused: str | None = None
        self._reads_in_place = False
        self._closed = False
        self._lock = ranked_lock("sglang.adapter")  # attach/close and the adapter's own counters, never held during I/O
        self._segments_per_page = 0
        self._reorder_kv = False
        self._page_bytes = 0
        self._aligned = False  # every piece of a host page 4096-aligned (_describe_pages)
        self._warned: dict[tuple[str, str], list] = {}
        self.counters = {"errors": 0, "legacy_calls": 0, "refused_calls": 0, "invalid_keys": 0,
                         "bad_arguments": 0, "bad_host_indices": 0, "metrics_errors": 0}
        self._samples = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}
        self._exporter = None
        self._last_sync = 0.0
        self._sync_lock = ranked_lock("sglang.sync")  # one snapshot+export at a time, in snapshot order
        self._last_stats: dict | None = None
        self._trailing: threading.Timer | None = None  # the sync owed after a skipped one (_arm_trailing_sync)
        if mem_pool_host is not None and not isinstance(mem_pool_host, dict):
            self.register_mem_pool_host(mem_pool_host)

    # ------------------------------------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Bind the host KV pool and open the engine on its namespace (sglang calls this once per attach;
        the plugin factory path calls it from the constructor first, so a second call with the same pool
        is a no-op)."""
        with self._lock:
            if self.mem_pool_host is mem_pool_host and self.engine is not None:
                return
            if self.engine is not None:
                raise RuntimeError("kvstream: a different host pool was registered on an attached backend; "
                                   "detach and attach the storage backend again")
            self.mem_pool_host = mem_pool_host
            self._describe_pages(mem_pool_host)
            self.namespace = Namespace(self._namespace_fields(mem_pool_host))
            engine = self._open_engine(self.namespace)
            try:  # the backend holds an engine only once attached whole: a retry starts afresh
                self._exporter = self._make_exporter() if self.enable_metrics else None
            except BaseException:
                engine.close()
                raise
            self.engine = engine
            self._reads_in_place = self._register_pool(mem_pool_host)
        self._log_startup()
        self._say_earlier_namespace()

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Record every host pool of the group; any pool but the KV anchor means a hybrid model (see
        :meth:`on_host_pools_registered`)."""
        self.registered_pools[host_pool_name] = host_pool
        if _pool_name(host_pool_name) != PoolName.KV.value:
            self._sidecars.append(_pool_name(host_pool_name))
            if self._attached_once:
                # A sidecar added after the attach (a draft model's KV pool: SGLang registers it while the
                # scheduler still starts): refused as at the attach, so the server does not start and
                # serve every L3 lookup as a miss while it writes pages nobody reads.
                self.on_host_pools_registered()

    def on_host_pools_registered(self) -> None:
        """Refuse hybrid models (SWA, Mamba, DSA indexer, draft KV sidecars): they need the v2 interface.

        Raising here fails sglang's attach with this message; the backend is closed first, so any call the
        already-started storage threads still make is answered with a miss.
        """
        self._attached_once = True
        if not self._sidecars or self._refused is not None:
            return
        names = ", ".join(sorted(set(self._sidecars)))
        self._refused = (
            f"kvstream: this model uses HiCache sidecar host pools ({names}) besides the KV pool; kvstream "
            "implements the v1 storage interface (KV pages only) and cannot store them. Run this model with "
            "--hicache-storage-backend file, or without an L3 storage backend.")
        self.close()
        raise RuntimeError(self._refused)

    _attached_once = False

    # ------------------------------------------------------------------------------------------ v1
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Number of leading ``keys`` stored: from the engine's index; the first key it lacks costs one
        header lookup per tier (a page another rank or server wrote, see Engine.prefix_len)."""
        return self._guard("batch_exists", 0, self._batch_exists, keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read ``keys`` into the host pool at ``host_indices`` (``page_size`` slots per key). One bool per key;
        sglang uses the leading run of True."""
        return self._guard("batch_get_v1", [False] * _count_of(keys), self._batch_get_v1, keys, host_indices,
                           extra_info)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Write the host pool's pages at ``host_indices`` under ``keys``; returns once every byte is out of
        host memory. One bool per key (True = at least one tier holds a verified copy)."""
        return self._guard("batch_set_v1", [False] * _count_of(keys), self._batch_set_v1, keys, host_indices,
                           extra_info)

    # ------------------------------------------------------------------------------------------ legacy
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | bool | None:
        """Legacy: read one page into the flat page tensor ``target_location``; the tensor, or None.
        With raw addresses (``target_location`` an int or ints, ``target_sizes`` their byte counts, as
        sglang's Mooncake backend takes them): whether the page was read there."""
        if _raw(target_location):
            return self._guard("get", False, self._raw_call, self._get_pages, key, target_location, target_sizes)
        return self._guard("get", None, lambda: self._legacy_get([key], [target_location])[0])

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        """Legacy (copying) read path: fill the flat page tensors; per key the tensor or None."""
        return self._guard("batch_get", [None] * _count_of(keys), self._legacy_get, keys, target_locations)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Legacy: write one flat page tensor, or (``value`` None) the bytes at raw addresses
        ``target_location`` / ``target_sizes`` (sglang's Mooncake form)."""
        if value is None and _raw(target_location):
            return self._guard("set", False, self._raw_call, self._put_pages, key, target_location, target_sizes)
        return self._guard("set", False, lambda: all(self._legacy_set([key], [value])))

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Legacy (copying) write path: flat page tensors; True when every page is stored."""
        return self._guard("batch_set", False, lambda: all(self._legacy_set(keys, values)))

    def exists(self, key: str) -> bool:
        """Legacy: is ``key`` stored (as batch_exists)."""
        return self._guard("exists", False, lambda: self._batch_exists([key]) == 1)

    # ------------------------------------------------------------------------------------------ v2
    # Never reached for the models we accept (sglang calls v2 only with sidecar pools, refused at attach);
    # implemented as misses so a sidecar registered after the attach cannot raise into a controller thread.
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        def run():
            if pool_transfers:
                self._warn("batch_exists_v2", "sidecar pools", "kvstream: v2 query with sidecar pools answered "
                           "as a miss (kvstream stores only the KV pool)")
                return PoolTransferResult(kv_hit_pages=0, extra_pool_hit_pages={})
            return PoolTransferResult(kv_hit_pages=self._batch_exists(keys), extra_pool_hit_pages={})

        return self._guard("batch_exists_v2", None, run) or PoolTransferResult(kv_hit_pages=0,
                                                                                  extra_pool_hit_pages={})

    def batch_get_v2(self, transfers, extra_info=None):
        return _v2_misses(transfers)

    def batch_set_v2(self, transfers, extra_info=None):
        return _v2_misses(transfers)

    # ------------------------------------------------------------------------------------------ admin
    def clear(self) -> None:
        """Drop every page of this namespace from every tier (sglang's /clear_hicache_storage_backend)."""
        self._guard("clear", None, lambda: self.engine.clear() if self.engine is not None else None)

    def close(self) -> None:
        """Close the engine (idempotent). Later calls answer misses / False without touching the tiers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self.engine = self.engine, None
            trailing, self._trailing = self._trailing, None
        if trailing is not None:
            trailing.cancel()
        if engine is not None and self._exporter is not None:  # the counts since the last sync (a detach;
            with self._sync_lock, suppress(Exception):  # backends of one process add up, metrics.py)
                self._exporter.sync(self._stats_of(engine), self.counters)
        if engine is not None:
            try:
                engine.close()
            except Exception as exc:  # close() runs on sglang's detach path: report, never raise
                log.warning("kvstream: closing the engine failed: %s", exc)

    def get_stats(self):
        """sglang's ``StorageMetrics`` (pages and GB/s per prefetch/backup call since the last poll), with the
        full kvstream stats attached as ``.kvstream``. Also pushes the Prometheus metrics."""
        return self._guard("get_stats", None, self._get_stats)

    def flush_metrics(self) -> None:
        """Push the engine's counters to Prometheus now (normally at most once per second, from the batch
        calls and sglang's get_stats polls)."""
        self._guard("flush_metrics", None, self._maybe_sync, True)

    def stats(self) -> dict:
        """Engine stats (per tier bytes, shares, errors, last batch vs bound) plus the adapter's counters."""
        return self._stats_of(self.engine)

    def _stats_of(self, engine) -> dict:
        out = dict(engine.stats() if engine is not None else {})
        out["adapter"] = dict(self.counters)
        return out

    # ------------------------------------------------------------------------------------------ internals
    def _guard(self, method: str, default: Any, fn: Callable, *args: Any) -> Any:
        """Run ``fn``; any exception -> ``default``, a rate-limited warning and a counter."""
        if self.engine is None:
            self._count("refused_calls")
            if self._refused is None and not self._closed and method not in ("get_stats", "clear"):
                self._warn(method, "not attached", f"kvstream: {method} called before the host pool was "
                           "registered; answering a miss")
            return default
        try:
            return fn(*args)
        except Exception as exc:
            if self._closed:  # closed under a call (sglang's detach): a miss, not a fault
                return default
            self._count("errors")
            if self._exporter is not None:
                with suppress(Exception):  # a metrics failure must not turn a miss into a raise
                    self._exporter.count_error(method)
            self._warn(method, type(exc).__name__, f"kvstream: {method} failed ({type(exc).__name__}: {exc}); "
                       "answered as a miss, the controller thread continues", exc_info=exc)
            return default

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _warn(self, method: str, what: str, message: str, exc_info: BaseException | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            slot = self._warned.setdefault((method, what), [0.0, 0])
            if slot[0] and now - slot[0] < WARN_INTERVAL_S:
                slot[1] += 1
                return
            suppressed, slot[0], slot[1] = slot[1], now, 0
        if suppressed:
            message += f" ({suppressed} more like this in the last {WARN_INTERVAL_S:.0f} s)"
        log.warning("%s", message, exc_info=exc_info if log.isEnabledFor(logging.DEBUG) else None)  # (an
        # argument: escaped, errors.PrintableArgs; the message names the exception, which may name a tier's file)

    def _batch_exists(self, keys: Sequence[str]) -> int:
        return self.engine.prefix_len(keys)

    def _batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        pages = self._pool_pages(keys, host_indices)
        found = [False] * len(keys) if pages is None else self._get_pages(keys, pages)
        self._touch_prefix(extra_info, mark=False)  # (SGLang's prefetch thread: no metadata write there)
        return found

    def _batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        pages = self._pool_pages(keys, host_indices)
        stored = [False] * len(keys) if pages is None else self._put_pages(keys, pages)
        self._touch_prefix(extra_info, mark=True)
        return stored

    def _touch_prefix(self, extra_info: HiCacheStorageExtraInfo | None, mark: bool) -> None:
        """The call's prefix (sglang passes it with ``hicache_storage_pass_prefix_keys``, which the launcher
        turns on for kvstream: plugin.py) is in use: its pages outlive the call's (Engine.touch_prefix). Without
        it, a prefix's head, in L3 only written once while hits read the tail beyond what host memory holds, was
        the first page evicted, and every page after it dead weight (batch_exists counts the leading run).
        ``mark``: a write after the prefix marks its pages another process wrote as used, so that their
        writer keeps them too (Engine.touch_prefix; DP ranks, servers of one model sharing a tier)."""
        prefix = getattr(extra_info, "prefix_keys", None)
        if prefix:
            self.engine.touch_prefix(prefix, mark=mark)

    def _legacy_get(self, keys: list[str], targets: Any) -> list:
        self._note_legacy()
        host = self.mem_pool_host
        n = len(keys)
        given = self._per_key("batch_get", targets, n) if targets is not None else []
        # (a key without a target, as with targets=None, reads into a page of its own, returned)
        targets = [t if t is not None else host.get_dummy_flat_data_page() for t in given + [None] * (n - len(given))]
        # The engine fills contiguous memory; a strided target gets a contiguous twin, copied back after.
        landing = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
                   for t in targets]
        pages = [[(t.data_ptr(), t.numel() * t.element_size())] for t in landing]
        found = self._get_pages(keys, pages)
        out = []  # one answer per key: sglang indexes it by key
        for target, land, ok in zip(targets, landing, found, strict=True):
            if ok and land is not target:
                target.copy_(land)
            out.append(target if ok else None)
        return out

    def _legacy_set(self, keys: list[str], values: Any) -> list[bool]:
        self._note_legacy()
        values = self._per_key("batch_set", values, len(keys)) if values is not None else []
        present = [i for i, v in enumerate(values) if v is not None]
        flat = {i: values[i].contiguous() for i in present}  # referenced until the engine returns
        stored = [False] * len(keys)  # a key without a value (a short list) is not stored
        if present:
            pages = [[(flat[i].data_ptr(), flat[i].numel() * flat[i].element_size())] for i in present]
            result = self._put_pages([keys[i] for i in present], pages)
            for i, ok in zip(present, result):
                stored[i] = bool(ok)
        return stored

    def _per_key(self, method: str, items: Any, n: int) -> list:
        """The legacy calls' tensors, at most one per key: sglang indexes answers by key, so the answer
        has len(keys) entries whatever came; a key past the end of a short list has no tensor (as with
        None) and tensors past the last key are ignored (counted and warned: a caller's mismatch)."""
        items = list(items)
        if len(items) != n:
            self._count("bad_arguments")
            self._warn(method, "length", f"kvstream: {method} with {n} keys and {len(items)} tensors; keys "
                       "without a tensor are misses, tensors without a key are ignored")
        return items[:n]

    def _get_pages(self, keys: Sequence[str], pages: list) -> list[bool]:
        t0 = time.perf_counter()
        found, read = self._engine_call(self.engine.get, keys, pages)
        self._record("prefetch", found, t0, read)
        return found

    def _put_pages(self, keys: Sequence[str], pages: list) -> list[bool]:
        t0 = time.perf_counter()
        stored, _ = self._engine_call(self.engine.put, keys, pages)
        self._record("backup", stored, t0)
        return stored

    def _raw_call(self, op: Callable, key: str, locations: Any, sizes: Any) -> bool:
        """One page at raw addresses: a miss unless every segment lies inside the host pool's buffer
        (the engine reads and writes wherever the addresses point)."""
        page = list(zip(_ints(locations), _ints(sizes), strict=True))
        if not page or not self._inside_buffer(page):
            self._count("bad_arguments")
            self._warn(op.__name__, "raw", "kvstream: raw addresses outside the host pool's KV buffer; a miss")
            return False
        return bool(op([key], [page])[0])

    def _inside_buffer(self, page: Sequence[Segment]) -> bool:
        """Whether the segments lie inside the host pool's KV buffer (True where the pool has none to
        tell: its own get_page_buffer_meta is then the only authority)."""
        spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in _kv_buffers(self.mem_pool_host)]
        return not spans or all(any(lo <= a and a + n <= hi for lo, hi in spans) for a, n in page)

    def _engine_call(self, op: Callable, keys: Sequence[str], pages: list[list[Segment] | None]
                     ) -> tuple[list[bool], bool]:
        """Run an engine batch on the pages whose keys are valid and whose memory is known; the others are
        False (invalid keys counted here, pages outside the host pool by _pool_pages). Returns the answers
        and whether the engine was called (else its last batch is an earlier call's)."""
        valid = [is_valid_key(k) for k in keys]
        if not all(valid):
            self._count("invalid_keys", valid.count(False))
            self._warn("keys", "invalid", "kvstream: refused page keys that are not [0-9A-Za-z_-]{1,200} "
                       f"(first: {next(k for k, v in zip(keys, valid) if not v)!r})")
        sel = [i for i, (v, page) in enumerate(zip(valid, pages)) if v and page is not None]
        if len(sel) == len(keys):
            return list(op(keys, pages)), True
        out = [False] * len(keys)
        if sel:
            for i, r in zip(sel, op([keys[i] for i in sel], [pages[i] for i in sel])):
                out[i] = bool(r)
        return out, bool(sel)

    def _pool_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[Segment] | None] | None:
        """The host pool's segments of each page, in flat-page order. A page whose host slots are not inside
        the pool is None (a miss, counted and warned): the pool forms raw addresses from the slots, and the
        engine would read or write wherever they point. None for the whole batch (and a warning) on a shape
        or type error."""
        host = self.mem_pool_host
        n = len(keys)
        if n == 0:
            return []
        if host_indices is None or len(host_indices) != n * host.page_size:
            self._count("bad_arguments")
            self._warn("pages", "shape", f"kvstream: {n} keys but {0 if host_indices is None else len(host_indices)}"
                       f" host slots (page size {host.page_size}); answered as a miss")
            return None
        inside = self._inside_pool(host_indices, n)
        if inside is None:
            self._count("bad_arguments")
            self._warn("pages", "indices", "kvstream: host_indices are not integer slot indices "
                       f"({type(host_indices).__name__} {getattr(host_indices, 'dtype', '')}); answered as a miss")
            return None
        sel = [i for i, ok in enumerate(inside) if ok]
        if len(sel) < n:
            self._count("bad_host_indices", n - len(sel))
            self._warn("pages", "outside", f"kvstream: {n - len(sel)} of {n} pages have host slots outside the host "
                       f"pool (slots 0..{host.size - 1}, pages of {host.page_size}); those pages are misses")
            if not sel:
                return [None] * n
            host_indices = torch.as_tensor(host_indices).reshape(n, host.page_size)[sel].reshape(-1)
        ptrs, sizes = host.get_page_buffer_meta(host_indices)
        per = self._segments_per_page
        if len(ptrs) != len(sel) * per:
            self._count("bad_arguments")
            self._warn("pages", "segments", f"kvstream: host pool returned {len(ptrs)} segments for {len(sel)} pages, "
                       f"expected {per} per page; answered as a miss")
            return None
        segs = list(zip(ptrs, sizes))
        pages: list[list[Segment] | None] = [None] * n
        unsized = getattr(host, "size", None) is None
        for j, i in enumerate(sel):
            page = segs[j * per:(j + 1) * per]
            if unsized and not self._inside_buffer(page):
                self._count("bad_host_indices")
                continue
            if self._reorder_kv:  # MHA layer_first: k0 v0 k1 v1 ... -> k0 k1 ... v0 v1 ... (the flat page order)
                page = page[0::2] + page[1::2]
            pages[i] = page
        return pages

    def _inside_pool(self, host_indices: Any, n: int) -> list[bool] | None:
        """Per page, whether its ``page_size`` slots lie inside the host pool (each page's first slot plus a
        page fits too: the pool addresses a page from its first slot); None when the indices are not integers."""
        host = self.mem_pool_host
        try:
            idx = torch.as_tensor(host_indices)
        except (TypeError, ValueError, RuntimeError):
            return None
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            return None
        # In numpy: torch's reductions wake its OpenMP pool, which on a busy host cost several ms of a
        # call (and spinning CPU) for a few thousand indices; numpy does them in this thread.
        idx = idx.reshape(n, host.page_size).to(torch.int64).cpu().numpy()
        if getattr(host, "size", None) is None:  # a pool that does not say: its segments are checked instead
            return (idx.min(axis=1) >= 0).tolist()
        size = int(host.size)
        ok = (idx.min(axis=1) >= 0) & (idx.max(axis=1) < size) & (idx[:, 0] + host.page_size <= size)
        return ok.tolist()

    def _note_legacy(self) -> None:
        self._count("legacy_calls")
        if self.counters["legacy_calls"] == 1:
            log.info("kvstream: sglang is using the copying batch_get/batch_set path (the kvstream plugin's "
                     "controller hook is not active, or 'interface_v1' is missing from the dynamic extra config)")

    def _record(self, kind: str, results: Sequence[bool], t0: float, read: bool = False) -> None:
        """SGLang's samples of the batch; for a prefetch the engine ``read`` (not one refused whole before
        it: invalid keys, slots outside the pool), the retrieval metrics of its batch too."""
        if not self.enable_metrics:
            return
        elapsed = time.perf_counter() - t0
        pages = sum(1 for r in results if r)
        with self._lock:
            samples = self._samples
            if len(samples[f"{kind}_pgs"]) < MAX_STORAGE_SAMPLES:
                samples[f"{kind}_pgs"].append(len(results))
                samples[f"{kind}_bandwidth"].append(pages * self._page_bytes / elapsed / 1e9 if elapsed > 0 else 0.0)
        exporter = self._exporter
        if exporter is None:
            return
        try:  # the data already moved: a metrics failure must not turn this batch into a miss
            if read:  # (else engine.last_batch is an earlier batch's: counted twice)
                exporter.observe_read(self.engine.last_batch, elapsed)
            self._maybe_sync()
        except Exception as exc:
            self._count("metrics_errors")
            self._warn("metrics", type(exc).__name__, f"kvstream: exporting metrics failed ({exc})")

    def _maybe_sync(self, force: bool = False) -> None:
        """Refresh the stats snapshot (and the Prometheus metrics) at most once per METRICS_INTERVAL_S:
        sglang polls get_stats on every scheduler iteration, and a full snapshot is not free."""
        # Serialised: the exporter turns totals into increments against the last snapshot it saw, so
        # an older snapshot exported after a newer one would count the difference twice. A thread that
        # finds a sync running skips its own (the running one is at most this fresh); flush waits.
        if not self._sync_lock.acquire(blocking=force):
            self._arm_trailing_sync(METRICS_INTERVAL_S)  # the running one may have missed this call's counts
            return
        try:
            now = time.monotonic()
            if not force and self._last_stats is not None and now - self._last_sync < METRICS_INTERVAL_S:
                self._arm_trailing_sync(METRICS_INTERVAL_S - (now - self._last_sync))
                return
            self._last_sync = now
            engine = self.engine  # (read once: close() may detach it between two reads, and a snapshot
            if engine is None:  # of nothing, exported, would be the exporter's baseline: every page counted
                return  # again by close()'s own sync)
            stats = self._stats_of(engine)
            self._last_stats = stats
            if self._exporter is not None:
                self._exporter.sync(stats, self.counters)
                if not all(t["healthy"] for t in stats.get("tiers", ())):  # a failed tier may rejoin with
                    # no call of sglang's (an idle server; the thread that removes what it owed): its gauge
                    # follows within a second, traffic or not
                    self._arm_trailing_sync(METRICS_INTERVAL_S)
        finally:
            self._sync_lock.release()

    def _arm_trailing_sync(self, delay: float) -> None:
        """Run a skipped sync ``delay`` seconds later (one owed at a time). sglang polls get_stats only
        while it schedules work (an idle server sleeps: --sleep-on-idle), so without it the last batch's
        counters would reach /metrics only with the next request (a scrape after a burst read stale pages)."""
        with self._lock:
            if self._closed or self._trailing is not None or self._exporter is None:
                return
            timer = self._trailing = threading.Timer(delay, self._trailing_sync)
            timer.daemon = True
            timer.name = "kvstream-metrics"
        timer.start()

    def _trailing_sync(self) -> None:
        with self._lock:
            self._trailing = None
        # (each on its own: the sync arms the next turn, so a probe that raised must not skip it: the failed
        # tier of an idle server was probed no more, its gauge frozen)
        for step in (self._probe_failed_tiers, lambda: self._maybe_sync(True)):
            try:
                step()
            except Exception as exc:  # a timer thread: report, count, never raise
                self._count("metrics_errors")
                self._warn("metrics", type(exc).__name__, f"kvstream: exporting metrics failed ({exc})")

    def _probe_failed_tiers(self) -> None:
        """A failed tier's probe when it is due (tier_retry's back-off, or a vanished directory's look). Only
        gets and puts probed: on an idle server (--sleep-on-idle, no request) a tier remounted stayed failed,
        its gauge at 0 and its owed replicas pending, until the next request. This timer runs each interval
        while a tier is failed (_maybe_sync), outside the sync lock: a probe may list the tier as it rejoins."""
        for tier in getattr(self.engine, "tiers", ()):  # (None once closed: no tier)
            if not tier.healthy and not self._closed:  # (close() may come meanwhile: Tier.usable checks too)
                tier.usable()

    def _get_stats(self):
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        with self._lock:
            samples, self._samples = self._samples, {name: [] for name in self._samples}
        for name, values in samples.items():
            getattr(out, name).extend(values)
        self._maybe_sync()
        out.kvstream = self._last_stats  # kvstream's own figures, refreshed at most once per second
        return out

    # -- attach helpers --
    def _describe_pages(self, host) -> None:
        """Segments per page and the page size in bytes, from the pool itself (one probe page)."""
        probe = torch.arange(host.page_size, dtype=torch.int64)
        _, sizes = host.get_page_buffer_meta(probe)
        self._segments_per_page = len(sizes)
        self._page_bytes = sum(sizes)
        self._reorder_kv = not self.is_mla and host.layout == "layer_first"
        # From the pieces themselves, not sglang's is_stride_page_aligned (False for any layer_first pool, whose
        # pieces of 64-token pages are aligned: the start-up line said "staged" for pages moved in place). A
        # piece's address is affine in the page (base + page x stride + offset): pages 0 and 1 decide for all.
        pages = 2 if (getattr(host, "size", None) or 0) >= 2 * host.page_size else 1
        ptrs, sizes = host.get_page_buffer_meta(torch.arange(pages * host.page_size, dtype=torch.int64))
        self._aligned = all(a % ALIGN == 0 and n % ALIGN == 0 for a, n in zip(ptrs, sizes))

    def _namespace_fields(self, host) -> dict:
        cfg = self.storage_config
        probe = torch.arange(host.page_size, dtype=torch.int64)
        _, sizes = host.get_page_buffer_meta(probe)
        fields = {
            "format": "sglang-hicache/1",
            "model": cfg.model_name or "",
            "attention": "mla" if self.is_mla else "mha",
            "layout": host.layout,
            "dtype": _dtype(host).replace("torch.", ""),
            "page_size": host.page_size,
            "layers": getattr(host, "layer_num", None),
            "segments": list(sizes),
            "pp": [cfg.pp_rank, cfg.pp_size],
            "cp": [cfg.attn_cp_rank, cfg.attn_cp_size],
        }
        if self.is_mla:
            fields["kv_dim"] = getattr(host, "kv_cache_dim", None)
        else:
            # MHA pages hold this rank's heads only: rank-specific.
            fields["heads"] = [getattr(host, "head_num", None), getattr(host, "head_dim", None),
                               getattr(host, "v_head_dim", None)]
            fields["tp"] = [cfg.tp_rank, cfg.tp_size]
        if getattr(cfg, "dcp_size", 1) > 1:  # (DCP, MLA only: each DCP rank's page is its own shard of a logical
            # page, as sglang's file backend keys it; without DCP the key is left out: digests stay as they were)
            fields["dcp"] = [cfg.dcp_rank, cfg.dcp_size, cfg.logical_page_size]
        kv_dtype = _kv_cache_dtype(host)
        if kv_dtype is not None:  # (only where the pool's dtype cannot say: other namespaces keep their digest)
            fields["kv_cache_dtype"] = kv_dtype
        return fields

    def _register_pool(self, host) -> bool:
        """Tell the engine where pages are read into (the pool's KV buffer): it registers it with its
        read ring (memory.py), so reads land in it in place from the first call; returns whether they do.
        A pool of K and V in buffers of their own is not: a page's K and V pieces would lie in two
        registered buffers, and one fixed read reaches into one (its pages are staged)."""
        bufs = _kv_buffers(host)
        if len(bufs) != 1:
            return False
        try:
            return self.engine.register_memory(bufs[0].data_ptr(), bufs[0].numel() * bufs[0].element_size())
        except Exception as exc:  # only a speed-up: reads are staged, the attach goes on
            log.warning("kvstream: could not learn the host pool's page size (%s); reads are staged", exc)
            return False

    def _open_engine(self, namespace: Namespace):
        from ..engine import Engine

        # The engine would announce itself at INFO on every rank; sglang gets one line instead, from
        # rank 0 (startup_line), which carries the same facts plus the host-pool side. The configuration's
        # warnings likewise: every rank reads the same configuration, so rank 0 alone warns (each rank did).
        engine = Engine(self.config, namespace, announce=False, warn=self.is_rank0, page_bytes=self._page_bytes)
        # Not closed by the exit hook: a scheduler process that returns (sglang's graceful shutdown) never
        # stops its storage threads, which go on backing up and prefetching until the interpreter stops
        # them; closed under them, each call failed, logged by kvstream and sglang (hundreds of lines per
        # shutdown). Its puts wait for their pages, so the hook has nothing queued to write for it.
        engine.close_at_exit = False
        return engine

    def _make_exporter(self):
        from .metrics import Exporter

        cfg = self.storage_config
        # attn_cp_rank too: under attention DP sglang passes the attention-TP rank as tp_rank, the same on
        # every context-parallel rank of a DP group (runtime_context.derive_attention_ranks), whose engines
        # are apart (namespace); with the three ranks alone their gauges overwrote each other's (mostrecent)
        labels = {"tp_rank": str(cfg.tp_rank), "dp_rank": str(self.dp_rank), "pp_rank": str(cfg.pp_rank),
                  "attn_cp_rank": str(cfg.attn_cp_rank)}
        return Exporter(labels, [t.path for t in self.config.tiers])

    @property
    def dp_rank(self) -> int:
        """This scheduler's data-parallel rank: the storage config's (attention DP), else the replica the DP
        controller spawned it as (``--dp N`` without attention DP: sglang passes dp_rank 0 to every replica's
        backend; its scheduler metrics label the replica). Without it the replicas' series shared one label
        set, one replica's gauges hiding the other's, and each replica logged the start-up line."""
        if self.storage_config.dp_rank:
            return int(self.storage_config.dp_rank)
        try:
            from sglang.srt.runtime_context import get_parallel

            return int(get_parallel().dp_rank or 0)
        except Exception:  # (not written in this process: no DP controller, an embedding, a test)
            return 0

    @property
    def is_rank0(self) -> bool:
        cfg = self.storage_config
        return (cfg.tp_rank, cfg.pp_rank, cfg.attn_cp_rank, self.dp_rank) == (0, 0, 0, 0)

    @property
    def zero_copy(self) -> bool:
        """True when every piece of the host pool's pages is 4096-aligned in address and size: written with
        O_DIRECT from host memory (puts.py: a page whose pieces all are), read into it in place."""
        return self._aligned

    def startup_line(self) -> str:
        """The one-line effective configuration logged at start-up (rank 0)."""
        cfg = self.config
        tiers = ", ".join(f"{t.path}" + (f" ({t.capacity})" if str(t.capacity) != "unlimited" else "")
                          for t in cfg.tiers)
        engine = self.engine
        io = getattr(engine, "io_engine", None) or cfg.io_engine
        io = {"Ring": "io_uring", "ThreadRing": "threads"}.get(io, io)
        scan = getattr(engine, "scan", None) or {}
        host = self.mem_pool_host
        mode = "zero-copy" if self.zero_copy else "staged"
        if self.zero_copy:  # where a read lands: the host pool itself once registered, or on huge pages
            mode += " (reads of single-tier pages in place)" if self._reads_in_place else \
                " (reads through huge-page staging: K and V in buffers of their own)" if len(_kv_buffers(host)) > 1 \
                else " (reads through huge-page staging: host pool in 4 KiB pages, not registered)"
        why = "" if self.zero_copy else f" (host pages not {ALIGN}-aligned: bounce buffers)"
        writer = "" if self.is_writer else "; MLA non-writer rank (sglang skips its backups; no catch-up)"
        return (f"kvstream: {len(cfg.tiers)} tier{'s' if len(cfg.tiers) != 1 else ''} [{tiers}]; "
                f"policy {cfg.policy_spec}; io {io}; layout {host.layout} "
                f"{'MLA' if self.is_mla else 'MHA'} {_dtype(host).replace('torch.', '')} page {host.page_size} "
                f"({self._page_bytes / 1024:.0f} KiB); {mode}{why}; fsync {cfg.fsync}; "
                f"namespace {self.namespace.digest[:12]}; {scan.get('pages', 0)} pages indexed so far, "
                f"start-up scan {'done' if scan.get('done') else 'in the background'}{writer}"
                + (f"; {engine.trust_summary()}" if hasattr(engine, "trust_summary") else ""))

    def _say_earlier_namespace(self) -> None:
        """An fp8 server upgraded from a kvstream of before 6b6a304, whose namespace had no --kv-cache-dtype:
        its pages there are another namespace's now (fp8_e4m3 and fp8_e5m2 alike: never served), and no
        capacity counts their room. Each tier holding that directory is said once, with the fix (the start
        said nothing: every page a miss, the directory left for good)."""
        fields = dict(self.namespace.fields)
        if fields.pop("kv_cache_dtype", None) is None:
            return
        for k, path in self.engine.namespace_dirs(Namespace(fields).digest):
            log.warning("kvstream: tier %d holds %s, this server's namespace as kvstream versions before 6b6a304 "
                        "named it (without --kv-cache-dtype: fp8_e4m3 and fp8_e5m2 pages alike); its pages are "
                        "never served now, and no capacity counts their room: remove that directory once no "
                        "server of an earlier version uses it", k, path)

    def _log_startup(self) -> None:
        line = self.startup_line()
        if self.is_rank0:
            log.info(line)
        else:
            log.debug(line)


def _raw(location: Any) -> bool:
    """Whether ``location`` is a raw address or a list of them (sglang's Mooncake form), not a tensor."""
    if isinstance(location, (list, tuple)):
        return bool(location) and all(isinstance(x, int) for x in location)
    return isinstance(location, int) and not isinstance(location, bool)


def _ints(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _dtype(host: Any) -> str:
    """The host pool's dtype; a pool without the attribute is described by its KV buffer's."""
    dtype = getattr(host, "dtype", None)
    if dtype is None:
        dtype = getattr(getattr(host, "kv_buffer", None), "dtype", None)
    return str(dtype)


def _kv_buffers(host) -> list:
    """The host pool's KV buffers: one tensor (``kv_buffer``), or K and V apart (sglang's
    AsymmetricMHATokenToKVPoolHost, head_dim != v_head_dim, keeps ``(k_buffer, v_buffer)`` there)."""
    buf = getattr(host, "kv_buffer", None)
    return [b for b in (buf if isinstance(buf, (tuple, list)) else [buf]) if isinstance(b, torch.Tensor) and b.numel()]


def _kv_cache_dtype(host: Any) -> str | None:
    """What the bytes of a pool stored as uint8 are (SGLang stores fp8_e4m3 and fp8_e5m2 KV alike as
    bytes, so the host pool's dtype cannot tell them apart): the server's --kv-cache-dtype, or None
    where the pool says it already, or no server arguments are set (an embedding, a test)."""
    if _dtype(host) != "torch.uint8":
        return None
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(get_server_args().kv_cache_dtype)
    except Exception:  # (not set: ValueError; another sglang: ImportError, AttributeError)
        log.warning("kvstream: the host pool stores its KV as bytes and the server's --kv-cache-dtype is not "
                    "known here: pages of fp8_e4m3 and fp8_e5m2 servers of this model would share a namespace")
        return "unknown"


def _count_of(keys) -> int:
    """len(keys) for the default answer, computed without raising (the answer goes to sglang's threads)."""
    try:
        return len(keys)
    except TypeError:
        return 0


def _v2_misses(transfers) -> dict:
    """Every page of every v2 transfer missed (never raises: it answers sglang's controller threads)."""
    try:
        return {t.name: [False] * len(t.keys or []) for t in transfers or []}
    except Exception:  # a malformed transfer list: nothing to answer per pool
        return {}


def _pool_name(name: Any) -> str:
    return getattr(name, "value", name)
