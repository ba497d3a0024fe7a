"""Read priority: which tiers a read is using right now, told by the read path, asked by the write path.

Writes never cost reads (the paper's M2, here per tier): while a ``get`` reads from tier k, the write
path starts no new write on tier k; what it had in flight there finishes (at most its write window,
flow.py: with the writes the writer's current step decided on before the read began), and queued
writes go out the moment the tier has no read left. A tier counts as read from for the whole of a
``get`` that routes items to it, from just before its first submission (a write started between the
submission and ``begin`` would run beside the read) until the call returns, not only while a request
is in flight: between a completion and the claims it brings the tier's in-flight count drops to zero
for an instant, and a write slipped in there would sit in the device queue ahead of the next read. Orphans (staged reads still in flight after their call
returned) do not hold writes back: nobody waits for them, and they are reaped only by the next
``get``, so counting them would idle the tier's writes between calls, the window writes exist for.
Nor does a read that stalled: a tier whose reads made no progress for :data:`STALL_S` lets its
writes go (holding them protects no read, and a hung read with ``read_timeout=0`` would otherwise
hold them forever).

The read path calls :meth:`begin`/:meth:`end` under its own lock, the write path calls
:meth:`held`/:meth:`epoch` under its own; this object's lock is a leaf (nothing is called while it
is held), and :meth:`end` runs the listeners after releasing it: the write path's wake-up takes
only its queue lock, which is never held across I/O, so a get never waits for a write.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from .index import tiers_in
from .locks import ranked_lock

STALL_S = 1.0  # reads of a tier that made no progress for this long no longer hold its writes, s


class ReadPriority:
    """Per tier: the ``get`` calls reading from it now, and an epoch bumped each time reads start.

    :param n_tiers: number of tiers.
    :param enabled: False (setting ``read_priority=off``): :meth:`held` is always 0 and writes go out
        whatever reads are in flight (the behaviour before read priority); reads are still tracked.
    """

    def __init__(self, n_tiers: int, enabled: bool = True, clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self.clock = clock
        self._lock = ranked_lock("priority")
        self._reading = [0] * n_tiers
        self._epoch = [0] * n_tiers
        self._progress = [0.0] * n_tiers  # when tier k's reads last started or completed one
        self._listeners: list[Callable[[], None]] = []

    # -- the read path ---------------------------------------------------------------------------
    def begin(self, mask: int) -> None:
        """A ``get`` starts reading from the tiers in ``mask``."""
        now = self.clock()
        with self._lock:
            for k in tiers_in(mask):
                if not self._reading[k]:
                    self._epoch[k] += 1
                self._reading[k] += 1
                self._progress[k] = now

    def progress(self, k: int) -> None:
        """A read of tier ``k`` completed (the tier is serving its reads)."""
        self._progress[k] = self.clock()

    def end(self, mask: int) -> None:
        """That ``get`` returns: its tiers are released; a tier left with no reader wakes the listeners."""
        freed = False
        with self._lock:
            for k in tiers_in(mask):
                self._reading[k] -= 1
                freed |= not self._reading[k]
        if freed:
            for listener in self._listeners:
                listener()

    # -- the write path --------------------------------------------------------------------------
    def held(self) -> tuple[int, float | None]:
        """(tiers whose writes wait now, as a bitmask; seconds until one of them stops waiting if no
        read ends or progresses meanwhile, None if none waits). Nothing waits with read priority off."""
        if not self.enabled:
            return 0, None
        now = self.clock()
        mask, until = 0, None
        with self._lock:
            for k, n in enumerate(self._reading):
                left = self._progress[k] + STALL_S - now
                if n and left > 0:
                    mask |= 1 << k
                    until = left if until is None else min(until, left)
        return mask, until

    def epoch(self, k: int) -> int:
        """Bumped each time reads start on tier ``k``: a write that completes in the epoch it was
        submitted in, with no read since, measured the tier's write bandwidth undisturbed."""
        return self._epoch[k]

    def idle_for(self, k: int) -> float:
        """Seconds since tier ``k``'s reads last started or completed one (the writer's clock counts
        that as its progress while writes wait there: Engine.stalled)."""
        return self.clock() - self._progress[k]

    def reading(self, k: int) -> bool:
        return bool(self._reading[k])

    def listen(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (with no lock of this object held) whenever a tier's last reader ends."""
        self._listeners.append(callback)

