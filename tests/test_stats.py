"""stats.py: the busy clock is a union of intervals, counters and shares, the bounded history, and the
per-batch bound and gap (the paper's Eq. 3) from bytes and busy time."""
from __future__ import annotations

import pytest

from helpers import FakeClock
from kvstream_hicache.stats import HISTORY, TIER_COUNTERS, TOTAL_COUNTERS, BusyClock, Stats, batch_figures


def test_the_busy_clock_counts_overlapping_ops_once():
    clock = FakeClock(0.0)
    busy = BusyClock(2, clock)
    busy.started(0)
    clock.advance(1.0)
    busy.started(0, 2)  # overlaps the first: no extra time
    clock.advance(1.0)
    busy.finished(0)
    clock.advance(1.0)
    busy.finished(0, 2)  # idle from here
    clock.advance(5.0)
    assert busy.total(0) == pytest.approx(3.0) and busy.total(1) == 0.0
    busy.started(1)
    clock.advance(0.5)
    assert busy.snapshot() == pytest.approx([3.0, 0.5])  # an open interval counts up to now
    busy.started(1, 0)  # nothing started: no new interval
    assert busy.in_flight == [0, 1]


def test_counters_snapshot_and_read_shares():
    stats = Stats(2)
    stats.add(0, "bytes_served", 300)
    stats.add(1, "bytes_served", 100)
    stats.add(1, "errors")
    stats.total("gets")
    stats.total("pages_found", 4)
    snap = stats.snapshot()
    assert set(snap["tiers"][0]) == set(TIER_COUNTERS) | {"read_share"}
    assert set(TOTAL_COUNTERS) <= set(snap)
    assert [t["read_share"] for t in snap["tiers"]] == pytest.approx([0.75, 0.25])
    assert snap["tiers"][1]["errors"] == 1 and snap["gets"] == 1 and snap["pages_found"] == 4
    snap["tiers"][0]["bytes_served"] = 0  # a copy: the counters are untouched
    assert stats.snapshot()["tiers"][0]["bytes_served"] == 300
    assert Stats(1).snapshot()["tiers"][0]["read_share"] == 0.0  # nothing served: no division


def test_the_batch_history_is_bounded_and_the_last_batch_kept():
    stats = Stats(1)
    for i in range(HISTORY + 5):
        stats.record_batch({"i": i})
    snap = stats.snapshot()
    assert len(snap["history"]) == HISTORY and snap["history"][0] == {"i": 5}
    assert snap["last_batch"] == {"i": HISTORY + 4}


def test_the_batch_bound_is_the_bytes_over_the_sum_of_the_tier_rates():
    # tier 0: 600 bytes in 2 s busy (300 B/s); tier 1: 200 bytes in 2 s (100 B/s): bound 800/400 = 2 s
    f = batch_figures(2.5, 800, [600, 200], [2.0, 2.0], [600, 200])
    assert f["bound_s"] == pytest.approx(2.0) and f["gap"] == pytest.approx(0.25)
    assert f["throughput"] == pytest.approx(320.0)
    assert [t["bandwidth"] for t in f["tiers"]] == pytest.approx([300.0, 100.0])
    idle = batch_figures(0.0, 0, [0, 0], [0.0, 0.0], [0, 0])  # nothing read: no bound, no gap
    assert idle["bound_s"] == 0.0 and idle["gap"] is None and idle["throughput"] == 0.0
