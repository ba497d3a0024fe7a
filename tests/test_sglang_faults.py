"""Faults seen from sglang's controller threads: they stay alive, requests degrade to misses, later requests
hit again. sglang's own failure injector, a tier directory replaced mid-run, I/O errors and corruption on one
tier (the ring's fault hook), exceptions inside the engine, a hybrid model refused at attach, metrics."""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time

import pytest

from sglang_fixtures import PAGE, cpu_sglang, drivers, plugin_loaded, round_trip, tiers_config  # noqa: F401  (first: CPU stubs)

from kvstream_hicache.faults import Fault, FaultPlan, TierFaultPlan  # noqa: E402
from kvstream_hicache.io import OP_READ  # noqa: E402
from helpers import wait_for_fault, wait_until  # noqa: E402
from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage  # noqa: E402

ATTEMPTS = 40  # bounded retries under random injected failures (p=0.3 per call: a miss-all chance < 1e-9)


def _until(fn, want, attempts=ATTEMPTS):
    for _ in range(attempts):
        got = fn()
        if got == want:
            return got
    return got


def test_sglang_failure_injector(plugin_loaded, tier_dirs, drivers, monkeypatch):
    """SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE / _DELAY wrap the backend: random calls fail or stall."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]))
    assert type(drv.backend).__name__ == "HiCacheStorageFailureInjector"
    assert drv.zero_copy
    for seed in range(3):
        tokens = cpu_sglang.random_tokens(4 * PAGE, seed=100 + seed)
        src = cpu_sglang.fill_random(pools, len(tokens), seed=100 + seed)
        assert _until(lambda: drv.backup(tokens, src), len(tokens)) == len(tokens)
        results = []

        def fetch():
            got = drv.prefetch(tokens)
            results.append(got)
            return got.tokens

        assert _until(fetch, len(tokens)) == len(tokens)
        assert pools.page_bytes(results[-1].host_indices) == pools.page_bytes(src)
        for got in results:
            pools.free(got.host_indices)
        assert drv.threads_alive()
    assert drv.storage.counters["errors"] == 0


def test_tier_directory_replaced_mid_run(plugin_loaded, tier_dirs, drivers):
    """Tier 0's directory is replaced by a file while the server runs (root ignores chmod, so permissions
    cannot simulate this): reads come from tier 1, writes go on, and every request still hits."""
    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]))
    tokens, src, got = round_trip(drv, pools, n_pages=5, seed=201)
    assert got.tokens == len(tokens)

    away = tier_dirs[0] + ".away"
    os.rename(tier_dirs[0], away)
    with open(tier_dirs[0], "w") as f:
        f.write("not a directory\n")
    try:
        got = drv.prefetch(tokens)
        assert got.tokens == len(tokens), "pages must be served from the surviving replica"
        assert pools.page_bytes(got.host_indices) == pools.page_bytes(src)
        tier0 = drv.storage.stats()["tiers"][0]
        assert tier0["errors"] > 0 or not tier0["healthy"], f"tier 0 was never tried: {tier0}"
        tokens2, src2, got2 = round_trip(drv, pools, n_pages=3, seed=202)
        assert got2.tokens == len(tokens2)
        assert pools.page_bytes(got2.host_indices) == pools.page_bytes(src2)
        assert drv.threads_alive()
        assert drv.storage.counters["errors"] == 0
    finally:
        os.unlink(tier_dirs[0])
        os.rename(away, tier_dirs[0])


class _TierPlan(FaultPlan):
    """Apply ``fault`` to reads of files under one tier directory, once armed."""

    def __init__(self, tier: str, fault: Fault):
        super().__init__()
        self.tier, self.fault, self.armed = os.path.realpath(tier), fault, False

    def decide(self, opcode, fd, offset, length):
        if not self.armed or opcode != OP_READ:
            return None
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        if not path.startswith(self.tier + os.sep):
            return None
        self.hits.append((self.fault, opcode, fd, offset, length))
        return self.fault


@pytest.mark.parametrize("fault,counter", [(Fault.error(errno.EIO), "errors"), (Fault.corrupt(), "corrupted")])
def test_tier_io_errors_and_corruption_fall_back_to_the_replica(plugin_loaded, tier_dirs, drivers, monkeypatch,
                                                               fault, counter):
    from kvstream_hicache.engine import Engine

    plan = _TierPlan(tier_dirs[0], fault)
    monkeypatch.setattr(KVStreamHiCacheStorage, "_open_engine",
                        lambda self, ns: Engine(self.config, ns, fault_plan=plan))
    pools = cpu_sglang.make_pools("mha", "layer_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    tokens = cpu_sglang.random_tokens(6 * PAGE, seed=301)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=301)
    assert drv.backup(tokens, src) == len(tokens)
    plan.armed = True
    got = drv.prefetch(tokens)
    assert got.tokens == len(tokens)
    assert pools.page_bytes(got.host_indices) == pools.page_bytes(src)
    stats = drv.storage.stats()
    assert stats["tiers"][1]["bytes_served"] == 6 * pools.flat_page_nbytes(), "tier 1 served everything"
    assert plan.hits, "tier 0 claims the front of the batch first, so it must have been read"
    assert stats["tiers"][0][counter] > 0
    from prometheus_client import REGISTRY

    drv.storage.flush_metrics()
    labels = dict(drv.storage._exporter.labels, tier="0")
    name = {"errors": "kvstream:tier_errors_total", "corrupted": "kvstream:tier_corrupted_pages_total"}[counter]
    assert (REGISTRY.get_sample_value(name, labels) or 0) > 0
    if counter == "errors":  # (EIO fails the tier: counted, also once it is back between two scrapes)
        assert REGISTRY.get_sample_value("kvstream:tier_failures_total", labels) == stats["tiers"][0]["failures"] >= 1
    assert drv.threads_alive()


def test_engine_exceptions_never_reach_the_controller_threads(plugin_loaded, tier_dirs, drivers, caplog):
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]))
    tokens, src, _ = round_trip(drv, pools, n_pages=3, seed=401)
    engine = drv.storage.engine

    def boom(*a, **k):
        raise RuntimeError("injected engine failure")

    saved = {name: getattr(engine, name) for name in ("get", "put", "prefix_len")}
    for name in saved:
        setattr(engine, name, boom)
    with caplog.at_level(logging.WARNING, logger="kvstream"):
        for _ in range(3):
            assert drv.query(tokens) == 0
            fresh = cpu_sglang.random_tokens(2 * PAGE, seed=402)
            assert drv.backup(fresh, cpu_sglang.fill_random(pools, len(fresh), seed=402)) == 0
            assert drv.storage.batch_get_v1(["a" * 64], src[:PAGE]) == [False]
            assert drv.storage.batch_get(["a" * 64]) == [None]
            assert drv.storage.batch_set(["a" * 64], [pools.host.get_data_page(int(src[0]))]) is False
    assert drv.threads_alive()
    assert drv.storage.counters["errors"] >= 15
    warned = [r for r in caplog.records if "injected engine failure" in r.getMessage()]
    methods = {r.getMessage().split()[1] for r in warned}
    assert len(warned) == len(methods), "one warning per method per interval, not one per call"
    for name, fn in saved.items():
        setattr(engine, name, fn)
    got = drv.prefetch(tokens)
    assert got.tokens == len(tokens) and pools.page_bytes(got.host_indices) == pools.page_bytes(src)


def test_hybrid_model_refused_at_attach(tier_dirs):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    backend = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:2])),
                                     pools.host)
    backend.register_mem_host_pool_v2(pools.host, PoolName.KV)
    backend.register_mem_host_pool_v2(object(), PoolName.SWA)
    with pytest.raises(RuntimeError, match="sidecar host pools .*swa.*--hicache-storage-backend file"):
        backend.on_host_pools_registered()
    idx = pools.alloc(PAGE)
    assert backend.batch_get_v1(["a" * 64], idx) == [False]  # threads already running get misses, no raise
    assert backend.batch_exists_v2(["a" * 64]).kv_hit_pages == 0
    backend.close()


def test_plain_model_attach_passes_the_v2_registration(tier_dirs):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    backend = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:2])),
                                     pools.host)
    backend.register_mem_host_pool_v2(pools.host, PoolName.KV)
    backend.on_host_pools_registered()
    assert backend.engine is not None
    backend.close()


def test_prometheus_metrics(plugin_loaded, tier_dirs, drivers):
    from prometheus_client import REGISTRY

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    tokens, src, got = round_trip(drv, pools, n_pages=4, seed=501)
    drv.storage.flush_metrics()
    labels = drv.storage._exporter.labels
    page = pools.flat_page_nbytes()
    served = sum(REGISTRY.get_sample_value("kvstream:tier_served_bytes_total", dict(labels, tier=str(k))) or 0
                 for k in range(2))
    assert served >= 4 * page
    for k in range(2):
        assert REGISTRY.get_sample_value("kvstream:tier_write_bytes_total", dict(labels, tier=str(k))) >= 4 * page
        assert REGISTRY.get_sample_value("kvstream:tier_healthy", dict(labels, tier=str(k))) == 1
    assert REGISTRY.get_sample_value("kvstream:retrieval_seconds_count", labels) >= 1
    assert REGISTRY.get_sample_value("kvstream:pages_total", dict(labels, result="found")) >= 4


def test_prometheus_metrics_reach_the_registry_without_another_call(plugin_loaded, tier_dirs, drivers, monkeypatch):
    """A batch whose sync fell inside the interval is exported later by itself: an idle sglang server
    (--sleep-on-idle) polls get_stats no more, and a scrape after a burst must not read stale pages."""
    from prometheus_client import REGISTRY

    from kvstream_hicache.sglang import storage

    monkeypatch.setattr(storage, "METRICS_INTERVAL_S", 3.0)
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    labels = drv.storage._exporter.labels

    def found() -> float:
        return REGISTRY.get_sample_value("kvstream:pages_total", dict(labels, result="found")) or 0.0

    start = found()
    round_trip(drv, pools, n_pages=4, seed=511)  # its first sync runs at once
    round_trip(drv, pools, n_pages=4, seed=512)  # within the interval: skipped, owed
    deadline = time.monotonic() + 30.0
    while found() < start + 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert found() >= start + 8, (start, found())
    drv.storage.close()
    assert drv.storage._trailing is None


def test_pages_a_capacity_could_not_take_show_in_the_metrics(plugin_loaded, tier_dirs, drivers):
    """A backup larger than a tier's room: the pages that tier's capacity could not take are skipped there
    (stats()["tiers"][k]["skipped_writes"], docs/guarantees.md), stored nowhere when every tier skipped
    them. On a real server (capacity 3M, a 37-page prompt) 13 of 37 pages were stored on no tier while
    /metrics showed no eviction, no error, nothing under-replicated, and the log said nothing above DEBUG:
    kvstream:tier_skipped_writes_total counts them now (and tier_write_failures_total a write a full tier
    refused)."""
    from prometheus_client import REGISTRY

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    page = pools.flat_page_nbytes()
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2], capacity=str(4 * page)),
                  enable_metrics=True)
    labels = drv.storage._exporter.labels

    def skipped(k: int) -> float | None:
        return REGISTRY.get_sample_value("kvstream:tier_skipped_writes_total", dict(labels, tier=str(k)))

    def failed(k: int) -> float | None:
        return REGISTRY.get_sample_value("kvstream:tier_write_failures_total", dict(labels, tier=str(k)))

    before = [skipped(k) for k in range(2)]
    assert None not in before and None not in [failed(k) for k in range(2)], "no series from the attach"
    tokens = cpu_sglang.random_tokens(6 * PAGE, seed=531)
    drv.backup(tokens, cpu_sglang.fill_random(pools, len(tokens), seed=531))
    drv.storage.flush_metrics()
    stats = drv.storage.stats()["tiers"]
    assert [t["skipped_writes"] for t in stats] == [2, 2]
    assert [skipped(k) - before[k] for k in range(2)] == [2, 2]
    drv.storage.close()


def test_a_backup_larger_than_the_capacity_keeps_the_prefix_sglang_looks_up(plugin_loaded, tier_dirs):
    """SGLang's batch_set pages are one prefix chain and batch_exists counts the leading run. A backup of 6
    pages on tiers of 4 pages' capacity stored pages 2-5 (admission.fit_capacity dropped the batch's first
    pages), so batch_exists answered 0 and the 4 pages stored were never served (a real server with
    capacity 3M: a 37-page prompt, flushed and sent again, had no L3 hit; found by trial metrics)."""
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    page = pools.flat_page_nbytes()
    cfg = cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:2], capacity=str(4 * page)))
    storage = KVStreamHiCacheStorage(cfg, pools.host)
    try:
        keys = cpu_sglang.page_keys(cpu_sglang.random_tokens(6 * PAGE, seed=541), PAGE)
        storage.batch_set_v1(keys, cpu_sglang.fill_random(pools, 6 * PAGE, seed=541))
        assert storage.batch_exists(keys) == 4
    finally:
        storage.close()


def test_a_tier_that_rejoins_while_sglang_is_idle_reaches_its_gauge(plugin_loaded, tier_dirs, drivers, monkeypatch):
    """A failed tier may rejoin with no call of sglang's: the thread that removed what it owed lets it in
    (tiers.py _settle), at a restart on an idle server. While a tier is failed the adapter syncs its
    metrics each interval by itself, so kvstream:tier_healthy says 1 within a second of the rejoin. Before,
    it said 0 until the next request (found by the real server's clear-and-restart test)."""
    from prometheus_client import REGISTRY

    from kvstream_hicache.sglang import storage

    monkeypatch.setattr(storage, "METRICS_INTERVAL_S", 0.2)
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    labels = dict(drv.storage._exporter.labels, tier="1")
    tier = drv.storage.engine.tiers[1]
    assert tier.fail(errno.EIO, "test: an I/O error")
    drv.storage.flush_metrics()
    assert REGISTRY.get_sample_value("kvstream:tier_healthy", labels) == 0
    assert tier.usable(now=True)  # (as the removal's thread does: no call of sglang's)
    deadline = time.monotonic() + 30.0
    while REGISTRY.get_sample_value("kvstream:tier_healthy", labels) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert REGISTRY.get_sample_value("kvstream:tier_healthy", labels) == 1, "the rejoin never reached the gauge"
    drv.storage.close()


@pytest.mark.parametrize("how", ["eio", "unmounted"])
def test_a_failed_tier_is_probed_and_rejoins_on_an_idle_server(plugin_loaded, tier_dirs, drivers, monkeypatch, how):
    """docs/sglang.md: a failed tier is "probed again after tier_retry", and one whose directory vanished
    and is back rejoins within a second. On a real idle server (--sleep-on-idle, no request) nothing probed
    it: a loop-device tier unmounted (lazily), a page written, mounted again, stayed failed in the gauge
    and its 15 owed replicas pending for a minute, until the next request. The metrics timer that runs
    while a tier is failed now probes it when due: no call of sglang's here at all."""
    from prometheus_client import REGISTRY

    from kvstream_hicache.sglang import storage

    monkeypatch.setattr(storage, "METRICS_INTERVAL_S", 0.2)
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    labels = dict(drv.storage._exporter.labels, tier="1")
    tier = drv.storage.engine.tiers[1]
    away = tier_dirs[1] + ".away"
    if how == "unmounted":  # (the directory gone, as a lazy umount leaves it, then back)
        os.rename(tier_dirs[1], away)
        assert tier.fail(errno.ENOENT, "test: the tier's directory is gone")
    else:
        assert tier.fail(errno.EIO, "test: an I/O error")
    drv.storage.flush_metrics()
    assert REGISTRY.get_sample_value("kvstream:tier_healthy", labels) == 0
    if how == "unmounted":
        os.rename(away, tier_dirs[1])
    deadline = time.monotonic() + 10.0
    while REGISTRY.get_sample_value("kvstream:tier_healthy", labels) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert REGISTRY.get_sample_value("kvstream:tier_healthy", labels) == 1, "the idle server never probed the tier"
    assert tier.healthy
    drv.storage.close()


def test_the_metrics_timers_probe_lets_no_tier_of_a_closed_backend_rejoin(plugin_loaded, tier_dirs, drivers,
                                                                           monkeypatch, caplog):
    """The metrics timer probes a failed tier by itself (an idle server), on its own thread, which sglang's
    detach does not stop (it stops its storage threads, then closes the backend): a probe that was on its
    way when the backend closed let the tier of the closed engine rejoin, and the engine's rejoin ran after
    close() (Engine._reconcile: its record of owed clears rewritten, a thread listing the tier's pages),
    logged "recovered; it rejoins reads and writes" after the detach. Held here inside the probe until the
    engine is closed (the window is as long as the probe: write_timeout on a network tier). Review rev2."""
    from kvstream_hicache.sglang import storage as storage_module

    monkeypatch.setattr(storage_module, "METRICS_INTERVAL_S", 0.2)
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    engine = drv.storage.engine
    tier = engine.tiers[1]
    probing = threading.Event()
    probe, rejoin, rejoined_after_close = tier._probe, tier.on_rejoin, []

    def held_probe():  # (the timer's probe, begun while the backend was attached, ends once it is closed)
        if threading.current_thread().name == "kvstream-metrics" and not probing.is_set():
            probing.set()
            wait_until(lambda: engine._closed, timeout=30)
        return probe()

    def noted_rejoin(t):
        if engine._closed:
            rejoined_after_close.append(t.k)
        return rejoin(t)

    monkeypatch.setattr(tier, "_probe", held_probe)
    monkeypatch.setattr(tier, "on_rejoin", noted_rejoin)
    assert tier.fail(errno.EIO, "test: an I/O error")
    drv.storage.flush_metrics()  # (a sync that sees the tier failed arms the timer)
    assert probing.wait(30), "the metrics timer never probed the failed tier"
    caplog.set_level(logging.WARNING, logger="kvstream")
    drv.close()  # sglang's detach
    for thread in threading.enumerate():
        if thread.name == "kvstream-metrics":
            thread.join(30)
    assert rejoined_after_close == [], "the closed engine's tier rejoined after the detach"
    assert not tier.healthy
    assert not [r for r in caplog.records if "recovered" in r.getMessage()], caplog.text


def test_a_probe_that_raises_in_the_metrics_timer_does_not_end_its_syncs(plugin_loaded, tier_dirs, drivers,
                                                                         monkeypatch):
    """The metrics timer's probe and its sync shared one ``try``: an exception of the probe (a rejoin that cannot
    start its thread: RuntimeError "can't start new thread" in a process at its thread limit) skipped the sync,
    which is what arms the next turn: on an idle server the failed tier was never probed again, its gauge never
    moved, for good (one "exporting metrics failed" line). Review rev2."""
    from prometheus_client import REGISTRY

    from kvstream_hicache.sglang import storage as storage_module

    monkeypatch.setattr(storage_module, "METRICS_INTERVAL_S", 0.2)
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    labels = dict(drv.storage._exporter.labels, tier="1")
    tier = drv.storage.engine.tiers[1]
    rejoin, raised = tier.on_rejoin, []

    def rejoin_once_refused(t):
        if not raised:
            raised.append(t.k)
            raise RuntimeError("can't start new thread")
        return rejoin(t)

    monkeypatch.setattr(tier, "on_rejoin", rejoin_once_refused)
    assert tier.fail(errno.EIO, "test: an I/O error")
    drv.storage.flush_metrics()
    wait_until(lambda: raised, timeout=30, what="the metrics timer never probed the failed tier")
    deadline = time.monotonic() + 10.0
    while REGISTRY.get_sample_value("kvstream:tier_healthy", labels) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert REGISTRY.get_sample_value("kvstream:tier_healthy", labels) == 1, "no probe after the one that raised"
    assert drv.storage.counters["metrics_errors"] == 1


def test_a_trailing_metrics_sync_racing_close_counts_no_page_twice(plugin_loaded, tier_dirs, drivers, monkeypatch):
    """While a tier is failed the adapter syncs its metrics by itself each interval (a timer thread). One
    such sync that found the engine attached, then read the stats after close() detached it
    (``self.stats()`` reads ``self.engine`` again: None), exports a snapshot with no totals: the exporter
    takes it as its new baseline (``_last_totals = {}``), and close()'s own final sync then adds every page
    ever found again: kvstream:pages_total{result="found"} doubles at a detach. Held here at that point
    (the window is the timer thread's, between its ``self.engine is None`` test and its ``self.stats()``).
    Now it reads the engine once. From the review of this stop's latest changes."""
    from prometheus_client import REGISTRY

    from kvstream_hicache.sglang import storage as storage_module

    monkeypatch.setattr(storage_module, "METRICS_INTERVAL_S", 0.2)
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    st = drv.storage
    labels = dict(st._exporter.labels, result="found")

    def found() -> float:
        return REGISTRY.get_sample_value("kvstream:pages_total", labels) or 0.0

    start = found()
    round_trip(drv, pools, n_pages=4, seed=601)
    st.flush_metrics()
    after = found()
    assert after >= start + 4
    in_sync = threading.Event()
    stats, stats_of = st.stats, st._stats_of

    def hold():  # the first stats read of the timer thread waits until close() has detached the engine
        if threading.current_thread().name == "kvstream-metrics" and not in_sync.is_set():
            in_sync.set()
            deadline = time.monotonic() + 30
            while st.engine is not None and time.monotonic() < deadline:
                time.sleep(0.005)

    def held_stats():
        hold()
        return stats()

    def held_stats_of(engine):
        hold()
        return stats_of(engine)

    monkeypatch.setattr(st, "stats", held_stats)
    monkeypatch.setattr(st, "_stats_of", held_stats_of)
    assert st.engine.tiers[1].fail(errno.EIO, "test: an I/O error")
    st.flush_metrics()  # a tier is failed: the next sync is armed by itself
    assert in_sync.wait(30), "no trailing sync while a tier was failed"
    st.close()
    assert found() == after, f"pages found counted again at close: {after} -> {found()}"


def test_context_parallel_ranks_of_one_dp_group_export_apart(plugin_loaded, tier_dirs):
    """Under attention DP sglang's storage config carries the attention-TP rank as tp_rank and the
    attention-DP rank as dp_rank (cache_controller, runtime_context.derive_attention_ranks): the
    context-parallel ranks of one DP group share all three, while their engines are apart (the namespace
    has the CP rank). Labelled with those three alone, their series were one: tier 1 failed on CP rank 1
    only, and the gauge said whatever rank synced last. SGLang labels its own storage metrics with
    attn_cp_rank; so does kvstream now."""
    import dataclasses

    from prometheus_client import REGISTRY

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    base = cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:2]))
    base.enable_storage_metrics = True
    ranks = [KVStreamHiCacheStorage(dataclasses.replace(base, attn_cp_rank=r, attn_cp_size=2), pools.host)
             for r in (0, 1)]
    try:
        labels = [dict(st._exporter.labels) for st in ranks]
        assert labels[0] != labels[1], f"both CP ranks export as {labels[0]}"
        assert ranks[1].engine.tiers[1].fail(errno.EIO, "test: an I/O error")
        for st in reversed(ranks):  # (rank 0 last: its healthy tier 1 would hide rank 1's failed one)
            st.flush_metrics()
        healthy = [REGISTRY.get_sample_value("kvstream:tier_healthy", dict(lbl, tier="1")) for lbl in labels]
        assert healthy == [1, 0]
    finally:
        for st in ranks:
            st.close()


def test_prometheus_multiprocess_mode(tmp_path):
    """As in an sglang server: PROMETHEUS_MULTIPROC_DIR set before prometheus_client is imported, samples
    written by the scheduler process are aggregated by the /metrics collector."""
    from sglang_fixtures import run_python

    code = (
        "from kvstream_hicache.sglang.metrics import Exporter\n"
        "e = Exporter({'tp_rank': '0', 'dp_rank': '0', 'pp_rank': '0', 'attn_cp_rank': '0'}, ['/t0', '/t1'])\n"
        "o = Exporter({'tp_rank': '1', 'dp_rank': '0', 'pp_rank': '0', 'attn_cp_rank': '0'}, ['/t0'])\n"
        "e.sync({'tiers': [{'bytes_served': 300, 'read_share': 0.75, 'healthy': True},"
        " {'bytes_served': 100, 'read_share': 0.25, 'healthy': False, 'replica_skipped_pages': 3,"
        " 'replica_skipped_bytes': 12288, 'replication_done': 2, 'replication_pending': 5}], 'pages_found': 4,"
        " 'routed_calls': 5, 'held_calls': 3})\n"
        "e.observe_read({'time_s': 0.01, 'bound_s': 0.008, 'gap': 0.25}, 0.01)\n"
        "from prometheus_client import CollectorRegistry, generate_latest, multiprocess\n"
        "r = CollectorRegistry(); multiprocess.MultiProcessCollector(r)\n"
        "print(generate_latest(r).decode())\n"
    )
    proc = run_python(code, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, timeout=60)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr
    ranks = 'attn_cp_rank="0",dp_rank="0",pp_rank="0"'  # (sorted, as the collector writes them)
    assert f'kvstream:tier_served_bytes_total{{{ranks},tier="0",tp_rank="0"}} 300.0' in out, out
    assert f'kvstream:tier_healthy{{{ranks},tier="1",tp_rank="0"}} 0.0' in out, out
    assert f'kvstream:retrieval_gap_count{{{ranks},tp_rank="0"}} 1.0' in out, out
    assert f'kvstream:tier_replica_skips_total{{{ranks},tier="1",tp_rank="0"}} 3.0' in out, out
    assert f'kvstream:tier_replica_skip_bytes_total{{{ranks},tier="1",tp_rank="0"}} 12288.0' in out, out
    assert f'kvstream:tier_replication_done_total{{{ranks},tier="1",tp_rank="0"}} 2.0' in out, out
    assert f'kvstream:tier_replication_pending{{{ranks},tier="1",tp_rank="0"}} 5.0' in out, out
    assert f'kvstream:read_calls_total{{{ranks},rule="held",tp_rank="0"}} 3.0' in out, out
    assert f'kvstream:read_calls_total{{{ranks},rule="open",tp_rank="0"}} 2.0' in out, out
    # a backend whose read calls chose no rule yet (one tier) has the series at 0: 0 is an answer
    assert f'kvstream:read_calls_total{{{ranks},rule="held",tp_rank="1"}} 0.0' in out, out
    assert any(f.name.startswith("counter_") for f in tmp_path.iterdir())


def test_host_indices_outside_the_pool_are_misses_never_memory_writes(tier_dirs):
    """host_indices past the end of the host pool, negative, 2**40 or straddling its end: each such page
    is a miss (with a warning and a counter) before any address is formed from it; the good pages of the
    batch are stored and read. In a child process: an address formed from 2**40 crashes the interpreter."""
    from sglang_fixtures import run_python

    code = f"""
import json, torch
from kvstream_hicache.tools import cpu_sglang
cpu_sglang.install_stubs()
from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage
P = {PAGE}
pools = cpu_sglang.make_pools("mha", "page_first", page_size=P)
backend = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config={{"tiers": {tier_dirs[:2]!r}}}),
                                 pools.host)
size = pools.host.size
tokens = cpu_sglang.random_tokens(2 * P, seed=81)
keys = cpu_sglang.page_keys(tokens, P)
src = cpu_sglang.fill_random(pools, len(tokens), seed=81)
def at(start):
    return torch.arange(start, start + P, dtype=torch.int64)
bad = [at(size), at(-P), at(2 ** 40), at(size - P // 2)]
bad_keys = [c * 64 for c in "abcd"]
out = {{}}
out["set"] = backend.batch_set_v1([keys[0]] + bad_keys + [keys[1]], torch.cat([src[:P]] + bad + [src[P:]]))
out["exists"] = backend.batch_exists(keys)
dst = pools.alloc(2 * P)
out["get"] = backend.batch_get_v1([keys[0]] + bad_keys + [keys[1]], torch.cat([dst[:P]] + bad + [dst[P:]]))
out["bytes"] = pools.page_bytes(dst) == pools.page_bytes(src)
out["float"] = backend.batch_get_v1(keys[:1], dst[:P].to(torch.float32))
out["counters"] = backend.counters
backend.close()
print("RESULT " + json.dumps(out))
"""
    proc = run_python(code, timeout=180)
    assert proc.returncode == 0, f"the child died ({proc.returncode}): {proc.stderr[-3000:]}"
    import json

    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["set"] == [True, False, False, False, False, True]
    assert out["exists"] == 2
    assert out["get"] == [True, False, False, False, False, True] and out["bytes"]
    assert out["float"] == [False]
    assert out["counters"]["bad_host_indices"] == 8 and out["counters"]["bad_arguments"] == 1
    assert out["counters"]["errors"] == 0
    assert "outside the host pool" in proc.stderr


def test_a_capacity_smaller_than_one_page_is_refused_at_attach(tier_dirs):
    """A capacity that holds no page of this pool would make every backup a silent miss: the attach
    fails, naming the setting, the page size and the fix."""
    from kvstream_hicache.errors import ConfigError

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    half = pools.flat_page_nbytes() // 2  # capacity counts payload bytes: half a page holds none
    config = cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:2], capacity=half))
    with pytest.raises(ConfigError) as info:
        KVStreamHiCacheStorage(config, pools.host)
    message = str(info.value)
    assert "extra config 'capacity'" in message and "less than one page" in message
    assert str(pools.flat_page_nbytes()) in message and "leave it empty for unlimited" in message


def _engines_with(monkeypatch, plan):
    from kvstream_hicache.engine import Engine

    monkeypatch.setattr(KVStreamHiCacheStorage, "_open_engine",
                        lambda self, ns: Engine(self.config, ns, fault_plan=plan, page_bytes=self._page_bytes))


@pytest.mark.parametrize("n_tiers", [1, 2])
def test_an_mla_reader_rank_finds_pages_again_after_a_transient_read_error(plugin_loaded, tier_dirs, drivers,
                                                                            monkeypatch, n_tiers):
    """MLA with TP 2: rank 1 is not a storage writer, so sglang never calls its batch_set_v1 (backup_skip);
    its calls are batch_exists then batch_get_v1. One EIO per tier during a prefetch fails its tiers
    (a miss: fine). The fault is gone, the pages are intact on disk and tier_retry (0.2 s) passes many
    times over; docs/guarantees.md: "After `tier_retry` seconds ... the next call probes it ... when that
    works it rejoins". But batch_exists (Engine.prefix_len) answers from the healthy tiers without
    probing, and no get or put ever comes on this rank: it answers 0 for ever, and since sglang
    all-reduces the hit count with MIN over the TP ranks, the whole server loses its L3 until restart."""
    plan = TierFaultPlan()
    _engines_with(monkeypatch, plan)
    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    extra = tiers_config(tier_dirs[:n_tiers])  # tier_retry 0.2 s
    tokens = cpu_sglang.random_tokens(4 * PAGE, seed=41)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=41)
    rank0 = drivers(pools, "kvstream", extra_config=extra, tp_rank=0, tp_size=2)
    assert rank0.backup(tokens, src) == len(tokens)
    rank0.close()

    rank1 = drivers(pools, "kvstream", extra_config=extra, tp_rank=1, tp_size=2)
    assert rank1.controller.backup_skip  # sglang never writes through this rank
    got = rank1.prefetch(tokens)
    assert got.tokens == len(tokens)
    pools.free(got.host_indices)

    for d in tier_dirs[:n_tiers]:  # one read error per tier, then the tiers are fine again
        plan.on(d, Fault.error(errno.EIO), opcode=OP_READ, times=1)
    got = rank1.prefetch(tokens)
    pools.free(got.host_indices)
    assert rank1.threads_alive()

    hits = []
    for _ in range(10):  # 2.5 s: more than 10x tier_retry
        time.sleep(0.25)
        hits.append(rank1.query(tokens))
        if hits[-1] == len(tokens):
            break
    healthy = [t["healthy"] for t in rank1.storage.stats()["tiers"]]
    assert hits[-1] == len(tokens), (
        f"rank 1's hit query after the fault: {hits} tokens of {len(tokens)}; tiers healthy: {healthy}")
    got = rank1.prefetch(tokens)
    assert got.tokens == len(tokens) and pools.page_bytes(got.host_indices) == pools.page_bytes(src)


def test_a_detach_exports_the_counts_of_its_last_batches(plugin_loaded, tier_dirs, drivers, monkeypatch):
    """sglang's /detach_hicache_storage_backend (HiCacheController.detach_storage_backend) closes the
    backend. Pages read within the last METRICS_INTERVAL_S before it were counted by the engine but
    their Prometheus increments were only owed (the trailing sync): close() cancels that sync and
    never exports them, so kvstream:pages_total / tier_served_bytes_total undercount for good
    (metrics.py: backends of one process, detach / re-attach, are meant to add up)."""
    from prometheus_client import REGISTRY

    from kvstream_hicache.sglang import storage

    monkeypatch.setattr(storage, "METRICS_INTERVAL_S", 60.0)  # (the window is 1 s by default; widened here)
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    labels = dict(drv.storage._exporter.labels)

    def found() -> float:
        return REGISTRY.get_sample_value("kvstream:pages_total", dict(labels, result="found")) or 0.0

    start = found()
    for seed in (601, 602):  # the first batch is exported at once, the second is owed
        tokens = cpu_sglang.random_tokens(4 * PAGE, seed=seed)
        src = cpu_sglang.fill_random(pools, len(tokens), seed=seed)
        assert drv.backup(tokens, src) == len(tokens)
        got = drv.prefetch(tokens)
        assert got.tokens == len(tokens)
    backend = drv.storage
    assert backend.stats()["pages_found"] == 8
    drv.close()  # sglang's detach path: backend.close()
    assert found() - start == 8, f"pages_total{{found}} grew by {found() - start} for 8 pages read"


def test_a_prefetch_batch_the_engine_never_read_adds_no_retrieval_sample(plugin_loaded, tier_dirs, drivers):
    """docs/sglang.md section 7: ``kvstream:retrieval_seconds`` is the "time of one read batch" and
    ``kvstream:retrieval_bound_seconds_total`` the "sum of the batches' bound". A prefetch whose pages all
    have host slots outside the pool is answered by the adapter without an engine read, and changes
    neither (before: the adapter observed ``engine.last_batch``, the *previous* batch, so that batch was
    counted twice, its time observed again, its bound added again; found by the review of what an
    operator sees)."""
    import torch
    from prometheus_client import REGISTRY

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]), enable_metrics=True)
    tokens, _src, got = round_trip(drv, pools, n_pages=4, seed=911)
    assert got.tokens == len(tokens)
    storage = drv.storage
    labels = dict(storage._exporter.labels)

    def samples():
        return (REGISTRY.get_sample_value("kvstream:retrieval_seconds_count", labels) or 0,
                REGISTRY.get_sample_value("kvstream:retrieval_seconds_sum", labels) or 0,
                REGISTRY.get_sample_value("kvstream:retrieval_bound_seconds_total", labels) or 0)

    storage.flush_metrics()
    before = samples()
    assert storage.engine.last_batch.get("bound_s"), "the round trip's read has a bound"
    keys = cpu_sglang.page_keys(tokens, PAGE)
    size = pools.host.size
    outside = torch.cat([torch.arange(size + i * PAGE, size + (i + 1) * PAGE, dtype=torch.int64)
                         for i in range(len(keys))])
    assert storage.batch_get_v1(keys, outside) == [False] * len(keys)  # every page a miss, no engine read
    storage.flush_metrics()
    after = samples()
    assert after == before, f"a batch the engine never read changed retrieval metrics: {before} -> {after}"


def test_a_legacy_set_ended_by_ctrl_c_never_stores_the_tensor_the_caller_reused(tier_dirs, monkeypatch):
    """A script's legacy ``set`` (on its main thread) ended by Ctrl-C while the page waits in the write
    queue (a legacy get reads the tier: read priority holds the write back). The adapter turns errors
    into misses, not an interrupt: the KeyboardInterrupt reaches the script, which reuses its tensor
    for other KV. The key never serves those bytes: the engine's put withdraws its pages before it
    raises. Before, the writer wrote the reused tensor under the key and the next get served it."""
    import torch

    plan = FaultPlan()
    _engines_with(monkeypatch, plan)
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    backend = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:1])),
                                     pools.host)
    n = pools.flat_page_nbytes()
    a, b = "a" * 64, "b" * 64
    value_a = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    value_b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    expected = value_b.clone()
    inside = threading.Event()  # SIGINT raises KeyboardInterrupt only during the set (never into pytest)

    def on_sigint(signum, frame):
        if inside.is_set():
            raise KeyboardInterrupt

    default = signal.signal(signal.SIGINT, on_sigint)
    try:
        assert backend.set(a, value_a) is True
        plan.add(Fault.hold(), opcode=OP_READ, times=1)
        reader = threading.Thread(target=backend.get, args=(a, torch.empty_like(value_a)))
        reader.start()
        wait_for_fault(plan, what="the get never submitted its read")
        interrupted = threading.Event()

        def press():
            wait_until(lambda: backend.engine._writes.queue.fifo[0], what="the set never queued its page")
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            interrupted.wait(10)
            plan.release()

        threading.Thread(target=press).start()
        inside.set()
        with pytest.raises(KeyboardInterrupt):
            backend.set(b, value_b)
        inside.clear()
        value_b.fill_(0x5A)  # the call raised: the script's tensor holds other KV now
        interrupted.set()
        reader.join(60)
        assert not reader.is_alive()
        wait_until(lambda: not backend.engine._writes.queue.pending, what="the queue never drained")
        got = backend.get(b, torch.empty_like(value_b))
        assert got is None or torch.equal(got, expected), (
            f"the key serves the tensor the script reused after set raised: {got[:8].tolist()}")
    finally:
        signal.signal(signal.SIGINT, default)
        plan.release()
        backend.close()


def test_batch_exists_and_get_stats_while_a_tier_hangs_return_by_read_timeout(tier_dirs, fuse_tier):
    """SGLang's prefetch thread asks batch_exists for every request; its first key the index lacks is
    looked up on every tier (discovery). On a network tier whose server stopped answering (FUSE, SIGSTOP)
    with write_timeout=0 ("wait for ever" for writes), that look is bounded by read_timeout: batch_exists
    answers 0 hit pages, and get_stats (a metrics poll) touches no tier. Before, the look ran in place:
    the scheduler's prefetch thread waited as long as the server. From the review of hung tiers' entry
    points."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    network, daemon = fuse_tier
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    extra = tiers_config([tier_dirs[0], network], write_timeout=0, read_timeout=0.5, tier_retry=600)
    backend = KVStreamHiCacheStorage(cpu_sglang.storage_config(pools, extra_config=extra), pools.host)
    got = []
    try:
        backend.register_mem_host_pool_v2(pools.host, PoolName.KV)
        backend.on_host_pools_registered()
        assert backend.engine.wait_scan(60)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            time.sleep(2)  # (past FUSE's 1 s attribute cache)
            asking = threading.Thread(target=lambda: got.append((backend.batch_exists(["b" * 64, "c" * 64]),
                                                                 backend.get_stats())), daemon=True)
            asking.start()
            asking.join(20)
            assert not asking.is_alive(), "batch_exists waited for the hung tier past read_timeout"
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        asking.join(20)
    finally:
        backend.close()
    assert got and got[0][0] == 0, got
