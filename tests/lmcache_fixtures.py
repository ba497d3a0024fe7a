"""Fixtures and helpers of the LMCache tests (test_lmcache_*.py): LMCache 0.5.6's MP API imported lazily
(the SGLang venv collects those files without it), one storage manager with our adapter as its only L2
adapter, keys, payloads and layouts. Like sglang_fixtures.py, a helper module: no test lives here.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from kvstream_hicache.errors import EngineClosedError
from kvstream_hicache.lmcache import keys as l2keys
from kvstream_hicache.layout import TierLayout

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no telemetry from tests

WAIT_S = 30.0  # upper bound on any wait for a completion (never a sleep), s
L1_GB = "0.03"


@pytest.fixture(scope="module")
def lmc():
    """LMCache's MP API, imported lazily (the SGLang venv collects this file without it)."""
    import torch
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    class NS:
        pass

    ns = NS()
    ns.torch, ns.ObjectKey, ns.MemoryLayoutDesc = torch, ObjectKey, MemoryLayoutDesc
    ns.GroupedObjectKeys, ns.PrefetchTaskSpec = GroupedObjectKeys, PrefetchTaskSpec
    ns.parse_args, ns.StorageManager = parse_args, StorageManager
    return ns


class Server:
    """One LMCache MP storage manager with our adapter as its only L2 adapter."""

    def __init__(self, lmc, tiers: list[str], module_path: str = "kvstream_hicache.lmcache.adapter", **params):
        spec = {"type": "plugin", "module_path": module_path,
                "class_name": "KVStreamL2Adapter",
                "adapter_params": {"tiers": tiers, "chunk": "4K", **params}}
        self.lmc = lmc
        self.sm = lmc.StorageManager(lmc.parse_args(["--l1-size-gb", L1_GB, "--eviction-policy", "LRU",
                                                     "--l2-adapter", json.dumps(spec)]))
        (_desc, self.adapter), = self.sm.l2_adapters()
        self.stores = 0

    @property
    def engine(self):
        return self.adapter.engine

    def write_through(self, keys, layout, payloads) -> None:
        """L1 write -> LMCache stores to L2 through the adapter; waits for the store to complete."""
        objs = self.sm.reserve_write(keys, layout)
        assert set(objs) == set(keys)
        for key, data in zip(keys, payloads):
            obj = objs[key]
            assert obj.get_size() == len(data)
            np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        self.sm.finish_write(keys)
        self.stores += 1
        assert self.adapter.core.wait_completed("store", self.stores, WAIT_S)
        self.drop_l1(keys)  # the read must come from L2

    def drop_l1(self, keys) -> None:
        """Delete ``keys`` from L1 once LMCache has let them go. Its store controller read-locks a stored
        chunk's L1 object until it has seen the store task complete, which comes after the adapter
        counts it; deleted by force in between, the key came back with the prefetch that followed as
        a temporary object, and the controller's late ``finish_read`` freed that one (the prefetch
        found no L1 copy: once in 17 runs of the LMCache suites under load)."""
        deadline = time.monotonic() + WAIT_S
        deleted = 0
        while True:
            n, locked = self.sm.delete_l1_keys(keys)  # (unforced: a locked key is skipped)
            deleted += n
            if not locked:
                break
            assert time.monotonic() < deadline, "LMCache never released the stored chunks' L1 objects"
            time.sleep(0.005)
        assert deleted == len(keys)

    def prefetch(self, keys, layout) -> tuple[int, list[bytes | None]]:
        """Prefetch into L1; returns (L2 hits, per key the L1 bytes or None when not resident)."""
        lmc = self.lmc
        handle = self.sm.submit_prefetch_task(lmc.PrefetchTaskSpec([lmc.GroupedObjectKeys(keys, 0, layout)]))
        assert self.sm.wait_prefetch_status(handle, WAIT_S)
        result = self.sm.query_prefetch_status(handle)
        hits = sum(row.popcount() for row in result.l2_hit_cells)
        out: list[bytes | None] = []
        for key in keys:
            with self.sm.read_prefetched_results([key]) as objs:
                out.append(None if objs is None else bytes(objs[0].byte_array))
            if objs is not None:  # release the prefetch's read lock (None: the context released it)
                self.sm.finish_read_prefetched([key])
        return hits, out

    def close(self) -> None:
        engine = self.engine
        self.sm.close()
        with pytest.raises(EngineClosedError):  # LMCache closed the adapter, the adapter its engine
            engine.get([], [])


@pytest.fixture
def server_factory(lmc, tier_root):
    """Servers closed at teardown, before tier_root (requested here for that order) removes their tiers."""
    servers: list[Server] = []

    def make(tiers, module_path: str = "kvstream_hicache.lmcache.adapter", **params) -> Server:
        server = Server(lmc, tiers, module_path, **params)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def make_tiers(root: str, n: int) -> list[str]:
    dirs = [os.path.join(root, f"tier{i}") for i in range(n)]
    for d in dirs:
        os.makedirs(d)
    return dirs


def chunk_keys(lmc, n: int, model: str = "org/model-7b", rank: int = 0, salt: str = "") -> list:
    return [lmc.ObjectKey(chunk_hash=(1000 + i).to_bytes(8, "big"), model_name=model, kv_rank=rank,
                          cache_salt=salt) for i in range(n)]


def random_payloads(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def page_path(server: Server, tier: str, key, layout) -> str:
    ekey = l2keys.engine_key(key)
    return TierLayout(tier, server.engine.namespace.digest).page_path(ekey)


def layout_of(lmc, tokens: int, heads_dim: int):
    """KV_2LTD-like layout [2, tokens, heads*dim] in bfloat16: 4 * tokens * heads_dim bytes."""
    return lmc.MemoryLayoutDesc(shapes=[lmc.torch.Size([2, tokens, heads_dim])], dtypes=[lmc.torch.bfloat16])
