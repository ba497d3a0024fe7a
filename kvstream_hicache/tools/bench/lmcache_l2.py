"""LMCache L2 adapters as bench contenders, built and driven the way LMCache's MP server does (needs
lmcache 0.5.6: run ``kvstream bench`` from ``.venv-lmcache``).

* ``lmcache-fs-native-odirect``: LMCache's own file-system adapter, ``{"type": "fs_native",
  "base_path": <tier 0>, "use_odirect": true}`` (C++ worker threads, one O_DIRECT read per chunk
  straight into L1, no checksum);
* ``lmcache-fs-native``: the same with its default, buffered I/O (its files are fsynced after the
  store and dropped from the page cache before each read; the footprint a read leaves is recorded);
* ``lmcache-kvstream``: kvstream's ``KVStreamL2Adapter`` over every bench tier, as a ``plugin`` adapter;
* ``lmcache-kvstream-1tier``: the same on tier 0 alone.

Each adapter is built from its ``--l2-adapter`` JSON by LMCache's own argument parser
(``add_l2_adapters_args`` + ``parse_args_to_l2_adapters_config``) and factory (``create_l2_adapter``,
given the L1 memory descriptor, as the server does). Pages are LMCache chunks: objects of a real
``L1MemoryManager`` (LMCache's L1 arena), one per page of a batch. A write is one store task; a read
cuts the batch into 8 load tasks submitted back to back (LMCache's prefetch controller keeps up to 8
requests in flight) and waits on the adapter's load eventfd until every task has a result, as the
controller does. The ``lmcache-adapter`` policy (contenders.py) is kvstream's task machinery
(``L2Core``) without LMCache; these four are the real thing, side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import time
from typing import Any, Sequence

import numpy as np

from .contenders import Contender, Outcome, drop_page_cache, fsync_files, history_outcome, resident_bytes
from .geometry import Geometry

FS_NATIVE = "lmcache-fs-native"
FS_NATIVE_ODIRECT = "lmcache-fs-native-odirect"
LMCACHE_KVSTREAM = "lmcache-kvstream"
LMCACHE_KVSTREAM_1TIER = "lmcache-kvstream-1tier"
L2_CONTENDERS = (FS_NATIVE, FS_NATIVE_ODIRECT, LMCACHE_KVSTREAM, LMCACHE_KVSTREAM_1TIER)
TASKS = 8  # LMCache's prefetch controller keeps up to 8 requests in flight
WAIT_S = 300.0  # a task not done by then is a failure of the run, not a figure
ADAPTER_MODULE = "kvstream_hicache.lmcache.adapter"


def adapter_spec(name: str, dirs: Sequence[str], engine_settings: dict | None = None) -> dict:
    """The ``--l2-adapter`` JSON of contender ``name``; ``dirs``: its directory in each bench tier."""
    if name in (FS_NATIVE, FS_NATIVE_ODIRECT):
        spec: dict[str, Any] = {"type": "fs_native", "base_path": dirs[0]}
        if name == FS_NATIVE_ODIRECT:
            spec["use_odirect"] = True
        return spec
    if name in (LMCACHE_KVSTREAM, LMCACHE_KVSTREAM_1TIER):
        tiers = list(dirs[:1] if name == LMCACHE_KVSTREAM_1TIER else dirs)
        return {"type": "plugin", "module_path": ADAPTER_MODULE, "class_name": "KVStreamL2Adapter",
                "adapter_params": {"tiers": tiers, **(engine_settings or {})}}
    raise ValueError(f"not an LMCache L2 contender: {name!r}")


def spec_dirs(spec: dict) -> list[str]:
    return [spec["base_path"]] if spec["type"] == "fs_native" else list(spec["adapter_params"]["tiers"])


def create_adapter(spec: dict, l1_memory_desc: Any = None):
    """The adapter as ``lmcache server --l2-adapter JSON`` creates it: LMCache's parser, then its factory."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config

    parser = add_l2_adapters_args(argparse.ArgumentParser())
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    (one,) = config.adapters
    return create_l2_adapter(one, l1_memory_desc)


def chunk_shape(geometry: Geometry) -> tuple[int, ...]:
    """An LMCache chunk of ``geometry``'s page: ``[2, layers, tokens, heads * head_dim]`` (KV_2LTD) for a
    model preset, else the page as one flat bf16 tensor. Only the layout tag depends on it."""
    m = geometry.model
    if m is not None and not m.mla and geometry.page_tokens and len(geometry.segments) == 2:
        heads = geometry.segments[0] // (geometry.page_tokens * m.layers * m.head_dim * 2)
        return (2, m.layers, geometry.page_tokens, heads * m.head_dim)
    return (geometry.page_bytes // 2,)


class L1Host:
    """A real LMCache L1 arena (``L1MemoryManager``) holding one batch of chunks, and their keys."""

    def __init__(self, geometry: Geometry, batch_pages: int, model_name: str):
        import torch
        from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
        from lmcache.v1.distributed.config import L1MemoryManagerConfig
        from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager

        if geometry.page_bytes % 2:
            raise ValueError(f"{geometry.label}: an LMCache chunk of bf16 needs an even page size")
        self.page_bytes = geometry.page_bytes
        self.model_name = model_name
        self._object_key = ObjectKey
        self.l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=batch_pages * self.page_bytes + (64 << 20),
                                                        use_lazy=False))
        layout = MemoryLayoutDesc(shapes=[torch.Size(chunk_shape(geometry))], dtypes=[torch.bfloat16])
        err, self.objects = self.l1.allocate(layout, batch_pages)
        if not self.objects or len(self.objects) != batch_pages:
            self.l1.close()
            raise RuntimeError(f"LMCache L1 could not allocate {batch_pages} chunks of {self.page_bytes} B: {err}")
        self.views = [np.frombuffer(o.byte_array, dtype=np.uint8)[: self.page_bytes] for o in self.objects]

    def keys(self, keys: Sequence[str]) -> list:
        """LMCache ObjectKeys of bench keys (64 hex chars: the chunk hash)."""
        return [self._object_key(chunk_hash=bytes.fromhex(k), model_name=self.model_name, kv_rank=0) for k in keys]

    def load(self, ds, batch) -> None:
        for i, j in enumerate(batch.pages):
            ds.fill(j, self.views[i])

    def memory_desc(self) -> Any:
        return self.l1.get_l1_memory_desc()

    def close(self) -> None:
        self.views.clear()  # numpy views pin the arena
        self.l1.free(self.objects)
        self.l1.close()


class L2AdapterReads(Contender):
    """An LMCache L2 adapter (see the module docstring) storing and loading through the task interface.

    :param dirs: the contender's directory in each bench tier (created here; the runner removes them).
    """

    def __init__(self, name: str, host: L1Host, dirs: Sequence[str], engine_settings: dict | None = None):
        self.name = name
        self.host = host
        self.n_tiers = len(dirs)
        self.spec = adapter_spec(name, dirs, engine_settings)
        for d in spec_dirs(self.spec):
            os.makedirs(d, exist_ok=True)
        self.adapter = create_adapter(self.spec, host.memory_desc())
        self.engine = getattr(self.adapter, "engine", None)  # kvstream's adapter: its engine
        self.buffered = self.spec["type"] == "fs_native" and not self.spec.get("use_odirect")
        self.views = host.views
        self.footprints: list[int] = []
        self._closed = False

    # -- the task interface --------------------------------------------------------------------
    def _wait(self, kind: str, ids: Sequence[int]) -> dict:
        """Block on the adapter's eventfd of ``kind`` until every task in ``ids`` has a result."""
        from lmcache.v1.platform.event_notifier import consume_fd

        a = self.adapter
        fd = a.get_store_event_fd() if kind == "store" else a.get_load_event_fd()
        results: dict = {}
        pending = set(ids)
        deadline = time.monotonic() + WAIT_S
        while True:
            if kind == "store":
                results.update((t, r) for t, r in a.pop_completed_store_tasks().items() if t in pending)
                pending -= results.keys()
            else:
                for t in list(pending):
                    r = a.query_load_result(t)
                    if r is not None:
                        results[t] = r
                        pending.discard(t)
            if not pending:
                return results
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: {kind} tasks {sorted(pending)} not done in {WAIT_S:.0f} s")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                consume_fd(fd)

    def write(self, ds, batch) -> float:
        """One store task with the batch's chunks; returns seconds (buffered: fsynced too)."""
        self.host.load(ds, batch)
        n = len(batch.keys)
        t0 = time.perf_counter()
        task = self.adapter.submit_store_task(self.host.keys(batch.keys), self.host.objects[:n])
        result = self._wait("store", [task])[task]
        if self.buffered:
            fsync_files(self.files())
        dt = time.perf_counter() - t0
        if not result.is_successful():
            raise RuntimeError(f"{self.name} failed to store batch {batch.index}: {result}")
        return dt

    def read(self, batch) -> Outcome:
        n = len(batch.keys)
        keys = self.host.keys(batch.keys)
        core = getattr(self.adapter, "core", None)
        batches0 = core.counters["load_batches"] if core is not None else 0
        bounds = [round(t * n / TASKS) for t in range(TASKS + 1)]
        spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        ids = [self.adapter.submit_load_task(keys[a:b], self.host.objects[a:b]) for a, b in spans]
        got = self._wait("load", ids)
        found = [bool(got[t].test(i)) for t, (a, b) in zip(ids, spans) for i in range(b - a)]
        if self.engine is not None:
            return history_outcome(self.engine, found, core.counters["load_batches"] - batches0, self.n_tiers,
                                   {"tasks": len(ids)})
        nbytes = sum(found) * self.host.page_bytes
        split = (nbytes,) + (0,) * (self.n_tiers - 1)
        return Outcome(found, split, (None,) * self.n_tiers, split, {"tasks": len(ids)})

    # -- page cache (buffered only) ------------------------------------------------------------
    def files(self) -> list[str]:
        return [os.path.join(r, f) for d in spec_dirs(self.spec) for r, _, fs in os.walk(d) for f in fs]

    def before_phase(self) -> None:
        if self.buffered:
            drop_page_cache(self.files(), "fadvise")

    def after_phase(self, outcome: Outcome) -> None:
        if self.buffered:
            fp = resident_bytes(self.files())
            if fp is not None:
                self.footprints.append(fp)
                outcome.extra["page_cache_bytes"] = fp

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.adapter.close()

