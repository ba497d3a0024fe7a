"""How much each tier keeps in flight: enough to reach its bandwidth, and no more.

A throttled tier reaches its limit with one request in flight; an NVMe drive or a parallel file
system needs many megabytes in flight before it does. A fixed depth is wrong for one of them, so
each tier has a :class:`TierFlow` that follows its device from what its own reads show:

* **Request size** follows the tier's throughput: about :data:`REQUEST_TIME_S` of its bandwidth,
  in whole blocks, between :data:`MIN_REQUEST` (or one block) and :data:`MAX_REQUEST`. A fast tier gets few large requests
  (little CPU per byte); a slow one keeps small requests, so what it has in flight when a batch
  ends (and the fast tier takes over) stays small. (Blocks no other tier can deliver have no such
  tail: the read path sends them in requests up to MAX_REQUEST whatever this size, reads.py.)
* **Window** (bytes in flight) follows the latency, as TCP Vegas does: while a request's latency
  per byte stays close to the device's unloaded latency (that of requests sent to it while it was
  idle, as the first of every batch is), the device is not queueing yet and the window grows by a
  request; once it climbs well above it, requests are only waiting in a queue and the window
  shrinks by an eighth. (The unloaded latency is never taken from a loaded device: a queue that
  stands long enough would otherwise pass for it, and the window would ratchet up.) It never falls below :data:`MIN_REQUESTS` requests (one in service, one
  queued behind it, so the device never waits for us), nor rises above ``ceiling``.
* **Stalls**: a tier with reads in flight and no completion for :data:`STALL_FACTOR` times its
  usual latency (at least :data:`STALL_MIN_S`) is *overdue*; the read path then lets other tiers
  re-read its items.
* **Tiers that are not independent** (two that share the CPUs that move their bytes): whether a
  routed call holds every tier but the fastest to one item in flight is decided by the calls' own
  rates under each rule (:class:`SlowerTiers`).

Pure: no I/O, no clock (callers pass ``now``), no threads; the read path calls it under its lock,
and the write path keeps one per tier for its writes (writes.py) under its own.
"""
from __future__ import annotations

from collections import deque

REQUEST_TIME_S = 0.001  # a request carries about this much of the tier's bandwidth, s
MAX_REQUEST = 8 << 20  # largest request, bytes: beyond this the device splits it anyway
MIN_REQUEST = 1 << 20  # smallest request a tier is sized down to (rounded to whole blocks), bytes: below
                       # it every device pays per request more than it saves in tail
MIN_REQUESTS = 2  # smallest window, in requests
GROW_BELOW = 1.5  # latency per byte over the recent lowest: grow the window while below this
SHRINK_ABOVE = 2.5  # ... and shrink it while above this
BASE_SAMPLES = 16  # unloaded latency: the lowest of the last this many requests that found the tier idle
SMOOTH = 0.125  # weight of a new sample in the moving averages of throughput and latency
RATE_SPAN_S = 0.02  # throughput is measured over at least this much busy time (completions come in bursts), s
STALL_FACTOR = 8.0  # no completion for this many usual latencies: the tier is overdue
STALL_MIN_S = 0.25  # ... and never sooner than this, s: a throttled device (cgroup blkio) holds its completions
                    # for a throttle slice (100 ms) at a time, and a busy host adds scheduling noise
INITIAL_WINDOW = 4 << 20  # before the first measurement (the fixed depth of earlier versions), bytes
STEAL_FASTER = 2.0  # an idle tier re-reads items in flight on a tier it is measured this many times as fast as,
STEAL_QUIET = 2.0  # ... or on one that has completed nothing for this many of the idle tier's request latencies


def outpaces(rate: float, owner_rate: float) -> bool:
    """Whether a tier measured at ``rate`` (bytes/s; 0: not measured yet) re-reads items in flight on one
    measured at ``owner_rate`` (the router's tail steal) for their speed alone. A re-read pays only if it
    lands first, and the owner's reads are under way: a rate measured over a few spans (a burst let through
    by a throttle, a queue) does not tell a tier about as fast, which would read the bytes twice for nothing
    (small gets on two such tiers read 1.5-1.9x their bytes); an unmeasured tier outpaces nothing and is
    outpaced by nothing. A slow owner not measured yet is taken over when it falls quiet (``quiet_for``)."""
    return owner_rate > 0 and rate >= STEAL_FASTER * owner_rate


class TierFlow:
    """Request size, window and health of one tier's reads (see the module docstring).

    :param block: the routing block, bytes: requests and windows are whole blocks.
    :param ceiling: most bytes in flight (the read path's memory budget for this tier).
    """

    def __init__(self, block: int, ceiling: int):
        self.block = block
        self.ceiling = max(ceiling, MIN_REQUESTS * block)
        self.window = min(max(INITIAL_WINDOW, MIN_REQUESTS * block), self.ceiling)
        self.rate = 0.0  # bytes/s while busy, moving average (0: not measured yet)
        self.latency = 0.0  # request latency, moving average, s
        self._alone: deque[float] = deque(maxlen=BASE_SAMPLES)  # latency per byte of requests sent to an idle tier
        self._last_done = 0.0  # when the last completion (or the first submit after idling) happened
        self._span_bytes = 0  # bytes completed since the current throughput span began
        self._span_busy = 0.0  # the tier's busy time when it began, s
        self.request = 0  # bytes per request (a multiple of ``block``), kept by _resize
        self._resize()

    # -- what the read path asks ---------------------------------------------------------------
    def _resize(self) -> None:
        """Bytes per request: about REQUEST_TIME_S of the tier's bandwidth, whole blocks, at most
        MAX_REQUEST and half the window."""
        want = max(self.rate * REQUEST_TIME_S, MIN_REQUEST) if self.rate else self.window / MIN_REQUESTS
        blocks = int(min(want, MAX_REQUEST, self.window / MIN_REQUESTS) // self.block)
        self.request = max(1, blocks) * self.block

    def room(self, in_flight: int) -> int:
        """Bytes the tier may add to the ``in_flight`` it has."""
        return max(0, self.window - in_flight)

    def overdue(self, now: float, in_flight: int) -> bool:
        """Reads in flight and no completion for far longer than usual: stalled, or much slower
        than it was."""
        return in_flight > 0 and now - self._last_done > self.stall_after

    @property
    def stall_after(self) -> float:
        return max(STALL_MIN_S, STALL_FACTOR * self.latency)

    def overdue_at(self) -> float:
        """When the tier turns overdue if nothing completes meanwhile."""
        return self.quiet_at(self.stall_after)

    def quiet_at(self, seconds: float) -> float:
        """When the tier will have completed nothing for ``seconds`` (its reads in flight waiting)."""
        return self._last_done + seconds

    def disturbed(self, busy: float) -> None:
        """Something else used the device during the current throughput span (for a write flow:
        reads): drop the span, so that the rate measures the tier's own bandwidth."""
        self._span_bytes, self._span_busy = 0, busy

    # -- what the read path tells --------------------------------------------------------------
    def submitted(self, now: float, in_flight_before: int) -> None:
        if not in_flight_before:
            self._last_done = now  # idle until now: the stall clock starts here

    def completed(self, nbytes: int, latency: float, ahead: int, now: float, busy: float) -> None:
        """A request of ``nbytes`` completed ``latency`` s after it was submitted behind ``ahead``
        bytes already in flight on this tier (its own excluded); ``busy``: the tier's busy time so
        far (seconds with at least one read in flight), which throughput is measured against."""
        self._last_done = now
        if nbytes <= 0 or latency <= 0:
            return
        self._span_bytes += nbytes
        if busy - self._span_busy >= RATE_SPAN_S:
            sample = self._span_bytes / (busy - self._span_busy)
            self.rate = sample if not self.rate else self.rate + SMOOTH * (sample - self.rate)
            self._span_bytes, self._span_busy = 0, busy
            self._resize()
        self.latency = latency if not self.latency else self.latency + SMOOTH * (latency - self.latency)
        per_byte = latency / nbytes
        if not ahead:  # the tier was idle: this is what a request costs with no queue at all
            self._alone.append(per_byte)
        if not self._alone:
            return  # nothing to compare with yet
        ratio = per_byte / min(self._alone)
        request = self.request
        if ratio < GROW_BELOW and ahead + nbytes >= self.window - request:
            self.window = min(self.ceiling, self.window + request)  # the window limited this tier
        elif ratio > SHRINK_ABOVE:  # a queue: drain it quickly, an eighth per completion
            self.window = max(MIN_REQUESTS * request, self.window - max(request, self.window // 8 // self.block
                                                                           * self.block))
        self._resize()

    def __repr__(self) -> str:
        return (f"TierFlow(window={self.window >> 10} KiB, request={self.request >> 10} KiB, "
                f"rate={self.rate / 1e6:.0f} MB/s, latency={self.latency * 1e3:.2f} ms)")


EXPLORE_EVERY = 32  # one routed call in this many reads by the rule the recent calls found slower, and the
# next one too (its rate counts: SlowerTiers), so 1 in 16 reads so (dfs 1 MiB: 2 in 16 read 1.11x one tier, held 1.22x)
CALL_SMOOTH = 0.25  # weight of a call's rate in each rule's moving average
OPEN, HELD = RULES = range(2)  # what a routed call's slower tiers keep in flight: their windows, or one item
RULE_NAMES = ("open", "held")  # (SlowerTiers)


class SlowerTiers:
    """How much a call that several tiers can serve lets every tier but the fastest read: its window
    (OPEN), or one item in flight (HELD) while the fastest is healthy and not overdue.

    The tiers of a ring are meant to be independent devices, each read at its own speed; but two tiers
    may share what moves their bytes: the CPUs (a FUSE client's daemons, a RAM tier's loop device, a
    network file system's client copy every byte on the cores the reader runs on), a disk, a link. Then
    a slower tier's reads cost the faster one more than they add: GlusterFS through FUSE beside this
    machine's disk, on two cores, read 0.42-0.74x the disk alone at 256 KiB pages (four runs); with
    the slower tier held to one item in flight, 0.63-1.15x. (Left out altogether, a third rule tried in
    stop 46, it read no more than held anywhere measured: its pages are staged all the same, and the
    fastest tier's stale rate chose which tier read alone.) On devices of their own a slower tier that
    needs a deep queue to reach its bandwidth (a parallel file system far away) reads far less so held,
    and no latency tells the two cases apart reliably (tier 0's latency rises under either its own
    queue, another tenant, or the other tier's CPU). So the calls decide, as the router does, with
    nothing to set: routed calls of each size (within 2x) take the two rules in turn until each has a
    rate, then the faster (a moving average of bytes per second over calls of each), and one call in
    EXPLORE_EVERY the other, and the next one too (the first is not counted: below), so that a change (a
    tier that speeds up, the machine's load, the page size) is seen. Pure: the read path calls it under
    its lock, passing each call's bytes and seconds."""

    def __init__(self) -> None:
        # Per size class of call (the bit length of its bytes): a call costs some time besides its bytes
        # (the lock, its plan, its last completions), so a small call reads fewer bytes a second under
        # either rule; compared across sizes, the calls of two sizes in turn had one rule measured on the
        # small ones alone (452 calls in 480 open where held read 1.7x faster at every size).
        self.rates: dict[int, list[float]] = {}  # per class, routed calls' bytes/s (moving average): open, held
        self._calls: dict[int, int] = {}
        # A call's reads run on past its end (re-read items, its last completions: a FUSE tier's daemons
        # still busy with them; a throttled device's debt), so the call after one of the other rule reads at
        # a rate that is partly that one's: after calls left open, a held exploration read 0.3x a held call
        # after held ones (GlusterFS beside the disk, 256 KiB), and the calls kept the slower rule. Such a
        # call is not counted; the next call of its size takes its rule again, and counts (calls of two
        # sizes in turn, each after the other's, would never count otherwise).
        self._last: int | None = None  # the rule of the last routed call that ended
        self._again: dict[int, int] = {}  # per class, a rule whose call was not counted: taken again, until
        # a call of the class ends (that one counts)

    def rule(self, nbytes: int) -> int:
        """The rule for the next routed call, of ``nbytes``: OPEN or HELD."""
        size = nbytes.bit_length()
        calls = self._calls[size] = self._calls.get(size, 0) + 1
        rates = self.rates.setdefault(size, [0.0] * len(RULES))
        if size in self._again:
            return self._again[size]
        if not all(rates):
            return rates.index(0.0)  # (each rule in turn, open first)
        best = max(RULES, key=rates.__getitem__)
        return best if calls % EXPLORE_EVERY else 1 - best

    def done(self, rule: int, planned: int, nbytes: int, seconds: float) -> None:
        """A routed call of ``planned`` bytes (as given to :meth:`rule`) read ``nbytes`` in ``seconds``
        under ``rule``."""
        size = planned.bit_length()
        rates = self.rates.setdefault(size, [0.0] * len(RULES))
        last, self._last = self._last, rule
        if self._again.pop(size, None) is None and last is not None and last != rule:
            self._again[size] = rule
            return
        if nbytes > 0 and seconds > 0:
            rate, prev = nbytes / seconds, rates[rule]
            rates[rule] = rate if not prev else prev + CALL_SMOOTH * (rate - prev)
