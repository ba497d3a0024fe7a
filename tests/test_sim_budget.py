"""kvsim's write models (legacy, deferred, sync) and the replicas-within-budget policies."""

from __future__ import annotations

import pytest

from kvstream_hicache.tools.sim.bandwidth import Constant
from kvstream_hicache.tools.sim.simulator import SimConfig, parse_sim_policy, prepare, run_policy
from kvstream_hicache.tools.sim.trace import build_stream
from kvstream_hicache.tools.sim.writeq import WriteQueue
from kvstream_hicache.tools.workload import generate_swebench

GB = 1e9


def test_deferred_page_holds_staging_until_its_last_tier_wrote_it():
    wq = WriteQueue(2, "deferred", staging_bytes=10 * GB)
    wq.add([1 * GB, 1 * GB], [3, 1])  # page 0 on both tiers, page 1 on tier 0 only
    assert wq.occupancy() == pytest.approx(2 * GB)
    assert (wq.pending(0), wq.pending(1)) == pytest.approx((2 * GB, 1 * GB))
    wq.advance([2 * GB, 0.5 * GB], [(0.0, 1.0)] * 2)  # tier 0 wrote both pages, tier 1 half of page 0
    assert wq.pending(0) == 0 and wq.pending(1) == pytest.approx(0.5 * GB)
    assert wq.occupancy() == pytest.approx(1 * GB)  # page 0 still staged for tier 1
    assert wq.busy() and wq.quiet_for(5.0) == 0.0
    wq.advance([2 * GB, 0.5 * GB], [(0.0, 2.0)] * 2, now=1.0)
    assert wq.occupancy() == 0 and not wq.busy()
    assert wq.idle_since == pytest.approx(2.0)  # tier 1 finished 1 s into that phase
    assert wq.quiet_for(5.0) == pytest.approx(3.0)


def test_deferred_back_pressure_waits_until_the_new_kv_fits():
    wq = WriteQueue(2, "deferred", staging_bytes=3 * GB)
    wq.add([1 * GB] * 3, [3] * 3)
    # 1 GB must fit: one page must leave, i.e. be written on both tiers; tier 1 (1 GB/s) decides: 1 s
    assert wq.room(1 * GB, [10 * GB, 1 * GB]) == pytest.approx(1.0)
    assert wq.occupancy() == pytest.approx(2 * GB)
    assert wq.room(1 * GB, [10 * GB, 1 * GB]) == 0.0
    assert wq.room(3 * GB, [10 * GB, 1 * GB]) == pytest.approx(2.0)  # more than the pool: wait until empty
    assert wq.occupancy() == 0


def test_legacy_back_pressure_is_the_original_per_tier_check():
    wq = WriteQueue(2, "legacy", staging_bytes=3 * GB)
    wq.add([5 * GB], [3])
    assert wq.room(100 * GB, [1 * GB, 2 * GB]) == pytest.approx(2.0)  # new KV not counted, slowest tier over


def test_sync_calls_are_served_one_at_a_time():
    wq = WriteQueue(2, "sync", staging_bytes=100 * GB)
    wq.add([1 * GB], [3])  # call 1: both tiers
    wq.add([1 * GB], [1])  # call 2: tier 0 only
    wq.advance([1 * GB, 0.5 * GB], [(0.0, 2.5)] * 2)
    # call 1 ends at 2 s (tier 1); tier 0 idles from 1 s to 2 s, then writes half of call 2
    assert wq.pending(0) == pytest.approx(0.5 * GB) and wq.pending(1) == 0
    assert wq.occupancy() == pytest.approx(1 * GB)
    wq.advance([1 * GB, 0.5 * GB], [(0.0, 1.0)] * 2, now=2.5)
    assert not wq.busy() and wq.idle_since == pytest.approx(3.0)


def test_read_priority_windows_hold_a_tier_back():
    wq = WriteQueue(2, "deferred", staging_bytes=10 * GB)
    wq.add([1 * GB], [3])
    wq.advance([1 * GB, 1 * GB], [(0.0, 0.0), (0.0, 1.0)])  # tier 0 reads the whole phase, tier 1 writes
    assert wq.pending(0) == pytest.approx(1 * GB) and wq.pending(1) == 0


def _swebench(n=400, **kw):
    reqs = generate_swebench(sessions=20, requests=n, mean_input=6000, seed=3, **kw)
    cfg = SimConfig(bytes_per_token=64e3, memory_bytes=2 * GB, tiers=[Constant(3 * GB), Constant(1 * GB)],
                    write_tiers=[Constant(1.3 * GB), Constant(0.7 * GB)], write_model="deferred",
                    read_priority="tier")
    prep = prepare(build_stream(reqs), cfg)
    prep.arrival_s = prep.arrival_s / 2.0
    return prep, cfg


def test_budget_home_replica_never_outlasts_its_home_copy():
    prep, cfg = _swebench()
    full, _ = run_policy(parse_sim_policy("replicate-all"), prep, cfg)
    home, _ = run_policy(parse_sim_policy("budget:h=home"), prep, cfg)
    t0, _ = run_policy(parse_sim_policy("tier0"), prep, cfg)
    w = prep.write_block_bytes.sum()
    assert home["write_bytes"][0] == pytest.approx(w)  # the home tier takes every page
    assert home["write_bytes"][1] + home["replica_skipped_bytes"][1] == pytest.approx(w)
    assert 0 < home["replica_skipped_pages"][1]
    # a replica finishes no later than its home copy: tier 1 never holds more than tier 0 in time
    assert home["write_bytes"][1] <= w * 0.7 / 1.3 + 1e9
    assert home["write_stall_s"] <= t0["write_stall_s"] + 1e-6
    assert full["write_amplification"] == pytest.approx(2.0)
    assert 1.0 < home["write_amplification"] < 2.0


def test_budget_with_a_long_horizon_is_full_replication():
    prep, cfg = _swebench()
    full, _ = run_policy(parse_sim_policy("replicate-all"), prep, cfg)
    wide, _ = run_policy(parse_sim_policy("budget:h=1e9"), prep, cfg)
    assert wide["replica_skipped_bytes"][1] == 0
    assert wide["write_bytes"] == pytest.approx(full["write_bytes"])
    assert wide["ttft_mean_s"] == pytest.approx(full["ttft_mean_s"], rel=0.02)


def test_budget_zero_horizon_is_tier0_alone():
    prep, cfg = _swebench()
    none, _ = run_policy(parse_sim_policy("budget:h=0"), prep, cfg)
    t0, _ = run_policy(parse_sim_policy("tier0"), prep, cfg)
    assert none["write_bytes"][1] == 0
    assert none["ttft_mean_s"] == pytest.approx(t0["ttft_mean_s"])


def test_parse_budget_policies():
    assert parse_sim_policy("budget").horizon == "window"
    assert parse_sim_policy("budget:h=home+quiet+0.5").horizon == "home+quiet+0.5"
    for bad in ["budget:h=soon", "budget:h=home+-1", "budget:g=0.5"]:
        with pytest.raises(ValueError):
            parse_sim_policy(bad)


def test_kvstream_is_budget_with_catchup_written_behind_the_puts():
    """The policy named kvstream is the engine's default: budget (h=home+1) with catch-up. The replicas
    the budget skips are written later (in read-free time, after the puts' own writes), so tier 1
    ends up holding more than without catch-up; they never cost the puts (no more write stall)."""
    prep, cfg = _swebench()
    kv, _ = run_policy(parse_sim_policy("kvstream:h=home"), prep, cfg)  # (home+1 skips nothing here)
    plain, _ = run_policy(parse_sim_policy("budget:h=home"), prep, cfg)
    full, _ = run_policy(parse_sim_policy("replicate-all"), prep, cfg)
    assert parse_sim_policy("kvstream").catchup and not parse_sim_policy("budget-no-catch-up").catchup
    assert kv["replica_skipped_bytes"][1] > 0 and plain["replica_caught_up_bytes"] == [0.0, 0.0]
    caught = kv["replica_caught_up_bytes"][1]
    assert 0 < caught <= kv["replica_skipped_bytes"][1]
    assert caught + kv["replica_owed_bytes"][1] == pytest.approx(kv["replica_skipped_bytes"][1])
    assert plain["write_bytes"][1] < kv["write_bytes"][1] <= full["write_bytes"][1] + 1e-6
    assert kv["write_stall_s"] <= plain["write_stall_s"] + 1e-6
    assert kv["catchup_done_s"] > 0
