"""What a real ``sglang.launch_server`` needs to serve with HiCache on a CPU-only host (sglang 0.5.23).

``kvstream serve-cpu`` puts this directory on the server's ``PYTHONPATH``; its ``sitecustomize.py`` calls
:func:`install` in every process of the server. On a host where ``torch.cuda.is_available()`` is true it
does nothing. Otherwise it installs, and says in the log that it replaced:

* ``torchvision`` (its wheel needs a CUDA torch) and ``triton`` if absent -> ``cpu_sglang.install_stubs()``;
* ``sgl_kernel`` (imported at module level under ``SGLANG_USE_CPU_ENGINE=1``; its CPU build is not on
  PyPI) -> the stand-in package next to this file, whose functions raise if ever called;
* the host (L2) pool's pinned memory (``HostKVCache.__init__`` defaults ``pin_memory=True`` and pins with
  ``torch.cuda.cudart()``) -> ``pin_memory=False``;
* the device<->host (L1<->L2) copies (``load_to_device_per_layer``/``backup_from_device_all_layer``: CUDA
  or XPU kernels, never imported on a CPU) -> torch advanced indexing, for the MHA layouts layer_first,
  page_first, page_first_direct, page_head and the MLA layouts layer_first, page_first, page_first_direct.

The hooks go through sglang's own ``HookRegistry``: registered here, applied by the ``load_plugins()``
that every sglang process runs. This is serving scaffolding for a CPU; the storage backend never imports it.
"""
from __future__ import annotations

import os
import sys

__all__ = ["SHIM_DIR", "install", "layer_rows", "load_to_device_per_layer", "backup_from_device_all_layer", "REPLACED"]

SHIM_DIR = os.path.dirname(os.path.abspath(__file__))  # goes on PYTHONPATH: sitecustomize.py, sgl_kernel/
_POOLS = "sglang.srt.mem_cache.pool_host"
REPLACED = (
    "torchvision/triton -> stubs",
    "sgl_kernel -> stand-in (raises if called)",
    "HostKVCache pin_memory -> False",
    "L1<->L2 copies (transfer_kv_* kernels) -> torch indexing",
)
_installed = False


def install() -> bool:
    """Install the CPU shims in this process (idempotent). Returns False, doing nothing, on a GPU host."""
    global _installed
    if _installed:
        return True
    import torch

    if torch.cuda.is_available():
        return False
    from .. import cpu_sglang

    cpu_sglang.install_stubs()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_POOLS}.base.HostKVCache.__init__", _unpinned_host_pool, HookType.AROUND)
    for cls in ("mha.MHATokenToKVPoolHost", "mla.MLATokenToKVPoolHost"):
        HookRegistry.register(f"{_POOLS}.{cls}.load_to_device_per_layer", load_to_device_per_layer,
                              HookType.REPLACE)
        HookRegistry.register(f"{_POOLS}.{cls}.backup_from_device_all_layer", backup_from_device_all_layer,
                              HookType.REPLACE)
    _installed = True
    print(f"[kvstream cpu-shims] pid {os.getpid()}: no CUDA device, CPU shims installed: " + "; ".join(REPLACED),
          file=sys.stderr, flush=True)
    return True


def _unpinned_host_pool(original, self, *args, **kwargs):
    kwargs["pin_memory"] = False  # pinning calls torch.cuda.cudart(): "Torch not compiled with CUDA enabled"
    return original(self, *args, **kwargs)


def layer_rows(buffer, layout: str, page_size: int, layer: int, idx):
    """A view of one layer of a host buffer and the index that picks token slots ``idx`` from it.

    ``view[index]`` is ``[len(idx), heads, dim]`` for every layout, so one assignment copies either way.
    The layer is taken with a basic (view) index first, so assigning through ``view[index]`` writes the
    host buffer itself.
    """
    if layout == "layer_first":  # [layer, token, head, dim]
        return buffer[layer], (idx,)
    if layout == "page_first":  # [token, layer, head, dim]
        return buffer[:, layer], (idx,)
    if layout == "page_first_direct":  # [page, layer, token in page, head, dim]
        return buffer[:, layer], (idx // page_size, idx % page_size)
    if layout == "page_head":  # [page, head, token in page, layer, dim]: the head axis stays in the middle
        return buffer[:, :, :, layer], (idx // page_size, slice(None), idx % page_size)
    raise NotImplementedError(f"kvstream cpu-shims: no CPU copy for host layout {layout!r}")


def _pairs(host, layer_id: int):
    """(host buffer, device buffer, host layer) for each tensor of ``layer_id``: K and V, or MLA's one."""
    if _is_mla(host):  # the controller's layer maps to a host row and a device buffer
        return [(host.kv_buffer, host.device_kv_buffers[host._buffer_index_by_layer[layer_id]],
                 host._host_layer_by_controller[layer_id])]
    return [(host.k_buffer, host.device_k_buffers[layer_id], layer_id),
            (host.v_buffer, host.device_v_buffers[layer_id], layer_id)]


def _is_mla(host) -> bool:
    return hasattr(host, "_host_layer_by_controller")  # MLATokenToKVPoolHost's layer maps (MHA has none)


def _target_layers(host):
    return list(host._target_layer_indices) if _is_mla(host) else range(host.layer_num)


def load_to_device_per_layer(host, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                              is_draft: bool = False):
    if not is_draft and layer_id not in _target_layers(host):
        return
    for buffer, device, layer in _pairs(host, layer_id):
        view, index = layer_rows(buffer, host.layout, host.page_size, layer, host_indices)
        device[device_indices] = view[index]


def backup_from_device_all_layer(host, device_pool, host_indices, device_indices, io_backend):
    for layer_id in _target_layers(host):
        for buffer, device, layer in _pairs(host, layer_id):
            view, index = layer_rows(buffer, host.layout, host.page_size, layer, host_indices)
            view[index] = device[device_indices]
