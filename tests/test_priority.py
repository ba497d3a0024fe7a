"""ReadPriority (priority.py), driven by a fake clock: which tiers' writes wait for reads, for how long
a stalled read holds them, the epoch that tells an undisturbed write, and the listeners a tier's last
reader wakes."""
from __future__ import annotations

import pytest

from helpers import FakeClock
from kvstream_hicache.priority import STALL_S, ReadPriority

T0, T1, T2 = 1, 2, 4  # tier bitmasks


@pytest.fixture
def clock():
    return FakeClock()


def test_writes_wait_on_the_tiers_a_get_reads_and_only_those(clock):
    prio = ReadPriority(3, clock=clock)
    assert prio.held() == (0, None)
    prio.begin(T0 | T2)
    mask, until = prio.held()
    assert mask == T0 | T2 and until == pytest.approx(STALL_S)
    assert prio.reading(0) and not prio.reading(1) and prio.reading(2)
    prio.end(T0 | T2)
    assert prio.held() == (0, None)


def test_two_gets_on_one_tier_hold_it_until_both_end(clock):
    prio = ReadPriority(2, clock=clock)
    prio.begin(T0)
    prio.begin(T0 | T1)
    prio.end(T0)
    assert prio.held()[0] == T0 | T1
    prio.end(T0 | T1)
    assert prio.held()[0] == 0


def test_a_stalled_read_lets_the_writes_go_and_progress_holds_them_again(clock):
    prio = ReadPriority(2, clock=clock)
    prio.begin(T0 | T1)
    clock.advance(STALL_S * 0.6)
    prio.progress(1)  # tier 1 completed a read: it is serving; tier 0 made no progress
    mask, until = prio.held()
    assert mask == T0 | T1 and until == pytest.approx(STALL_S * 0.4)  # the first to stop waiting
    clock.advance(STALL_S * 0.5)
    mask, until = prio.held()
    assert mask == T1 and until == pytest.approx(STALL_S * 0.5)  # tier 0 stalled: its writes go
    prio.progress(0)
    assert prio.held()[0] == T0 | T1


def test_the_epoch_moves_when_reads_start_on_an_idle_tier_only(clock):
    prio = ReadPriority(2, clock=clock)
    assert (prio.epoch(0), prio.epoch(1)) == (0, 0)
    prio.begin(T0)
    prio.begin(T0)  # already read from: the same epoch
    assert (prio.epoch(0), prio.epoch(1)) == (1, 0)
    prio.end(T0)
    prio.end(T0)
    prio.begin(T0 | T1)
    assert (prio.epoch(0), prio.epoch(1)) == (2, 1)
    prio.end(T0 | T1)


def test_the_last_reader_of_a_tier_wakes_the_listeners_with_the_lock_released(clock):
    prio = ReadPriority(2, clock=clock)
    seen = []
    prio.listen(lambda: seen.append(prio.held()))  # held() takes the lock: a deadlock if still held
    prio.begin(T0)
    prio.begin(T0 | T1)
    prio.end(T0)  # tier 0 still read by the second get: no tier freed
    assert seen == []
    prio.end(T0 | T1)
    assert seen == [(0, None)]


def test_off_nothing_waits_but_reads_are_still_tracked(clock):
    prio = ReadPriority(2, enabled=False, clock=clock)
    prio.begin(T0)
    assert prio.held() == (0, None)
    assert prio.reading(0) and prio.epoch(0) == 1
    prio.end(T0)
