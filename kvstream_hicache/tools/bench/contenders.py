"""The policies a benchmark compares, each behind one small interface (``Contender``).

* :class:`EngineReads` - the engine's routed read (``Engine.get(..., policy=)``) into caller memory:
  ``kvstream`` (completion-driven), ``static-<g>``, ``tier<k>``; one engine serves them all.
* :class:`HiCacheFileReads` - sglang's own ``HiCacheFile`` reading its copy of the pages from tier 0
  into a real host pool, through the controller's own legacy read routine (``_generic_page_get``:
  ``batch_get`` into flat pages, then ``set_from_flat_data_page``). Buffered I/O: its page-cache
  pages are dropped before each of its read phases and their footprint is measured after.
* :class:`LMCacheReads` - kvstream through the LMCache adapter's task machinery (``L2Core``): the
  batch cut into 8 load tasks queued together, as LMCache's prefetch controller keeps up to 8
  requests in flight, and pooled into routed engine batches; needs no LMCache install.
* :class:`AdapterReads` - kvstream through the SGLang adapter (``KVStreamHiCacheStorage``) into the
  same host pool, through the controller's zero-copy routine (``_page_get_zero_copy``), so the
  adapter's overhead over the bare engine is visible.

The two sglang contenders call the controller's methods unbound on a small stand-in object, so the
loop they run is sglang's, not a copy of it. ``read`` returns an :class:`Outcome`; the runner times
the call around it.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from ...lmcache.core import L2Core
from ...lmcache.keys import namespace_fields
from ...segments import Segment
from .dataset import Batch, Dataset, page_segments
from .geometry import Geometry

KVSTREAM_1TIER = "kvstream-1tier"
HICACHE_FILE = "hicache-file"
SGLANG_ADAPTER = "sglang-adapter"
SGLANG_ADAPTER_1TIER = "sglang-adapter-1tier"
SGLANG_ADAPTER_1TIER_STAGED = "sglang-adapter-1tier-staged"  # register_memory=off: the rule before 2026-12-05
LMCACHE_ADAPTER = "lmcache-adapter"


@dataclass
class Outcome:
    found: list[bool]
    tier_bytes: tuple[int, ...]  # bytes each tier read (all transfers)
    tier_busy: tuple[float | None, ...]  # seconds each tier had reads in flight (None: unknown)
    tier_served: tuple[int, ...]  # payload bytes each tier delivered first
    extra: dict = field(default_factory=dict)


class Contender:
    name: str
    views: list[np.ndarray]  # where a batch's pages land (uint8 views, one per page) for the check
    buffered = False  # reads through the page cache (dropped before each read, footprint measured after)

    def before_phase(self) -> None:
        """Called right before each timed read (e.g. drop this contender's page cache)."""

    def read(self, batch: Batch) -> Outcome:  # pragma: no cover - interface
        raise NotImplementedError

    def after_phase(self, outcome: Outcome) -> None:
        """Called right after each timed read (e.g. measure the page-cache footprint)."""

    def memory(self) -> dict | None:
        """The staging memory of the kvstream engine this contender reads through (``stats()["memory"]``:
        limit, held and peak bytes of its read and write pools); None for a peer without one."""
        engine = getattr(self, "engine", None)
        return engine.stats()["memory"] if engine is not None else None

    def close(self) -> None:
        pass


def history_outcome(engine, found: Sequence[bool], batches: int, n_tiers: int, extra: dict | None = None) -> Outcome:
    """An :class:`Outcome` summed over the engine's last ``batches`` batch records (a read that the
    adapter's task machinery turned into that many engine batches)."""
    records = engine.stats()["history"][-batches:] if batches else []
    per_tier = [[_tier(r, k) for r in records] for k in range(n_tiers)]
    return Outcome(
        found=list(found),
        tier_bytes=tuple(sum(int(t.get("bytes", 0)) for t in ts) for ts in per_tier),
        tier_busy=tuple(sum(t.get("busy_s") or 0.0 for t in ts) if any(ts) else None for ts in per_tier),
        tier_served=tuple(sum(int(t.get("bytes_served", 0)) for t in ts) for ts in per_tier),
        extra={"engine_batches": batches, **(extra or {})},
    )


def _tier(record: dict, k: int) -> dict:
    """Tier ``k`` of an engine batch record; empty for a bench tier the engine does not have (a one-tier
    engine on bench tier 0)."""
    tiers = record.get("tiers") or ()
    return tiers[k] if k < len(tiers) else {}


def engine_outcome(last: dict, found: Sequence[bool], n_tiers: int) -> Outcome:
    """An :class:`Outcome` from the engine's per-batch record (``Engine.last_batch``, stats.py)."""
    tiers = [_tier(last, k) for k in range(n_tiers)]
    return Outcome(
        found=list(found),
        tier_bytes=tuple(int(t.get("bytes", 0)) for t in tiers),
        tier_busy=tuple(t.get("busy_s") for t in tiers),
        tier_served=tuple(int(t.get("bytes_served", 0)) for t in tiers),
        extra={"engine_time_s": last.get("time_s"), "engine_gap": last.get("gap")},
    )


# ------------------------------------------------------------------------------------------ engine
class EngineReads(Contender):
    """``engine.get(keys, segments, policy=policy)`` into one aligned buffer of a batch of pages."""

    def __init__(self, name: str, engine, policy, dest, views: list[np.ndarray], geometry: Geometry,
                 batch_pages: int):
        self.name = name
        self.engine = engine
        self.policy = policy
        self.n_tiers = len(engine.config.tiers)
        self.segments = page_segments(dest.address, geometry, batch_pages)
        engine.register_memory(dest.address, dest.nbytes)  # as a server registers its host pool
        self.views = views  # shared by every engine policy; the runner releases them before closing dest

    def read(self, batch: Batch) -> Outcome:
        found = self.engine.get(list(batch.keys), self.segments[: len(batch.keys)], policy=self.policy)
        return engine_outcome(self.engine.last_batch, found, self.n_tiers)


class OneTierReads(EngineReads):
    """kvstream as a one-tier user runs it: its own engine on tier 0 alone, holding its own copy of the
    pages, read into the same destination as the engine policies. The ``tier0`` policy of the replicated
    store is not that: there every page has a holder on each tier, which the read path must allow for.

    :param directory: its directory on tier 0 (the runner removes it).
    """

    name = KVSTREAM_1TIER

    def __init__(self, directory: str, namespace, settings: dict, dest, views: list[np.ndarray], geometry: Geometry,
                 batch_pages: int, n_tiers: int):
        from ...config import Config
        from ...engine import Engine

        os.makedirs(directory, exist_ok=True)
        engine = Engine(Config.from_sources({"tiers": [directory], **settings}), namespace)
        super().__init__(KVSTREAM_1TIER, engine, None, dest, views, geometry, batch_pages)
        self.n_tiers = n_tiers  # its one tier is bench tier 0

    def write(self, ds: Dataset, batch: Batch) -> float:
        """Store ``batch`` through the one-tier engine (from the destination buffer); returns seconds."""
        for i, j in enumerate(batch.pages):
            ds.fill(j, self.views[i])
        t0 = time.perf_counter()
        ok = self.engine.put(list(batch.keys), self.segments[: len(batch.keys)])
        dt = time.perf_counter() - t0
        if not all(ok):
            raise RuntimeError(f"{self.name} failed to store {ok.count(False)} pages of batch {batch.index}")
        return dt

    def close(self) -> None:
        self.engine.close()


# ------------------------------------------------------------------------------------------ LMCache
class BenchRead(NamedTuple):
    found: list[bool]  # per key, as engine.get returns
    tasks: int  # load tasks submitted together
    batches: int  # engine batches they became (1 when pooled into one)


def bench_read(engine: Any, keys: Sequence[str], buffers: Sequence[Sequence[Segment]], *, tasks: int = 8,
               pool: bool = True, namespace: Any = None) -> BenchRead:
    """Read ``keys`` into ``buffers`` the way the LMCache adapter does, for ``kvstream bench``.

    The batch is cut into ``tasks`` contiguous load tasks submitted back to back (LMCache's prefetch
    controller keeps up to 8 requests in flight) and read through the adapter's task machinery
    (:class:`~kvstream_hicache.lmcache.core.L2Core`): pooled into one routed engine batch (``pool=True``,
    the adapter's default) or one batch per task. Compare its time with ``engine.get(keys, buffers)``
    for the adapter's overhead. No LMCache needed.

    :param engine: a started Engine (kept open), or a Config / settings dict (opened and closed here,
        on ``namespace``: a Namespace or its fields; default the LMCache MP path's namespace).
    :param keys: engine keys already stored (as the bench wrote them).
    :param buffers: per key the ``(address, nbytes)`` segments to fill, as for ``engine.get``.
    """
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys for {len(buffers)} buffers")
    from ...config import Config

    own = isinstance(engine, (Config, Mapping))
    if own:
        from ...engine import Engine
        from ...layout import Namespace

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


class LMCacheReads(EngineReads):
    """The LMCache (vLLM) path: :func:`bench_read` on the same engine and destination, so
    its row beside ``kvstream`` is the adapter's overhead over the bare engine."""

    TASKS = 8  # LMCache's prefetch controller keeps up to 8 requests in flight

    def read(self, batch: Batch) -> Outcome:
        run = bench_read(self.engine, list(batch.keys), self.segments[: len(batch.keys)], tasks=self.TASKS)
        return history_outcome(self.engine, run.found, run.batches, self.n_tiers, {"tasks": run.tasks})


# ------------------------------------------------------------------------------------------ sglang
class SglangHost:
    """A real sglang host KV pool (page_first) holding one batch, and the controller stand-in: sglang's
    ``MHATokenToKVPoolHost`` (a K and a V chunk per page), or ``MLATokenToKVPoolHost`` for an MLA
    geometry (one latent chunk per page, ``kv_lora_rank + rope`` per token and layer)."""

    def __init__(self, geometry: Geometry, batch_pages: int):
        import warnings

        from .. import cpu_sglang

        cpu_sglang.install_stubs()
        with warnings.catch_warnings():  # "Only CUDA ... support AWQ/GGUF": true, and irrelevant to storage
            warnings.simplefilter("ignore", UserWarning)
            import sglang.srt.managers.cache_controller  # noqa: F401
            import sglang.srt.mem_cache.memory_pool  # noqa: F401
        self.cpu_sglang = cpu_sglang
        P = geometry.page_tokens if geometry.model is not None and geometry.model.mla else sglang_shape(geometry)[0]
        self.page_tokens = P
        self.page_bytes = geometry.page_bytes
        device_tokens = 2 * P  # the device pool is never used: keep it at two pages
        common = dict(page_size=P, device_tokens=device_tokens, host_ratio=(batch_pages + 1) * P / device_tokens)
        if geometry.model is not None and geometry.model.mla:
            m = geometry.model
            self.pools = cpu_sglang.make_pools("mla", "page_first", layers=m.layers, kv_lora_rank=m.kv_lora_rank,
                                               rope_dim=m.rope_dim, **common)
        else:
            _, L, H, D = sglang_shape(geometry)
            self.pools = cpu_sglang.make_pools("mha", "page_first", layers=L, heads=H, head_dim=D, **common)
        self.host = self.pools.host
        self.host_indices = self.pools.alloc(batch_pages * P)
        ptrs, sizes = self.host.get_page_buffer_meta(self.host_indices)
        per_page = len(geometry.segments)  # chunks per page: K and V (MHA), or one (MLA)
        if list(sizes[:per_page]) != list(geometry.segments) or len(ptrs) != per_page * batch_pages:
            raise RuntimeError(f"sglang host pool chunks {sizes[:per_page]} differ from the geometry "
                               f"{geometry.segments}")
        self.chunk_bytes = tuple(int(x) for x in sizes[:per_page])  # the chunks of a page, in order
        self.chunk_ptrs = [tuple(int(x) for x in ptrs[per_page * i:per_page * (i + 1)]) for i in range(batch_pages)]
        from sglang.srt.managers.cache_controller import HiCacheController

        self.controller_cls = HiCacheController
        # One 'page' view per page: K chunk then V chunk are not adjacent in page_first; checks use the first
        # chunk's first block and the last chunk's last block, which is what a flat page's first and last hold.
        self.views = [_PageView(chunks, self.chunk_bytes) for chunks in self.chunk_ptrs]

    def load(self, ds: Dataset, batch: Batch) -> None:
        """Put ``batch``'s page contents into the host pool (what a GPU backup would have left there)."""
        page = np.empty(ds.page_bytes, dtype=np.uint8)
        for i, j in enumerate(batch.pages):
            ds.fill(j, page)
            at = 0
            for ptr, size in zip(self.chunk_ptrs[i], self.chunk_bytes):
                ctypes.memmove(ptr, page.ctypes.data + at, size)
                at += size

    def stand_in(self, backend) -> SimpleNamespace:
        return SimpleNamespace(storage_backend=backend, storage_host_pool=self.host, mem_pool_host=self.host,
                               page_size=self.page_tokens)

    def storage_config(self, model_name: str, extra: dict | None = None):
        return self.cpu_sglang.storage_config(self.pools, model_name=model_name, extra_config=extra)


class _PageView:
    """A page's host chunks seen as one page for the check: ``[:n]`` is the first chunk's start,
    ``[-n:]`` the last chunk's end."""

    def __init__(self, ptrs: Sequence[int], sizes: Sequence[int]):
        self.first = np.ctypeslib.as_array((ctypes.c_uint8 * sizes[0]).from_address(ptrs[0]))
        self.last = np.ctypeslib.as_array((ctypes.c_uint8 * sizes[-1]).from_address(ptrs[-1]))

    def __getitem__(self, s: slice):
        if s.start is None or s.start >= 0:
            return self.first[s]
        return self.last[s]

    def __setitem__(self, s: slice, value) -> None:
        if s.start is None or s.start >= 0:
            self.first[s] = value
        else:
            self.last[s] = value


class _Op:
    """The controller's PrefetchOperation as far as the page routines use it."""

    request_id = "kvstream-bench"

    @staticmethod
    def is_terminated() -> bool:
        return False


def sglang_shape(geometry: Geometry) -> tuple[int, int, int, int]:
    """(page tokens, layers, kv heads, head dim) of an MHA host pool whose K and V chunks match ``geometry``."""
    if geometry.model is not None and not geometry.model.mla and geometry.page_tokens:
        m = geometry.model
        tp_heads = geometry.segments[0] // (geometry.page_tokens * m.layers * m.head_dim * 2)
        return geometry.page_tokens, m.layers, tp_heads, m.head_dim
    if len(geometry.segments) != 2 or geometry.segments[0] != geometry.segments[1] or geometry.segments[0] % 64:
        raise ValueError(f"{geometry.label}: the sglang contenders need two equal K/V chunks (multiple of 64 bytes)")
    return 16, 1, 1, geometry.segments[0] // (16 * 2)  # bf16: P*L*H*D*2 bytes per chunk


class HiCacheFileReads(Contender):
    """sglang's ``HiCacheFile`` on tier 0, read through ``HiCacheController._generic_page_get``."""

    name = HICACHE_FILE
    buffered = True

    def __init__(self, host: SglangHost, directory: str, model_name: str, drop: str = "fadvise"):
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # it would override file_storage_path
        os.makedirs(directory, exist_ok=True)
        self.host = host
        self.dir = directory
        self.drop = drop
        self.backend = HiCacheFile(host.storage_config(model_name, {"file_storage_path": directory}),
                                   file_path=directory)
        self.backend.register_mem_pool_host(host.host)
        self.ctl = host.stand_in(self.backend)
        self.views = host.views
        self.footprints: list[int] = []

    def write(self, ds: Dataset, batch: Batch) -> float:
        """Store ``batch`` through sglang's legacy write routine; returns seconds (buffered, then fsynced)."""
        self.host.load(ds, batch)
        t0 = time.perf_counter()
        ok = self.host.controller_cls._generic_page_set(self.ctl, list(batch.keys), self.host.host_indices)
        self._sync()
        if not ok:
            raise RuntimeError(f"HiCacheFile failed to store batch {batch.index} in {self.dir}")
        return time.perf_counter() - t0

    def files(self) -> list[str]:
        return [e.path for e in os.scandir(self.dir) if e.name.endswith(".bin")]

    def _sync(self) -> None:
        fsync_files(self.files())

    def before_phase(self) -> None:
        drop_page_cache(self.files(), self.drop)

    def read(self, batch: Batch) -> Outcome:
        n = len(batch.keys)
        count = self.host.controller_cls._generic_page_get(self.ctl, _Op(), list(batch.keys), self.host.host_indices)
        found = [i < count for i in range(n)]
        nbytes = count * self.host.page_bytes
        return Outcome(found, (nbytes, 0), (None, None), (nbytes, 0))

    def after_phase(self, outcome: Outcome) -> None:
        # The footprint a buffered reader leaves: every page it read stays cached (until memory pressure).
        fp = resident_bytes(self.files())
        if fp is not None:
            self.footprints.append(fp)
            outcome.extra["page_cache_bytes"] = fp


class AdapterReads(Contender):
    """``KVStreamHiCacheStorage.batch_get_v1`` into the host pool, via ``_page_get_zero_copy``.

    :param tiers: its tier directories: the bench's (``sglang-adapter``), or tier 0's alone
        (``sglang-adapter-1tier``, kvstream as a one-tier SGLang user runs it; ``-staged``: with
        ``register_memory=off``, so reads into the host pool's 4 KiB pages are staged and copied).
    :param n_tiers: the bench's tier count (default: ``len(tiers)``).
    """

    def __init__(self, host: SglangHost, tiers: Sequence[str], model_name: str, extra: dict | None = None, *,
                 name: str = SGLANG_ADAPTER, n_tiers: int | None = None):
        from ...sglang.storage import KVStreamHiCacheStorage

        self.name = name
        self.host = host
        cfg = host.storage_config(model_name, {"tiers": list(tiers), **(extra or {})})
        self.backend = KVStreamHiCacheStorage(cfg)
        self.backend.register_mem_pool_host(host.host)
        if hasattr(self.backend, "on_host_pools_registered"):
            self.backend.on_host_pools_registered()
        self.ctl = host.stand_in(self.backend)
        self.views = host.views
        self.engine = getattr(self.backend, "engine", None)
        self.n_tiers = n_tiers or len(tiers)

    def write(self, ds: Dataset, batch: Batch) -> float:
        self.host.load(ds, batch)
        t0 = time.perf_counter()
        ok = self.host.controller_cls._page_set_zero_copy(self.ctl, list(batch.keys), self.host.host_indices)
        if not ok:
            raise RuntimeError(f"the kvstream adapter failed to store batch {batch.index}")
        return time.perf_counter() - t0

    def read(self, batch: Batch) -> Outcome:
        n = len(batch.keys)
        count = self.host.controller_cls._page_get_zero_copy(self.ctl, _Op(), list(batch.keys), self.host.host_indices)
        found = [i < count for i in range(n)]
        last = getattr(self.engine, "last_batch", None) or {}
        return engine_outcome(last, found, self.n_tiers)

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close:
            close()


# ------------------------------------------------------------------------------------ page cache
def fsync_files(paths: Sequence[str]) -> None:
    """Write back a buffered writer's files, so their pages are clean and can be dropped."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_page_cache(paths: Sequence[str], mode: str) -> None:
    """Evict ``paths`` from the page cache: ``fadvise`` (just these files, no root needed),
    ``global`` (``sync; echo 3 > /proc/sys/vm/drop_caches``, root), or ``none``."""
    if mode == "none":
        return
    if mode == "global":
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages only: files were fsynced after writing
        finally:
            os.close(fd)


_libc = None


def resident_bytes(paths: Sequence[str]) -> int | None:
    """Bytes of ``paths`` in the page cache now (mincore(2)); None where mincore is unavailable."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.mmap.restype = ctypes.c_void_p
            _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_long]
            _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        except (OSError, AttributeError):
            return None
    page = mmap.PAGESIZE
    total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_uint8 * ((size + page - 1) // page))()
                if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return None
                total += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
            finally:
                _libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return total
