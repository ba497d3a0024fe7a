"""The write path (issue 15, issue 16 item 7): writes wait while a get reads their tier, deferred
writes (M2) and their back-pressure, replicas within budget, bounded open files per put.

Real engine, real files with O_DIRECT; faults (held, delayed completions) at the ring. No timing
assertions: the tests wait for events (a held op reached the ring, a page committed) and check order.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from kvstream_hicache import admission, files, writes
from kvstream_hicache.faults import Fault
from kvstream_hicache.io import OP_READ, OP_WRITE
from kvstream_hicache.layout import TierLayout, file_size
from kvstream_hicache.priority import STALL_S, ReadPriority
from kvstream_hicache.router import SingleTier
from kvstream_hicache.tiers import Tier
from kvstream_hicache.tmpfiles import MARK_PREFIX

from helpers import (
    FakeClock, PageSet, Pages, TierFaultPlan, io_uring_fds, key, make_engine, open_fds, page_files, segments_of, sq_tail,
    tmp_files, wait_for_fault,
    wait_until,
)

WAIT_S = 60.0


class Held:
    """A get of ``keys`` from tier 0 alone whose reads are held in the ring, in a thread."""

    def __init__(self, engine, pages: PageSet, keys, plan: TierFaultPlan, tier_dir: str):
        self.plan = plan
        plan.on(tier_dir, Fault.hold(), opcode=OP_READ)
        self.result: list = []
        self.thread = threading.Thread(target=lambda: self.result.append(
            pages.checked_get(engine, keys, policy=SingleTier(0))))
        self.thread.start()
        wait_for_fault(plan, WAIT_S, "the get never reached the ring")

    def release(self) -> list:
        self.plan.clear()
        self.plan.release()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the released get did not finish"
        return self.result[0]


@contextmanager
def releasing(plan: TierFaultPlan):
    """Whatever happens in the block, held completions are let go after it (close would wait for them)."""
    try:
        yield
    finally:
        plan.clear()
        plan.release()


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    return t, out


# ----------------------------------------------------------------------------------- read priority
def test_writes_to_a_tier_wait_while_a_get_reads_it(tier_dirs):
    """A get reading tier 0 holds new writes to tier 0 (not one is started), while tier 1, which
    the get does not read, takes its copies at once; the put returns, both tiers written, only after
    the get. (Before read priority every write went out at once.)"""
    plan = TierFaultPlan()
    pages = PageSet()
    with make_engine(tier_dirs[:2], fault_plan=plan, clock=FakeClock()) as engine, releasing(plan):
        stored, new = pages.keys(4), pages.keys(3, 100)
        assert pages.put(engine, stored) == [True] * 4
        reader = Held(engine, pages, stored, plan, tier_dirs[0])
        writer, result = in_thread(pages.put, engine, new)
        wait_until(lambda: all(engine.index.holders(k) == 0b10 for k in new), WAIT_S, "tier 1 never took the pages")
        assert os.listdir(engine.tiers[0].layout.tmp) == []  # no write to tier 0 even started
        assert engine.stats()["tiers"][0]["write_queued_bytes"] == 3 * file_size(engine.index.get(new[0]).length)
        assert writer.is_alive()  # the put waits for every tier that takes its pages
        assert reader.release() == [True] * 4
        writer.join(WAIT_S)
        assert result == [[True] * 3]
        assert [engine.index.holders(k) for k in new] == [0b11] * 3
        stats = engine.stats()
        assert stats["tiers"][0]["write_held_s"] > 0 and stats["tiers"][1]["write_held_s"] == 0
        assert stats["under_replicated"] == 0
        assert pages.checked_get(engine, new) == [True] * 3


def test_a_read_holds_its_tiers_writes_from_before_it_reaches_the_ring(tier_dirs, monkeypatch):
    """A get's tier counts as read from before its first read is submitted. Before, the read path
    told read priority after the submission: a write that came in between (here: the reader thread
    slowed between the two; on a loaded machine, descheduled) started on the tier the read was
    using (a CI run's "tier 1 never took the pages": tier 0 had taken them too)."""
    begin = ReadPriority.begin

    def slow_begin(self, mask):
        time.sleep(0.3)
        begin(self, mask)

    monkeypatch.setattr(ReadPriority, "begin", slow_begin)
    plan = TierFaultPlan()
    pages = PageSet()
    with make_engine(tier_dirs[:2], fault_plan=plan, clock=FakeClock()) as engine, releasing(plan):
        stored, new = pages.keys(2), pages.keys(2, 100)
        assert pages.put(engine, stored) == [True] * 2
        reader = Held(engine, pages, stored, plan, tier_dirs[0])  # returns once the read is on the ring
        writer, result = in_thread(pages.put, engine, new)
        wait_until(lambda: all(engine.index.holders(k) & 0b10 for k in new), WAIT_S, "tier 1 never took the pages")
        assert [engine.index.holders(k) for k in new] == [0b10] * 2  # tier 0's writes wait for the get
        assert writer.is_alive()
        assert reader.release() == [True] * 2
        writer.join(WAIT_S)
        assert result == [[True] * 2] and [engine.index.holders(k) for k in new] == [0b11] * 2


def test_a_get_whose_clean_up_raises_still_lets_its_tiers_writes_go(tier_dirs, monkeypatch):
    """The end of a get releases its tiers' read priority whatever its clean-up raised: before, an
    error in unpinning or ending the call skipped it, and the tiers it read held their writes until
    the stall clock let them go (here: only when the test moves its clock)."""
    plan = TierFaultPlan()
    pages = PageSet()
    clock = FakeClock()
    with make_engine(tier_dirs[:2], fault_plan=plan, clock=clock) as engine, releasing(plan):
        stored, new = pages.keys(2), pages.keys(2, 100)
        assert pages.put(engine, stored) == [True] * 2
        unpin = engine.index.unpin

        def failing_unpin(infos):
            unpin(infos)
            raise RuntimeError("clean-up failed")

        monkeypatch.setattr(engine.index, "unpin", failing_unpin)
        with pytest.raises(RuntimeError, match="clean-up failed"):
            pages.checked_get(engine, stored)
        monkeypatch.setattr(engine.index, "unpin", unpin)
        writer, result = in_thread(pages.put, engine, new)
        writer.join(WAIT_S)
        clock.advance(STALL_S + 0.1)  # (were the writes still held, they go now: the engine closes)
        assert result == [[True] * 2] and [engine.index.holders(k) for k in new] == [0b11] * 2


def test_a_stalled_read_does_not_hold_writes_forever(tier_dirs):
    """Reads of tier 0 that make no progress for STALL_S (a hung device, read_timeout=0) stop holding
    its writes: the put completes on both tiers while the get is still stuck."""
    plan = TierFaultPlan()
    pages = PageSet()
    clock = FakeClock()
    with make_engine(tier_dirs[:2], fault_plan=plan, clock=clock, read_timeout=0) as engine, releasing(plan):
        stored, new = pages.keys(2), pages.keys(2, 100)
        assert pages.put(engine, stored) == [True] * 2
        reader = Held(engine, pages, stored, plan, tier_dirs[0])
        writer, result = in_thread(pages.put, engine, new)
        wait_until(lambda: all(engine.index.holders(k) == 0b10 for k in new), WAIT_S, "tier 1 never took the pages")
        assert writer.is_alive()
        clock.advance(STALL_S + 0.1)  # the held read has made no progress for longer than STALL_S
        writer.join(WAIT_S)
        assert result == [[True] * 2] and [engine.index.holders(k) for k in new] == [0b11] * 2
        assert reader.thread.is_alive()  # the get is still stuck: it was not what let the writes go
        assert reader.release() == [True] * 2


def test_read_priority_off_writes_whatever_is_read(tier_dirs):
    """read_priority=off is the behaviour before: writes go out while a get reads their tier."""
    plan = TierFaultPlan()
    pages = PageSet()
    with make_engine(tier_dirs[:2], fault_plan=plan, clock=FakeClock(), read_priority="off") as engine, \
            releasing(plan):
        stored, new = pages.keys(2), pages.keys(2, 100)
        assert pages.put(engine, stored) == [True] * 2
        reader = Held(engine, pages, stored, plan, tier_dirs[0])
        assert pages.put(engine, new) == [True] * 2  # returns with the get still held
        assert [engine.index.holders(k) for k in new] == [0b11] * 2
        assert reader.thread.is_alive()
        assert reader.release() == [True] * 2


# ---------------------------------------------------------------------------------- deferred (M2)
@pytest.mark.parametrize("late", ["put", "close"])
def test_work_that_comes_while_the_writer_is_in_a_step_is_not_slept_through(tier_dirs, monkeypatch, late):
    """A put accepted (or close() called) after the writer's step looked at the queues, before the
    writer waits again. The step here starts nothing and asks for a wait with no limit, as a step
    does when what is queued cannot start (its tier failed meanwhile, a catch-up copy dropped):
    the writer must still write what came (and stop). Before, that notify came while nobody waited
    and was lost, and the writer slept with no limit: the put never answered (a CI run's model test
    hung 300 s in a put), close() never returned."""
    src = Pages(2, seed=7)
    keys = [key(i, "late") for i in range(2)]
    done: list = []
    both = threading.Event()

    def record(ok):
        done.append(ok)
        if len(done) == 2:
            both.set()

    engine = make_engine(tier_dirs[:2])
    path = engine._writes
    real = path._step_under_writer
    armed = [True]

    def step():
        if not armed[0]:
            return real()
        armed[0] = False  # this step found nothing it could start; then the work comes
        if late == "put":
            engine.put_deferred(keys[1:], [src.src_segments[1]], record)
        else:
            path.queue.close()
        return 0.0

    monkeypatch.setattr(path, "_step_under_writer", step)
    try:
        engine.put_deferred(keys[:1], [src.src_segments[0]], record)
        if late == "put":
            assert both.wait(WAIT_S), "the put accepted during the writer's step was never written"
            assert done == [[True], [True]] and engine.get(keys, src.dst_segments) == [True, True]
        else:
            path._thread.join(WAIT_S)
            assert not path._thread.is_alive(), "the writer slept through close()"
            assert done == [[True]]  # what was queued was written before it stopped
        assert not armed[0]
    finally:
        engine.close()


def test_deferred_put_completes_only_when_committed(tier_dirs):
    """put_deferred returns at once; until its pages are committed the callback has not run and the
    page is not found; then the callback reports them, and they are found and read back."""
    plan = TierFaultPlan()
    src = Pages(3, seed=3)
    keys = [key(i, "deferred") for i in range(3)]
    done: list = []
    finished = threading.Event()
    with make_engine(tier_dirs[:2], fault_plan=plan) as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE).on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)
        engine.put_deferred(keys, src.src_segments, lambda ok: (done.append(ok), finished.set()))
        wait_for_fault(plan)  # a write is in flight, held
        assert done == [] and not any(engine.contains(k) for k in keys)
        assert engine.stats()["write_backlog_bytes"] == 3 * sum(n for _, n in src.src_segments[0])
        plan.clear()
        plan.release()
        assert finished.wait(WAIT_S)
        assert done == [[True] * 3] and all(engine.contains(k) for k in keys)
        assert engine.get(keys, src.dst_segments) == [True] * 3 and all(src.equal(i) for i in range(3))
        stats = engine.stats()
        assert stats["deferred_puts"] == 1 and stats["write_backlog_bytes"] == 0


def test_deferred_puts_wait_when_the_backlog_is_full_and_lose_nothing(tier_dirs):
    """With the backlog at its bound, the next deferred put waits (back-pressure) until pages commit;
    no put is dropped and every page is stored."""
    plan = TierFaultPlan()
    size = 64 << 10
    src = [Pages(2, seed=s, size=size) for s in range(3)]
    keys = [[key(i, f"bp{s}") for i in range(2)] for s in range(3)]
    results: list = []
    with make_engine(tier_dirs[:2], fault_plan=plan, write_backlog=3 * size) as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        engine.put_deferred(keys[0], src[0].src_segments, results.append)  # 2 pages: within the bound
        wait_for_fault(plan)
        blocked, _ = in_thread(engine.put_deferred, keys[1], src[1].src_segments, results.append)
        wait_until(lambda: engine.stats()["backpressure_waits"] == 1, WAIT_S, "the second put never waited")
        assert blocked.is_alive() and results == []
        plan.clear()
        plan.release()
        blocked.join(WAIT_S)
        engine.put_deferred(keys[2], src[2].src_segments, results.append)
        wait_until(lambda: len(results) == 3, WAIT_S, "a deferred put never completed")
        assert results == [[True, True]] * 3
        for s in range(3):
            assert engine.get(keys[s], src[s].dst_segments) == [True, True] and src[s].equal(1)


def _waited(engine, thread: threading.Thread) -> int:
    """The backpressure waits once ``thread`` (a deferred put) either returned or began to wait."""
    wait_until(lambda: not thread.is_alive() or engine.stats()["backpressure_waits"], WAIT_S,
               "the put neither returned nor waited")
    return engine.stats()["backpressure_waits"]


@pytest.mark.parametrize("bound, stored, first, second", [
    pytest.param(3, [], [0, 1], [0, 1], id="being-written"),
    pytest.param(3, [], [0, 1], [1, 2], id="one-being-written-one-new"),
    pytest.param(1, [], [0, 1], [0, 1], id="being-written-with-the-backlog-past-its-bound"),
    pytest.param(3, [], [0, 1], [2, 2], id="one-new-page-given-twice"),
    pytest.param(2, [0], [1, 2], [0], id="held-already"),
])
def test_a_deferred_put_waits_for_backlog_room_only_for_the_pages_it_adds(tier_dirs, bound, stored, first, second):
    """The first deferred put's pages held in their writes (a backlog bound of ``bound`` pages; a put larger
    than it is taken whole with the backlog empty), the second adds only its pages that are not being
    written (it joins those), not held by a tier already (answered True, no I/O) and not repeats within it:
    with room for those it does not wait, and one that adds nothing never waits, even past the bound.
    Before, it waited for room for every page it named: LMCache's store thread held up by bytes it would
    never add. Every put completes, each page written once per tier. (The last three cases from the review
    of d2977fc.)"""
    plan = TierFaultPlan()
    size = 64 << 10
    src = Pages(3, seed=7, size=size)  # (held for the whole test: the segments are its memory)
    segs = src.src_segments
    keys = [key(i, "room") for i in range(3)]
    results: list = []
    with make_engine(tier_dirs[:2], fault_plan=plan, write_backlog=bound * size) as engine:
        assert engine.put([keys[i] for i in stored], [segs[i] for i in stored]) == [True] * len(stored)
        with releasing(plan):
            plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
            engine.put_deferred([keys[i] for i in first], [segs[i] for i in first], results.append)
            wait_for_fault(plan)
            later, _ = in_thread(engine.put_deferred, [keys[i] for i in second], [segs[i] for i in second],
                                 results.append)
            waits = _waited(engine, later)
            backlog = engine.stats()["write_backlog_bytes"]
        later.join(WAIT_S)
        wait_until(lambda: len(results) == 2, WAIT_S, "a deferred put never completed")
        assert waits == 0, "a deferred put waited for backlog room for pages it does not add"
        assert backlog == len(set(first) | set(second) - set(stored)) * size
        assert sorted(results) == sorted([[True] * len(first), [True] * len(second)])
        written = len(set(stored) | set(first) | set(second))
        assert [t["pages_written"] for t in engine.stats()["tiers"]] == [written, written]


def test_a_key_being_written_is_written_once(tier_dirs):
    """Two puts of one key while its first write is in flight: one file per tier, both report it."""
    plan = TierFaultPlan()
    src = Pages(1, seed=4)
    k = [key(0, "twice")]
    results: list = []
    with make_engine(tier_dirs[:2], fault_plan=plan) as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        engine.put_deferred(k, src.src_segments, results.append)
        wait_for_fault(plan)
        engine.put_deferred(k, src.src_segments, results.append)
        plan.clear()
        plan.release()
        wait_until(lambda: len(results) == 2, WAIT_S, "a deferred put never completed")
        assert results == [[True], [True]]
        assert [t["pages_written"] for t in engine.stats()["tiers"]] == [1, 1]


def test_fsync_full_a_put_that_joined_another_puts_write_is_false_when_the_directory_sync_fails(
        tier_dirs, monkeypatch):
    """fsync=full, one tier: a second put of a key joins the first put's write in flight; then the page
    directory's fsync fails (EIO). No copy is durable: both puts answer False (before: the second
    answered True, its sync judged only its own pages, not the one it joined). Found by a review."""
    plan = TierFaultPlan()
    pages = PageSet(64 << 10, held=1)
    (k,) = pages.keys(1)

    def failing_sync(self, dirs):
        raise OSError(errno.EIO, "fsync directory: Input/output error")

    with make_engine(tier_dirs[:1], fault_plan=plan, fsync="full") as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        first, out1 = in_thread(engine.put, [k], pages.src_segments)
        wait_for_fault(plan, WAIT_S)
        second, out2 = in_thread(engine.put, [k], pages.src_segments)
        wait_until(lambda: len(engine._writes.queue.pending[k].calls) == 2, WAIT_S,
                   "the second put never joined the first")
        monkeypatch.setattr(Tier, "sync_dirs", failing_sync)
        plan.clear()
        plan.release()
        first.join(WAIT_S)
        second.join(WAIT_S)
        assert out1 == [[False]] and out2 == [[False]]


def test_a_put_never_answers_for_a_version_of_another_length_being_written(tier_dirs):
    """Two puts of one key at the same moment, of other sizes (two deployments of the namespace): the
    second does not join the first's write (that is not its page); it answers False, and its next put
    stores its own version (before: it answered True for the other size's copy)."""
    plan = TierFaultPlan()
    big, small = PageSet(64 << 10, held=1, salt="v"), PageSet(16 << 10, held=1, salt="v")
    (k,) = big.keys(1)
    with make_engine(tier_dirs[:1], fault_plan=plan) as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        first, out1 = in_thread(engine.put, [k], big.src_segments)
        wait_for_fault(plan, WAIT_S)
        assert engine.put([k], small.src_segments) == [False]
        plan.clear()
        plan.release()
        first.join(WAIT_S)
        assert out1 == [[True]] and big.checked_get(engine, [k]) == [True]
        assert small.put(engine, [k]) == [True] and small.checked_get(engine, [k]) == [True]


def test_a_version_of_another_length_does_not_turn_a_put_into_a_no_op(tier_dirs):
    """Another deployment of the namespace (another KV dtype: 12 KiB pages, not 48 KiB) stores a key
    on a tier both share; this engine finds it (a miss: the other size). A put of the key at its own
    length writes it over that version, and the get finds it (before: the key counted as held, the put
    answered True and wrote nothing, and every later get missed). Found by a review."""
    mine, theirs = PageSet(48 << 10, salt="v"), PageSet(12 << 10, salt="v")
    keys = mine.keys(1)
    with make_engine(tier_dirs[:1]) as engine:
        with make_engine(tier_dirs[2:3]) as other:
            assert theirs.put(other, keys) == [True]
            source = other.tiers[0].layout
        ours = TierLayout(tier_dirs[0], engine.namespace.digest)
        os.makedirs(ours.page_dir(keys[0]), mode=0o700, exist_ok=True)
        shutil.copyfile(source.page_path(keys[0]), ours.page_path(keys[0]))
        assert mine.checked_get(engine, keys) == [False]
        assert mine.put(engine, keys) == [True]
        assert mine.checked_get(engine, keys) == [True]


def test_lru_order_of_a_put_places_a_page_it_joined_in_its_batch(tier_dirs):
    """put([b, x]) while another put writes x: x (joined) is placed in this put's batch order, the batch's
    head b the most recent (PutCall.lru_order)."""
    plan = TierFaultPlan()
    pages = PageSet(8192)
    x, b = pages.keys(2)
    with make_engine(tier_dirs[:1], fault_plan=plan) as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        first, out1 = in_thread(pages.put, engine, [x])
        wait_for_fault(plan, WAIT_S)
        second, out2 = in_thread(pages.put, engine, [b, x])
        wait_until(lambda: engine._writes.queue.pending.get(b) is not None, WAIT_S, "the second put never queued")
        plan.clear()
        plan.release()
        first.join(WAIT_S)
        second.join(WAIT_S)
        assert out1 == [[True]] and out2 == [[True, True]]
        assert engine.index.keys(0) == [x, b], "LRU order of put([b, x]) is not reverse batch order"


def test_lru_order_of_a_put_that_mixes_new_and_held_pages_is_its_batch_s(tier_dirs):
    """Within one put LRU order is reverse batch order, held pages of the batch included: put([b, a]) with b
    new and a held leaves b, its head, the most recent and a just before it, so the next evictions take a
    before b (before: a held page was touched when the put was accepted, the new ones when it ended, so a
    new page passed a held one whatever the batch said). Found by a review."""
    pages = PageSet(8192)
    with make_engine(tier_dirs[:1], capacity="24K") as engine:  # three pages
        x, y, a, b, c, d = pages.keys(6)
        assert pages.put(engine, [a]) == [True]
        assert pages.put(engine, [x, y]) == [True, True]  # LRU, least recent first: a, y, x
        assert pages.put(engine, [b, a]) == [True, True]  # b new (evicts y, not a: touched first), a held
        assert engine.index.keys(0) == [x, a, b]
        assert pages.put(engine, [c, d]) == [True, True]  # the two least recent go: x and a
        assert engine.index.keys(0) == [b, d, c]


def test_a_prefix_is_evicted_from_its_tail_after_a_put_and_after_a_get(tier_dirs):
    """A page serves only while every page before it is held (SGLang's batch_exists and LMCache's lookup count
    the leading run), so a capacity evicts a call's pages from its tail, as SGLang's radix tree evicts leaves
    first. In batch order, the head went first: one page over the capacity left a prefix of 0 pages."""
    pages = PageSet(8192)
    with make_engine(tier_dirs[:1], capacity="32K") as engine:  # four pages
        p, n = pages.keys(4), pages.keys(2, start=4)
        assert pages.put(engine, p) == [True] * 4
        assert pages.put(engine, n[:1]) == [True]
        assert engine.prefix_len(p) == 3, "the put's head was evicted before its tail"
        assert pages.checked_get(engine, p[:3] + n[:1]) == [True] * 4  # the get's head ends the most recent
        assert pages.put(engine, n[1:]) == [True]
        assert engine.prefix_len(p) == 3 and not engine.contains(n[0]), "the get's head was evicted first"


def test_clear_drops_queued_and_in_flight_writes(tier_dirs):
    plan = TierFaultPlan()
    src = Pages(4, seed=5)
    keys = [key(i, "clear") for i in range(4)]
    results: list = []
    with make_engine(tier_dirs[:2], fault_plan=plan) as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        engine.put_deferred(keys, src.src_segments, results.append)
        wait_for_fault(plan)
        clearer, _ = in_thread(engine.clear)
        # clear may also run whole while the write is held (the writer's step ends at WAKE_S, and
        # clear cancels the write in flight): under load this thread did not look in between
        wait_until(lambda: engine._writes.queue.exclusive or not clearer.is_alive(), WAIT_S, "clear never started")
        plan.clear()
        plan.release()
        clearer.join(WAIT_S)
        wait_until(lambda: results, WAIT_S, "the put never completed")
        assert not any(engine.contains(k) for k in keys)
        assert engine.stats()["write_backlog_bytes"] == 0 and engine.check() == []


def test_clear_and_check_while_writes_wait_for_a_read(tier_dirs):
    """Writes held back by a get (nothing in flight) do not block clear() or check(); the held
    writes are dropped by clear and their put completes. (clear and check take the read path's lock,
    so they run once the stalled get gives up at read_timeout: short here.)"""
    plan = TierFaultPlan()
    pages = PageSet()
    src = Pages(2, seed=6)
    keys = [key(i, "held-clear") for i in range(2)]
    results: list = []
    with make_engine(tier_dirs[:2], fault_plan=plan, clock=FakeClock(), read_timeout=0.5) as engine, \
            releasing(plan):
        stored = pages.keys(2)
        assert pages.put(engine, stored) == [True] * 2
        reader = Held(engine, pages, stored, plan, tier_dirs[0])
        engine.put_deferred(keys, src.src_segments, results.append)
        wait_until(lambda: all(engine.index.holders(k) == 0b10 for k in keys), WAIT_S, "tier 1 never took the pages")
        assert engine.check() == []
        engine.clear()
        wait_until(lambda: results, WAIT_S, "the put never completed")
        assert not any(engine.contains(k) for k in keys)
        assert len(reader.release()) == 2  # the get ends (what it finds of cleared pages is not the point)
        assert engine.stats()["write_backlog_bytes"] == 0 and engine.check() == []


# ------------------------------------------------------------------------------- replicas in budget
@pytest.mark.parametrize("queued,home,w,w_home,slack,fits", [
    (0, 8, 1.0, 1.0, 0.0, True),    # drains with the home copy
    (8, 8, 1.0, 1.0, 0.0, False),   # one page more than the home copy: later
    (4, 8, 1.0, 2.0, 12.0, True),   # later than the home copy, within the slack
    (8, 8, 1.0, 2.0, 16.0, True),
    (10, 8, 1.0, 2.0, 16.0, False),  # beyond the slack
    (0, 8, 0.0, 1.0, 0.0, True),    # not measured yet: admitted
    (0, 8, 1.0, 0.0, 0.0, True),
])
def test_budget_rule(queued, home, w, w_home, slack, fits):
    assert admission.replica_fits(queued, 8, w, home, w_home, slack) is fits


def test_a_slow_tier_skips_replicas_that_would_drain_after_the_home_copy(tier_dirs):
    """replicate=budget, slack 0.5 s, tier 1 much slower to write (every write delayed 0.5 s): once
    both write bandwidths are measured, a large put leaves some pages on tier 0 alone. A skip is
    counted per tier, is not under-replication, fails no page, and every page reads back;
    replicate=all keeps every replica."""
    plan = TierFaultPlan()
    page = 1 << 20
    warm = 2 * writes.TRUST_BYTES // page  # (a page's short last write measures nothing: test_replication.py)
    for mode in ("budget", "all"):
        pages = PageSet(page, salt=mode)
        plan.clear()
        plan.on(tier_dirs[1], Fault.delay(0.5), opcode=OP_WRITE)
        # (catchup off: background replication would write a skipped replica to tier 1 behind the put,
        # which under load it did before the holders were counted: 21 skipped, 20 on tier 0 alone)
        with make_engine(tier_dirs[:2], fault_plan=plan, replicate=mode, replicate_slack=0.5,
                         catchup=False) as engine:
            warm_keys = pages.keys(warm)
            assert pages.put(engine, warm_keys) == [True] * warm  # accepted unmeasured: every replica
            assert [engine.index.holders(k) for k in warm_keys] == [0b11] * warm
            assert all(engine._writes._bandwidth_under_queues(k) > 0 for k in range(2))  # both measured now
            batch = pages.keys(24, 1000)
            assert pages.put(engine, batch) == [True] * 24
            stats = engine.stats()
            alone = [k for k in batch if engine.index.holders(k) == 0b01]
            skipped = stats["tiers"][1]["replica_skipped_pages"]
            assert stats["under_replicated"] == 0 and stats["pages_failed"] == 0
            assert skipped == len(alone)
            assert stats["tiers"][1]["replica_skipped_bytes"] == skipped * file_size(engine.index.get(batch[0]).length)
            assert stats["tiers"][0]["replica_skipped_pages"] == 0  # the home tier takes every page
            if mode == "budget":
                assert 0 < len(alone) < 24
            else:
                assert skipped == 0
            assert pages.checked_get(engine, batch) == [True] * 24


@pytest.mark.parametrize("aligned", [True, False], ids=["zero-copy", "staged"])
def test_a_write_ring_that_breaks_is_replaced_and_holds_no_caller(tier_dirs, caplog, aligned):
    """The write ring's descriptor replaced under the engine (a library that closes or dup2s over
    descriptors it does not own): every io_uring call on it fails from then on (EOPNOTSUPP). The
    writer's recovery from a failed step waited for the writes in flight by reaping, which raised
    again and ended the writer thread: that put, and every later one, waited for ever; then (stop 38)
    the ring was closed and every later put failed. Now the write path replaces the ring (inflight.py):
    the put in flight fails, later puts are stored on a new ring, and reads, on their own ring, go on.
    Staged writes give their staging back (the count of staging in use leaked when a write was given up)."""
    pages = PageSet(8192, aligned=aligned)
    before = io_uring_fds()
    with make_engine(tier_dirs[:2], replicate="all", catchup=False) as engine:  # (no replica owed: no
        rings = io_uring_fds() - before                                         # catch-up read on a ring)
        stored = pages.keys(2)
        assert pages.put(engine, stored) == [True, True]
        (write_ring,) = [fd for fd in rings if sq_tail(fd) > 0]  # (nothing was read yet)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, write_ring)  # (not a close: the number stays ours, so no other file takes it)
        os.close(null)
        result = {}
        putter = threading.Thread(target=lambda: result.setdefault("put", pages.put(engine, pages.keys(2, 100))))
        putter.start()
        putter.join(30)
        assert not putter.is_alive(), "a put waited for ever on the broken write ring"
        assert result["put"] == [False, False]
        assert engine._writes._staged == 0
        failed = [r for r in caplog.records if "write ring failed" in r.getMessage()]
        assert [r.exc_info is not None for r in failed] == [True, False]  # (the error, then the replacement)
        assert "go on on a new ring" in failed[1].getMessage()
        assert engine.stats()["ring_failures"] == 1
        later = pages.keys(3, 200)
        assert pages.put(engine, later) == [True] * 3
        assert [engine.index.holders(k) for k in later] == [0b11] * 3
        assert pages.checked_get(engine, stored + later) == [True] * 5


def _hung_tier_1(tier_dirs, plan):
    """An engine whose tier 1 hangs on writes (held) once a first page was put: that put answers at
    write_timeout from tier 0, and tier 1's abandoned write stays on the ring (an orphan)."""
    engine = make_engine(tier_dirs[:2], fault_plan=plan, replicate="all", write_timeout=0.5, tier_retry=600,
                         catchup=False)
    plan.on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)
    pages = PageSet(1 << 20, aligned=False)
    assert pages.put(engine, pages.keys(1)) == [True]
    assert engine._writes.io.orphans >= 1 and tmp_files(tier_dirs[1])
    return engine, pages


def _put_returns(engine, pages, keys) -> list:
    out = []
    t = threading.Thread(target=lambda: out.append(pages.put(engine, keys)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "a put waited for the hung tier"
    return out[0]


def test_a_write_ring_replaced_under_a_hung_tier_s_abandoned_writes_removes_their_files(tier_dirs):
    """The write ring breaks while a hung tier's abandoned write is on it: the replacement gives that
    write up as a hung tier's end of write does, so its temporary file goes once the tier answers
    (before: its job was never discarded, the file and its descriptor stayed past close()). Found by
    a review."""
    plan = TierFaultPlan()
    before = io_uring_fds()
    engine, pages = _hung_tier_1(tier_dirs, plan)
    with engine, releasing(plan):
        (write_ring,) = [fd for fd in io_uring_fds() - before if sq_tail(fd) > 0]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, write_ring)
        os.close(null)
        _put_returns(engine, pages, pages.keys(1, 10))
        assert engine.stats()["ring_failures"] == 1
        plan.clear()
        plan.release()  # the hung tier answers
        wait_until(lambda: not tmp_files(tier_dirs[1]), 10, "the abandoned write's temporary file stayed")


class _BuggyPlan(TierFaultPlan):
    """Raises once when armed: any bug in a writer step (the writer fails what is pending, lives on)."""
    armed = False

    def decide(self, opcode, fd, offset, length):
        if self.armed:
            self.armed = False
            raise RuntimeError("a bug in a writer step")
        return super().decide(opcode, fd, offset, length)


def test_a_writer_error_does_not_wait_for_a_hung_tier_s_abandoned_writes(tier_dirs):
    """An unexpected error in the writer's step while a hung tier's abandoned write is on the ring:
    the writer gives up what is pending without waiting for that write (before: it reaped until the
    hung tier answered, and every put waited with it). Found by a review."""
    plan = _BuggyPlan()
    engine, pages = _hung_tier_1(tier_dirs, plan)
    with engine, releasing(plan):
        plan.armed = True
        assert len(_put_returns(engine, pages, pages.keys(1, 10))) == 1
        assert _put_returns(engine, pages, pages.keys(1, 20)) == [True]  # (tier 0; tier 1 failed, retried later)
        assert engine._writes.io.orphans >= 1


# ---------------------------------------------------------------------- open files (issue 16 item 7)
def test_a_large_put_holds_a_bounded_number_of_files(tier_dirs, fd_limit, caplog):
    """3,000 pages on two tiers under a limit of open_fds + 128: every page stored, no warning
    (before: one temporary file per page per tier at once, EMFILE from the 128th on)."""
    pages = PageSet(4096)
    keys = pages.keys(3000)
    with make_engine(tier_dirs[:2]) as engine:
        fd_limit(open_fds() + 128)
        assert pages.put(engine, keys) == [True] * 3000
        assert engine.stats()["pages_failed"] == 0 and engine.stats()["under_replicated"] == 0
        assert [t["write_failures"] for t in engine.stats()["tiers"]] == [0, 0]
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "same file system" not in r.message]


def test_out_of_descriptors_is_never_a_failure(tier_dirs, fd_limit):
    """Fewer descriptors than the write path would keep open (EMFILE mid-put): the put waits for its
    own files to close and stores every page; no tier fails."""
    pages = PageSet(4096)
    keys = pages.keys(400)
    with make_engine(tier_dirs[:2]) as engine:
        fd_limit(open_fds() + 6)  # caller buffers and CRC work need none; 6 < 2 x TMP_FILES_PER_TIER
        assert pages.put(engine, keys) == [True] * 400
        stats = engine.stats()
        assert stats["pages_failed"] == 0 and all(t["healthy"] and not t["write_failures"] for t in stats["tiers"])
    assert files.TMP_FILES_PER_TIER * 2 > 6  # (so the limit really was below what the path would open)


# ---------------------------------------------------------------------- a bug in the writer (review)
def test_an_error_while_submitting_fails_the_put_and_the_writer_lives_on(tier_dirs, monkeypatch, caplog):
    """An unexpected error after some writes of a batch were recorded but before the batch went to
    the ring (here: staging memory for a tier-1 job): the put returns, its pages failed, and the
    writer keeps working (before: it reaped forever for writes that were never submitted)."""
    pages = PageSet(8192, aligned=False)  # unaligned: every job takes a staging copy
    keys = pages.keys(4)
    with make_engine(tier_dirs[:2]) as engine:
        path = engine._writes
        real = path._stage_under_writer
        calls = []

        def stage(write, offset):
            calls.append(write.job.page.key)
            if len(calls) == 2:
                raise MemoryError("staging memory (a bug or a real shortage)")
            return real(write, offset)

        monkeypatch.setattr(path, "_stage_under_writer", stage)
        out = []
        t = threading.Thread(target=lambda: out.append(pages.put(engine, keys)), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "the put never returned: the writer is stuck"
        assert len(out[0]) == 4 and not all(out[0])
        assert "write path error" in caplog.text
        assert path._staged == 0  # (the writes reaped while giving up gave their staging back)
        monkeypatch.setattr(path, "_stage_under_writer", real)
        more = pages.keys(4, start=4)
        assert pages.put(engine, more) == [True] * 4  # the writer lives on
        assert pages.checked_get(engine, more) == [True] * 4
        engine.clear()  # (the failed put may leave a page on one tier only: start the check clean)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["quota", "eio"])
def test_a_home_tier_write_failure_is_written_to_a_tier_that_skipped_it(tier_dirs, err):
    """replicate=budget, tier 1 measured slower (its writes delayed) so it skips replicas; then every
    write of tier 0 fails (a quota: ENOSPC; or EIO). Each page whose home write failed is written to
    tier 1 before the put answers: every page True, on tier 1, read back; the next put too (before:
    21 of 24 pages False, again on the put after)."""
    plan = TierFaultPlan()
    page = 1 << 20
    warm = 2 * writes.TRUST_BYTES // page  # (a page's short last write measures nothing: test_replication.py)
    pages = PageSet(page)
    plan.on(tier_dirs[1], Fault.delay(0.5), opcode=OP_WRITE)
    # memory=16M: a tier's write window is at most 4 MiB, so tier 1 measures at most 8 MiB/s whatever
    # its window grew to, and skips unless tier 0 wrote slower than that (with the default 64M it
    # measured up to 32 MiB/s: where the disk was slow it took every replica, and nothing was tested)
    with make_engine(tier_dirs[:2], fault_plan=plan, replicate_slack=0.5, memory="16M") as engine:
        assert pages.put(engine, pages.keys(warm)) == [True] * warm
        assert all(engine._writes._bandwidth_under_queues(k) > 0 for k in range(2))
        plan.on(tier_dirs[0], Fault.error(err), opcode=OP_WRITE)
        for start in (1000, 2000):
            skipped = engine.stats()["tiers"][1]["replica_skipped_pages"]
            batch = pages.keys(24, start)
            assert pages.put(engine, batch) == [True] * 24
            assert all(engine.index.holders(k) & 0b10 for k in batch)
            assert pages.checked_get(engine, batch) == [True] * 24
            if start == 1000:  # (after EIO tier 0 is failed: the next put's home is tier 1)
                assert engine.stats()["tiers"][1]["replica_skipped_pages"] > skipped, "no replica was skipped"


# ------------------------------------------------------------------------- bounded write staging (issue 22 item 4)
@pytest.mark.parametrize("tiers", [1, 2])
def test_a_page_larger_than_write_staging_is_staged_a_request_at_a_time(tier_dirs, tiers):
    """One 40 MiB page 1 byte off 4096 alignment in caller memory, memory=8M (4 MiB for writes): it is
    written a staged request at a time (back-pressure), never staged whole: the write pool's peak stays
    within its half of memory plus one request (before: the whole page, 40 MiB). Read back byte-exact."""
    pages = PageSet(40 << 20, aligned=False)
    keys = pages.keys(1)
    with make_engine(tier_dirs[:tiers], memory="8M", replicate="all") as engine:
        assert pages.put(engine, keys) == [True]
        peak = engine.stats()["memory"]["write_peak_bytes"]
        assert peak <= (4 << 20) + engine._writes.io.flows[0].request + 4096, f"write staging peaked at {peak >> 20} MiB"
        assert engine.index.holders(keys[0]) == (1 << tiers) - 1
        assert pages.checked_get(engine, keys) == [True]
        for k in range(tiers):
            assert pages.checked_get(engine, keys, SingleTier(k)) == [True]


def test_many_unaligned_pages_stay_within_write_staging(tier_dirs):
    """8 unaligned 6 MiB pages in one put, memory=8M: staging in flight stays bounded (the pages
    wait for it; before: the first page staged whole), every page stored and read back."""
    pages = PageSet(6 << 20, aligned=False)
    keys = pages.keys(8)
    with make_engine(tier_dirs[:2], memory="8M", replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * 8
        peak = engine.stats()["memory"]["write_peak_bytes"]
        assert peak <= (4 << 20) + engine._writes.io.flows[0].request + 4096, f"write staging peaked at {peak >> 20} MiB"
        assert pages.checked_get(engine, keys) == [True] * 8


# --------------------------------------------------------------------------- a hung tier (issue 22 item 6)
@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "zero_copy"])
def test_a_put_answers_at_write_timeout_when_a_tier_hangs(tier_dirs, aligned):
    """Tier 1's writes never complete (held in the ring: a hung tier). Past write_timeout the tier is
    failed and the put answers: every page True from tier 0 (before: the put blocked as long as the
    tier; pages written from the caller's memory on a local tier, as long as the tier too). The writes
    left on the ring are the abandoned jobs' (staged copies, or zero-copy writes whose bytes go only
    to files never renamed into place). When the held writes end, their temporary files go; the tier
    holds no page; the pages read back from tier 0."""
    plan = TierFaultPlan()
    pages = PageSet(3 << 20, aligned=aligned)
    keys = pages.keys(4)
    with make_engine(tier_dirs[:2], fault_plan=plan, replicate="all", write_timeout=0.5, tier_retry=600) as engine, \
            releasing(plan):
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)
        t, out = in_thread(pages.put, engine, keys)
        t.join(WAIT_S)
        assert not t.is_alive(), "the put waited for a hung tier"
        assert out == [[True] * 4]
        row = engine.stats()["tiers"][1]
        assert not row["healthy"] and row["write_timeouts"] == 1 and row["writes_abandoned"] >= 1
        left = list(engine._writes.io.requests())
        assert left and all(w.orphan and (w.staging is not None) == (not aligned) for w in left)
        assert all(engine.index.holders(k) == 0b01 for k in keys)
        plan.clear()
        plan.release()
        wait_until(lambda: not tmp_files(tier_dirs[1]), WAIT_S, "an abandoned write's temporary file stayed")
        assert page_files(tier_dirs[1]) == []
        assert pages.checked_get(engine, keys) == [True] * 4
        assert pages.put(engine, pages.keys(2, start=4)) == [True] * 2  # the writer goes on (tier 0)


def test_close_returns_while_a_hung_tier_holds_abandoned_writes(tier_dirs):
    """close() with abandoned writes still held by a hung tier returns (the ring is closed by a
    background thread, which removes their files once they end)."""
    plan = TierFaultPlan()
    pages = PageSet(1 << 20, aligned=False)
    engine = make_engine(tier_dirs[:2], fault_plan=plan, replicate="all", write_timeout=0.5, tier_retry=600)
    try:
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)
        assert pages.put(engine, pages.keys(2)) == [True, True]
        closer = threading.Thread(target=engine.close)
        closer.start()
        closer.join(WAIT_S)
        assert not closer.is_alive(), "close() waited for a hung tier"
    finally:
        plan.clear()
        plan.release()
        engine.close()
    wait_until(lambda: not any(t.name == "kvstream-close" for t in threading.enumerate()), WAIT_S,
               "the background close never ended")
    # (each file goes in a kvstream-discard thread of its own, which may still run after the close)
    wait_until(lambda: not tmp_files(tier_dirs[1]), WAIT_S, "an abandoned write's temporary file stayed")


@pytest.mark.parametrize("memory,chunk,page", [("4M", "16K", 1 << 20), ("128M", "16M", 32 << 20)])
def test_a_hung_tier_s_abandoned_staging_does_not_hold_the_healthy_tiers_puts(tier_dirs, memory, chunk, page):
    """Tier 1 hangs with staged writes in flight that fill write staging: abandoned at write_timeout,
    their staging leaves the budget (the pool has it back when they end), so the next put, to tier 0
    now, goes through (before: it waited as long as the hung tier, the budget full of the abandoned
    writes' staging). Found by a review."""
    plan = TierFaultPlan()
    pages = PageSet(page, aligned=False)
    with make_engine(tier_dirs[:2], fault_plan=plan, replicate="all", write_timeout=0.3, tier_retry=600,
                     memory=memory, chunk=chunk) as engine, releasing(plan):
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)
        assert _put_returns(engine, pages, pages.keys(2)) == [True, True]
        assert not engine.tiers[1].healthy and engine._writes.io.orphans
        assert _put_returns(engine, pages, pages.keys(2, start=2)) == [True, True]


def test_close_answers_a_deferred_put_queued_behind_a_hung_tier_s_abandoned_staging(tier_dirs):
    """A deferred put queued while a hung tier's abandoned writes hold the staging they took: close()
    writes it to the healthy tier, answers it and returns (before: close() waited for the hung tier,
    the deferred put unanswered). Found by a review."""
    plan = TierFaultPlan()
    pages = PageSet(1 << 20, aligned=False, held=4)
    keys = pages.keys(4)
    done: list = []
    engine = make_engine(tier_dirs[:2], fault_plan=plan, replicate="all", write_timeout=0.3, tier_retry=600,
                         memory="4M")
    try:
        with releasing(plan):
            plan.on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)
            assert engine.put(keys[:2], pages.src_segments[:2]) == [True, True]
            assert not engine.tiers[1].healthy
            engine.put_deferred(keys[2:], pages.src_segments[2:], done.append)
            closer = threading.Thread(target=engine.close, daemon=True)
            closer.start()
            closer.join(20)
            assert not closer.is_alive(), "close() waited for a hung tier's abandoned writes"
            assert done == [[True, True]]
    finally:
        engine.close()


def test_a_writer_step_held_up_by_one_tier_never_fails_another_as_hung(tier_dirs, fuse_tier):
    """Tier 1's FUSE daemon stops for 1 s while a put starts: the writer's step waits in tier 1's
    create (held up, not hung: its file system answers later) after it queued tier 0's writes. Tier 0's
    hang clock starts when its writes are sent, so tier 0 stays healthy and holds both pages (before:
    the clock started with the step, and tier 0 was failed as hung, write_timeout 0.3 s, at the step's
    first reap). Found by a review."""
    tier, daemon = fuse_tier
    plan = TierFaultPlan().on(tier_dirs[0], Fault.delay(0.05), opcode=OP_WRITE)
    pages = PageSet(64 << 10)
    keys = pages.keys(2, start=1)
    resume = threading.Timer(1.0, os.kill, (daemon.pid, signal.SIGCONT))
    with make_engine([tier_dirs[0], tier], fault_plan=plan, replicate="all", write_timeout=0.3,
                     tier_retry=600, discover=False) as engine:
        try:
            assert pages.put(engine, pages.keys(1)) == [True]
            os.kill(daemon.pid, signal.SIGSTOP)
            resume.start()
            assert pages.put(engine, keys) == [True, True]
        finally:
            resume.cancel()
            os.kill(daemon.pid, signal.SIGCONT)
            plan.clear()
        row = engine.stats()["tiers"][0]
        assert row["healthy"] and row["write_timeouts"] == 0, engine.tiers[0].last_error
        assert all(engine.index.holders(k) & 1 for k in keys)


def _gated_put_let_go_of(tier_dirs, join: bool):
    """put_deferred with a gate (LMCache's L2Core) of pages 0-1 whose writes are in flight (held); a
    put_deferred without one of page 2; with ``join``, a put of page 0 from another caller, from memory of
    its own, that waits for that copy (writequeue.py). Then the gate shuts (L2Core.close giving up on a
    hung tier) and the writes end. Returns (engine, pages, results: gated, other, joined)."""
    from kvstream_hicache.memory import CallerGate

    plan = TierFaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    pages = PageSet(held=3)
    keys = pages.keys(3)
    gate, gated, other, joined = CallerGate("source"), [], [], []
    mine = pages.fresh()[:1]  # the joining put's own copy of page 0
    for a, b in zip(mine[0], pages.src[0]):
        a[:] = b
    try:
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        engine.put_deferred(keys[:2], pages.src_segments[:2], gated.append, gate)
        wait_for_fault(plan)
        engine.put_deferred(keys[2:], pages.src_segments[2:], other.append)
        joiner = threading.Thread(target=lambda: joined.append(engine.put(keys[:1], segments_of(mine))), daemon=True)
        if join:
            joiner.start()
            wait_until(lambda: len(engine._writes.queue.pending[keys[0]].calls) == 2 or not joiner.is_alive(), WAIT_S,
                       "the put never joined")
            assert joiner.is_alive()
        assert gate.close(WAIT_S)
        plan.clear()
        plan.release()
        if join:
            joiner.join(WAIT_S)
        wait_until(lambda: gated and other, WAIT_S, "the deferred puts never ended")
    except BaseException:
        plan.clear()
        plan.release()
        engine.close()
        raise
    return engine, pages, (gated, other, joined)


def test_a_gated_put_let_go_of_with_writes_in_flight_commits_nothing_and_releases_all(tier_dirs):
    """The gated put's jobs, cancelled (WritePage.gone) while their writes are in flight, commit nothing
    and give everything back: temporary files, index reservations, descriptors, staging; the other put
    commits as ever."""
    fds = open_fds()
    engine, pages, (gated, other, _) = _gated_put_let_go_of(tier_dirs, join=False)
    with engine:
        assert gated == [[False, False]] and other == [[True]]
        assert [engine.held(k) for k in pages.keys(3)] == [False, False, True]
        assert tmp_files(tier_dirs[0]) == [] and engine.index.reserved == [0]
        assert engine._writes._staged == 0 and not any(engine._writes.jobs.active)
    assert open_fds() == fds


def test_a_put_that_joined_a_page_whose_caller_let_go_of_its_memory_still_stores_it(tier_dirs):
    """The put that joined page 0 (the SGLang path, or another core on an engine it was given) never let go
    of its own memory: its page is stored, written from that memory (WriteQueue._hand_over_under_queues).
    Found in the review of stop 46: it got False, the key was not stored (the copy it waited for was the
    gated put's, cancelled)."""
    engine, pages, (gated, other, joined) = _gated_put_let_go_of(tier_dirs, join=True)
    with engine:
        assert gated == [[False, False]] and other == [[True]]
        assert joined == [[True]], "a put whose memory was never let go lost its page to another caller's gate"
        assert pages.checked_get(engine, pages.keys(1)) == [True]
        assert engine.stats()["write_backlog_bytes"] == 0 and tmp_files(tier_dirs[0]) == [] and engine.check() == []


def test_a_page_joined_by_several_puts_is_written_once_from_the_first_that_did_not_let_go(tier_dirs):
    """A gated put_deferred of page 0 (LMCache's L2Core) is being written to two tiers (held); three puts of
    the key join it: a second store of the same core (the same gate, its memory let go of with the first's:
    filled with other bytes here, as freed memory may be), a put_deferred without a gate (another caller),
    and a put. The gate shuts and the writes end. The store of the same core gets False; the page is
    written once to each tier, from the memory of a joined caller that still has it (never the freed one),
    and both those callers get True (before: all four False, the key lost)."""
    from kvstream_hicache.memory import CallerGate

    plan = TierFaultPlan()
    pages = PageSet(held=1)
    (k,) = pages.keys(1)
    freed, deferred, mine = pages.fresh(), pages.fresh(), pages.fresh()
    for a, b, c, d in zip(freed[0], deferred[0], mine[0], pages.src[0]):
        a[:], b[:], c[:] = 0x5A, d, d
    gate, gated, same_core, other = CallerGate("source"), [], [], []
    with make_engine(tier_dirs[:2], fault_plan=plan, replicate="all") as engine, releasing(plan):
        for tier in tier_dirs[:2]:
            plan.on(tier, Fault.hold(), opcode=OP_WRITE)
        engine.put_deferred([k], pages.src_segments, gated.append, gate)
        wait_until(lambda: len(plan.hits) >= 2, WAIT_S, "the writes to both tiers never reached the ring")
        engine.put_deferred([k], segments_of(freed), same_core.append, gate)
        engine.put_deferred([k], segments_of(deferred), other.append)
        putter, joined = in_thread(engine.put, [k], segments_of(mine))
        wait_until(lambda: len(engine._writes.queue.pending[k].calls) == 4, WAIT_S, "the put never joined")
        assert gate.close(WAIT_S)
        plan.clear()
        plan.release()
        putter.join(WAIT_S)
        wait_until(lambda: gated and same_core and other, WAIT_S, "the deferred puts never ended")
        assert gated == [[False]] and same_core == [[False]]
        assert other == [[True]] and joined == [[True]], "puts whose memory was never let go lost their page"
        assert pages.checked_get(engine, [k]) == [True]
        assert engine.index.get(k).tiers == 0b11 and [t["pages_written"] for t in engine.stats()["tiers"]] == [1, 1]
        stats = engine.stats()
        assert stats["pages_stored"] == 1 and stats["pages_failed"] == 0 and stats["write_backlog_bytes"] == 0
        assert engine.check() == []


def test_a_page_clear_cancelled_is_not_written_for_a_put_that_joined_it_when_its_caller_lets_go(tier_dirs):
    """clear() (SGLang's after a weight update) cancels a gated put_deferred's page being written (held),
    which a put joined; then the gate shuts and the writes end. The page stays cancelled, the put gets
    False and nothing is stored: a put that joined a page clear() dropped never writes it after the clear
    (its KV may be stale), even though its own memory is still there."""
    from kvstream_hicache.memory import CallerGate

    plan = TierFaultPlan()
    pages = PageSet(held=1)
    (k,) = pages.keys(1)
    gate, gated = CallerGate("source"), []
    with make_engine(tier_dirs[:1], fault_plan=plan) as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        engine.put_deferred([k], pages.src_segments, gated.append, gate)
        wait_for_fault(plan)
        putter, joined = in_thread(engine.put, [k], pages.src_segments)
        wait_until(lambda: len(engine._writes.queue.pending[k].calls) == 2, WAIT_S, "the put never joined")
        engine.clear()
        assert gate.close(WAIT_S)
        plan.clear()
        plan.release()
        putter.join(WAIT_S)
        wait_until(lambda: gated, WAIT_S, "the deferred put never ended")
        assert gated == [[False]] and joined == [[False]]
        assert not engine.held(k) and pages.checked_get(engine, [k]) == [False] and page_files(tier_dirs[0]) == []
        assert engine.stats()["write_backlog_bytes"] == 0


@pytest.mark.parametrize("how", ["put", "put_deferred"])
def test_a_put_after_clear_writes_its_own_page_never_the_one_clear_cancelled(tier_dirs, how):
    """A put_deferred's page (KV of before a weight update) is being written, its write in flight (its end
    delayed); clear() cancels it. A put of the key from other memory (``put``, SGLang's, which flushes with
    clear() and serves the same prefixes again; ``put_deferred``, LMCache's) comes right after clear()
    returned, its own write held. The cancelled page's write ends: its put gets False, and the new put is
    not answered with it, its page the one being written. Released, the new put gets True and the key reads
    back with its bytes: one page file, no temporary file, backlog 0. Found in review (clearput): the put
    joined the cancelled page, still in ``pending`` until its write ended, and got False, its page not
    stored."""
    plan = TierFaultPlan()
    pages, stale = PageSet(held=1), PageSet(held=1, salt="stale")  # (stale: other bytes, the same size)
    (k,) = pages.keys(1)
    old: list = []
    with make_engine(tier_dirs[:1], fault_plan=plan) as engine, releasing(plan):
        queue = engine._writes.queue
        plan.on(tier_dirs[0], Fault.delay(5.0), opcode=OP_WRITE, times=1)  # ends on its own, after the clear
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE, times=1)  # the put after the clear: till released
        engine.put_deferred([k], stale.src_segments, old.append)
        wait_for_fault(plan)
        cancelled = queue.pending[k]
        engine.clear()
        if how == "put":
            _, new = in_thread(engine.put, [k], pages.src_segments)
        else:
            new = []
            engine.put_deferred([k], pages.src_segments, new.append)
        wait_until(lambda: old, WAIT_S, "the cancelled page's put never ended")
        assert old == [[False]]  # (its write was in flight at the clear: cancelled)
        assert not new, f"the put after clear() was answered with the page clear() cancelled: {new}"
        assert queue.pending.get(k) not in (None, cancelled)  # (the new page, its end not disturbed)
        wait_until(lambda: len(plan.hits) == 2, WAIT_S, "the put after the clear never wrote its page")
        plan.release()
        wait_until(lambda: new, WAIT_S, "the put after the clear never ended")
        assert new == [[True]]
        assert pages.checked_get(engine, [k]) == [True] and engine.index.get(k).tiers == 0b1
        assert len(page_files(tier_dirs[0])) == 1 and tmp_files(tier_dirs[0]) == []
        assert engine.stats()["write_backlog_bytes"] == 0 and not queue.pending and not queue.cancelled


class _CountedRing:
    """A real ring whose submits (io_uring_enter calls that send) are counted."""

    def __init__(self, ring):
        self.inner, self.submits = ring, 0

    def submit(self, ops):
        self.submits += 1
        return self.inner.submit(ops)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_writer_step_sends_the_writes_of_every_tier_in_one_submit(tier_dirs):
    """The SGLang path (put, no gate): a page for two tiers goes out in one step, both tiers' writes in one
    submit (one io_uring_enter), as before ae6be7d, which submits per tier for a gated put's zero-copy
    writes (they must not wait, unsent, for another tier's hung call) and so for every put (found in the
    review of stop 46)."""
    from kvstream_hicache.io import open_ring

    rings = []
    engine = make_engine(tier_dirs[:2], ring_factory=lambda **kw: rings.append(_CountedRing(open_ring(**kw))) or rings[-1])
    with engine:
        pages = PageSet()
        before = [r.submits for r in rings]
        assert pages.put(engine, pages.keys(1)) == [True]
        assert engine.held(pages.keys(1)[0]) and engine.index.get(pages.keys(1)[0]).tiers == 0b11
        assert sorted(r.submits - b for r, b in zip(rings, before)) == [0, 1]


@pytest.mark.parametrize("capped", [0, 1])
def test_a_put_whose_head_is_being_written_keeps_the_head_on_a_capacity_limited_tier(tier_dirs, capped):
    """A prefix put while another put still writes its first pages (joined, not new): the capacity taken by those
    pages counts, as a held head's does (admission.fit_capacity), so the capacity-limited tier keeps the prefix's
    head. ``capped`` 1: the head committed on that tier already while tier 0's writes are held (its tiers were
    summed, the committed ones twice: the mask lost that tier, and the new pages after the head evicted it)."""
    plan = TierFaultPlan()
    src = Pages(6, seed=5)
    keys = [key(i, "joined") for i in range(6)]
    page = sum(n for _, n in src.src_segments[0])
    results: list = []
    capacity = [4 * page, ""] if capped == 0 else ["", 4 * page]
    with make_engine(tier_dirs[:2], fault_plan=plan, capacity=capacity) as engine, releasing(plan):
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        engine.put_deferred(keys[:2], src.src_segments[:2], results.append)
        wait_for_fault(plan)
        if capped == 1:
            wait_until(lambda: all(engine.index.holders(k) & 2 for k in keys[:2]), WAIT_S, "tier 1 never committed")
        engine.put_deferred(keys, src.src_segments, results.append)
        plan.clear()
        plan.release()
        wait_until(lambda: len(results) == 2, WAIT_S, "a deferred put never completed")
        assert results == [[True] * 2, [True] * 6]
        assert [engine.index.holders(k) >> capped & 1 for k in keys] == [1, 1, 1, 1, 0, 0], \
            engine.stats()["tiers"][capped]


def test_a_hung_tier_s_abandoned_writes_leave_no_mark_held_once_their_files_go(tier_dirs):
    """Tier 1 hangs (its writes held) and fails at write_timeout: its jobs are abandoned (the writer has no job
    there) while their temporary files stay until the held writes end. When those files go, so does the
    engine's mark (Tier._untrack): before, the writer's look found them still there and kept the mark, and
    nothing looked again: a failed tier held a file open for good (its unmount: EBUSY)."""
    plan = TierFaultPlan()
    pages = PageSet(1 << 20)
    keys = pages.keys(2)
    mark_dir = os.path.join(tier_dirs[1], "kvstream", "tmp")
    with make_engine(tier_dirs[:2], fault_plan=plan, replicate="all", write_timeout=0.5, tier_retry=600) as engine, \
            releasing(plan):
        plan.on(tier_dirs[1], Fault.hold(), opcode=OP_WRITE)
        assert pages.put(engine, keys) == [True] * 2
        assert not engine.stats()["tiers"][1]["healthy"]
        assert any(n.startswith(MARK_PREFIX) for n in os.listdir(mark_dir))  # (its files are there: held)
        plan.clear()
        plan.release()
        wait_until(lambda: not tmp_files(tier_dirs[1]), WAIT_S, "an abandoned write's temporary file stayed")
        wait_until(lambda: not any(n.startswith(MARK_PREFIX) for n in os.listdir(mark_dir)), WAIT_S,
                   "the mark stayed held on the failed tier")
