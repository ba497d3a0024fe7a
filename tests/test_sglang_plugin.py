"""The sglang plugin: CLI acceptance through sglang's own argv parsing, registration, import-lightness,
and the two construction paths (plugin factory, ``dynamic`` loader)."""

from __future__ import annotations

import json
import textwrap

import pytest

from sglang_fixtures import PAGE, cpu_sglang, drivers, plugin_loaded, run_python, tiers_config  # noqa: F401 (fixtures)

ARGV = ["--model-path", "dummy", "--enable-hierarchical-cache", "--page-size", "64",
        "--hicache-storage-backend", "kvstream"]

CLI = textwrap.dedent("""
    import json, sys
    from kvstream_hicache.tools import cpu_sglang
    cpu_sglang.install_stubs()
    from sglang.srt.server_args import prepare_server_args
    argv = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {argv!r}
    out = {{}}
    try:
        prepare_server_args(argv)
        out["before_load"] = "accepted"
    except SystemExit as exc:
        out["before_load"] = f"exit {{exc.code}}"
    from sglang.srt.plugins import load_plugins
    load_plugins()
    out["cache_controller_imported"] = "sglang.srt.managers.cache_controller" in sys.modules
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    out["registered"] = "kvstream" in StorageBackendFactory._registry
    try:
        args = prepare_server_args(argv)
        out["after_load"] = args.hicache_storage_backend
    except SystemExit as exc:
        out["after_load"] = f"exit {{exc.code}}"
    print("RESULT " + json.dumps(out))
""").format(argv=ARGV)


def _result(proc) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_cli_accepts_kvstream_only_after_load_plugins():
    """sglang's argparse rejects the name until load_plugins() runs kvstream's entry point; then accepts it,
    without the plugin importing the (slow) cache controller module."""
    out = _result(run_python(CLI))
    assert out["before_load"] == "exit 2"
    assert out["registered"] is True
    assert out["after_load"] == "kvstream"
    assert out["cache_controller_imported"] is False


def test_cli_rejects_kvstream_when_plugin_disabled():
    """SGLANG_PLUGINS whitelisting another plugin disables ours: the name stays invalid."""
    out = _result(run_python(CLI, env={"SGLANG_PLUGINS": "some-other-plugin"}))
    assert out["registered"] is False
    assert out["before_load"] == "exit 2"
    assert out["after_load"] == "exit 2"


@pytest.mark.parametrize("module", ["kvstream_hicache.sglang.plugin", "kvstream_hicache.plugin"])
def test_plugin_module_is_import_light(module):
    proc = run_python(f"import sys, {module} as p; "
                      "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang', 'numpy')))")
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr


def test_factory_builds_kvstream_and_controller_goes_zero_copy(plugin_loaded, tier_dirs, drivers):
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    drv = drivers(pools, "kvstream", extra_config=tiers_config(tier_dirs[:2]))
    assert isinstance(drv.storage, KVStreamHiCacheStorage)
    assert drv.zero_copy, "the plugin must switch the controller to batch_get_v1/batch_set_v1"
    assert drv.storage.mem_pool_host is pools.host


@pytest.mark.parametrize("module_path", ["kvstream_hicache.sglang.storage", "kvstream_hicache.hicache"],
                         ids=["module", "old-module-path"])
@pytest.mark.parametrize("interface_v1", [1, 0])
def test_dynamic_spelling(tier_dirs, drivers, interface_v1, module_path):
    """The no-plugin fallback: sglang's `dynamic` loader calls KVStreamHiCacheStorage(storage_config, {}),
    found under the module path the configuration names (the old one included)."""
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    extra = tiers_config(tier_dirs[:2], backend_name="kvstream", module_path=module_path,
                         class_name="KVStreamHiCacheStorage", interface_v1=interface_v1)
    drv = drivers(pools, "dynamic", extra_config=extra)
    assert drv.zero_copy == bool(interface_v1)
    tokens = cpu_sglang.random_tokens(3 * PAGE, seed=5)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=5)
    assert drv.backup(tokens, src) == len(tokens)
    got = drv.prefetch(tokens)
    assert got.tokens == len(tokens)
    assert pools.page_bytes(got.host_indices) == pools.page_bytes(src)
    assert (drv.storage.counters["legacy_calls"] > 0) == (not interface_v1)


def test_bad_extra_config_fails_the_attach_with_the_key_named(plugin_loaded, tier_dirs):
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    with pytest.raises(ValueError, match="tier_dirs"):
        cpu_sglang.ControllerDriver(pools, "kvstream", extra_config={"tiers": tier_dirs[:1], "tier_dirs": "x"})


def test_constructor_paths_and_idempotent_close(tier_dirs):
    """Both factory shapes; close twice; calls after close answer misses without raising."""
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    pools = cpu_sglang.make_pools("mla", "page_first", page_size=PAGE)
    cfg = cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:2]))
    a = KVStreamHiCacheStorage(cfg, pools.host)  # plugin factory path: pool given up front
    a.register_mem_pool_host(pools.host)  # sglang registers it again: a no-op
    b = KVStreamHiCacheStorage(cfg, {})  # dynamic path: pool registered later
    assert b.engine is None
    b.register_mem_pool_host(pools.host)
    assert b.engine is not None and b.namespace == a.namespace
    for backend in (a, b):
        backend.close()
        backend.close()
        idx = pools.alloc(PAGE)
        assert backend.batch_get_v1(["a" * 64], idx) == [False]
        assert backend.batch_exists(["a" * 64]) == 0
        assert backend.exists("a" * 64) is False
        pools.free(idx)


def test_docs_list_every_setting_and_sglang_key():
    """docs/sglang.md documents every extra-config key the engine accepts and every sglang key we pass over."""
    from pathlib import Path

    from kvstream_hicache.config import SETTINGS, env_name
    from kvstream_hicache.sglang.storage import SGLANG_KEYS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "sglang.md").read_text()
    for key in SETTINGS:
        assert f"`{key}`" in doc and f"`{env_name(key)}`" in doc, key
    for key in SGLANG_KEYS - {"tp_lcm_size"}:  # tp_lcm_size is popped by sglang before it reaches a backend
        assert f"`{key}`" in doc, key


@pytest.mark.parametrize("tp_rank,layout,mode", [(0, "page_first", "zero-copy"), (0, "layer_first", "zero-copy"),
                                                 (1, "page_first", None)])
def test_startup_line_logged_once_on_rank0(tier_dirs, caplog, tp_rank, layout, mode):
    import logging

    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    pools = cpu_sglang.make_pools("mha", layout, page_size=PAGE)
    cfg = cpu_sglang.storage_config(pools, tp_rank=tp_rank, tp_size=2, extra_config=tiers_config(tier_dirs[:2]))
    with caplog.at_level(logging.INFO, logger="kvstream"):
        backend = KVStreamHiCacheStorage(cfg, pools.host)
        backend.register_mem_pool_host(pools.host)  # sglang's second registration logs nothing more
        backend.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    if mode is None:
        assert lines == []
        return
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("kvstream: 2 tiers [")
    for part in ("policy kvstream", "io ", f"layout {layout} MHA bfloat16 page {PAGE}", mode, "namespace "):
        assert part in line, (part, line)


@pytest.mark.parametrize("page_size,mode", [(PAGE, "zero-copy (reads of single-tier pages in place)"),
                                            (PAGE // 2, "staged (host pages not 4096-aligned")])
def test_startup_line_of_a_layer_first_pool_says_how_its_pages_move(tier_dirs, page_size, mode):
    """A layer_first page is 2 pieces per layer. With 64-token pages (and here 16: 16 x 2 heads x 64 x 2 B) each
    piece is 4096-aligned: the engine writes them with O_DIRECT from the host pool and reads them into it in
    place (the pool is one registered buffer), yet the start-up line said "staged (host pages not
    4096-aligned: bounce buffers)" for every layer_first pool (sglang's is_stride_page_aligned answers False
    for that layout whatever the geometry); found by a trial of --hicache-mem-layout on a real server. Pieces
    of 2048 bytes (8-token pages) are staged, and the line says so."""
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    pools = cpu_sglang.make_pools("mha", "layer_first", page_size=page_size)
    cfg = cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:1]))
    backend = KVStreamHiCacheStorage(cfg, pools.host)
    try:
        keys = [f"{i:064x}" for i in range(4)]
        idx = pools.alloc(4 * page_size)
        assert backend.batch_set_v1(keys, idx) == [True] * 4
        assert backend.batch_get_v1(keys, idx) == [True] * 4
        in_place = backend.stats()["tiers"][0]["bytes_in_place"]
        line = backend.startup_line()
    finally:
        backend.close()
    assert mode in line, line
    assert (in_place > 0) == mode.startswith("zero-copy"), (in_place, line)


def test_a_tp_servers_configuration_warnings_are_logged_once_by_rank_0(tier_dirs, caplog, monkeypatch):
    """A TP server's ranks read one configuration: a KVSTREAM_* typo and two tiers on one file system are the
    same facts on every rank. docs/sglang.md says each is one warning; a real `launch_server --tp 2` logged
    "tiers ... are on the same file system" once per rank (TP0 and TP1: 8 lines at TP 8), and so the typo's.
    Rank 0 warns, as it logs the start-up line; the other ranks say it at DEBUG."""
    import logging

    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    monkeypatch.setenv("KVSTREAM_CAPACTIY", "1G")
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    with caplog.at_level(logging.DEBUG, logger="kvstream"):
        for rank in (0, 1):
            cfg = cpu_sglang.storage_config(pools, tp_rank=rank, tp_size=2, extra_config=tiers_config(tier_dirs[:2]))
            KVStreamHiCacheStorage(cfg, pools.host).close()
    for what in ("KVSTREAM_CAPACTIY", "are on the same file system"):
        said = [r for r in caplog.records if what in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG], (what, [r.getMessage() for r in said])


def test_the_replicas_of_a_dp_server_are_told_apart_in_metrics_and_start_up(tier_dirs, caplog):
    """`launch_server --dp 2` (no attention DP): sglang hands every replica's backend dp_rank 0 in its storage
    config (attention ranks only); the replica is get_parallel().dp_rank, which sglang's own scheduler
    metrics label. Found on a real `--dp 2` server on this CPU: both replicas exported kvstream's series under
    one label set, so the gauges (multiprocess "mostrecent": tier_healthy, tier_read_share, ...) of one
    replica hid the other's (a tier failed on DP1 read healthy while DP0 wrote last), and both logged the
    start-up line (and the configuration's warnings) at INFO."""
    import logging

    from sglang.srt.runtime_context import get_parallel

    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    labels = []
    with caplog.at_level(logging.INFO, logger="kvstream"):
        for replica in (0, 1):
            cfg = cpu_sglang.storage_config(pools, extra_config=tiers_config(tier_dirs[:1]), enable_metrics=True)
            with get_parallel().override(dp_rank=replica, tp_rank=0, tp_size=1):
                backend = KVStreamHiCacheStorage(cfg, pools.host)
            labels.append(backend._exporter.labels)
            backend.close()
    assert [lbl["dp_rank"] for lbl in labels] == ["0", "1"], labels
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "namespace" in r.getMessage()]
    assert len(lines) == 1, lines
