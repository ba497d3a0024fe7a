"""Counters and per-batch figures, exported as plain dicts.

Per tier: bytes and blocks read (every transfer, duplicates included), bytes served (first
verified arrivals: the tier's share of the data returned), bytes in place (of those, the ones read
straight into the caller's memory, no staging copy: memory.py), pages read (pages it served at least one
block of), bytes/pages written, read and write busy time
(time with at least one op of that tier in flight), errors, reads retried on another replica
after this tier failed them, corrupted copies found, copies found to be another writer's version
(kept on disk, out of the index), evictions.

Per read batch (``last_batch`` and a bounded history): retrieval time, bytes, per tier bytes and
busy time, and the bound ``D / sum_k b_k`` with ``b_k`` = tier k's bytes / busy time in that batch
(the aggregate-bandwidth bound of the paper, Eq. 3), and ``gap = time / bound - 1``.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from .locks import ranked_lock

TIER_COUNTERS = (
    "bytes_read", "blocks_read", "requests", "bytes_served", "bytes_in_place", "pages_read", "bytes_written",
    "pages_written", "read_busy_s", "write_busy_s", "errors", "replica_retries", "corrupted", "evictions",
    "evictions_spared", "used_marks",
    "quarantined", "other_versions", "write_failures", "skipped_writes", "replica_skipped_pages",
    "replica_skipped_bytes", "write_held_s", "replication_done", "replication_bytes", "replication_dropped",
    "replication_promoted", "replication_read_bytes",
    "write_timeouts", "writes_abandoned",
)
TOTAL_COUNTERS = (
    "gets", "pages_requested", "pages_found", "pages_missing", "puts", "pages_put", "pages_stored",
    "pages_existing", "pages_failed", "under_replicated", "invalid_keys", "size_mismatch", "read_timeouts",
    "duplicate_reads", "orphan_reads", "discovered", "deferred_puts", "backpressure_waits", "backpressure_s",
    "ring_failures", "routed_calls", "held_calls",
)
HISTORY = 256  # read batches kept in stats()["history"]
SAY_EVERY_S = 30.0  # a warning an event repeats for as long as a tier stays slow (a get's timeout) is said this often


class Every:
    """A warning said at most once per ``interval`` s, with how many like it were held back since: a tier slow
    for hours times out every get, and one line a get flooded the server's log (the count is in the stats).
    Not thread-safe: its caller's lock (the read path's) orders the calls."""

    def __init__(self, log, interval: float = SAY_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.log, self.interval, self.clock = log, interval, clock
        self.last: float | None = None
        self.held = 0

    def warning(self, msg: str, *args) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < self.interval:
            self.held += 1
            return
        if self.held:
            msg += f" ({self.held} more like this in the last {now - self.last:.0f} s)"
        self.last, self.held = now, 0
        self.log.warning(msg, *args)


class BusyClock:
    """Per-tier time with >= 1 op in flight (union of intervals, not a sum per op)."""

    def __init__(self, n_tiers: int, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.in_flight = [0] * n_tiers
        self._since = [0.0] * n_tiers
        self._total = [0.0] * n_tiers

    def started(self, tier: int, n: int = 1) -> None:
        if n and not self.in_flight[tier]:
            self._since[tier] = self.clock()
        self.in_flight[tier] += n

    def finished(self, tier: int, n: int = 1) -> None:
        self.in_flight[tier] -= n
        if not self.in_flight[tier]:
            self._total[tier] += self.clock() - self._since[tier]

    def total(self, tier: int) -> float:
        """Busy seconds so far, counting an open interval up to now."""
        busy = self._total[tier]
        if self.in_flight[tier]:
            busy += self.clock() - self._since[tier]
        return busy

    def snapshot(self) -> list[float]:
        return [self.total(k) for k in range(len(self.in_flight))]


class Stats:
    """Thread-safe counters. ``add`` is cheap; ``snapshot`` builds the dict."""

    def __init__(self, n_tiers: int):
        self.n_tiers = n_tiers
        self._lock = ranked_lock("stats")
        self.tiers = [dict.fromkeys(TIER_COUNTERS, 0) for _ in range(n_tiers)]
        self.totals = dict.fromkeys(TOTAL_COUNTERS, 0)
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.last_batch: dict = {}

    def add(self, tier: int, name: str, n: float = 1) -> None:
        with self._lock:
            self.tiers[tier][name] += n

    def total(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.totals[name] += n

    def record_batch(self, batch: dict) -> None:
        with self._lock:
            self.last_batch = batch
            self.history.append(batch)

    def snapshot(self) -> dict:
        with self._lock:
            tiers = [dict(t) for t in self.tiers]
            totals = dict(self.totals)
            history = list(self.history)
            last = dict(self.last_batch)
        served = sum(t["bytes_served"] for t in tiers)
        for t in tiers:
            t["read_share"] = t["bytes_served"] / served if served else 0.0
        return {"tiers": tiers, **totals, "last_batch": last, "history": history}


def batch_figures(elapsed: float, served: int, tier_bytes: list[int], tier_busy: list[float],
                  tier_served: list[int]) -> dict:
    """The per-batch record: time, bytes, per tier bytes/busy/bandwidth, bound and gap."""
    rates = [b / t if t > 0 else 0.0 for b, t in zip(tier_bytes, tier_busy)]
    total_rate = sum(rates)
    bound = served / total_rate if total_rate > 0 and served else 0.0
    return {
        "time_s": elapsed,
        "bytes": served,
        "throughput": served / elapsed if elapsed > 0 else 0.0,
        "tiers": [{"bytes": b, "busy_s": t, "bandwidth": r, "bytes_served": s}
                  for b, t, r, s in zip(tier_bytes, tier_busy, rates, tier_served)],
        "bound_s": bound,
        "gap": elapsed / bound - 1.0 if bound > 0 else None,
    }
