"""One batch read through a routing policy, as a discrete-event simulation (the tiers are modelled,
the router is the engine's own: ``kvstream_hicache.router``).

The router tests, kvsim's serving simulator and its validation against bench runs all read a batch
through :func:`simulate`; only the tier model here is invented, every claim comes from the router.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np

from ...router import Claim, Policy, all_tiers

__all__ = ["Speed", "SimResult", "simulate"]

Speed = Union[float, Callable[[float], float]]


@dataclass
class SimResult:
    """Outcome of ``simulate``. Times in seconds, volumes in bytes."""

    finish: float  # time the last item was resolved (inf when the batch could not finish)
    done: bool
    found: list[bool]
    reads: list[int]  # items delivered first by each tier (the achieved split)
    source: list[int]  # per item: the tier that delivered it first (-1: missing)
    issued: list[int]  # reads issued per tier, duplicates and failures included
    bytes_read: list[float]  # bytes each tier transferred up to ``finish``
    duplicates: int  # reads of items another tier delivered first (completed or still in flight)
    retries: int  # items handed to another replica after a failed read
    claims: list[Claim]
    bound: float | None  # D / sum(b_k) for constant speeds (Eq. 3), else None

    @property
    def share(self) -> list[float]:
        total = sum(self.reads)
        return [r / total if total else 0.0 for r in self.reads]

    @property
    def gap(self) -> float | None:
        """finish / bound - 1 (constant speeds only)."""
        return None if self.bound in (None, 0) else self.finish / self.bound - 1.0


def simulate(
    policy: Policy,
    n_items: int,
    speeds: Sequence[Speed],
    holders: Sequence[int] | None = None,
    item_bytes: float | Sequence[float] = 1,
    latency: float | Sequence[float] = 0,
    *,
    fail: Callable[[int, int], bool] | None = None,
    max_dt: float | None = None,
    until: float = math.inf,
    max_events: int | None = None,
) -> SimResult:
    """Discrete-event simulation of one batch read through ``policy``.

    Tier model: **processor sharing**. A tier's bandwidth ``speeds[k]`` (bytes/s, a constant or a
    callable of time) is shared equally by the reads it has in flight, after a fixed per-request
    ``latency`` (s, time to first byte, which uses no bandwidth). This matches an NVMe SSD or a
    striped PFS at queue depth: internal parallelism serves the outstanding requests together and a
    request's latency grows with the queue (Little's law); FIFO would give the same throughput but
    lets a duplicate read never slow the tier's own reads, which flatters stealing.

    ``fail(tier, item) -> True`` makes that read complete with ``ok=False``. Callable speeds are
    re-sampled at every event and at least every ``max_dt`` (default: one item time at the fastest
    initial speed), i.e. treated as piecewise constant. Stops when the batch is resolved, at
    ``until``, or when no tier can progress (every read stalled, and no idle tier may take one over):
    then ``done`` is False and ``finish`` is inf.

    An idle tier takes over items in flight on another tier (the route's ``refill``) only when it is
    at least as fast at the time (the engine's ``may_steal`` rule, reads.py, with exact rates).
    """
    n_tiers = len(speeds)
    if holders is None:
        holders = all_tiers(n_items, n_tiers)
    if len(holders) != n_items:
        raise ValueError(f"holders has {len(holders)} entries for {n_items} items")
    sizes = [float(item_bytes)] * n_items if np.isscalar(item_bytes) else [float(s) for s in item_bytes]
    lat = [float(latency)] * n_tiers if np.isscalar(latency) else [float(x) for x in latency]
    varying = any(callable(s) for s in speeds)
    rate_of = [s if callable(s) else (lambda t, v=float(s): v) for s in speeds]
    if varying and max_dt is None:
        fastest = max((f(0.0) for f in rate_of), default=0.0)
        mean = sum(sizes) / n_items if n_items else 1.0
        max_dt = mean / fastest if fastest > 0 else 1e-3
    if max_events is None:
        max_events = 1_000_000 + 100 * n_items * n_tiers
    tol = 1e-9 * max(sizes, default=1.0)

    route = policy.start(n_tiers, holders)
    active: list[dict[int, float]] = [{} for _ in range(n_tiers)]  # item -> bytes left
    pending: list[tuple[float, int, int, int]] = []  # (ready time, seq, tier, item) in latency
    issued = [0] * n_tiers
    bytes_read = [0.0] * n_tiers
    counter = 0

    def issue(claims: list[Claim], now: float) -> None:
        nonlocal counter
        for claim in claims:
            for item in claim.items:
                issued[claim.tier] += 1
                if lat[claim.tier] > 0:
                    heapq.heappush(pending, (now + lat[claim.tier], counter, claim.tier, item))
                    counter += 1
                else:
                    active[claim.tier][item] = sizes[item]

    t = 0.0
    rates = [max(0.0, f(t)) for f in rate_of]
    # The engine's rule (reads.py, _may_steal_under_reads) with exact rates: a tier with nothing unread
    # re-reads items in flight on another only when it is at least as fast, or the other is overdue. A
    # stalled tier shows as rate 0 at once here, so the rate test covers "overdue" too (the engine needs a
    # timer only because its measure lags; its measured rates must show twice the speed, or the owner fall
    # quiet: flow.outpaces). The engine sets the rule where it sizes depths itself (a policy without a
    # depth, kvsim's default); here it holds for a fixed depth too: the refills below come at once, not
    # after a reap, and without it an idle tier would start a healthy batch with duplicates.
    route.may_steal = lambda tier, owner: rates[tier] >= rates[owner]
    issue(route.start(), t)
    events = 0
    while not route.done and events < max_events:
        events += 1
        rates = [max(0.0, f(t)) for f in rate_of]
        # A tier with nothing in flight gets no completion to claim on: ask the route, as the engine
        # does after every reap (reads.py, _run_under_reads), so that a healthy tier takes over the
        # items a stalled one claimed (start() never steals). Before dt: a claim made here is what
        # lets the batch go on where every read in flight is stalled.
        busy = {k for k in range(n_tiers) if active[k]} | {p[2] for p in pending}
        if len(busy) < n_tiers:
            issue(route.refill(), t)
        dt = math.inf
        for k in range(n_tiers):
            if active[k] and rates[k] > 0:
                dt = min(dt, min(active[k].values()) * len(active[k]) / rates[k])
        if pending:
            dt = min(dt, pending[0][0] - t)
        if varying:
            dt = min(dt, max_dt)
        if dt == math.inf or t + dt > until:
            break
        dt = max(dt, 0.0)
        for k in range(n_tiers):
            if active[k] and rates[k] > 0:
                per = rates[k] * dt / len(active[k])
                for item in active[k]:
                    active[k][item] -= per
                bytes_read[k] += rates[k] * dt
        t += dt
        while pending and pending[0][0] <= t:
            _, _, k, item = heapq.heappop(pending)
            active[k][item] = sizes[item]
        finished = [(k, item) for k in range(n_tiers) for item, left in active[k].items() if left <= tol]
        for k, item in finished:
            del active[k][item]
            ok = not (fail is not None and fail(k, item))
            issue(route.complete(k, item, ok), t)

    done = route.done
    in_flight = [item for k in range(n_tiers) for item in active[k]] + [p[3] for p in pending]
    stragglers = sum(1 for item in in_flight if route.found[item])  # duplicates not yet reaped
    bound = None
    if not varying and n_items:
        total_rate = sum(float(s) for s in speeds)
        bound = sum(sizes) / total_rate if total_rate > 0 else math.inf
    return SimResult(
        finish=t if done else math.inf,
        done=done,
        found=list(route.found),
        reads=list(route.reads),
        source=list(route.source),
        issued=issued,
        bytes_read=bytes_read,
        duplicates=route.duplicates + stragglers,
        retries=route.retries,
        claims=list(route.claims_log),
        bound=bound,
    )
