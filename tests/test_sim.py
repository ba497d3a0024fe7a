"""kvsim: the model's equations, reuse distances, Eq. 2 against an LRU cache, and the simulator."""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest

from kvstream_hicache.router import CompletionDriven, StaticSplit
from kvstream_hicache.tools.sim import model
from kvstream_hicache.tools.sim.bandwidth import Bursty, Constant, Periodic, Recorded, load_recorded, parse_series
from kvstream_hicache.tools.sim.batch import simulate
from kvstream_hicache.tools.sim.cli import main
from kvstream_hicache.tools.sim.simulator import (
    SimConfig,
    capacity_sweep,
    mean_share,
    parse_sim_policy,
    prepare,
    run_policy,
    static_sweep,
)
from kvstream_hicache.tools.sim.trace import brute_force_distances, build_stream, load_requests, lru_misses
from kvstream_hicache.tools.workload import Request

GB = 1e9


# -- the paper's worked example (section 5.2) ------------------------------------------------------------


def test_worked_example_75_25_meets_the_bound_at_3_and_1():
    phi = model.share([3 * GB, 1 * GB])[0]
    assert phi == 0.75
    assert model.static_penalty(0.75, phi) == 1.0
    d = 12 * GB
    assert model.static_time(d, 0.75, [3 * GB, 1 * GB]) == model.bound(d, [3 * GB, 1 * GB]) == 3.0


def test_worked_example_12_5_percent_slower_when_tier0_drops_to_2():
    phi = model.share([2 * GB, 1 * GB])[0]
    assert model.static_penalty(0.75, phi) == pytest.approx(1.125)
    d = 12 * GB
    assert model.static_time(d, 0.75, [2 * GB, 1 * GB]) / model.bound(d, [2 * GB, 1 * GB]) == pytest.approx(1.125)


def test_worked_example_slower_than_tier0_alone_when_tier1_drops_to_half():
    d = 12 * GB
    static = model.static_time(d, 0.75, [3 * GB, 0.5 * GB])
    alone = model.static_time(d, 1.0, [3 * GB, 0.5 * GB])
    assert alone == pytest.approx(4.0) and static == pytest.approx(6.0)
    assert static > alone


@pytest.mark.parametrize("speeds", [(3.0, 1.0), (2.0, 1.0), (3.0, 0.5)])
def test_router_static_split_reproduces_eq5(speeds):
    n = 400  # item_bytes 1: D = 400
    r = simulate(StaticSplit(0.75), n, speeds)
    assert r.finish == pytest.approx(model.static_time(n, 0.75, speeds))


def test_the_other_equations():
    assert model.step_time(1.0, 2.0, 0.5) == 3.5
    assert model.bound(10 * GB, [3 * GB, 1 * GB], d2h=2 * GB) == 5.0  # capped by host-to-device
    assert model.demand(100.0, 0.25) == 25.0
    assert model.miss_probability([1, 5, 10, 20], 9) == 0.5
    assert model.miss_probability([1, 5, 10, 20], 9, weights=[1, 1, 1, 3]) == pytest.approx(4 / 6)
    assert model.write_time(2 * GB, [4 * GB, 1 * GB]) == 2.0
    assert model.writes_off_path(2 * GB, [4 * GB, 1 * GB], t_fwd_next=2.0)
    assert not model.writes_off_path(2 * GB, [4 * GB, 1 * GB], t_fwd_next=1.9)
    assert model.queue_growth(0.5) == 1.0 and model.queue_growth(0.9) == pytest.approx(9.0)
    assert model.queue_growth(1.0) == math.inf
    assert model.queue_wait(0.75, 2.0) == pytest.approx(6.0)
    assert model.gap([11.0, 11.0], [10.0, 10.0]) == pytest.approx(0.1)


def test_presets_are_per_rank():
    assert model.preset("14b").bytes_per_token == 40_000
    assert model.preset("32b").bytes_per_token == 64_000
    assert model.preset("70b").bytes_per_token == model.preset("110b").bytes_per_token == 80_000
    custom = model.preset("kv=128K,tp=2")
    assert custom.bytes_per_token == 64_000
    with pytest.raises(ValueError):
        model.preset("7b")
    assert model.parse_bytes("3GB/s") == 3e9 and model.parse_bytes("80GiB") == 80 * 2**30
    with pytest.raises(ValueError):
        model.parse_bytes("fast")


# -- the static gap is V-shaped --------------------------------------------------------------------------


def test_static_gap_is_v_shaped_with_its_minimum_at_the_share():
    grid = [round(g, 2) for g in np.arange(0.0, 1.0001, 0.05)]
    gaps = [simulate(StaticSplit(g), 400, (3.0, 1.0)).gap for g in grid]
    best = int(np.argmin(gaps))
    assert grid[best] == 0.75 and gaps[best] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(gaps[:best], gaps[1 : best + 1]))  # falls to the minimum
    assert all(a < b for a, b in zip(gaps[best:], gaps[best + 1 :]))  # then rises
    for g, gap in zip(grid, gaps):  # and it is Eq. 6
        assert gap == pytest.approx(model.static_penalty(g, 0.75) - 1.0, abs=0.01)


def test_static_sweep_of_a_run_minimum_at_the_mean_share():
    reqs = _toy_trace(seed=1)
    prep, cfg = _prepared(reqs, tiers=(Constant(2 * GB), Constant(0.5 * GB)))
    _, log = run_policy(parse_sim_policy("kvstream"), prep, cfg)
    share = mean_share(log)
    assert share == pytest.approx(0.8)
    grid = [round(g, 2) for g in np.arange(0.0, 1.0001, 0.05)]
    gaps = static_sweep(log, grid)
    best = int(np.argmin(gaps))
    assert grid[best] == 0.8 and gaps[best] == pytest.approx(0.0, abs=1e-9)
    assert all(a > b for a, b in zip(gaps[:best], gaps[1 : best + 1]))
    assert all(a < b for a, b in zip(gaps[best:], gaps[best + 1 :]))


# -- reuse distances and Eq. 2 -----------------------------------------------------------------------------


def _req(t, ids, input_length=None, out=10):
    return Request(float(t), input_length if input_length is not None else 512 * len(ids), out, tuple(ids))


def test_reuse_distances_on_a_hand_made_trace():
    reqs = [
        _req(0, [1, 2, 3]),  # first touches
        _req(1, [1, 2, 4]),  # reuses 1, 2: since their last use, 2 and 3 (resp. 3 and 1) were touched
        _req(2, [5]),
        _req(3, [1, 2, 4, 6], input_length=512 * 3 + 100),  # partial last block
    ]
    s = build_stream(reqs, block_tokens=512)
    assert s.reused.tolist() == [0, 0, 0, 512, 512, 0, 0, 512, 512, 512, 0]
    assert s.written.tolist() == [512, 512, 512, 0, 0, 512, 512, 0, 0, 0, 100]
    # block 1 at access 3: distinct blocks since = {2, 3} + itself -> 3 blocks
    assert s.distance[3] == 3 * 512
    # block 2 at access 4: since its use at 1: {3, 1} + itself
    assert s.distance[4] == 3 * 512
    # request 3, block 1: since access 3: {2, 4, 5} + itself
    assert s.distance[7] == 4 * 512
    assert np.array_equal(s.distance, brute_force_distances(s))


def _toy_trace(seed: int, n: int = 120, pool: int = 30):
    """Sessions of growing prompts interleaved at random, with a shared system prompt."""
    rng = random.Random(seed)
    next_id = [100]
    sessions = [[0, 1] for _ in range(pool)]  # two shared system-prompt blocks
    reqs = []
    for i in range(n):
        s = sessions[rng.randrange(pool)]
        for _ in range(rng.randint(1, 4)):
            s.append(next_id[0])
            next_id[0] += 1
        tail = rng.randint(1, 512)
        reqs.append(_req(i * 500.0, list(s), input_length=512 * (len(s) - 1) + tail, out=rng.randint(1, 50)))
        s[-1] = next_id[0]  # the partial last block is rewritten as a new block next turn
        next_id[0] += 1
    return reqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reuse_distances_match_a_brute_force_count(seed):
    s = build_stream(_toy_trace(seed, n=60, pool=8))
    assert np.array_equal(s.distance, brute_force_distances(s))


@pytest.mark.parametrize("seed", [0, 3])
def test_eq2_demand_equals_the_lru_cache_misses(seed):
    s = build_stream(_toy_trace(seed))
    bpt = 1000.0
    caps = [512 * bpt * k for k in (1, 4, 16, 64, 256, 4096)]
    sweep = capacity_sweep(s, bpt, caps, lru=True)
    assert sweep["eq2_bytes"] == pytest.approx(sweep["lru_bytes"])
    assert sweep["eq2_bytes"][0] == pytest.approx(sweep["reuse_bytes"])  # one block of memory: all miss
    assert sweep["eq2_bytes"][-1] == 0.0  # everything fits
    assert all(a >= b for a, b in zip(sweep["eq2_bytes"], sweep["eq2_bytes"][1:]))
    for cap in caps:  # and per access, not only in total
        assert np.array_equal(lru_misses(s, cap / bpt), s.miss_tokens(cap / bpt))


# -- the simulator ---------------------------------------------------------------------------------------


def _prepared(reqs, tiers=(Constant(3 * GB), Constant(1 * GB)), memory=512 * 1000 * 8, **kw):
    # 32-token chunks: a step reads tens of chunks, as a real step does with 256-token chunks of long prompts
    kw.setdefault("chunk_tokens", 32)
    cfg = SimConfig(bytes_per_token=1000.0, memory_bytes=memory, tiers=list(tiers),
                    write_tiers=[Constant(100 * GB)] * len(tiers), prefill_tps=1e6, decode_tps=1e6, **kw)
    return prepare(build_stream(reqs), cfg), cfg


def test_simulated_kvstream_stays_within_one_claim_of_the_bound_every_step():
    prep, cfg = _prepared(_toy_trace(5))
    res, log = run_policy(parse_sim_policy("kvstream"), prep, cfg)
    claim = cfg.m * cfg.chunk_tokens * cfg.bytes_per_token
    assert sum(log.demand) == pytest.approx(prep.storage_bytes) and prep.storage_bytes > 0
    for t_ret, bound in zip(log.t_ret, log.bound):
        assert bound - 1e-12 <= t_ret <= bound + claim / (1 * GB)
    assert res["gap"] < 0.05
    assert res["write_amplification"] == pytest.approx(2.0)
    assert res["read_share"][0] == pytest.approx(0.75, abs=0.05)


def test_policies_write_volumes_and_ordering():
    prep, cfg = _prepared(_toy_trace(6), tiers=(Constant(3 * GB), Constant(1 * GB)))
    out = {}
    for spec in ["kvstream", "tier0", "static-0.75", "static-0.5", "replicate-share-0.4:g=0.75",
                 "replicate-share-0:g=0.75", "replicate-after-slow:g=0.75"]:
        p = parse_sim_policy(spec)
        out[p.name], _ = run_policy(p, prep, cfg)
    # The router splits a step's chunks by count (round(g n)), so Eq. 6 holds up to one chunk per step.
    assert out["static-0.75"]["gap"] == pytest.approx(0.0, abs=0.02)
    assert out["static-0.5"]["gap"] == pytest.approx(model.static_penalty(0.5, 0.75) - 1.0, rel=0.03)
    assert out["tier0"]["gap"] == pytest.approx(1 / 0.75 - 1.0, rel=1e-6)
    assert out["tier0"]["write_amplification"] == pytest.approx(1.0)
    assert out["static-0.5"]["write_amplification"] == pytest.approx(1.0)
    lo, hi = 0.75 - 0.4 * 0.75, 0.75 + 0.4 * 0.25  # the replicated window of placement keys
    both = (prep.write_u >= lo) & (prep.write_u < hi)
    expected = 1.0 + prep.write_block_bytes[both].sum() / prep.write_block_bytes.sum()
    assert out["replicate-share-0.4:g=0.75"]["write_amplification"] == pytest.approx(expected)
    assert out["replicate-share-0:g=0.75"]["write_amplification"] == pytest.approx(1.0)
    # nothing turns slow at constant bandwidth: no replication at all
    assert out["replicate-after-slow:g=0.75"]["write_amplification"] == pytest.approx(1.0)
    for r in out.values():
        assert r["gap"] >= -1e-9


def test_replicate_after_slow_replicates_once_a_tier_slows():
    prep, cfg = _prepared(_toy_trace(7), tiers=(Periodic(3 * GB, 2 * GB, 10.0), Constant(1 * GB)))
    res, _ = run_policy(parse_sim_policy("replicate-after-slow:g=0.75"), prep, cfg)
    assert 1.0 < res["write_amplification"] < 2.0


def test_kvstream_follows_varying_bandwidth_where_a_static_split_cannot():
    tiers = (Bursty(3 * GB, 0.5 * GB, on_s=5.0, off_s=5.0, seed=2), Constant(1 * GB))
    prep, cfg = _prepared(_toy_trace(8), tiers=tiers)
    kv, _ = run_policy(parse_sim_policy("kvstream"), prep, cfg)
    st, _ = run_policy(parse_sim_policy("static-0.75"), prep, cfg)
    assert kv["gap"] < 0.05 < st["gap"]


def test_an_idle_healthy_tier_takes_over_what_a_stalled_tier_claimed():
    """router.py: 'when a tier stalls it lets the healthy tier finish the whole batch'. Tier 0 claims the
    only item at the start (start() never steals) and stalls; tier 1, idle, gets it through refill()
    (before: done False, finish inf)."""
    r = simulate(CompletionDriven(2, 4), 1, [0.0, 1e9], item_bytes=16e6)
    assert r.done and r.finish == pytest.approx(16e6 / 1e9)
    assert r.reads == [0, 1] and any(c.steal and c.tier == 1 for c in r.claims)


def test_a_slower_idle_tier_does_not_re_read_a_faster_tiers_items():
    """The engine's may_steal (reads.py): an idle tier re-reads another's items only when it is at least
    as fast, so tier 1, at a third of tier 0's speed, leaves tier 0's only item to it."""
    r = simulate(CompletionDriven(2), 1, [1.0, 1 / 3])  # tier 0 claims the item, tier 1 stays idle
    assert r.done and r.reads == [1, 0] and not any(c.steal for c in r.claims)
    assert r.finish == pytest.approx(1.0)


def test_replicate_all_with_a_dead_tier_reads_at_the_healthy_tiers_rate():
    """Full replication, tier 0 dead (kvsim reads it at its 1 MB/s trickle): completion-driven routing
    reads at tier 1's rate, as tier 1 alone does (before: each step waited on the trickle)."""
    reqs = [Request(float(10 * i), 512, 1, (1,)) for i in range(4)]  # one 512-token block, reused 3 times
    cfg = SimConfig(bytes_per_token=1000.0, memory_bytes=0.0, tiers=[Constant(0.0), Constant(1 * GB)],
                    write_tiers=[Constant(100 * GB)] * 2, prefill_tps=1e6, decode_tps=1e6)
    prep = prepare(build_stream(reqs), cfg)
    assert prep.storage_bytes > 0
    alone, _ = run_policy(parse_sim_policy("tier1"), prep, cfg)
    both, _ = run_policy(parse_sim_policy("replicate-all"), prep, cfg)
    assert alone["gap"] == pytest.approx(0.0, abs=0.01)
    assert both["retrieval_s"] <= 1.01 * alone["retrieval_s"], (both["retrieval_s"], alone["retrieval_s"])


def test_static_sweep_applies_the_d2h_cap_as_the_static_rows_do():
    """With --d2h below b_0 + b_1 both the static-0.5 row and its bound are capped by D2H (gap 0); the
    sweep at g = 0.5 must say the same (before: +100%, Eq. 5 over D / (b_0 + b_1), no cap)."""
    reqs = [Request(float(10 * i), 512 * 8, 1, tuple(range(1, 9))) for i in range(4)]
    prep, cfg = _prepared(reqs, memory=0.0, d2h_bps=1 * GB)
    _, log = run_policy(parse_sim_policy("kvstream"), prep, cfg)
    row, _ = run_policy(parse_sim_policy("static-0.5"), prep, cfg)
    assert row["gap"] == pytest.approx(0.0, abs=0.02)
    assert static_sweep(log, [0.5])[0] == pytest.approx(row["gap"], abs=0.02)


def test_parse_sim_policy():
    assert parse_sim_policy("kvstream:m=4").m == 4
    assert parse_sim_policy("static-auto").auto_g
    assert parse_sim_policy("tier1").tier == 1
    # a claim size or depth given to a static or one-tier policy is simulated, not dropped for --m
    assert (parse_sim_policy("static-0.75:m=8,depth=16").m, parse_sim_policy("static-0.75:m=8,depth=16").depth) == (8, 16)
    assert parse_sim_policy("static-auto:m=3").m == 3 and parse_sim_policy("tier1:m=4").m == 4
    assert parse_sim_policy("static-0.50:m=4").name == "static-0.5:m=4" and parse_sim_policy("tier0").name == "tier0"
    p = parse_sim_policy("replicate-share-0.4")
    assert p.kind == "share" and p.f == 0.4 and p.auto_g
    assert parse_sim_policy("replicate-after-slow:slow=0.5,g=0.7").slow == 0.5
    for bad in ["fastest", "static-2", "replicate-share-1.5", "kvstream:g=1", "tierx"]:
        with pytest.raises(ValueError):
            parse_sim_policy(bad)


# -- bandwidth series -------------------------------------------------------------------------------------


def test_bandwidth_series(tmp_path):
    assert parse_series("3G").rate(5.0) == 3e9
    p = parse_series("periodic:mean=1G,amp=0.5G,period=60")
    assert p.rate(15.0) == pytest.approx(1.5e9) and p.rate(45.0) == pytest.approx(0.5e9)
    b = parse_series("bursty:high=2G,low=0.5G,on=3,off=2,seed=4")
    assert {b.rate(t / 10) for t in range(2000)} == {2e9, 0.5e9}
    doc = {"tiers": [{"name": "nvme", "t": [0, 1, 2], "bps": [3e9, 2e9, 1e9], "write_bps": [1e9, 1e9, 1e9]},
                     {"t": [0, 1], "bps": [1e9, 0.5e9]}]}
    path = tmp_path / "bw.json"
    path.write_text(json.dumps(doc))
    reads, writes = load_recorded(path)
    assert [reads[0].rate(t) for t in (0, 0.5, 1, 2.5, 3.0, 4.2)] == [3e9, 3e9, 2e9, 1e9, 3e9, 2e9]  # repeats
    assert writes[0].rate(0) == 1e9 and writes[1] is None
    assert parse_series(f"recorded:{path}#1").rate(1.5) == 0.5e9
    assert Recorded((0.0, 1.0), (1.0, 2.0), repeat=False).rate(10.0) == 2.0
    with pytest.raises(ValueError):
        parse_series("periodic:mean=1G")


@pytest.mark.parametrize("spec, words", [
    ("bursty:high=3G,low=1G,on=0,off=0", "on and off"),  # rate() looped forever: phases of length 0
    ("bursty:high=3G,low=1G,on=-1,off=5", "on and off"),  # a bare numpy error
    ("periodic:mean=3G,amp=1G,period=0", "period"),  # ZeroDivisionError in rate()
])
def test_bandwidth_series_refuses_phases_that_cannot_be(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_series(spec)


def test_recorded_series_refuses_a_tier_the_file_lacks(tmp_path):
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"tiers": [{"t": [0, 1], "bps": [1e9, 2e9]}, {"t": [0, 1], "bps": [1e9, 1e9]}]}))
    for tier in ("5", "-1", "x"):  # (#5: IndexError; #-1 picked the last tier)
        with pytest.raises(ValueError, match=f"2 tiers: #{tier} .*#0 to #1"):
            parse_series(f"recorded:{path}#{tier}")


# -- the command -------------------------------------------------------------------------------------------


def test_kvsim_command_writes_json_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    with open(trace, "w") as fh:
        for r in _toy_trace(9, n=80):
            fh.write(json.dumps(r.to_dict()) + "\n")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    rc = main(["--trace", str(trace), "--model", "kv=4000,tp=1", "--memory", "4M", "--tier", "3G", "--tier", "1G",
               "--chunk-tokens", "32",
               "--capacities", "1M,4M,64M", "--validate-lru", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["policies"]) == {"kvstream", "replicate-all", "budget-no-catch-up", "tier0", "tier1", "static-auto",
                                    "static-0.5", "replicate-share-0.4", "replicate-after-slow"}
    assert res["policies"]["kvstream"]["gap"] < 0.05
    assert res["policies"]["static-auto"]["g"] == pytest.approx(0.75)
    assert res["capacity_sweep"]["eq2_bytes"] == pytest.approx(res["capacity_sweep"]["lru_bytes"])
    assert png.stat().st_size > 10_000
    assert "kvstream" in capsys.readouterr().out


def test_kvsim_reports_bad_input(tmp_path, capsys):
    assert main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "kvsim:" in capsys.readouterr().err


@pytest.mark.parametrize("extra, words", [
    (["--d2h", "0"], "--d2h '0'"),  # ZeroDivisionError
    (["--tier", "periodic:mean=3G,amp=1G,period=0", "--tier", "1G"], "--tier 'periodic:.*period"),  # ditto
    (["--tier", "bursty:high=3G,low=1G,on=0,off=0", "--tier", "1G"], "--tier 'bursty:.*on and off"),  # hung
    (["--tier", "recorded:{bw}#5", "--tier", "1G"], "#5"),  # IndexError
    (["--chunk-tokens", "0"], "--chunk-tokens 0"),  # every storage read dropped, exit 0
    (["--chunk-tokens", "-5"], "--chunk-tokens -5"),  # a numpy error
    (["--prefill-tps", "0"], "--prefill-tps 0"),  # replaced by the preset's rate (`or`)
    (["--decode-tps", "0"], "--decode-tps 0"),
    (["--prefill-tps=-5"], "--prefill-tps -5"),  # blamed on the 'rate factor'
    (["--max-batch", "0"], "--max-batch 0"),  # ran as 1
    (["--load", "0"], "--load 0"),  # ran at rate factor 1.0
    (["--load=-1"], "--load -1"),
    (["--rate", "0"], "--rate 0"),
    (["--limit", "-1"], "--limit -1"),  # an empty run, exit 0
    (["--latency", "abc"], "--latency 'abc'"),  # 'could not convert string to float'
    (["--memory", "80X"], "--memory '80X'"),
    (["--staging", "lots"], "--staging 'lots'"),
    (["--tier", "fast", "--tier", "1G"], "--tier 'fast'"),
    (["--policies", "tier0,fastest"], "--policies 'fastest'"),
])
def test_kvsim_refuses_a_bad_setting_naming_it(tmp_path, capsys, extra, words):
    """A bad setting ends in 'kvsim: FLAG VALUE: ...' and exit 2: no traceback, no silent substitute."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in _toy_trace(9, n=20)))
    bw = tmp_path / "bw.json"
    bw.write_text(json.dumps({"tiers": [{"t": [0, 1], "bps": [1e9, 2e9]}, {"t": [0, 1], "bps": [1e9, 1e9]}]}))
    extra = [x.replace("{bw}", str(bw)) for x in extra]
    rc = main(["--trace", str(trace), "--memory", "1G", "--policies", "tier0", *extra])  # (the last flag wins)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kvsim: ") and re.search(words, err), err


def test_generated_workload_and_orders():
    reqs = load_requests(workload="swebench", limit=200)
    assert len(reqs) == 200 and all(r.hash_ids for r in reqs)
    rr = load_requests(workload="swebench", order="round-robin", limit=200)
    assert sorted(r.timestamp for r in rr) == sorted(r.timestamp for r in reqs)
    with pytest.raises(ValueError):
        load_requests(workload="swebench", order="sideways")
