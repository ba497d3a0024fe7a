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
    # the default engine's reads right after the put (catch-up running) are rows of their own
    assert set(doc["policies"]) == {"kvstream@put", "tier0@put", "kvstream", "static-0.5", "tier0"}
    catch_up = doc["write"]["catch_up"]
    assert catch_up["finished"] and catch_up["pending_pages"] == 0 and catch_up["s"] >= 0
    assert set(catch_up) >= {"after_put", "after_catch_up", "ratio_to_replicated_write", "ratio_to_slowest_alone"}
    for name, p in doc["policies"].items():
        assert p["batches"] == 2 and p["missing_pages"] == 0  # (@put: once over the 2 data set batches)
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


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl not installed: pip install .[peers]")
def test_bench_nixl_peers_and_one_tier_kvstream(tmp_path, tier_dirs):
    """sglang's real NIXL backend (POSIX plugin, O_DIRECT) on tier 0 and hash-sharded over both tiers,
    beside a one-tier kvstream engine, with fio's figures measured in the same run."""
    doc = _bench(tmp_path, tier_dirs[:2], "kvstream,kvstream-1tier,sglang-adapter-1tier,hicache-nixl,hicache-nixl-sharded",
                 "--write-baseline", "none", "--batch", "8", "--fio", "run", "--fio-runtime", "0.3",
                 "--fio-size", "4M", "--fio-iodepth", "4")
    pol = doc["policies"]
    assert doc["wrong_pages"] == {}
    for name in ("kvstream-1tier", "sglang-adapter-1tier", "hicache-nixl", "hicache-nixl-sharded"):
        assert pol[name]["missing_pages"] == 0 and pol[name]["throughput_gbps"] > 0, name
        assert pol[name]["cpu_s_per_gb"] > 0 and doc["write"][name]["seconds"] > 0, name
    for name in ("hicache-nixl", "kvstream-1tier", "sglang-adapter-1tier"):
        assert pol[name]["share"] == [1.0, 0.0], name
    sharded = pol["hicache-nixl-sharded"]["share"]  # NIXL's hash put 16 K/V files of 8 pages on each side
    assert 0 < sharded[0] < 1 and sum(sharded) == pytest.approx(1.0)
    assert pol["hicache-nixl"]["speedup_vs_hicache-nixl"] == pytest.approx(1.0)
    assert pol["kvstream"]["memory_peak_bytes"] > 0 and pol["hicache-nixl"]["memory_peak_bytes"] is None
    assert pol["sglang-adapter-1tier"]["memory_peak_bytes"] is not None  # its own engine's
    assert set(doc["fio"]) >= {"before", "after", "read"} and doc["fio"]["read"]["all"] > 0
    assert pol["kvstream"]["fraction_of_fio"] > 0
    assert not any(os.listdir(d) for d in tier_dirs[:2])  # every peer's copy removed with the bench's


def test_bench_refuses_contenders_of_the_other_venv(tmp_path, tier_dirs, capsys):
    """sglang's and LMCache's contenders run in separate venvs: asked for one this Python lacks, the
    bench refuses before writing anything and says where to run it."""
    other = "lmcache-fs-native" if importlib.util.find_spec("lmcache") is None else "hicache-nixl"
    assert cli.main(["bench", *tier_dirs[:2], *SMALL, "--policies", f"kvstream,{other}"]) == 2
    err = capsys.readouterr().err
    assert "cannot run the chosen policies here" in err and ("kvstream bench" in err or ".[peers]" in err)
    assert not any(os.listdir(d) for d in tier_dirs[:2])


@pytest.mark.testbed
@pytest.mark.skipif(os.geteuid() != 0, reason="a testbed needs root (loop devices, mounts, cgroups)")
def test_device_speed_testbed_up_and_down(tmp_path):
    """A RAM-backed tier (image in /dev/shm, no direct I/O, discard) read-limited in the blkio group,
    beside a directory on the machine's disk; torn down without a trace."""
    from kvstream_hicache.tools.bench import testbed as tb

    name = f"kvs-test-{os.getpid()}"
    profile = tb.parse_profile("dir,ram:700/0")
    lines = []
    try:
        bed = tb.up(profile, name=name, sizes=[0, 192 << 20], image_dir=str(tmp_path), fio_bs=None, log=lines.append)
        dir_tier, ram_tier = bed.tiers
        assert dir_tier.backing == "dir" and os.path.isdir(dir_tier.mount) and not dir_tier.device
        assert dir_tier.mount.startswith(str(tmp_path))
        assert ram_tier.image == f"/dev/shm/{name}-tier1.img"
        with open(f"/sys/block/{os.path.basename(ram_tier.device)}/loop/dio") as f:
            assert f.read().strip() == "0"  # reads come from the tmpfs image's pages: RAM
        with open("/proc/self/mounts") as f:
            opts = next(line.split()[3] for line in f if line.split()[1] == ram_tier.mount)
        assert "discard" in opts.split(",")
        assert bed.limits() == {"read": {ram_tier.devnum: 700 * 10**6}, "write": {}}
        assert tb.Testbed.load(name).profile == profile and not bed.problems()
        again = tb.up(profile, name=name, image_dir=str(tmp_path), fio_bs=None, log=lines.append)
        assert again.tiers[1].device == ram_tier.device  # reused, not rebuilt
    finally:
        assert tb.down(name, image_dir=str(tmp_path), log=lines.append)
    assert not os.path.exists(f"/dev/shm/{name}-tier1.img") and not os.path.exists(dir_tier.mount)
    assert not os.path.exists(bed.cgroup) and tb.status(name) == {"up": False, "name": name}
    with open("/proc/self/mounts") as f:
        assert ram_tier.mount not in f.read()


def test_bench_mixed_scenario(tmp_path, tier_dirs):
    """--scenario mixed: every write policy (the SGLang and the LMCache path) reads and writes at once;
    the backup pages of each phase are removed again, the data set reads back right."""
    out = tmp_path / "mixed.json"
    rc = cli.main(["bench", *tier_dirs[:2], "--scenario", "mixed", "--page-bytes", "65536", "--batch", "8",
                   "--batches", "1", "--warmup", "0", "--mixed-reads", "2", "--mixed-gap", "0.05",
                   "--write-batch", "4", "--write-rate", "max", "--no-progress", "--json", str(out), "--keep-data"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"today", "priority", "budget", "kvstream", "lmcache"}
    for name, p in doc["policies"].items():
        assert p["write_bps"] > 0 and p["write_failed_pages"] == 0, name
        assert p["read_p50_s"] > 0 and p["gap"] is not None
    assert doc["policies"]["today"]["write_vs_today"] == 1.0
    assert doc["policies"]["today"]["held_s"] == [0.0, 0.0]  # read_priority=off never holds a write
    assert doc["policies"]["budget"]["catch_up"] == [0, 0]  # catchup=off: a skipped replica stays skipped
    pages = [len(files) for d in tier_dirs[:2] for _, _, files in os.walk(d) if files]
    assert sum(pages) == 2 * 2 * 8  # only the data set is left: two batches of 8 pages on both tiers


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_bench_mla_pages_through_sglang_mla_host_pool(tmp_path, tier_dirs):
    """DeepSeek's MLA pages (kv_lora_rank 512 + rope 64, one latent chunk per page) are read through
    sglang's real ``MLATokenToKVPoolHost`` by the adapter on one and two tiers, every page checked."""
    from kvstream_hicache.tools.bench import geometry
    from kvstream_hicache.tools.bench.contenders import SglangHost

    g = geometry.from_model("deepseek-v3", 32)
    host = SglangHost(g, 2)  # (installs the CPU stubs sglang's imports need)
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    assert isinstance(host.host, MLATokenToKVPoolHost)
    assert host.chunk_bytes == g.segments == (32 * 61 * 576 * 2,)
    rc = cli.main(["bench", *tier_dirs[:2], "--model", "deepseek-v3", "--page-size", "32", "--batch", "4",
                   "--batches", "2", "--warmup", "0", "--no-progress", "--verify", "-1", "--write-baseline", "none",
                   "--policies", "sglang-adapter-1tier,sglang-adapter", "--json", str(tmp_path / "mla.json")])
    assert rc == 0
    doc = json.loads((tmp_path / "mla.json").read_text())
    assert "(MLA)" in doc["geometry"]["label"] and doc["wrong_pages"] == {}
    for name in ("sglang-adapter-1tier", "sglang-adapter"):
        assert doc["policies"][name]["missing_pages"] == 0, name


def test_the_reads_right_after_the_put_are_a_phase_of_their_own(tmp_path, tier_dirs):
    """The '@put' pass (reads while the catch-up writes) and the timed rounds: one clock for both (the bound
    interpolates idle tiers by time, --series and kvsim order batches by t0), each row against its own
    phase's reference (docs/benchmarks.md: "x tier0 right after the put is against tier0@put"), and the
    run's bound that of the timed rounds (those every reference row's figures come from)."""
    doc = _bench(tmp_path, tier_dirs[:2], "kvstream,tier0", "--batch", "32", "--batches", "4")
    put = [b for b in doc["batches"] if b["policy"].endswith("@put")]
    timed = [b for b in doc["batches"] if not b["policy"].endswith("@put")]
    assert put and timed
    assert min(b["t0"] for b in timed) > max(b["t0"] for b in put), "two clocks in one list of batches"
    after_put = doc["write"]["catch_up"]["after_put"]["ratio_to_tier0"]
    assert doc["policies"]["kvstream@put"]["speedup_vs_tier0"] == pytest.approx(after_put)
    timed = [b for b in timed if b["bound_s"]]
    assert doc["bound_gbps"] == pytest.approx(sum(b["nbytes"] for b in timed) / sum(b["bound_s"] for b in timed) / 1e9)


@pytest.mark.parametrize("policy, why", [("tier2", "cannot route reads over 2 tiers"),
                                         ("static-0.5/0.3/0.2", "cannot route reads over 2 tiers"),
                                         ("tier0:m=0", "is not a routing policy")])
def test_bench_refuses_a_policy_the_tiers_cannot_take_before_writing(tmp_path, tier_dirs, capsys, policy, why):
    """A policy is checked as the engine's policy setting is (config.check_policy): one that names a tier,
    or gives shares, the tiers do not have, or a bad m, is refused before anything is written, and the
    message names --policies, the policy as written and the valid forms. Before: 'tier2' for two tiers
    wrote every page and the baselines, then its first read raised a traceback (ValueError). Found by a
    review."""
    assert cli.main(["bench", *tier_dirs[:2], *SMALL, "--policies", f"kvstream,{policy}"]) == 2
    out = capsys.readouterr()
    assert f"--policies: {policy!r} {why}" in out.err and "valid: 'kvstream'" in out.err, out.err
    assert "replicated write" not in out.out
    assert not any(os.listdir(d) for d in tier_dirs[:2])
