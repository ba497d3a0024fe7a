"""A put ended by Ctrl-C whose interrupt lands elsewhere than in the wait for its event: inside
WriteQueue.accept (its pages already queued), and a second Ctrl-C while its pages are withdrawn (from
the review of this stop's changes: each left a wrong page stored, or the put or the writer hung).

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

from kvstream_hicache.faults import FaultPlan
from kvstream_hicache.jobs import Jobs
from kvstream_hicache.writequeue import WriteQueue
from kvstream_hicache.writes import WritePath

from helpers import PageSet, _Memory, held_read, make_engine, wait_until

HANG_S = 20  # an interrupted put whose writes are all over (nothing in flight) returns in ms: 20 s is a hang


def _line(func, text: str) -> int:
    lines, first = inspect.getsourcelines(func)
    hits = [first + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (func, text, hits)
    return hits[0]


@contextmanager
def interrupt_at(func, text: str, nth: int = 1):
    """Ctrl-C handled in the main thread as it reaches the line of ``func`` holding ``text`` for the
    ``nth`` time: KeyboardInterrupt raised there. Yields the number of times it was raised (0 or 1)."""
    code = getattr(func, "__wrapped__", func).__code__
    line = _line(func, text)
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
        memory = _Memory(pages.size, True)
        memory.array[:] = np.frombuffer(pages.data(b), dtype=np.uint8)
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
    memory = [_Memory(pages.size, True) for _ in keys]
    for m, k in zip(memory, keys):
        m.array[:] = np.frombuffer(pages.data(k), dtype=np.uint8)
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
