"""The gap to the aggregate-bandwidth bound, and the figures of a benchmark run (pure: no I/O, no clock).

The bound of one batch (the paper's Eq. 2) is the time the tiers would need if every tier streamed
at its full rate and they all finished together::

    T_bound(i) = D_i / sum_k b_k(i)          D_i: payload bytes of batch i
                                             b_k(i): bandwidth of tier k during batch i

and a policy's gap over its batches is ``sum_i T_ret(i) / sum_i T_bound(i) - 1``.

Where ``b_k(i)`` comes from (measured in the same run, never taken from a profile):
  * the batch itself, when tier k moved at least ``min_bytes`` in it: ``bytes_k / busy_k``, with
    ``busy_k`` the time tier k had reads in flight during the batch (the engine's per-batch stats);
  * otherwise (the policy left tier k idle or nearly so, e.g. ``tier0``, ``hicache-file``), the
    tier's rate interpolated in time between the nearest batches of *other* policies that did
    measure it. Policies are interleaved batch by batch, so such a neighbour is one batch away.
A rate measured over a whole batch is that tier's average over the batch, which is what the bound
needs even while the bandwidth drifts (``D = sum_k b_k T`` when both tiers stream all along).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..rates import interpolate

MIN_TIER_PAGES = 4  # a tier's own rate is trusted when it read at least this many pages in the batch


@dataclass
class BatchRecord:
    """One timed batch of one policy. Times in seconds, ``t0`` from the start of the read phase."""

    policy: str
    round: int
    t0: float
    t_ret: float
    nbytes: int  # payload bytes delivered (found pages x page bytes)
    pages: int
    found: int
    tier_bytes: tuple[int, ...]  # bytes each tier read (duplicate reads near the meeting point included)
    tier_busy: tuple[float | None, ...]  # seconds each tier had reads in flight (None: unknown)
    tier_served: tuple[int, ...] = ()  # payload bytes each tier delivered first (its share of the data)
    extra: dict = field(default_factory=dict)
    # filled by assign_bounds():
    tier_bps: tuple[float, ...] = ()
    tier_bps_source: tuple[str, ...] = ()  # "batch" | "interpolated" | "none"
    bound_s: float | None = None

    @property
    def t_mid(self) -> float:
        return self.t0 + self.t_ret / 2


def tier_rate(rec: BatchRecord, tier: int, min_bytes: int) -> float | None:
    """Tier ``tier``'s bandwidth measured by batch ``rec`` (bytes/s), or None if it did not measure it."""
    busy = rec.tier_busy[tier] if tier < len(rec.tier_busy) else None
    nbytes = rec.tier_bytes[tier] if tier < len(rec.tier_bytes) else 0
    if busy is None or busy <= 0 or nbytes < max(min_bytes, 1):
        return None
    return nbytes / busy


def rate_samples(records: Iterable[BatchRecord], n_tiers: int, min_bytes: int) -> list[list[tuple[float, float]]]:
    """Per tier, the ``(t_mid, bytes/s)`` samples of every batch that measured it, in time order."""
    out: list[list[tuple[float, float]]] = [[] for _ in range(n_tiers)]
    for rec in records:
        for k in range(n_tiers):
            r = tier_rate(rec, k, min_bytes)
            if r is not None:
                out[k].append((rec.t_mid, r))
    for s in out:
        s.sort()
    return out


def assign_bounds(records: Sequence[BatchRecord], n_tiers: int, min_bytes: int) -> None:
    """Fill ``tier_bps``, ``tier_bps_source`` and ``bound_s`` of every record (see the module docstring)."""
    samples = rate_samples(records, n_tiers, min_bytes)
    for rec in records:
        rates, sources = [], []
        for k in range(n_tiers):
            own = tier_rate(rec, k, min_bytes)
            if own is not None:
                rates.append(own)
                sources.append("batch")
                continue
            est = interpolate(samples[k], rec.t_mid)  # this batch is not among the samples of tier k
            rates.append(est or 0.0)
            sources.append("interpolated" if est is not None else "none")
        rec.tier_bps = tuple(rates)
        rec.tier_bps_source = tuple(sources)
        total = sum(rates)
        rec.bound_s = rec.nbytes / total if total > 0 and rec.nbytes > 0 else None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between order statistics (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def gap(records: Sequence[BatchRecord]) -> float | None:
    """``sum T_ret / sum T_bound - 1`` over the records that have a bound."""
    timed = [r for r in records if r.bound_s]
    if not timed:
        return None
    return sum(r.t_ret for r in timed) / sum(r.bound_s for r in timed) - 1.0


def summarize(records: Sequence[BatchRecord], n_tiers: int) -> dict:
    """A policy's figures: throughput, percentiles of batch time, per-tier share, gap, bound."""
    if not records:
        return {}
    t_sum = sum(r.t_ret for r in records)
    d_sum = sum(r.nbytes for r in records)
    tier_bytes = [sum(r.tier_bytes[k] for r in records if k < len(r.tier_bytes)) for k in range(n_tiers)]
    read_total = sum(tier_bytes)
    served = [sum(r.tier_served[k] for r in records if k < len(r.tier_served)) for k in range(n_tiers)]
    served_total = sum(served)
    bounded = [r for r in records if r.bound_s]
    times = [r.t_ret for r in records]
    return {
        "batches": len(records),
        "pages": sum(r.pages for r in records),
        "missing_pages": sum(r.pages - r.found for r in records),
        "throughput_gbps": d_sum / t_sum / 1e9 if t_sum > 0 else 0.0,
        "median_gbps": percentile([r.nbytes / r.t_ret / 1e9 for r in records if r.t_ret > 0], 50),
        "p50_s": percentile(times, 50),
        "p90_s": percentile(times, 90),
        "max_s": max(times),
        # share of the data each tier delivered (first arrivals); all bytes read if the policy cannot tell
        "share": ([b / served_total for b in served] if served_total
                  else [b / read_total if read_total else 0.0 for b in tier_bytes]),
        "read_amplification": read_total / d_sum - 1.0 if d_sum else 0.0,
        "gap": gap(records),
        "tier_rates_mbps": [_mean_rate(records, k) for k in range(n_tiers)],
        # diagnostics: the engine's own busy time per tier as a share of the batch time, CPU per batch
        "engine_busy_frac": [_busy_frac(records, k) for k in range(n_tiers)],
        "cpu_s_per_batch": percentile([r.extra["cpu_s"] for r in records if "cpu_s" in r.extra], 50)
        if any("cpu_s" in r.extra for r in records) else None,
        # process CPU seconds (all threads) per GB delivered, over the policy's batches
        "cpu_s_per_gb": (sum(r.extra["cpu_s"] for r in records if "cpu_s" in r.extra)
                         / (sum(r.nbytes for r in records if "cpu_s" in r.extra) / 1e9))
        if any("cpu_s" in r.extra and r.nbytes for r in records) else None,
        # the staging memory peak of the engine the policy reads through (None: not a kvstream engine)
        "memory_peak_bytes": max((r.extra["memory_peak_bytes"] for r in records if "memory_peak_bytes" in r.extra),
                                 default=None),
        **_windows(records),
        "drift_on_frac": (sum(r.extra["drift_on"] * r.t_ret for r in records if "drift_on" in r.extra)
                          / sum(r.t_ret for r in records if "drift_on" in r.extra))
        if any("drift_on" in r.extra for r in records) else None,
        "bound_gbps": (sum(r.nbytes for r in bounded) / sum(r.bound_s for r in bounded) / 1e9) if bounded else None,
    }


def _windows(records: Sequence[BatchRecord]) -> dict:
    """Median start-up (call -> first read submitted) and tail (first tier done -> batch done), seconds,
    over the batches where the ring instrument saw at least two tiers."""
    starts, tails = [], []
    for r in records:
        w = [e for e in (r.extra.get("tier_window_s") or ()) if e is not None]
        if len(w) >= 2:
            starts.append(min(e[0] for e in w))
            tails.append(max(0.0, r.t_ret - min(e[1] for e in w)))
    if not starts:
        return {}
    return {"startup_s": percentile(starts, 50), "tail_s": percentile(tails, 50)}


def _busy_frac(records: Sequence[BatchRecord], k: int) -> float | None:
    busy = [(r.extra["engine_busy_s"][k], r.t_ret) for r in records
            if len(r.extra.get("engine_busy_s") or ()) > k and r.extra["engine_busy_s"][k] is not None]
    t = sum(tr for _, tr in busy)
    return sum(b for b, _ in busy) / t if t > 0 else None


def _mean_rate(records: Sequence[BatchRecord], k: int) -> float | None:
    """Tier k's rate over the batches that measured it themselves (sum bytes / sum time), MB/s."""
    used = [r for r in records if len(r.tier_bps_source) > k and r.tier_bps_source[k] == "batch"]
    t = sum(r.tier_bytes[k] / r.tier_bps[k] for r in used if r.tier_bps[k] > 0)
    return sum(r.tier_bytes[k] for r in used) / t / 1e6 if t > 0 else None


def overall_bound_gbps(records: Sequence[BatchRecord]) -> float | None:
    """The aggregate bound over every batch of the run: ``sum D / sum T_bound`` (GB/s)."""
    bounded = [r for r in records if r.bound_s]
    if not bounded:
        return None
    return sum(r.nbytes for r in bounded) / sum(r.bound_s for r in bounded) / 1e9
