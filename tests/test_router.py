"""Unit tests of the pure router with simulated tiers (injected speeds, latencies and faults)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream_hicache.router import (
    Claim,
    CompletionDriven,
    SingleTier,
    StaticSplit,
    all_tiers,
    parse_policy,
)
from kvstream_hicache.tools.sim.batch import simulate


def residual(m: int, speeds, item_bytes: float = 1.0) -> float:
    """The paper's residual: one last claim of m items on the slowest tier (seconds)."""
    return m * item_bytes / min(speeds)


# -- constant speeds: the split and the bound --------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("speeds", [(3.0, 1.0), (1.0, 1.0), (5.0, 1.0), (1.0, 3.0), (1.7, 1.0)])
@pytest.mark.parametrize("n", [100, 1001])
def test_constant_speeds_meet_the_bound_within_one_claim(m, speeds, n):
    b0, b1 = speeds
    r = simulate(CompletionDriven(m), n, speeds, item_bytes=2.0)
    assert r.done and all(r.found)
    bound = n * 2.0 / (b0 + b1)
    assert r.bound == pytest.approx(bound)
    assert bound - 1e-9 <= r.finish <= bound + residual(m, speeds, 2.0)
    # The split is b0/(b0+b1) up to each tier's last claim (m items per tier).
    assert abs(r.reads[0] - n * b0 / (b0 + b1)) <= 2 * m
    # The meet-in-the-middle overlap: at most each tier's in-flight window re-read.
    assert r.duplicates <= 2 * 2 * m


def test_two_tiers_meet_in_the_middle():
    r = simulate(CompletionDriven(2), 40, (1.0, 1.0))
    fresh = [c for c in r.claims if not c.steal]
    assert fresh[0] == Claim(0, (0, 1), False)
    assert fresh[1] == Claim(1, (39, 38), False)
    tier0 = [i for c in fresh if c.tier == 0 for i in c.items]
    tier1 = [i for c in fresh if c.tier == 1 for i in c.items]
    assert tier0 == sorted(tier0) and tier1 == sorted(tier1, reverse=True)
    assert max(tier0) < min(tier1)  # the cursors met, they did not cross
    assert sorted(tier0 + tier1) == list(range(40))


def test_depth_limits_in_flight_and_claims_are_m_items():
    route = CompletionDriven(m=3, depth=7).start(2, all_tiers(50, 2))
    claims = route.start()
    assert [len(c.items) for c in claims] == [3, 3, 3, 3]  # room for two claims of 3 per tier
    assert len(route.tier_in_flight(0)) == 6 and len(route.tier_in_flight(1)) == 6
    assert route.complete(0, 0) == []  # room 2 < m: wait
    new = route.complete(0, 1)
    assert new == [Claim(0, (6, 7, 8), False)]


# -- varying speeds -----------------------------------------------------------------------------------


def test_split_follows_a_mid_batch_speed_change():
    n, switch = 1200, 100.0  # tier 0 at 3/s until t=100 (300 items read together with tier 1), then 1/s

    def b0(t):
        return 3.0 if t < switch else 1.0

    r = simulate(CompletionDriven(2), n, (b0, 1.0))
    fluid = switch + (n - 4.0 * switch) / 2.0  # the bound for these bandwidth curves: 500 s
    assert r.done
    assert fluid - 1e-6 <= r.finish <= fluid + residual(2, (1.0, 1.0)) + 1.0  # + one re-sample step
    expected0 = 3.0 * switch + (fluid - switch)  # tier 0's integral of bandwidth: 700 items
    assert abs(r.reads[0] - expected0) <= 2 * 2 + 2
    # A split tuned to the first phase (75:25) pays Eq. 6 in the second.
    static = simulate(StaticSplit(0.75), n, (b0, 1.0))
    assert static.finish > 1.2 * r.finish


def test_split_follows_when_the_fast_tier_changes_sides():
    n = 1000

    def b0(t):
        return 1.0 if t < 100 else 4.0

    def b1(t):
        return 4.0 if t < 100 else 1.0

    r = simulate(CompletionDriven(2), n, (b0, b1))
    assert r.finish <= n / 5.0 + 2.0
    assert abs(r.reads[0] - (100 + 4 * (r.finish - 100))) <= 6


# -- stalls ---------------------------------------------------------------------------------------------


def test_a_stalled_tier_leaves_the_rest_to_the_other_tier():
    n = 200
    r = simulate(CompletionDriven(2), n, (1.0, 0.0))
    assert r.done and all(r.found)
    assert r.reads == [n, 0]
    assert r.finish == pytest.approx(n / 1.0, abs=residual(2, (1.0,)))
    assert any(c.steal and c.tier == 0 for c in r.claims)
    # The stalled tier's reads are still outstanding: its buffers must stay owned by the engine.
    assert r.duplicates == 4


def test_a_tier_with_enormous_latency_cannot_hold_the_batch_hostage():
    n = 200
    r = simulate(CompletionDriven(2), n, (2.0, 2.0), latency=(0.0, 1e9))
    assert r.done and r.reads == [n, 0]
    assert r.finish <= n / 2.0 + residual(2, (2.0,))


def test_a_tier_that_stalls_mid_batch():
    r = simulate(CompletionDriven(4), 500, (1.0, lambda t: 1.0 if t < 50 else 0.0))
    assert r.done and all(r.found)
    assert r.finish <= 50 + (500 - 100) / 1.0 + residual(4, (1.0,)) + 1.0


def test_static_split_waits_for_a_stalled_tier():
    r = simulate(StaticSplit(0.5), 20, (1.0, 0.0))
    assert not r.done and r.finish == math.inf


# -- holders and failures ---------------------------------------------------------------------------------


def test_items_are_claimed_only_by_their_holders():
    rng = random.Random(7)
    n = 300
    holders = [rng.choice([0b01, 0b10, 0b11, 0b11]) for _ in range(n)]
    r = simulate(CompletionDriven(2), n, (3.0, 1.0), holders=holders)
    assert r.done and all(r.found)
    for c in r.claims:
        for i in c.items:
            assert holders[i] >> c.tier & 1
    only1 = sum(1 for h in holders if h == 0b10)
    assert r.reads[1] >= only1


def test_item_with_no_holder_is_missing_from_the_start():
    route = CompletionDriven().start(2, [0b11, 0, 0b01])
    claims = route.start()
    assert all(1 not in c.items for c in claims)
    for c in claims:
        for i in c.items:
            route.complete(c.tier, i)
    assert route.done and route.found == [True, False, True]


def test_a_failed_read_falls_back_to_another_replica():
    n = 50
    bad = {(0, i) for i in range(0, n, 3)}
    r = simulate(CompletionDriven(2), n, (1.0, 1.0), fail=lambda t, i: (t, i) in bad)
    assert r.done and all(r.found)
    assert r.retries >= 1


def test_a_read_failing_on_every_holder_is_reported_missing():
    holders = [0b11] * 10
    holders[3] = 0b01  # only tier 0 holds item 3, and tier 0 fails it
    fails = {(0, 3), (0, 5), (1, 5)}
    r = simulate(CompletionDriven(2), 10, (1.0, 1.0), holders=holders, fail=lambda t, i: (t, i) in fails)
    assert r.done
    assert [i for i, f in enumerate(r.found) if not f] == [3, 5]


@pytest.mark.parametrize("policy", [StaticSplit(0.5), SingleTier(0)])
def test_static_policies_fall_back_without_stealing(policy):
    n = 40
    fails = {(0, i) for i in range(0, 20, 2)}
    r = simulate(policy, n, (1.0, 1.0), fail=lambda t, i: (t, i) in fails)
    assert r.done and all(r.found)
    assert not any(c.steal for c in r.claims)
    assert r.retries == len(fails)


# -- three tiers -----------------------------------------------------------------------------------------


def test_three_tiers_all_stay_busy_and_meet_the_bound():
    n, speeds = 900, (3.0, 2.0, 1.0)
    r = simulate(CompletionDriven(2), n, speeds)
    assert r.done and all(r.found)
    assert r.finish <= n / 6.0 + residual(2, speeds)
    for k, b in enumerate(speeds):
        assert abs(r.reads[k] - n * b / 6.0) <= 2 * 2 * 2
    first = [c for c in r.claims[:3]]
    assert first[0].items[0] == 0 and first[2].items[0] == n - 1
    assert first[1].items[0] == 2 + (n - 2) // 2  # middle tier: the middle of the unread run [2, n)


def test_four_tiers_middle_tiers_split_the_largest_gap():
    route = CompletionDriven(1, 1).start(4, all_tiers(100, 4))
    claims = route.start()
    assert [c.items[0] for c in claims] == [0, 50, 25, 99]


# -- static policies ---------------------------------------------------------------------------------------


def test_static_split_assigns_exactly():
    n = 100
    r = simulate(StaticSplit(0.75), n, (3.0, 1.0))
    got0 = sorted(i for c in r.claims if c.tier == 0 for i in c.items)
    got1 = sorted(i for c in r.claims if c.tier == 1 for i in c.items)
    assert got0 == list(range(75)) and got1 == list(range(75, 100))
    assert r.finish == pytest.approx(max(75 / 3.0, 25 / 1.0))
    assert r.duplicates == 0


def test_static_split_penalty_matches_eq6():
    n = 400  # 75:25 at 2 and 1 GB/s-like speeds: 12.5% over the bound
    r = simulate(StaticSplit(0.75), n, (2.0, 1.0))
    assert r.gap == pytest.approx(0.125)


def test_static_split_three_tiers_by_shares():
    r = simulate(StaticSplit((0.5, 0.3, 0.2)), 10, (1.0, 1.0, 1.0))
    assert r.reads == [5, 3, 2]


def test_single_tier_reads_everything_it_holds():
    holders = [0b11] * 10
    holders[4] = 0b01
    r = simulate(SingleTier(1), 10, (1.0, 1.0), holders=holders)
    assert r.reads == [1, 9] and all(r.found)


# -- parsing and determinism -------------------------------------------------------------------------------


def test_parse_policy():
    assert parse_policy("kvstream") == CompletionDriven()
    assert parse_policy("kvstream:m=4,depth=8") == CompletionDriven(4, 8)
    assert parse_policy("static-0.75") == StaticSplit(0.75)
    assert parse_policy("static-0.75").name == "static-0.75"
    assert parse_policy("tier0") == SingleTier(0)
    assert parse_policy("tier1:m=4").name == "tier1"
    assert parse_policy("static-0.5/0.3/0.2").name == "static-0.5/0.3/0.2"
    assert parse_policy(" KVStream ").name == "kvstream"
    for bad in ["", "fastest", "static-1.5", "kvstream:m=0", "kvstream:q=1", "kvstream:m=4,depth=2", "tier0:m=0",
                "tier1:m=4,depth=2", "static-0.5:m=0"]:
        with pytest.raises(ValueError):
            parse_policy(bad)


def test_same_completions_give_the_same_claims_log():
    def drive():
        rng = random.Random(3)
        route = CompletionDriven(2).start(2, all_tiers(30, 2))
        flying = [(c.tier, i) for c in route.start() for i in c.items]
        while flying:
            tier, item = flying.pop(rng.randrange(len(flying)))
            flying += [(c.tier, i) for c in route.complete(tier, item, True) for i in c.items]
        return route.claims_log

    assert drive() == drive()


def test_completing_a_read_that_is_not_in_flight_is_a_bug():
    route = CompletionDriven().start(2, all_tiers(4, 2))
    route.start()
    with pytest.raises(ValueError):
        route.complete(1, 0)


# -- invariants -----------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    n_tiers = draw(st.integers(1, 4))
    n = draw(st.integers(0, 40))
    holders = draw(st.lists(st.integers(0, (1 << n_tiers) - 1), min_size=n, max_size=n))
    fails = draw(st.sets(st.tuples(st.integers(0, n_tiers - 1), st.integers(0, max(n - 1, 0)))))
    m = draw(st.integers(1, 4))
    depth = draw(st.integers(m, 2 * m + 2))
    kind = draw(st.sampled_from(["kvstream", "static", "single"]))
    if kind == "kvstream":
        policy = CompletionDriven(m, depth)
    elif kind == "static":
        policy = StaticSplit(draw(st.floats(0.0, 1.0)), m, depth)
    else:
        policy = SingleTier(draw(st.integers(0, n_tiers - 1)), m, depth)
    seed = draw(st.integers(0, 2**32 - 1))
    return n_tiers, holders, fails, policy, seed


@settings(max_examples=300, deadline=None)
@given(batches())
def test_router_invariants(batch):
    n_tiers, holders, fails, policy, seed = batch
    rng = random.Random(seed)
    route = policy.start(n_tiers, holders)
    readers = [set() for _ in holders]
    failed = [set() for _ in holders]
    flying: list[tuple[int, int]] = []

    def take(claims):
        for c in claims:
            assert 1 <= len(c.items) <= route.m
            assert c.steal is False or isinstance(policy, CompletionDriven)
            for i in c.items:
                assert holders[i] >> c.tier & 1, "claimed by a non-holder"
                assert c.tier not in failed[i], "re-claimed by a tier that failed it"
                assert c.tier not in readers[i], "claimed twice by one tier"
                readers[i].add(c.tier)
                assert len(readers[i]) <= 2, "more than two concurrent readers"
                flying.append((c.tier, i))
        for k in range(n_tiers):
            assert len(route.tier_in_flight(k)) <= route.depth

    take(route.start())
    while flying:
        tier, item = flying.pop(rng.randrange(len(flying)))
        readers[item].discard(tier)
        if (tier, item) in fails:
            failed[item].add(tier)
        was_done = route.done
        claims = route.complete(tier, item, (tier, item) not in fails)
        if was_done:
            assert claims == []
        take(claims)
    assert route.done and route.in_flight == 0
    for i, h in enumerate(holders):
        some_holder_succeeds = any(h >> k & 1 and (k, i) not in fails for k in range(n_tiers))
        assert route.found[i] == some_holder_succeeds
