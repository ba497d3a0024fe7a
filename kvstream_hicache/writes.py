"""The write path: every put's pages go through one queue per tier, written by one writer thread,
bounded per tier, and held back on a tier while a read uses it.

Data flow (``put`` waits for its pages; ``put_deferred`` returns at once and calls back)::

    accept (the caller's thread):
        keys already held by a usable tier -> touch (most recent), True, no I/O (idempotent, cheap);
        a key another put is writing now -> waits for that page (written once)
        capacity: a tier with a limit targets only the newest pages of the batch that fit
        replicate=budget: per new page, in key order, the home tier (the first usable one) takes it;
            another tier k takes it only if (P_k + s) / w_k <= max(P_home / w_home, replicate_slack)
            (P = bytes accepted for the tier and not yet written, w = its measured write
            bandwidth, s = the page's file bytes); a skipped replica is counted, not a failure
        -> one job per (page, tier) at the back of that tier's FIFO
    the writer thread, per tier, while the tier has no read in flight (priority.py) and its bytes in
    flight are within its window (flow.py: the window and request size follow the device):
        start the next job: reserve capacity (LRU victims deleted first), open a temporary file
            (at most MAX_OPEN_FILES per tier: a put of any size holds a bounded number of
            descriptors), checksums (once per page) and the header; a page not 4096-aligned in
            memory is copied into staging (the write half of ``memory``) while a job of it is in flight
        submit its header and payload in requests of the flow's size
        on completion: [fdatasync] -> rename into place -> index commit; ENOSPC -> evict LRU on that
            tier and rewrite (or rename again), up to SPACE_RETRIES times
    a page is done when every tier it targets is done; a put when its pages are: fsync=full syncs the
    page directories, then the caller returns (``put``) or its callback runs (``put_deferred``).
    The caller's memory is never read after that.

Read priority holds new writes back, never the ones in flight: when a get starts on a tier, what the
tier had in flight (its window) finishes first. ``put_deferred`` is the paper's M2 (the LMCache
path): pages wait in the queues until their tier has no read in flight, and the bytes of pages not
yet done are bounded by ``write_backlog`` (back-pressure: a deferred put beyond it waits). A page is
stored when >= 1 tier committed it; fewer than the tiers it should be on counts as under-replicated
(a budget skip excepted).
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager

from .errors import EngineClosedError
from .flow import TierFlow
from .index import Index, tiers_in
from .integrity import PageHeader, block_crcs, pack_header
from .io import OP_WRITE
from .layout import HEADER_SIZE, block_size_for, file_size, is_aligned, is_valid_key, round_up
from .priority import ReadPriority
from .segments import Payload, Segment
from .staging import BufferPool
from .stats import BusyClock, Stats
from .tiers import SPACE_ERRNOS, Tier

log = logging.getLogger("kvstream")

STAGING_LIMIT = 256 << 20  # default staging memory for unaligned pages in flight, bytes
SPACE_RETRIES = 8  # rewrites (or renames) of one (page, tier) after ENOSPC, each after an LRU eviction: the
# jobs of a batch compete for the room each eviction makes; _room_possible_locked stops hopeless retries
MAX_OPEN_FILES = 32  # temporary files open at once per tier: a 10,000-page put must not exhaust the
# descriptor limit (issue 16 item 7); 32 pages per tier keep any device busy (the window bounds bytes)
WAKE_S = 0.002  # longest wait for a write completion: a tier whose reads ended, or new work for an idle
# tier, is noticed within this (the reads' end also wakes the writer when nothing is in flight)
FD_RETRY_S = 0.05  # out of descriptors with none of ours open: try again after this, s
FD_GIVE_UP_S = 30.0  # ... for this long, then the (page, tier) fails (nothing of ours to wait for), s
CANCELLED = -1  # job.err of a job that clear() cancelled
TRUST_BYTES = 32 << 20  # replicate=budget judges a tier by its write bandwidth only once this much was
# written to it undisturbed: a few small writes measure latency (and a stall), not bandwidth
WRITE_UNIT = 1 << 20  # write requests are whole multiples of this (or of the chunk, if larger), bytes: a
# smaller chunk is a checksum unit, not a reason for more, smaller writes


class _Page:
    """A page to write: its sources, checksums, the tiers it goes to and the puts waiting for it."""

    __slots__ = ("key", "segments", "length", "block", "file_bytes", "aligned", "crcs", "created", "data",
                 "staging", "header", "users", "targets", "expected", "committed", "left", "calls", "evict",
                 "copied", "started")

    def __init__(self, key: str, segments: Sequence[Segment], length: int, block: int, targets: int):
        self.key, self.segments, self.length, self.block = key, segments, length, block
        self.file_bytes = file_size(length)
        self.aligned = all(is_aligned(a, n) for a, n in segments)
        self.targets = targets  # tiers to write (bitmask)
        self.expected = targets  # tiers that should hold it after the put (failed tiers included)
        self.crcs: tuple[int, ...] | None = None  # computed when its first job starts
        self.created = 0
        self.data: list[tuple[int, int, int]] = []  # (address, nbytes, file offset) of the payload
        self.staging = None  # staging copy (unaligned pages), held while a job of the page is in flight
        self.header = None
        self.users = 0  # jobs started and not finished (they hold the staging copy and the header)
        self.committed: list[int] = []
        self.left = 0  # jobs not finished
        self.calls: list[tuple[_Call, int]] = []  # (put, position of the key in it)
        self.evict = True  # may evict the tier's least recent pages to make room (a catch-up copy may not)
        self.copied: Callable[[bool, float], None] | None = None  # a catch-up copy (replication.py): its
        # callback, told whether it committed and how long its job took from its start
        self.started = 0.0  # when its (last) job started, monotonic s


def replica_fits(queued: int, size: int, w: float, home_queued: int, w_home: float, slack: float) -> bool:
    """replicate=budget: may a tier with ``queued`` bytes pending, write bandwidth ``w``, take a page
    of ``size`` bytes, whose home tier has ``home_queued`` bytes pending (the page included) at
    ``w_home``? Yes when it drains no later than the home copy, or within ``slack`` seconds; yes too
    while either bandwidth is unmeasured (0). With slack 0 a replica never finishes after its home
    copy; the slack is a floor: a replica may always take up to ``slack`` seconds."""
    if not w or not w_home:
        return True
    return (queued + size) / w <= max(home_queued / w_home, slack)


def _requests(page: _Page, request: float) -> list[tuple]:
    """The writes of a page file: ``(buffer, bytes, file offset)``, each ``request`` payload bytes (the
    first also carries the header), a buffer being one ``(address, length)`` or a list of them (a
    vectored write where a request spans the header and the payload, or two segments)."""
    ops: list[tuple] = []
    pieces: list[tuple[int, int]] = []
    size = start = 0
    limit = request + HEADER_SIZE
    for address, n, _offset in [(page.header.address, HEADER_SIZE, 0), *page.data]:  # contiguous in the file
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


class _Job:
    """One page on one tier: a temporary file and the writes that fill it."""

    __slots__ = ("page", "tier", "fd", "tmp", "ops", "next", "in_flight", "err", "tries")

    def __init__(self, page: _Page, tier: int, fd: int, tmp: str, ops: list[tuple]):
        self.page, self.tier, self.fd, self.tmp, self.ops = page, tier, fd, tmp, ops
        self.next = 0  # ops[next:] not yet submitted
        self.in_flight = 0
        self.err = 0
        self.tries = 0


class _Call:
    """One put: results per key, pages not yet done, how the caller learns the end."""

    __slots__ = ("results", "pages", "repeats", "left", "done", "event", "dirs")

    def __init__(self, n: int, done: Callable[[list[bool]], None] | None):
        self.results = [False] * n
        self.pages: list[_Page] = []  # its own new pages, in key order (LRU order on completion)
        self.repeats: list[tuple[int, int]] = []  # (position, first position of the same key)
        self.left = 0  # pages (its own and others' it waits for) not yet done
        self.done = done
        self.event = threading.Event() if done is None else None
        self.dirs: dict[int, set[str]] = {}  # page directories committed, per tier (fsync=full)


class WritePath:
    """Owns the write ring, its staging pool, each tier's write queue and flow, and the writer thread.

    :param priority: tells which tiers a read uses now (writes there wait).
    :param staging_limit: staging memory for pages not 4096-aligned in memory, bytes.
    :param ceiling: most bytes one tier may keep in flight (its window's ceiling).
    :param replicate: 'all' or 'budget' (module docstring); ``slack``: replicate_slack, s.
    :param backlog: bytes of pages not yet done beyond which ``put_deferred`` waits.
    """

    def __init__(self, ring, tiers: list[Tier], index: Index, stats: Stats, pool: BufferPool,
                 chunk: int, digest: str, priority: ReadPriority, *, staging_limit: int = STAGING_LIMIT,
                 ceiling: int = STAGING_LIMIT, replicate: str = "all", slack: float = 0.0,
                 backlog: int = 2 << 30):
        n = len(tiers)
        self.ring = ring
        self.chunk = chunk
        self.digest = digest
        self.tiers = tiers
        self.index = index
        self.stats = stats
        self.pool = pool
        self.priority = priority
        self.staging_limit = staging_limit
        self.replicate, self.slack, self.backlog_limit = replicate, slack, backlog
        unit = max(chunk, WRITE_UNIT)
        self.flows = [TierFlow(unit, ceiling) for _ in tiers]  # write window, request size, bandwidth
        self.busy = BusyClock(n)
        self.lock = threading.Lock()  # held by the writer thread while it works, and by exclusive()
        self._qlock = threading.Lock()  # the queues: taken briefly, by callers and the writer
        self._work = threading.Condition(self._qlock)  # the writer waits here for work
        self._room = threading.Condition(self._qlock)  # deferred puts wait here for backlog room
        self._fifo: list[deque[_Page]] = [deque() for _ in tiers]  # pages waiting for a job on tier k
        self._copies: list[deque[_Page]] = [deque() for _ in tiers]  # catch-up copies: after the FIFO
        self.on_thin: Callable[[list[str]], None] = lambda keys: None  # pages that now lack a tier
        self._active: list[list[_Job]] = [[] for _ in tiers]  # jobs started and not finished, per tier
        self._pending: dict[str, _Page] = {}  # key -> the page being written
        self.queued = [0] * n  # bytes accepted for tier k and not yet written (P_k), file bytes
        self.measured = [0] * n  # bytes written undisturbed by reads (what the flow's rate is measured on)
        self.backlog = 0  # bytes of pages accepted and not done
        self._in_flight = [0] * n  # bytes of writes in flight per tier
        self._ops: dict[int, tuple[_Job, int, float, int, int]] = {}  # tag -> (job, bytes, t0, ahead, epoch)
        self._tags = itertools.count(1)
        self._staged = 0  # staging bytes held by pages with a job in flight
        self._fd_short = False  # a temporary file failed with EMFILE: wait for one of ours to close
        self._fd_retry_at = 0.0
        self._fd_since: float | None = None
        self._held_since: list[float | None] = [None] * n
        self._busy_seen = [0.0] * n
        self._wakes = 0
        self._exclusive = 0
        self._closing = False
        priority.listen(self._wake)
        self._thread = threading.Thread(target=self._run, name="kvstream-writer", daemon=True)
        self._thread.start()

    # -- callers ---------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], mask: int) -> list[bool]:
        """See Engine.put. ``mask``: tiers usable for this batch. Returns when its pages are done."""
        call = self._accept(keys, pages, mask, None)
        if call.event is not None:
            call.event.wait()
        return call.results

    def put_deferred(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], mask: int,
                     done: Callable[[list[bool]], None]) -> None:
        """See Engine.put_deferred: waits only while the backlog is full (back-pressure)."""
        if len(pages) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(pages)} pages")
        need = sum(n for segments in pages for _, n in segments)
        with self._qlock:
            if self.backlog and self.backlog + need > self.backlog_limit and not self._closing:
                t0 = time.perf_counter()
                self.stats.total("backpressure_waits")
                self._room.wait_for(lambda: not self.backlog or self.backlog + need <= self.backlog_limit
                                    or self._closing)
                self.stats.total("backpressure_s", time.perf_counter() - t0)
        self.stats.total("deferred_puts")
        self._accept(keys, pages, mask, done)

    def copy(self, key: str, address: int, info, created: int, tier: int, evict: bool,
             done: Callable[[bool], None]) -> None:
        """Background replication (replication.py): write the page ``info`` describes, its payload at
        ``address`` (4096-aligned, padded), to ``tier`` after the tier's foreground FIFO, held back by
        reads as any write; ``evict``: it may evict LRU pages to make room. ``done(committed, seconds)``
        runs on the writer thread (seconds: from the job's start on the tier to its end). Not a put: no put counter moves, and the budget does not count it."""
        page = _Page(key, [(address, round_up(info.length))], info.length, info.block, 1 << tier)
        page.length, page.crcs, page.created, page.evict, page.copied = info.length, info.crcs, created, evict, done
        page.data = [(address, round_up(info.length), HEADER_SIZE)]
        page.left = 1
        with self._qlock:
            if self._closing:
                raise EngineClosedError("kvstream engine is closed")
            self._copies[tier].append(page)
            self._work.notify()

    def idle(self, k: int) -> bool:
        """No foreground page waits for a job on tier ``k`` (catch-up never goes ahead of a put)."""
        return not self._fifo[k]

    def writing(self, key: str) -> bool:
        """A put is writing ``key`` now."""
        return key in self._pending

    @contextmanager
    def exclusive(self):
        """No write progresses inside (check, clear): the writer finishes its step and waits."""
        with self._qlock:
            self._exclusive += 1
        try:
            with self.lock:
                yield
        finally:
            with self._qlock:
                self._exclusive -= 1
                self._work.notify_all()

    def cancel_locked(self) -> None:
        """clear(): drop every queued job and discard the ones in flight (their pages report False).
        Called inside :meth:`exclusive`."""
        with self._qlock:
            dropped = [(page, k) for queues in (self._fifo, self._copies) for k, fifo in enumerate(queues)
                       for page in fifo]
            for fifo in (*self._fifo, *self._copies):
                fifo.clear()
        for jobs in self._active:
            for job in list(jobs):
                job.err = CANCELLED
                if not job.in_flight:  # (held back between two of its writes) nothing will reap it
                    self._finish_job_locked(job)
        for page, k in dropped:
            self._job_over(page, k)

    def close(self) -> None:
        """Write what is queued, stop the writer, close the ring. Idempotent."""
        with self._qlock:
            self._closing = True
            self._work.notify_all()
            self._room.notify_all()
        self._thread.join()
        with self.lock:
            self.ring.close()
            self.pool.close()

    # -- accept ----------------------------------------------------------------------------------
    def _accept(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], mask: int,
                done: Callable[[list[bool]], None] | None) -> _Call:
        if len(pages) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(pages)} pages")
        call = _Call(len(keys), done)
        # Pages the index already has are looked at on disk before the queue lock is taken: a get's
        # end takes that lock to wake the writer, and must not wait behind these stats.
        held: set[str] = set()
        for key in keys:
            if is_valid_key(key) and key not in held and self.index.contains(key, mask) \
                    and self._still_held(key, mask):
                held.add(key)
        with self._qlock:
            if self._closing:  # close() ran while this call was on its way in
                raise EngineClosedError("kvstream engine is closed")
            self.stats.total("puts")
            self.stats.total("pages_put", len(keys))
            self._enqueue_locked(call, keys, pages, mask, held)
            now = not call.left  # else the writer thread ends it
        if now:
            self._signal(call)  # nothing to write (held, invalid, no tier can take it): done now
        return call

    def _enqueue_locked(self, call: _Call, keys: Sequence[str], pages: Sequence[Sequence[Segment]],
                        mask: int, held: set[str]) -> None:
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            if not is_valid_key(key):
                self.stats.total("invalid_keys")
                log.warning("kvstream: refused to store invalid key %r", key)
                continue
            if key in first:
                call.repeats.append((i, first[key]))
                continue
            first[key] = i
            segments = pages[i]
            length = sum(n for _, n in segments)
            if length <= 0 or any(n < 0 for _, n in segments):
                self.stats.total("pages_failed")
                continue
            writing = self._pending.get(key)
            if writing is not None:  # another put is writing it: wait for that copy
                writing.calls.append((call, i))
                call.left += 1
                for k in writing.committed:  # fsync=full: the tiers done already
                    call.dirs.setdefault(k, set()).add(self.tiers[k].layout.page_dir(key))
                continue
            if key in held and self.index.contains(key, mask):
                self.index.touch(key)
                self.stats.total("pages_existing")
                call.results[i] = True
                continue
            page = _Page(key, segments, length, block_size_for(length, self.chunk),
                         mask & ~self.index.holders(key))
            page.calls.append((call, i))
            call.pages.append(page)
        self._fit_capacity(call.pages)
        failed_tiers = ((1 << len(self.tiers)) - 1) & ~mask
        for page in call.pages:
            page.expected = page.targets | failed_tiers
            self._admit(page)
            if not page.targets:  # no tier can take it (capacity, every tier failed): False
                self.stats.total("pages_failed")
                continue
            call.left += 1
            self._pending[page.key] = page
            self.backlog += page.length
            for k in tiers_in(page.targets):
                self._fifo[k].append(page)
                page.left += 1
        call.pages = [p for p in call.pages if p.targets]
        if call.left:
            self._work.notify()

    def _still_held(self, key: str, mask: int) -> bool:
        """Whether a usable tier the index lists for ``key`` still has its file (one stat per tier
        until one does). A put answers True without writing only then: a copy deleted behind the
        engine's back (an operator, another process's eviction) is forgotten and written again."""
        for k in tiers_in(self.index.holders(key) & mask):
            try:
                os.stat(self.tiers[k].layout.page_path(key))
                return True
            except FileNotFoundError:
                if not self.tiers[k].fail(errno.ENOENT, f"look up {key}"):
                    self.index.remove(key, k)  # this file alone is gone (a tier that went keeps its
                                               # entries, as on a read: its copies may come back with it)
            except OSError:  # cannot tell (EIO, ESTALE...): the entry stays, the page is written again
                pass
        return False

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

    def _admit(self, page: _Page) -> None:
        """The home tier (the page's first target) takes the page; under replicate=budget another
        tier takes it only if its pending writes plus the page drain no later than the home tier's,
        or than the slack: a replica that would delay the next reads is skipped."""
        if not page.targets:
            return
        home = (page.targets & -page.targets).bit_length() - 1
        s = page.file_bytes
        self.queued[home] += s
        w_home = self._bandwidth(home)
        for k in tiers_in(page.targets & ~(1 << home)):
            if self.replicate == "budget" and not replica_fits(self.queued[k], s, self._bandwidth(k),
                                                               self.queued[home], w_home, self.slack):
                page.targets &= ~(1 << k)
                page.expected &= ~(1 << k)
                self.stats.add(k, "replica_skipped_pages")
                self.stats.add(k, "replica_skipped_bytes", s)
                continue
            self.queued[k] += s

    def _bandwidth(self, k: int) -> float:
        """Tier k's write bandwidth (bytes/s, undisturbed by reads), or 0 until TRUST_BYTES were
        measured (the budget admits every replica until then)."""
        return self.flows[k].rate if self.measured[k] >= TRUST_BYTES else 0.0

    # -- the writer thread -----------------------------------------------------------------------
    def _wake(self) -> None:
        """A tier's last read ended (priority listener) or new work came: the writer looks again."""
        with self._qlock:
            self._wakes += 1
            self._work.notify()

    def _has_work(self) -> bool:
        return bool(self._ops) or any(self._fifo) or any(self._copies) or any(self._active)

    def _run(self) -> None:
        while True:
            with self._qlock:
                self._work.wait_for(lambda: (self._has_work() and not self._exclusive) or
                                    (self._closing and not self._has_work()))
                if not self._has_work():
                    return
                wakes = self._wakes
            with self.lock:
                try:
                    idle = self._step()
                except Exception:  # a bug must not hang every caller: fail what is pending, live on
                    log.exception("kvstream: write path error; the pages being written are reported failed")
                    self._abandon_locked()
                    continue
            if idle is not None:  # nothing in flight: queued jobs wait for reads to end or stall
                with self._qlock:  # (or for descriptors); a wake-up since the step cuts it short
                    if self._wakes == wakes and not self._exclusive:
                        self._work.wait(idle or None)

    def _step(self) -> float | None:
        """Start and submit what each tier may take now, then reap what completes within WAKE_S.
        Returns None, or when nothing is in flight how long to wait for a wake-up (0: no limit)."""
        held, until = self.priority.held()
        self._account_held(held)
        self._submit_locked(held)
        if self._ops:
            done = [(self._ops.pop(tag), res) for tag, res in self.ring.reap(1, WAKE_S)]
            now = time.monotonic()
            for op, res in done:
                self._complete_locked(op, res, now)
            self._account_busy()
            return None
        timeout = until
        retry = self._fd_retry_at - time.monotonic()
        if retry > 0:
            timeout = retry if timeout is None else min(timeout, retry)
        return 0.0 if timeout is None else max(timeout, 1e-3)

    def _account_held(self, held: int) -> None:
        """Time each tier's queued writes spent waiting for its reads (stats ``write_held_s``)."""
        now = time.monotonic()
        for k in range(len(self.tiers)):
            waiting = held >> k & 1 and bool(self._fifo[k] or self._active[k])
            since = self._held_since[k]
            if waiting and since is None:
                self._held_since[k] = now
            elif not waiting and since is not None:
                self.stats.add(k, "write_held_s", now - since)
                self._held_since[k] = None

    def _account_busy(self) -> None:
        for k, busy in enumerate(self.busy.snapshot()):
            if busy > self._busy_seen[k]:
                self.stats.add(k, "write_busy_s", busy - self._busy_seen[k])
                self._busy_seen[k] = busy

    # -- submit ----------------------------------------------------------------------------------
    def _submit_locked(self, held: int) -> None:
        ops = []
        entries = []
        now = time.monotonic()
        bounded = self.priority.enabled  # off: every job in flight at once (the behaviour before)
        try:
            for k in range(len(self.tiers)):
                if held >> k & 1:
                    continue
                window = self.flows[k].window if bounded else math.inf
                while self._in_flight[k] < window:
                    job = self._next_job_locked(k, now)
                    if job is None:
                        break
                    buf, n, offset = job.ops[job.next]
                    job.next += 1
                    job.in_flight += 1
                    tag = next(self._tags)
                    ops.append((OP_WRITE, job.fd, buf, offset, tag))
                    reading = self.priority.reading(k)
                    entries.append((tag, job, n, k, -1 if reading else self.priority.epoch(k)))
                    self.flows[k].submitted(now, self._in_flight[k])
                    self._ops[tag] = (job, n, now, self._in_flight[k], entries[-1][4])
                    self._in_flight[k] += n
                    self.busy.started(k)
            if ops:
                self.ring.submit(ops)
        except BaseException:  # nothing of this batch was queued (the ring validates a batch first):
            # undo what was recorded for it, so that no op waits for a completion that never comes
            for tag, job, n, k, _ in entries:
                del self._ops[tag]
                job.next -= 1
                job.in_flight -= 1
                self._in_flight[k] -= n
                self.busy.finished(k)
            raise

    def _next_job_locked(self, k: int, now: float) -> _Job | None:
        """The job of tier ``k`` with a write left to submit: a started one, else the next page of
        its FIFO (None: none, or none can start now: descriptors, staging memory)."""
        for job in self._active[k]:
            if job.err == 0 and job.next < len(job.ops):
                return job
        while True:
            if len(self._active[k]) >= MAX_OPEN_FILES or self._fd_short or now < self._fd_retry_at:
                return None
            with self._qlock:
                fifo = self._fifo[k] or self._copies[k]  # catch-up copies only when no put waits
                if not fifo:
                    return None
                page = fifo[0]
            if not page.aligned and page.staging is None and self._staged and \
                    self._staged + round_up(page.length) > self.staging_limit:
                return None  # staging memory is in use by pages in flight: wait for one
            started = self._start_job_locked(page, k)
            if started is False:
                return None  # out of descriptors: the page stays first in line
            with self._qlock:
                fifo.popleft()
            if started is not None:
                return started
            # the page could not go to this tier (failed tier, capacity, error): next one

    def _start_job_locked(self, page: _Page, k: int) -> _Job | None | bool:
        """A job for ``page`` on tier ``k``, ready to submit; None when the page cannot go there (the
        reason is counted); False when no descriptor is free (try again later)."""
        tier = self.tiers[k]
        if not tier.healthy:  # failed since the put was accepted: the page misses it (under-replicated)
            self._job_over(page, k)
            return None
        try:  # the file first: a page evicted to make room for a write that cannot start is lost for nothing
            fd, tmp = tier.create_tmp()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                return self._out_of_descriptors(page, k)
            self._failed_locked(k, exc.errno or errno.EIO, f"create temporary file for {page.key}")
            self._job_over(page, k)
            return None
        self._fd_since = None
        victims = self.index.reserve(k, page.file_bytes, evict=page.evict)
        if victims is None:
            tier.discard(fd, tmp)
            if page.copied is None:  # (a catch-up copy that finds no room counts as dropped, replication.py)
                self.stats.add(k, "skipped_writes")
            log.debug("kvstream: tier %d cannot make room for page %s (capacity, pinned pages)", k, page.key)
            self._job_over(page, k)
            return None
        self._evicted_locked(k, victims)
        page.users += 1
        try:
            self._prepare_locked(page)
        except BaseException:
            page.users -= 1
            self._release_locked(page)
            tier.discard(fd, tmp)
            self.index.abort(k, page.file_bytes)
            raise
        request = self.flows[k].request if self.priority.enabled else math.inf
        job = _Job(page, k, fd, tmp, _requests(page, request))
        page.started = time.monotonic()
        self._active[k].append(job)
        return job

    def _out_of_descriptors(self, page: _Page, k: int) -> bool | None:
        """EMFILE/ENFILE: never a failure while our own files can close and free one; with none of
        ours open, retry for FD_GIVE_UP_S, then fail this (page, tier)."""
        now = time.monotonic()
        if any(self._active):
            self._fd_short = True  # cleared when one of our jobs closes its file
            return False
        if self._fd_since is None:
            self._fd_since = now
            log.warning("kvstream: out of file descriptors (the process's limit); writes wait for one")
        if now - self._fd_since < FD_GIVE_UP_S:
            self._fd_retry_at = now + FD_RETRY_S
            return False
        # Given up: this (page, tier) fails, and so does every next one at once until a create
        # succeeds (which resets _fd_since), instead of each waiting FD_GIVE_UP_S again.
        self.stats.add(k, "write_failures")
        self._job_over(page, k)
        return None

    def _prepare_locked(self, page: _Page) -> None:
        """Checksums (once per page), the header, and where the payload is written from: the caller's
        memory (aligned) or a staging copy, held while a job of the page is in flight."""
        if page.aligned:
            if page.crcs is None:
                payload = Payload(page.segments)
                page.data = [(address, n, HEADER_SIZE + start)
                             for (address, n), start in zip(page.segments, payload.starts) if n]
                page.crcs = block_crcs(page.segments, page.length, page.block)
        elif page.staging is None:
            padded = round_up(page.length)
            staging = page.staging = self.pool.get(padded)
            self._staged += padded
            Payload(page.segments).gather(staging.address)
            if padded > page.length:
                ctypes.memset(staging.address + page.length, 0, padded - page.length)
            page.data = [(staging.address, padded, HEADER_SIZE)]
            if page.crcs is None:
                page.crcs = block_crcs([(staging.address, page.length)], page.length, page.block)
        if page.header is None:
            if not page.created:
                page.created = time.time_ns()
            page.header = self.pool.get(HEADER_SIZE)
            pack_header(PageHeader(page.key, self.digest, page.length, page.block, page.crcs, page.created),
                        page.header)

    def _release_locked(self, page: _Page) -> None:
        """No job of the page in flight: its staging copy and header go back (a later job of another
        tier copies again from the caller's memory, which stays valid until the page is done)."""
        if page.users:
            return
        if page.staging is not None:
            self._staged -= page.staging.nbytes
            self.pool.put(page.staging)
            page.staging = None
        if page.header is not None:
            self.pool.put(page.header)
            page.header = None

    # -- completions -----------------------------------------------------------------------------
    def _complete_locked(self, op: tuple, res: int, now: float) -> None:
        job, want, t0, ahead, epoch = op
        k = job.tier
        self._in_flight[k] -= want
        self.busy.finished(k)
        flow = self.flows[k]
        # A write measures the tier's bandwidth only if no read started on the tier meanwhile:
        # writes held back or slowed by reads must not lower it.
        if epoch >= 0 and epoch == self.priority.epoch(k) and not self.priority.reading(k):
            if want * 2 >= flow.request or len(job.ops) == 1:  # (not a page's short last write)
                flow.completed(max(res, 0), now - t0, ahead, now, self.busy.total(k))
                self.measured[k] += max(res, 0)
        else:
            flow.disturbed(self.busy.total(k))
        job.in_flight -= 1
        if res != want and not job.err:
            job.err = -res if res < 0 else self._short_write_errno(job)
        if not job.in_flight and (job.err or job.next == len(job.ops)):
            self._finish_job_locked(job)

    def _finish_job_locked(self, job: _Job) -> None:
        page, k = job.page, job.tier
        tier = self.tiers[k]
        if job.err == 0:
            try:
                try:
                    fd, job.fd = job.fd, None  # commit closes it, whatever happens
                    page_dir = tier.commit(fd, job.tmp, page.key)
                except OSError as exc:
                    # No file name: fdatasync failed, the data is not sealed; never retried.
                    if exc.errno not in SPACE_ERRNOS or exc.filename is None or not page.evict:
                        raise
                    page_dir = self._place_after_eviction_locked(job, exc)
            except OSError as exc:
                tier.discard(None, job.tmp)
                self.index.abort(k, page.file_bytes)
                self._failed_locked(k, exc.errno or errno.EIO, f"commit {page.key}")
                self._close_job(job)
                return
            # A copy of other content on another tier (a failed tier's, another writer's) leaves the
            # index, so it is never served against these checksums; its file is a valid page and stays.
            # A background copy is the tier's least recent page (the first to go when room is needed: it
            # never costs a page the tier chose to keep); a put's page, or a promoted one, the most recent.
            self.index.commit(page.key, k, page.length, page.block, page.crcs, page.file_bytes,
                              oldest=not page.evict)
            page.committed.append(k)
            for call, _ in page.calls:
                call.dirs.setdefault(k, set()).add(page_dir)
            self.stats.add(k, "bytes_written", page.length)
            self.stats.add(k, "pages_written")
            self._close_job(job)
            return
        if job.err in SPACE_ERRNOS and page.evict and job.tries < SPACE_RETRIES and self._room_possible_locked(job):
            victims = self.index.evict(k, page.file_bytes)
            if victims:
                self._evicted_locked(k, victims)
                job.tries += 1
                job.err = 0
                job.next = 0  # write it all again
                return
        tier.discard(job.fd, job.tmp)
        self.index.abort(k, page.file_bytes)
        if job.err != CANCELLED and not (page.copied is not None and job.err in SPACE_ERRNOS):
            self._failed_locked(k, job.err, f"write {page.key}")  # (a full tier refusing a catch-up copy: dropped)
        self._close_job(job)

    def _close_job(self, job: _Job) -> None:
        """The job's file is closed (committed or discarded): its slot and its page's buffers free up."""
        self._active[job.tier].remove(job)
        self._fd_short = False
        job.page.users -= 1
        self._release_locked(job.page)
        self._job_over(job.page, job.tier)

    def _job_over(self, page: _Page, k: int) -> None:
        """One tier of the page is done (written, failed or skipped); the last one ends the page."""
        if page.copied is not None:
            page.copied(bool(page.committed), time.monotonic() - page.started if page.started else 0.0)
            return
        with self._qlock:  # (callers add to queued and backlog under it too)
            self.queued[k] -= page.file_bytes
            page.left -= 1
            if page.left:
                return
            if self._pending.get(page.key) is page:
                del self._pending[page.key]
            self.backlog -= page.length
            self._room.notify_all()
        ok = bool(page.committed)
        if ok:
            self.stats.total("pages_stored")
            if page.expected & ~self.index.holders(page.key):
                self.stats.total("under_replicated")
        else:
            self.stats.total("pages_failed")
        if ok and len(page.committed) < len(self.tiers):
            self.on_thin([page.key])  # a skipped or failed replica: background replication owes it
        for call, i in page.calls:
            call.results[i] = ok
            call.left -= 1
            if not call.left:
                self._end_call(call)

    def _end_call(self, call: _Call) -> None:
        unsynced = set()
        for k, dirs in call.dirs.items():
            if self.tiers[k].fsync == "full" and dirs:
                try:
                    self.tiers[k].sync_dirs(dirs)
                except OSError as exc:
                    unsynced.add(k)
                    self.tiers[k].fail(exc.errno or errno.EIO, "fsync directory")
        if unsynced:  # fsync=full promises a copy that survives a crash: none may have
            for page in call.pages:
                if page.committed and set(page.committed) <= unsynced:
                    for owner, i in page.calls:
                        if owner is call:
                            call.results[i] = False
        for page in call.pages:
            if page.committed:
                self.index.touch(page.key)  # LRU order = batch order, not completion order
        self._signal(call)

    def _signal(self, call: _Call) -> None:
        for i, j in call.repeats:
            call.results[i] = call.results[j]
        if call.event is not None:
            call.event.set()
            return
        try:
            call.done(call.results)
        except Exception:
            log.exception("kvstream: a deferred put's completion callback failed")

    def _abandon_locked(self) -> None:
        """After an unexpected error: wait for the writes in flight (they read caller memory), then
        discard every job and fail every page still pending, so that no caller waits forever."""
        while self.ring.in_flight:
            for tag, _ in self.ring.reap(1, None):
                self._ops.pop(tag, None)  # (reaped by the step that failed: already popped)
        for tag in list(self._ops):  # recorded but never completed: nothing will reap them now
            self._ops.pop(tag)
        for k, jobs in enumerate(self._active):
            self._in_flight[k] = 0
            if self.busy.in_flight[k]:
                self.busy.finished(k, self.busy.in_flight[k])
            for job in jobs:
                job.in_flight = 0
        self.cancel_locked()

    # -- errors ----------------------------------------------------------------------------------
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

