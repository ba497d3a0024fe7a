"""The in-flight core under both paths: one ring's requests between submit and completion.

Each path (reads.py, writes.py) owns one ``InFlight``: its ring, each tier's ``TierFlow`` (window,
request size, rate: flow.py), the busy clock, the bytes in flight per tier and the tag of every
request on the ring. A path builds its requests (any object with ``tier`` and ``nbytes``; the core
sets ``t0``, ``ahead`` and ``orphan`` on it), ``add``s them, then ``submit``s the batch: if the ring
refuses it (it validates a whole batch before queueing any of it), every request of the batch is
undone here and the error re-raised, so no request waits for a completion that never comes; the path
undoes its own part (descriptors, buffers) in its ``except``. ``reap`` hands back ``(request, res)``
with the accounting already done; the path decides what the completion tells the tier's flow
(``measure``) and what it means for its pages.

A failed ring (reads and writes): a ``reap`` that raised OSError marks it ``failed`` (the kernel
refused io_uring_enter: a passing shortage, EAGAIN/EBUSY, or its descriptor closed under it); the
path then calls ``replace``, which closes it (what the kernel took is cancelled and waited for; what
it never took never runs), gives up every request and goes on with a new ring from ``reopen``, so
one bad moment does not end the path's I/O for the life of the engine.

Orphans (reads only): a request whose call returned while it was in flight stays here, with its
buffers and descriptor, until reaped; its bytes count against its tier's window for later calls.

Not thread-safe: each path calls it under its own lock (reads: ``ReadPath.lock``, writes: the
writer's ``WritePath.lock``).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from .flow import STEAL_QUIET, TierFlow
from .stats import BusyClock

log = logging.getLogger("kvstream")


class InFlight:
    """Requests in flight on ``ring``, per tier of ``n_tiers``.

    :param unit: the flows' request unit, bytes (the routing block for reads, WRITE_UNIT for writes).
    :param ceiling: most bytes one tier may keep in flight (its window's ceiling).
    :param reopen: opens a ring like ``ring`` (``replace``); ``name``: the path's, for the log.
    """

    def __init__(self, ring, n_tiers: int, unit: int, ceiling: int, reopen: Callable[[], object], name: str):
        self.ring = ring
        self.reopen = reopen
        self.name = name
        self.failed: OSError | None = None  # what the last reap raised, until ``replace``
        self.flows = [TierFlow(unit, ceiling) for _ in range(n_tiers)]
        self.busy = BusyClock(n_tiers)
        self.bytes = [0] * n_tiers  # bytes in flight per tier (orphans included)
        self.orphaned = [0] * n_tiers  # of which orphans'
        self.orphans = 0  # orphan requests in flight
        self._reqs: dict = {}  # tag -> request, for every request on the ring
        self._tags = itertools.count(1)
        self._batch: list = []  # (tag, request, op) added and not yet submitted

    def __len__(self) -> int:
        return len(self._reqs)

    def requests(self):
        return self._reqs.values()

    def add(self, req, opcode: int, fd: int, buf, offset: int, now: float) -> None:
        """Account ``req`` as in flight on its tier from ``now`` (the next ``submit`` sends it)."""
        k = req.tier
        tag = next(self._tags)
        self.flows[k].submitted(now, self.bytes[k])
        req.t0, req.ahead, req.orphan = now, self.bytes[k], False  # ahead: bytes in flight before it
        self.bytes[k] += req.nbytes
        self.busy.started(k)
        self._reqs[tag] = req
        self._batch.append((opcode, fd, buf, offset, tag))

    def submit(self) -> None:
        """Send what was added since the last submit. :raises: the ring's error, with none of the
        batch left in flight."""
        if not self._batch:
            return
        try:
            self.ring.submit(self._batch)
        except BaseException:
            self.unsent()
            raise
        self._batch = []

    def unsent(self) -> list:
        """Give up what was added since the last submit (an error came between): returned, out of the
        accounting (none of it is on the ring)."""
        batch, self._batch = self._batch, []
        reqs = [self._reqs.pop(tag) for *_, tag in batch]
        for req in reqs:
            self._forget(req)
        return reqs

    def reap(self, min_complete: int, timeout: float | None) -> list[tuple[object, int]]:
        """Completions, ``(request, res)``, each out of the accounting (res: bytes, or -errno)."""
        done = []
        try:
            reaped = self.ring.reap(min_complete, timeout)
        except OSError as exc:
            self.failed = exc
            raise
        for tag, res in reaped:
            req = self._reqs.pop(tag, None)
            if req is not None:  # (None: abandon() already gave it up)
                self._forget(req)
                done.append((req, res))
        return done

    def _forget(self, req) -> None:
        k = req.tier
        self.bytes[k] -= req.nbytes
        self.busy.finished(k)
        if req.orphan:
            self.orphans -= 1
            self.orphaned[k] -= req.nbytes

    def measure(self, req, res: int, now: float, undisturbed: bool) -> None:
        """Feed a completion to its tier's flow: ``undisturbed``, its bytes and latency measure the
        device; otherwise (a write that a read overlapped, an orphan reaped long after) it shows only
        that the tier progressed, and the busy time up to now is not the device's."""
        k = req.tier
        flow, busy = self.flows[k], self.busy.total(k)
        flow.completed(max(res, 0) if undisturbed else 0, now - req.t0, req.ahead, now, busy)
        if not undisturbed:
            flow.disturbed(busy)

    def orphan(self, reqs) -> None:
        """``reqs`` (in flight) belong to a call that returned: orphans until reaped."""
        for req in reqs:
            if not req.orphan:
                req.orphan = True
                self.orphans += 1
                self.orphaned[req.tier] += req.nbytes

    def overdue_wait(self, now: float) -> float | None:
        """Seconds until a tier with requests in flight turns overdue, or quiet for long enough that an idle
        tier may re-read its items (``quiet_for``) (None: none will: they have none, or are so already)."""
        # Only a tier with nothing of a call in flight steals without a completion of its own to wake it; one
        # with orphans alone is idle too (an orphan may never complete). Each at its own latency: the lowest is
        # past soon, and its tier may hold none of the items in flight.
        idle = {f.latency for k, f in enumerate(self.flows) if self.bytes[k] == self.orphaned[k] and f.latency}
        dues = [due for k, f in enumerate(self.flows) if self.bytes[k] and (due := f.overdue_at()) > now]
        dues += [due for k, f in enumerate(self.flows) if self.bytes[k] > self.orphaned[k]
                 for latency in idle if (due := f.quiet_at(STEAL_QUIET * latency)) > now]
        return min(dues) - now + 1e-3 if dues else None

    def overdue(self, k: int) -> bool:
        return self.flows[k].overdue(time.monotonic(), self.bytes[k])

    def quiet_for(self, owner: int, tier: int) -> bool:
        """Whether ``owner`` has reads in flight and has completed nothing for STEAL_QUIET of ``tier``'s
        request latencies: reads there wait on something slower than ``tier`` (a slow device not measured
        yet, a throttle's stall), so that ``tier`` re-reading them lands first."""
        latency = self.flows[tier].latency
        return bool(self.bytes[owner] and latency and
                    time.monotonic() > self.flows[owner].quiet_at(STEAL_QUIET * latency))

    def abandon(self) -> list:
        """Give up every request (after the ring was closed or drained, or an error lost their
        completions): returns them, the accounting reset."""
        reqs = list(self._reqs.values())
        self._reqs.clear()
        self._batch = []
        for k, n in enumerate(self.busy.in_flight):
            if n:
                self.busy.finished(k, n)
        self.bytes = [0] * len(self.bytes)
        self.orphaned = [0] * len(self.bytes)
        self.orphans = 0
        return reqs

    def replace(self) -> list:
        """After a failed ``reap``: close the ring (nothing it took lands after this), give up every
        request (returned, for the path to release) and open a new ring. If none opens, the closed
        ring stays (``ring.closed``: the path's I/O ends there), logged as an error."""
        why, self.failed = self.failed or "an error", None
        self.ring.close()
        reqs = self.abandon()
        try:
            self.ring = self.reopen()
        except OSError as exc:
            log.error("kvstream: the %s ring failed (%s) and no new one opens (%s): %s end here", self.name, why,
                      exc, self.name + "s")
        else:
            log.warning("kvstream: the %s ring failed (%s); %d requests on it are given up, and %ss go on on a new "
                        "ring", self.name, why, len(reqs), self.name)
        return reqs
