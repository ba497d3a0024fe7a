"""The state of one get() on the read path: its plan (pages and blocks from the index entries), its
requests in flight, what arrived, which missed pages get a second call, and the figures a finished
get records (stats.py). Used under the read path's lock (reads.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from .files import ReadFile
from .flow import HELD, MAX_REQUEST, MIN_REQUESTS, RULE_NAMES, TierFlow
from .index import Index, PageInfo
from .io import MAX_VECTOR, PageMap
from .layout import ALIGN, is_valid_key
from .memory import CallerMemory
from .segments import Segment
from .stats import Stats, batch_figures

log = logging.getLogger("kvstream")


# Least a staged call of one holder keeps in flight on its tier (it keeps half the tier's budget, at
# least this): two of the largest requests, one in service and one queued behind it, so the device
# never waits for us (GetCall.queue_bytes).
STAGED_DEPTH = MIN_REQUESTS * MAX_REQUEST


class ReadPage:
    """One requested page: its index entry, where its payload goes, whether it can be read in place."""

    __slots__ = ("key", "info", "map", "in_place", "single")

    def __init__(self, key: str, info: PageInfo, segments: Sequence[Segment], holders: int, memory: CallerMemory):
        self.key, self.info = key, info
        self.map = PageMap(segments, info.length, info.block, info.crcs)
        # O_DIRECT can target the caller's memory as it is, and does better there than through
        # staging: huge pages, or memory registered with the ring (memory.py)
        self.in_place = info.length % ALIGN == 0 and len(segments) <= MAX_VECTOR and memory.takes(segments)
        self.single = holders & (holders - 1) == 0  # one usable holder: nobody can race for it


class Req:
    """One read in flight: blocks ``j0 .. j1-1`` of one page from one tier."""

    __slots__ = ("call", "tier", "p", "j0", "j1", "items", "bufs", "file", "nbytes", "t0", "ahead", "orphan")

    def __init__(self, call: "GetCall", tier: int, p: int, j0: int, j1: int, items: list[int], bufs,
                 file: ReadFile, nbytes: int):
        self.call, self.tier, self.p, self.j0, self.j1, self.items = call, tier, p, j0, j1, items
        self.bufs = bufs  # staging buffers, one per block; None: straight into caller memory
        self.file, self.nbytes = file, nbytes  # (t0, ahead, orphan: set by InFlight.add)


class GetCall:
    """State of one get(): pages, items (page, block), files, first arrivals."""

    def __init__(self, n_tiers: int, deadline: float | None = None):
        self.pages: list[ReadPage] = []
        self.page_of: list[int] = []  # request position of each entry of ``pages``
        self.dups: list[tuple[int, int]] = []  # (request position, entry of ``pages``) of a key asked for again
        self.page_tiers: list[int] = []  # per page, tiers that served >= 1 of its blocks (mask)
        self.items: list[tuple[int, int]] = []  # (index into pages, block)
        self.holders: list[int] = []
        self.files: dict[tuple[int, int], ReadFile] = {}
        self.bad: set[tuple[int, int]] = set()  # (tier, page) found damaged this call
        self.failed: list[tuple[int, int]] = []  # (tier, item) reads that failed
        self.route = None
        self.arrived = bytearray()
        self.active = True
        self.in_flight = 0  # requests
        self.deadline = deadline  # (monotonic) when the get's read_timeout ends; None: no limit
        self.timed_out = False  # read_timeout passed with reads in flight
        self.direct_in_flight = 0  # requests into caller memory (the call cannot return before them)
        self.read = [0] * n_tiers  # bytes transferred per tier
        self.served = [0] * n_tiers  # first-arrival bytes per tier
        self.requests = 0
        self.direct = [0] * n_tiers  # per tier, of ``served``: read straight into caller memory (no copy)
        self.relook: set[str] = set()  # keys whose indexed copies were gone or another writer's version
        self.reading = 0  # tiers this call has submitted reads to: writes there wait until it returns
        self.single = False  # every page has one usable holder (plan)
        self.nbytes = 0  # the bytes of its pages (plan)
        self.rule: int | None = None  # routed: what its slower tiers keep in flight (flow.SlowerTiers)
        self.fastest: int | None = None  # ... the tier a call that holds them keeps open (fastest_holder)
        self.in_place = False  # ... and every page can be read into caller memory (plan)

    def plan(self, keys, pages, infos: list[PageInfo | None], mask: int, stats: Stats, memory: CallerMemory) -> None:
        """The call's pages and items (page, block): each key the index holds on a usable tier whose
        size matches the caller's buffer (``infos``: the pinned index entries)."""
        if len(pages) != len(keys):
            raise ValueError(f"get: {len(keys)} keys but {len(pages)} pages")
        first: dict[str, int] = {}
        for i, (key, info) in enumerate(zip(keys, infos)):
            if info is None:
                if not is_valid_key(key):
                    stats.total("invalid_keys")
                continue
            segments = pages[i]
            nbytes = sum(n for _, n in segments)
            if nbytes != info.length:  # (another deployment's version, e.g. another KV dtype: a copy of the
                stats.total("size_mismatch")  # caller's size may be on another tier, looked for after the call)
                log.warning("kvstream: page %s holds %d bytes but the caller's buffer has %d; looking for a copy "
                            "of the caller's size", key, info.length, nbytes)
                self.relook.add(key)
                continue
            holders = info.tiers & mask
            if not holders:
                continue
            if key in first:  # asked for again: read once, and copied once verified (the two buffers may be
                self.dups.append((i, first[key]))  # one: a second read failing its check would land on the first)
                continue
            p = first[key] = len(self.pages)
            self.pages.append(ReadPage(key, info, segments, holders, memory))
            self.page_of.append(i)
            for j in range(len(info.crcs)):
                self.items.append((p, j))
                self.holders.append(holders)
        self.arrived = bytearray(len(self.items))
        self.page_tiers = [0] * len(self.pages)
        self.single = all(page.single for page in self.pages)  # one usable holder for every page
        self.nbytes = sum(page.info.length for page in self.pages)  # (its size class: flow.SlowerTiers)
        self.in_place = self.single and all(page.in_place for page in self.pages)  # no staging at all

    def left(self) -> float | None:
        """Seconds left of the get's read_timeout (None: no limit)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def item_bytes(self) -> int:
        """Most bytes one item of this call carries (a block, or a page smaller than one): windows and
        depths are bytes, and this counts them in items. (Counted in 1 MiB blocks, a 2 MiB window of
        256 KiB pages held 512 KiB: docs/benchmarks.md, "Two tiers against one".)"""
        return max(min(page.info.block, page.info.length) for page in self.pages)

    def queue_bytes(self, flow: TierFlow) -> int:
        """Bytes a tier keeps in flight for this call (before what earlier calls still hold there).

        A call that another tier could also serve keeps the flow's window, near the point where
        latency starts to climb, so that little is left for another tier to wait on when a batch
        ends. A call whose every page one tier alone holds has no other tier to take over, and
        queues deeper (a device that serves a deeper queue faster gains): read in place, the tier's
        whole budget, as nixl keeps a whole batch; staged, half of it and at least STAGED_DEPTH, so
        that a staged block is copied out and checked while still in the CPU's cache (the figures:
        docs/benchmarks.md, "A staged single holder keeps half its budget in flight")."""
        if not self.single:
            return flow.window
        if self.in_place:
            return flow.ceiling
        return min(flow.ceiling, max(STAGED_DEPTH, flow.ceiling // MIN_REQUESTS))

    def fastest_holder(self, flows: Sequence[TierFlow]) -> int | None:
        """The tier a routed call whose slower tiers are held (flow.SlowerTiers) keeps open: the fastest
        (by its flow's rate) of the tiers this call can read, where it holds every page of the call;
        None where it does not. (The fastest of all tiers may be failed, or hold none of these pages:
        every tier that could read them was held to one item. And a page only a slower tier holds has
        no other reader: held, a small fast tier at its capacity beside a large slow one had every page
        it lacked read one item at a time.)"""
        holders = set(self.holders)
        tiers = 0
        for h in holders:
            tiers |= h
        fastest = max((k for k in range(len(flows)) if tiers >> k & 1), key=lambda k: flows[k].rate)
        return fastest if all(h >> fastest & 1 for h in holders) else None

    def pages_done(self) -> list[bool]:
        """Per page, whether every block arrived."""
        done = [True] * len(self.pages)
        for (p, _j), arrived in zip(self.items, self.arrived):
            if not arrived:
                done[p] = False
        return done

    def second_chance(self, keys: Sequence[str], pages, found: list[bool], mask: int, index: Index,
                      recover: Callable[[list[str], dict[str, int], int], int]) -> tuple[list[int], int]:
        """Pages this call missed that the engine's ``recover`` can give a new holder: a failed tier
        that holds them and answers a probe now (maybe the only copy left), or a copy on disk of the
        caller's size the index did not list (another writer's version, or a copy elsewhere). (positions
        to read again, the tiers usable now)"""
        missed = [i for i, ok in enumerate(found) if not ok]
        failed_holders = 0
        for i in missed:
            info = index.get(keys[i])
            if info is not None:
                failed_holders |= info.tiers & ~mask
        if not missed or not (failed_holders or self.relook):
            return [], mask
        sizes = {keys[i]: sum(n for _, n in pages[i]) for i in missed if keys[i] in self.relook}
        now = recover([keys[i] for i in missed], sizes, mask)
        rejoined = now & ~mask
        retry = []
        for i in missed:
            info = index.get(keys[i])
            if info is None or not info.tiers & now or info.length != sizes.get(keys[i], info.length):
                continue  # (still of another size than the caller's: read again, it would miss again)
            if info.tiers & rejoined or keys[i] in sizes:
                retry.append(i)
        return retry, now



def record_get(stats: Stats, calls: list[GetCall], n_keys: int, n_found: int, elapsed: float, busy: list[float],
               policy, flows) -> None:
    """Count a finished get (its call and, if any, its second chance) and record its batch figures."""
    n_tiers = len(busy)
    read = [sum(c.read[k] for c in calls) for k in range(n_tiers)]
    served_by = [sum(c.served[k] for c in calls) for k in range(n_tiers)]
    in_place = [sum(c.direct[k] for c in calls) for k in range(n_tiers)]
    served = sum(served_by)
    for k in range(n_tiers):
        if read[k]:
            stats.add(k, "bytes_read", read[k])
        if served_by[k]:
            stats.add(k, "bytes_served", served_by[k])
        if in_place[k]:
            stats.add(k, "bytes_in_place", in_place[k])
        stats.add(k, "read_busy_s", busy[k])
    stats.total("gets")
    stats.total("pages_requested", n_keys)
    stats.total("pages_found", n_found)
    stats.total("pages_missing", n_keys - n_found)
    if any(c.timed_out for c in calls):  # (one get, one timeout: its second chance reads within it)
        stats.total("read_timeouts")
    for c in calls:  # (flow.SlowerTiers: which rule the calls that decide one took)
        if c.rule is not None:
            stats.total("routed_calls")
            stats.total("held_calls", c.rule == HELD)
    batch = batch_figures(elapsed, served, read, busy, served_by)
    batch.update(pages=n_keys, found=n_found, items=sum(len(c.items) for c in calls),
                 requests=sum(c.requests for c in calls), direct_bytes=sum(in_place),
                 policy=getattr(policy, "name", str(policy)),
                 duplicates=sum(getattr(c.route, "duplicates", 0) for c in calls),
                 retries=sum(getattr(c.route, "retries", 0) for c in calls),
                 duplicate_bytes=sum(read) - served if served else 0, second_chance=len(calls) - 1,
                 windows=[f.window for f in flows], rule=None if calls[0].rule is None else RULE_NAMES[calls[0].rule])
    stats.record_batch(batch)
