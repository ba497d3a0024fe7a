"""The write path: every put's pages go through one queue per tier, written by one writer thread,
bounded per tier, and held back on a tier while a read uses it.

Data flow (``put`` waits for its pages; ``put_deferred`` returns at once and calls back)::

    accept (the caller's thread):
        keys already held by a usable tier -> touch (most recent), True, no I/O (idempotent, cheap);
        a key another put is writing now -> waits for that page (written once)
        admission (admission.py): capacity, then replicate=budget; a skipped replica is counted,
            not a failure
        -> one job per (page, tier) at the back of that tier's FIFO
    the writer thread, per tier, while the tier has no read in flight (priority.py) and its bytes in
    flight are within its window (flow.py: the window and request size follow the device):
        start the next job: reserve capacity (LRU victims deleted first), open a temporary file
            (at most TMP_FILES_PER_TIER per tier, files.py: a put of any size holds a bounded
            number of descriptors), checksums (once per page) and the header; a page not 4096-aligned in
            memory is copied into staging (the write half of ``memory``) while a job of it is in flight
        submit its header and payload in requests of the flow's size (inflight.py)
        on completion: Tier.commit ([fdatasync] -> rename into place) -> index commit; ENOSPC ->
            evict LRU on that tier and rewrite (or rename again), up to SPACE_RETRIES times
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

import errno
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from .admission import admit, fit_capacity
from .errors import EngineClosedError
from .files import OUT_OF_DESCRIPTORS, TMP_FILES_PER_TIER, Shortage
from .index import Index, tiers_in
from .inflight import InFlight
from .io import OP_WRITE
from .layout import HEADER_SIZE, block_size_for, is_valid_key, round_up
from .priority import ReadPriority
from .puts import PutCall, WritePage
from .segments import Segment
from .staging import BufferPool
from .stats import Stats
from .tiers import SPACE_ERRNOS, SPACE_RETRIES, Tier

log = logging.getLogger("kvstream")

WAKE_S = 0.002  # longest wait for a write completion: a tier whose reads ended, or new work for an idle
# tier, is noticed within this (the reads' end also wakes the writer when nothing is in flight)
CANCELLED = -1  # job.err of a job that clear() cancelled
TRUST_BYTES = 32 << 20  # replicate=budget judges a tier by its write bandwidth only once this much was
# written to it undisturbed: a few small writes measure latency (and a stall), not bandwidth
WRITE_UNIT = 1 << 20  # write requests are whole multiples of this (or of the chunk, if larger), bytes: a
# smaller chunk is a checksum unit, not a reason for more, smaller writes


class WriteSettings(NamedTuple):
    """The settings the write path reads (a slice of Config: defaults live in config.SETTINGS only)."""

    replicate: str
    replicate_slack: float
    write_backlog: int

    @classmethod
    def of(cls, config) -> "WriteSettings":
        return cls(*(getattr(config, name) for name in cls._fields))


class _Write:
    """One write request in flight: ``nbytes`` of ``job``'s file. ``epoch``: the tier's read epoch
    when submitted (-1: a read was running), so a completion measures the device only undisturbed."""

    __slots__ = ("job", "tier", "nbytes", "epoch", "t0", "ahead", "orphan")

    def __init__(self, job: "_Job", nbytes: int, epoch: int):
        self.job, self.tier, self.nbytes, self.epoch = job, job.tier, nbytes, epoch


class _Job:
    """One page on one tier: a temporary file and the writes that fill it."""

    __slots__ = ("page", "tier", "fd", "tmp", "ops", "next", "in_flight", "err", "tries")

    def __init__(self, page: WritePage, tier: int, fd: int, tmp: str, ops: list[tuple]):
        self.page, self.tier, self.fd, self.tmp, self.ops = page, tier, fd, tmp, ops
        self.next = 0  # ops[next:] not yet submitted
        self.in_flight = 0
        self.err = 0
        self.tries = 0


class WritePath:
    """Owns the write ring's in-flight core (each tier's flow, the writes in flight), its staging
    pool, each tier's write queue, and the writer thread.

    :param priority: tells which tiers a read uses now (writes there wait).
    :param staging_limit: staging memory for pages not 4096-aligned in memory, bytes.
    :param ceiling: most bytes one tier may keep in flight (its window's ceiling).
    :param settings: replicate (admission.py), replicate_slack, write_backlog (bytes of pages not
        yet done beyond which ``put_deferred`` waits).

    Locks: ``lock``, the writer's (held by the writer thread while it works, and by ``exclusive``):
    methods ending ``_under_writer`` run with it held; ``_qlock``, the queues' (callers and the
    writer, briefly; taken under ``lock``, never the other way round): methods ending
    ``_under_queues``.
    """

    def __init__(self, ring, tiers: list[Tier], index: Index, stats: Stats, pool: BufferPool,
                 chunk: int, digest: str, priority: ReadPriority, settings: WriteSettings, *,
                 staging_limit: int, ceiling: int, thinned: Callable[[list[str]], None] = lambda keys: None):
        n = len(tiers)
        self.io = InFlight(ring, n, max(chunk, WRITE_UNIT), ceiling)  # write window, request size, bandwidth
        self.chunk = chunk
        self.digest = digest
        self.tiers = tiers
        self.index = index
        self.stats = stats
        self.pool = pool
        self.priority = priority
        self.staging_limit = staging_limit
        self.settings = settings
        self.lock = threading.Lock()  # held by the writer thread while it works, and by exclusive()
        self._qlock = threading.Lock()  # the queues: taken briefly, by callers and the writer
        self._work = threading.Condition(self._qlock)  # the writer waits here for work
        self._room = threading.Condition(self._qlock)  # deferred puts wait here for backlog room
        self._fifo: list[deque[WritePage]] = [deque() for _ in tiers]  # pages waiting for a job on tier k
        self._copies: list[deque[WritePage]] = [deque() for _ in tiers]  # catch-up copies: after the FIFO
        self.thinned = thinned  # pages a put left on fewer tiers than there are (replication.py owes them)
        self._active: list[list[_Job]] = [[] for _ in tiers]  # jobs started and not finished, per tier
        self._pending: dict[str, WritePage] = {}  # key -> the page being written
        self.queued = [0] * n  # bytes accepted for tier k and not yet written (P_k), file bytes
        self.measured = [0] * n  # bytes written undisturbed by reads (what the flow's rate is measured on)
        self.backlog = 0  # bytes of pages accepted and not done
        self._staged = 0  # staging bytes held by pages with a job in flight
        self._fds = Shortage()
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
            limit = self.settings.write_backlog
            if self.backlog and self.backlog + need > limit and not self._closing:
                t0 = time.perf_counter()
                self.stats.total("backpressure_waits")
                self._room.wait_for(lambda: not self.backlog or self.backlog + need <= limit or self._closing)
                self.stats.total("backpressure_s", time.perf_counter() - t0)
        self.stats.total("deferred_puts")
        self._accept(keys, pages, mask, done)

    def copy(self, key: str, address: int, info, created: int, tier: int, evict: bool,
             done: Callable[[bool, float], None]) -> None:
        """Background replication (replication.py): write the page ``info`` describes, its payload at
        ``address`` (4096-aligned, padded), to ``tier`` after the tier's foreground FIFO, held back by
        reads as any write; ``evict``: it may evict LRU pages to make room. ``done(committed, seconds)``
        runs on the writer thread (seconds: from the job's start on the tier to its end). Not a put: no
        put counter moves, and the budget does not count it."""
        page = WritePage(key, [(address, round_up(info.length))], info.length, info.block, 1 << tier)
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

    def cancel_under_writer(self) -> None:
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
                    self._finish_job_under_writer(job)
        for page, k in dropped:
            self._job_over_under_writer(page, k)

    def close(self) -> None:
        """Write what is queued, stop the writer, close the ring. Idempotent."""
        with self._qlock:
            self._closing = True
            self._work.notify_all()
            self._room.notify_all()
        self._thread.join()
        with self.lock:
            self.io.ring.close()
            self.pool.close()

    # -- accept ----------------------------------------------------------------------------------
    def _accept(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], mask: int,
                done: Callable[[list[bool]], None] | None) -> PutCall:
        if len(pages) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(pages)} pages")
        call = PutCall(len(keys), done)
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
            self._enqueue_under_queues(call, keys, pages, mask, held)
            now = not call.left  # else the writer thread ends it
        if now:
            call.signal()  # nothing to write (held, invalid, no tier can take it): done now
        return call

    def _enqueue_under_queues(self, call: PutCall, keys: Sequence[str], pages: Sequence[Sequence[Segment]],
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
            page = WritePage(key, segments, length, block_size_for(length, self.chunk),
                         mask & ~self.index.holders(key))
            page.calls.append((call, i))
            call.pages.append(page)
        self._admit_under_queues(call.pages, ((1 << len(self.tiers)) - 1) & ~mask)
        for page in call.pages:
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

    def _admit_under_queues(self, new: list[WritePage], failed_tiers: int) -> None:
        """Each new page's target tiers (admission.py), and its bytes queued on them."""
        targets = [page.targets for page in new]
        for k, n in enumerate(fit_capacity([page.file_bytes for page in new], targets, self.index.capacities)):
            if n:
                self.stats.add(k, "skipped_writes", n)
        bandwidth = [self._bandwidth_under_queues(k) for k in range(len(self.tiers))]
        replicate, slack = self.settings.replicate, self.settings.replicate_slack
        for page, wanted in zip(new, targets):
            page.expected = wanted | failed_tiers
            page.targets = admit(page.file_bytes, wanted, self.queued, bandwidth, replicate, slack)
            for k in tiers_in(wanted & ~page.targets):  # a skipped replica: not expected, not a failure
                page.expected &= ~(1 << k)
                self.stats.add(k, "replica_skipped_pages")
                self.stats.add(k, "replica_skipped_bytes", page.file_bytes)
            for k in tiers_in(page.targets):
                self.queued[k] += page.file_bytes

    def _bandwidth_under_queues(self, k: int) -> float:
        """Tier k's write bandwidth (bytes/s, undisturbed by reads), or 0 until TRUST_BYTES were
        measured (the budget admits every replica until then)."""
        return self.io.flows[k].rate if self.measured[k] >= TRUST_BYTES else 0.0

    # -- the writer thread -----------------------------------------------------------------------
    def _wake(self) -> None:
        """A tier's last read ended (priority listener) or new work came: the writer looks again."""
        with self._qlock:
            self._wakes += 1
            self._work.notify()

    def _has_work_under_queues(self) -> bool:
        return bool(len(self.io)) or any(self._fifo) or any(self._copies) or any(self._active)

    def _run(self) -> None:
        while True:
            with self._qlock:
                self._work.wait_for(lambda: (self._has_work_under_queues() and not self._exclusive) or
                                    (self._closing and not self._has_work_under_queues()))
                if not self._has_work_under_queues():
                    return
                wakes = self._wakes
            with self.lock:
                try:
                    idle = self._step_under_writer()
                except Exception:  # a bug must not hang every caller: fail what is pending, live on
                    log.exception("kvstream: write path error; the pages being written are reported failed")
                    self._abandon_under_writer()
                    continue
            if idle is not None:  # nothing in flight: queued jobs wait for reads to end or stall
                with self._qlock:  # (or for descriptors); a wake-up since the step cuts it short
                    if self._wakes == wakes and not self._exclusive:
                        self._work.wait(idle or None)

    def _step_under_writer(self) -> float | None:
        """Start and submit what each tier may take now, then reap what completes within WAKE_S.
        Returns None, or when nothing is in flight how long to wait for a wake-up (0: no limit)."""
        held, until = self.priority.held()
        self._account_held_under_writer(held)
        self._submit_under_writer(held)
        if len(self.io):
            done = self.io.reap(1, WAKE_S)
            now = time.monotonic()
            for write, res in done:
                self._complete_under_writer(write, res, now)
            self._account_busy_under_writer()
            return None
        timeout = until
        retry = self._fds.retry_at - time.monotonic()
        if retry > 0:
            timeout = retry if timeout is None else min(timeout, retry)
        return 0.0 if timeout is None else max(timeout, 1e-3)

    def _account_held_under_writer(self, held: int) -> None:
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

    def _account_busy_under_writer(self) -> None:
        for k, busy in enumerate(self.io.busy.snapshot()):
            if busy > self._busy_seen[k]:
                self.stats.add(k, "write_busy_s", busy - self._busy_seen[k])
                self._busy_seen[k] = busy

    # -- submit ----------------------------------------------------------------------------------
    def _submit_under_writer(self, held: int) -> None:
        writes = []
        now = time.monotonic()
        bounded = self.priority.enabled  # off: every job in flight at once (the behaviour before)
        try:
            for k in range(len(self.tiers)):
                if held >> k & 1:
                    continue
                window = self.io.flows[k].window if bounded else math.inf
                while self.io.bytes[k] < window:
                    job = self._next_job_under_writer(k, now)
                    if job is None:
                        break
                    buf, n, offset = job.ops[job.next]
                    job.next += 1
                    job.in_flight += 1
                    write = _Write(job, n, -1 if self.priority.reading(k) else self.priority.epoch(k))
                    writes.append(write)
                    self.io.add(write, OP_WRITE, job.fd, buf, offset, now)
            self.io.submit()
        except BaseException:  # none of the batch is in flight (InFlight.submit): the jobs take it back
            for write in writes:
                write.job.next -= 1
                write.job.in_flight -= 1
            raise

    def _next_job_under_writer(self, k: int, now: float) -> _Job | None:
        """The job of tier ``k`` with a write left to submit: a started one, else the next page of
        its FIFO (None: none, or none can start now: descriptors, staging memory)."""
        for job in self._active[k]:
            if job.err == 0 and job.next < len(job.ops):
                return job
        while True:
            if len(self._active[k]) >= TMP_FILES_PER_TIER or self._fds.blocked(now):
                return None
            with self._qlock:
                fifo = self._fifo[k] or self._copies[k]  # catch-up copies only when no put waits
                if not fifo:
                    return None
                page = fifo[0]
            if not page.aligned and page.staging is None and self._staged and \
                    self._staged + round_up(page.length) > self.staging_limit:
                return None  # staging memory is in use by pages in flight: wait for one
            started = self._start_job_under_writer(page, k)
            if started is False:
                return None  # out of descriptors: the page stays first in line
            with self._qlock:
                fifo.popleft()
            if started is not None:
                return started
            # the page could not go to this tier (failed tier, capacity, error): next one

    def _prepare_under_writer(self, page: WritePage) -> None:
        self._staged += page.prepare(self.pool, self.digest)

    def _release_under_writer(self, page: WritePage) -> None:
        """No job of the page in flight: its staging copy and header go back (a later job of another
        tier copies again from the caller's memory, which stays valid until the page is done)."""
        if not page.users:
            self._staged -= page.release(self.pool)

    def _start_job_under_writer(self, page: WritePage, k: int) -> _Job | None | bool:
        """A job for ``page`` on tier ``k``, ready to submit; None when the page cannot go there (the
        reason is counted); False when no descriptor is free (try again later)."""
        tier = self.tiers[k]
        if not tier.healthy:  # failed since the put was accepted: the page misses it (under-replicated)
            self._job_over_under_writer(page, k)
            return None
        try:  # the file first: a page evicted to make room for a write that cannot start is lost for nothing
            fd, tmp = tier.create_tmp()
        except OSError as exc:
            if exc.errno in OUT_OF_DESCRIPTORS:
                return self._out_of_descriptors_under_writer(page, k)
            self._failed_under_writer(k, exc.errno or errno.EIO, f"create temporary file for {page.key}")
            self._job_over_under_writer(page, k)
            return None
        self._fds.created()
        victims = self.index.reserve(k, page.file_bytes, evict=page.evict)
        if victims is None:
            tier.discard(fd, tmp)
            if page.copied is None:  # (a catch-up copy that finds no room counts as dropped, replication.py)
                self.stats.add(k, "skipped_writes")
            log.debug("kvstream: tier %d cannot make room for page %s (capacity, pinned pages)", k, page.key)
            self._job_over_under_writer(page, k)
            return None
        self._evicted_under_writer(k, victims)
        page.users += 1
        try:
            self._prepare_under_writer(page)
        except BaseException:
            page.users -= 1
            self._release_under_writer(page)
            tier.discard(fd, tmp)
            self.index.abort(k, page.file_bytes)
            raise
        request = self.io.flows[k].request if self.priority.enabled else math.inf
        job = _Job(page, k, fd, tmp, page.requests(request))
        page.started = time.monotonic()
        self._active[k].append(job)
        return job

    def _out_of_descriptors_under_writer(self, page: WritePage, k: int) -> bool | None:
        """EMFILE/ENFILE (files.py): False to try again later, or None: this (page, tier) fails."""
        if self._fds.hit(any(self._active), time.monotonic()):
            return False
        self.stats.add(k, "write_failures")
        self._job_over_under_writer(page, k)
        return None

    # -- completions -----------------------------------------------------------------------------
    def _complete_under_writer(self, write: _Write, res: int, now: float) -> None:
        job, want, k = write.job, write.nbytes, write.tier
        # A write measures the tier's bandwidth only if no read started on the tier meanwhile:
        # writes held back or slowed by reads must not lower it.
        if write.epoch >= 0 and write.epoch == self.priority.epoch(k) and not self.priority.reading(k):
            if want * 2 >= self.io.flows[k].request or len(job.ops) == 1:  # (not a page's short last write)
                self.io.measure(write, res, now, True)
                self.measured[k] += max(res, 0)
        else:
            self.io.measure(write, res, now, False)
        job.in_flight -= 1
        if res != want and not job.err:
            job.err = -res if res < 0 else self._short_write_errno_under_writer(job)
        if not job.in_flight and (job.err or job.next == len(job.ops)):
            self._finish_job_under_writer(job)

    def _finish_job_under_writer(self, job: _Job) -> None:
        page, k = job.page, job.tier
        tier = self.tiers[k]
        if job.err == 0 and page.copied is not None and not self.index.holders(page.key):
            job.err = CANCELLED  # a catch-up copy of a page deleted (or cleared) meanwhile: not brought back
        if job.err == 0:
            try:
                fd, job.fd = job.fd, None  # commit closes it, whatever happens
                page_dir = tier.commit(fd, job.tmp, page.key, lambda: page.evict and
                                       self._evict_under_writer(k, page.file_bytes))
            except OSError as exc:
                tier.discard(None, job.tmp)
                self.index.abort(k, page.file_bytes)
                self._failed_under_writer(k, exc.errno or errno.EIO, f"commit {page.key}")
                self._close_job_under_writer(job)
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
            self._close_job_under_writer(job)
            return
        if job.err in SPACE_ERRNOS and page.evict and job.tries < SPACE_RETRIES and \
                self._room_possible_under_writer(job):
            if self._evict_under_writer(k, page.file_bytes):
                job.tries += 1
                job.err = 0
                job.next = 0  # write it all again
                return
        tier.discard(job.fd, job.tmp)
        self.index.abort(k, page.file_bytes)
        if job.err != CANCELLED and not (page.copied is not None and job.err in SPACE_ERRNOS):
            self._failed_under_writer(k, job.err, f"write {page.key}")  # (a full tier refusing a copy: dropped)
        self._close_job_under_writer(job)

    def _close_job_under_writer(self, job: _Job) -> None:
        """The job's file is closed (committed or discarded): its slot and its page's buffers free up."""
        self._active[job.tier].remove(job)
        self._fds.closed()
        job.page.users -= 1
        self._release_under_writer(job.page)
        self._job_over_under_writer(job.page, job.tier)

    def _job_over_under_writer(self, page: WritePage, k: int) -> None:
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
            self.thinned([page.key])  # a skipped or failed replica: background replication owes it
        for call, i in page.calls:
            call.results[i] = ok
            call.left -= 1
            if not call.left:
                self._end_call_under_writer(call)

    def _end_call_under_writer(self, call: PutCall) -> None:
        call.sync_dirs(self.tiers)
        for page in call.pages:
            if page.committed:
                self.index.touch(page.key)  # LRU order = batch order, not completion order
        call.signal()

    def _abandon_under_writer(self) -> None:
        """After an unexpected error: wait for the writes in flight (they read caller memory), then
        discard every job and fail every page still pending, so that no caller waits forever."""
        while self.io.ring.in_flight:
            self.io.reap(1, None)
        self.io.abandon()  # (recorded but never completed: nothing will reap them now)
        for jobs in self._active:
            for job in jobs:
                job.in_flight = 0
        self.cancel_under_writer()

    # -- errors ----------------------------------------------------------------------------------
    def _evict_under_writer(self, k: int, nbytes: int) -> bool:
        """Evict LRU pages of tier ``k`` to make room for ``nbytes``; False: nothing left to evict."""
        victims = self.index.evict(k, nbytes)
        self._evicted_under_writer(k, victims)
        return bool(victims)

    def _room_possible_under_writer(self, job: _Job) -> bool:
        """Could evicting every page of this namespace on the tier make room for the job? If not
        (a page larger than the file system, or one full of other data), evicting would only
        throw pages away: the write fails for this tier and nothing is evicted."""
        free = self.tiers[job.tier].free_bytes(job.fd)  # (what the job already holds is reused)
        return free is None or free + self.index.used[job.tier] >= job.page.file_bytes  # (None: cannot
        # tell: try eviction)

    def _short_write_errno_under_writer(self, job: _Job) -> int:
        """A write that stopped early: the ring reports the bytes done, not the error that
        followed. A nearly full file system means ENOSPC (evict and retry), else EIO."""
        free = self.tiers[job.tier].free_bytes()
        return errno.ENOSPC if free is not None and free < 2 * job.page.file_bytes else errno.EIO

    def _evicted_under_writer(self, k: int, victims: list[str]) -> None:
        for key in victims:
            self.tiers[k].unlink_page(key)
        if victims:
            self.stats.add(k, "evictions", len(victims))

    def _failed_under_writer(self, k: int, err: int, what: str) -> None:
        self.stats.add(k, "write_failures")
        self.stats.add(k, "errors")
        if not self.tiers[k].fail(err, what) and err not in SPACE_ERRNOS:
            log.warning("kvstream: tier %d: %s failed: %s", k, what, os.strerror(err))

