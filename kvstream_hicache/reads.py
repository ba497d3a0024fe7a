"""The read path: one batch, one pool of blocks, routed over the tiers by completions.

Data flow of ``get`` (one call at a time per read ring)::

    reap orphans of earlier calls (non-blocking)
    pin the pages in the index; items = every block of every page held by a usable tier
    route = policy.start(n_tiers, holders)                 (router.py, pure)
    loop: submit claims -> reap completions ->
          verify the block's crc32c against the index -> on the FIRST verified arrival copy the block
          from its staging buffer into the caller's segments (a block may straddle segments)
          -> route.complete(tier, item, ok) -> next claims
    until every item is found or failed (or read_timeout passes)
    unpin; reads still in flight become *orphans*: they keep their staging buffer and file
    descriptor until a later call (or close) reaps them, and never touch caller memory again.

Reads always land in engine-owned staging buffers. That costs one memcpy per block, and buys the
rule that lets a stalled tier not hold a batch hostage: the call can return with reads still in
flight on that tier, because none of them targets memory the caller may reuse.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

from .index import Index, PageInfo
from .integrity import crc32c
from .io import OP_READ
from .layout import HEADER_SIZE, BlockSpan, block_span, is_valid_key
from .segments import Payload, Segment
from .staging import BufferPool
from .stats import BusyClock, Stats, batch_figures
from .tiers import Tier

log = logging.getLogger("kvstream")


class _File:
    """A read descriptor shared by the ops of one (tier, page) in one call."""

    __slots__ = ("fd", "refs", "release")

    def __init__(self, fd: int | None):
        self.fd = fd
        self.refs = 0  # ops in flight on it
        self.release = False  # the call ended: close when the last op is reaped

    def drop(self) -> None:
        self.refs -= 1
        if self.release and not self.refs and self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Op:
    __slots__ = ("call", "tier", "item", "buf", "file", "span")

    def __init__(self, call: "_Call", tier: int, item: int, buf, file: _File, span: BlockSpan):
        self.call, self.tier, self.item, self.buf, self.file, self.span = call, tier, item, buf, file, span


class _Page:
    """One requested page: its index entry and where its payload goes in caller memory."""

    __slots__ = ("key", "info", "payload")

    def __init__(self, key: str, info: PageInfo, segments: Sequence[Segment]):
        self.key, self.info, self.payload = key, info, Payload(segments)


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
        self.in_flight = 0
        self.read = [0] * n_tiers  # bytes transferred per tier
        self.served = [0] * n_tiers  # first-arrival bytes per tier


class ReadPath:
    """Owns the read ring, its staging pool and the ops in flight on it (orphans included)."""

    def __init__(self, ring, tiers: list[Tier], index: Index, stats: Stats, pool: BufferPool,
                 read_timeout: float):
        self.ring = ring
        self.tiers = tiers
        self.index = index
        self.stats = stats
        self.pool = pool
        self.read_timeout = read_timeout
        self.lock = threading.Lock()
        self.busy = BusyClock(len(tiers))
        self._ops: dict[int, _Op] = {}  # tag -> op, for every read in flight on the ring
        self._orphans = 0  # ops in _ops whose call has returned
        self._tags = itertools.count(1)

    @property
    def orphans(self) -> int:
        """Reads of finished calls still in flight (engine-owned buffers)."""
        return self._orphans

    # -- get -----------------------------------------------------------------------------------
    def get(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], policy, mask: int) -> list[bool]:
        """See Engine.get. ``mask``: tiers usable for this batch."""
        n_tiers = len(self.tiers)
        found = [False] * len(keys)
        t0 = time.perf_counter()
        with self.lock:
            self._reap_locked(0, 0)
            busy0 = self.busy.snapshot()
            infos = self.index.pin(keys)
            call = _Call(n_tiers)
            try:
                self._plan_locked(call, keys, pages, infos, mask)
                if call.items:
                    self._run_locked(call, policy)
                done = self._pages_done(call)
                for p, ok in enumerate(done):
                    found[call.page_of[p]] = ok
            finally:
                self.index.unpin(infos)
                self._end_call_locked(call)
            busy = [b - a for a, b in zip(busy0, self.busy.snapshot())]
        elapsed = time.perf_counter() - t0
        for p, ok in enumerate(found):
            if ok:
                self.index.touch(keys[p])
        served = sum(call.served)
        n_found = sum(found)
        for k in range(n_tiers):
            if call.read[k]:
                self.stats.add(k, "bytes_read", call.read[k])
            if call.served[k]:
                self.stats.add(k, "bytes_served", call.served[k])
            self.stats.add(k, "read_busy_s", busy[k])
        self.stats.total("gets")
        self.stats.total("pages_requested", len(keys))
        self.stats.total("pages_found", n_found)
        self.stats.total("pages_missing", len(keys) - n_found)
        batch = batch_figures(elapsed, served, call.read, busy, call.served)
        batch.update(pages=len(keys), found=n_found, items=len(call.items),
                     policy=getattr(policy, "name", str(policy)),
                     duplicates=getattr(call.route, "duplicates", 0), retries=getattr(call.route, "retries", 0))
        self.stats.record_batch(batch)
        return found

    def _plan_locked(self, call: _Call, keys, pages, infos: list[PageInfo | None], mask: int) -> None:
        if len(pages) != len(keys):
            raise ValueError(f"get: {len(keys)} keys but {len(pages)} pages")
        for i, (key, info) in enumerate(zip(keys, infos)):
            if info is None:
                if not is_valid_key(key):
                    self.stats.total("invalid_keys")
                continue
            segments = pages[i]
            if sum(n for _, n in segments) != info.length:
                self.stats.total("size_mismatch")
                log.warning("kvstream: page %s holds %d bytes but the caller's buffer has %d; reported missing",
                            key, info.length, sum(n for _, n in segments))
                continue
            holders = info.tiers & mask
            if not holders:
                continue
            p = len(call.pages)
            call.pages.append(_Page(key, info, segments))
            call.page_of.append(i)
            for j in range(len(info.crcs)):
                call.items.append((p, j))
                call.holders.append(holders)
        call.arrived = bytearray(len(call.items))
        call.page_tiers = [0] * len(call.pages)

    def _run_locked(self, call: _Call, policy) -> None:
        route = call.route = policy.start(len(self.tiers), call.holders)
        deadline = time.monotonic() + self.read_timeout if self.read_timeout > 0 else None
        pending = deque(route.start())
        while True:
            ops: list[tuple[int, _Op]] = []
            while pending:
                tier, items, _steal = pending.popleft()
                for item in items:
                    op = self._prepare_locked(call, tier, item)
                    if op is None:
                        call.failed.append((tier, item))
                        pending.extend(route.complete(tier, item, False))
                    else:
                        ops.append(op)
            if ops:
                self._submit_locked(ops)
            if route.done:
                return
            if not call.in_flight:
                log.error("kvstream: router stalled with %d unresolved items and nothing in flight; "
                          "reporting them missing", sum(1 for a in call.arrived if not a))
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.stats.total("read_timeouts")
                log.warning("kvstream: read batch timed out after %.1f s with %d reads in flight; "
                            "their pages are reported missing", self.read_timeout, call.in_flight)
                return
            for tag, res in self.ring.reap(1, left):
                pending.extend(self._complete_locked(tag, res))

    def _prepare_locked(self, call: _Call, tier: int, item: int) -> tuple[int, _Op] | None:
        p, j = call.items[item]
        page = call.pages[p]
        if not self.tiers[tier].healthy:
            return None  # failed during this batch: its items go to the other holders
        f = call.files.get((tier, p))
        if f is None:
            try:
                f = _File(self.tiers[tier].open_page(page.key))
            except OSError as exc:
                f = _File(None)
                err = exc.errno or errno.EIO
                if self.tiers[tier].fail(err, f"open {page.key}"):
                    # the whole tier went (unmounted, moved away): its copies may come back with it,
                    # so the index keeps them; rejoining reconciles with what survived
                    self.stats.add(tier, "errors")
                elif err == errno.ENOENT:  # deleted under us (operator, other rank): forget this copy
                    self.index.remove(page.key, tier)
                else:
                    self.stats.add(tier, "errors")
            call.files[(tier, p)] = f
        if f.fd is None:
            return None
        span = block_span(page.info.length, page.info.block, j)
        buf = self.pool.get(page.info.block)
        f.refs += 1
        return next(self._tags), _Op(call, tier, item, buf, f, span)

    def _submit_locked(self, ops: list[tuple[int, _Op]]) -> None:
        batch = [(OP_READ, op.file.fd, (op.buf.address, op.span.padded), HEADER_SIZE + op.span.start, tag)
                 for tag, op in ops]
        try:
            self.ring.submit(batch)
        except BaseException:  # nothing was queued (the ring validates a batch first): undo, re-raise
            for _tag, op in ops:
                op.file.drop()
                self.pool.put(op.buf)
            raise
        for tag, op in ops:
            self._ops[tag] = op
            op.call.in_flight += 1
            self.busy.started(op.tier)

    def _complete_locked(self, tag: int, res: int) -> list:
        op = self._ops.pop(tag)
        call, tier, span = op.call, op.tier, op.span
        self.busy.finished(tier)
        op.file.drop()
        call.in_flight -= 1
        if res > 0:
            call.read[tier] += res
        self.stats.add(tier, "blocks_read")
        if not call.active:  # orphan of an earlier call: its batch is over, only release
            self._orphans -= 1
            self.stats.total("orphan_reads")
            self.pool.put(op.buf)
            return []
        p, j = call.items[op.item]
        page = call.pages[p]
        if call.arrived[op.item] and res >= span.nbytes:
            ok = True  # a duplicate: the first arrival already won; skip the verify
            self.stats.total("duplicate_reads")
        else:
            ok = self._verify_locked(op, res, p, j)
            if ok and not call.arrived[op.item]:
                page.payload.scatter(op.buf.address, span.start, span.nbytes)
                call.arrived[op.item] = 1
                call.served[tier] += span.nbytes
                call.page_tiers[p] |= 1 << tier
            elif not ok:
                call.failed.append((tier, op.item))
        self.pool.put(op.buf)
        return call.route.complete(tier, op.item, ok)

    def _verify_locked(self, op: _Op, res: int, p: int, j: int) -> bool:
        tier, span, page = op.tier, op.span, op.call.pages[p]
        if res < 0:
            self.stats.add(tier, "errors")
            self.tiers[tier].fail(-res, f"read {page.key}")
            return False
        if res >= span.nbytes and crc32c((op.buf.address, span.nbytes)) == page.info.crcs[j]:
            return True
        self.stats.add(tier, "corrupted")
        if (tier, p) not in op.call.bad:
            self._quarantine_locked(op.call, tier, p, j, "truncated" if res < span.nbytes else "checksum")
        return False

    def _quarantine_locked(self, call: _Call, tier: int, p: int, j: int, why: str) -> None:
        """A block failed its check. Re-read it from the file (outside the ring) to tell a damaged
        copy from a transfer fault; a damaged copy is removed from the tier and the index."""
        page = call.pages[p]
        call.bad.add((tier, p))
        span = block_span(page.info.length, page.info.block, j)
        try:
            fd = os.open(self.tiers[tier].layout.page_path(page.key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.pread(fd, span.nbytes, HEADER_SIZE + span.start)
            finally:
                os.close(fd)
            damaged = len(data) != span.nbytes or crc32c(data) != page.info.crcs[j]
        except FileNotFoundError:
            damaged = True
        except OSError:
            return  # the tier is failing: its health, not this page, is the problem
        if damaged:
            log.warning("kvstream: page %s on tier %d is damaged (%s, block %d); removed, served from a replica "
                        "if one is valid", page.key, tier, why, j)
            self.index.remove(page.key, tier)
            self.tiers[tier].unlink_page(page.key)
            self.stats.add(tier, "quarantined")
        else:
            log.warning("kvstream: block %d of page %s from tier %d failed its %s check in transfer but is "
                        "intact on disk; read from a replica", j, page.key, tier, why)

    def _pages_done(self, call: _Call) -> list[bool]:
        done = [True] * len(call.pages)
        for (p, _j), arrived in zip(call.items, call.arrived):
            if not arrived:
                done[p] = False
        return done

    def _end_call_locked(self, call: _Call) -> None:
        call.active = False
        self._orphans += call.in_flight
        for k in range(len(self.tiers)):
            n = sum(1 for mask in call.page_tiers if mask >> k & 1)
            if n:
                self.stats.add(k, "pages_read", n)
        for f in call.files.values():
            f.release = True
            if not f.refs and f.fd is not None:
                os.close(f.fd)
                f.fd = None
        if call.route is not None:
            for tier, item in call.failed:
                if call.arrived[item]:
                    self.stats.add(tier, "replica_retries")

    # -- orphans -------------------------------------------------------------------------------
    def _reap_locked(self, min_complete: int, timeout: float | None) -> None:
        if not self._ops:
            return
        for tag, res in self.ring.reap(min_complete, timeout):
            self._complete_locked(tag, res)

    def drain(self, timeout: float | None) -> int:
        """Reap orphans until none is in flight or ``timeout`` passes; returns how many remain."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self._ops:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._reap_locked(1, left)
            return len(self._ops)

    def close(self) -> None:
        """Close the ring (it drains what is in flight), then release every op's resources."""
        with self.lock:
            self.ring.close()
            for op in self._ops.values():
                op.file.refs = max(op.file.refs - 1, 0)
                if op.file.fd is not None and not op.file.refs:
                    os.close(op.file.fd)
                    op.file.fd = None
            self._ops.clear()
            self._orphans = 0
            self.pool.close()
