"""The write path: every put's pages go through one queue per tier, written by one writer thread,
bounded per tier, and held back on a tier while a read uses it.

Data flow (``put`` waits for its pages; ``put_deferred`` returns at once and calls back)::

    accept (the caller's thread, writequeue.py): held keys answer at once, a key being written waits
        for that copy, admission (admission.py) picks the tiers -> the page at the back of each
        target tier's FIFO
    the writer thread, per tier, while the tier has no read in flight (priority.py) and its bytes in
    flight are within its window (flow.py: the window and request size follow the device):
        start the next job (jobs.py: a temporary file, at most Tier.tmp_files per tier, so a
            put of any size holds a bounded number of descriptors; room; checksums and header)
        submit its header and payload in requests of the flow's size (inflight.py): from the caller's
            memory (aligned pages, local tiers), else each request from a staging copy of its own (the
            write half of ``memory`` bounds those in flight, whatever the page size: back-pressure)
        a tier with writes in flight and no completion for write_timeout: failed, its queued pages skip
            it, its jobs abandoned (their files never renamed into place, removed when their writes end)
        when a job's writes are done: jobs.py commits it (rename into place, index; ENOSPC: evict
            and write again, up to SPACE_RETRIES times)
    a page is done when every tier it targets is done; a put when its pages are: fsync=full syncs the
    page directories, then the caller returns (``put``; one ended by Ctrl-C withdraws its pages first:
    puts.PutCall.withdraw) or its callback runs (``put_deferred``), or its caller let go (WritePage.gone). The
    caller's memory is never read after that (but by a hung tier's abandoned writes, never renamed into place).

Read priority holds new writes back, never the ones in flight: when a get starts on a tier, what the
tier had in flight (its window) finishes first. ``put_deferred`` is the paper's M2 (the LMCache
path): pages wait in the queues until their tier has no read in flight, bounded by ``write_backlog``
(writequeue.py). A page is stored when >= 1 tier committed it; fewer than the tiers it should be on
counts as under-replicated (a budget skip excepted).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

from .index import EVICT_FILES, EVICT_PAUSE_S, Index
from .inflight import InFlight
from .io import OP_WRITE
from .jobs import Jobs
from .flow import MAX_REQUEST
from .layout import ALIGN, round_up
from .locks import ranked_lock
from .priority import ReadPriority
from .puts import CANCELLED, Job, PutCall, Write, WritePage
from .segments import Segment
from .staging import BufferPool
from .stats import Stats
from .tiers import Tier
from .writequeue import WriteQueue, WriteSettings

log = logging.getLogger("kvstream")

WAKE_S = 0.002  # longest wait for a write completion: a tier whose reads ended, or new work for an idle
# tier, is noticed within this (the reads' end also wakes the writer when nothing is in flight)
TRUST_BYTES = 32 << 20  # replicate=budget judges a tier by its write bandwidth only once this much was
# written to it undisturbed: a few small writes measure latency (and a stall), not bandwidth
ORPHAN_POLL_S = 0.1  # with only abandoned writes in flight (a hung tier), the writer looks for their end this often, s
TRIM_BYTES = 256 << 20  # a trim (scan end, a capacity lowered) removes this much per hold of the writer's lock
WRITE_UNIT = 1 << 20  # write requests are whole multiples of this (or of the chunk, if larger), bytes: a
# smaller chunk is a checksum unit, not a reason for more, smaller writes


class WritePath:
    """Owns the write ring's in-flight core (each tier's flow, the writes in flight), its staging
    pool, the write queues (``queue``, writequeue.py), and the writer thread.

    :param priority: tells which tiers a read uses now (writes there wait).
    :param staging_limit: staging memory for the staged write requests in flight, bytes.
    :param ceiling: most bytes one tier may keep in flight (its window's ceiling).
    :param settings: the queue's (writequeue.py): replicate, replicate_slack, write_backlog.

    Locks: ``lock``, the writer's (held by the writer thread while it works, and by ``exclusive``):
    methods ending ``_under_writer`` run with it held; ``queue.lock``, the queues' (callers and the
    writer, briefly; taken under ``lock``, never the other way round): methods ending
    ``_under_queues``.
    """

    def __init__(self, ring, tiers: list[Tier], index: Index, stats: Stats, pool: BufferPool,
                 chunk: int, digest: str, priority: ReadPriority, settings: WriteSettings, *,
                 reopen: Callable[[], object], staging_limit: int, ceiling: int,
                 thinned: Callable[[list[str]], None] = lambda keys: None):
        n = len(tiers)
        self.io = InFlight(ring, n, max(chunk, WRITE_UNIT), ceiling, lambda: self._set_up(reopen()), "write")
        self.tiers = tiers
        self.index = index
        self.stats = stats
        self.pool = pool
        self.priority = priority
        self.staging_limit = staging_limit
        self.lock = ranked_lock("write")  # held by the writer thread while it works, and by exclusive()
        self.queue = WriteQueue(tiers, index, stats, chunk, settings, self._bandwidth_under_queues, thinned)
        self.jobs = Jobs(tiers, index, stats, pool, self.queue, digest)  # each page on each tier (jobs.py)
        self.measured = [0] * n  # bytes written undisturbed by reads (what the flow's rate is measured on)
        self._staged = 0  # staging bytes held by writes in flight (at most staging_limit)
        self._piece = max(ALIGN, min(MAX_REQUEST, staging_limit // ALIGN * ALIGN))  # a staged request's most
        self._set_up(ring)
        self.write_timeout = settings.write_timeout
        self._progress = [0.0] * n  # when each tier's writes in flight last progressed (hang clock)
        self._held_since: list[float | None] = [None] * n
        self._busy_seen = [0.0] * n
        priority.listen(self.queue.wake)
        self._thread = threading.Thread(target=self._run, name="kvstream-writer", daemon=True)
        self._thread.start()

    # -- callers ---------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], mask: int) -> list[bool]:
        """See Engine.put. ``mask``: tiers usable for this batch. Returns when its pages are done."""
        call = PutCall(len(keys), None)
        try:
            self.queue.accept(keys, pages, mask, call)
            call.event.wait()
        except BaseException:  # (Ctrl-C in accept or the wait: nothing of it starts after, PutCall.withdraw)
            call.withdraw(self.exclusive, self.jobs.withdraw_under_writer)
            raise
        return call.results

    def put_deferred(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], mask: int,
                     done: Callable[[list[bool]], None], gate=None) -> None:
        """See Engine.put_deferred: waits only while the backlog is full (back-pressure)."""
        if len(pages) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(pages)} pages")
        self.queue.wait_for_room(keys, [sum(n for _, n in segments) for segments in pages], mask)
        self.stats.total("deferred_puts")
        self.queue.accept(keys, pages, mask, PutCall(len(keys), done, gate))

    def copy(self, key: str, address: int, info, created: int, tier: int, evict: bool,
             done: Callable[[bool, float], None]) -> None:
        """Background replication (replication.py): write the page ``info`` describes, its payload at
        ``address`` (4096-aligned, padded), to ``tier`` after the tier's foreground FIFO, held back by
        reads as any write; ``evict``: it may evict LRU pages to make room. ``done(committed, seconds,
        refused)`` runs on the writer thread (seconds: from the job's start on the tier to its end; refused: a
        full tier refused it; NEVER_FITS: larger than its whole file system). Not a put: no
        put counter moves, and the budget does not count it."""
        page = WritePage(key, [(address, round_up(info.length))], info.length, info.block, 1 << tier)
        page.crcs, page.created, page.evict, page.copied = info.crcs, created, evict, done
        page.left = 1
        self.queue.copy(page, tier)

    def idle(self, k: int) -> bool:
        """No foreground page waits for a job on tier ``k`` (catch-up never goes ahead of a put)."""
        return not self.queue.fifo[k]

    def writing(self, key: str) -> bool:
        """A put is writing ``key`` now."""
        return key in self.queue.pending

    @contextmanager
    def exclusive(self):
        """No write progresses inside (check, clear): the writer finishes its step and waits."""
        queue, counted = self.queue, False
        try:
            with queue.lock:  # (no call between the two: an interrupt lands before or after both)
                queue.exclusive, counted = queue.exclusive + 1, True
            with self.lock:
                yield
        finally:
            if counted:
                with queue.lock:
                    queue.exclusive -= 1
                    queue.wake_under_queues()

    def cancel_under_writer(self) -> None:
        """clear(): drop every queued job and discard the ones in flight (their pages report False).
        Called inside :meth:`exclusive` (and by the writer giving up after an error)."""
        dropped = self.queue.drop_all()
        for jobs in self.jobs.active:
            for job in list(jobs):
                job.err = CANCELLED
                if not job.in_flight:  # (held back between two of its writes) nothing will reap it
                    self.jobs.finish_under_writer(job)
        for page, k in dropped:
            self.queue.job_over_under_writer(page, k)

    def trim(self, k: int) -> int:
        """Evict tier ``k``'s least recent pages beyond its capacity and remove their files, as the
        writer does when it makes room, TRIM_BYTES (EVICT_FILES files) at a time behind the writes in progress (the
        start-up scan found the tier over its capacity: one lowered since the last run). The excess is
        measured again at each step: a write may have made room in between (a stale excess would evict
        pages that fit). The scan calls this on its own thread, which must hold no reference to the
        engine: were the engine dropped meanwhile, its finalizer (close, which waits for the scan)
        would run there and wait for itself. Returns the pages evicted (the scan says so, once)."""
        evicted = 0
        while not self.queue.closing:
            with self.exclusive():
                victims = self.index.evict_excess(k, TRIM_BYTES, EVICT_FILES)
                self.jobs.evicted_under_writer(k, victims)
            evicted += len(victims)
            if not victims:
                break
            if self._has_work_under_queues():  # writes wait: their turn (a look, without the queue's lock)
                time.sleep(EVICT_PAUSE_S)
        return evicted

    def close(self) -> None:
        """Write what is queued, stop the writer, close the ring (in a background thread while a hung
        tier holds abandoned writes: closing a ring waits for the kernel). Idempotent."""
        self.queue.close()
        if self._thread is not threading.current_thread():  # (a dropped engine's __del__ may run here)
            self._thread.join()
        with self.lock:
            if not self.io.orphans:
                self._close_ring()
                return
            log.warning("kvstream: close(): %d abandoned writes still in flight (a hung tier); the write ring "
                        "and its buffers are released by a background thread once they end", self.io.orphans)
            threading.Thread(target=self._close_ring, name="kvstream-close", daemon=True).start()

    def _close_ring(self) -> None:
        self.io.ring.close()  # (drains: the abandoned writes' buffers are free after it)
        for write in self.io.abandon():
            self._give_up_under_writer(write)
        self.pool.close()

    def _set_up(self, ring):
        """Where a tier may hang, every op of the write ring goes to the kernel's async workers (else
        io_uring may issue a write in the writer's submit, where a FUSE or NFS write waits)."""
        inner = getattr(ring, "inner", ring)  # (under a fault wrapper too; the thread pool never blocks)
        if not all(tier.local for tier in self.tiers) and hasattr(inner, "punt"):
            inner.punt = True
        return ring

    def _bandwidth_under_queues(self, k: int) -> float:
        """Tier k's write bandwidth (bytes/s, undisturbed by reads), or 0 until TRUST_BYTES were
        measured (the budget admits every replica until then)."""
        return self.io.flows[k].rate if self.measured[k] >= TRUST_BYTES else 0.0

    # -- the writer thread -----------------------------------------------------------------------
    def _has_live_writes(self) -> bool:
        """Writes in flight other than abandoned ones."""
        return len(self.io) > self.io.orphans

    def _has_work_under_queues(self) -> bool:
        return self._has_live_writes() or any(self.queue.fifo) or any(self.queue.copies) or any(self.jobs.active)

    def _run(self) -> None:
        queue = self.queue
        while True:
            with queue.lock:
                queue.work.wait_for(lambda: (self._has_work_under_queues() and not queue.exclusive) or
                                    (queue.closing and not self._has_work_under_queues()),
                                    ORPHAN_POLL_S if self.io.orphans else None)
                if not self._has_work_under_queues():
                    if queue.closing:
                        return
                    if not self.io.orphans:
                        continue
                elif queue.exclusive:
                    continue
                wakes = queue.wakes
            with self.lock:
                try:
                    idle = self._step_under_writer()
                except Exception:  # a bug must not hang every caller: fail what is pending, live on
                    if self.io.ring.closed:  # (closed after it broke, logged then: one line per step now)
                        log.warning("kvstream: the write ring is closed; the pages being written are reported failed")
                    else:
                        log.exception("kvstream: write path error; the pages being written are reported failed")
                    self._abandon_under_writer()
                    continue
            if idle is not None:  # nothing in flight: queued jobs wait for reads to end or stall
                with queue.lock:  # (or for descriptors); a wake-up since the step cuts it short
                    quiet = queue.wakes == wakes and not queue.exclusive
                    # Closing, and what is queued could start only on an outside event (a failed
                    # tier's rejoin: no read holds it, no descriptor retry is due): nothing will come,
                    # so it fails rather than hold close() for ever (a fresh-clone CI run hung 300 s
                    # in close() after the model test's tier 0 vanished with writes queued for it).
                    stuck = quiet and queue.closing and not idle
                    if quiet and not stuck:
                        queue.work.wait(idle or None)
                if stuck:
                    log.warning("kvstream: close(): writes queued for tiers that cannot take them now are "
                                "reported failed")
                    with self.lock:
                        self._abandon_under_writer()

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
            self._check_hung_under_writer(now)
            # only abandoned writes left (a hung tier): look again after a while, not at once
            return None if done or self._has_live_writes() else ORPHAN_POLL_S
        timeout = until
        retry = self.jobs.fds.retry_at - time.monotonic()
        if retry > 0:
            timeout = retry if timeout is None else min(timeout, retry)
        return 0.0 if timeout is None else max(timeout, 1e-3)

    def _account_held_under_writer(self, held: int) -> None:
        """Time each tier's queued writes spent waiting for its reads (stats ``write_held_s``)."""
        now = time.monotonic()
        for k in range(len(self.tiers)):
            waiting = held >> k & 1 and bool(self.queue.fifo[k] or self.jobs.active[k])
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
        writes, idle = [], []  # idle: tiers whose hang clock starts with this batch
        bounded = self.priority.enabled  # off: every job in flight at once (the behaviour before)
        try:
            for k in range(len(self.tiers)):
                if held >> k & 1:
                    continue
                window = self.io.flows[k].window if bounded else math.inf
                while self.io.bytes[k] < window:
                    job = self._next_job_under_writer(k)
                    if job is None:
                        break
                    n, offset = job.ops[job.next]
                    if job.staged and self._staged and self._staged + n > self.staging_limit:
                        break  # back-pressure: staging is full of writes in flight; one ends first
                    job.next += 1
                    job.in_flight += 1
                    write = Write(job, n, -1 if self.priority.reading(k) else self.priority.epoch(k))
                    writes.append(write)
                    buf = self._stage_under_writer(write, offset) if job.staged else job.page.memory(n, offset)
                    self.io.add(write, OP_WRITE, job.fd, buf, offset, time.monotonic())
                    if not self.io.bytes[k] - write.nbytes - self.io.orphaned[k]:
                        idle.append(k)
                if any(not w.job.staged and w.job.page.gate is not None for w in writes):  # a gated put's
                    self.io.submit()  # zero-copy write (the kernel reads its caller's memory) never waits,
                    writes = []  # unsent, for another tier's call (a hung create), after which it may let go
            self.io.submit()  # (else one submit per step, all tiers: the SGLang path's cost, no gate)
        except BaseException:  # none of the batch is in flight (InFlight.submit): the jobs take it back
            for write in writes:
                write.job.next -= 1
                write.job.in_flight -= 1
                self._unstage_under_writer(write)
            raise
        # An idle tier's hang clock starts when its writes are sent, not when the step began: the step may
        # have waited on another tier's file system (a hung FUSE create), and such a clock failed it at once.
        now = time.monotonic()
        for k in idle:
            self._progress[k] = now

    def _stage_under_writer(self, write: Write, offset: int) -> tuple[int, int]:
        """A staging copy of the write's file bytes (held by the write until its completion)."""
        staging = write.staging = self.pool.get(write.nbytes)
        self._staged += staging.nbytes
        write.budgeted = True
        write.job.page.fill(staging.address, write.nbytes, offset)
        return staging.address, write.nbytes

    def _give_up_under_writer(self, write: Write) -> None:
        """A write that ended, or that its ring will never complete (closed, replaced), with no more to
        say about its page: its staging goes back; an orphan's job (a hung tier's, abandoned) has its
        file removed once no write of it is left."""
        self._unstage_under_writer(write)
        if write.orphan:
            write.job.in_flight -= 1
            if not write.job.in_flight:
                self.jobs.discard_abandoned_under_writer(write.job)

    def _unstage_under_writer(self, write: Write) -> None:
        self._unbudget_under_writer(write)
        if write.staging is not None:
            self.pool.put(write.staging)
            write.staging = None

    def _unbudget_under_writer(self, write: Write) -> None:
        if write.budgeted:
            self._staged -= write.staging.nbytes
            write.budgeted = False

    def _next_job_under_writer(self, k: int) -> Job | None:
        """The job of tier ``k`` with a write left to submit: a started one, else the next page of
        its FIFO (None: none, or none can start now: descriptors, staging memory)."""
        jobs = self.jobs
        if (job := jobs.next_under_writer(k)) is not None:
            return job
        while True:
            if len(jobs.active[k]) >= self.tiers[k].tmp_files or jobs.fds.blocked(time.monotonic()):
                return None
            with self.queue.lock:
                fifo = self.queue.fifo[k] or self.queue.copies[k]  # catch-up copies only when no put waits
                if not fifo:
                    return None
                page = fifo[0]
            request = self.io.flows[k].request if self.priority.enabled else math.inf
            staged = not (page.aligned and self.tiers[k].local)  # (zero-copy: a local file system's writes)
            if staged:  # each request is staged whole: no request may need more than the staging memory
                request = min(request, self._piece)
            started = jobs.start_under_writer(page, k, request, staged)
            if started is False:
                return None  # out of descriptors: the page stays first in line
            with self.queue.lock:
                fifo.popleft()
            if started is not None:
                return started
            jobs.idle_under_writer(k)  # the page could not go to this tier (failed tier, capacity, error): next one

    # -- a hung tier ------------------------------------------------------------------------------
    def _check_hung_under_writer(self, now: float) -> None:
        if self.write_timeout <= 0:
            return
        for k in range(len(self.tiers)):
            if self.io.bytes[k] > self.io.orphaned[k] and now - self._progress[k] > self.write_timeout:
                self._progress[k] = now  # (the tier fails, its jobs abandoned: their writes stay as orphans)
                self.jobs.hung_under_writer(k, self.write_timeout, self._orphan_under_writer)

    def _orphan_under_writer(self, job: Job) -> None:
        """An abandoned job's writes in flight: orphans until they end. Their staging leaves the budget
        at once (it goes back to the pool when they end): else it stayed full, and every later put, and
        close(), waited for the hung tier. Memory stays bounded, by one window per hung tier: a failed
        tier takes no new write, and one back in service counts its orphans in its window (io.bytes);
        with read priority off, by what the budget let the tier hold when it hung."""
        orphans = [w for w in self.io.requests() if w.job is job]
        for write in orphans:
            self._unbudget_under_writer(write)
        self.io.orphan(orphans)

    # -- completions -----------------------------------------------------------------------------
    def _complete_under_writer(self, write: Write, res: int, now: float) -> None:
        job, want, k = write.job, write.nbytes, write.tier
        self._progress[k] = now
        if write.orphan:
            self._give_up_under_writer(write)
            return
        self._unstage_under_writer(write)
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
            job.err = -res if res < 0 else self.jobs.short_write_errno_under_writer(job)
        if not job.in_flight and (job.err or job.next == len(job.ops)):
            self.jobs.finish_under_writer(job)

    def _abandon_under_writer(self) -> None:
        """After an unexpected error: wait for the live writes in flight (they read caller memory; a
        tier that holds them past write_timeout is hung), then discard every job and fail every page
        still pending, so that no caller waits for ever; a hung tier's abandoned writes are not waited
        for (they end on their own). A ring that cannot even be waited on is replaced (inflight.py)."""
        for write in self.io.unsent():  # (added, never submitted: the error came between)
            self._give_up_under_writer(write)
        deadline = time.monotonic() + self.write_timeout if self.write_timeout > 0 else math.inf
        try:
            while self._has_live_writes() and time.monotonic() < deadline:
                for write, _ in self.io.reap(1, None if deadline == math.inf else deadline - time.monotonic()):
                    self._give_up_under_writer(write)
        except Exception:
            log.exception("kvstream: the write ring failed; the pages being written are reported failed")
            self.stats.total("ring_failures")
            for write in self.io.replace():  # (closed: what it took has ended; writes go on on a new one)
                self._give_up_under_writer(write)
        for k in sorted({write.tier for write in self.io.requests() if not write.orphan}):
            self.jobs.hung_under_writer(k, self.write_timeout, self._orphan_under_writer)  # (no end in time)
        for jobs in self.jobs.active:
            for job in jobs:
                job.in_flight = 0
        self.cancel_under_writer()  # (catch-up copies among them stay owed: replication.py)
