"""Use the real sglang 0.5.23 on a CPU-only host: import stubs, real KV pools, a real HiCache controller.

sglang's HiCache storage path (host KV pool -> ``HiCacheStorage`` backend -> files) runs on a CPU, but
importing it needs two packages a CPU host lacks: ``torchvision`` (the PyPI wheel needs CUDA torch) and
``triton`` (optional, GPU only). This module stubs both, builds the real device and host pools, and drives
a real ``HybridCacheController`` the way the scheduler does, so tests, the demo and the benchmarks
exercise the same code paths as a GPU server, minus the device<->host copies (those need CUDA kernels).

Typical use::

    from kvstream_hicache.tools import cpu_sglang
    cpu_sglang.install_stubs()                      # before anything imports sglang
    cpu_sglang.load_kvstream_plugin()               # sglang's load_plugins(): "kvstream" becomes a backend name
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=16, layers=2)
    with cpu_sglang.ControllerDriver(pools, "kvstream", extra_config={"tiers": [d0, d1]}) as drv:
        tokens = cpu_sglang.random_tokens(4 * pools.page_size, seed=1)
        host_idx = cpu_sglang.fill_random(pools, len(tokens), seed=1)
        assert drv.backup(tokens, host_idx) == len(tokens)          # backup thread -> batch_set_v1
        result = drv.prefetch(tokens)                               # prefetch + IO threads -> batch_get_v1
        assert result.tokens == len(tokens)
        assert pools.page_bytes(result.host_indices) == pools.page_bytes(host_idx)

Everything here is test/bench scaffolding: it is never imported by the plugin or the storage backend.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import platform
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = [
    "install_stubs",
    "load_kvstream_plugin",
    "Pools",
    "make_pools",
    "storage_config",
    "fill_random",
    "scramble",
    "random_tokens",
    "page_keys",
    "ControllerDriver",
    "PrefetchResult",
]

HOST_BUDGET = 1 << 34  # bytes: lifts sglang's "free RAM minus 10 GiB" host-pool check for small test pools
STUBBED_ROOTS = ("torchvision",)  # packages that cannot be installed next to a CPU torch

_stub_lock = threading.Lock()
_stubs_installed = False


# --------------------------------------------------------------------------------------------- stubs
def _sglang_dir() -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed: pip install --no-deps sglang==0.5.23 (see docs/sglang.md)")
    return list(spec.submodule_search_locations)[0]


def _load_platform_stubs() -> types.ModuleType:
    """Load ``sglang/_platform_stubs.py`` standalone: importing ``sglang`` itself would pull triton in."""
    name = "_kvstream_sglang_platform_stubs"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(_sglang_dir(), "_platform_stubs.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class _MockFinder:
    """Meta-path finder serving permissive mock modules for the stubbed package roots."""

    def __init__(self, roots: Sequence[str], mock_cls: type):
        self.roots = tuple(roots)
        self.mock_cls = mock_cls

    def find_spec(self, fullname, path=None, target=None):
        if not any(fullname == r or fullname.startswith(r + ".") for r in self.roots):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return sys.modules.get(spec.name) or self.mock_cls(spec.name)

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def _install_mock_roots(stubs: types.ModuleType, roots: Sequence[str]) -> None:
    # transformers caches "is torchvision installed?" behind lru_cache and probes with find_spec, which the
    # finder below would answer "yes": ask it first, while the answer is still the truth (no).
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        import_utils.is_torchvision_v2_available()
    except ImportError:  # transformers absent: sglang's import fails later with its own message
        pass
    missing = [r for r in roots if r not in sys.modules and importlib.util.find_spec(r) is None]
    if missing:
        sys.meta_path.insert(0, _MockFinder(missing, stubs._MockModule))


def _install_triton_stub(stubs: types.ModuleType) -> None:
    """Run sglang's own macOS triton stub by presenting darwin/arm64/MPS for the duration of the call.

    The stub also patches ``Tensor.to``/``Tensor.copy_`` (an MPS non_blocking workaround) and adds missing
    ``torch.mps`` attributes; the Tensor patches are undone, the ``torch.mps`` additions are harmless.
    """
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    import torch

    saved = (sys.platform, platform.machine, torch.backends.mps.is_available, torch.Tensor.to, torch.Tensor.copy_)
    sys.platform = "darwin"
    platform.machine = lambda: "arm64"
    torch.backends.mps.is_available = lambda: True
    try:
        stubs.install_platform_stubs()
    finally:
        sys.platform, platform.machine, torch.backends.mps.is_available, torch.Tensor.to, torch.Tensor.copy_ = saved


def install_stubs(roots: Sequence[str] = STUBBED_ROOTS) -> None:
    """Make ``import sglang...`` work on a CPU host. Idempotent; call before the first sglang import.

    Installs mock modules for ``torchvision`` (and any other package named in ``roots``) unless it is
    really installed, and sglang's triton stub unless triton is installed. On a GPU host with both
    packages present this does nothing.
    """
    global _stubs_installed
    with _stub_lock:
        if _stubs_installed:
            return
        stubs = _load_platform_stubs()
        _install_mock_roots(stubs, roots)
        _install_triton_stub(stubs)
        _stubs_installed = True


def load_kvstream_plugin() -> None:
    """Run sglang's ``load_plugins()`` (as every scheduler process does), so ``"kvstream"`` is a backend name.

    If the entry point was not run (the package is not installed, or ``SGLANG_PLUGINS`` excludes it), the
    plugin is registered directly, so the in-process controller still finds the backend.
    """
    install_stubs()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if "kvstream" not in StorageBackendFactory._registry:
        from sglang.srt.plugins.hook_registry import HookRegistry

        from ..sglang import plugin

        plugin.register()
        HookRegistry.apply_hooks()


# --------------------------------------------------------------------------------------------- pools
@dataclass
class Pools:
    """A real sglang device KV pool on ``device="cpu"`` and its host (L2) mirror.

    ``kind`` is ``"mha"`` or ``"mla"``; ``layout`` is the host layout (``page_first``, ``layer_first``,
    ``page_first_direct``, ``page_head`` for MHA). ``host`` is what a ``HiCacheStorage`` backend sees.
    """

    kind: str
    layout: str
    page_size: int
    device: Any
    host: Any

    def alloc(self, tokens: int):
        """Host token slots for ``tokens`` (a multiple of page_size); raises MemoryError when full."""
        idx = self.host.alloc(tokens)
        if idx is None:
            raise MemoryError(f"host pool full: {tokens} tokens requested, {self.host.available_size()} free")
        return idx

    def free(self, host_indices) -> None:
        if host_indices is not None and len(host_indices):
            self.host.free(host_indices)

    def split(self) -> bool:
        """K and V in buffers of their own (AsymmetricMHATokenToKVPoolHost): no flat-page interface."""
        return isinstance(getattr(self.host, "kv_buffer", None), tuple)

    def page_views(self, index: int) -> list:
        """A split pool's page starting at host slot ``index``: its K view, then its V view."""
        p = self.page_size
        return [b[index:index + p] if self.layout == "page_first" else b[index // p] for b in self.host.kv_buffer]

    def page_bytes(self, host_indices) -> list[bytes]:
        """The bytes of each page at ``host_indices``, in sglang's flat-page order for this layout (a
        split pool: its K bytes, then its V bytes)."""
        import torch

        def raw(t) -> bytes:
            return t.contiguous().view(torch.uint8).numpy().tobytes()

        p = self.page_size
        if self.split():
            return [b"".join(raw(v) for v in self.page_views(int(host_indices[i])))
                    for i in range(0, len(host_indices), p)]
        return [raw(self.host.get_data_page(int(host_indices[i]), flat=True)) for i in range(0, len(host_indices), p)]

    def flat_page_nbytes(self) -> int:
        if self.split():
            return sum(v.numel() * v.element_size() for v in self.page_views(0))
        return self.host.get_dummy_flat_data_page().numel() * self.host.dtype.itemsize


def make_pools(
    kind: str = "mha",
    layout: str = "page_first",
    *,
    page_size: int = 16,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 64,
    v_head_dim: int | None = None,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    dtype: Any = None,
    device_tokens: int = 512,
    host_ratio: float = 2.0,
) -> Pools:
    """Build a real device pool (on the CPU) and its host pool, under a lifted host-RAM budget.

    MHA geometry: ``layers x heads x head_dim`` (``v_head_dim`` other than ``head_dim``: sglang's
    AsymmetricMHATokenToKVPoolHost, K and V in buffers of their own); MLA: ``layers x (kv_lora_rank + rope_dim)``.
    The host pool holds about ``host_ratio * device_tokens`` tokens.
    """
    install_stubs()
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers)
    if kind == "mha":
        dev = MHATokenToKVPool(size=device_tokens, page_size=page_size, dtype=dtype, head_num=heads, head_dim=head_dim,
                               layer_num=layers, device="cpu", enable_memory_saver=False, v_head_dim=v_head_dim)
        info = dev.get_device_pool_infos()[0].buffer_info
        with host_memory_budget_scope(HOST_BUDGET):  # (the class sglang picks for the geometry)
            host = get_mha_host_pool_cls(info)(info, host_ratio, 0, page_size, layout, **common)
    elif kind == "mla":
        dev = MLATokenToKVPool(device_tokens, page_size, dtype, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim,
                               layer_num=layers, device="cpu", enable_memory_saver=False)
        with host_memory_budget_scope(HOST_BUDGET):
            host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, host_ratio, 0, page_size, layout,
                                        target_layer_num=layers, override_kv_cache_dim=dev.kv_cache_dim, **common)
    else:
        raise ValueError(f"kind must be 'mha' or 'mla', not {kind!r}")
    return Pools(kind=kind, layout=layout, page_size=page_size, device=dev, host=host)


def storage_config(
    pools: Pools,
    *,
    model_name: str = "org/model",
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    extra_config: dict | None = None,
    enable_metrics: bool = False,
):
    """A ``HiCacheStorageConfig`` as the controller would build it for these pools (no controller needed)."""
    install_stubs()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=pools.kind == "mla", enable_storage_metrics=enable_metrics,
        is_page_first_layout=pools.layout == "page_first", model_name=model_name,
        extra_config=dict(extra_config) if extra_config is not None else None,
    )


def random_tokens(n: int, seed: int = 0, vocab: int = 32000) -> list[int]:
    """``n`` deterministic token ids."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def page_keys(tokens: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """sglang's own page keys (SHA-256 chain) for ``tokens``: what the prefetch thread will query."""
    install_stubs()
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(list(tokens), prior_hash, page_size=page_size))


def fill_random(pools: Pools, tokens: int, seed: int = 0):
    """Allocate ``tokens`` host slots and fill their pages with deterministic values; returns the indices."""
    import torch

    idx = pools.alloc(tokens)
    gen = torch.Generator().manual_seed(seed)
    if pools.split():  # (no flat-page interface: each of its buffers' page views filled)
        for i in range(0, tokens, pools.page_size):
            for view in pools.page_views(int(idx[i])):
                view.copy_(torch.randn(view.shape, generator=gen, dtype=torch.float32).to(view.dtype))
        return idx
    n = pools.host.get_dummy_flat_data_page().numel()
    for i in range(0, tokens, pools.page_size):
        page = torch.randn(n, generator=gen, dtype=torch.float32).to(pools.host.dtype)
        pools.host.set_from_flat_data_page(int(idx[i]), page)
    return idx


def scramble(pools: Pools, host_indices) -> None:
    """Overwrite the pages at ``host_indices`` with a constant, so a read-back must really write them."""
    import torch

    if pools.split():
        for i in range(0, len(host_indices), pools.page_size):
            for view in pools.page_views(int(host_indices[i])):
                view.fill_(-7.0)
        return
    flat = torch.full((pools.host.get_dummy_flat_data_page().numel(),), -7.0, dtype=pools.host.dtype)
    for i in range(0, len(host_indices), pools.page_size):
        pools.host.set_from_flat_data_page(int(host_indices[i]), flat)


# --------------------------------------------------------------------------------------------- controller
@dataclass
class PrefetchResult:
    """What one emulated prefetch got: the storage hit (tokens), the tokens read into the host pool and where."""

    hit_tokens: int
    tokens: int
    host_indices: Any = None  # the first ``tokens`` host slots; the caller owns them (Pools.free)
    keys: list = field(default_factory=list)


class ControllerDriver:
    """A real ``HybridCacheController`` with a storage backend, driven the way sglang's scheduler drives it.

    ``backup()`` hands host pages to the backup thread (-> ``batch_set_v1``/``batch_set``) and waits for the
    ack; ``prefetch()`` runs the hit query on the prefetch thread (-> ``batch_exists``), allocates host slots
    like the scheduler, and lets the IO thread read (-> ``batch_get_v1``/``batch_get``). Only the device<->host
    copies are absent (they need CUDA kernels). ``backend`` is any name sglang accepts at this point: a
    built-in (``"file"``), ``"kvstream"`` (after the plugin registered it), or ``"dynamic"`` with the
    module/class in ``extra_config``. The extra config is passed as the parsed dict sglang would produce.

    Not thread-safe: one caller at a time. Close it (or use ``with``) to stop the threads and close the backend.
    """

    def __init__(
        self,
        pools: Pools,
        backend: str = "kvstream",
        *,
        extra_config: dict | None = None,
        model_name: str = "org/model",
        tp_rank: int = 0,
        tp_size: int = 1,
        enable_metrics: bool = False,
        timeout: float = 60.0,
    ):
        install_stubs()
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        self.pools = pools
        self.timeout = timeout
        self._acks: dict[str, list] = {}
        self._closed = False
        # The controller reads page size and ranks from process-wide sglang state, as in a scheduler process.
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=pools.page_size))
        # A plain TP layout (attention and MoE TP = TP); tp_group=None below: no collectives, the hit and
        # completion all-reduces see no peer group, as in a one-rank server.
        self._parallel = get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, attn_tp_rank=tp_rank,
                                                 attn_tp_size=tp_size, moe_tp_rank=tp_rank, moe_tp_size=tp_size,
                                                 pp_rank=0, pp_size=1)
        self._parallel.__enter__()
        try:
            group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=pools.host, device_pool=pools.device,
                                             layer_mapper=lambda i: i, is_primary_index_anchor=True)])
            allocator = types.SimpleNamespace(get_kvcache=lambda: pools.device)
            self.controller = HybridCacheController(
                token_to_kv_pool_allocator=allocator, mem_pool_host=group, page_size=pools.page_size, tp_group=None,
                load_cache_event=threading.Event(), write_policy="write_through", storage_backend=backend,
                model_name=model_name, storage_backend_extra_config=dict(extra_config or {}),
                enable_storage_metrics=enable_metrics,
            )
        except BaseException:
            self._parallel.__exit__(None, None, None)
            raise
        self._rid = 0

    # -- what the scheduler does -------------------------------------------------------------------------
    @property
    def backend(self):
        """The storage backend as the controller holds it (possibly sglang's failure-injector proxy)."""
        return self.controller.storage_backend

    @property
    def storage(self):
        """The backend object itself, unwrapped from sglang's failure-injector proxy when that is active."""
        backend = self.controller.storage_backend
        return getattr(backend, "_backend", backend)

    @property
    def zero_copy(self) -> bool:
        """True when the controller calls ``batch_get_v1``/``batch_set_v1`` (not the copying legacy pair)."""
        cc = self.controller
        return cc.page_get_func == cc._page_get_zero_copy and cc.page_set_func == cc._page_set_zero_copy

    def threads_alive(self) -> bool:
        cc = self.controller
        return all(t.is_alive() for t in (cc.prefetch_thread, cc.prefetch_io_aux_thread, cc.prefetch_sync_thread,
                                          cc.backup_thread))

    def backup(self, tokens: Sequence[int], host_indices, keys: Sequence[str] | None = None,
               prefix_keys: Sequence[str] | None = None) -> int:
        """Write the pages at ``host_indices`` (holding ``tokens``) through the backup thread; returns tokens stored.
        ``prefix_keys``: the keys of the pages before them, as the scheduler passes them with
        ``hicache_storage_pass_prefix_keys`` (``keys`` then chain from the last of them)."""
        from queue import Empty

        if keys is None:
            keys = page_keys(tokens, self.pools.page_size, prefix_keys[-1] if prefix_keys else None)
        op_id = self.controller.write_storage(host_indices, list(tokens), hash_value=list(keys),
                                              prefix_keys=list(prefix_keys) if prefix_keys else None)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                op = self.controller.ack_backup_queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError(f"backup op {op_id} not acked within {self.timeout}s") from None
            if op.id == op_id:
                return op.completed_tokens

    def query(self, tokens: Sequence[int]) -> int:
        """Hit query only (prefetch thread -> ``batch_exists``): tokens the storage holds as a prefix."""
        result = self.prefetch(tokens, read=False)
        return result.hit_tokens

    def prefetch(self, tokens: Sequence[int], *, read: bool = True,
                 prefix_keys: Sequence[str] | None = None) -> PrefetchResult:
        """Query, then (``read``) allocate host slots for the hit and read it through the IO thread.
        ``prefix_keys``: the keys of the pages before ``tokens`` (in host memory, as the scheduler passes
        them with ``hicache_storage_pass_prefix_keys``): ``tokens``' keys chain from the last of them."""
        from queue import Empty

        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        cc = self.controller
        self._rid += 1
        rid = f"kvstream-driver-{id(self)}-{self._rid}"
        prefix = list(prefix_keys) if prefix_keys else None
        op = cc.prefetch(CacheRequestHandle(rid, 0), list(tokens), prefix[-1] if prefix else None, prefix)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                got = cc.prefetch_hit_queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError(f"prefetch {rid}: no hit-query result within {self.timeout}s") from None
            if got is op:
                break
        hit = op.storage_hit_count
        keys = list(op.hash_value)
        if not read or hit == 0:
            return PrefetchResult(hit_tokens=hit, tokens=0, keys=keys)
        op.host_indices = self.pools.alloc(hit)
        cc.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = self._next_ack(rid, deadline)
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.completed_req:
                break
        self.pools.free(op.host_indices[completed:])  # as the scheduler does with an unfinished tail
        return PrefetchResult(hit_tokens=hit, tokens=completed, host_indices=op.host_indices[:completed], keys=keys)

    def _next_ack(self, rid: str, deadline: float):
        from queue import Empty

        pending = self._acks.get(rid)
        if pending:
            return pending.pop(0)
        while True:
            try:
                ack = self.controller.ack_prefetch_queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError(f"prefetch {rid}: IO thread did not complete within {self.timeout}s") from None
            if ack.rid == rid:
                return ack
            self._acks.setdefault(ack.rid, []).append(ack)

    def clear(self) -> bool:
        """The admin ``/clear_hicache_storage_backend`` path."""
        return self.controller.clear_storage_backend()

    def close(self) -> None:
        """Stop the storage threads, close the backend (sglang's detach path). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.controller.detach_storage_backend()
        finally:
            self._parallel.__exit__(None, None, None)

    def __enter__(self) -> "ControllerDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
