"""A put ended by Ctrl-C whose interrupt lands elsewhere than in the wait for its event: inside
WriteQueue.accept (its pages already queued), and a second Ctrl-C while its pages are withdrawn (from
the review of this stop's changes: each left a wrong page stored, or the put or the writer hung); and a
put ended by Ctrl-C whose page another put joined (that put still stores its page, from its own memory),
or inside its own join of another put's page; and one ended at any line of its queueing
(WriteQueue._enqueue_under_queues and its admission).

Python runs a SIGINT handler (KeyboardInterrupt) in the main thread at a bytecode boundary, wherever
that thread is. ``interrupt_at`` raises the KeyboardInterrupt at one chosen line (a trace function
in the main thread only), as the default handler does when the signal comes in that instant; the
engine, its rings, threads and files are all real.
"""
from __future__ import annotations

import inspect
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from kvstream_hicache.faults import Fault, FaultPlan
from kvstream_hicache.io import OP_WRITE
from kvstream_hicache.jobs import Jobs
from kvstream_hicache.memory import CallerGate
from kvstream_hicache.puts import PutCall
from kvstream_hicache.writequeue import WriteQueue
from kvstream_hicache.writes import WritePath

from helpers import PageSet, _Memory, held_read, make_engine, wait_until

HANG_S = 20  # an interrupted put whose writes are all over (nothing in flight) returns in ms: 20 s is a hang


def _line(func, text: str) -> int:
    lines, first = inspect.getsourcelines(func)
    hits = [first + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (func, text, hits)
    return hits[0]


def _code_lines(func) -> list[tuple[int, str]]:
    """Every line of ``func``'s body where a Ctrl-C can be handled (a line its code starts): (line
    number, text)."""
    code = getattr(func, "__wrapped__", func).__code__
    lines, first = inspect.getsourcelines(func)
    numbers = sorted({line for _, _, line in code.co_lines() if line is not None and line > code.co_firstlineno})
    return [(n, lines[n - first].strip()) for n in numbers]


@contextmanager
def interrupt_at(func, text: str | int, nth: int = 1):
    """Ctrl-C handled in the main thread as it reaches the line of ``func`` holding ``text`` (or line
    number ``text``) for the ``nth`` time: KeyboardInterrupt raised there. Yields the number of times
    it was raised (0 or 1)."""
    code = getattr(func, "__wrapped__", func).__code__
    line = text if isinstance(text, int) else _line(func, text)
    seen, raised = [0], [0]

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line:
            seen[0] += 1
            if seen[0] == nth:
                raised[0] += 1
                raise KeyboardInterrupt
        return local

    def calls(frame, event, arg):
        return local if frame.f_code is code else None

    sys.settrace(calls)
    try:
        yield raised
    finally:
        sys.settrace(None)


def _holding(pages: PageSet, key: str) -> _Memory:
    """Aligned caller memory (the zero-copy path) holding ``key``'s page."""
    memory = _Memory(pages.size, True)
    memory.array[:] = np.frombuffer(pages.data(key), dtype=np.uint8)
    return memory


def _stored_whole(engine, pages: PageSet, k: str) -> None:
    """``k`` reads back with its page's bytes (never the 0x5A a caller reused its memory for), nothing is
    left in the backlog, and check() finds nothing."""
    found, got = pages.get(engine, [k])
    assert found == [True] and got[0] == pages.data(k), f"served {got[0][:8].hex()}: not the joined put's bytes"
    assert engine.stats()["write_backlog_bytes"] == 0 and engine.check() == []


def test_a_put_whose_ctrl_c_lands_inside_accept_never_stores_the_memory_the_caller_reused(tier_dirs):
    """Ctrl-C comes while the put is still in WriteQueue.accept, its page already in the tier's FIFO (a
    batch of many pages spends its time in that loop). The caller gets KeyboardInterrupt and reuses its
    memory; the engine must not write that memory under the key. Before, nothing withdraws the queued
    page (PutCall.wait, which does, was never entered): the writer checksums and writes the reused bytes,
    served as the page and passing check()."""
    pages = PageSet(64 << 10)
    a, b = pages.keys(2)
    plan = FaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    try:
        assert pages.put(engine, [a]) == [True]
        reader = held_read(engine, pages, plan, a)
        memory = _holding(pages, b)
        with pytest.raises(KeyboardInterrupt), \
                interrupt_at(WriteQueue._enqueue_under_queues, "call.pages = [p for p in call.pages if p.targets]"):
            engine.put([b], [memory.segments])
        memory.array[:] = 0x5A  # the call raised: the caller's host page holds other KV now
        plan.release()
        reader.join(60)
        wait_until(lambda: not engine._writes.queue.pending, what="the queue never drained")
        found, got = pages.get(engine, [b])
        problems = engine.check()
    finally:
        plan.release()
        engine.close()
    assert not found[0] or got[0] == pages.data(b), (
        f"the engine stored the memory the caller reused after put raised KeyboardInterrupt: first bytes "
        f"{got[0][:8].hex()} (0x5a: written after the call); check() reports {problems}")


def _interrupted_put(engine, pages, plan, ctrl_c, keys, func, text, nth=1):
    """put(keys) held in the FIFO (a held read), Ctrl-C pressed; a second Ctrl-C handled where ``func``
    reaches ``text`` the ``nth`` time. Returns (hung, raised twice): hung when the put had not returned
    HANG_S s after the read was released (then freed by setting its event, so the test ends)."""
    a = pages.keys(1, 100)[0]
    assert pages.put(engine, [a]) == [True]
    reader = held_read(engine, pages, plan, a)
    memory = [_holding(pages, k) for k in keys]
    returned = threading.Event()
    state = {"hung": False}

    def press():
        queue = engine._writes.queue
        wait_until(lambda: len(queue.fifo[0]) == len(keys), what="the put never queued its pages")
        call = queue.pending[keys[0]].calls[0][0]
        ctrl_c.press()
        time.sleep(0.5)
        plan.release()  # the read ends: nothing holds the writer back now
        if not returned.wait(HANG_S):
            state["hung"] = True
            state["left"] = call.left
            state["pending"] = sorted(k[:8] for k in queue.pending)
            call.event.set()  # (frees the test's main thread)

    presser = threading.Thread(target=press, daemon=True)
    presser.start()
    with pytest.raises(KeyboardInterrupt), ctrl_c.during(), interrupt_at(func, text, nth) as raised:
        try:
            engine.put(keys, [m.segments for m in memory])
        finally:
            returned.set()
    presser.join(60)
    reader.join(60)
    return state, raised[0]


def test_a_second_ctrl_c_inside_the_withdrawal_does_not_hang_the_put(tier_dirs, ctrl_c):
    """Ctrl-C while a put's three pages wait in the FIFO, and Ctrl-C again (a user presses twice) as the
    withdrawal (Jobs.withdraw_under_writer) ends the second withdrawn page. PutCall.wait takes the
    second interrupt as harmless, and the withdrawal runs on a thread of its own, which no signal reaches
    (the line is never met in the main thread). Before, it ran in the main thread: the FIFO entries the
    first pass removed and had not ended yet were gone, no one ended those pages, and the put waited for
    ever (a later put of those keys joined them and waited for ever too)."""
    pages = PageSet(64 << 10)
    keys = pages.keys(3)
    plan = FaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    try:
        state, raised = _interrupted_put(engine, pages, plan, ctrl_c, keys, Jobs.withdraw_under_writer,
                                         "self.queue.job_over_under_writer(page, k)", nth=2)
        assert raised == 0  # (not in the main thread any more: PutCall.withdraw)
        assert not state["hung"], (
            f"the put ended by Ctrl-C (twice) never returned: {state['left']} pages still counted as left, "
            f"pages {state['pending']} pending for ever")
    finally:
        plan.release()
        engine.close()


def test_a_second_ctrl_c_before_exclusive_s_try_does_not_stop_the_writer(tier_dirs, ctrl_c):
    """Ctrl-C while a put's page waits in the FIFO, and Ctrl-C again handled as WritePath.exclusive has
    counted itself (queue.exclusive += 1) and not yet entered its ``try`` (the call that releases the
    queue lock is where Python handles a pending signal). The count is never taken back: the writer
    waits for ever for exclusive sections to end (WritePath._run), so this put, every later put and
    write, never end. The withdrawal now takes exclusive on a thread no signal reaches (the line is never
    met in the main thread), and exclusive counts itself with no call between (an interrupt in clear()
    or check() lands before or after). Before, the put hung, and a put of another key after it too."""
    pages = PageSet(64 << 10)
    keys = pages.keys(1)
    plan = FaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    try:
        state, raised = _interrupted_put(engine, pages, plan, ctrl_c, keys, WritePath.exclusive, "try:")
        assert raised == 0  # (not in the main thread any more: PutCall.withdraw)
        later = []
        putter = threading.Thread(target=lambda: later.append(pages.put(engine, pages.keys(1, 50))), daemon=True)
        putter.start()
        putter.join(HANG_S)
        assert not state["hung"] and later == [[True]], (
            f"after a second Ctrl-C the interrupted put hung: {state}; a later put of another key "
            f"{'returned ' + repr(later) if later else 'hung too'}; queue.exclusive = {engine._writes.queue.exclusive}")
    finally:
        plan.release()
        engine._writes.queue.exclusive = 0  # (let close() end)
        with engine._writes.queue.lock:
            engine._writes.queue.wake_under_queues()
        engine.close()


@pytest.mark.parametrize("where", ["queued", "in_flight"])
@pytest.mark.parametrize("joiner", ["put", "put_deferred"])
def test_a_put_that_joined_the_page_of_a_put_ended_by_ctrl_c_still_stores_it(tier_dirs, ctrl_c, joiner, where):
    """A put's page waits in the FIFO (a held read) or is being written (its write held); a put of the key
    from another thread joins it (the SGLang path, or a put_deferred: LMCache's); Ctrl-C ends the first
    put, whose caller reuses its memory. The joined put never let go of its own: the page is written from
    it, the joined put answers True and the key reads back with its bytes, never the reused ones (before:
    the withdrawal cancelled the page, and the joined put got False, its page lost)."""
    pages = PageSet(64 << 10)
    k = pages.keys(1)[0]
    plan = FaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    queue, jobs = engine._writes.queue, engine._writes.jobs
    first, theirs = _holding(pages, k), _holding(pages, k)
    joined: list = []
    try:
        if where == "queued":
            assert pages.put(engine, pages.keys(1, 100)) == [True]
            reader = held_read(engine, pages, plan, pages.keys(1, 100)[0])
        else:
            plan.add(Fault.hold(), opcode=OP_WRITE, times=1)

        def press():
            wait_until(lambda: k in queue.pending and (queue.fifo[0] if where == "queued" else jobs.active[0]),
                       what="the put never queued its page")
            page = queue.pending[k]
            if joiner == "put":
                threading.Thread(target=lambda: joined.append(engine.put([k], [theirs.segments])), daemon=True).start()
            else:
                engine.put_deferred([k], [theirs.segments], joined.append)
            wait_until(lambda: len(page.calls) == 2, what="the put never joined")
            ctrl_c.press()
            # (released once the withdrawal is done: its page out of the FIFO, or its job cancelled)
            wait_until(lambda: queue.pending.get(k) is not page or any(job.err for job in jobs.active[0]),
                       what="the interrupted put was never withdrawn")
            plan.release()

        presser = threading.Thread(target=press, daemon=True)
        presser.start()
        with pytest.raises(KeyboardInterrupt), ctrl_c.during():
            engine.put([k], [first.segments])
        first.array[:] = 0x5A  # the call raised: the caller's host page holds other KV now
        presser.join(60)
        if where == "queued":
            reader.join(60)
        wait_until(lambda: joined, HANG_S, "the joined put never ended")
        assert joined == [[True]], "a put whose memory was never let go lost its page to another put's Ctrl-C"
        _stored_whole(engine, pages, k)
    finally:
        plan.release()
        engine.close()


def test_a_put_that_took_over_a_let_go_of_page_and_is_ended_by_ctrl_c_hands_it_on(tier_dirs, ctrl_c):
    """A gated put_deferred's page (LMCache's) is being written (held); a put (this thread) and then a
    put_deferred without a gate join it. The gate shuts: the put writes the page from its own memory (its
    write held in turn), and Ctrl-C ends that put, whose caller reuses its memory. The page goes on to the
    put_deferred, written from its memory: True, read back with its bytes, never the reused ones (the put
    owned the copy it took over: withdrawn with it, nothing of its memory read after it raised)."""
    pages = PageSet(64 << 10)
    k = pages.keys(1)[0]
    plan = FaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    queue, jobs = engine._writes.queue, engine._writes.jobs
    gated_memory, mine, theirs = (_holding(pages, k) for _ in range(3))
    gate, gated, deferred, returned = CallerGate("source"), [], [], threading.Event()
    try:
        plan.add(Fault.hold(), opcode=OP_WRITE, times=2)  # the gated put's write, then the put's own
        engine.put_deferred([k], [gated_memory.segments], gated.append, gate)
        wait_until(lambda: plan.hits, what="the gated put's write never reached the ring")
        first = queue.pending[k]

        def press():
            try:
                wait_until(lambda: len(first.calls) == 2, what="the put never joined")
                engine.put_deferred([k], [theirs.segments], deferred.append)
                gate.close(60)
                plan.release()
                wait_until(lambda: len(plan.hits) == 2 or returned.is_set(), what="the put never wrote the page")
                if not returned.is_set():
                    ctrl_c.press()
                    # (released once the withdrawal cancelled its job)
                    wait_until(lambda: any(job.err for job in jobs.active[0]) or returned.is_set(),
                               what="the interrupted put was never withdrawn")
            finally:
                plan.release()

        presser = threading.Thread(target=press, daemon=True)
        presser.start()
        try:
            with pytest.raises(KeyboardInterrupt), ctrl_c.during():
                engine.put([k], [mine.segments])
        finally:
            returned.set()
        mine.array[:] = 0x5A  # the call raised: the caller's host page holds other KV now
        presser.join(60)
        wait_until(lambda: gated and deferred, HANG_S, "the deferred puts never ended")
        assert gated == [[False]] and deferred == [[True]], "the page was not handed on to the put_deferred"
        _stored_whole(engine, pages, k)
        assert engine.stats()["pages_stored"] == 1
    finally:
        plan.release()
        engine.close()


def _unhang_main_put(returned: threading.Event, state: dict) -> None:
    """Watchdog: a put in the main thread still not returned HANG_S s on (its withdrawal waiting for its
    event): recorded, and that event set so that the test ends."""
    if returned.wait(HANG_S):
        return
    state["hung"] = True
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        call = frame.f_locals.get("self")
        if isinstance(call, PutCall):
            state["left"] = call.left
            call.event.set()
            return
        frame = frame.f_back


@pytest.mark.parametrize("line", ["call.joined.append(writing)", "call.sources[i] = segments"])
def test_a_put_ended_by_ctrl_c_inside_its_join_returns_and_the_page_goes_to_the_next_put(tier_dirs, line):
    """A gated put_deferred's page (LMCache's) is being written (held); a put of the key from this thread
    is ended by Ctrl-C inside its join of that page (WriteQueue._enqueue_under_queues, at ``line``), and
    its caller reuses its memory; a put_deferred of the key joins after it. The gate shuts, the write
    ends. The interrupted put returns (raises) at once, and the page goes to the put_deferred, written from
    its memory: True, read back with its bytes, backlog 0. Found in the review of 455a878: cut after it
    entered the page's calls and before the put's own list of joined pages, the put was made the heir
    and its memory (never recorded) looked up: KeyError in the writer, the put_deferred never answered,
    the backlog stuck; cut one line later, its count one off, the interrupted put waited for ever."""
    pages = PageSet(64 << 10)
    k = pages.keys(1)[0]
    plan = FaultPlan()
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    gated_memory, mine, theirs = (_holding(pages, k) for _ in range(3))
    gate, gated, deferred, returned, state = CallerGate("source"), [], [], threading.Event(), {"hung": False}
    try:
        plan.add(Fault.hold(), opcode=OP_WRITE, times=1)
        engine.put_deferred([k], [gated_memory.segments], gated.append, gate)
        wait_until(lambda: plan.hits, what="the gated put's write never reached the ring")
        threading.Thread(target=_unhang_main_put, args=(returned, state), daemon=True).start()
        try:
            with pytest.raises(KeyboardInterrupt), interrupt_at(WriteQueue._enqueue_under_queues, line):
                engine.put([k], [mine.segments])
        finally:
            returned.set()
        assert not state["hung"], f"the put ended by Ctrl-C inside its join never returned: left {state.get('left')}"
        mine.array[:] = 0x5A  # the call raised: the caller's host page holds other KV now
        engine.put_deferred([k], [theirs.segments], deferred.append)
        assert gate.close(60)
        plan.release()
        wait_until(lambda: gated and deferred, HANG_S, "the deferred puts never ended")
        assert gated == [[False]] and deferred == [[True]], "the page was not handed to the put_deferred"
        _stored_whole(engine, pages, k)
    finally:
        plan.release()
        engine.close()


def test_a_put_ended_by_ctrl_c_after_clear_waits_for_its_own_write_not_the_cancelled_page_it_joined(tier_dirs, ctrl_c):
    """A put_deferred's page is being written (the end of its write delayed); a put (this thread) of its key
    and a new one joins it and writes the new one (its write held). clear() cancels both pages (out of the
    pages being written: a put after the clear writes its own, writequeue.py), then Ctrl-C ends the put.
    Its withdrawal takes it out of the cancelled page it joined too: that page's end answers the
    put_deferred (False) and does not end the put, whose own write still reads its memory (held); released,
    the put raises, and nothing is left (backlog 0, no page, check() clean). Taken out of the pages being
    written only, the put stayed among that page's callers and its end ended the put's wait early."""
    pages = PageSet(64 << 10)
    j, n = pages.keys(2)
    plan = FaultPlan()
    plan.add(Fault.delay(5.0), opcode=OP_WRITE, times=1)  # the put_deferred's page: ends on its own
    plan.add(Fault.hold(), opcode=OP_WRITE, times=1)  # the put's own page: till released
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    queue = engine._writes.queue
    theirs, mine = _holding(pages, j), [_holding(pages, j), _holding(pages, n)]
    deferred, state = [], {}
    try:
        engine.put_deferred([j], [theirs.segments], deferred.append)
        wait_until(lambda: plan.hits, what="the put_deferred's write never reached the ring")
        joined = queue.pending[j]

        def press():
            try:
                wait_until(lambda: len(plan.hits) == 2 and len(joined.calls) == 2, what="the put never joined")
                call = joined.calls[1][0]
                engine.clear()
                ctrl_c.press()
                wait_until(lambda: not call.joined, what="the interrupted put was never withdrawn")
                state["withdrawn before the page ended"] = not deferred
                wait_until(lambda: deferred, what="the cancelled page never ended")
                with engine._writes.lock:  # (the writer is past that page's end)
                    state["ended early"] = call.event.is_set()
            finally:
                plan.release()

        presser = threading.Thread(target=press, daemon=True)
        presser.start()
        with pytest.raises(KeyboardInterrupt), ctrl_c.during():
            engine.put([j, n], [m.segments for m in mine])
        presser.join(60)
        assert state == {"withdrawn before the page ended": True, "ended early": False}, state
        assert deferred == [[False]]
        wait_until(lambda: not queue.pending and not queue.cancelled, HANG_S, "a page never ended")
        assert engine.stats()["write_backlog_bytes"] == 0 and not engine.held(j) and not engine.held(n)
        assert engine.check() == []
    finally:
        plan.release()
        engine.close()


_ENQUEUE_LINES = [(func, n, f"{func.__name__.split('_')[1]}+{n - func.__code__.co_firstlineno}:{text[:40]}")
                  for func in (WriteQueue._enqueue_under_queues, WriteQueue._admit_under_queues)
                  for n, text in _code_lines(func)]


@pytest.mark.parametrize("nth", [1, 2])
@pytest.mark.parametrize("func, line", [(func, n) for func, n, _ in _ENQUEUE_LINES],
                         ids=[name for _, _, name in _ENQUEUE_LINES])
def test_a_put_ended_by_ctrl_c_anywhere_in_its_enqueue_leaves_nothing_behind(tier_dirs, func, line, nth):
    """A put of a batch (a key two tiers hold already, a key a put_deferred is writing, two new keys, one of
    them twice, an invalid key) is ended by Ctrl-C at any line of WriteQueue._enqueue_under_queues or of
    its admission (the ``nth`` time the line is reached: the second page, the second tier), its writes
    held back by a read; its caller then reuses its memory. The put raises at once; once the read ends, no page of it is left
    being written, the backlog and the bytes queued per tier are back to 0, the put_deferred stores its
    page, and a put of the same keys from fresh memory stores every one of them (read back with their
    bytes, never the reused ones; check() finds nothing). Found in review (enqint): cut inside the loop
    that queues the put's own pages, a page was left in ``pending`` in no FIFO (or in one, uncounted):
    it never ended, its bytes stayed in the backlog (put_deferred's back-pressure), and a later put of
    the key joined it and waited for ever; cut in admission or before that loop's end, the bytes admitted
    for the pages not queued yet stayed in the tiers' ``queued`` (replicate=budget's pending bytes), for
    ever."""
    pages = PageSet(64 << 10)
    reading, held, joined, new1, new2 = pages.keys(5)
    keys = [held, joined, new1, "bad/key", new2, new1]
    plan = FaultPlan()
    engine = make_engine(tier_dirs[:2], fault_plan=plan)
    queue = engine._writes.queue
    memory = {k: _holding(pages, k) for k in (joined, new1, new2)}
    memory[held] = memory["bad/key"] = _Memory(pages.size, True)
    theirs = _holding(pages, joined)
    deferred, returned, state, later = [], threading.Event(), {"hung": False}, []
    try:
        assert pages.put(engine, [reading, held]) == [True, True]
        reader = held_read(engine, pages, plan, reading)  # tier 0's writes wait for it
        engine.put_deferred([joined], [theirs.segments], deferred.append)
        threading.Thread(target=_unhang_main_put, args=(returned, state), daemon=True).start()
        try:
            with interrupt_at(func, line, nth) as raised:
                try:
                    result = engine.put(keys, [memory[k].segments for k in keys])
                except KeyboardInterrupt:
                    result = None
        finally:
            returned.set()
        assert not state["hung"], f"the put ended by Ctrl-C never returned: left {state.get('left')}"
        assert (result is None) == bool(raised[0]), result  # (not reached the nth time: the put was whole)
        for m in memory.values():
            m.array[:] = 0x5A  # the call raised: the caller's host pages hold other KV now
        plan.release()
        reader.join(60)
        try:
            wait_until(lambda: not queue.pending and deferred, HANG_S)
        except AssertionError:
            pass
        left = {"pending": sorted(k[:6] for k in queue.pending), "backlog": queue.backlog, "queued": list(queue.queued)}
        putter = threading.Thread(target=lambda: later.append(pages.put(engine, keys[:3] + keys[4:])), daemon=True)
        putter.start()
        putter.join(HANG_S)
        assert left == {"pending": [], "backlog": 0, "queued": [0, 0]} and later == [[True] * 5], (
            f"after a put ended by Ctrl-C there: {left} (pages still being written, bytes held), and a later put "
            f"of its keys {'returned ' + repr(later) if later else 'waited for ever'}")
        assert deferred == [[True]]
        found, got = pages.get(engine, keys[:3] + keys[4:])
        assert found == [True] * 5 and all(g == pages.data(k) for g, k in zip(got, keys[:3] + keys[4:])), (
            "a page was stored from the memory the caller reused after put raised")
        assert engine.stats()["write_backlog_bytes"] == 0 and engine.check() == []
    finally:
        plan.release()
        engine.close()


_CLEAR_LINES = [(func, n, f"{func.__name__}+{n - func.__code__.co_firstlineno}:{text[:40]}")
                for func in (WritePath.cancel_under_writer, WriteQueue.drop_all)
                for n, text in _code_lines(func)]


@pytest.mark.parametrize("func, line", [(func, None) for func in (None,)] +
                         [(func, n) for func, n, _ in _CLEAR_LINES],
                         ids=["pressed_while_clear_waits_for_the_writer"] + [name for _, _, name in _CLEAR_LINES])
def test_a_clear_ended_by_ctrl_c_leaves_no_page_counted_and_no_put_unanswered(tier_dirs, ctrl_c, func, line):
    """clear() with one page's write in flight (held) and another page queued (the writer held by an exclusive
    section), ended by Ctrl-C: handled at any line of its cancelling of the writes (WritePath.cancel_under_writer,
    WriteQueue.drop_all), or pressed while it waits for the writer. Once the held write is released, both
    put_deferreds are answered, no page is being written or cancelled, the backlog and the bytes queued are
    back to 0, and a put of both keys stores them (check() clean); a Ctrl-C pressed while clear() waits is
    raised once the clear is whole (both puts answered False, nothing indexed). Found in review (clearrev):
    cut after WriteQueue.drop_all, the queued page, dropped from its FIFO, was never ended: it stayed in
    ``WriteQueue.cancelled`` for good, its bytes in the backlog (a put_deferred's back-pressure) and per tier,
    its put_deferred never answered (LMCache's store never completed); cut before the jobs were marked, the
    write in flight was committed after clear() raised."""
    pages = PageSet(64 << 10)
    a, b = pages.keys(2)
    plan = FaultPlan()
    plan.add(Fault.hold(), opcode=OP_WRITE, times=1)  # a's write: in flight at the clear
    engine = make_engine(tier_dirs[:1], fault_plan=plan)
    queue = engine._writes.queue
    mine = {k: _holding(pages, k) for k in (a, b)}
    done: dict[str, list] = {a: [], b: []}
    inside, leave = threading.Event(), threading.Event()

    def hold_writer():
        with engine._writes.exclusive():
            inside.set()
            leave.wait(60)

    def let_writer_go():
        wait_until(lambda: queue.exclusive == 2, what="clear() never waited for the writer")
        if func is None:
            ctrl_c.press()
            time.sleep(0.2)
        leave.set()

    try:
        engine.put_deferred([a], [mine[a].segments], done[a].append)
        wait_until(lambda: plan.hits, what="a's write never reached the ring")
        holder = threading.Thread(target=hold_writer, daemon=True)
        holder.start()
        inside.wait(60)
        engine.put_deferred([b], [mine[b].segments], done[b].append)  # queued: the writer is held
        assert [page.key for page in queue.fifo[0]] == [b]
        threading.Thread(target=let_writer_go, daemon=True).start()
        interrupted = False
        with ctrl_c.during(), interrupt_at(func or WritePath.cancel_under_writer, line or 0):
            try:
                engine.clear()
            except KeyboardInterrupt:
                interrupted = True
        holder.join(60)
        if func is None:  # (b's answer may come a moment after clear() returns: the writer's callback)
            assert interrupted and not engine.held(b), (interrupted, done)
            wait_until(lambda: done[b], HANG_S, "the queued put was never answered")
            assert done[b] == [[False]], done
        plan.release()
        try:
            wait_until(lambda: done[a] and done[b] and not queue.pending and not queue.cancelled, HANG_S)
        except AssertionError:
            pass
        left = {"done": {k[:6]: v for k, v in done.items()}, "pending": sorted(k[:6] for k in queue.pending),
                "cancelled": sorted(p.key[:6] for p in queue.cancelled), "backlog": queue.backlog,
                "queued": list(queue.queued)}
        assert all(left["done"].values()) and left["pending"] == left["cancelled"] == [] and \
            left["backlog"] == 0 and left["queued"] == [0], (
                f"after a clear() ended by Ctrl-C: {left} (a put never answered, its page counted for ever)")
        if func is None:
            assert done[a] == [[False]] and engine.index.keys(0) == []
        assert pages.put(engine, [a, b]) == [True, True]
        assert engine.stats()["write_backlog_bytes"] == 0 and engine.check() == []
    finally:
        leave.set()
        plan.release()
        engine.close()
