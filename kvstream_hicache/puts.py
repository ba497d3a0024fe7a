"""What the write path writes: a put (``PutCall``) and its pages (``WritePage``): a page's sources,
its checksums and header, and the writes that fill its file, from the caller's memory or staged a
request at a time; a page on one tier (``Job``: its temporary file) and one write request of it in
flight (``Write``, with its staging copy if any). Plain data, used by writes.py, jobs.py and writequeue.py under the writer's lock
(``PutCall.signal`` also without it, for a put with nothing to write; ``PutCall.withdraw`` runs on a thread of its own).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager

from .bounded import shielded
from .integrity import PageHeader, block_crcs, pack_header, write_stamp
from .layout import HEADER_SIZE, file_size, is_aligned
from .io import copy
from .segments import Payload, Segment
from .trust import wall_ns

log = logging.getLogger("kvstream")


class PutCall:
    """One put: results per key, pages not yet done, how the caller learns the end."""

    __slots__ = ("results", "pages", "joined", "held", "repeats", "left", "done", "event", "dirs", "gate", "sources")

    def __init__(self, n: int, done: Callable[[list[bool]], None] | None, gate=None):
        self.results = [False] * n
        self.pages: list[WritePage] = []  # its own new pages, in key order (LRU order on completion)
        self.joined: list[WritePage] = []  # other puts' pages of its keys, being written when it came
        self.held: list[tuple[int, str]] = []  # (position, key) of its keys a tier held already
        self.repeats: list[tuple[int, int]] = []  # (position, first position of the same key)
        self.left = 0  # pages (its own and others' it waits for) not yet done
        self.done = done
        self.event = threading.Event() if done is None else None
        self.dirs: dict[int, set[str]] = {}  # page directories committed, per tier (fsync=full)
        self.gate = gate  # its caller's memory.CallerGate (put_deferred): shut, the memory is no longer to be read
        self.sources: dict[int, Sequence[Segment]] = {}  # position -> its caller's page, of each key it joined:
        # written from it if the caller of the copy it waits for lets go first (WriteQueue._hand_over_under_queues)

    def let_go(self) -> bool:
        """Its caller let go of its memory (shut its gate): none of it is to be read any more."""
        return self.gate is not None and self.gate.shut

    def sync_dirs(self, tiers, stats) -> None:
        """fsync=full: make the put's renames durable on each tier; a page none of whose copies is
        durable then reports False (fsync=full promises a copy that survives a crash)."""
        unsynced = set()
        for k, dirs in self.dirs.items():
            if tiers[k].fsync == "full" and dirs:
                try:
                    tiers[k].sync_dirs(dirs)
                except OSError as exc:
                    unsynced.add(k)
                    if exc.errno == errno.ETIMEDOUT:  # (the tier did not answer in time: bounded.py)
                        stats.add(k, "write_timeouts")
                    tiers[k].fail(exc.errno or errno.EIO, "fsync directory")
        if not unsynced:
            return
        for page in self.pages + self.joined:  # (a joined page answers this put too: same promise)
            if page.committed and set(page.committed) <= unsynced:
                for owner, i in page.calls:
                    if owner is self:
                        self.results[i] = False

    def withdraw(self, exclusive: Callable, withdraw: Callable[["PutCall"], None]) -> None:
        """``put`` was ended by an exception (KeyboardInterrupt, SystemExit: any BaseException) while it
        queued or waited for its pages, and its caller takes their memory back (reuses or frees it) as
        the exception goes on. So first, inside ``exclusive`` (the writer's: no write progresses),
        ``withdraw`` (Jobs.withdraw_under_writer) takes the put's pages from the writer: none starts any
        more; then this waits for the writes already reading that memory. Left queued, the pages were
        checksummed and written from the reused memory: a wrong page stored, passing check(). The
        withdrawal runs on a thread of its own, which no signal reaches (Python delivers them to the main
        thread): a second Ctrl-C cannot cut it half-way (pages left counted, the put waiting for ever) nor
        leave the writer paused; it only ends this wait, which is taken again."""

        def run() -> None:
            try:
                with exclusive():
                    withdraw(self)
            except Exception:  # (a defect of ours: logged; the put does not wait on it)
                log.exception("kvstream: withdrawing the pages of an interrupted put")
                return
            self.event.wait()

        shielded(run)  # (another interrupt meanwhile: the first one goes on, after this)

    def lru_order(self, held: bool = False) -> list[str]:
        """The keys the put leaves most recent, in the order to touch them (Index.touch_many): reverse
        batch order, the batch's first page last (docs/design.md): a prefix's tail is evicted before its
        head, as SGLang's radix tree evicts leaves first (a page serves only while every page before it is
        held: batch_exists counts the leading run; evicted head first, a prefix's whole tail was dead
        weight). Its new pages that committed and the ones held already, together (touching each kind
        apart made a held page less recent than a new one after it in the batch); with ``held``, the
        held ones alone (touched when the put is accepted, so that its writes do not evict them)."""
        new = [] if held else [(page.calls[0][1], page.key) for page in self.pages if page.committed]  # (calls[0]:
        joined = [] if held else [(i, page.key) for page in self.joined if page.committed  # this put; joined:
                                  for owner, i in page.calls if owner is self]  # another put's write it waited for)
        return [key for _, key in sorted(new + joined + self.held, reverse=True)]

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

    __slots__ = ("key", "segments", "payload", "length", "block", "file_bytes", "aligned", "crcs", "created",
                 "copied_ns", "header", "users", "targets", "expected", "committed", "left", "calls", "spare", "evict",
                 "copied", "refused", "started", "gate", "withdrawn", "cleared")

    def __init__(self, key: str, segments: Sequence[Segment], length: int, block: int, targets: int):
        self.key, self.segments, self.length, self.block = key, segments, length, block
        self.payload = Payload(segments)
        self.file_bytes = file_size(length)
        self.aligned = all(is_aligned(a, n) for a, n in segments)
        self.targets = targets  # tiers to write (bitmask)
        self.expected = targets  # tiers that should hold it after the put (failed tiers included)
        self.spare = 0  # tiers replicate=budget skipped: written after all if no tier committed the page
        self.crcs: tuple[int, ...] | None = None  # computed when its first job starts
        self.created = 0
        self.copied_ns = 0  # a catch-up copy's own write stamp (PageHeader.copied_ns), set with its header
        self.header = None  # the page header, held while a job of the page is in flight
        self.users = 0  # jobs started and not finished (they hold the header)
        self.committed: list[int] = []
        self.left = 0  # jobs not finished
        self.calls: list[tuple[PutCall, int]] = []  # (put, position of the key in it): first the put whose
        # memory it is written from, then the puts that joined it
        self.evict = True  # may evict the tier's least recent pages to make room (a catch-up copy may not)
        self.copied: Callable[[bool, float, bool | str], None] | None = None  # a catch-up copy (replication.py):
        # its callback, told whether it committed, how long its job took from its start, and whether a full
        # tier refused it (``refused``: Jobs._refused_or_failed_under_writer), or NEVER_FITS: its file is larger
        # than the tier's whole file system (Jobs._never_fits_under_writer)
        self.refused: bool | str = False
        self.started = 0.0  # when its (last) job started, monotonic s
        self.gate = None  # the CallerGate of the put that brought the page (its memory), if it has one
        self.withdrawn = False  # the put that brought it was interrupted (PutCall.withdraw): its memory taken back;
        # or it has not counted the page yet (WriteQueue._enqueue_under_queues: its FIFO entries void till then)
        self.cleared = False  # clear() cancelled it: never written again, not even for a put that joined it

    @property
    def writer_ns(self) -> int:
        """Its file's write stamp (integrity.write_stamp), as its header carries it: known once prepared."""
        return write_stamp(self.created, self.copied_ns)

    def gone(self) -> bool:
        """Its caller let go of its memory (shut its gate: L2Core.close giving up on a hung tier; or took it
        back: an interrupted put, withdrawn): no job of it starts, submits or commits any more (the bytes it
        would write may not be the page's). The puts that joined it still get their page
        (WriteQueue._hand_over_under_queues)."""
        return self.withdrawn or self.gate is not None and self.gate.shut

    @contextmanager
    def _source(self):
        """Held while the caller's memory is read: yields False (read nothing) once its gate is shut.
        The gate is held meanwhile, so the caller never lets go in the middle of a read."""
        if self.gate is None:
            yield True
            return
        with self.gate:
            yield not self.gate.shut

    def prepare(self, pool, digest: str) -> bool:
        """Checksums (once per page, from the caller's memory) and the header (from ``pool``, held
        while a job of the page is in flight). False: the caller let go of the memory first (gone)."""
        if self.crcs is None:
            with self._source() as readable:
                if not readable:
                    return False
                self.crcs = block_crcs(self.segments, self.length, self.block)
        if self.header is None:
            if not self.created:
                self.created = wall_ns()  # (never earlier than a delete's before it: trust.wall_ns)
            if self.copied is not None and not self.copied_ns:  # (a catch-up copy keeps the page's created, a
                self.copied_ns = wall_ns()  # promoted one takes a new one: its own stamp tells its file from
                # its source's, PageHeader.writer_ns)
            self.header = pool.get(HEADER_SIZE)
            pack_header(PageHeader(self.key, digest, self.length, self.block, self.crcs, self.created, self.copied_ns),
                        self.header)
        return True

    def release(self, pool) -> None:
        """The header goes back to ``pool``."""
        if self.header is not None:
            pool.put(self.header)
            self.header = None

    def spans(self, request: float, staged: bool) -> list[tuple[int, int]]:
        """The writes of the page file: ``(bytes, file offset)``, each ``request`` payload bytes, the
        first also carrying the header (staged: ``request`` bytes each, header included, so that
        staging buffers are of one size: two 1 MiB requests share a huge-page slab, 1 MiB + 4 KiB
        would take one each)."""
        out = []
        start, size = 0, request + (0 if staged else HEADER_SIZE)
        while start < self.file_bytes:
            n = int(min(size, self.file_bytes - start))
            out.append((n, start))
            start, size = start + n, request
        return out

    def memory(self, n: int, start: int):
        """Where file bytes ``[start, start + n)`` of a page written from the caller's memory (aligned:
        no padding) lie: one ``(address, length)``, or a list of them (a vectored write spanning the
        header and the payload, or two segments)."""
        pieces = []
        if start < HEADER_SIZE:
            pieces.append((self.header.address + start, HEADER_SIZE - start))
        offset = max(start, HEADER_SIZE) - HEADER_SIZE
        pieces.extend(self.payload.pieces(offset, start + n - HEADER_SIZE - offset))
        return pieces if len(pieces) > 1 else pieces[0]

    def fill(self, address: int, n: int, start: int) -> None:
        """Copy file bytes ``[start, start + n)`` into staging memory at ``address``: the header, the
        payload from the caller's memory, zeros past its end. Zeros for the payload too once the caller
        let go of its memory (gone): such a job is never committed (Jobs.finish_under_writer)."""
        end = start + n
        if start < HEADER_SIZE:
            copy(address, self.header.address + start, min(end, HEADER_SIZE) - start)
        lo = max(start, HEADER_SIZE) - HEADER_SIZE  # payload offsets
        hi = max(lo, min(end - HEADER_SIZE, self.length))
        if hi > lo:
            with self._source() as readable:
                if readable:
                    self.payload.gather(address + HEADER_SIZE + lo - start, lo, hi - lo)
                else:
                    ctypes.memset(address + HEADER_SIZE + lo - start, 0, hi - lo)
        pad = end - HEADER_SIZE - hi
        if pad > 0:
            ctypes.memset(address + n - pad, 0, pad)


NEVER_FITS = "never fits"  # WritePage.refused of a catch-up copy larger than the tier's file system
CANCELLED = -1  # Job.err of a job cancelled: by clear(), a page its caller let go of (WritePage.gone), an unwanted copy


class Write:
    """One write request in flight: ``nbytes`` of ``job``'s file. ``epoch``: the tier's read epoch
    when submitted (-1: a read was running), so a completion measures the device only undisturbed."""

    __slots__ = ("job", "tier", "nbytes", "epoch", "staging", "budgeted", "t0", "ahead", "orphan")

    def __init__(self, job: "Job", nbytes: int, epoch: int):
        self.job, self.tier, self.nbytes, self.epoch = job, job.tier, nbytes, epoch
        self.staging = None  # the request's staging copy (a staged job), held until its completion
        self.budgeted = False  # its staging counts in the write staging budget (not once abandoned)


class Job:
    """One page on one tier: a temporary file and the writes that fill it (``ops``: ``(bytes, file
    offset)``), from the caller's memory or, ``staged``, each from a staging copy of its own."""

    __slots__ = ("page", "tier", "fd", "tmp", "ops", "staged", "next", "in_flight", "err", "tries")

    def __init__(self, page: WritePage, tier: int, fd: int, tmp: str, ops: list[tuple[int, int]], staged: bool):
        self.page, self.tier, self.fd, self.tmp, self.ops, self.staged = page, tier, fd, tmp, ops, staged
        self.next = 0  # ops[next:] not yet submitted
        self.in_flight = 0
        self.err = 0
        self.tries = 0
