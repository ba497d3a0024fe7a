"""A ring-level instrument: when each tier's reads of a batch started and ended, measured outside the engine.

The bound needs each tier's bandwidth during a batch. The engine reports per tier the time with at
least one read in flight (its *busy* time). On a token-bucket throttle (blk-throttle, cloud volume
limits) that time overstates the tier's rate: a short idle gap inside a throttle slice is paid back
by a burst right after, so ``bytes / busy`` exceeds the sustained limit (measured here: 630-680
MB/s on a tier throttled at 580 MB/s, while the batch itself took exactly bytes / 580 MB/s). The
instrument below measures instead each tier's *span*: from its first read submitted to its last
read completed within the batch, which is the time the tier needed to deliver its bytes, or to the
batch's return when reads of the batch were still in flight on the tier then (``returned``). Those
are reads the tier had not delivered yet, e.g. held back by a throttle whose slice allowance the
tier had spent, and which another tier re-read: ending the span at the tier's last completion would
credit it with its burst rate (measured on the disk testbed: a 0.7 GB/s tier read 133 MiB in its
first 0.12 s of a 0.19 s batch, then three 1 MiB reads waited until the batch ended; its span rate
was 1.16 GB/s, and the batch's bound counted that).

It wraps the engine's rings through the documented ``ring_factory`` hook (no engine change), tells
tiers apart by the device of each file descriptor (``fstat().st_dev``; when two tiers share a file
system it cannot, and the runner falls back to the engine's busy time), and costs one ``fstat``
per submitted read.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from ...io import OP_READ, RING_ENTRIES, open_ring


class SpanRecorder:
    """Per tier: first read submitted, last read completed and bytes read since :meth:`reset`."""

    def __init__(self, tier_dirs: Sequence[str], clock: Callable[[], float] = time.perf_counter,
                 tier_of_fd: Callable[[int], int | None] | None = None):
        """:param tier_of_fd: fd -> tier (tests inject one); default: by the fd's device."""
        devs = [os.stat(d).st_dev for d in tier_dirs]
        self.n = len(devs)
        tier_of_dev = {d: k for k, d in enumerate(devs)}
        # Tiers on distinct devices: an fd's device names its tier.
        self.usable = tier_of_fd is not None or len(tier_of_dev) == len(devs)
        self._tier_of_fd = tier_of_fd or (lambda fd: tier_of_dev.get(os.fstat(fd).st_dev))
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], tuple[int, int]] = {}  # (ring id, tag) -> (tier, window)
        self._window = 0
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._window += 1
            self.first: list[float | None] = [None] * self.n
            self.last: list[float | None] = [None] * self.n
            self.bytes = [0] * self.n

    def spans(self) -> tuple[tuple[float | None, ...], tuple[int, ...]]:
        """(seconds from first submission to last completion per tier, bytes per tier) of this window."""
        with self._lock:
            spans = tuple(None if f is None or l is None else l - f for f, l in zip(self.first, self.last))
            return spans, tuple(self.bytes)

    def edges(self, t0: float) -> list[tuple[float, float] | None]:
        """Per tier, (first submission, last completion) in seconds after ``t0`` (same clock), or None."""
        with self._lock:
            return [None if f is None or l is None else (f - t0, l - t0) for f, l in zip(self.first, self.last)]

    def returned(self) -> None:
        """The batch returned: a tier with reads of it still in flight was busy with it until now. Closes
        the window: what completes later (an orphan) no longer moves a span."""
        now = self._clock()
        with self._lock:
            for k, window in self._pending.values():
                if window == self._window and self.first[k] is not None:
                    self.last[k] = now
            self._window += 1

    def submitted(self, ring_id: int, ops: Sequence[tuple]) -> None:
        if not self.usable:
            return
        now = self._clock()
        with self._lock:
            for op in ops:
                if op[0] != OP_READ:
                    continue
                try:
                    k = self._tier_of_fd(op[1])
                except OSError:
                    continue
                if k is None:
                    continue
                self._pending[(ring_id, op[4])] = (k, self._window)
                if self.first[k] is None:
                    self.first[k] = now

    def reaped(self, ring_id: int, results: Sequence[tuple[int, int]]) -> None:
        if not self.usable or not results:
            return
        now = self._clock()
        with self._lock:
            for tag, res in results:
                entry = self._pending.pop((ring_id, tag), None)
                if entry is None or entry[1] != self._window:
                    continue  # not a read, or an orphan of an earlier batch completing late
                k = entry[0]
                self.last[k] = now
                if res > 0:
                    self.bytes[k] += res


class TimedRing:
    """A ring that reports its submissions and completions to a :class:`SpanRecorder`."""

    def __init__(self, inner, recorder: SpanRecorder):
        self.inner = inner
        self._recorder = recorder

    def submit(self, ops) -> int:
        ops = list(ops)
        n = self.inner.submit(ops)  # (recorded once submitted: ops a refused submit never sent do not count)
        self._recorder.submitted(id(self), ops[:n])
        return n

    def reap(self, min_complete: int = 1, timeout: float | None = None):
        out = self.inner.reap(min_complete, timeout)
        self._recorder.reaped(id(self), out)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


def ring_factory(recorder: SpanRecorder) -> Callable:
    """An ``Engine(ring_factory=...)`` that opens the usual ring and wraps it."""

    def factory(entries: int = RING_ENTRIES, engine: str = "auto"):
        return TimedRing(open_ring(entries, engine), recorder)

    return factory


@contextmanager
def instrumented_engines(recorder: SpanRecorder) -> Iterator[None]:
    """Engines constructed inside this block (e.g. by the SGLang adapter) get instrumented rings."""
    from ... import engine as engine_mod

    original = engine_mod.Engine

    class _Instrumented(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("ring_factory", ring_factory(recorder))
            super().__init__(*args, **kwargs)

    engine_mod.Engine = _Instrumented
    try:
        yield
    finally:
        engine_mod.Engine = original
