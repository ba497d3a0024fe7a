"""Completion-driven routing of one batch's reads over replicated tiers (the paper's M4).

The router is pure: no I/O, no threads, no clock. The engine (or the simulator, or a test) feeds it
completions and submits the claims it returns, so the same object gives the same claim sequence on
every adapter path (SGLang today, LMCache/vLLM later).

Items are the batch's routing units, ``0 .. n-1`` in batch order. ``holders[i]`` is a bitmask of the
tiers that hold item ``i``. Lifecycle of one batch::

    route = policy.start(n_tiers, holders)
    submit(route.start())                         # initial claims of every tier
    while not route.done:
        tier, item, ok = wait_any()
        submit(route.complete(tier, item, ok))    # the next claims, possibly none
    route.found                                   # per item: read from some tier
    route.in_flight                               # reads still outstanding (duplicates, stalls):
                                                  # their buffers stay engine-owned until reaped

Rules shared by every policy
----------------------------
* An item is only claimed by a tier that holds it and has not failed it.
* ``complete(tier, item, ok=False)`` means that tier lacks or failed the item: the item goes back to
  the pool for its other holders (claimed before any fresh item), or is reported missing when no
  holder remains and no other read of it is in flight.
* The first successful completion of an item wins; a later duplicate completion is ignored.
* A tier keeps at most ``depth`` items in flight and claims ``m`` at a time whenever it has room for
  ``m`` (a last claim may be shorter). Both are per tier and may change during a batch
  (``set_depth``: the read path sizes them from each tier's flow, flow.py); ``refill()`` lets tiers
  claim into room that grew without a completion.

Completion-driven meet-in-the-middle (``CompletionDriven``, name ``"kvstream"``)
-------------------------------------------------------------------------------
* Tier 0 claims unread items from the front of the batch, the last tier from the back; a tier that
  completes a read immediately claims the next ``m`` unread items from its end, so a faster (or
  momentarily less contended) tier advances further and the tiers finish together (Eq. 4).
* **N > 2 tiers.** A middle tier seats its cursor at the midpoint of the largest run of unread items
  it can read (ties: the earliest run) and claims forward from there; when its next item is no longer
  unread (it ran into another tier's claims) it re-seats the same way. Tier 0 and the last tier scan
  to the far end of the batch, so together they reach every item; middle tiers split the largest
  remaining gap, so every tier has work until the pool is empty. With two tiers this reduces to
  the paper's rule.
* **The tail.** When a tier with room for ``m`` finds nothing unread it can read, it steals up to
  ``m`` items that are in flight on another tier, oldest claim first, each item read by at most two
  tiers at once. Near the meeting point this re-reads at most ``2m`` items (the paper's overlap);
  when a tier stalls it lets the healthy tier finish the whole batch. Stealing is triggered only by
  a completion or a ``refill()`` (never in ``start()``), so a healthy batch does not start with
  duplicates; the read path's ``may_steal`` filter lets a tier re-read another's items only where the
  re-read lands first (a tier measured twice as fast, or an owner fallen quiet or overdue: flow.outpaces).

Static policies (``StaticSplit``, ``SingleTier``) assign every item to one tier up front and never
steal; an item the assigned tier does not hold, or fails, falls back to another holder.

Rejected alternative: measuring tier bandwidths and splitting by prediction. It needs monitoring,
lags every change of the bandwidth mix and pays Eq. 6's penalty whenever the prediction is off;
completion order adapts with no state at all.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

__all__ = [
    "Claim",
    "BatchRoute",
    "Policy",
    "CompletionDriven",
    "StaticSplit",
    "SingleTier",
    "parse_policy",
    "all_tiers",
]

# Item states.
_UNREAD = 0   # claimable by its usable holders
_READING = 1  # in flight on at least one tier
_FOUND = 2    # resolved: delivered by a tier
_MISSING = 3  # resolved: no holder could deliver it

DEFAULT_CLAIM = 2  # items per claim (m); a claim of 2 pages keeps the meet-in-the-middle overlap small


class Claim(NamedTuple):
    """One claim: ``tier`` reads ``items`` (in this order); ``steal`` marks a tail re-read of items
    already in flight on another tier."""

    tier: int
    items: tuple[int, ...]
    steal: bool


def all_tiers(n_items: int, n_tiers: int) -> list[int]:
    """Holders mask list for a batch whose every item is on every tier (full replication, M3)."""
    return [(1 << n_tiers) - 1] * n_items


class BatchRoute:
    """Routing state of one batch. Built by ``Policy.start``; see the module docstring."""

    steals = False  # whether idle tiers re-read items in flight elsewhere

    def __init__(self, n_tiers: int, holders: Sequence[int], m: int, depth: int):
        if n_tiers < 1:
            raise ValueError(f"n_tiers must be >= 1, got {n_tiers}")
        if m < 1 or depth < m:
            raise ValueError(f"need 1 <= m <= depth, got m={m}, depth={depth}")
        self.n_tiers = n_tiers
        self.n = n = len(holders)
        self.m = m
        self.depth = depth
        self._depth = [depth] * n_tiers  # per tier: the caller may follow each device (set_depth)
        self._m = [m] * n_tiers
        # may_steal(stealer, owner): whether a tier with nothing unread may re-read items in flight on
        # ``owner`` (None: always). The caller decides from what it measures; the router stays pure.
        self.may_steal: Callable[[int, int], bool] | None = None
        full = (1 << n_tiers) - 1
        self._holders = [int(h) & full for h in holders]
        # _can[k][i] == 1 while tier k holds item i and has not failed it (bytearray: numpy views it).
        self._can = [bytearray(1 if (h >> k) & 1 else 0 for h in self._holders) for k in range(n_tiers)]
        self._state = bytearray(n)  # all _UNREAD
        self._readers = [0] * n  # bitmask of tiers with a read of the item in flight
        self._flight: list[dict[int, int]] = [{} for _ in range(n_tiers)]  # item -> claim seq, in claim order
        self._returned: deque[int] = deque()  # items given back by a failed read, claimed first
        self._seq = 0
        self._started = False
        self.claims_log: list[Claim] = []
        self.found = [False] * n
        self.reads = [0] * n_tiers  # first arrivals per tier
        self.source = [-1] * n  # per item: the tier whose read delivered it first (-1: none)
        self.duplicates = 0  # successful completions of items already delivered
        self.failures = 0  # ok=False completions
        self.retries = 0  # items handed to another replica after a failure
        self._unresolved = n
        for i, h in enumerate(self._holders):
            if h == 0:
                self._resolve(i, False)

    # -- public -----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Every item is resolved (found, or missing on every holder)."""
        return self._unresolved == 0

    @property
    def in_flight(self) -> int:
        """Reads issued and not yet completed, over all tiers (includes duplicates after ``done``)."""
        return sum(len(f) for f in self._flight)

    def tier_in_flight(self, tier: int) -> tuple[int, ...]:
        """Items in flight on ``tier``, oldest claim first."""
        return tuple(self._flight[tier])

    def set_depth(self, tier: int, depth: int, claim: int | None = None) -> None:
        """Items ``tier`` may keep in flight from now on (0: none for now), and optionally how many it
        claims at a time (a fast tier claims what one of its requests carries; >= 1). A claim needs
        room for the whole claim, so a depth below it lets the tier claim again only when its flight
        is empty."""
        self._depth[tier] = max(0, depth)
        if claim is not None:
            self._m[tier] = max(1, claim)

    def refill(self) -> list[Claim]:
        """Claims for every tier with room (after ``set_depth`` grew one, or when a steal became
        allowed without a completion)."""
        return self._fill(range(self.n_tiers)) if self._started else []

    def start(self) -> list[Claim]:
        """Initial claims: tiers claim round-robin (tier 0, 1, ..., then again) until full or dry."""
        if self._started:
            raise RuntimeError("BatchRoute.start() called twice")
        self._started = True
        out: list[Claim] = []
        progress = True
        while progress:
            progress = False
            for tier in range(self.n_tiers):
                if self._room(tier) >= self._claim_size(tier):
                    claim = self._claim_fresh(tier)
                    if claim is not None:
                        out.append(claim)
                        progress = True
        return out

    def complete(self, tier: int, item: int, ok: bool = True) -> list[Claim]:
        """Record the completion of ``tier``'s read of ``item``; return the claims it triggers.

        ``ok=False``: the tier lacks the item or the read failed (or was corrupt). The item goes back
        to its other holders, or is reported missing when none remains.
        Raises ValueError when that read is not in flight (a caller bug).
        """
        self._completed(tier, item, ok)
        return self._fill_after(tier)

    def complete_many(self, tier: int, results: Sequence[tuple[int, bool]]) -> list[Claim]:
        """``complete`` for several ``(item, ok)`` of one tier at once (one request of several
        items): the same state, and the claims the last of them would trigger."""
        for item, ok in results:
            self._completed(tier, item, ok)
        return self._fill_after(tier)

    def _fill_after(self, tier: int) -> list[Claim]:
        order = [tier] + [k for k in range(self.n_tiers) if k != tier]
        return self._fill(order)

    def _completed(self, tier: int, item: int, ok: bool) -> None:
        flight = self._flight[tier]
        if item not in flight:
            raise ValueError(f"item {item} is not in flight on tier {tier}")
        del flight[item]
        bit = 1 << tier
        self._readers[item] &= ~bit
        state = self._state[item]
        if state >= _FOUND:
            if ok:
                self.duplicates += 1  # first arrival already won; this copy is identical
        elif ok:
            self.reads[tier] += 1
            self.source[item] = tier
            self._resolve(item, True)
        else:
            self.failures += 1
            self._can[tier][item] = 0
            if self._readers[item]:
                pass  # another replica's read is still in flight: wait for it
            elif any(self._can[k][item] for k in range(self.n_tiers)):
                self._state[item] = _UNREAD
                self._returned.append(item)
                self.retries += 1
            else:
                self._resolve(item, False)

    # -- policy hook ------------------------------------------------------------------------------
    def _take(self, tier: int, k: int) -> list[int]:  # pragma: no cover - abstract
        """Up to ``k`` fresh unread items for ``tier`` (policy-specific order)."""
        raise NotImplementedError

    # -- machinery --------------------------------------------------------------------------------
    def _claimable(self, tier: int, item: int) -> bool:
        return self._state[item] == _UNREAD and self._can[tier][item] == 1

    def _room(self, tier: int) -> int:
        return self._depth[tier] - len(self._flight[tier])

    def _claim_size(self, tier: int) -> int:
        """The tier's claim size, or its whole depth when that is smaller (at least 1: a tier with
        no depth has no room for it)."""
        return max(1, min(self._m[tier], self._depth[tier]))

    def _resolve(self, item: int, found: bool) -> None:
        self._state[item] = _FOUND if found else _MISSING
        self.found[item] = found
        self._unresolved -= 1

    def _take_returned(self, tier: int, k: int) -> list[int]:
        out: list[int] = []
        if not self._returned:
            return out
        keep: deque[int] = deque()
        while self._returned:
            item = self._returned.popleft()
            if self._state[item] != _UNREAD:
                continue  # stale entry: claimed since it was given back
            if len(out) < k and self._can[tier][item]:
                out.append(item)
                self._state[item] = _READING  # taken: no second pick before _record
            else:
                keep.append(item)
        self._returned = keep
        return out

    def _claim_fresh(self, tier: int) -> Claim | None:
        m = self._claim_size(tier)
        items = self._take_returned(tier, m)
        if len(items) < m:
            items += self._take(tier, m - len(items))
        return self._record(tier, items, False) if items else None

    def _steal(self, tier: int, k: int) -> list[int]:
        bit = 1 << tier
        can = self._can[tier]
        cands = []
        for other in range(self.n_tiers):
            if other == tier or (self.may_steal is not None and not self.may_steal(tier, other)):
                continue
            for pos, (item, seq) in enumerate(self._flight[other].items()):
                r = self._readers[item]
                if (self._state[item] == _READING and can[item] and not (r & bit) and r & (r - 1) == 0):
                    cands.append((seq, pos, item))
        cands.sort()
        return [item for _, _, item in cands[:k]]

    def _record(self, tier: int, items: list[int], steal: bool) -> Claim:
        seq = self._seq
        self._seq += 1
        flight = self._flight[tier]
        bit = 1 << tier
        for item in items:
            flight[item] = seq
            self._readers[item] |= bit
            self._state[item] = _READING
        claim = Claim(tier, tuple(items), steal)
        self.claims_log.append(claim)
        return claim

    def _fill(self, order: Sequence[int]) -> list[Claim]:
        out: list[Claim] = []
        if self.done:
            return out  # batch resolved: no new reads; stragglers just drain
        for tier in order:
            while self._room(tier) >= self._claim_size(tier):
                claim = self._claim_fresh(tier)
                if claim is None and self.steals:
                    items = self._steal(tier, self._claim_size(tier))
                    claim = self._record(tier, items, True) if items else None
                if claim is None:
                    break
                out.append(claim)
        return out


class _MeetInTheMiddle(BatchRoute):
    steals = True

    def __init__(self, n_tiers: int, holders: Sequence[int], m: int, depth: int):
        super().__init__(n_tiers, holders, m, depth)
        last = n_tiers - 1
        # Cursor per tier: tier 0 at the front, the last tier at the back, middle tiers unseated (-1).
        self._pos = [0] + [-1] * max(0, n_tiers - 2) + ([self.n - 1] if n_tiers > 1 else [])
        self._step = [1] + [1] * max(0, n_tiers - 2) + ([-1] if n_tiers > 1 else [])
        self._edge = [k == 0 or k == last for k in range(n_tiers)]

    def _take(self, tier: int, k: int) -> list[int]:
        out: list[int] = []
        pos, step, n = self._pos[tier], self._step[tier], self.n
        if self._edge[tier]:
            while len(out) < k and 0 <= pos < n:
                if self._claimable(tier, pos):
                    out.append(pos)
                    self._state[pos] = _READING  # taken: no second pick before _record
                pos += step
        else:
            while len(out) < k:
                if 0 <= pos < n and self._claimable(tier, pos):
                    out.append(pos)
                    self._state[pos] = _READING  # taken: the re-seat below must not pick it again
                    pos += 1
                    continue
                pos = self._reseat(tier)
                if pos < 0:
                    break
        self._pos[tier] = pos
        return out

    def _reseat(self, tier: int) -> int:
        """Midpoint of the largest run of items ``tier`` can claim (earliest on ties), or -1."""
        mask = (np.frombuffer(self._state, dtype=np.uint8) == _UNREAD) & (
            np.frombuffer(self._can[tier], dtype=np.uint8) == 1
        )
        if not mask.any():
            return -1
        edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1)
        best = int(np.argmax(ends - starts))
        return int(starts[best] + (ends[best] - starts[best]) // 2)


class _Assigned(BatchRoute):
    """Static assignment: each tier reads its own list, front to back; no stealing."""

    def __init__(self, n_tiers: int, holders: Sequence[int], m: int, depth: int, shares: Sequence[float]):
        super().__init__(n_tiers, holders, m, depth)
        n = self.n
        bounds = [0]
        acc = 0.0
        for s in shares:
            acc += s
            bounds.append(min(n, round(acc * n)))
        bounds[-1] = n
        self._queues: list[deque[int]] = [deque() for _ in range(n_tiers)]
        for tier in range(n_tiers):
            for i in range(bounds[tier], bounds[tier + 1]):
                if self._state[i] != _UNREAD:
                    continue  # no holder at all: already missing
                # Not held by the assigned tier: the next holder in tier order takes it.
                owner = next(t % n_tiers for t in range(tier, tier + n_tiers) if self._can[t % n_tiers][i])
                self._queues[owner].append(i)
        self.assigned = [len(q) for q in self._queues]

    def _take(self, tier: int, k: int) -> list[int]:
        q = self._queues[tier]
        out: list[int] = []
        while q and len(out) < k:
            item = q.popleft()
            if self._claimable(tier, item):
                out.append(item)
                self._state[item] = _READING  # taken: no second pick before _record
        return out


class Policy:
    """A routing policy: data (name, parameters) plus ``start`` that builds one batch's route."""

    name: str = "policy"
    m: int  # items per claim (every policy's dataclass field)
    depth: int | None  # items in flight per tier (None: 2 * m)

    def __post_init__(self):
        # Every policy's claim and depth, checked when it is made: a bad one is a setting's error at start-up
        # (config._check_policy), never a get's (BatchRoute raised it into every read).
        if self.m < 1 or (self.depth is not None and self.depth < self.m):
            raise ValueError(f"{self.name} policy needs 1 <= m <= depth, got m={self.m}, depth={self.depth}")

    def validate(self, n_tiers: int) -> None:
        """:raises ValueError: the policy cannot route reads over ``n_tiers`` tiers (it names a tier, or
        gives shares, that are not there). Its own parameters were checked when it was made."""
        if n_tiers < 1:
            raise ValueError(f"n_tiers must be >= 1, got {n_tiers}")

    def start(self, n_tiers: int, holders: Sequence[int]) -> BatchRoute:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


@dataclass(frozen=True)
class CompletionDriven(Policy):
    """Completion-driven meet-in-the-middle (M4): ``m`` items per claim, ``depth`` in flight per tier
    (default ``2*m``)."""

    m: int = DEFAULT_CLAIM
    depth: int | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return "kvstream"

    def start(self, n_tiers: int, holders: Sequence[int]) -> BatchRoute:
        return _MeetInTheMiddle(n_tiers, holders, self.m, self.depth or 2 * self.m)


@dataclass(frozen=True)
class StaticSplit(Policy):
    """Fixed shares by position: the first ``round(g*n)`` items to tier 0, the rest to tier 1.

    ``g`` may also be a sequence of per-tier shares (N > 2); a float with N > 2 tiers gives tier 0
    the share ``g`` and splits the rest equally.
    """

    g: float | tuple[float, ...] = 0.5
    m: int = DEFAULT_CLAIM
    depth: int | None = None

    def __post_init__(self):
        shares = self.g if isinstance(self.g, tuple) else (self.g,)
        if any(s < 0 for s in shares) or (not isinstance(self.g, tuple) and self.g > 1):
            raise ValueError(f"static split share(s) must be in [0, 1], got {self.g}")
        if isinstance(self.g, tuple) and sum(self.g) <= 0:
            raise ValueError(f"static split shares must not all be zero, got {self.g}")
        super().__post_init__()

    @property
    def name(self) -> str:  # type: ignore[override]
        if isinstance(self.g, tuple):
            return "static-" + "/".join(f"{s:g}" for s in self.g)
        return f"static-{self.g:g}"

    def validate(self, n_tiers: int) -> None:
        super().validate(n_tiers)
        if isinstance(self.g, tuple) and len(self.g) != n_tiers:
            raise ValueError(f"{self.name}: {len(self.g)} shares for {n_tiers} tiers")

    def shares(self, n_tiers: int) -> list[float]:
        self.validate(n_tiers)
        if isinstance(self.g, tuple):
            total = sum(self.g)
            return [s / total for s in self.g]
        if n_tiers == 1:
            return [1.0]
        rest = (1.0 - self.g) / (n_tiers - 1)
        return [self.g] + [rest] * (n_tiers - 1)

    def start(self, n_tiers: int, holders: Sequence[int]) -> BatchRoute:
        return _Assigned(n_tiers, holders, self.m, self.depth or 2 * self.m, self.shares(n_tiers))


@dataclass(frozen=True)
class SingleTier(Policy):
    """Every item from one tier; items it lacks or fails fall back to another holder."""

    tier: int = 0
    m: int = DEFAULT_CLAIM
    depth: int | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"tier{self.tier}"

    def validate(self, n_tiers: int) -> None:
        super().validate(n_tiers)
        if not 0 <= self.tier < n_tiers:
            raise ValueError(f"{self.name}: no tier {self.tier} among {n_tiers} tiers")

    def start(self, n_tiers: int, holders: Sequence[int]) -> BatchRoute:
        self.validate(n_tiers)
        shares = [1.0 if k == self.tier else 0.0 for k in range(n_tiers)]
        return _Assigned(n_tiers, holders, self.m, self.depth or 2 * self.m, shares)


_SPEC = re.compile(r"^(?P<kind>kvstream|static-(?P<g>[0-9.]+(?:/[0-9.]+)*)|tier(?P<tier>\d+))(?::(?P<opts>.*))?$")


def parse_policy(spec: str) -> Policy:
    """Policy from its name: ``"kvstream"``, ``"kvstream:m=4,depth=8"``, ``"static-0.75"``,
    ``"static-0.5/0.3/0.2"`` (N tiers), ``"tier0"``; every form accepts ``:m=..,depth=..``.

    Raises ValueError naming the accepted forms.
    """
    match = _SPEC.match(spec.strip().lower())
    if not match:
        raise ValueError(
            f"unknown routing policy {spec!r}: use 'kvstream[:m=M,depth=D]', 'static-G' (0 <= G <= 1) or 'tierK'"
        )
    opts: dict[str, int] = {}
    if match["opts"]:
        for part in match["opts"].split(","):
            key, _, value = part.partition("=")
            if key.strip() not in ("m", "depth") or not value.strip().isdigit():
                raise ValueError(f"bad option {part!r} in policy {spec!r}: options are m=<int>, depth=<int>")
            opts[key.strip()] = int(value)
    if match["g"] is not None:
        parts = [float(x) for x in match["g"].split("/")]
        return StaticSplit(parts[0] if len(parts) == 1 else tuple(parts), **opts)
    if match["tier"] is not None:
        return SingleTier(int(match["tier"]), **opts)
    return CompletionDriven(**opts)
