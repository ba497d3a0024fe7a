"""The write path: replicate a batch of pages to every usable tier, all in flight at once.

Data flow of ``put`` (one call at a time per write ring)::

    keys already held by a usable tier -> touch (most recent), True, no I/O (idempotent, cheap)
    per new page: block CRCs (crc32c, GIL released) and the header; the payload goes out
        zero-copy from the caller's memory when every segment is 4096-aligned in address and
        length, else through one staging copy per page (shared by every tier)
    per (page, tier): reserve capacity in the index (LRU victims deleted first), create
        <tier>/kvstream/tmp/<unique>.tmp (O_DIRECT), queue header + payload writes
    one ring submission for everything; as each (page, tier) completes: [fdatasync] -> rename
        into place -> index commit; ENOSPC -> evict LRU on that tier and rewrite (or rename again), up
        to SPACE_RETRIES times
    fsync=full: fsync the page directories; return when every write has completed
    (so the caller's memory is never read after return)

A page is stored when >= 1 tier committed it; fewer than all tiers counts as under-replicated.
Staged pages are written in windows of at most ``staging_limit`` bytes of staging memory (half the
engine's ``memory`` setting).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Sequence

from .errors import EngineClosedError
from .index import Index
from .integrity import PageHeader, block_crcs, pack_header
from .io import OP_WRITE
from .layout import HEADER_SIZE, block_size_for, file_size, is_aligned, is_valid_key, round_up
from .segments import Payload, Segment
from .staging import BufferPool
from .stats import BusyClock, Stats
from .tiers import SPACE_ERRNOS, Tier

log = logging.getLogger("kvstream")

STAGING_LIMIT = 256 << 20  # default staging memory for unaligned pages in flight per window, bytes
SPACE_RETRIES = 8  # rewrites (or renames) of one (page, tier) after ENOSPC, each after an LRU eviction: the
# jobs of a batch compete for the room each eviction makes; _room_possible_locked stops hopeless retries


class _Page:
    """A page to write: payload sources, header, and which tiers committed it."""

    __slots__ = ("pos", "key", "segments", "length", "block", "crcs", "file_bytes", "data", "staging",
                 "header", "targets", "expected", "committed")

    def __init__(self, pos: int, key: str, segments: Sequence[Segment], length: int, block: int, targets: int):
        self.pos, self.key, self.segments, self.length, self.block = pos, key, segments, length, block
        self.file_bytes = file_size(length)
        self.targets = targets  # tiers to write (bitmask)
        self.expected = targets  # tiers that should hold it after the put (failed tiers included)
        self.crcs: tuple[int, ...] = ()
        self.data: list[tuple[int, int, int]] = []  # (address, nbytes, file offset)
        self.staging = None
        self.header = None
        self.committed: list[int] = []

    @property
    def aligned(self) -> bool:
        return all(is_aligned(a, n) for a, n in self.segments)


class _Job:
    """One page on one tier: a temporary file and the writes that fill it."""

    __slots__ = ("page", "tier", "fd", "tmp", "left", "err", "tries")

    def __init__(self, page: _Page, tier: int, fd: int, tmp: str):
        self.page, self.tier, self.fd, self.tmp = page, tier, fd, tmp
        self.left = 0
        self.err = 0
        self.tries = 0


class WritePath:
    def __init__(self, ring, tiers: list[Tier], index: Index, stats: Stats, pool: BufferPool,
                 chunk: int, digest: str, staging_limit: int = STAGING_LIMIT):
        self.ring = ring
        self.chunk = chunk
        self.digest = digest
        self.tiers = tiers
        self.index = index
        self.stats = stats
        self.pool = pool
        self.staging_limit = staging_limit
        self.lock = threading.Lock()
        self.busy = BusyClock(len(tiers))
        self._ops: dict[int, tuple[_Job, int]] = {}  # tag -> (job, bytes expected)
        self._tag = 0
        self.closed = False

    def put(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], mask: int) -> list[bool]:
        """See Engine.put. ``mask``: tiers usable for this batch."""
        if len(pages) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(pages)} pages")
        results = [False] * len(keys)
        n_tiers = len(self.tiers)
        with self.lock:
            if self.closed:  # close() ran while this call waited for the lock
                raise EngineClosedError("kvstream engine is closed")
            busy0 = self.busy.snapshot()
            new: list[_Page] = []
            first: dict[str, int] = {}
            repeats: list[tuple[int, int]] = []
            for i, key in enumerate(keys):
                if not is_valid_key(key):
                    self.stats.total("invalid_keys")
                    log.warning("kvstream: refused to store invalid key %r", key)
                    continue
                if key in first:
                    repeats.append((i, first[key]))
                    continue
                segments = pages[i]
                length = sum(n for _, n in segments)
                if length <= 0 or any(n < 0 for _, n in segments):
                    self.stats.total("pages_failed")
                    continue
                if self.index.contains(key, mask):
                    self.index.touch(key)
                    self.stats.total("pages_existing")
                    results[i] = True
                    continue
                first[key] = i
                targets = mask & ~self.index.holders(key)
                new.append(_Page(i, key, segments, length, block_size_for(length, self.chunk), targets))
            self._fit_capacity(new)
            failed_tiers = ((1 << n_tiers) - 1) & ~mask
            for page in new:
                page.expected = page.targets | failed_tiers
            for window in _windows(new, self.staging_limit):
                self._write_window_locked(window)
            busy = [b - a for a, b in zip(busy0, self.busy.snapshot())]
        for k in range(n_tiers):
            self.stats.add(k, "write_busy_s", busy[k])
        for page in new:
            results[page.pos] = bool(page.committed)
            if page.committed:
                self.index.touch(page.key)  # LRU order = batch order, not completion order
                self.stats.total("pages_stored")
                if page.expected & ~self.index.holders(page.key):
                    self.stats.total("under_replicated")
            else:
                self.stats.total("pages_failed")
        for i, j in repeats:
            results[i] = results[j]
        self.stats.total("puts")
        self.stats.total("pages_put", len(keys))
        return results

    def _fit_capacity(self, new: list[_Page]) -> None:
        """A batch larger than a tier's capacity: target only its newest pages that fit, as LRU
        would keep them (writing the older ones would only evict them again within the batch)."""
        for k, cap in enumerate(self.index.capacities):
            if cap is None:
                continue
            room = cap
            for page in reversed(new):
                if page.targets >> k & 1:
                    if page.file_bytes <= room:
                        room -= page.file_bytes
                    else:
                        page.targets &= ~(1 << k)
                        room = 0
                        self.stats.add(k, "skipped_writes")

    # -- one window ------------------------------------------------------------------------------
    def _write_window_locked(self, window: list[_Page]) -> None:
        jobs: list[_Job] = []
        dirs: dict[int, set[str]] = {}
        try:
            for page in window:
                self._prepare_locked(page)
                for tier in range(len(self.tiers)):
                    if page.targets >> tier & 1:
                        job = self._start_job_locked(page, tier)
                        if job is not None:
                            jobs.append(job)
            self._submit_locked(jobs)
            while self._ops:
                for tag, res in self.ring.reap(1):
                    job, want = self._ops.pop(tag)
                    self.busy.finished(job.tier)
                    job.left -= 1
                    if res != want and not job.err:
                        job.err = -res if res < 0 else self._short_write_errno(job)
                    if not job.left:
                        self._finish_job_locked(job, dirs)
            for tier, tier_dirs in dirs.items():
                if self.tiers[tier].fsync == "full" and tier_dirs:
                    try:
                        self.tiers[tier].sync_dirs(tier_dirs)
                    except OSError as exc:
                        self.tiers[tier].fail(exc.errno or errno.EIO, "fsync directory")
        finally:
            for page in window:
                for buf in (page.staging, page.header):
                    if buf is not None:
                        self.pool.put(buf)
                page.staging = page.header = None

    def _prepare_locked(self, page: _Page) -> None:
        """Checksums, header, and where the payload is written from."""
        payload = Payload(page.segments)
        if page.aligned:
            page.data = [(address, n, HEADER_SIZE + start)
                         for (address, n), start in zip(page.segments, payload.starts) if n]
            page.crcs = block_crcs(page.segments, page.length, page.block)
        else:
            padded = round_up(page.length)
            staging = page.staging = self.pool.get(padded)
            payload.gather(staging.address)
            if padded > page.length:
                ctypes.memset(staging.address + page.length, 0, padded - page.length)
            page.data.append((staging.address, padded, HEADER_SIZE))
            page.crcs = block_crcs([(staging.address, page.length)], page.length, page.block)
        page.header = self.pool.get(HEADER_SIZE)
        pack_header(PageHeader(page.key, self.digest, page.length, page.block, page.crcs, time.time_ns()),
                    page.header)

    def _start_job_locked(self, page: _Page, k: int) -> _Job | None:
        tier = self.tiers[k]
        victims = self.index.reserve(k, page.file_bytes)
        if victims is None:
            self.stats.add(k, "skipped_writes")
            log.debug("kvstream: tier %d cannot make room for page %s (capacity, pinned pages)", k, page.key)
            return None
        self._evicted_locked(k, victims)
        try:
            fd, tmp = tier.create_tmp()
        except OSError as exc:
            self.index.abort(k, page.file_bytes)
            self._failed_locked(k, exc.errno or errno.EIO, f"create temporary file for {page.key}")
            return None
        return _Job(page, k, fd, tmp)

    def _submit_locked(self, jobs: list[_Job]) -> None:
        ops = []
        for job in jobs:
            page = job.page
            job.left = 1 + len(page.data)
            for address, n, offset in ((page.header.address, HEADER_SIZE, 0), *page.data):
                self._tag += 1
                self._ops[self._tag] = (job, n)
                ops.append((OP_WRITE, job.fd, (address, n), offset, self._tag))
            self.busy.started(job.tier, job.left)
        if not ops:
            return
        try:
            self.ring.submit(ops)
        except BaseException:  # nothing was queued (the ring validates a batch first): undo, re-raise
            for *_, tag in ops:
                del self._ops[tag]
            for job in jobs:
                self.busy.finished(job.tier, job.left)
                self.tiers[job.tier].discard(job.fd, job.tmp)
                self.index.abort(job.tier, job.page.file_bytes)
            raise

    def _finish_job_locked(self, job: _Job, dirs: dict[int, set[str]]) -> None:
        page, k = job.page, job.tier
        tier = self.tiers[k]
        if not job.err:
            try:
                try:
                    page_dir = tier.commit(job.fd, job.tmp, page.key)
                except OSError as exc:
                    # No file name: fdatasync failed, the data is not sealed; never retried.
                    if exc.errno not in SPACE_ERRNOS or exc.filename is None:
                        raise
                    page_dir = self._place_after_eviction_locked(job, exc)
            except OSError as exc:
                tier.discard(None, job.tmp)
                self.index.abort(k, page.file_bytes)
                self._failed_locked(k, exc.errno or errno.EIO, f"commit {page.key}")
                return
            # A copy of other content on another tier (a failed tier's, another writer's) leaves the
            # index, so it is never served against these checksums; its file is a valid page and stays.
            self.index.commit(page.key, k, page.length, page.block, page.crcs, page.file_bytes)
            page.committed.append(k)
            dirs.setdefault(k, set()).add(page_dir)
            self.stats.add(k, "bytes_written", page.length)
            self.stats.add(k, "pages_written")
            return
        if job.err in SPACE_ERRNOS and job.tries < SPACE_RETRIES and self._room_possible_locked(job):
            victims = self.index.evict(k, page.file_bytes)
            if victims:
                self._evicted_locked(k, victims)
                job.tries += 1
                job.err = 0
                self._submit_locked([job])
                return
        tier.discard(job.fd, job.tmp)
        self.index.abort(k, page.file_bytes)
        self._failed_locked(k, job.err, f"write {page.key}")

    def _place_after_eviction_locked(self, job: _Job, exc: OSError) -> str:
        """A full tier refused the rename itself (a new shard directory or directory block needs
        room): the data is written and sealed, so evict LRU pages and place it again.
        :raises OSError: still no room (nothing left to evict, or SPACE_RETRIES used up)."""
        for _ in range(SPACE_RETRIES):
            victims = self.index.evict(job.tier, job.page.file_bytes)
            if not victims:
                break
            self._evicted_locked(job.tier, victims)
            try:
                return self.tiers[job.tier].place(job.tmp, job.page.key)
            except OSError as again:
                if again.errno not in SPACE_ERRNOS:
                    raise
                exc = again
        raise exc

    def _room_possible_locked(self, job: _Job) -> bool:
        """Could evicting every page of this namespace on the tier make room for the job? If not
        (a page larger than the file system, or one full of other data), evicting would only
        throw pages away: the write fails for this tier and nothing is evicted."""
        try:
            st = os.statvfs(self.tiers[job.tier].root)
            allocated = os.fstat(job.fd).st_blocks * 512  # what the job already holds is reused
        except OSError:
            return True  # cannot tell: try eviction as before
        return st.f_bavail * st.f_frsize + self.index.used[job.tier] + allocated >= job.page.file_bytes

    def _short_write_errno(self, job: _Job) -> int:
        """A write that stopped early: the ring reports the bytes done, not the error that
        followed. A nearly full file system means ENOSPC (evict and retry), else EIO."""
        try:
            st = os.statvfs(self.tiers[job.tier].root)
        except OSError:
            return errno.EIO
        return errno.ENOSPC if st.f_bavail * st.f_frsize < 2 * job.page.file_bytes else errno.EIO

    def _evicted_locked(self, k: int, victims: list[str]) -> None:
        for key in victims:
            self.tiers[k].unlink_page(key)
        if victims:
            self.stats.add(k, "evictions", len(victims))

    def _failed_locked(self, k: int, err: int, what: str) -> None:
        self.stats.add(k, "write_failures")
        self.stats.add(k, "errors")
        if not self.tiers[k].fail(err, what) and err not in SPACE_ERRNOS:
            log.warning("kvstream: tier %d: %s failed: %s", k, what, os.strerror(err))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.ring.close()
            self.pool.close()


def _windows(pages: list[_Page], limit: int) -> list[list[_Page]]:
    """Split pages so that the staged (unaligned) ones of a window fit ``limit`` bytes."""
    out: list[list[_Page]] = []
    current: list[_Page] = []
    staged = 0
    for page in pages:
        need = 0 if page.aligned else round_up(page.length)
        if current and staged + need > limit:
            out.append(current)
            current, staged = [], 0
        current.append(page)
        staged += need
    if current:
        out.append(current)
    return out
