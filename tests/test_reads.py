"""The read path's requests: merged reads, reads straight into caller memory, memory bounds.

What the engine tests (test_engine.py) show for every read holds here too; these tests pin down
how the reads are issued: a page's adjacent blocks go out as one request, a block no other tier
could deliver lands straight in the caller's pages (no staging copy), and the call then waits for
it however long the device takes, since returning earlier would let it land in memory the caller
reuses. Real files with O_DIRECT, both I/O engines; no timing assertions.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
import resource
import threading
import time

import numpy as np
import pytest

from kvstream_hicache.faults import Fault, FaultPlan, TierFaultPlan
from kvstream_hicache.flow import HELD, MAX_REQUEST, OPEN, RULE_NAMES, RULES
from kvstream_hicache.io import HUGE_PAGE_SIZE, OP_READ, AlignedBuffer, ThreadRing, open_ring
from kvstream_hicache.layout import HEADER_SIZE
from kvstream_hicache.memory import HugePageMap
from kvstream_hicache.router import CompletionDriven

from helpers import (PageSet, Pages, flip_byte, io_uring_fds, key, make_array_engine as make_engine, make_ring,
                     messages, open_fds, segments_of, sq_tail, wait_until)

MIB = 1 << 20
KIB = 1 << 10


def stored(dirs, n, io_engine="uring", plan=None, aligned=True, size=4 * MIB, **settings):
    pages = Pages(n, aligned=aligned, size=size)  # 4 MiB pages: 2 MiB segments, huge-page backed
    keys = [key(i, "reads") for i in range(n)]
    engine = make_engine(dirs, io_engine, fault_plan=plan, **settings)
    assert engine.put(keys, pages.src_segments) == [True] * n
    for a, n in (seg for page in pages.dst_segments for seg in page):  # as a server registers its pool
        engine.register_memory(a, n)
    return engine, pages, keys


def huge(pages: Pages) -> bool:
    """Whether the destination buffers are huge-page backed (THP may be off, or short of pages)."""
    m = HugePageMap(background=False)
    return all(m.huge(a, n) for page in pages.dst_segments for a, n in page)


def test_single_holder_reads_land_in_caller_memory_in_merged_requests(tier_dirs, io_engine):
    engine, pages, keys = stored(tier_dirs[:1], 6, io_engine, chunk="64K")
    with engine:
        assert engine.get(keys, pages.dst_segments) == [True] * 6
        assert all(pages.equal(i) for i in range(6))
        batch = engine.last_batch
        assert huge(pages) == bool(HUGE_PAGE_SIZE)
        if not huge(pages):
            pytest.fail("THP is off or out of huge pages: in-place reads cannot be shown here")
        assert batch["direct_bytes"] == 6 * 4 * MIB  # no staging copy at all
        assert batch["items"] == 6 * 64  # 64 blocks of 64 KiB per page ...
        # ... read as larger requests: a request carries ~1 ms of the tier's rate and at least 1 MiB
        # (flow.py): 16 blocks of 64 KiB
        assert batch["requests"] <= batch["items"] / 16
        assert engine._reads.pool.allocated == 0


@pytest.mark.parametrize("memory", ["huge", "small"])
def test_pages_one_tier_alone_holds_go_out_whole_whatever_the_flows_request_size(tier_dirs, io_engine, memory):
    """The flow keeps a tier's requests near 1 ms of its rate so that little is left in flight for
    another tier to wait on when the batch ends; for blocks no other tier can deliver that does not
    apply, and a page goes out in one request (up to MAX_REQUEST), in place or staged."""
    engine, pages, keys = stored(tier_dirs[:1], 4, io_engine, chunk="1M", size=8 * MIB)
    with engine:
        flow = engine._reads.io.flows[0]
        flow.window, flow.request = 64 * MIB, MIB  # a tier its flow sizes to 1 MiB requests
        if memory == "small":  # host-pool memory in 4 KiB pages: staged
            engine._reads.memory.takes = lambda segments: False
        assert engine.get(keys, pages.dst_segments) == [True] * 4
        assert all(pages.equal(i) for i in range(4))
        assert engine.last_batch["items"] == 32
        assert engine.last_batch["requests"] == 4  # one per page (1 MiB requests: 32)
        assert (engine.last_batch["direct_bytes"] == 0) == (memory == "small" or not HUGE_PAGE_SIZE)


class _Watched(CompletionDriven):
    """The default policy, recording for each claim how many items its tier still had in flight."""

    def start(self, n_tiers, holders):
        route = super().start(n_tiers, holders)
        record = route._record

        def watched(tier, items, steal):
            self.in_flight.append(len(route._flight[tier]))
            return record(tier, items, steal)

        route._record = watched
        return route


def test_a_tier_claims_again_while_its_reads_are_in_flight(tier_dirs, io_engine):
    """A claim needs room for all of it. Claims as large as a tier's window (single-holder pages
    claim what an 8 MiB request carries) let it claim again only once every read in flight had
    completed, so the device sat idle through each round of completions: 2 MiB pages read at 0.6x
    nixl's rate. Claims are at most half the window, so the next claim goes out while reads are in
    flight (in the old rule none did)."""
    engine, pages, keys = stored(tier_dirs[:1], 16, io_engine, chunk="1M", size=2 * MIB)
    with engine:
        flow = engine._reads.io.flows[0]
        flow.window = flow.ceiling = 6 * MIB  # 6 blocks in flight at most; a page one tier holds
        engine._reads.memory.takes = lambda segments: False  # would claim 8 (host-pool memory)
        policy = _Watched()
        object.__setattr__(policy, "in_flight", [])
        assert engine.get(keys, pages.dst_segments, policy=policy) == [True] * 16
        assert all(pages.equal(i) for i in range(16))
        assert engine.last_batch["items"] == 32
        later = policy.in_flight[1:]  # the first claim finds nothing in flight, by definition
        assert later and sum(n > 0 for n in later) >= len(later) // 2, policy.in_flight


@pytest.mark.parametrize("holders,in_place", [(1, True), (1, False), (2, False)])
def test_a_tier_that_alone_holds_a_call_queues_past_its_window(tier_dirs, io_engine, holders, in_place):
    """The flow's window stays near where the device's latency starts to climb, so that little is
    left in flight for another tier at the end of a batch; when one tier alone holds every page of
    a call there is no other tier, and it queues deeper. Read in place it keeps its whole budget
    (the window's ceiling) in flight, as nixl keeps a whole batch (a deeper queue read 0.51-1.15x ->
    0.94-1.34x nixl); staged it keeps half of it (at least STAGED_DEPTH, two of the largest
    requests), so that what lands is still in the CPU's cache when it is copied out (the whole 32 MiB
    budget read 0.74-0.87x 16 MiB on a RAM tier, into sglang's host pool). With a second holder the
    window still bounds each tier."""
    engine, pages, keys = stored(tier_dirs[:holders], 32, io_engine, chunk="1M", size=2 * MIB)
    with engine:
        for flow in engine._reads.io.flows:
            flow.window, flow.ceiling = 2 * MIB, 48 * MIB  # a device whose latency climbs at once
            flow.completed = lambda *a, **k: None  # ... and stays so for this call
        engine._reads.memory.takes = lambda segments: in_place
        policy = _Watched()
        object.__setattr__(policy, "in_flight", [])
        assert engine.get(keys, pages.dst_segments, policy=policy) == [True] * 32
        assert all(pages.equal(i) for i in range(32))
        assert (engine.last_batch["direct_bytes"] > 0) == in_place
        most = max(policy.in_flight)  # items (1 MiB blocks) a tier had in flight when it claimed more
        if holders == 2:
            assert most <= 1, policy.in_flight  # claims of 1 item in a window of 2
        elif in_place:  # past half the budget, up to all 48 MiB of it
            assert most > (24 * MIB - MAX_REQUEST) // MIB, policy.in_flight
        else:  # past the 2 MiB window, within half the budget (24 MiB): claims of 8 MiB with room for them
            assert 2 < most <= (24 * MIB - MAX_REQUEST) // MIB, policy.in_flight


def test_windows_count_the_bytes_pages_smaller_than_a_block_carry(tier_dirs, io_engine):
    """A window is bytes; a tier's depth in items is the window over the most bytes one item
    carries. A page smaller than a block is one item of its own size: counted in whole 1 MiB
    blocks, a 2 MiB window of 256 KiB pages held 2 of them (512 KiB in flight, claims of one page),
    and two tiers read 0.85x one tier into sglang's host pool (0.95x counted in bytes)."""
    engine, pages, keys = stored(tier_dirs[:2], 64, io_engine, chunk="1M", size=256 * KIB)
    with engine:
        for flow in engine._reads.io.flows:
            flow.window = 2 * MIB  # a device whose latency climbs at once ...
            flow.completed = lambda *a, **k: None  # ... and stays so for this call
        policy = _Watched()
        object.__setattr__(policy, "in_flight", [])
        assert engine.get(keys, pages.dst_segments, policy=policy) == [True] * 64
        assert all(pages.equal(i) for i in range(64))
        # 8 pages in a window, claims of half of it (4): a tier claims with up to 4 in flight
        assert 1 < max(policy.in_flight) <= 4, policy.in_flight


class _PerTier(CompletionDriven):
    """The default policy, recording per tier the items it still had in flight at each of its claims."""

    def start(self, n_tiers, holders):
        route = super().start(n_tiers, holders)
        record = route._record

        def watched(tier, items, steal):
            self.in_flight[tier].append(len(route._flight[tier]))
            return record(tier, items, steal)

        route._record = watched
        return route


@pytest.mark.parametrize("rule", [OPEN, HELD])
def test_a_routed_call_keeps_its_slower_tiers_to_what_its_rule_lets_them_read(tier_dirs, io_engine, rule):
    """flow.SlowerTiers: a routed call whose rule holds the slower tiers (a tier that shares the reader's
    CPUs, a FUSE file system's daemons: GlusterFS beside this machine's disk read 0.74x the disk alone
    at 256 KiB pages, held 1.22x) keeps every tier but the fastest to one item in flight; open, every
    tier its window. Every page is read whole either way, and the call's rate goes to its rule."""
    engine, pages, keys = stored(tier_dirs[:2], 64, io_engine, chunk="1M", size=256 * KIB)
    with engine:
        reads = engine._reads
        for flow, rate in zip(reads.io.flows, (4e9, 1e9)):  # tier 1 the slower, and so it stays
            flow.window, flow.rate = 8 * MIB, rate
            flow.completed = lambda *a, **k: None
        reads.slower.rule = lambda nbytes: rule
        policy = _PerTier()
        object.__setattr__(policy, "in_flight", [[], []])
        assert engine.get(keys, pages.dst_segments, policy=policy) == [True] * 64
        assert all(pages.equal(i) for i in range(64))
        assert {OPEN: max(policy.in_flight[1] or [0]) > 1, HELD: set(policy.in_flight[1]) == {0}}[rule], \
            policy.in_flight  # (held: one item, with none in flight)
        assert max(policy.in_flight[0]) > 1, policy.in_flight  # the fastest keeps its window either way
        [rates] = reads.slower.rates.values()  # (one size of call)
        assert [bool(r) for r in rates] == [r == rule for r in RULES]
        stats = engine.stats()  # (what an operator sees: which rule the calls took)
        assert (stats["routed_calls"], stats["held_calls"], engine.last_batch["rule"]) == (1, rule, RULE_NAMES[rule])


def _held_get(engine, pages, keys, rates, prepare=lambda: None) -> list[list[int]]:
    """A get whose rule (flow.SlowerTiers) holds the slower tiers, the tiers' rates set to ``rates`` (and
    kept): per tier, the items it had in flight at each of its claims. Every page is read whole."""
    reads = engine._reads
    for flow, rate in zip(reads.io.flows, rates):
        flow.window, flow.rate = 8 * MIB, rate
        flow.completed = lambda *a, **k: None
    reads.slower.rule = lambda nbytes: HELD
    policy = _PerTier()
    object.__setattr__(policy, "in_flight", [[] for _ in rates])
    prepare()
    assert engine.get(keys, pages.dst_segments, policy=policy) == [True] * len(keys)
    assert all(pages.equal(i) for i in range(len(keys)))
    return policy.in_flight


def test_a_held_call_keeps_open_the_fastest_tier_it_can_read(tier_dirs, io_engine):
    """The fastest tier of all is failed: a held call keeps the fastest of the tiers it can read at its
    window (before: every tier the call could read was held to one item in flight)."""
    engine, pages, keys = stored(tier_dirs, 64, io_engine, chunk="1M", size=256 * KIB, tier_retry=3600)
    with engine:
        in_flight = _held_get(engine, pages, keys, (4e9, 2e9, 1e9),
                              lambda: engine.tiers[0].fail(errno.EIO, "test"))
        assert not in_flight[0] and max(in_flight[1]) > 1, in_flight
        assert set(in_flight[2]) == {0}, in_flight  # the slower one held


def test_a_call_with_pages_only_a_slower_tier_holds_does_not_hold_it(tier_dirs, io_engine):
    """A small fast tier at its capacity beside a large slower one: half the pages are on the slower
    tier alone, which is their only reader; the call reads them at its window (before: held, one item
    at a time, 33 claims each with nothing else in flight)."""
    n, size = 64, 256 * KIB
    engine, pages, keys = stored(tier_dirs[:2], n, io_engine, chunk="1M", size=size,
                                 capacity=f"{n // 2 * size}{os.pathsep}")
    with engine:
        assert any(engine.index.get(k).tiers == 0b10 for k in keys)
        in_flight = _held_get(engine, pages, keys, (4e9, 1e9))
        assert max(in_flight[1]) > 1, in_flight


def test_an_item_the_fastest_tier_fails_in_transfer_is_read_by_the_tier_a_held_call_holds(tier_dirs, io_engine, caplog):
    """One read of the fastest tier arrives corrupt (a transfer fault: the copy on disk is intact): the
    item goes back to the slower holder, which a held call keeps at one item, and the page is read in the
    same call. (A third rule that left the slower tiers out, tried in stop 46, stalled here: the page was
    missing, "router stalled".)"""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 32, io_engine, plan=plan, chunk="1M", size=256 * KIB)
    caplog.set_level(logging.INFO, "kvstream")
    with engine:
        plan.on(tier_dirs[0], Fault.corrupt(), opcode=OP_READ, times=1)
        try:
            _held_get(engine, pages, keys, (4e9, 1e9))
        finally:
            plan.clear()
            plan.release()
        assert plan.hits, "the fastest tier's read never arrived corrupt"
        assert not messages(caplog, "router stalled")
        assert (engine.last_batch["rule"], engine.last_batch["second_chance"]) == ("held", 0)  # (the same call)


@pytest.mark.parametrize("what", ["gone", "directory"])
def test_a_page_the_fastest_tier_cannot_open_is_read_by_the_tier_a_held_call_holds(tier_dirs, io_engine, what,
                                                                                    caplog):
    """The index says the fastest tier holds a page whose file went under it (an operator, another node),
    or a directory now stands under its name: its open fails, and the slower holder reads it in the same
    call, even where nothing else is in flight (a call of that one page)."""
    engine, pages, keys = stored(tier_dirs[:2], 1, io_engine, chunk="1M", size=256 * KIB)
    caplog.set_level(logging.INFO, "kvstream")
    with engine:
        path = engine.tiers[0].layout.page_path(keys[0])
        os.unlink(path)
        if what == "directory":
            os.mkdir(path)
        try:
            _held_get(engine, pages, keys, (4e9, 1e9))
        finally:
            if what == "directory":
                os.rmdir(path)  # (a stray kvstream leaves in place: the test's own)
        assert not messages(caplog, "router stalled")
        assert (engine.last_batch["rule"], engine.last_batch["second_chance"]) == ("held", 0)


@pytest.mark.parametrize("fault", ["error", "hold"])
def test_a_held_call_opens_its_slower_tier_once_the_fastest_fails_or_stalls(tier_dirs, io_engine, fault):
    """The tier a held call keeps open fails during the call, or stalls (overdue): the slower tier
    reads (or re-reads) its items at its window (before: one at a time to the end of the call)."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 64, io_engine, plan=plan, chunk="1M", size=256 * KIB,
                                 tier_retry=3600)
    with engine:
        what = Fault.error(errno.EIO) if fault == "error" else Fault.hold()
        try:
            in_flight = _held_get(engine, pages, keys, (4e9, 1e9), lambda: plan.on(tier_dirs[0], what, opcode=OP_READ))
        finally:
            plan.clear()
            plan.release()
        assert engine.tiers[0].healthy == (fault == "hold")
        assert max(in_flight[1]) > 1, in_flight


def _tier_bytes(engine, counter: str) -> list[int]:
    return [t[counter] for t in engine.stats()["tiers"]]


def test_tiers_not_measured_yet_re_read_few_of_each_others_items(tier_dirs, io_engine):
    """Small gets on two tiers of a fresh engine, whose rates are not measured yet (flow.outpaces): neither
    re-reads the other's items in flight while that one completes its reads (before: rate 0 >= rate 0 let
    both, each re-read the other's whole share, and the orphans those steals left reset the throughput
    spans so neither ever got measured: 256 KiB pages read 8 at a time took 1.9x the bytes they served).
    (Not none at all: a tier that falls quiet, a scheduling hiccup on a loaded machine, may be taken over.)"""
    engine, pages, keys = stored(tier_dirs[:2], 64, io_engine, chunk="1M", size=256 * KIB)
    with engine:
        for i in range(0, 64, 8):
            assert engine.get(keys[i:i + 8], pages.dst_segments[i:i + 8]) == [True] * 8
            assert all(pages.equal(j) for j in range(i, i + 8))
        engine._reads.drain(30)
        read, served = sum(_tier_bytes(engine, "bytes_read")), sum(_tier_bytes(engine, "bytes_served"))
        assert read <= 1.3 * served, (read / served, engine.stats()["duplicate_reads"])


def test_a_slow_tier_not_measured_yet_is_taken_over_once_it_falls_quiet(tier_dirs, io_engine):
    """Tier 1's reads take 200 ms each (under the 250 ms that make a tier overdue), tier 0's a fraction of a
    millisecond, neither measured yet: once tier 1 has completed nothing for two of tier 0's request latencies,
    tier 0 re-reads what tier 1 has in flight, and serves the whole batch (a rule that left unmeasured tiers
    to each other read tier 1's half at its pace)."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 8, io_engine, plan=plan, chunk="1M", size=256 * KIB)
    with engine:
        plan.on(tier_dirs[1], Fault.delay(0.2), opcode=OP_READ)
        try:
            assert engine.get(keys, pages.dst_segments) == [True] * 8
        finally:
            plan.clear()
        assert all(pages.equal(i) for i in range(8))
        assert _tier_bytes(engine, "bytes_served") == [8 * 256 * KIB, 0], engine.last_batch["tiers"]
        assert [f.rate for f in engine._reads.io.flows] == [0, 0]  # (neither measured)


def test_an_idle_tier_re_reads_what_a_tier_it_outpaces_a_quiet_or_an_overdue_one_has_in_flight(tier_dirs):
    """The read path's steal rule: a tier measured at least STEAL_FASTER times as fast as the owner
    (flow.outpaces), an owner quiet for STEAL_QUIET of the stealer's latencies or overdue, measured or not;
    nothing between tiers not measured yet that both complete their reads."""
    engine = make_engine(tier_dirs[:2])
    with engine:
        reads = engine._reads
        flows, may = reads.io.flows, reads._may_steal_under_reads
        reads.io.bytes = [1 << 20, 1 << 20]  # (reads in flight on both)
        for f in flows:
            f.submitted(time.monotonic(), 0)  # (the stall clock starts now: neither quiet)
        for rates, want in (((0, 0), False), ((1e9, 0), False), ((0, 1e9), False), ((1.5e9, 1e9), False),
                            ((2e9, 1e9), True), ((1e9, 2e9), False)):
            flows[0].rate, flows[1].rate = rates
            assert may(0, 1) is want, rates
        flows[0].rate = flows[1].rate = 0
        flows[0].latency = 1e-3  # (tier 0's requests take 1 ms; tier 1 has been quiet for longer)
        flows[1].submitted(time.monotonic() - 0.01, 0)
        assert may(0, 1) and not may(1, 0)
        reads.io.bytes = [0, 0]

def test_an_idle_tier_is_woken_to_take_over_a_quiet_one_whatever_the_latency_of_a_tier_that_cannot(tier_dirs,
                                                                                                    io_engine):
    """Three tiers: tier 0 (a fast one, its latency measured) cannot read this call (failed here; it could as
    well lack the pages), tier 1 answers in 5 ms and tier 2 in 200 ms, neither measured. Tier 1's wait must
    wake once tier 2 has been quiet for two of tier 1's latencies, not only for two of tier 0's (long past
    by then): else tier 1 sat idle until tier 2 delivered its half at its pace."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs, 10, io_engine, plan=plan, chunk="1M", size=256 * KIB)
    with engine:
        usable = engine._usable_mask
        engine._usable_mask = lambda: usable() & 0b001  # (tier 0 alone: its latency measured)
        assert engine.get(keys[8:], pages.dst_segments[8:]) == [True] * 2
        engine._usable_mask = lambda: usable() & 0b110  # (then tier 0 fails)
        plan.on(tier_dirs[1], Fault.delay(0.005), opcode=OP_READ)
        plan.on(tier_dirs[2], Fault.delay(0.2), opcode=OP_READ)
        try:
            assert engine.get(keys[:8], pages.dst_segments[:8]) == [True] * 8
        finally:
            plan.clear()
        assert all(pages.equal(i) for i in range(10))
        flows = engine._reads.io.flows
        assert _tier_bytes(engine, "bytes_served")[1:] == [8 * 256 * KIB, 0], engine.last_batch["tiers"]
        assert flows[0].latency < flows[1].latency and not flows[1].rate
        engine._usable_mask = usable


def test_an_idle_tier_with_an_orphan_in_flight_is_woken_to_take_over_a_quiet_one(tier_dirs, io_engine):
    """Tier 0 is left with one read of an earlier call that never completes (an orphan: tier 1 delivered its
    block), and reads this call's share at once; tier 1 answers in 200 ms (under the 250 ms that make it
    overdue), neither measured. Tier 0 has nothing of this call in flight, and no completion of this call
    comes to wake it: its wait must wake once tier 1 has been quiet for two of its latencies (before, it
    counted as busy for the orphan and sat idle until tier 1 delivered its half at its pace)."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:2], 16, io_engine, plan=plan, chunk="1M", size=256 * KIB)
    with engine:
        try:
            plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ, times=1)
            assert engine.get(keys[:8], pages.dst_segments[:8]) == [True] * 8
            assert engine._reads.io.orphaned == [256 * KIB, 0]
            served = _tier_bytes(engine, "bytes_served")
            plan.on(tier_dirs[1], Fault.delay(0.2), opcode=OP_READ)
            assert engine.get(keys[8:], pages.dst_segments[8:]) == [True] * 8
            assert all(pages.equal(i) for i in range(16))
            assert [b - a for a, b in zip(served, _tier_bytes(engine, "bytes_served"))] == [8 * 256 * KIB, 0], \
                engine.last_batch["tiers"]
        finally:
            plan.clear()
            plan.release()


@pytest.mark.parametrize("rule", [OPEN, HELD])
def test_a_stalled_slower_tier_takes_no_more_reads_than_its_window_held_or_open(tier_dirs, io_engine, rule):
    """The slower tier hangs (its reads never complete): calls after calls leave their reads there as
    orphans, which count in its window, held or open (held, before: one more read per call, past it)."""
    plan = TierFaultPlan()
    n, per = 128, 16
    engine, pages, keys = stored(tier_dirs[:2], n, io_engine, plan=plan, chunk="1M", size=256 * KIB)
    with engine:
        reads = engine._reads
        for flow, rate in zip(reads.io.flows, (4e9, 1e9)):
            flow.window, flow.rate = MIB, rate
            flow.completed = lambda *a, **k: None
        reads.slower.rule = lambda nbytes: rule
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_READ)
        try:
            for i in range(0, n, per):
                assert engine.get(keys[i:i + per], pages.dst_segments[i:i + per]) == [True] * per
                assert reads.io.orphaned[1] <= MIB, (i, reads.io.orphaned)
            assert all(pages.equal(i) for i in range(n))
        finally:
            plan.clear()
            plan.release()


def test_replicated_blocks_are_staged_so_a_stalled_tier_cannot_hold_the_call(tier_dirs, io_engine):
    engine, pages, keys = stored(tier_dirs[:2], 6, io_engine)
    with engine:
        assert engine.get(keys, pages.dst_segments) == [True] * 6
        assert engine.last_batch["direct_bytes"] == 0


def test_caller_memory_of_small_pages_is_staged_even_with_one_holder(tier_dirs, io_engine):
    """4 KiB pages: an O_DIRECT read into them pins every page and is split at the device's segment
    limit, so the read goes through huge-page staging (memory.py)."""
    engine, pages, keys = stored(tier_dirs[:1], 4, io_engine)
    sizes = [n for shape in pages.shapes for n in shape]
    with engine, mmap.mmap(-1, sum(sizes)) as small:  # anonymous memory the kernel keeps in 4 KiB pages
        small.madvise(mmap.MADV_NOHUGEPAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(small))
        offsets = [0, *itertools.accumulate(sizes)]
        segments = [[(base + offsets[2 * i], sizes[2 * i]), (base + offsets[2 * i + 1], sizes[2 * i + 1])]
                    for i in range(4)]
        assert not any(HugePageMap(background=False).huge(a, n) for page in segments for a, n in page)
        assert engine.get(keys, segments) == [True] * 4
        assert small[:] == b"".join(a.tobytes() for page in pages.src for a in page)
        assert engine.last_batch["direct_bytes"] == 0


def test_unaligned_caller_memory_is_staged_even_with_one_holder(tier_dirs, io_engine):
    engine, pages, keys = stored(tier_dirs[:1], 4, io_engine, aligned=False)
    with engine:
        assert engine.get(keys, pages.dst_segments) == [True] * 4
        assert all(pages.equal(i) for i in range(4))
        assert engine.last_batch["direct_bytes"] == 0


def test_page_held_by_one_tier_of_two_is_read_in_place(tier_dirs, io_engine):
    engine, pages, keys = stored(tier_dirs[:2], 4, io_engine)
    with engine:
        engine.index.remove(keys[0], 0)  # tier 0 lost its copy: only tier 1 can deliver page 0
        engine.tiers[0].unlink_page(keys[0])
        assert engine.get(keys, pages.dst_segments) == [True] * 4
        assert all(pages.equal(i) for i in range(4))
        assert engine.last_batch["direct_bytes"] == 4 * MIB


def test_a_single_holder_stalled_get_after_get_says_so_once_per_30_s(tier_dirs, caplog):
    """A slow tier, the only holder of the pages a get reads into caller memory (SGLang's registered host pool):
    every get times out and then waits for those reads, for as long as the tier is slow. Each is counted; the two
    warnings are said once per 30 s, not once a get (before: two lines a get, the whole time: flap trial)."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:1], 2, "uring", plan=plan, read_timeout=0.05)
    with engine, caplog.at_level(logging.WARNING, logger="kvstream"):
        for n in range(1, 4):
            plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ)
            t = threading.Thread(target=engine.get, args=(keys, pages.dst_segments))
            t.start()
            wait_until(lambda: engine._reads.waiting_direct, 20, "the get never timed out into its wait")
            plan.clear()
            plan.release()
            t.join(30)
            assert not t.is_alive()
        assert engine.stats()["read_timeouts"] == 3
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len([m for m in said if "timed out" in m]) == 1, said
        assert len([m for m in said if "waiting for" in m]) == 1, said


def test_a_stalled_single_holder_is_waited_for_past_read_timeout(tier_dirs, io_engine):
    """No other tier can deliver these blocks and they target caller memory: the call waits for
    the reads in flight however long the device takes, delivers them verified, and reports what it
    had not started by read_timeout as missing."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:1], 3, io_engine, plan=plan, read_timeout=0.05)
    with engine:
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ)
        result: list = []
        t = threading.Thread(target=lambda: result.append(engine.get(keys, pages.dst_segments)))
        t.start()
        t.join(1.0)  # far past read_timeout: still waiting for the held reads
        assert t.is_alive() and not result
        plan.clear()
        plan.release()
        t.join(30)
        assert not t.is_alive()
        (found,) = result
        assert found[0] and all(pages.equal(i) for i in range(3) if found[i])
        assert engine.stats()["orphan_reads_in_flight"] == 0 and engine.stats()["read_timeouts"] == 1
    with make_engine(tier_dirs[:1], io_engine) as again:  # (a timeout this short fails any read on a busy host)
        assert again.get(keys, pages.dst_segments) == [True] * 3 and all(pages.equal(i) for i in range(3))


def test_reads_into_caller_memory_land_before_a_failing_call_returns(tier_dirs, io_engine, monkeypatch):
    """An unexpected error inside a get (here: the ring's reap, once) while reads into caller memory
    are in flight: the call still waits for them before the error leaves it, so none lands in memory
    the caller has taken back (before: it returned at once, the reads still in flight)."""
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:1], 3, io_engine, plan=plan)
    with engine:
        direct = huge(pages)  # (without huge pages every read is staged: nothing to wait for)
        ring = engine._reads.io.ring
        real, calls = ring.reap, []

        def reap(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("the ring failed (injected)")
            return real(*args, **kwargs)

        monkeypatch.setattr(ring, "reap", reap)
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ)
        result: list = []

        def get():
            try:
                result.append(engine.get(keys, pages.dst_segments))
            except RuntimeError as exc:
                result.append(exc)

        t = threading.Thread(target=get)
        t.start()
        t.join(1.0)
        assert t.is_alive() == direct, "the call returned with reads into caller memory in flight"
        plan.clear()
        plan.release()
        t.join(30)
        assert not t.is_alive()
        assert isinstance(result[0], RuntimeError)
        assert engine._reads.drain(30) == 0
        assert engine.get(keys, pages.dst_segments) == [True] * 3 and all(pages.equal(i) for i in range(3))


@pytest.mark.parametrize("into", ["another ring", "/dev/null"])
def test_a_read_ring_that_fails_is_replaced_and_the_next_get_reads(tier_dirs, caplog, into):
    """The read ring's descriptor made to reach another ring (io_uring_enter takes none of its SQEs:
    "no progress", EAGAIN, as a passing kernel shortage answers) or /dev/null (EOPNOTSUPP, for good)
    while a get reads into registered caller memory. Before, waiting for those reads failed too and
    the read path closed for the life of the engine: every later get raised EngineClosedError (and
    close() raised ValueError). Now that get raises, and the ring is replaced (inflight.py): nothing
    it held lands after the call, the next get reads in place on a new ring with the same memory
    registered, and close() is clean."""
    before = io_uring_fds()
    engine, pages, keys = stored(tier_dirs[:1], 4, "uring")
    with engine:
        rings = io_uring_fds() - before
        tails = {fd: sq_tail(fd) for fd in rings}
        assert engine.get(keys, pages.dst_segments) == [True] * 4
        (read_ring,) = [fd for fd in rings if sq_tail(fd) > tails[fd]]
        registered = engine._reads.io.ring.fixed_bytes
        assert registered and engine.last_batch["direct_bytes"] == 4 * 4 * MIB
        with make_ring("uring"):
            (other,) = io_uring_fds() - rings - before
            target = os.open(os.devnull, os.O_RDONLY) if into == "/dev/null" else os.dup(other)
            os.dup2(target, read_ring)
            os.close(target)
            with pytest.raises(OSError):
                engine.get(keys, pages.dst_segments)
        assert engine.stats()["ring_failures"] == 1
        assert [m for m in messages(caplog, "the read ring failed") if "go on on a new ring" in m]
        for array in (a for page in pages.dst for a in page):
            array[:] = 0  # (the same memory: the one registered)
        assert engine.get(keys, pages.dst_segments) == [True] * 4 and all(pages.equal(i) for i in range(4))
        assert engine._reads.io.ring.fixed_bytes == registered
        assert engine.last_batch["direct_bytes"] == 4 * 4 * MIB


def test_a_read_ring_replaced_by_the_thread_pool_under_auto_keeps_reading(tier_dirs):
    """io_engine=auto (the default): the read ring fails (its descriptor now /dev/null) and, just as it
    is replaced, io_uring_setup meets EMFILE (the process at its descriptor limit): open_ring's own
    fallback hands back the thread-pool engine. The read path goes on there, staging what it read in
    place (before: the caller memory pointed at a ring with no registered memory, and that get and
    every later one raised AttributeError). Found by a review."""
    short = []

    def factory(entries, engine):  # the real open_ring; only the moment of the shortage is arranged
        if not short:
            return open_ring(entries, engine)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.open(os.devnull, os.O_RDONLY)  # the number the next descriptor would get
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # no descriptor number left: EMFILE
        try:
            return open_ring(entries, engine)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    before = io_uring_fds()
    engine, pages, keys = stored(tier_dirs[:1], 4, "auto", ring_factory=factory)
    with engine:
        rings = io_uring_fds() - before
        tails = {fd: sq_tail(fd) for fd in rings}
        assert engine.get(keys, pages.dst_segments) == [True] * 4
        (read_ring,) = [fd for fd in rings if sq_tail(fd) > tails[fd]]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, read_ring)
        os.close(null)
        short.append(1)
        with pytest.raises(OSError):
            engine.get(keys, pages.dst_segments)
        short.clear()
        assert isinstance(engine._reads.io.ring, ThreadRing) and engine._reads.memory.ring is None
        for array in (a for page in pages.dst for a in page):
            array[:] = 0
        for _ in range(2):
            assert engine.get(keys, pages.dst_segments) == [True] * 4 and all(pages.equal(i) for i in range(4))


def test_transfer_fault_on_a_single_holder_is_a_miss_and_the_file_is_kept(tier_dirs, io_engine):
    plan = TierFaultPlan()
    engine, pages, keys = stored(tier_dirs[:1], 2, io_engine, plan=plan)
    with engine:
        plan.on(tier_dirs[0], Fault.corrupt(), opcode=OP_READ, times=1)
        assert engine.get(keys, pages.dst_segments).count(False) == 1  # the request that was corrupted
        assert engine.stats()["tiers"][0]["corrupted"] == 1
        assert engine.get(keys, pages.dst_segments) == [True, True]  # intact on disk: kept, served
        assert all(pages.equal(i) for i in range(2))


def test_damage_on_a_single_holder_is_a_miss_and_the_copy_is_removed(tier_dirs, io_engine):
    engine, pages, keys = stored(tier_dirs[:1], 2, io_engine)
    with engine:
        flip_byte(engine.tiers[0].layout.page_path(keys[1]), HEADER_SIZE + 100, 0x01)
        assert engine.get(keys, pages.dst_segments) == [True, False]
        assert engine.stats()["tiers"][0]["quarantined"] == 1
        assert not engine.contains(keys[1])


def test_staging_stays_within_the_memory_setting(tier_dirs, io_engine):
    engine, pages, keys = stored(tier_dirs[:2], 24, io_engine, size=2 * MIB, chunk="256K", memory="4M")
    # (two holders: every read is staged)
    with engine:
        for _ in range(3):
            assert engine.get(keys, pages.dst_segments) == [True] * 24
        pool = engine._reads.pool
        assert pool.peak_bytes <= 2 * MIB  # half of memory= is the read path's
        assert engine.stats()["memory"]["read_peak_bytes"] == pool.peak_bytes


def test_the_huge_page_answer_never_blocks_the_read_path():
    """Reading smaps walks every mapping's page tables (seconds for a large host pool): the read
    path's map answers "not huge" for memory it does not know yet and learns it in the background."""
    buf = AlignedBuffer(4 * MIB)  # huge-page backed where THP is available
    try:
        np.frombuffer(buf, dtype=np.uint8)[:] = 1
        m = HugePageMap()
        assert not m.huge(buf.address, buf.nbytes)  # unknown yet: staged, and a read starts
        with m._reading:  # wait for the background read to finish
            pass
        assert m.huge(buf.address, buf.nbytes) == HugePageMap(background=False).huge(buf.address, buf.nbytes)
    finally:
        buf.close()


def test_a_large_get_holds_a_bounded_number_of_files(tier_dirs, io_engine, monkeypatch):
    """A get of many pages keeps about READ_FILES_HELD read descriptors open at most (an idle one
    closes, and reopens if its page is read again), not one per page and tier: a batch of any size
    fits the process's descriptor limit."""
    from kvstream_hicache import files

    monkeypatch.setattr(files, "READ_FILES_HELD", 8)
    # memory=4M: each tier's window is at most 1 MiB, 16 requests of these 64 KiB pages in flight
    engine, pages, keys = stored(tier_dirs[:2], 96, io_engine, size=64 << 10, chunk="16K", memory="4M")
    with engine:
        assert engine.get(keys, pages.dst_segments) == [True] * 96
        assert all(pages.equal(i) for i in range(96))
        # open: the files of the reads in flight (16 per tier) and at most 8 idle ones, not 2 x 96
        assert engine._reads.files.peak <= 2 * 16 + 8
        assert engine._reads.drain(30) == 0 and engine._reads.files.open == 0  # (tail duplicates' too)


def test_out_of_descriptors_on_a_read_closes_idle_ones_first(tier_dirs, io_engine, fd_limit):
    """EMFILE when a get opens a page: the call's idle descriptors close and the open is tried again,
    so every page is read and no tier error is counted (before: those pages missed)."""
    engine, pages, keys = stored(tier_dirs[:1], 96, io_engine, size=64 << 10, chunk="16K", memory="4M")
    with engine:
        engine.stats()  # (anything that opens a file lazily does it now, not under the limit)
        # memory=4M: a window of 2 MiB, 32 reads of these 64 KiB pages in flight; room for those and
        # 8 idle descriptors, not for one per page (96)
        fd_limit(open_fds() + 40)
        assert engine.get(keys, pages.dst_segments) == [True] * 96
        assert all(pages.equal(i) for i in range(96))
        assert engine.stats()["tiers"][0]["errors"] == 0
        assert engine._reads.files.peak < 96  # (not one per page)


def test_registered_memory_takes_reads_in_place_from_the_first_call(tier_dirs, io_engine):
    """register_memory learns the memory's pages now; unregistered new memory is staged at first
    (the engine learns it in the background, never on the read path)."""
    pages = Pages(2, size=4 * MIB)
    keys = [key(i, "registered") for i in range(2)]
    with make_engine(tier_dirs[:1], io_engine) as engine:
        assert engine.put(keys, pages.src_segments) == [True, True]
        assert engine.get(keys, pages.dst_segments) == [True, True]
        assert engine.last_batch["direct_bytes"] < 8 * MIB  # not known yet: the first page at least staged
        dst = pages.fresh()
        # huge-page backed, or pinned by the ring (test_registered_memory.py)
        answers = [engine.register_memory(a, n) for page in segments_of(dst) for a, n in page]
        ring = engine._reads.io.ring  # pinned by the ring where the memlock limit allows (as root: always)
        direct = bool(HUGE_PAGE_SIZE) or (io_engine == "uring" and ring.fixed_bytes > 0 and ring.readv_fixed)
        assert answers == [direct] * len(answers)
        assert engine.get(keys, segments_of(dst)) == [True, True] and all(pages.equal(i, dst) for i in range(2))
        assert engine.last_batch["direct_bytes"] == (8 * MIB if direct else 0)


class NthRead(FaultPlan):
    """Corrupts (a transfer fault: the file stays intact) the n-th read op of the engine, 1-based."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.reads = n, 0

    def decide(self, opcode, fd, offset, length):
        if opcode != OP_READ:
            return None
        self.reads += 1
        return Fault.corrupt() if self.reads == self.n else None


def test_a_key_asked_for_twice_is_read_once_and_a_failed_read_never_overwrites_it(tier_dirs, io_engine):
    """get([K, K]) into one buffer: K is read once and both entries are True, byte-exact, though the
    read after its first copy is corrupted in transfer (before: K was read twice; a staged block is
    copied into the caller's memory as its checksum is computed, so the failed second read landed over
    the page already reported found: [True, False] with a flipped byte). Found by a review."""
    pages = Pages(1, aligned=False)  # unaligned caller memory: every read is staged
    k = key(0, "dup")
    plan = NthRead(4)  # K has 3 blocks: reads 1-3 are its first copy, read 4 the duplicate's block 0
    engine = make_engine(tier_dirs[:1], io_engine, fault_plan=plan)
    with engine:
        assert engine.put([k], pages.src_segments) == [True]
        dst = pages.dst_segments[0]
        # one item in flight at a time: K's first copy is read and verified before the second goes out
        found = engine.get([k, k], [dst, dst], CompletionDriven(m=1, depth=1))
        assert found == [True, True] and pages.equal(0), f"found={found}"
        assert plan.reads == 3  # (read once)
        plan.n = 0  # (no more faults)
        other = pages.fresh()[0]  # a second buffer: the verified copy goes there too
        assert engine.get([k, k], [dst, segments_of([other])[0]]) == [True, True] and pages.equal(0, [other])


def test_a_page_whose_block_exceeds_the_tiers_window_is_read(tier_dirs, caplog):
    """A page needing more than 900 checksums gets a larger block (layout.block_for); the read path
    counts a tier's depth in such blocks. A block larger than the window goes out one at a time
    (before: window // block was 0, no tier could claim, and the stored page was reported missing,
    "router stalled", on every get). Found by a review."""
    pages = PageSet(16 << 20, aligned=False, salt="big")  # 16 MiB: 900 blocks of 20 KiB
    engine = make_engine(tier_dirs[:1], "uring", chunk="4K", memory="16K")  # legal: memory >= 4 blocks
    with engine:
        keys = pages.keys(1)
        assert pages.put(engine, keys) == [True]
        found = pages.checked_get(engine, keys)
        assert found == [True], [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
