"""BoundedCalls (bounded.py): a tier's file-system calls on a thread of its own, each waited for at
most a deadline. A hung call is a threading.Event the test holds; no timing assertions."""
from __future__ import annotations

import errno
import threading

import pytest

from kvstream_hicache.bounded import BoundedCalls

from helpers import wait_until


def test_a_call_returns_its_result_or_raises_its_error():
    calls = BoundedCalls("tier 1", 30.0)
    try:
        assert calls.run(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(FileNotFoundError):
            calls.run(open, "/nonexistent/kvstream-bounded")
        assert calls.run(threading.current_thread) is not threading.current_thread()  # (its own thread)
    finally:
        calls.close()


def test_a_hung_call_times_out_later_ones_fail_at_once_and_what_it_made_is_undone():
    calls = BoundedCalls("tier 1", 0.2)
    gate, undone, ran = threading.Event(), [], []
    try:
        with pytest.raises(OSError) as exc:
            calls.run(lambda: gate.wait() and "made", late=undone.append)
        assert exc.value.errno == errno.ETIMEDOUT and "tier 1" in str(exc.value)
        wait_until(calls.hung, what="the call out past its deadline never counted as hung")
        with pytest.raises(OSError) as exc:
            calls.run(ran.append, 1)  # (not queued behind the hung call: it never runs)
        assert exc.value.errno == errno.ETIMEDOUT and "has not returned" in str(exc.value)
        posted = []
        calls.post(posted.append, "clean-up")  # (runs when the tier answers; the caller does not wait)
        assert posted == []
        gate.set()
        wait_until(lambda: undone == ["made"] and posted == ["clean-up"], what="the late result was never undone")
        assert ran == [] and not calls.hung() and calls.run(lambda: "again") == "again"
    finally:
        gate.set()
        calls.close()


def test_a_call_made_by_a_call_runs_in_place_and_no_deadline_means_no_thread():
    calls = BoundedCalls("tier 1", 30.0)
    try:
        assert calls.run(lambda: calls.run(threading.current_thread)) is calls.run(threading.current_thread)
    finally:
        calls.close()
    local = BoundedCalls("tier 0", 0.0)  # (a local file system: called in place)
    assert local.run(threading.current_thread) is threading.current_thread()
    assert calls.run(threading.current_thread) is threading.current_thread()  # (closed: in place too)
