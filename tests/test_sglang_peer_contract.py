"""What sglang's own Mooncake-store test (tests/peers) expects of a backend, checked on our terms
(issue 24, item 8): the legacy set/get with raw addresses and a host pool that does not say its dtype or
size. The backend and the host pools are real.
"""
from __future__ import annotations

import pytest

from sglang_fixtures import PAGE, cpu_sglang, drivers, plugin_loaded, tiers_config  # noqa: F401 (fixtures)


@pytest.fixture
def backend_factory(tier_dirs):
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    made = []

    def make(pools, host=None, **config):
        backend = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:2]),
                                                                   **config))
        backend.register_mem_pool_host(host if host is not None else pools.host)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def test_raw_address_set_and_get(backend_factory):
    """set(key, target_location=ptr, target_sizes=n) stores the bytes at ptr; get reads them back into
    another address and answers True (sglang's Mooncake form); addresses outside the pool are a miss."""
    import torch

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    backend = backend_factory(pools)
    buf = pools.host.kv_buffer.view(torch.uint8).reshape(-1)
    n = 4096
    buf[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
    assert backend.set("raw-page", target_location=buf[:n].data_ptr(), target_sizes=n) is True
    assert backend.exists("raw-page")
    assert backend.get("raw-page", target_location=[buf[n:2 * n].data_ptr()], target_sizes=[n]) is True
    assert torch.equal(buf[:n], buf[n:2 * n])
    outside = torch.zeros(n, dtype=torch.uint8)
    assert backend.get("raw-page", target_location=outside.data_ptr(), target_sizes=n) is False
    assert not outside.any()
    assert backend.set("raw-other", target_location=outside.data_ptr(), target_sizes=n) is False
    assert not backend.exists("raw-other")


class BarePool:
    """A host pool that gives only what the layout needs (no ``dtype``, no ``size``), as sglang's
    Mooncake test's pool does: the real pool's buffer and page metadata, nothing else."""

    def __init__(self, host):
        self._host = host
        self.kv_buffer = host.kv_buffer
        self.layout = host.layout
        self.page_size = host.page_size

    def get_page_buffer_meta(self, indices):
        return self._host.get_page_buffer_meta(indices)


def test_a_pool_without_dtype_or_size_is_served(backend_factory):
    import torch

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    bare = BarePool(pools.host)
    assert not hasattr(bare, "dtype") and not hasattr(bare, "size")
    backend = backend_factory(pools, host=bare)
    tokens = cpu_sglang.random_tokens(2 * PAGE, seed=5)
    keys = cpu_sglang.page_keys(tokens, PAGE)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=5)
    assert backend.batch_set_v1(keys, src) == [True, True]
    assert backend.batch_exists(keys) == 2
    dst = src + len(tokens)
    assert backend.batch_get_v1(keys, dst) == [True, True]
    assert pools.page_bytes(dst) == pools.page_bytes(src)
    beyond = torch.full((PAGE,), pools.host.size + 10 * PAGE, dtype=torch.int64)  # past the pool's buffer
    assert backend.batch_get_v1(keys[:1], beyond) == [False]

# The MLA non-writer rank: tests/test_sglang_controller.py::test_mla_pages_are_shared_and_only_the_writer_writes.
