"""What the write path writes: a put (``PutCall``) and its pages (``WritePage``): a page's sources,
its checksums and header, the staging copy of a page not 4096-aligned in memory, and the writes
that fill its file; a page on one tier (``Job``: its temporary file) and one write request of it in
flight (``Write``). Plain data, used by writes.py and writequeue.py under the writer's lock
(``PutCall.signal`` also without it, for a put with nothing to write).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence

from .integrity import PageHeader, block_crcs, pack_header
from .layout import HEADER_SIZE, file_size, is_aligned, round_up
from .segments import Payload, Segment

log = logging.getLogger("kvstream")


class PutCall:
    """One put: results per key, pages not yet done, how the caller learns the end."""

    __slots__ = ("results", "pages", "repeats", "left", "done", "event", "dirs")

    def __init__(self, n: int, done: Callable[[list[bool]], None] | None):
        self.results = [False] * n
        self.pages: list[WritePage] = []  # its own new pages, in key order (LRU order on completion)
        self.repeats: list[tuple[int, int]] = []  # (position, first position of the same key)
        self.left = 0  # pages (its own and others' it waits for) not yet done
        self.done = done
        self.event = threading.Event() if done is None else None
        self.dirs: dict[int, set[str]] = {}  # page directories committed, per tier (fsync=full)

    def sync_dirs(self, tiers) -> None:
        """fsync=full: make the put's renames durable on each tier; a page none of whose copies is
        durable then reports False (fsync=full promises a copy that survives a crash)."""
        unsynced = set()
        for k, dirs in self.dirs.items():
            if tiers[k].fsync == "full" and dirs:
                try:
                    tiers[k].sync_dirs(dirs)
                except OSError as exc:
                    unsynced.add(k)
                    tiers[k].fail(exc.errno or errno.EIO, "fsync directory")
        if not unsynced:
            return
        for page in self.pages:
            if page.committed and set(page.committed) <= unsynced:
                for owner, i in page.calls:
                    if owner is self:
                        self.results[i] = False

    def signal(self) -> None:
        """The put is over: ``put`` returns, or the deferred put's callback runs (its error is logged:
        it must not stop the writer)."""
        for i, j in self.repeats:
            self.results[i] = self.results[j]
        if self.event is not None:
            self.event.set()
            return
        try:
            self.done(self.results)
        except Exception:
            log.exception("kvstream: a deferred put's completion callback failed")


class WritePage:
    """A page to write: its sources, checksums, the tiers it goes to and the puts waiting for it."""

    __slots__ = ("key", "segments", "length", "block", "file_bytes", "aligned", "crcs", "created", "data",
                 "staging", "header", "users", "targets", "expected", "committed", "left", "calls", "spare",
                 "evict", "copied", "started")

    def __init__(self, key: str, segments: Sequence[Segment], length: int, block: int, targets: int):
        self.key, self.segments, self.length, self.block = key, segments, length, block
        self.file_bytes = file_size(length)
        self.aligned = all(is_aligned(a, n) for a, n in segments)
        self.targets = targets  # tiers to write (bitmask)
        self.expected = targets  # tiers that should hold it after the put (failed tiers included)
        self.spare = 0  # tiers replicate=budget skipped: written after all if no tier committed the page
        self.crcs: tuple[int, ...] | None = None  # computed when its first job starts
        self.created = 0
        self.data: list[tuple[int, int, int]] = []  # (address, nbytes, file offset) of the payload
        self.staging = None  # staging copy (unaligned pages), held while a job of the page is in flight
        self.header = None
        self.users = 0  # jobs started and not finished (they hold the staging copy and the header)
        self.committed: list[int] = []
        self.left = 0  # jobs not finished
        self.calls: list[tuple[PutCall, int]] = []  # (put, position of the key in it)
        self.evict = True  # may evict the tier's least recent pages to make room (a catch-up copy may not)
        self.copied: Callable[[bool, float], None] | None = None  # a catch-up copy (replication.py): its
        # callback, told whether it committed and how long its job took from its start
        self.started = 0.0  # when its (last) job started, monotonic s

    def prepare(self, pool, digest: str) -> int:
        """Checksums (once per page), the header, and where the payload is written from: the caller's
        memory (aligned) or a staging copy from ``pool``, held while a job of the page is in flight.
        Returns the staging bytes it took."""
        staged = 0
        if self.aligned:
            if self.crcs is None:
                payload = Payload(self.segments)
                self.data = [(address, n, HEADER_SIZE + start)
                             for (address, n), start in zip(self.segments, payload.starts) if n]
                self.crcs = block_crcs(self.segments, self.length, self.block)
        elif self.staging is None:
            staged = round_up(self.length)
            staging = self.staging = pool.get(staged)
            Payload(self.segments).gather(staging.address)
            if staged > self.length:
                ctypes.memset(staging.address + self.length, 0, staged - self.length)
            self.data = [(staging.address, staged, HEADER_SIZE)]
            if self.crcs is None:
                self.crcs = block_crcs([(staging.address, self.length)], self.length, self.block)
        if self.header is None:
            if not self.created:
                self.created = time.time_ns()
            self.header = pool.get(HEADER_SIZE)
            pack_header(PageHeader(self.key, digest, self.length, self.block, self.crcs, self.created), self.header)
        return staged

    def release(self, pool) -> int:
        """The staging copy and the header go back to ``pool``; returns the staging bytes freed."""
        freed = 0
        if self.staging is not None:
            freed = self.staging.nbytes
            pool.put(self.staging)
            self.staging = None
        if self.header is not None:
            pool.put(self.header)
            self.header = None
        return freed

    def requests(self, request: float) -> list[tuple]:
        """The writes of the page file: ``(buffer, bytes, file offset)``, each ``request`` payload bytes
        (the first also carries the header), a buffer being one ``(address, length)`` or a list of them
        (a vectored write where a request spans the header and the payload, or two segments)."""
        ops: list[tuple] = []
        pieces: list[tuple[int, int]] = []
        size = start = 0
        limit = request + HEADER_SIZE
        for address, n, _offset in [(self.header.address, HEADER_SIZE, 0), *self.data]:  # contiguous in the file
            while n:
                take = int(min(n, limit - size))
                pieces.append((address, take))
                size, address, n = size + take, address + take, n - take
                if size == limit:
                    ops.append((pieces if len(pieces) > 1 else pieces[0], size, start))
                    start, pieces, size, limit = start + size, [], 0, request
        if pieces:
            ops.append((pieces if len(pieces) > 1 else pieces[0], size, start))
        return ops


CANCELLED = -1  # Job.err of a job that clear() cancelled


class Write:
    """One write request in flight: ``nbytes`` of ``job``'s file. ``epoch``: the tier's read epoch
    when submitted (-1: a read was running), so a completion measures the device only undisturbed."""

    __slots__ = ("job", "tier", "nbytes", "epoch", "t0", "ahead", "orphan")

    def __init__(self, job: "Job", nbytes: int, epoch: int):
        self.job, self.tier, self.nbytes, self.epoch = job, job.tier, nbytes, epoch


class Job:
    """One page on one tier: a temporary file and the writes that fill it."""

    __slots__ = ("page", "tier", "fd", "tmp", "ops", "next", "in_flight", "err", "tries")

    def __init__(self, page: WritePage, tier: int, fd: int, tmp: str, ops: list[tuple]):
        self.page, self.tier, self.fd, self.tmp, self.ops = page, tier, fd, tmp, ops
        self.next = 0  # ops[next:] not yet submitted
        self.in_flight = 0
        self.err = 0
        self.tries = 0
