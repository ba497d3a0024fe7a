"""Admission: which tiers a put's new pages go to. Pure: sizes, bandwidths and capacities in, target
tiers out (writequeue.py keeps the queues and counts what was skipped).

Two rules, in this order, over a batch's new pages in key order:

- capacity: a tier with a limit targets only the first pages of the batch that fit, the most recent once
  it is written (reverse batch order, PutCall.lru_order: a prefix's head, which the pages after it need:
  SGLang's batch_exists counts the leading run), as LRU would keep them (writing the others would only
  evict them again within the batch);
- replicate=budget: the home tier (a page's first target) takes it; another tier k takes it only if
  ``(P_k + s) / w_k <= max(P_home / w_home, slack)`` (P: bytes accepted for the tier and not yet
  written, the page included for home; w: its measured write bandwidth, 0 while unmeasured; s: the
  page's file bytes): a replica that would delay the next reads is skipped.
"""
from __future__ import annotations

from collections.abc import Sequence

from .index import tiers_in


def fit_capacity(sizes: Sequence[int], targets: list[int], capacities: Sequence[int | None],
                 held: Sequence[bool] = ()) -> list[int]:
    """Drop from ``targets`` (per page, a tier bitmask; changed in place) each capacity-limited tier
    the page does not fit on, the batch's first pages placed first: once one does not fit, none after it
    (a prefix's tail without its head serves nothing). Returns how many pages each tier dropped. (Before,
    the last pages were kept: a backup larger than the capacity stored a tail that batch_exists never
    reached, found by trial metrics.) ``held[i]``: page ``i`` is held already on the tiers of ``targets[i]``
    (the put's pages it need not write): it takes its room there, never dropped nor counted (left out, a
    batch whose head was held took the whole capacity for its new pages, whose writes evicted that head)."""
    skipped = [0] * len(capacities)
    for k, cap in enumerate(capacities):
        if cap is None:
            continue
        room = cap
        for i in range(len(sizes)):
            if targets[i] >> k & 1:
                if sizes[i] <= room:
                    room -= sizes[i]
                elif i < len(held) and held[i]:
                    room = 0
                else:
                    targets[i] &= ~(1 << k)
                    room = 0
                    skipped[k] += 1
    return skipped


def replica_fits(queued: int, size: int, w: float, home_queued: int, w_home: float, slack: float) -> bool:
    """replicate=budget: may a tier with ``queued`` bytes pending, write bandwidth ``w``, take a page
    of ``size`` bytes, whose home tier has ``home_queued`` bytes pending (the page included) at
    ``w_home``? Yes when it drains no later than the home copy, or within ``slack`` seconds; yes too
    while either bandwidth is unmeasured (0). With slack 0 a replica never finishes after its home
    copy; the slack is a floor: a replica may always take up to ``slack`` seconds."""
    if not w or not w_home:
        return True
    return (queued + size) / w <= max(home_queued / w_home, slack)


def admit(size: int, targets: int, queued: Sequence[int], bandwidth: Sequence[float], replicate: str,
          slack: float) -> int:
    """The tiers of ``targets`` that take a new page of ``size`` file bytes (``queued``: bytes
    pending per tier before it; ``bandwidth``: per tier, bytes/s or 0 while unmeasured)."""
    if not targets or replicate != "budget":
        return targets
    home = (targets & -targets).bit_length() - 1
    home_queued = queued[home] + size
    kept = targets
    for k in tiers_in(targets & ~(1 << home)):
        if not replica_fits(queued[k], size, bandwidth[k], home_queued, bandwidth[home], slack):
            kept &= ~(1 << k)
    return kept
