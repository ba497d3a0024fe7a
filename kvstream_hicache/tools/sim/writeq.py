"""Pending writes per tier for kvsim: how a step's new KV reaches the tiers, and when it holds a step up.

Three models (``SimConfig.write_model``):

``legacy``    the original kvsim model: one backlog float per tier; a step waits (back-pressure) until
              every tier's backlog, before its own new KV is added, is within the staging bound.
``deferred``  the engine's M2 on the LMCache path: store tasks queue in the engine and each tier drains
              its own FIFO of pages independently; a page occupies the staging pool until its last
              chosen tier has written it (the pool is shared by all tiers); a step's new KV must fit
              the pool (``occupancy + W_i <= S``) or the step waits for room.
``sync``      SGLang's path: one ``batch_set`` per step, calls served one at a time; a call returns
              when every tier it writes to has committed its pages, so no tier starts the next call
              before the slowest tier of the current one is done. The pages wait in host memory
              (HiCache's backup queue) meanwhile; ``staging`` bounds that queue here (a proxy: HiCache
              itself would keep the pages pinned, not stall the step).

Each tier writes only in the windows it is given (read priority: ``advance`` is called with the
windows in which a tier has no read in flight).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

__all__ = ["WriteQueue", "CatchUpQueue", "WRITE_MODELS"]

WRITE_MODELS = ("legacy", "deferred", "sync")
_EPS = 1e-6  # bytes


class WriteQueue:
    def __init__(self, n_tiers: int, mode: str, staging_bytes: float):
        if mode not in WRITE_MODELS:
            raise ValueError(f"unknown write model {mode!r}: use one of {', '.join(WRITE_MODELS)}")
        self.n, self.mode, self.staging = n_tiers, mode, float(staging_bytes)
        self._pending = [0.0] * n_tiers  # bytes queued or in flight per tier
        self._occ = 0.0  # staging bytes held (deferred, sync)
        # deferred: per tier FIFO of [page, bytes left]; per page [bytes, tiers left]
        self._fifo: list[deque] = [deque() for _ in range(n_tiers)]
        self._pages: dict[int, list] = {}
        self._next_page = 0
        # sync: FIFO of calls [staged bytes, [bytes left per tier]]
        self._calls: deque = deque()
        self.idle_since = 0.0  # when the last pending write (any tier) completed

    def busy(self) -> bool:
        """True while some tier has a write queued, held back or in flight."""
        return any(p > _EPS for p in self._pending)

    def quiet_for(self, now: float) -> float:
        """Seconds the write path has been idle (no write pending on any tier) at ``now``; 0 if busy."""
        return 0.0 if self.busy() else max(0.0, now - self.idle_since)

    # -- state ------------------------------------------------------------------------------------
    def pending(self, k: int) -> float:
        """Bytes queued, held back or in flight on tier ``k``."""
        return self._pending[k]

    def occupancy(self) -> float:
        """Staging bytes held: pages that still have a write to do on some tier."""
        if self.mode == "legacy":
            return max(self._pending, default=0.0)
        return self._occ

    # -- a put ------------------------------------------------------------------------------------
    def add(self, sizes: Sequence[float], masks: Sequence[int]) -> list[float]:
        """Queue one put (a step's new pages): ``sizes[j]`` bytes to the tiers in bitmask ``masks[j]``.
        Returns the bytes queued per tier."""
        per = [0.0] * self.n
        sizes = np.asarray(sizes, dtype=float)
        masks = np.asarray(masks, dtype=np.int64)
        for k in range(self.n):
            per[k] = float(sizes[(masks >> k) & 1 == 1].sum())
            self._pending[k] += per[k]
        if self.mode == "deferred":
            for s, m in zip(sizes.tolist(), masks.tolist()):
                tiers = [k for k in range(self.n) if m >> k & 1]
                if not tiers or s <= 0:
                    continue
                pid = self._next_page
                self._next_page += 1
                self._pages[pid] = [s, len(tiers)]
                self._occ += s
                for k in tiers:
                    self._fifo[k].append([pid, s])
        elif self.mode == "sync":
            staged = float(sizes[masks != 0].sum())
            if staged > 0:
                self._calls.append([staged, per[:]])
                self._occ += staged
        return per

    # -- time passes ------------------------------------------------------------------------------
    def advance(self, rates: Sequence[float], windows: Sequence[tuple[float, float]], now: float = 0.0) -> None:
        """Let tier ``k`` write at ``rates[k]`` bytes/s during ``windows[k] = (a, b)`` (seconds within
        the phase that starts at time ``now``; ``b <= a``: no writing)."""
        was_busy = self.busy()
        if self.mode == "sync":
            done_at = self._advance_sync(rates, windows)
        else:
            done_at = 0.0
            for k in range(self.n):
                a, b = windows[k]
                if b > a and self._pending[k] > 0:
                    before = self._pending[k]
                    self._write(k, (b - a) * rates[k])
                    if self._pending[k] <= _EPS:
                        done_at = max(done_at, a + before / rates[k])
        if was_busy and not self.busy():
            self.idle_since = now + done_at

    def room(self, new_bytes: float, rates: Sequence[float], now: float = 0.0) -> float:
        """Back-pressure before a step's new KV (``new_bytes``) is staged: the seconds the step waits,
        with every tier writing meanwhile; the queue is advanced by that time."""
        if self.mode == "legacy":
            t = 0.0
            for k in range(self.n):
                over = self._pending[k] - self.staging
                if over > 0:
                    t = max(t, over / rates[k])
            if t > 0:
                self.advance(rates, [(0.0, t)] * self.n, now)
            return t
        target = max(self.staging - new_bytes, 0.0)
        t = 0.0
        while self._occ > target + _EPS:
            if self.mode == "deferred":
                heads = [(self._fifo[k][0][1] / rates[k], k) for k in range(self.n) if self._fifo[k]]
                if not heads:
                    break
                dt = min(heads)[0]
            else:
                if not self._calls:
                    break
                left = self._calls[0][1]
                dt = max(left[k] / rates[k] for k in range(self.n))
            self.advance(rates, [(0.0, dt)] * self.n, now + t)
            t += dt
        return t

    # -- internals --------------------------------------------------------------------------------
    def _write(self, k: int, nbytes: float) -> None:
        if self.mode == "legacy":
            self._pending[k] = max(0.0, self._pending[k] - nbytes)
            return
        fifo = self._fifo[k]
        while nbytes > _EPS and fifo:
            head = fifo[0]
            done = min(head[1], nbytes)
            head[1] -= done
            nbytes -= done
            self._pending[k] -= done
            if head[1] <= _EPS:
                fifo.popleft()
                page = self._pages[head[0]]
                page[1] -= 1
                if page[1] == 0:
                    self._occ -= page[0]
                    del self._pages[head[0]]
        if not fifo:
            self._pending[k] = 0.0
        if not self._pages:
            self._occ = 0.0

    def _advance_sync(self, rates: Sequence[float], windows: Sequence[tuple[float, float]]) -> float:
        """Serve calls in order within the windows; returns when (in the phase) the last call completed."""
        last_done = 0.0
        clock = [w[0] for w in windows]
        end = [w[1] for w in windows]
        while self._calls:
            staged, left = self._calls[0]
            finish = [clock[k] + left[k] / rates[k] if left[k] > _EPS else clock[k] for k in range(self.n)]
            if all(left[k] <= _EPS or finish[k] <= end[k] + 1e-12 for k in range(self.n)):
                done_at = max(f for k, f in enumerate(finish) if left[k] > _EPS) if any(
                    x > _EPS for x in left) else min(clock)
                for k in range(self.n):
                    self._pending[k] = max(0.0, self._pending[k] - left[k])
                    clock[k] = max(clock[k], done_at)
                self._occ -= staged
                self._calls.popleft()
                last_done = done_at
                continue
            for k in range(self.n):  # the head call does not finish in this phase: partial progress
                if left[k] > _EPS and end[k] > clock[k]:
                    done = min(left[k], (end[k] - clock[k]) * rates[k])
                    left[k] -= done
                    self._pending[k] -= done
            break
        if not self._calls:
            self._occ = 0.0
            self._pending = [0.0] * self.n
        return last_done


class CatchUpQueue(WriteQueue):
    """A WriteQueue with the engine's background replication (kvstream_hicache/replication.py): a
    replica the budget skipped is owed to its tier and written there later, in the tier's write
    windows (read priority decides them, as for every write), only once the tier's foreground writes
    are drained (never ahead of a put), at ``share`` of its write bandwidth; a written replica joins
    ``holders`` (the blocks' tier masks), so later reads can route to it. The copy's read from the
    source tier is not modelled (tier 0 reads several times faster than tier 1 writes)."""

    def __init__(self, n_tiers: int, mode: str, staging_bytes: float, share: float, holders: np.ndarray):
        super().__init__(n_tiers, mode, staging_bytes)
        self.share, self.holders = share, holders
        self._owed: list[deque] = [deque() for _ in range(n_tiers)]  # per tier FIFO of [block, bytes left]
        self.caught_up = [0.0] * n_tiers  # bytes of replicas written by catch-up
        self.caught_up_pages = [0] * n_tiers
        self.done_at = 0.0  # when the last owed replica was written

    def owe(self, blocks: Sequence[int], sizes: Sequence[float], masks: Sequence[int]) -> None:
        """A put's pages: each tier not in its mask is owed the page."""
        for block, size, mask in zip(np.asarray(blocks).tolist(), np.asarray(sizes, dtype=float).tolist(),
                                     np.asarray(masks).tolist()):
            for k in range(self.n):
                if not mask >> k & 1 and size > 0:
                    self._owed[k].append([block, size])

    def owed(self, k: int) -> float:
        return sum(left for _, left in self._owed[k])

    def advance(self, rates: Sequence[float], windows: Sequence[tuple[float, float]], now: float = 0.0) -> None:
        before = list(self._pending)
        super().advance(rates, windows, now)
        for k in range(self.n):
            a, b = windows[k]
            owed = self._owed[k]
            if b <= a or not owed or self._pending[k] > _EPS:
                continue  # no window, nothing owed, or a put's pages still wait: they go first
            used = (before[k] - self._pending[k]) / rates[k]  # the window's time the put's pages took
            budget = (b - a - used) * rates[k] * self.share
            spent = 0.0
            while owed and budget > _EPS:
                head = owed[0]
                done = min(head[1], budget)
                head[1] -= done
                budget -= done
                spent += done
                if head[1] <= _EPS:
                    owed.popleft()
                    self.holders[head[0]] |= 1 << k
                    self.caught_up_pages[k] += 1
            self.caught_up[k] += spent
            if spent and not owed:
                self.done_at = now + a + used + spent / (rates[k] * self.share)
