"""The CPU shims' L1<->L2 copies (kvstream_hicache/tools/cpu_shims), on sglang's real device and host pools.

sglang's own copies are CUDA/XPU kernels; the shims replace them with torch indexing on a CPU. Per host
layout: device slots A are backed up to host slots H and loaded back into device slots B, layer by
layer: B must then hold A's bytes for every layer, K and V (MLA: its one buffer), and the host pool
nothing outside H (a copy to the wrong slots or layers fails one of the two).
"""
from __future__ import annotations

import pytest

from sglang_fixtures import cpu_sglang  # noqa: F401  (installs the import stubs first)

import torch  # noqa: E402

from kvstream_hicache.tools import cpu_shims  # noqa: E402

PAGE = 16
LAYOUTS = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "page_head"),
           ("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct")]


def _device_buffers(pools):
    dev = pools.device
    return list(dev.kv_buffer) if pools.kind == "mla" else list(dev.k_buffer) + list(dev.v_buffer)


def _host_buffers(host):
    return [host.kv_buffer] if hasattr(host, "_host_layer_by_controller") else [host.k_buffer, host.v_buffer]


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_backup_then_load_moves_every_layer_through_the_given_host_slots(kind, layout):
    pools = cpu_sglang.make_pools(kind, layout, page_size=PAGE, layers=3, device_tokens=256)
    gen = torch.Generator().manual_seed(5)
    for buf in _device_buffers(pools):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    for buf in _host_buffers(pools.host):
        buf.zero_()
    src = torch.arange(2 * PAGE, 4 * PAGE)  # two device pages
    dst = torch.arange(8 * PAGE, 10 * PAGE)
    host_idx = pools.alloc(2 * PAGE)
    cpu_shims.backup_from_device_all_layer(pools.host, pools.device, host_idx, src, "kernel")
    for layer in range(3):
        cpu_shims.load_to_device_per_layer(pools.host, pools.device, host_idx, dst, layer, "kernel")
    for buf in _device_buffers(pools):
        assert torch.equal(buf[dst], buf[src])
    # every host byte that is not zero lies in the pages of host_idx
    touched = pools.page_bytes(host_idx)
    assert all(any(page) for page in touched)
    everything = sum(int(torch.count_nonzero(b)) for b in _host_buffers(pools.host))
    in_pages = sum(int(torch.count_nonzero(torch.frombuffer(bytearray(p), dtype=torch.uint8))) for p in touched)
    assert everything <= in_pages  # bf16 elements vs bytes: each nonzero element has a nonzero byte there
    pools.free(host_idx)


def test_unknown_layout_names_itself():
    with pytest.raises(NotImplementedError, match="page_unified"):
        cpu_shims.layer_rows(torch.zeros(1), "page_unified", PAGE, 0, torch.arange(1))
