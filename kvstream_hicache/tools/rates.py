"""Tier rates over time, as both tools use them: ``kvstream bench`` fills a tier's bandwidth in a batch
that did not measure it, and ``kvsim --validate-bench`` replays a run's recorded rates, from the same
interpolation. Pure.
"""
from __future__ import annotations

import bisect
from typing import Sequence

__all__ = ["interpolate"]


def interpolate(samples: Sequence[tuple[float, float]], t: float) -> float | None:
    """Linear interpolation of ``samples`` at ``t``; the nearest sample outside their span; None if empty."""
    if not samples:
        return None
    times = [s[0] for s in samples]
    j = bisect.bisect_left(times, t)
    if j == 0:
        return samples[0][1]
    if j == len(samples):
        return samples[-1][1]
    (ta, ra), (tb, rb) = samples[j - 1], samples[j]
    if tb == ta:
        return (ra + rb) / 2
    return ra + (rb - ra) * (t - ta) / (tb - ta)
