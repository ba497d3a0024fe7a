"""CI smoke tests of the ``kvstream`` command: ``bench`` on plain temporary directories (no throttling,
a few small pages), ``check`` and ``info`` on what it leaves, ``testbed status`` when none is up.
They prove the command runs end to end and writes its outputs; the figures themselves mean nothing here."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from kvstream_hicache.tools import cli

SMALL = ["--page-bytes", "65536", "--batch", "4", "--batches", "2", "--warmup", "0", "--no-progress",
         "--verify", "-1"]


def _bench(tmp_path, dirs, policies, *extra):
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", *dirs, *SMALL, "--policies", policies, "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_engine_policies_json_plot_series(tmp_path, tier_dirs):
    plot, series = tmp_path / "bench.png", tmp_path / "series.json"
    # 32 pages per batch: enough for each tier to read the >= gap.MIN_TIER_PAGES that measure it alone
    doc = _bench(tmp_path, tier_dirs[:2], "kvstream,static-0.5,tier0", "--plot", str(plot), "--series", str(series),
                 "--batch", "32")
    assert doc["bound_gbps"] > 0
    assert set(doc["policies"]) == {"kvstream", "static-0.5", "tier0"}
    for name, p in doc["policies"].items():
        assert p["batches"] == 2 and p["missing_pages"] == 0
        assert p["throughput_gbps"] > 0 and p["gap"] is not None
        assert len(p["share"]) == 2 and sum(p["share"]) == pytest.approx(1.0)
    assert doc["policies"]["tier0"]["share"] == [1.0, 0.0]
    assert doc["wrong_pages"] == {}
    assert doc["write"]["replicated_s"] > 0 and set(doc["write"]["single_tier"]) == {"tier0", "tier1"}
    assert plot.stat().st_size > 0
    tiers = json.loads(series.read_text())["tiers"]
    assert len(tiers) == 2 and len(tiers[0]["t"]) == len(tiers[0]["bps"])
    from kvstream_hicache.tools.sim.bandwidth import load_recorded

    reads, _ = load_recorded(str(series))  # kvsim reads it as recorded tier bandwidth
    assert len(reads) == 2
    assert not any(os.listdir(d) for d in tier_dirs[:2])  # the bench removed its pages


def test_bench_three_tiers_and_check_of_what_it_leaves(tmp_path, tier_dirs, capsys):
    doc = _bench(tmp_path, tier_dirs, "kvstream", "--keep-data", "--write-baseline", "none")
    assert len(doc["policies"]["kvstream"]["share"]) == 3
    bench_dirs = [os.path.join(d, "kvstream-bench") for d in tier_dirs]
    capsys.readouterr()
    assert cli.main(["check", "--tiers", *bench_dirs]) == 0
    assert "no problems" in capsys.readouterr().out
    assert cli.main(["info", "--tiers", *bench_dirs]) == 0
    out = capsys.readouterr().out
    assert "tier0" in out and "tier2" in out
    claim = next(line for line in out.splitlines() if line.split()[:1] == ["claim"])
    assert claim.split()[1] == "2" and "m of policy 'kvstream'" in claim  # the effective m, not None
    assert cli.main(["info", "--json", "--tiers", *bench_dirs]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["claim"][0] == "2"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_bench_sglang_peers(tmp_path, tier_dirs):
    doc = _bench(tmp_path, tier_dirs[:2], "kvstream,hicache-file,sglang-adapter", "--write-baseline", "none")
    hf = doc["policies"]["hicache-file"]
    assert hf["missing_pages"] == 0 and hf["share"] == [1.0, 0.0]
    assert hf["page_cache_bytes"] > 0  # buffered: what it read stays in the page cache
    assert doc["policies"]["sglang-adapter"]["missing_pages"] == 0
    assert doc["wrong_pages"] == {}
    assert "speedup_vs_hicache-file" in doc["policies"]["kvstream"]


def test_bench_refuses_bad_input(tmp_path, tier_dirs, capsys):
    assert cli.main(["bench", *tier_dirs[:2], *SMALL, "--policies", "kvstream", "--testbed", "testbed2-1:20"]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli.main(["bench", *tier_dirs[:2], *SMALL, "--model", "gpt-9", "--page-bytes", "0"]) == 2


def test_testbed_status_when_none_is_up(capsys):
    assert cli.main(["testbed", "status", "--name", "kvstream-test-never-up"]) == 1
    assert "is not up" in capsys.readouterr().out


def test_bench_drives_the_lmcache_adapter(tmp_path, tier_dirs):
    """The LMCache (vLLM) path is one more policy, so its overhead over the bare engine is on record."""
    doc = _bench(tmp_path, tier_dirs[:2], "kvstream,lmcache-adapter")
    lm = doc["policies"]["lmcache-adapter"]
    assert lm["batches"] == 2 and lm["missing_pages"] == 0
    assert lm["throughput_gbps"] > 0 and sum(lm["share"]) == pytest.approx(1.0)
    assert doc["wrong_pages"] == {}


def test_bench_mixed_scenario(tmp_path, tier_dirs):
    """--scenario mixed: every write policy (the SGLang and the LMCache path) reads and writes at once;
    the backup pages of each phase are removed again, the data set reads back right."""
    out = tmp_path / "mixed.json"
    rc = cli.main(["bench", *tier_dirs[:2], "--scenario", "mixed", "--page-bytes", "65536", "--batch", "8",
                   "--batches", "1", "--warmup", "0", "--mixed-reads", "2", "--mixed-gap", "0.05",
                   "--write-batch", "4", "--write-rate", "max", "--no-progress", "--json", str(out), "--keep-data"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"today", "priority", "budget", "lmcache"}
    for name, p in doc["policies"].items():
        assert p["write_bps"] > 0 and p["write_failed_pages"] == 0, name
        assert p["read_p50_s"] > 0 and p["gap"] is not None
    assert doc["policies"]["today"]["write_vs_today"] == 1.0
    assert doc["policies"]["today"]["held_s"] == [0.0, 0.0]  # read_priority=off never holds a write
    pages = [len(files) for d in tier_dirs[:2] for _, _, files in os.walk(d) if files]
    assert sum(pages) == 2 * 2 * 8  # only the data set is left: two batches of 8 pages on both tiers
