"""admission.py: which tiers a put's new pages go to (pure: sizes, bandwidths, capacities in)."""
from __future__ import annotations

from kvstream_hicache.admission import admit, fit_capacity


def test_a_capacity_keeps_the_first_pages_of_a_batch_that_fit():
    """A batch is a prefix (SGLang's batch_set, an LMCache task): its head is what the pages after it need,
    and the most recent once written (reverse batch order)."""
    targets = [0b11] * 5
    skipped = fit_capacity([10] * 5, targets, [25, None])
    assert targets == [0b11, 0b11, 0b10, 0b10, 0b10]  # tier 0 holds 25: the first two pages
    assert skipped == [3, 0]


def test_once_a_page_does_not_fit_no_later_one_is_placed():
    """LRU order: a smaller, less recent page placed behind one that did not fit would outlive it (and
    serve nothing: a prefix's leading run stops at the page that is missing)."""
    targets = [0b1, 0b1, 0b1]
    assert fit_capacity([1, 50, 10], targets, [30]) == [2]
    assert targets == [0b1, 0, 0]


def test_pages_of_a_tier_without_a_limit_all_go_there():
    targets = [0b1, 0b1]
    assert fit_capacity([1 << 40, 1 << 40], targets, [None]) == [0] and targets == [0b1, 0b1]


def test_replicate_all_keeps_every_target():
    assert admit(100, 0b111, [0, 10**9, 10**9], [1.0, 1.0, 1.0], "all", 0.0) == 0b111


def test_budget_skips_a_replica_that_would_finish_after_its_home_copy():
    # home (tier 0): 100 + 100 bytes at 100 B/s = 2 s; tier 1: 300 + 100 at 100 B/s = 4 s > max(2, 1)
    assert admit(100, 0b11, [100, 300], [100.0, 100.0], "budget", 1.0) == 0b01
    # a slack of 5 s lets it in
    assert admit(100, 0b11, [100, 300], [100.0, 100.0], "budget", 5.0) == 0b11


def test_budget_takes_every_replica_while_a_bandwidth_is_unmeasured():
    assert admit(100, 0b11, [0, 10**9], [100.0, 0.0], "budget", 0.0) == 0b11
    assert admit(100, 0b11, [0, 10**9], [0.0, 100.0], "budget", 0.0) == 0b11


def test_the_home_tier_is_the_first_target_and_always_kept():
    """Tier 0 is not a target (failed, full): tier 1 is home, tier 2 a replica judged against it."""
    assert admit(100, 0b110, [10**9, 0, 10**9], [1.0, 100.0, 100.0], "budget", 0.0) == 0b010
    assert admit(100, 0b110, [10**9, 0, 0], [1.0, 100.0, 100.0], "budget", 0.0) == 0b110


def test_no_target_admits_nothing():
    assert admit(100, 0, [0, 0], [1.0, 1.0], "budget", 1.0) == 0
