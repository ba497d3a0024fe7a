"""Fault injection: a ring wrapper (``FaultyRing``) and the plans that decide which ops fail and how.

``Engine(config, namespace, fault_plan=plan)`` wraps both of its rings in ``FaultyRing(ring, plan)``;
the tests, the reliability suite and fault drills use it to fail, hold, delay or corrupt chosen ops
on a real engine over real files. Nothing here runs unless a plan is given.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from .io import OP_READ, OP_WRITE, Vector, byte_view
from .locks import ranked_lock

__all__ = ["Fault", "FaultPlan", "TierFaultPlan", "FaultyRing"]


@dataclass(frozen=True)
class Fault:
    """What to do to one op. Build with the class methods."""

    kind: str  # 'error' | 'hold' | 'delay' | 'corrupt'
    errno: int = 0  # kind='error': the op completes with -errno and does no I/O
    seconds: float = 0.0  # kind='delay': completion reported no earlier than this after submit
    bit: int | None = None  # kind='corrupt': bit index into the transferred bytes; None = middle byte, bit 0

    @classmethod
    def error(cls, errno: int) -> "Fault":
        return cls("error", errno=errno)

    @classmethod
    def hold(cls) -> "Fault":
        return cls("hold")

    @classmethod
    def delay(cls, seconds: float) -> "Fault":
        return cls("delay", seconds=seconds)

    @classmethod
    def corrupt(cls, bit: int | None = None) -> "Fault":
        return cls("corrupt", bit=bit)


class FaultPlan:
    """Decides which ops fail and how; also the release switch for held completions.

    Rules match in order; ``None`` fields match anything; ``times`` bounds how many ops a rule hits.
    Subclasses may override ``decide`` (keep ``release``). Thread-safe.
    """

    def __init__(self):
        self._rules: list[list] = []
        self._lock = ranked_lock("faults")
        self.released = threading.Condition(self._lock)
        self.generation = 0  # bumped by release(); holds taken before the bump are let go
        self.hits: list[tuple[Fault, int, int, int, int]] = []  # (fault, opcode, fd, offset, length)

    def add(self, fault: Fault, *, opcode: int | None = None, fd: int | None = None,
            offset: int | None = None, times: int | None = None) -> "FaultPlan":
        with self._lock:
            self._rules.append([fault, opcode, fd, offset, times])
        return self

    def decide(self, opcode: int, fd: int, offset: int, length: int) -> Fault | None:
        with self._lock:
            for rule in self._rules:
                fault, r_op, r_fd, r_off, times = rule
                if times is not None and times <= 0:
                    continue
                if (r_op is None or r_op == opcode) and (r_fd is None or r_fd == fd) and (
                        r_off is None or r_off == offset):
                    if times is not None:
                        rule[4] = times - 1
                    self.hits.append((fault, opcode, fd, offset, length))
                    return fault
        return None

    def release(self) -> None:
        """Let every completion held so far through."""
        with self._lock:
            self.generation += 1
            self.released.notify_all()


class TierFaultPlan(FaultPlan):
    """Faults by tier directory: ``on(dir, fault, opcode=, times=)``. An op's tier is found from the
    path of its file descriptor, so one plan serves every ring of an engine (reads and writes)."""

    def __init__(self):
        super().__init__()
        self._tier_rules: list[list] = []
        self._mutex = ranked_lock("faults")

    def on(self, tier_dir: str, fault: Fault, opcode: int | None = None,
           times: int | None = None) -> "TierFaultPlan":
        with self._mutex:
            self._tier_rules.append([os.path.realpath(tier_dir) + os.sep, fault, opcode, times])
        return self

    def clear(self) -> None:
        with self._mutex:
            self._tier_rules.clear()

    def decide(self, opcode, fd, offset, length):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        with self._mutex:
            for rule in self._tier_rules:
                prefix, fault, r_op, times = rule
                if times is not None and times <= 0:
                    continue
                if path.startswith(prefix) and (r_op is None or r_op == opcode):
                    if times is not None:
                        rule[3] = times - 1
                    self.hits.append((fault, opcode, fd, offset, length))
                    return fault
        return None


_POLL_S = 0.005  # FaultyRing wait slice when held/delayed completions and real I/O are both pending, s
# The read ring's registered memory (memory.py) is the wrapped ring's own: a read into it passes
# through the plan like any other, and the wrapped ring sends it as a fixed read. A wrapped engine
# that registers nothing (the thread pool) has none of these names, wrapped or not.
_REGISTRATION = frozenset({"register_memory", "unregister_memory", "fixed", "covers", "fixed_bytes", "fixed_ops",
                           "readv_fixed"})


class FaultyRing:
    """Wraps an engine and applies ``plan.decide(opcode, fd, offset, length)`` to each op.

    error: no I/O, completes with -errno. hold: the I/O happens, its completion is withheld until
    ``plan.release()``. delay: completion withheld until ``seconds`` after submit. corrupt: after a
    successful read one bit of the data read is flipped; on a write the bit is flipped for the
    duration of the write (so the medium holds corrupt data) and restored on completion.
    """

    def __init__(self, inner, plan: FaultPlan):
        self.inner = inner
        self.plan = plan
        self._ready: deque[tuple[int, int]] = deque()
        self._withheld: list[tuple[int, int, Fault, float, int]] = []  # (tag, res, fault, due, generation)
        self._faults: dict[int, tuple] = {}  # tag -> (fault, buf, due, generation, opcode)
        self._errored: set[int] = set()

    @property
    def in_flight(self) -> int:
        return self.inner.in_flight + len(self._errored) + len(self._withheld)

    def __getattr__(self, name: str):
        if name in _REGISTRATION:
            return getattr(self.inner, name)
        raise AttributeError(f"'FaultyRing' object has no attribute '{name}'")

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def submit(self, ops: Iterable[tuple]) -> int:
        if self.inner.closed:
            raise ValueError("I/O engine is closed")
        passed = []
        errors = []
        for op in ops:
            opcode, fd, buf, offset, tag = op
            length = _length(buf)
            # read before deciding: a release() that comes after the decision lets this hold go (read
            # after it, a release racing the decision would leave the op held for good)
            generation = self.plan.generation
            fault = self.plan.decide(opcode, fd, offset, length)
            if fault is None:
                passed.append(op)
            elif fault.kind == "error":
                errors.append((tag, -fault.errno))
            else:
                if fault.kind == "corrupt" and opcode == OP_WRITE and length:
                    _flip(buf, fault.bit, length)
                self._faults[tag] = (fault, buf, time.monotonic() + fault.seconds, generation, opcode)
                passed.append(op)
        try:
            n = self.inner.submit(passed) if passed else 0
        except BaseException:  # nothing was submitted: undo this batch's write flips and records
            for op in passed:
                if op[4] in self._faults and self._faults[op[4]][0].kind == "corrupt" and op[0] == OP_WRITE:
                    self._finish_corrupt(op[4], 0)
                self._faults.pop(op[4], None)
            raise
        for tag, res in errors:
            self._errored.add(tag)
            self._ready.append((tag, res))
        return n + len(errors)

    def reap(self, min_complete: int = 1, timeout: float | None = None) -> list[tuple[int, int]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        want = min(min_complete, self.in_flight)
        out: list[tuple[int, int]] = []
        while True:
            self._collect(out)
            if len(out) >= want:
                return out
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return out
            if self.inner.in_flight:
                # Real I/O pending: wait on it, but in slices when withheld ones may come due meanwhile.
                slice_s = left if not self._withheld else min(_POLL_S, left if left is not None else _POLL_S)
                self._absorb(self.inner.reap(1, slice_s))
            else:
                # Only withheld completions remain: wait for plan.release() or the earliest delay.
                dues = [due for _, _, f, due, _ in self._withheld if f.kind == "delay"]
                wait = min(dues) - time.monotonic() if dues else None
                if left is not None:
                    wait = left if wait is None else min(wait, left)
                with self.plan.released:
                    if not self._due_now():
                        self.plan.released.wait(None if wait is None else max(wait, 0))

    def close(self) -> None:
        self.inner.close()  # drains: every write-corrupt flip below is safe to undo now
        for tag in [t for t, (f, _, _, _, op) in self._faults.items() if f.kind == "corrupt" and op == OP_WRITE]:
            self._finish_corrupt(tag, 0)
        self._withheld.clear()
        self._ready.clear()
        self._errored.clear()
        self._faults.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _absorb(self, completions) -> None:
        for tag, res in completions:
            entry = self._faults.get(tag)
            if entry is None:
                self._ready.append((tag, res))
            elif entry[0].kind == "corrupt":
                self._finish_corrupt(tag, res)
                self._ready.append((tag, res))
            else:
                fault, _, due, gen, _ = entry
                self._withheld.append((tag, res, fault, due, gen))

    def _is_due(self, fault: Fault, due: float, gen: int, now: float) -> bool:
        return (fault.kind == "hold" and self.plan.generation > gen) or (fault.kind == "delay" and now >= due)

    def _due_now(self) -> bool:
        now = time.monotonic()
        return any(self._is_due(f, due, gen, now) for _, _, f, due, gen in self._withheld)

    def _collect(self, out: list) -> None:
        if self.inner.in_flight:
            self._absorb(self.inner.reap(0, 0))
        now = time.monotonic()
        keep = []
        for item in self._withheld:
            tag, res, fault, due, gen = item
            if self._is_due(fault, due, gen, now):
                self._faults.pop(tag, None)
                self._ready.append((tag, res))
            else:
                keep.append(item)
        self._withheld = keep
        while self._ready:
            tag, res = self._ready.popleft()
            self._errored.discard(tag)
            out.append((tag, res))

    def _finish_corrupt(self, tag: int, res: int) -> None:
        """A read's data gets its bit flipped (if any arrived); a write's buffer gets restored."""
        fault, buf, _, _, opcode = self._faults.pop(tag)
        if opcode == OP_WRITE:
            _flip(buf, fault.bit, _length(buf))
        elif res > 0:
            _flip(buf, fault.bit, res)


def _length(buf) -> int:
    if isinstance(buf, tuple):
        return buf[1]
    if isinstance(buf, list):  # a vectored op's ranges
        return sum(n for _, n in buf)
    with memoryview(buf) as view:
        return view.nbytes


def _flip(buf, bit: int | None, length: int) -> None:
    view = byte_view(buf, OP_READ)
    try:
        index = (length // 2) * 8 if bit is None else bit % (length * 8)
        target, at = view.byte_at(index // 8) if isinstance(view, Vector) else (view, index // 8)
        target[at] ^= 1 << (index % 8)
    finally:
        view.release()
