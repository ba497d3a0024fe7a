"""A page on one tier (a ``Job``), from its temporary file to its commit: the write path's jobs.

    start: the tier still in service -> a temporary file (a descriptor: at most Tier.tmp_files per
        tier, files.py; EMFILE waits; ENOSPC, out of inodes too: evict LRU and try again) -> room (LRU
        victims evicted, their files removed) -> checksums and header (once per page)
    (writes.py submits the job's requests and reaps them; a failed or short write sets ``job.err``)
    finish: a catch-up copy still wanted? -> Tier.seal ([fdatasync], close) -> Tier.place (rename into
        place) -> the index; a write's ENOSPC -> evict LRU on that tier and write it all again, up to
        SPACE_RETRIES times, while evicting can make room at all (a temporary file's creation or a rename
        refused for room: evict and try that again, _with_room_under_writer); any other error fails the
        tier (tiers.py decides for how long)
    a hung tier (no write progress for write_timeout): the tier fails, its jobs are abandoned
        (hung_under_writer)
    a page whose caller let go of its memory (WritePage.gone: L2Core.close giving up on a hung tier; a put
        interrupted, withdrawn): no job of it starts or submits any more, and one that ends is cancelled,
        never renamed into place; a put that joined it writes it from its own memory (writequeue.py)
    a job over (committed, failed, cancelled or abandoned) tells the queue (writequeue.py), which
    ends the page and its put when every tier it targets is over.

Every method runs on the writer's side, under WritePath.lock (hence ``_under_writer``).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .files import OUT_OF_DESCRIPTORS, Shortage
from .index import Index
from .puts import CANCELLED, NEVER_FITS, Job, PutCall, WritePage
from .staging import BufferPool
from .stats import Every, Stats
from .tiers import SPACE_ERRNOS, SPACE_RETRIES, Tier
from .writequeue import WriteQueue

T = TypeVar("T")
SPARE_LOOKS = 8  # victims' files a write looks at for another process's use (_spare_used_under_writer), at most
log = logging.getLogger("kvstream")


class Jobs:
    """The jobs started and not over, per tier (``active``), and what starts and ends them.

    :param digest: the namespace digest every page header carries.
    """

    def __init__(self, tiers: list[Tier], index: Index, stats: Stats, pool: BufferPool, queue: WriteQueue,
                 digest: str):
        self.tiers, self.index, self.stats, self.pool, self.queue, self.digest = \
            tiers, index, stats, pool, queue, digest
        self.active: list[list[Job]] = [[] for _ in tiers]  # jobs started and not over, per tier
        self.fds = Shortage()  # temporary files open, and the EMFILE back-off (files.py)
        self.calling: int | None = None  # the tier whose create or commit the writer is in (a hung one: named)
        self.full_said = [Every(log) for _ in tiers]  # a tier refusing writes for room: a line in 30 s, not a page's

    def _release_under_writer(self, page: WritePage) -> None:
        """No job of the page in flight: its header goes back."""
        if not page.users:
            page.release(self.pool)

    def start_under_writer(self, page: WritePage, k: int, request: float, staged: bool) -> Job | None | bool:
        """A job for ``page`` on tier ``k``, ready to submit in requests of at most ``request`` bytes,
        each from a staging copy if ``staged``; None when the page cannot go there (the reason is
        counted); False when no descriptor is free (try again later)."""
        tier = self.tiers[k]
        # failed since the put was accepted: the page misses it (under-replicated); or its caller let go
        # of its memory (gone): it is not written anywhere any more
        if not tier.healthy or page.gone():
            self.queue.job_over_under_writer(page, k)
            return None
        if self._never_fits_under_writer(page, k):  # written, it filled the file system and the pages beside
            # it, which had room, evicted the tier's valid pages at their ENOSPC, all for a write that fails
            if page.copied is not None:
                # (a catch-up copy: replication drops it, Replicator._finished; taken for a refusal for room,
                # the tier's catch-up waited for room for this very page, which never comes, for good)
                page.refused = NEVER_FITS
            else:
                self.stats.add(k, "write_failures")
                self.stats.add(k, "errors")
                # (the warning for a full tier blamed other files, a quota or a reserve, and evicted nothing)
                self.full_said[k].warning(
                    "kvstream: tier %d (%s): page %s of %d bytes (file) is larger than the tier's whole file system "
                    "can hold (%d bytes: its size less what it reserves, e.g. GlusterFS's storage.reserve) and goes to "
                    "the other tiers only; give the tier a larger file system or store smaller pages (LMCache's "
                    "--chunk-size, SGLang's page size)", k, self.tiers[k].root, page.key, page.file_bytes,
                    self.tiers[k].fs_usable)
            self.queue.job_over_under_writer(page, k)
            return None
        try:  # the file first: a page evicted to make room for a write that cannot start is lost for nothing
            self.calling = k
            fd, tmp = self._with_room_under_writer(page, k, self.tiers[k].create_tmp)
        except OSError as exc:
            if exc.errno in OUT_OF_DESCRIPTORS:
                return self._out_of_descriptors_under_writer(page, k)
            self._refused_or_failed_under_writer(page, k, exc.errno or errno.EIO,
                                                 f"create temporary file for {page.key}")
            self.queue.job_over_under_writer(page, k)
            return None
        finally:
            self.calling = None
        self.fds.created()
        if page.gone():  # (let go of while the create was out: a hung tier's, L2Core.close)
            tier.discard(fd, tmp)
            self.queue.job_over_under_writer(page, k)
            return None
        if page.evict:
            self._spare_used_under_writer(k, page.length)
        victims = self.index.reserve(k, page.length, evict=page.evict)
        if victims is None:
            tier.discard(fd, tmp)
            if page.copied is None:  # (a catch-up copy that finds no room counts as dropped, replication.py)
                self.stats.add(k, "skipped_writes")
            log.debug("kvstream: tier %d cannot make room for page %s (capacity, pinned pages)", k, page.key)
            self.queue.job_over_under_writer(page, k)
            return None
        self.evicted_under_writer(k, victims)
        page.users += 1
        ready = False
        try:
            ready = page.prepare(self.pool, self.digest)
        finally:
            if not ready:  # raised, or its caller let go of the memory before its checksums were taken
                page.users -= 1
                self._release_under_writer(page)
                tier.discard(fd, tmp)
                self.index.abort(k, page.length)
        if not ready:
            self.queue.job_over_under_writer(page, k)
            return None
        # (a copy of it found there later, its header's write stamp this one, may be ours: Index THEIRS). Before
        # the file can be renamed into place; once prepared, the page's write stamp is known
        self.index.wrote(page.key, k, page.writer_ns)
        job = Job(page, k, fd, tmp, page.spans(request, staged), staged)
        page.started = time.monotonic()
        self.active[k].append(job)
        return job

    def _with_room_under_writer(self, page: WritePage, k: int, op: Callable[[], T]) -> T:
        """``op()`` on tier ``k`` for ``page``: the creation of its temporary file, or its rename into place.
        A tier out of room (ENOSPC, EDQUOT: no block, or no inode left, with bytes to spare; a rename may need
        a new directory block) evicts LRU pages and tries again, as a write does, up to SPACE_RETRIES times
        while there is a page to evict; a catch-up copy never evicts (page.evict). :raises OSError:"""
        for _ in range(SPACE_RETRIES):
            try:
                return op()
            except OSError as exc:
                if exc.errno not in SPACE_ERRNOS or not page.evict or not self._evict_under_writer(k, page.length):
                    raise
        return op()

    def _out_of_descriptors_under_writer(self, page: WritePage, k: int) -> bool | None:
        """EMFILE/ENFILE (files.py): False to try again later, or None: this (page, tier) fails."""
        if self.fds.hit(any(self.active), time.monotonic()):
            return False
        self.stats.add(k, "write_failures")
        self.queue.job_over_under_writer(page, k)
        return None

    def hung_under_writer(self, k: int, timeout: float, orphan: Callable[[Job], None]) -> None:
        """Tier ``k``'s writes made no progress for ``timeout`` s (write_timeout): the tier fails (no I/O
        on it: it may hang), its queued pages skip it, and its jobs are abandoned: the pages end with
        the tiers that committed them (or a tier that replicate=budget skipped writes them), the puts
        answer. ``orphan(job)`` leaves the job's writes in flight on the ring (writes.py). An abandoned
        job's file is never renamed into place, and goes when its last write ends. Such a write may
        still read its source after the put returned: its staging copy, or on a local tier the caller's
        memory (the kernel holds the request; nothing can call it back), whose bytes then go only to
        that file, never served."""
        self.stats.add(k, "write_timeouts")
        self.stats.add(k, "errors")
        self.tiers[k].fail(errno.ETIMEDOUT, f"writes made no progress for {timeout:g} s (write_timeout)")
        for page in self.queue.drop_tier(k):
            self.queue.job_over_under_writer(page, k)
        for job in list(self.active[k]):
            job.err = errno.ETIMEDOUT
            self.stats.add(k, "writes_abandoned")
            self.index.abort(k, job.page.length)
            orphan(job)
            self.leave_under_writer(job)
            if not job.in_flight:
                self.discard_abandoned_under_writer(job)

    def withdraw_under_writer(self, call: PutCall) -> None:
        """A put interrupted while it queues or waits (PutCall.withdraw): its caller takes the memory back. Its pages
        leave the FIFOs (WriteQueue.withdraw) and its jobs are cancelled, as clear() cancels them: none
        reads that memory any more once the writes in flight end (a page written whole and committed
        before stays: valid). A put that joined one of its pages, and did not let go of its memory,
        writes the page from that memory (WriteQueue._hand_over_under_queues)."""
        for page, k in self.queue.withdraw(call):
            self.queue.job_over_under_writer(page, k)
        mine = set(call.pages)
        for job in [job for jobs in self.active for job in jobs if job.page in mine]:
            job.err = job.err or CANCELLED
            if not job.in_flight:  # (held back between two of its writes) nothing else will finish it
                self.finish_under_writer(job)
        if not call.left:  # (it waited only for other puts' pages, or the last of its own just ended)
            call.event.set()

    def discard_abandoned_under_writer(self, job: Job) -> None:
        """An abandoned job with no write left in flight: its file goes, in a thread of its own (closing
        or unlinking on a hung tier blocks until the tier answers; the writer must not wait for it)."""
        self.fds.closed()
        threading.Thread(target=self.tiers[job.tier].discard, args=(job.fd, job.tmp),
                         name="kvstream-discard", daemon=True).start()

    def _wanted_under_writer(self, page: WritePage, k: int) -> bool:
        """A catch-up copy is committed only while the index still holds the content it copied, tier
        ``k`` still lacks it and no file has the page's name there. Else, since it was read: deleted
        or cleared (never brought back), or written there by a put (maybe other content: the copy,
        renamed over it, would bring an older version back), or another writer's file in place (not
        ours to replace). A put of this process commits on this thread too; another node's may come
        between this and the commit, which therefore replaces nothing (Tier.place without replace)."""
        info = self.index.get(page.key)
        return info is not None and not info.tiers >> k & 1 and \
            info.same_content(page.length, page.block, page.crcs) and not self.tiers[k].named(page.key)

    def next_under_writer(self, k: int) -> Job | None:
        """The started job of tier ``k`` with a write left to submit. One whose caller let go of its
        memory (gone) submits nothing more: cancelled, never committed (its writes in flight end first)."""
        for job in list(self.active[k]):
            if job.err == 0 and job.page.gone():
                job.err = CANCELLED
                if not job.in_flight:
                    self.finish_under_writer(job)
            elif job.err == 0 and job.next < len(job.ops):
                return job
        return None

    def finish_under_writer(self, job: Job) -> None:
        page, k = job.page, job.tier
        tier = self.tiers[k]
        if job.err == 0 and page.gone():  # its caller let go of the memory: a write may have read it after
            job.err = CANCELLED
        if job.err == 0 and page.copied is not None:
            try:
                if not self._wanted_under_writer(page, k):
                    job.err = CANCELLED
            except OSError as exc:  # (a tier that did not answer in time: bounded.py)
                job.err = exc.errno or errno.EIO
        if job.err == 0:
            sealing = True
            try:
                fd, job.fd, self.calling = job.fd, None, k  # seal closes it, whatever happens
                # (the data sealed: a rename refused for room is tried again. Its own file counted open)
                sealed = tier.seal(fd, len(self.active[k]))
                sealing = False
                page_dir = self._with_room_under_writer(page, k, lambda: tier.place(job.tmp, page.key,
                                                                                    replace=page.copied is None))
            except OSError as exc:
                tier.discard(None, job.tmp)
                err = exc.errno or errno.EIO
                if sealing and err in SPACE_ERRNOS:
                    err = self._rewrite_under_writer(job, err)
                    if not err:
                        return
                self.index.abort(k, page.length)
                if not (page.copied is not None and err == errno.EEXIST):
                    # (a catch-up copy that another writer's file beat to the name, since it looked: not
                    # wanted, as above)
                    self._refused_or_failed_under_writer(page, k, err, f"commit {page.key}")
                self._close_under_writer(job)
                return
            finally:  # (whatever the commit raised: a tier named later must be the one the writer is in)
                self.calling = None
            # A copy of other content on another tier (a failed tier's, another writer's) leaves the
            # index, so it is never served against these checksums; its file is a valid page and stays.
            # A background copy is the tier's least recent page (the first to go when room is needed: it
            # never costs a page the tier chose to keep); a put's page, or a promoted one, the most recent.
            if sealed is not None:  # (its eviction knows it by its identity: no header read)
                self.index.committed_file(page.key, k, sealed)
            self.index.commit(page.key, k, page.length, page.block, page.crcs, page.length,
                              oldest=not page.evict)
            page.committed.append(k)
            for call, _ in page.calls:
                call.dirs.setdefault(k, set()).add(page_dir)
            self.stats.add(k, "bytes_written", page.length)
            self.stats.add(k, "pages_written")
            self._close_under_writer(job)
            return
        if job.err in SPACE_ERRNOS and page.evict and job.tries < SPACE_RETRIES and \
                self._room_possible_under_writer(job):
            if self._evict_under_writer(k, page.length):
                job.tries += 1
                job.err = 0
                job.next = 0  # write it all again
                return
        tier.discard(job.fd, job.tmp)
        self.index.abort(k, page.length)
        if job.err != CANCELLED:
            self._refused_or_failed_under_writer(page, k, job.err, f"write {page.key}")
        self._close_under_writer(job)

    def _rewrite_under_writer(self, job: Job, err: int) -> int:
        """The job's page was refused for room (``err``) at its seal (the close, or fdatasync), its writes taken: a
        full GlusterFS volume reports them so (its write-behind). Evict and write it again to a new temporary file,
        as a write refused for room is (up to SPACE_RETRIES times). Before, nothing was evicted there, and every
        later page of the node was refused the same way, for good (trial lmgluster: the shared tier took no new
        chunk once full). Returns 0 (written again), or the errno the page fails with on the tier: ``err`` (a
        catch-up copy never evicts; nothing to evict; no descriptor free), or the new file's creation's (a tier
        that did not answer in time fails as hung: taken for the seal's refusal for room, it stayed in service)."""
        page, k = job.page, job.tier
        if not page.evict or job.tries >= SPACE_RETRIES or not self._room_possible_under_writer(job) or \
                not self._evict_under_writer(k, page.length):
            return err
        try:
            job.fd, job.tmp = self._with_room_under_writer(page, k, self.tiers[k].create_tmp)
        except OSError as exc:
            return err if exc.errno in OUT_OF_DESCRIPTORS else exc.errno or errno.EIO
        job.tries += 1
        job.err = 0
        job.next = 0  # write it all again
        return 0

    def _refused_or_failed_under_writer(self, page: WritePage, k: int, err: int, what: str) -> None:
        """``what`` failed with ``err`` for ``page`` on tier ``k``. A full tier (ENOSPC, EDQUOT) that refused a
        catch-up copy, at its temporary file's creation, a write or its rename, does not fail (before, a tier
        out of inodes or over a quota, statvfs showing bytes free, counted a write failure and an error at
        each try): the refusal is marked on the page, for the catch-up to take the tier for full
        (Replicator._finished: no page read at each look), and the copy stays owed. Anything else fails the
        tier (_failed_under_writer)."""
        if page.copied is not None and err in SPACE_ERRNOS:
            page.refused = True
        else:
            self._failed_under_writer(k, err, what)

    def _close_under_writer(self, job: Job) -> None:
        """The job's file is closed (committed or discarded): its slot and its page's buffers free up."""
        self.fds.closed()
        self.leave_under_writer(job)

    def leave_under_writer(self, job: Job) -> None:
        """The job is over for its page (committed, failed or abandoned)."""
        k = job.tier
        self.active[k].remove(job)
        job.page.users -= 1
        self._release_under_writer(job.page)
        self.queue.job_over_under_writer(job.page, k)
        self.idle_under_writer(k)

    def idle_under_writer(self, k: int) -> None:
        """Tier ``k``'s page left its FIFO without a job (refused: room, an error), or its last job ended: an
        idle tier's mark goes (review: a page refused after its temporary file was made left it held for good)."""
        if not self.active[k] and not self.queue.fifo[k] and not self.queue.copies[k]:  # (a look: a page queued
            self.tiers[k].release_mark()  # meanwhile makes it again) the tier is idle: its mark goes (Tier._track)

    def _evict_under_writer(self, k: int, nbytes: int) -> bool:
        """Evict LRU pages of tier ``k`` to make room for ``nbytes``; False: nothing left to evict. (The file
        system said ENOSPC: a tier with no capacity set evicts only so. Its victims are spared as reserve's are.)"""
        self._spare_used_under_writer(k, nbytes, full=True)
        victims = self.index.evict(k, nbytes)
        self.evicted_under_writer(k, victims)
        return bool(victims)

    def _spare_used_under_writer(self, k: int, nbytes: int, full: bool = False) -> None:
        """Before a write evicts from tier ``k`` by this process's own uses (its LRU): a victim whose file another
        process of the namespace marked used since this one last used it (Tier.mark_used: its access time) becomes
        this process's most recent instead (Index.spare), and the write evicts the next. A stat a victim, at most
        SPARE_LOOKS a write (a file marked again and again by another user cannot hold eviction up). ``full``:
        the victims of an eviction for ENOSPC (Index.evict), whatever the capacity."""
        looked = 0
        while looked < SPARE_LOOKS:
            victims = self.index.next_victims(k, nbytes, SPARE_LOOKS - looked, full)
            spared = 0
            for key, used_ns in victims:
                marked = self.tiers[k].marked_at(key)
                spared += marked is not None and marked > used_ns and self.index.spare(key, k)
            looked += len(victims)
            self.stats.add(k, "evictions_spared", spared)
            if not spared:
                return

    def _room_possible_under_writer(self, job: Job) -> bool:
        """Could evicting every page of this namespace on the tier make room for the job? If not
        (a page larger than the file system, or one full of other data), evicting would only
        throw pages away: the write fails for this tier and nothing is evicted."""
        room = self.tiers[job.tier].room(job.fd)  # (what the job already holds is reused)
        return room is None or room.free + self.index.used[job.tier] >= job.page.file_bytes  # (None: cannot
        # tell: try eviction)

    def _never_fits_under_writer(self, page: WritePage, k: int) -> bool:
        """Whether ``page``'s file is larger than what a write can ever get on tier ``k``'s file system (its size
        less what it reserves: Tier.fs_usable). Asked of the file system
        (statvfs) only where the size it gave last does not settle it: the first page, or one larger than that
        (it may have grown since); the size seen last answers the rest, no call per page."""
        tier = self.tiers[k]
        if tier.fs_bytes is None or 0 < (tier.fs_usable or 0) < page.file_bytes:  # (0: it does not say: not
            # asked again)
            tier.room()  # (None: cannot tell; it does not keep the page out)
        return bool(tier.fs_usable) and page.file_bytes > tier.fs_usable  # (its reserve kept back)

    def short_write_errno_under_writer(self, job: Job) -> int:
        """A write that stopped early: the ring reports the bytes done, not the error that
        followed. A nearly full file system means ENOSPC (evict and retry), else EIO."""
        room = self.tiers[job.tier].room()
        return errno.ENOSPC if room is not None and room.free < 2 * job.page.file_bytes else errno.EIO

    def evicted_under_writer(self, k: int, victims: list[str]) -> None:
        """Remove the files of pages evicted from tier ``k``'s index: each only while it is this process's
        copy (Tier.evict_page; another process's page written under the name since stays, and counts nowhere
        here: it is found again, as another's, when read)."""
        for key in victims:  # (the judges bound to their key: one may run after this loop moved on, on a
            # tier that answered late)
            if self.tiers[k].evict_page(key, *self.index.judges(key, k)):
                log.info("kvstream: tier %d: the file of evicted page %s stays: another process's page (or not a "
                         "file kvstream removes)", k, key)
            self.index.file_removed(key, k)
        if victims:
            self.stats.add(k, "evictions", len(victims))

    def _failed_under_writer(self, k: int, err: int, what: str) -> None:
        self.stats.add(k, "write_failures")
        self.stats.add(k, "errors")
        if err == errno.ETIMEDOUT:  # a call on a tier that may hang did not return within write_timeout
            self.stats.add(k, "write_timeouts")  # (bounded.py): hung, as when its writes make no progress
        if not self.tiers[k].fail(err, what) and err not in SPACE_ERRNOS:
            log.warning("kvstream: tier %d: %s failed: %s", k, what, os.strerror(err))
        elif err in SPACE_ERRNOS:  # full, not failed: without a word every put missed the tier, counted only
            self.full_said[k].warning(
                "kvstream: tier %d (%s) refuses writes for room (%s: %s) and evicting this engine's pages there did "
                "not make it (another program's or node's files, a quota, a reserve): the pages go to the other "
                "tiers only; free space there, raise the quota or set a capacity below what the file system gives "
                "(KVSTREAM_CAPACITY)", k, self.tiers[k].root, what, os.strerror(err))
