"""TierFlow: the window follows the device, from the latencies it reports (flow.py).

Each test drives one TierFlow against a simulated device, the way the read path does: keep the
window full of requests of ``flow.request`` bytes, report every completion with its latency and
the tier's busy time. Devices: one that serves requests one at a time (a loop device's worker, a
throttled disk), one with P parallel channels (an NVMe drive, a parallel file system), and one
that stops answering.
"""
from __future__ import annotations

import heapq

import pytest

from kvstream_hicache.flow import (EXPLORE_EVERY, HELD, MAX_REQUEST, MIN_REQUEST, MIN_REQUESTS, OPEN, RULES, STALL_MIN_S,
                                   SlowerTiers, TierFlow)

MIB = 1 << 20


class Device:
    """``channels`` servers, each moving ``rate`` bytes/s after ``overhead`` s per request; FIFO."""

    def __init__(self, rate: float, channels: int = 1, overhead: float = 50e-6):
        self.rate, self.channels, self.overhead = rate, channels, overhead
        self.free_at = [0.0] * channels

    def submit(self, now: float, nbytes: int) -> float:
        """Completion time of a request submitted at ``now``."""
        k = min(range(self.channels), key=lambda c: self.free_at[c])
        start = max(now, self.free_at[k])
        self.free_at[k] = start + self.overhead + nbytes / self.rate
        return self.free_at[k]


def drive(flow: TierFlow, device: Device, total: int, batch: int = 256 * MIB) -> tuple[float, list[int]]:
    """Read ``total`` bytes through ``flow`` in batches of ``batch`` (the tier idles between them);
    returns (throughput while busy, windows seen at each completion)."""
    clock = getattr(flow, "_test_clock", [0.0, 0.0])  # [now, busy so far]: runs across calls
    flow._test_clock = clock
    windows: list[int] = []
    busy0 = clock[1]
    for start in range(0, total, batch):
        clock[0] += 1.0  # idle between batches
        _batch(flow, device, min(batch, total - start), clock, windows)
    return total / (clock[1] - busy0), windows


def _batch(flow: TierFlow, device: Device, total: int, clock: list[float], windows: list[int]) -> None:
    now = t_start = clock[0]
    in_flight = submitted = done_bytes = 0
    events: list[tuple[float, int, int, float, int]] = []  # (done_at, seq, nbytes, t0, ahead)
    seq = 0
    while done_bytes < total:
        while submitted < total and flow.room(in_flight) >= flow.request:
            n = min(flow.request, total - submitted)
            flow.submitted(now, in_flight)
            heapq.heappush(events, (device.submit(now, n), seq, n, now, in_flight))
            seq += 1
            in_flight += n
            submitted += n
        done_at, _, n, t0, ahead = heapq.heappop(events)
        now = done_at
        in_flight -= n
        done_bytes += n
        flow.completed(n, now - t0, ahead, now, clock[1] + (now - t_start))  # busy all batch long
        windows.append(flow.window)
    clock[0] = now
    clock[1] += now - t_start


def capability(device: Device, request: int) -> float:
    """The device's throughput with every channel busy with requests of ``request`` bytes."""
    return device.channels * request / (device.overhead + request / device.rate)


def test_one_at_a_time_device_gets_a_small_window_and_full_speed():
    flow = TierFlow(MIB, 64 * MIB)
    device = Device(5e9)
    rate, windows = drive(flow, device, 4 << 30)
    assert rate > 0.97 * capability(device, flow.request)
    # Nothing is gained by queueing more than a request or two behind the one in service.
    assert flow.window <= 3 * flow.request, flow
    assert flow.window >= MIN_REQUESTS * flow.request


def test_parallel_device_window_grows_until_every_channel_is_busy():
    flow = TierFlow(MIB, 256 * MIB)
    device = Device(1e9, channels=16)  # 16 GB/s only with 16 requests in service at once
    rate, windows = drive(flow, device, 16 << 30)
    assert rate > 0.9 * capability(device, flow.request), (rate, flow)
    assert flow.window >= 16 * flow.request * 0.8, flow


def test_window_never_passes_the_ceiling():
    flow = TierFlow(MIB, 8 * MIB)
    _, windows = drive(flow, Device(1e9, channels=64), 2 << 30)
    assert max(windows) <= 8 * MIB


@pytest.mark.parametrize("block", [MIB, 64 << 10])
def test_slow_tier_keeps_small_requests(block):
    """A request carries about a millisecond of the tier's bandwidth, but at least MIN_REQUEST: at
    100 MB/s that is 1 MiB, so what a slow tier has in flight when a batch ends stays small."""
    flow = TierFlow(block, 64 * MIB)
    device = Device(100e6)
    rate, _ = drive(flow, device, 256 * MIB)
    assert rate > 0.97 * capability(device, flow.request)
    assert flow.request == MIN_REQUEST == MIB
    assert flow.window <= 4 * MIB


def test_fast_tier_takes_large_requests_up_to_the_cap():
    flow = TierFlow(MIB, 256 * MIB)
    drive(flow, Device(20e9, channels=4), 8 << 30)
    assert flow.request == MAX_REQUEST


def test_window_follows_the_device_when_it_slows_down_and_back():
    flow = TierFlow(MIB, 256 * MIB)
    drive(flow, Device(1e9, channels=16), 8 << 30)
    wide = flow.window
    drive(flow, Device(2e9, channels=1), 8 << 30)  # the same tier, now serving one at a time
    assert flow.window < wide / 3, (wide, flow)
    drive(flow, Device(1e9, channels=16), 16 << 30)
    assert flow.window > wide / 2, (wide, flow)


def test_overdue_only_with_reads_in_flight_and_after_many_usual_latencies():
    flow = TierFlow(MIB, 64 * MIB)
    drive(flow, Device(1e9), 64 * MIB)
    now = 100.0
    flow.submitted(now, 0)
    assert not flow.overdue(now, MIB)
    assert flow.stall_after == pytest.approx(max(STALL_MIN_S, 8 * flow.latency))
    assert flow.overdue_at() == pytest.approx(now + flow.stall_after)
    assert not flow.overdue(now + flow.stall_after * 0.99, MIB)
    assert flow.overdue(now + flow.stall_after * 1.01, MIB)
    assert not flow.overdue(now + 1000, 0)  # nothing in flight: idle, not stalled


def _calls(rule: SlowerTiers, rates: tuple[float, float], n: int, size: int = 64 * MIB) -> list[int]:
    """``n`` routed calls of ``size``, each read at ``rates[r]`` by the rule ``r`` it was given."""
    chosen = []
    for _ in range(n):
        r = rule.rule(size)
        chosen.append(r)
        rule.done(r, size, size, size / rates[r])
    return chosen


@pytest.mark.parametrize("rates, best", [
    ((1.2e9, 2.0e9), HELD),  # GlusterFS beside a disk at 1 MiB pages: held 1.14x the disk alone, open 0.84x
    ((2.5e9, 1.0e9), OPEN),  # tiers on devices of their own (a deep network tier that needs its queue)
])
def test_routed_calls_take_the_rule_that_reads_faster_and_try_the_other_now_and_then(rates, best):
    """A slower tier may cost the faster one more than it adds (a FUSE tier whose daemons share the
    reader's two cores): after calls by each rule, the calls take the faster, and one in EXPLORE_EVERY
    the other, to see a change; a call after one of the other rule is taken again, to be counted."""
    rule = SlowerTiers()
    chosen = _calls(rule, rates, 3 + 8 * EXPLORE_EVERY)
    assert chosen[:3] == [OPEN, HELD, HELD]  # each rule in turn (the first held call after an open one: again)
    other = 1 - best
    assert chosen[3:].count(other) == 2 * 8, chosen  # then one call in EXPLORE_EVERY the other, twice
    assert max(RULES, key=rule.rates[(64 * MIB).bit_length()].__getitem__) == best


@pytest.mark.parametrize("after_open, after_held", [(0.3, 1.0), (1.0, 0.3)])
def test_a_call_after_one_of_the_other_rule_is_counted_only_when_taken_again(after_open, after_held):
    """A call's reads run on past its end (a FUSE tier's daemons still busy with them, a throttled
    device's debt), so the call after one of the other rule reads slower for them: held calls read 0.3x
    as fast after open ones as after held ones (GlusterFS beside the disk, 256 KiB). Such a call is not
    counted, and the next call of its size takes its rule again and counts: the calls take the rule that
    reads faster in a run of its own (before: every exploration read after the other rule, and the calls
    stayed with the slower one)."""
    rule, chosen, size = SlowerTiers(), [], 64 * MIB
    for _ in range(3 + 8 * EXPLORE_EVERY):
        r = rule.rule(size)
        before = chosen[-1] if chosen else r
        slowed = 1.0 if before == r else after_open if before == OPEN else after_held
        rule.done(r, size, size, size / ({OPEN: 1.2e9, HELD: 2.0e9}[r] * slowed))
        chosen.append(r)
    assert chosen[-4 * EXPLORE_EVERY:].count(HELD) == 4 * EXPLORE_EVERY - 8, chosen
    assert rule.rates[size.bit_length()] == [pytest.approx(1.2e9), pytest.approx(2.0e9)]


def test_the_rule_follows_a_change_within_a_few_explorations():
    """The machine's load ends (or the page size changes): the open rule now reads faster, and the
    calls go back to it after a few of their explorations."""
    rule = SlowerTiers()
    _calls(rule, (1.0e9, 2.0e9), 4 * EXPLORE_EVERY)
    after = _calls(rule, (2.0e9, 1.0e9), 12 * EXPLORE_EVERY)
    assert after[-4 * EXPLORE_EVERY:].count(OPEN) == 4 * EXPLORE_EVERY - 8, after  # held only to explore


def test_calls_of_two_sizes_in_turn_take_the_rule_that_reads_faster_at_each():
    """Each call costs some time besides its bytes (2 ms here), so a small call reads fewer bytes a second
    under either rule. A server's calls of two sizes in turn (a large batch, a small one), the held rule
    1.7x faster at every size: the calls hold their slower tiers but in the explorations of each size
    (before, rates compared across sizes had the held rule measured on the small calls alone: 452 calls
    in 480 read open)."""
    rule, chosen = SlowerTiers(), []
    for i in range(4 + 32 * EXPLORE_EVERY):
        nbytes = (64 * MIB, 256 << 10)[i % 2]
        r = rule.rule(nbytes)
        rule.done(r, nbytes, nbytes, nbytes / (2.0e9 if r == HELD else 1.2e9) + 2e-3)
        chosen.append(r)
    after = chosen[4:]
    assert len(after) - after.count(HELD) <= 2 * len(after) // EXPLORE_EVERY, (after, rule.rates)
