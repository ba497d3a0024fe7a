"""The read path: one batch, one pool of blocks, routed over the tiers by completions.

Data flow of ``get`` (one call at a time per read ring)::

    reap orphans of earlier calls (non-blocking)
    pin the pages in the index; items = every block of every page held by a usable tier
    route = policy.start(n_tiers, holders)                 (router.py, pure)
    loop: claims -> requests: each tier's claimed blocks of one page, adjacent ones merged into one
          read (up to its flow's request size), into staging buffers or straight into caller memory
          -> submit -> reap -> verify each block's crc32c against the index (staged blocks are
          copied into the caller's segments in the same pass) -> route.complete(tier, item, ok)
          -> each tier's window follows its device (flow.py) -> next claims
    until every item is found or failed (or read_timeout passes)
    unpin; staged reads still in flight become *orphans*: they keep their staging buffers and file
    descriptor until a later call (or close) reaps them, and never touch caller memory again.
    second chance (once): pages missed while a failed tier holds them, or whose indexed copies were
    gone or another writer's version, go to the engine's ``recover`` (probe those tiers now, look the
    pages up on disk) and are read again if that gave them a holder they did not have

Where a read lands. Into an engine-owned staging buffer, copied into the caller's segments on its
first verified arrival (checksum and copy in one pass), or straight into the caller's pages: only a
block that one usable tier alone holds (nobody can race for it), and only where the memory suits
O_DIRECT (4096-aligned and huge-page backed, memory.py). The call waits for reads in place however
long the device takes (returning earlier would let them land in memory the caller reuses); with no
other holder there is nobody to take over anyway. Every block another tier could deliver is staged,
so a stalled tier never holds a call: its reads land in staging after the call returned.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence

from .errors import EngineClosedError
from .flow import TierFlow
from .index import Index, PageInfo
from .integrity import UNREADABLE, VANISHED, NotRegularFile, crc32c, open_regular, scan_file
from .io import MAX_VECTOR, OP_READ, PageMap
from .layout import ALIGN, HEADER_SIZE, block_span, is_aligned, is_valid_key, round_up
from .memory import HugePageMap
from .priority import ReadPriority
from .segments import Segment
from .staging import BufferPool
from .stats import BusyClock, Stats, batch_figures
from .tiers import Tier

log = logging.getLogger("kvstream")

MAX_OPEN_FILES = 256  # read descriptors the read path keeps open at once before it closes idle ones: a
# get of 10,000 pages on two tiers must not hold 20,000 (a page's file is reopened if needed again)


class _File:
    """A read descriptor shared by the requests of one (tier, page) in one call. Closed when the
    call ends, or earlier when idle while the read path holds more than MAX_OPEN_FILES (a batch of
    any size holds a bounded number of descriptors); an idle one closed early is opened again if
    another request of the page comes."""

    __slots__ = ("fd", "refs", "release", "failed")

    def __init__(self):
        self.fd: int | None = None
        self.refs = 0  # requests in flight on it
        self.release = False  # the call ended: close when the last request is reaped
        self.failed = False  # the open failed: this (tier, page) is not read in this call


class _Page:
    """One requested page: its index entry, where its payload goes, whether it can be read in place."""

    __slots__ = ("key", "info", "map", "in_place", "single")

    def __init__(self, key: str, info: PageInfo, segments: Sequence[Segment], holders: int, huge: HugePageMap):
        self.key, self.info = key, info
        self.map = PageMap(segments, info.length, info.block, info.crcs)
        # O_DIRECT can target the caller's memory as it is, and does better there than through
        # staging: huge pages (memory.py)
        self.in_place = info.length % ALIGN == 0 and len(segments) <= MAX_VECTOR and \
            all(is_aligned(a, n) and huge.huge(a, n) for a, n in segments)
        self.single = holders & (holders - 1) == 0  # one usable holder: nobody can race for it


class _Req:
    """One read in flight: blocks ``j0 .. j1-1`` of one page from one tier."""

    __slots__ = ("call", "tier", "p", "j0", "j1", "items", "bufs", "file", "nbytes", "t0", "ahead")

    def __init__(self, call: "_Call", tier: int, p: int, j0: int, j1: int, items: list[int], bufs, file: _File,
                 nbytes: int):
        self.call, self.tier, self.p, self.j0, self.j1, self.items = call, tier, p, j0, j1, items
        self.bufs = bufs  # staging buffers, one per block; None: straight into caller memory
        self.file, self.nbytes = file, nbytes
        self.t0 = 0.0
        self.ahead = 0  # bytes in flight on the tier when this was submitted


class _Call:
    """State of one get(): pages, items (page, block), files, first arrivals."""

    def __init__(self, n_tiers: int):
        self.pages: list[_Page] = []
        self.page_of: list[int] = []  # request position of each entry of ``pages``
        self.page_tiers: list[int] = []  # per page, tiers that served >= 1 of its blocks (mask)
        self.items: list[tuple[int, int]] = []  # (index into pages, block)
        self.holders: list[int] = []
        self.files: dict[tuple[int, int], _File] = {}
        self.bad: set[tuple[int, int]] = set()  # (tier, page) found damaged this call
        self.failed: list[tuple[int, int]] = []  # (tier, item) reads that failed
        self.route = None
        self.arrived = bytearray()
        self.active = True
        self.in_flight = 0  # requests
        self.direct_in_flight = 0  # requests into caller memory (the call cannot return before them)
        self.read = [0] * n_tiers  # bytes transferred per tier
        self.served = [0] * n_tiers  # first-arrival bytes per tier
        self.requests = 0
        self.direct_bytes = 0  # bytes read straight into caller memory (no staging copy)
        self.relook: set[str] = set()  # keys whose indexed copies were gone or another writer's version
        self.reading = 0  # tiers this call has submitted reads to: writes there wait until it returns


class ReadPath:
    """Owns the read ring, its staging pool, each tier's flow and the reads in flight (orphans
    included).

    :param pool: staging buffers (its ``max_bytes`` bounds what the read path holds, in flight and idle).
    :param block: the routing block, bytes.
    :param ceiling: most bytes one tier may keep in flight (the pool's share per tier).
    :param priority: told which tiers each call reads from (writes there wait: priority.py).
    """

    def __init__(self, ring, tiers: list[Tier], index: Index, stats: Stats, pool: BufferPool, block: int,
                 read_timeout: float, ceiling: int, digest: str, priority: ReadPriority):
        self.ring = ring
        self.digest = digest
        self.priority = priority
        self.closed = False
        self.tiers = tiers
        self.index = index
        self.stats = stats
        self.pool = pool
        self.read_timeout = read_timeout
        self.lock = threading.Lock()
        self.busy = BusyClock(len(tiers))
        self.flows = [TierFlow(block, ceiling) for _ in tiers]
        self.huge = HugePageMap()
        self._in_flight = [0] * len(tiers)  # bytes in flight per tier (orphans included)
        self._orphaned = [0] * len(tiers)  # of which orphans
        self._reqs: dict[int, _Req] = {}  # tag -> request, for every read in flight on the ring
        self._orphans = 0  # requests in _reqs whose call has returned
        self._open_files = 0  # read descriptors open (every call's, orphans' included)
        self.open_files_peak = 0
        self._tags = itertools.count(1)

    @property
    def orphans(self) -> int:
        """Reads of finished calls still in flight (engine-owned buffers)."""
        return self._orphans

    def after_get(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], found: list[bool]) -> None:
        """Hook set by the engine (replication.py), called before a get returns: ``pages`` hold the
        caller's verified copies of the pages ``found``; a page that lacks a tier is owed to it."""

    def recover(self, missed: list[str], relook: set[str], mask: int) -> int:
        """Hook set by the engine: a call missed ``missed`` (``relook``: keys whose indexed copies were
        gone or another writer's version). Probe failed tiers that hold them, index what the tiers
        hold of ``relook``; returns the tiers usable now."""
        return mask

    # -- get -----------------------------------------------------------------------------------
    def get(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], policy, mask: int) -> list[bool]:
        """See Engine.get. ``mask``: tiers usable for this batch."""
        n_tiers = len(self.tiers)
        found = [False] * len(keys)
        t0 = time.perf_counter()
        with self.lock:
            if self.closed:  # close() ran while this call waited for the lock
                raise EngineClosedError("kvstream engine is closed")
            self._reap_locked(0, 0)
            busy0 = self.busy.snapshot()
            calls = [self._call_locked(keys, pages, policy, mask, list(range(len(keys))), found)]
            retry, mask = self._second_chance_locked(calls[0], keys, found, mask)
            if retry:
                calls.append(self._call_locked([keys[i] for i in retry], [pages[i] for i in retry], policy, mask,
                                               retry, found))
            busy = [b - a for a, b in zip(busy0, self.busy.snapshot())]
        elapsed = time.perf_counter() - t0
        for p, ok in enumerate(found):
            if ok:
                self.index.touch(keys[p])
        self.after_get(keys, pages, found)
        read = [sum(c.read[k] for c in calls) for k in range(n_tiers)]
        served_by = [sum(c.served[k] for c in calls) for k in range(n_tiers)]
        served = sum(served_by)
        n_found = sum(found)
        for k in range(n_tiers):
            if read[k]:
                self.stats.add(k, "bytes_read", read[k])
            if served_by[k]:
                self.stats.add(k, "bytes_served", served_by[k])
            self.stats.add(k, "read_busy_s", busy[k])
        self.stats.total("gets")
        self.stats.total("pages_requested", len(keys))
        self.stats.total("pages_found", n_found)
        self.stats.total("pages_missing", len(keys) - n_found)
        batch = batch_figures(elapsed, served, read, busy, served_by)
        batch.update(pages=len(keys), found=n_found, items=sum(len(c.items) for c in calls),
                     requests=sum(c.requests for c in calls), direct_bytes=sum(c.direct_bytes for c in calls),
                     policy=getattr(policy, "name", str(policy)),
                     duplicates=sum(getattr(c.route, "duplicates", 0) for c in calls),
                     retries=sum(getattr(c.route, "retries", 0) for c in calls),
                     duplicate_bytes=sum(read) - served if served else 0, second_chance=len(calls) - 1,
                     windows=[f.window for f in self.flows])
        self.stats.record_batch(batch)
        return found

    def _call_locked(self, keys: Sequence[str], pages, policy, mask: int, pos: list[int], found: list[bool]) -> _Call:
        """One routed pass over ``keys``; marks ``found[pos[i]]`` for each key read whole."""
        infos = self.index.pin(keys)
        call = _Call(len(self.tiers))
        try:
            self._plan_locked(call, keys, pages, infos, mask)
            if call.items:
                self._run_locked(call, policy, mask)
            for p, ok in enumerate(self._pages_done(call)):
                if ok:
                    found[pos[call.page_of[p]]] = True
        finally:
            self.index.unpin(infos)
            if call.direct_in_flight:  # an error cut the call short: reads into caller memory land first
                self._settle_direct_locked(call)
            self._end_call_locked(call)
            if call.reading:
                self.priority.end(call.reading)  # writes to its tiers may go now (priority.py)
        return call

    def _second_chance_locked(self, call: _Call, keys: Sequence[str], found: list[bool],
                              mask: int) -> tuple[list[int], int]:
        """Pages the call missed that the engine's ``recover`` can give a new holder: a failed tier that
        holds them and answers a probe now (it may be the only copy left: the other tiers' copies were
        damaged, or never there), or a copy on disk the index did not list (another writer's version
        in place of the indexed one, or a copy elsewhere when the indexed ones vanished). (positions,
        new mask)"""
        missed = [i for i, ok in enumerate(found) if not ok]
        failed_holders = 0
        for i in missed:
            info = self.index.get(keys[i])
            if info is not None:
                failed_holders |= info.tiers & ~mask
        if not missed or not (failed_holders or call.relook):
            return [], mask
        now = self.recover([keys[i] for i in missed], call.relook, mask)
        rejoined = now & ~mask
        retry = []
        for i in missed:
            info = self.index.get(keys[i])
            if info is not None and info.tiers & now and (info.tiers & rejoined or keys[i] in call.relook):
                retry.append(i)
        return retry, now

    def _plan_locked(self, call: _Call, keys, pages, infos: list[PageInfo | None], mask: int) -> None:
        if len(pages) != len(keys):
            raise ValueError(f"get: {len(keys)} keys but {len(pages)} pages")
        for i, (key, info) in enumerate(zip(keys, infos)):
            if info is None:
                if not is_valid_key(key):
                    self.stats.total("invalid_keys")
                continue
            segments = pages[i]
            nbytes = sum(n for _, n in segments)
            if nbytes != info.length:
                self.stats.total("size_mismatch")
                log.warning("kvstream: page %s holds %d bytes but the caller's buffer has %d; reported missing",
                            key, info.length, nbytes)
                continue
            holders = info.tiers & mask
            if not holders:
                continue
            p = len(call.pages)
            call.pages.append(_Page(key, info, segments, holders, self.huge))
            call.page_of.append(i)
            for j in range(len(info.crcs)):
                call.items.append((p, j))
                call.holders.append(holders)
        call.arrived = bytearray(len(call.items))
        call.page_tiers = [0] * len(call.pages)

    def _run_locked(self, call: _Call, policy, mask: int) -> None:
        route = call.route = policy.start(len(self.tiers), call.holders)
        adaptive = getattr(policy, "depth", None) is None  # a policy that fixes the depth keeps it
        unit = max(page.info.block for page in call.pages)
        if adaptive:  # else the policy's own rule, as written (the paper's fixed m and depth)
            self._set_depths(route, unit)
            route.may_steal = self._may_steal
        deadline = time.monotonic() + self.read_timeout if self.read_timeout > 0 else None
        claims = route.start()
        while True:
            self._submit_locked(call, claims)
            if route.done:
                break
            if not call.in_flight and not self._orphans:
                log.error("kvstream: router stalled with %d unresolved items and nothing in flight; "
                          "reporting them missing", sum(1 for a in call.arrived if not a))
                break
            # (nothing of this call in flight but earlier calls' reads fill the windows: reaping
            # them below makes room)
            now = time.monotonic()
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                self.stats.total("read_timeouts")
                log.warning("kvstream: read batch timed out after %.1f s with %d reads in flight; "
                            "their pages are reported missing", self.read_timeout, call.in_flight)
                break
            wait = self._steal_wait(now)
            if wait is not None:
                left = wait if left is None else min(left, wait)
            claims = []
            for tag, res in self.ring.reap(1, left):
                claims += self._complete_locked(tag, res)
            if adaptive:
                self._set_depths(route, unit)
            claims += route.refill()  # a grown window, or a tier that turned overdue
        # Completions already there (no wait) are taken while the call is active: an error among them
        # fails its tier now, not when a later call reaps it as an orphan; buffers come back sooner.
        for tag, res in self.ring.reap(0, 0):
            self._complete_locked(tag, res)
        if call.direct_in_flight:
            self._wait_direct_locked(call, timed_out=not route.done)

    # -- requests --------------------------------------------------------------------------------
    def _submit_locked(self, call: _Call, claims: list) -> None:
        """Turn claims into requests and submit them; items whose page cannot be opened on the
        claiming tier fail there at once (and may be claimed by another holder)."""
        while claims:
            reqs, failed = self._requests_locked(call, claims)
            claims = []
            for tier, item in failed:
                call.failed.append((tier, item))
                claims += call.route.complete(tier, item, False)
            if reqs:
                self._start_locked(reqs)

    def _requests_locked(self, call: _Call, claims: list) -> tuple[list[_Req], list[tuple[int, int]]]:
        runs: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for tier, items, _steal in claims:
            for item in items:
                p, j = call.items[item]
                runs.setdefault((tier, p), []).append((j, item))
        reqs: list[_Req] = []
        failed: list[tuple[int, int]] = []
        for (tier, p), blocks in runs.items():
            f = self._file_locked(call, tier, p)
            if f is None:
                failed += [(tier, item) for _, item in blocks]
                continue
            blocks.sort()
            page = call.pages[p]
            cap = min(max(1, self.flows[tier].request // page.info.block), MAX_VECTOR)  # (a staged
            # request is one buffer per block, a vectored op)
            start = 0
            for end in range(1, len(blocks) + 1):
                if end < len(blocks) and blocks[end][0] == blocks[end - 1][0] + 1 and end - start < cap:
                    continue
                reqs.append(self._request_locked(call, tier, p, f, blocks[start:end]))
                start = end
        return reqs, failed

    def _request_locked(self, call: _Call, tier: int, p: int, f: _File, blocks: list[tuple[int, int]]) -> _Req:
        page = call.pages[p]
        info = page.info
        j0, j1 = blocks[0][0], blocks[-1][0] + 1
        end = min(j1 * info.block, round_up(info.length))  # the last block's read is padded to ALIGN
        nbytes = end - j0 * info.block
        if page.in_place and page.single:
            bufs = None
        else:
            bufs = [self.pool.get(info.block) for _ in range(j0, j1 - 1)]
            bufs.append(self.pool.get(end - (j1 - 1) * info.block))
        f.refs += 1
        return _Req(call, tier, p, j0, j1, [item for _, item in blocks], bufs, f, nbytes)

    def _file_locked(self, call: _Call, tier: int, p: int) -> _File | None:
        """The call's read descriptor of page ``p`` on ``tier`` (opened on first use, or again if it
        was closed while idle), or None."""
        f = call.files.get((tier, p))
        if f is None:
            f = call.files[(tier, p)] = _File()
        if f.fd is None and not f.failed:
            page = call.pages[p]
            f.failed = True  # until the open below succeeds
            if self.tiers[tier].healthy:  # failed during this batch: its items go to the other holders
                try:
                    try:
                        f.fd = self.tiers[tier].open_page(page.key)
                    except OSError as exc:  # out of descriptors: ours that are idle close, then once more
                        if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._close_idle_locked(call):
                            raise
                        f.fd = self.tiers[tier].open_page(page.key)
                    f.failed = False
                    self._open_files += 1
                    self.open_files_peak = max(self.open_files_peak, self._open_files)
                except NotRegularFile as exc:  # a FIFO, directory, ... under the page's name: a stray
                    self._remove_copy_locked(tier, page.key, f"{exc.strerror} under its name",
                                             remove=exc.errno != errno.EISDIR)
                except OSError as exc:
                    err = exc.errno or errno.EIO
                    if self.tiers[tier].fail(err, f"open {page.key}"):
                        # the whole tier went (unmounted, moved away): its copies may come back with
                        # it, so the index keeps them; rejoining reconciles with what survived
                        self.stats.add(tier, "errors")
                    elif err == errno.ENOENT:  # deleted under us (operator, other rank): forget this copy
                        self.index.remove(page.key, tier)
                        call.relook.add(page.key)
                    else:
                        self.stats.add(tier, "errors")
        return f if f.fd is not None else None

    def _close_idle_locked(self, call: _Call) -> int:
        """Close the call's descriptors no request is using (reopened if needed); how many closed."""
        idle = [f for f in call.files.values() if not f.refs and f.fd is not None]
        for f in idle:
            self._close_file(f)
        return len(idle)

    def _drop_file(self, f: _File) -> None:
        """A request on ``f`` completed: close it once idle if its call ended or too many are open."""
        f.refs -= 1
        if not f.refs and f.fd is not None and (f.release or self._open_files > MAX_OPEN_FILES):
            self._close_file(f)

    def _close_file(self, f: _File) -> None:
        os.close(f.fd)
        f.fd = None
        self._open_files -= 1

    def _start_locked(self, reqs: list[_Req]) -> None:
        ops = []
        tags = []
        for req in reqs:
            page = req.call.pages[req.p]
            if req.bufs is None:
                start = req.j0 * page.info.block
                target = page.map.ranges(start, req.nbytes)
            else:
                target = [(b.address, b.nbytes) for b in req.bufs]
            if len(target) == 1:
                target = target[0]  # one buffer: a plain read
            tag = next(self._tags)
            tags.append(tag)
            ops.append((OP_READ, req.file.fd, target, HEADER_SIZE + req.j0 * page.info.block, tag))
        try:
            self.ring.submit(ops)
        except BaseException:  # nothing was queued (the ring validates a batch first): undo, re-raise
            for req in reqs:
                self._drop_file(req.file)
                for b in req.bufs or ():
                    self.pool.put(b)
            raise
        now = time.monotonic()
        started = 0
        for tag, req in zip(tags, reqs):
            tier = req.tier
            started |= 1 << tier
            self.flows[tier].submitted(now, self._in_flight[tier])
            req.t0 = now
            req.ahead = self._in_flight[tier]
            self._in_flight[tier] += req.nbytes
            self._reqs[tag] = req
            req.call.in_flight += 1
            req.call.requests += 1
            if req.bufs is None:
                req.call.direct_in_flight += 1
            self.busy.started(tier)
        call = reqs[0].call
        if started & ~call.reading:  # a tier's first read of the call (priority.py)
            self.priority.begin(started & ~call.reading)
            call.reading |= started

    # -- completions ---------------------------------------------------------------------------
    def _complete_locked(self, tag: int, res: int, timely: bool = True) -> list:
        """``timely``: reaped while a call waited for completions. Otherwise (orphans reaped when the
        next call starts, or by drain) the completion may be long past: it shows the tier progressed,
        but its latency and the busy time up to now measure the gap between calls, not the device."""
        req = self._reqs.pop(tag)
        call, tier = req.call, req.tier
        now = time.monotonic()
        self._in_flight[tier] -= req.nbytes
        self.busy.finished(tier)
        self.priority.progress(tier)
        flow, busy = self.flows[tier], self.busy.total(tier)
        flow.completed(max(res, 0) if timely else 0, now - req.t0, req.ahead, now, busy)
        if not timely:
            flow.disturbed(busy)
        self._drop_file(req.file)
        call.in_flight -= 1
        if req.bufs is None:
            call.direct_in_flight -= 1
        if res > 0:
            call.read[tier] += res
            if req.bufs is None:
                call.direct_bytes += res
        self.stats.add(tier, "blocks_read", req.j1 - req.j0)
        self.stats.add(tier, "requests")
        if not call.active:  # orphan of an earlier call: its batch is over, only release (an error
            self._orphans -= 1   # still tells about the tier's health)
            self._orphaned[tier] -= req.nbytes
            self.stats.total("orphan_reads")
            if res < 0:
                self._failed_read(tier, call.pages[req.p].key, -res)
            self._release(req)
            return []
        try:
            return self._deliver_locked(req, res)
        finally:
            self._release(req)

    def _release(self, req: _Req) -> None:
        for b in req.bufs or ():
            self.pool.put(b)
        req.bufs = None if req.bufs is None else []

    def _deliver_locked(self, req: _Req, res: int) -> list:
        """Verify (and, from staging, copy in) the blocks that arrived; tell the router."""
        call, tier = req.call, req.tier
        page = call.pages[req.p]
        info = page.info
        if res < 0:
            self._failed_read(tier, page.key, -res)
        # Blocks wholly read (a short read means the file is shorter than its header says).
        if res >= req.nbytes:
            complete = req.j1 - req.j0
        else:
            complete = max(res, 0) // info.block  # every block but a page's last is a whole block
        skip = 0
        for i, item in enumerate(req.items):
            if call.arrived[item]:
                skip |= 1 << i
        bad = 0
        if complete:
            staging = None if req.bufs is None else [b.address for b in req.bufs[:complete]]  # None: in place
            bad = page.map.check(req.j0, req.j0 + complete, staging, skip & ((1 << complete) - 1))
        results = []
        duplicates = 0
        for i, item in enumerate(req.items):
            if skip >> i & 1:
                ok = res >= 0  # a duplicate: the first arrival already won
                duplicates += ok
            elif i < complete and not bad >> i & 1:
                ok = True
                call.arrived[item] = 1
                call.served[tier] += min(info.block, info.length - (req.j0 + i) * info.block)
                call.page_tiers[req.p] |= 1 << tier
            else:
                ok = False
                call.failed.append((tier, item))
                if res >= 0:
                    self.stats.add(tier, "corrupted")
                    if (tier, req.p) not in call.bad:
                        self._quarantine_locked(call, tier, req.p, req.j0 + i,
                                                "checksum" if i < complete else "truncated")
            results.append((item, ok))
        if duplicates:
            self.stats.total("duplicate_reads", duplicates)
        return call.route.complete_many(tier, results)

    def _failed_read(self, tier: int, key: str, err: int) -> None:
        self.stats.add(tier, "errors")
        self.tiers[tier].fail(err, f"read {key}")

    def _read_block(self, tier: int, page: _Page, j: int) -> bytes:
        """Block ``j`` of ``page`` read from ``tier``'s file outside the ring (buffered, once).
        :raises OSError: e.g. FileNotFoundError."""
        span = block_span(page.info.length, page.info.block, j)
        fd, _ = open_regular(self.tiers[tier].layout.page_path(page.key))
        try:
            return os.pread(fd, span.nbytes, HEADER_SIZE + span.start)
        finally:
            os.close(fd)

    def _quarantine_locked(self, call: _Call, tier: int, p: int, j: int, why: str) -> None:
        """A block failed its check. Re-read it from the file (outside the ring) to tell a damaged
        copy from a transfer fault. A copy that differs on disk from what the index says is checked
        against its own header: intact, it is another writer's version of the page (two processes of
        the namespace stored this key with other bytes), which leaves the index but stays on disk; it
        is removed only when it fails its own header or checksums (damaged)."""
        page = call.pages[p]
        call.bad.add((tier, p))
        try:
            data = self._read_block(tier, page, j)
            differs = len(data) != block_span(page.info.length, page.info.block, j).nbytes or \
                crc32c(data) != page.info.crcs[j]
        except (FileNotFoundError, NotRegularFile):
            differs = True
        except OSError:
            return  # the tier is failing: its health, not this page, is the problem
        if not differs:
            log.warning("kvstream: block %d of page %s from tier %d failed its %s check in transfer but is "
                        "intact on disk; read from a replica", j, page.key, tier, why)
            return
        scanned = scan_file(self.tiers[tier].layout, self.digest, page.key, payload=True)
        problem = scanned.problem
        if problem is not None and problem.detail.startswith(UNREADABLE):
            return  # an I/O error: the tier's health, not this copy, is the problem
        if problem is None or problem.detail == VANISHED:  # kept (another writer's version), or gone
            self.index.remove(page.key, tier)
            call.relook.add(page.key)
            if problem is None:
                self.stats.add(tier, "other_versions")
                log.info("kvstream: page %s on tier %d is another writer's version (intact, other bytes); kept, "
                         "read from a copy of the indexed version or indexed in its place", page.key, tier)
        else:
            self._remove_copy_locked(tier, page.key, f"{why}, block {j}")

    def _remove_copy_locked(self, tier: int, key: str, why: str, remove: bool = True) -> None:
        """A damaged copy (or a stray under a page's name): out of the index and off the tier (a
        directory stays: kvstream never removes one; ``check`` reports it)."""
        log.warning("kvstream: page %s on tier %d is damaged (%s); %s, served from a replica if one is valid",
                    key, tier, why, "removed" if remove else "left in place")
        self.index.remove(key, tier)
        if remove:
            self.tiers[tier].unlink_page(key)
        self.stats.add(tier, "quarantined")

    # -- flow ----------------------------------------------------------------------------------
    def _set_depths(self, route, unit: int) -> None:
        """Each tier's window, less what earlier calls still have in flight on it, in items. A tier
        claims what one of its requests carries (at least the policy's m), but no more than a share
        of the batch that leaves every tier a few claims: a small batch is still split."""
        share = route.n // (2 * len(self.flows))
        for k, flow in enumerate(self.flows):
            claim = max(route.m, min(flow.request // unit, share))
            route.set_depth(k, max(0, flow.window - self._orphaned[k]) // unit, claim)

    def _may_steal(self, tier: int, owner: int) -> bool:
        """An idle tier re-reads items in flight on ``owner`` only when it is at least as fast, or
        ``owner`` is overdue (stalled): otherwise the owner delivers them sooner than a re-read."""
        flows = self.flows
        return flows[tier].rate >= flows[owner].rate or flows[owner].overdue(time.monotonic(), self._in_flight[owner])

    def _steal_wait(self, now: float) -> float | None:
        """Seconds until a tier with reads in flight turns overdue (None: none will: they have none,
        or are overdue already, and were offered to the other tiers when they turned so)."""
        dues = [due for k, f in enumerate(self.flows) if self._in_flight[k] and (due := f.overdue_at()) > now]
        return min(dues) - now + 1e-3 if dues else None

    # -- end of a call -----------------------------------------------------------------------------
    def _wait_direct_locked(self, call: _Call, timed_out: bool) -> None:
        """Reads into caller memory must land before the call returns: wait for them. (After a
        timeout that is news; otherwise another tier delivered their blocks first, which is routine.)"""
        log.log(logging.WARNING if timed_out else logging.DEBUG,
                "kvstream: waiting for %d reads into caller memory before returning", call.direct_in_flight)
        while call.direct_in_flight and self.ring.in_flight:  # (a completion lost to an error has landed)
            for tag, res in self.ring.reap(1, None):
                self._complete_locked(tag, res)

    def _settle_direct_locked(self, call: _Call) -> None:
        """After an error inside a call: its reads into caller memory must still land before it
        returns. If even waiting fails (the ring is broken), the ring is closed, which cancels what
        the kernel holds and waits for it, and the read path is closed (calls raise EngineClosedError)."""
        try:
            self._wait_direct_locked(call, timed_out=True)
        except BaseException:
            log.exception("kvstream: could not wait for reads into caller memory; closing the read path")
            self.closed = True
            self.ring.close()

    def _pages_done(self, call: _Call) -> list[bool]:
        done = [True] * len(call.pages)
        for (p, _j), arrived in zip(call.items, call.arrived):
            if not arrived:
                done[p] = False
        return done

    def _end_call_locked(self, call: _Call) -> None:
        call.active = False
        self._orphans += call.in_flight
        if call.in_flight:
            for req in self._reqs.values():
                if req.call is call:
                    self._orphaned[req.tier] += req.nbytes
        for k in range(len(self.tiers)):
            n = sum(1 for mask in call.page_tiers if mask >> k & 1)
            if n:
                self.stats.add(k, "pages_read", n)
        for f in call.files.values():
            f.release = True  # (those still read close when their last request is reaped)
        self._close_idle_locked(call)
        if call.route is not None:
            for tier, item in call.failed:
                if call.arrived[item]:
                    self.stats.add(tier, "replica_retries")

    # -- orphans -------------------------------------------------------------------------------
    def _reap_locked(self, min_complete: int, timeout: float | None) -> None:
        if not self._reqs:
            return
        for tag, res in self.ring.reap(min_complete, timeout):
            self._complete_locked(tag, res, timely=False)

    def drain(self, timeout: float | None) -> int:
        """Reap orphans until none is in flight or ``timeout`` passes; returns how many remain."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self._reqs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._reap_locked(1, left)
            return len(self._reqs)

    def close(self) -> None:
        """Close the ring (it drains what is in flight), then release every request's resources."""
        with self.lock:
            self.closed = True
            self.ring.close()
            for req in self._reqs.values():
                req.file.refs = max(req.file.refs - 1, 0)
                if req.file.fd is not None and not req.file.refs:
                    self._close_file(req.file)
            self._reqs.clear()
            self._orphans = 0
            self._orphaned = [0] * len(self.tiers)
            self._in_flight = [0] * len(self.tiers)
            self.pool.close()
