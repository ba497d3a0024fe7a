"""kvstream behind sglang's real HybridCacheController on the CPU: real MHA/MLA host pools, page_first and
layer_first, 2 and 3 tiers; the backup thread writes, the prefetch thread finds, the IO thread reads back, and
the host pool ends up with the bytes that were written. Plus an A/B against sglang's own `file` backend."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from kvstream_hicache.layout import HEADER_SIZE, TierLayout
from helpers import loop_fs  # noqa: F401  (fixture)
from sglang_fixtures import (PAGE, cpu_sglang, drivers, plugin_loaded, round_trip, run_python,  # noqa: F401
                             tiers_config)

KINDS = ["mha", "mla"]
LAYOUTS = ["page_first", "layer_first"]


def _assert_consistent(drv):
    assert drv.threads_alive(), "a controller storage thread died"
    problems = drv.storage.engine.check()
    assert problems == [], problems


@pytest.mark.parametrize("n_tiers", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_controller_round_trip(plugin_loaded, tier_dirs, drivers, kind, layout, n_tiers):
    pools = cpu_sglang.make_pools(kind, layout, page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:n_tiers]))
    assert drv.zero_copy
    tokens, src, got = round_trip(drv, pools, n_pages=6, seed=11)
    assert got.hit_tokens == len(tokens), "the prefetch thread's batch_exists did not find every page"
    assert got.tokens == len(tokens), "the IO thread's batch_get_v1 did not read every page"
    assert pools.page_bytes(got.host_indices) == pools.page_bytes(src)
    stats = drv.storage.stats()
    assert [t["pages"] for t in stats["tiers"]] == [6] * n_tiers, "every tier holds a replica"
    assert sum(t["bytes_served"] for t in stats["tiers"]) == 6 * pools.flat_page_nbytes()
    assert stats["adapter"]["legacy_calls"] == 0 and stats["adapter"]["errors"] == 0
    # a second request for the same prefix plus new pages: hit on the prefix only
    more = tokens + cpu_sglang.random_tokens(2 * PAGE, seed=12)
    assert drv.query(more) == len(tokens)
    _assert_consistent(drv)


def test_more_than_one_storage_batch(plugin_loaded, tier_dirs, drivers):
    """> STORAGE_BATCH_SIZE (128) pages: the controller splits reads and writes into several calls."""
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE, device_tokens=4096, host_ratio=2.0)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]))
    tokens, src, got = round_trip(drv, pools, n_pages=150, seed=3)
    assert got.tokens == len(tokens)
    assert pools.page_bytes(got.host_indices) == pools.page_bytes(src)
    _assert_consistent(drv)


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mha", "layer_first"), ("mla", "layer_first")])
def test_ab_against_sglang_file_backend(plugin_loaded, tier_dirs, tier_root, drivers, monkeypatch, kind, layout):
    """Same host pool, same keys: sglang's `file` backend and kvstream read back identical bytes, and the
    payload kvstream stores is byte for byte the file sglang's backend writes."""
    file_dir = os.path.join(tier_root, "file-backend")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", file_dir)
    pools = cpu_sglang.make_pools(kind, layout, page_size=PAGE)
    tokens = cpu_sglang.random_tokens(5 * PAGE, seed=21)
    keys = cpu_sglang.page_keys(tokens, PAGE)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=21)
    reads = {}
    for backend, extra in (("file", {}), ("kvstream", tiers_config(tier_dirs[:2]))):
        drv = drivers(pools, backend, extra_config=extra)
        assert drv.backup(tokens, src, keys) == len(tokens)
        got = drv.prefetch(tokens)
        assert got.tokens == len(tokens), backend
        reads[backend] = pools.page_bytes(got.host_indices)
        if backend == "kvstream":
            kv = drv.storage
        drv.close()
    assert reads["file"] == reads["kvstream"] == pools.page_bytes(src)
    files = sorted(os.listdir(file_dir))
    for key in keys:
        with open(os.path.join(file_dir, next(f for f in files if f.startswith(key))), "rb") as f:
            ref = f.read()
        for tier in kv.config.tiers:
            with open(TierLayout(tier.path, kv.namespace.digest).page_path(key), "rb") as f:
                f.seek(HEADER_SIZE)
                assert f.read(len(ref)) == ref


@pytest.mark.parametrize("layout", LAYOUTS)
def test_legacy_and_zero_copy_paths_share_pages(tier_dirs, drivers, plugin_loaded, layout):
    """Pages written by the copying path (dynamic, interface_v1=0) are read by the zero-copy path, and the
    other way round: both store sglang's flat page (MHA layer_first segments are reordered K..., V...)."""
    pools = cpu_sglang.make_pools("mha", layout, page_size=PAGE)
    legacy = tiers_config(tier_dirs[:2], backend_name="kvstream", module_path="kvstream_hicache.sglang.storage",
                          class_name="KVStreamHiCacheStorage", interface_v1=0)
    t1 = cpu_sglang.random_tokens(3 * PAGE, seed=31)
    t2 = cpu_sglang.random_tokens(3 * PAGE, seed=32)
    s1 = cpu_sglang.fill_random(pools, len(t1), seed=31)
    s2 = cpu_sglang.fill_random(pools, len(t2), seed=32)

    drv = drivers(pools, "dynamic", extra_config=legacy)
    assert not drv.zero_copy
    assert drv.backup(t1, s1) == len(t1)
    drv.close()
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]))
    assert drv.zero_copy
    got = drv.prefetch(t1)
    assert got.tokens == len(t1) and pools.page_bytes(got.host_indices) == pools.page_bytes(s1)
    assert drv.backup(t2, s2) == len(t2)
    drv.close()
    drv = drivers(pools, "dynamic", extra_config=legacy)
    got = drv.prefetch(t2)
    assert got.tokens == len(t2) and pools.page_bytes(got.host_indices) == pools.page_bytes(s2)


def test_mla_pages_are_shared_and_only_the_writer_writes(plugin_loaded, tier_dirs, drivers):
    """MLA: TP rank 0 writes; rank 1 (not a storage writer: sglang skips its backups) reads rank 0's
    pages, and stores what it is asked to directly (a True is a page that exists)."""
    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    tokens = cpu_sglang.random_tokens(4 * PAGE, seed=41)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=41)
    rank0 = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), tp_rank=0, tp_size=2)
    assert rank0.storage.engine.config.catchup  # the writer rank: it catches up for every rank
    assert rank0.backup(tokens, src) == len(tokens)
    rank0.close()
    rank1 = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), tp_rank=1, tp_size=2)
    backend = rank1.storage
    assert not backend.is_writer
    assert not backend.engine.config.catchup  # its catch-up would be a second writer of rank 0's pages
    other = cpu_sglang.random_tokens(2 * PAGE, seed=42)
    other_keys = cpu_sglang.page_keys(other, PAGE)
    idx = cpu_sglang.fill_random(pools, len(other), seed=42)
    assert backend.batch_set_v1(other_keys, idx) == [True, True]
    assert backend.batch_exists(other_keys) == 2
    got = rank1.prefetch(tokens)
    assert got.tokens == len(tokens)
    assert pools.page_bytes(got.host_indices) == pools.page_bytes(src)


def test_an_mla_reader_rank_finds_the_writers_new_pages_with_discover_off(plugin_loaded, tier_dirs, drivers):
    """discover=0 (index only, for one process per namespace) on an MLA TP server: a reader rank never
    writes, it learns of rank 0's pages by discovery alone. Off, it found none of the pages rank 0 wrote
    after its start-up scan, and sglang's MIN over the ranks' hit counts made every L3 lookup a miss, with
    no word about it. The reader rank keeps discovery on and says why, once."""
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    extra = tiers_config(tier_dirs[:2], discover=0)
    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    reader = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=extra, tp_rank=1, tp_size=2),
                                    pools.host)
    try:
        assert reader.engine.wait_scan(30)  # (its scan done: from now on only discovery finds a new page)
        tokens = cpu_sglang.random_tokens(4 * PAGE, seed=43)
        src = cpu_sglang.fill_random(pools, len(tokens), seed=43)
        writer = drivers(pools, "kvstream", extra_config=extra, tp_rank=0, tp_size=2)
        assert not writer.storage.engine.config.discover  # the writer rank keeps the setting
        assert writer.backup(tokens, src) == len(tokens)
        keys = cpu_sglang.page_keys(tokens, PAGE)
        assert reader.batch_exists(keys) == 4
        assert reader.engine.config.discover
    finally:
        reader.close()


def test_an_mla_reader_rank_counts_the_writers_new_version_of_a_page_as_no_corruption(plugin_loaded, tier_dirs):
    """MLA TP: rank 0 evicts a page rank 1 has read, and stores it again from a new prefill (KV need not be
    bit-identical). Rank 1's next read finds the indexed copy replaced by an intact page: another
    writer's version (design.md), served, kept, counted in `other_versions`. It was also counted in
    `corrupted` (kvstream:tier_corrupted_pages_total: 'copies that failed verification'), which climbed
    on every reader rank of a healthy server."""
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    page = pools.flat_page_nbytes()
    cfg = {r: cpu_sglang.storage_config(pools, tp_rank=r, tp_size=2,
                                        extra_config=tiers_config(tier_dirs[:2], capacity=str(4 * page)))
           for r in (0, 1)}
    writer, reader = (KVStreamHiCacheStorage(cfg[r], pools.host) for r in (0, 1))
    try:
        keys = cpu_sglang.page_keys(cpu_sglang.random_tokens(4 * PAGE, seed=44), PAGE)
        other = cpu_sglang.page_keys(cpu_sglang.random_tokens(4 * PAGE, seed=45), PAGE)
        old = cpu_sglang.fill_random(pools, 4 * PAGE, seed=44)
        assert writer.batch_set_v1(keys, old) == [True] * 4
        dst = pools.alloc(4 * PAGE)
        assert reader.batch_get_v1(keys, dst) == [True] * 4
        assert writer.batch_set_v1(other, cpu_sglang.fill_random(pools, 4 * PAGE, seed=45)) == [True] * 4
        assert writer.batch_exists(keys) == 0  # evicted from both tiers
        new = cpu_sglang.fill_random(pools, 4 * PAGE, seed=46)
        assert writer.batch_set_v1(keys, new) == [True] * 4  # the same keys, other bytes
        cpu_sglang.scramble(pools, dst)
        assert reader.batch_get_v1(keys, dst) == [True] * 4
        assert pools.page_bytes(dst) == pools.page_bytes(new)
        tiers = reader.stats()["tiers"]
        assert sum(t["other_versions"] for t in tiers) >= 4 and sum(t["quarantined"] for t in tiers) == 0
        assert [t["corrupted"] for t in tiers] == [0, 0]
    finally:
        writer.close()
        reader.close()


@pytest.mark.leaves_problems("rank 1's index keeps entries of pages rank 0 evicted (index_stale, by design: never read "
                             "again), as many as the tier can hold")
def test_an_mla_reader_ranks_index_stays_within_its_tier_as_rank_0_evicts(plugin_loaded, loop_fs):
    """MLA TP: rank 0 (capacity of 8 pages) cycles pages through the tier; rank 1 finds each by discovery
    (sglang's hit query on every rank) as another process's copy, never evicted by it, and sglang never
    reads it again once rank 0 evicted it (MIN of the ranks' hits). Such an entry stayed in rank 1's
    index for the process's life: more than the file system can hold, growing with every page rank 0
    ever stored. Past the tier's size, the oldest are forgotten (their files, if any, are found again)."""
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    fs = loop_fs(16 << 20, "mla")
    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE, layers=8)
    page = pools.flat_page_nbytes()
    cfg = {r: cpu_sglang.storage_config(pools, tp_rank=r, tp_size=2,
                                        extra_config=tiers_config([fs.mnt], capacity=str(8 * page)))
           for r in (0, 1)}
    writer, reader = (KVStreamHiCacheStorage(cfg[r], pools.host) for r in (0, 1))
    try:
        for r in range(40):
            keys = cpu_sglang.page_keys(cpu_sglang.random_tokens(4 * PAGE, seed=1000 + r), PAGE)
            idx = cpu_sglang.fill_random(pools, 4 * PAGE, seed=r)
            assert writer.batch_set_v1(keys, idx) == [True] * 4
            pools.free(idx)
            assert reader.batch_exists(keys) == 4
        st = os.statvfs(fs.mnt)
        fits = st.f_blocks * st.f_frsize // page
        assert writer.stats()["tiers"][0]["pages"] <= 8
        assert reader.batch_exists(keys) == 4  # the newest still found
        held = reader.stats()["tiers"][0]["pages"]
        assert held <= fits, f"rank 1 indexes {held} pages; the tier holds at most {fits}"
    finally:
        writer.close()
        reader.close()


def test_namespace_keeps_models_layouts_and_mha_ranks_apart(tier_dirs):
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    extra = tiers_config(tier_dirs[:2])
    base = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    tokens = cpu_sglang.random_tokens(2 * PAGE, seed=51)
    keys = cpu_sglang.page_keys(tokens, PAGE)
    idx = cpu_sglang.fill_random(base, len(tokens), seed=51)
    writer = KVStreamHiCacheStorage(cpu_sglang.storage_config(base, extra_config=extra, tp_size=2), base.host)
    assert writer.batch_set_v1(keys, idx) == [True, True]
    assert writer.batch_exists(keys) == 2
    others = [
        (base, dict(model_name="org/other-model", tp_size=2)),
        (base, dict(tp_rank=1, tp_size=2)),
        (cpu_sglang.make_pools("mha", "layer_first", page_size=PAGE), dict(tp_size=2)),
        (cpu_sglang.make_pools("mha", "page_first", page_size=PAGE, heads=4), dict(tp_size=2)),
    ]
    for pools, kw in others:
        reader = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=extra, **kw), pools.host)
        assert reader.namespace != writer.namespace
        assert reader.batch_exists(keys) == 0, kw
        reader.close()
    writer.close()


def _fp8_pools(dtype):
    """A real MHA device pool storing ``dtype`` KV (as bytes, as SGLang stores fp8) and its host pool."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(size=512, page_size=PAGE, dtype=dtype, head_num=2, head_dim=64, layer_num=2,
                           device="cpu", enable_memory_saver=False)
    with host_memory_budget_scope(1 << 34):
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                    pin_memory=False, device="cpu", device_capacity_tokens=512, start_layer=0,
                                    end_layer=2)
    return cpu_sglang.Pools(kind="mha", layout="page_first", page_size=PAGE, device=dev, host=host)


def test_fp8_formats_keep_their_pages_apart(tier_dirs, monkeypatch):
    """SGLang stores fp8_e4m3 and fp8_e5m2 KV alike as uint8, so the host pool's dtype is the same for
    both: the namespace takes the server's --kv-cache-dtype too, and an e5m2 server is never served an
    e4m3 server's pages (before: both read the same pages). Found by a review."""
    import torch
    from sglang.srt import runtime_context

    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    extra = tiers_config(tier_dirs[:2])
    e4m3, e5m2 = _fp8_pools(torch.float8_e4m3fn), _fp8_pools(torch.float8_e5m2)
    tokens = cpu_sglang.random_tokens(2 * PAGE, seed=5)
    keys = cpu_sglang.page_keys(tokens, PAGE)
    src = cpu_sglang.fill_random(e4m3, len(tokens), seed=5)

    def backend(pools, kv_cache_dtype):  # (SGLang's process-wide server arguments, as a scheduler has them)
        args = type("Args", (), {"kv_cache_dtype": kv_cache_dtype})
        monkeypatch.setattr(runtime_context._CONTEXT, "_server_args", args)
        return KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=extra), pools.host)

    writer = backend(e4m3, "fp8_e4m3")
    assert writer.batch_set_v1(keys, src) == [True, True]
    writer.close()
    reader = backend(e5m2, "fp8_e5m2")
    try:
        assert reader.namespace != writer.namespace
        assert reader.batch_exists(keys) == 0
        assert reader.batch_get_v1(keys, e5m2.alloc(len(tokens))) == [False, False]
    finally:
        reader.close()
    again = backend(e4m3, "fp8_e4m3")  # the same server again: its pages
    try:
        assert again.batch_exists(keys) == 2
    finally:
        again.close()


def test_an_fp8_server_upgraded_from_before_its_kv_cache_dtype_was_in_the_namespace_is_told(tier_dirs, monkeypatch,
                                                                                                caplog):
    """An fp8 server upgraded from a kvstream of before 6b6a304, whose namespace had no --kv-cache-dtype (trial
    upgrade: 8c414b8's pages, then this tree's server on the same tier): its pages are another namespace's now,
    rightly never served (e4m3 and e5m2 alike there), and no capacity counts their room. The start said
    nothing: every page a miss, the old directory on the tier for good. It says which directory and the fix."""
    import torch
    from sglang.srt import runtime_context

    from kvstream_hicache.sglang import storage
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    extra = tiers_config(tier_dirs[:1])
    pools = _fp8_pools(torch.float8_e4m3fn)
    tokens = cpu_sglang.random_tokens(2 * PAGE, seed=5)
    keys = cpu_sglang.page_keys(tokens, PAGE)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=5)
    monkeypatch.setattr(runtime_context._CONTEXT, "_server_args", type("Args", (), {"kv_cache_dtype": "fp8_e4m3"}))
    with monkeypatch.context() as before:  # (the earlier version's namespace: no kv_cache_dtype field)
        before.setattr(storage, "_kv_cache_dtype", lambda host: None)
        earlier = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=extra), pools.host)
        assert earlier.batch_set_v1(keys, src) == [True, True]
        earlier.close()
    caplog.set_level("INFO", logger="kvstream")
    upgraded = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=extra), pools.host)
    try:
        assert upgraded.namespace.digest != earlier.namespace.digest and upgraded.batch_exists(keys) == 0
    finally:
        upgraded.close()
    old_dir = os.path.join(tier_dirs[0], "kvstream", earlier.namespace.digest)
    said = [r.getMessage() for r in caplog.records if old_dir in r.getMessage()]
    assert len(said) == 1 and "--kv-cache-dtype" in said[0] and "remove" in said[0], said


def test_a_draft_model_pool_registered_after_the_attach_is_refused(plugin_loaded, tier_dirs, drivers):
    """A separate draft model's KV pool (EAGLE3, HiCache draft 'sidecar' mode) reaches the backend after
    the attach, while the scheduler still starts (register_sidecar_pool -> register_host_pool_entry):
    refused there with the attach's message, so the server does not start (before: accepted with an
    error line; every L3 lookup then answered 0 while every backup wrote pages). Found by a review."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import PoolEntry

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    draft = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE, layers=1)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]))
    with pytest.raises(RuntimeError, match=r"sidecar host pools \(draft\)"):
        drv.controller.register_host_pool_entry(PoolEntry(name=PoolName.DRAFT, host_pool=draft.host,
                                                          device_pool=draft.device, layer_mapper=lambda i: i))
    assert drv.storage.batch_exists(["a" * 64]) == 0  # (closed: answers misses, never raises)


def test_clear_and_stats_through_the_controller(plugin_loaded, tier_dirs, drivers):
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    tokens, src, got = round_trip(drv, pools, n_pages=4, seed=61)
    drv.storage.flush_metrics()  # the stats snapshot is otherwise refreshed at most once per second
    metrics = drv.backend.get_stats()
    from sglang.srt.observability.metrics_collector import StorageMetrics

    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [4] and metrics.prefetch_pgs == [4]
    assert all(bw > 0 for bw in metrics.prefetch_bandwidth + metrics.backup_bandwidth)
    assert metrics.kvstream["pages_found"] == 4
    assert drv.backend.get_stats().prefetch_pgs == []  # drained by the previous poll
    assert drv.clear() is True
    assert drv.query(tokens) == 0
    _assert_consistent(drv)


def _legacy_backend(tier_dirs, layout: str, n: int, seed: int):
    """A backend on two tiers over a host pool of ``layout`` holding ``n`` random pages: (backend, pools,
    their keys, each page as sglang's flat data page)."""
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    pools = cpu_sglang.make_pools(layout, "page_first", page_size=PAGE)
    backend = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:2])),
                                     pools.host)
    tokens = cpu_sglang.random_tokens(n * PAGE, seed=seed)
    idx = cpu_sglang.fill_random(pools, len(tokens), seed=seed)
    return backend, pools, cpu_sglang.page_keys(tokens, PAGE), [pools.host.get_data_page(int(idx[i * PAGE]))
                                                                for i in range(n)]


def test_legacy_methods_directly(tier_dirs):
    """The five legacy methods on flat page tensors, including a strided target and a missing value."""
    import torch

    backend, pools, keys, flat = _legacy_backend(tier_dirs, "mla", 2, seed=71)
    assert backend.batch_set(keys, flat) is True
    assert backend.set(keys[0], flat[0]) is True  # idempotent
    assert backend.set("b" * 64, None) is False
    assert backend.exists(keys[1]) and not backend.exists("c" * 64)
    got = backend.batch_get(keys + ["c" * 64])
    assert [torch.equal(g, f) for g, f in zip(got[:2], flat)] == [True, True] and got[2] is None
    strided = torch.zeros(2 * flat[0].numel(), dtype=flat[0].dtype)[::2]
    assert backend.get(keys[1], strided) is strided and torch.equal(strided, flat[1])
    assert backend.get("../../etc/passwd") is None and backend.counters["invalid_keys"] == 1
    backend.close()


def test_legacy_batches_answer_one_entry_per_key(tier_dirs):
    """sglang indexes a batch_get answer by key (page_data[i] for i in range(len(hash_values))): a target
    list shorter than the keys still gets one answer per key (a key without a target reads into a
    page of its own, as with targets=None), and tensors past the last key are ignored, by batch_get
    and batch_set alike (counted, never a raise)."""
    import torch

    backend, pools, keys, flat = _legacy_backend(tier_dirs, "mha", 3, seed=73)
    try:
        assert backend.batch_set(keys[:2], flat[:2]) is True
        targets = [pools.host.get_dummy_flat_data_page() for _ in range(1)]
        got = backend.batch_get(keys, targets)  # two targets short; the third key is not stored
        assert len(got) == 3 and got[2] is None
        assert got[0] is targets[0] and torch.equal(got[0], flat[0]) and torch.equal(got[1], flat[1])
        got = backend.batch_get(keys[:1], [pools.host.get_dummy_flat_data_page() for _ in range(3)])
        assert len(got) == 1 and torch.equal(got[0], flat[0])
        assert backend.batch_set(keys[1:2], flat[1:]) is True  # the last tensor has no key: ignored
        assert not backend.exists(keys[2])
        assert backend.counters["bad_arguments"] == 3 and backend.counters["errors"] == 0
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_an_asymmetric_host_pool_round_trips_and_says_why_it_is_staged(plugin_loaded, tier_dirs, drivers, layout):
    """head_dim != v_head_dim (MiMo-V2): sglang's AsymmetricMHATokenToKVPoolHost keeps K and V in two
    buffers, ``kv_buffer`` a tuple. Pages round-trip through the real controller; raw addresses are
    checked against both buffers (the tuple was no tensor: nothing was checked); the reads are staged
    (a page's K and V lie in two buffers, and one fixed read reaches into one registered buffer) and
    the start-up line says so (it blamed 4 KiB pages). Found by a review."""
    pools = cpu_sglang.make_pools("mha", layout, page_size=PAGE, head_dim=64, v_head_dim=32)
    assert type(pools.host).__name__ == "AsymmetricMHATokenToKVPoolHost"
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:1]))
    assert drv.zero_copy and "K and V in buffers of their own" in drv.storage.startup_line()
    tokens, src, got = round_trip(drv, pools, n_pages=6, seed=17)
    assert got.tokens == len(tokens) and pools.page_bytes(got.host_indices) == pools.page_bytes(src)
    k, v = pools.host.kv_buffer
    inside = drv.storage._inside_buffer
    assert inside([(k.data_ptr(), 4096)]) and inside([(v.data_ptr(), 4096)])
    assert not inside([(k.data_ptr() + k.numel() * k.element_size(), 4096)])
    _assert_consistent(drv)


BACKUPS_AT_EXIT_CHILD = textwrap.dedent("""
    import sys
    from kvstream_hicache.tools import cpu_sglang

    cpu_sglang.install_stubs()
    cpu_sglang.load_kvstream_plugin()
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=16)
    drv = cpu_sglang.ControllerDriver(pools, "kvstream", extra_config={"tiers": sys.argv[1:]})
    tokens = cpu_sglang.random_tokens(4 * 16, seed=1)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=1)
    print("STORED", drv.backup(tokens, src), flush=True)
    for i in range(300):  # the scheduler's last write-backs, queued for the backup thread as the process ends
        more = cpu_sglang.random_tokens(4 * 16, seed=100 + i)
        drv.controller.write_storage(src, more, hash_value=cpu_sglang.page_keys(more, 16))
    print("EXIT", flush=True)  # a scheduler process that returns (sglang's graceful shutdown: no detach)
""")


def test_a_scheduler_process_that_exits_with_backups_queued_logs_no_failure(tier_dirs):
    """A scheduler process ends (sglang's graceful shutdown returns from the event loop; the storage
    threads are never stopped nor the backend detached) while its backup thread still has write-backs
    queued. sglang's storage threads go on calling the backend until the interpreter stops them: its
    engine is not closed under them at exit. Before, the exit hook closed the engine first: every
    later batch_set_v1 raised EngineClosedError, kvstream warned ("batch_set_v1 failed
    (EngineClosedError ...)") and sglang logged "Write page to storage: 4 pages failed." for each
    queued write-back, up to hundreds of lines in every server's shutdown log."""
    code = "import sys; sys.argv[1:] = %r\n" % tier_dirs[:2] + BACKUPS_AT_EXIT_CHILD
    done = run_python(code, env={"PYTHONPATH": os.pathsep.join(sys.path)}, timeout=240)
    assert "STORED 64" in done.stdout and "EXIT" in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "EngineClosedError" not in done.stderr, done.stderr[-3000:]
    assert "pages failed" not in done.stderr, done.stderr[-3000:]


def test_mla_pages_of_dcp_shards_are_kept_apart(tier_dirs):
    """Under decode context parallelism (sglang's DCP, MLA only) each DCP rank's host page holds its own
    shard of a logical page: ranks 0 and 1 store different bytes under the same page keys, and an operator
    who turns DCP on (or changes its size) changes what a page holds. The namespace takes the DCP rank and
    size (sglang's own file backend keys pages by them); before, every DCP shard shared MLA's one namespace
    and rank 1 was served rank 0's shard (reviewer reconfig)."""
    from dataclasses import replace

    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    extra = tiers_config(tier_dirs[:2])
    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    tokens = cpu_sglang.random_tokens(2 * PAGE, seed=61)
    keys = cpu_sglang.page_keys(tokens, PAGE)
    idx = cpu_sglang.fill_random(pools, len(tokens), seed=61)
    plain = cpu_sglang.storage_config(pools, extra_config=extra, tp_size=2)
    shard = {r: replace(plain, tp_rank=r, dcp_rank=r, dcp_size=2, logical_page_size=2 * PAGE) for r in (0, 1)}
    writer = KVStreamHiCacheStorage(shard[0], pools.host)
    assert writer.batch_set_v1(keys, idx) == [True, True] and writer.batch_exists(keys) == 2
    writer.close()
    for cfg in (shard[1], plain):  # another DCP shard; the same rank with DCP off
        reader = KVStreamHiCacheStorage(cfg, pools.host)
        try:
            assert reader.namespace != writer.namespace and reader.batch_exists(keys) == 0, cfg
        finally:
            reader.close()


def test_a_prefixs_head_outlives_its_tails_as_sglangs_scheduler_writes_and_reads_them(plugin_loaded, tier_dirs,
                                                                                          drivers):
    """As a server with HiCache runs: a prefix's head (a shared system prompt, H) reaches L3 once, with the
    first request's pages after it (A); later requests write only their own pages after it (B), and read L3
    only beyond what host memory holds, their prefix passed as ``prefix_keys`` (on for kvstream:
    plugin._pass_prefix_keys). At a capacity of 8 pages, the next 4 new pages (C) must evict a tail, not the
    head: evicted head first (batch order, no use of prefix_keys), every page of A and B stayed on the tier,
    useless (batch_exists counts the leading run: 0 tokens)."""
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    page = pools.flat_page_nbytes()
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:1], capacity=str(8 * page)))

    def write(n: int, seed: int, prefix: list[str] | None = None) -> tuple[list[int], list[str]]:
        tokens = cpu_sglang.random_tokens(n * PAGE, seed=seed)
        keys = cpu_sglang.page_keys(tokens, PAGE, prefix[-1] if prefix else None)
        assert drv.backup(tokens, cpu_sglang.fill_random(pools, len(tokens), seed=seed), keys,
                          prefix_keys=prefix) == len(tokens)
        return tokens, keys

    first, keys = write(4, 1)  # H and A: the first request's pages, one batch
    head, h_keys = first[:2 * PAGE], keys[:2]
    write(2, 3)  # another request's pages (X)
    b_tail, _ = write(2, 4, h_keys)  # B: H held, its own pages after it
    write(4, 5)  # C: 4 new pages at a capacity of 8 evict 4
    assert drv.query(head + b_tail) == len(head + b_tail), "the prefix's head was evicted before its tails"
    got = drv.prefetch(b_tail, prefix_keys=h_keys)  # (H in host memory: the tail alone read from L3)
    assert got.tokens == len(b_tail)
    assert drv.query(head) == len(head)


@pytest.mark.leaves_problems("each process's index lacks the pages the other wrote since its start (index_missing, "
                             "by design: found by discovery)")
def test_a_prefixs_head_another_process_of_the_namespace_keeps_using_is_not_evicted_by_its_writer(tier_dirs):
    """Two writers of one namespace on one tier: the DP ranks of an attention-DP server (DeepSeek's MLA: every
    DP group's attention-TP rank 0 writes), or two servers of one model sharing their tiers. A writes a shared
    prefix's head H with its first request; B's requests read H from L3 and write their own pages after it,
    with H as prefix_keys. A's other traffic then fills A's capacity. Before, A evicted H by its own LRU, where
    H had aged (B's reads and touches reach B's index only, where H is another process's copy), and every page
    B wrote after H stayed stored and served nothing (batch_exists counts the leading run): 0 tokens for B's
    prefixes, which B used every round. Now B's writes after H mark H used (its access time: Tier.mark_used)
    and A's eviction spares a page used since A last did (Index.spare). docs/sglang.md section 4."""
    import dataclasses

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    page = pools.flat_page_nbytes()
    cfg = cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:1], capacity=str(8 * page)))
    a, b = (KVStreamHiCacheStorage(dataclasses.replace(cfg, dp_rank=r), pools.host) for r in (0, 1))
    try:
        def keys(seed: int, prior: str | None = None) -> list[str]:
            return cpu_sglang.page_keys(cpu_sglang.random_tokens(2 * PAGE, seed=seed), PAGE, prior)

        def store(backend, k: list[str], seed: int, prefix: list[str] | None = None) -> None:
            idx = cpu_sglang.fill_random(pools, len(k) * PAGE, seed=seed)
            assert backend.batch_set_v1(k, idx, HiCacheStorageExtraInfo(prefix_keys=prefix)) == [True] * len(k)
            pools.free(idx)

        head = keys(1)
        store(a, head + keys(2, head[-1]), 1)  # A's request: H and its tail
        dst = pools.alloc(2 * PAGE)
        for r in range(4):
            store(a, keys(100 + r), 100 + r)  # A's other requests
            b.batch_exists(head)  # B's request: H from L3 ...
            assert b.batch_get_v1(head, dst) == [True, True], f"round {r}: A evicted the head B reads every round"
            tail = keys(200 + r, head[-1])  # ... and its own pages after it
            store(b, tail, 200 + r, head)
        assert b.batch_exists(head + tail) == 4
    finally:
        a.close()
        b.close()
