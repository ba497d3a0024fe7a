"""The write side's queues: what puts handed in and the writer has not finished.

Accepting a put (the caller's thread)::

    keys already held by a usable tier, at the put's length -> touch (most recent), True, no I/O
        (idempotent, cheap); another length is another version: written over it
    a key another put is writing now -> waits for that page (written once); should that put's caller let
        go of its memory before a tier committed it, the first waiting put writes it from its own
    admission (admission.py): capacity, then replicate=budget; a skipped replica is counted,
        not a failure
    -> the page at the back of each target tier's FIFO

State: per tier a FIFO of pages waiting for a job and the bytes accepted and not yet written
(``queued``, P_k of admission.py); the pages being written, by key (a put of a key already on its
way waits for that copy, or writes it if that copy's caller lets go first); the pages clear()
cancelled, until their writes in flight end (``cancelled``: no put joins one); the bytes of pages not
done (``backlog``: a deferred put beyond ``write_backlog`` waits, back-pressure); the writer's two
conditions (``work``: new work or a wake-up, ``room``: backlog room). The end of a page's last tier
ends the page, and a put when its pages are done (:meth:`WriteQueue.job_over_under_writer`).

Lock: ``lock``, the queues' (callers and the writer, briefly; the writer takes it under
WritePath.lock, never the other way round): methods ending ``_under_queues`` run with it held.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .admission import admit, fit_capacity
from .errors import EngineClosedError
from .index import Index, tiers_in
from .integrity import HeaderError, NotRegularFile, read_header
from .layout import block_size_for, is_valid_key
from .locks import ranked_lock
from .puts import PutCall, WritePage
from .segments import Segment
from .stats import Stats
from .tiers import Tier

log = logging.getLogger("kvstream")


class WriteSettings(NamedTuple):
    """The settings the write path reads (a slice of Config: defaults live in config.SETTINGS only)."""

    replicate: str
    replicate_slack: float
    write_backlog: int
    write_timeout: float

    @classmethod
    def of(cls, config) -> "WriteSettings":
        return cls(*(getattr(config, name) for name in cls._fields))


class WriteQueue:
    """Per-tier FIFOs, pending pages, backlog and back-pressure, acceptance and admission's
    bookkeeping.

    :param bandwidth: tier k's write bandwidth for admission (bytes/s, 0 while unmeasured), asked
        under the queues' lock.
    """

    def __init__(self, tiers: list[Tier], index: Index, stats: Stats, chunk: int, settings: WriteSettings,
                 bandwidth: Callable[[int], float], thinned: Callable[[list[str]], None] = lambda keys: None):
        self.tiers = tiers
        self.index = index
        self.stats = stats
        self.chunk = chunk
        self.settings = settings
        self.bandwidth = bandwidth
        self.lock = ranked_lock("queue")  # the queues: taken briefly, by callers and the writer
        self.work = threading.Condition(self.lock)  # the writer waits here for work
        self.room = threading.Condition(self.lock)  # deferred puts wait here for backlog room
        self.fifo: list[deque[WritePage]] = [deque() for _ in tiers]  # pages waiting for a job on tier k
        self.copies: list[deque[WritePage]] = [deque() for _ in tiers]  # catch-up copies: after the FIFO
        self.thinned = thinned  # pages a put left on fewer tiers than there are (replication.py owes them)
        self.pending: dict[str, WritePage] = {}  # key -> the page being written
        self.cancelled: set[WritePage] = set()  # pages clear() cancelled, their writes in flight not yet
        # ended: out of ``pending`` (drop_all), so that a put of the key after the clear writes its own page
        self.queued = [0] * len(tiers)  # bytes accepted for tier k and not yet written (P_k), file bytes
        self.backlog = 0  # bytes of pages accepted and not done
        self.wakes = 0  # wake-ups so far: one during a writer's step cuts its next wait short
        self.exclusive = 0  # WritePath.exclusive() sections entered or waiting: the writer waits
        self.closing = False

    def wait_for_room(self, keys: Sequence[str], sizes: Sequence[int], mask: int) -> None:
        """Back-pressure: wait while the pages of ``keys`` (``sizes`` bytes each) would take the backlog
        past write_backlog. Counted are only the pages the put may add: not a page being written already
        (the put joins it, or skips another version), nor one a tier of ``mask`` holds (True, no I/O),
        nor a repeat of a key (the put answers it with its first) or an invalid key (refused). A put that
        adds nothing never waits, even with the backlog past its bound (a put larger than it is taken
        whole when the backlog is empty). Before, such a store waited for room for bytes it would never
        add, its caller (LMCache's store thread) held up by them."""
        # Held: as the index has it, no stat, outside the lock as in accept (a copy deleted behind the
        # engine's back is written once uncounted, a page over the bound at most).
        new: dict[str, int] = {}
        for key, n in zip(keys, sizes):
            if is_valid_key(key) and key not in new:
                new[key] = 0 if self._holders(key, n) & mask else n
        with self.lock:
            limit = self.settings.write_backlog

            def room() -> bool:
                need = sum(n for key, n in new.items() if key not in self.pending)
                return not need or not self.backlog or self.closing or self.backlog + need <= limit

            if not room():
                t0 = time.perf_counter()
                self.stats.total("backpressure_waits")
                self.room.wait_for(room)
                self.stats.total("backpressure_s", time.perf_counter() - t0)

    def wake(self) -> None:
        """A tier's last read ended (priority listener) or new work came: the writer looks again."""
        with self.lock:
            self.wake_under_queues()

    def wake_under_queues(self) -> None:
        """Every wake-up of the writer: counted, so that one that comes while the writer is in a step
        (not waiting: a notify alone would be lost) cuts its next wait short. Without the count a put
        accepted during a step that found nothing to do waited until some later wake-up, for ever if
        none came (WritePath._run)."""
        self.wakes += 1
        self.work.notify()

    def close(self) -> None:
        """No put is accepted from now on; the writer writes what is queued and stops."""
        with self.lock:
            self.closing = True
            self.wake_under_queues()
            self.room.notify_all()

    def drop_all(self) -> list[tuple[WritePage, int]]:
        """clear(): empty every FIFO (catch-up copies too); returns the (page, tier) dropped (each still
        to end)."""
        with self.lock:
            dropped = [(page, k) for queues in (self.fifo, self.copies) for k, fifo in enumerate(queues)
                       for page in fifo]
            for page in self.pending.values():
                page.spare = 0  # cancelled, not failed: no tier takes it after all,
                page.cleared = True  # nor a put that joined it (the KV it holds may be stale: a weight update)
            # A page with writes in flight ends when they do (its bytes stay in the backlog till then), out of
            # ``pending`` now: a put of its key after clear() returned (SGLang's flush, then the same prefixes
            # served again) writes a page of its own. Before, it joined the cancelled page and got False, its
            # page not stored; the cancelled page's end leaves the new one alone (job_over_under_writer).
            self.cancelled.update(self.pending.values())
            self.pending.clear()
            for fifo in (*self.fifo, *self.copies):
                fifo.clear()
        return dropped

    def withdraw(self, call: PutCall) -> list[tuple[WritePage, int]]:
        """An interrupted put (Jobs.withdraw_under_writer): its pages leave every FIFO (returned: (page,
        tier), each still to end there) and no tier replicate=budget skipped takes them after all; the
        put waits for no other put's page any more. Called again, it finds nothing more to do."""
        mine = set(call.pages)
        dropped = []
        with self.lock:
            for k, fifo in enumerate(self.fifo):
                kept = [page for page in fifo if page not in mine]
                if len(kept) < len(fifo):
                    dropped += [(page, k) for page in fifo if page in mine]
                    fifo.clear()
                    fifo.extend(kept)
            for page in call.pages:  # gone: no tier replicate=budget skipped takes it after all (a put that
                page.withdrawn = True  # joined it writes it from its own memory, there too: _hand_over_under_queues)
            # It waits for no other put's page: out of the calls of every page being written, its joins and
            # one a Ctrl-C cut short (in page.calls, not yet in call.joined); so its count is taken afresh, its
            # own pages not over (each ends it once): a cut-short join left it one off, the put waiting for ever
            for page in (*self.pending.values(), *self.cancelled):  # (a page it joined that clear() cancelled too)
                if page.calls[0][0] is not call and any(owner is call for owner, _ in page.calls):
                    page.calls = [(owner, i) for owner, i in page.calls if owner is not call]
            call.joined = []
            call.left = sum(1 for page in call.pages if page.left)
        return dropped

    def drop_tier(self, k: int) -> list[WritePage]:
        """Tier ``k`` failed: empty its FIFO; returns the pages dropped (each still to end there)."""
        with self.lock:
            dropped = list(self.fifo[k])
            self.fifo[k].clear()
        return dropped

    def copy(self, page: WritePage, tier: int) -> None:
        """A catch-up copy (WritePath.copy) joins the tier's copies: written after its FIFO."""
        with self.lock:
            if self.closing:
                raise EngineClosedError("kvstream engine is closed")
            self.copies[tier].append(page)
            self.wake_under_queues()

    # -- accept ----------------------------------------------------------------------------------
    def accept(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], mask: int, call: PutCall) -> None:
        """Queue the pages of ``call`` (made by the caller, which can withdraw it if an interrupt lands
        half-way: PutCall.withdraw)."""
        if len(pages) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(pages)} pages")
        # Pages the index already has are looked at on disk before the queue lock is taken: a get's
        # end takes that lock to wake the writer, and must not wait behind these stats.
        held: set[str] = set()
        for key, segments in zip(keys, pages):
            length = sum(n for _, n in segments)
            if is_valid_key(key) and key not in held and self._holders(key, length) & mask \
                    and self._still_held(key, mask):
                held.add(key)
        with self.lock:
            if self.closing:  # close() ran while this call was on its way in
                raise EngineClosedError("kvstream engine is closed")
            self.stats.total("puts")
            self.stats.total("pages_put", len(keys))
            self._enqueue_under_queues(call, keys, pages, mask, held)
            now = not call.left  # else the writer thread ends it
        if now:
            call.signal()  # nothing to write (held, invalid, no tier can take it): done now

    def _enqueue_under_queues(self, call: PutCall, keys: Sequence[str], pages: Sequence[Sequence[Segment]],
                        mask: int, held: set[str]) -> None:
        first: dict[str, int] = {}
        held_at: list[tuple[int, int, int]] = []  # (batch index, length, tiers) of each page held or being written
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
            writing = self.pending.get(key)
            if writing is not None and writing.length != length:  # another version being written now
                continue  # (another deployment's, another size): not this page; False, the next put writes it
            if writing is not None:  # another put is writing it: wait for that copy (or, should its caller
                # let go first, write it from this put's memory: _hand_over_under_queues)
                call.sources[i] = segments  # (first: a Ctrl-C may land between any two of these lines; a put
                writing.calls.append((call, i))  # is an heir only once the page is in call.joined, its memory
                call.joined.append(writing)  # known then; withdraw undoes a join cut short whole)
                call.left += 1
                tiers = writing.targets
                for k in writing.committed:  # fsync=full: the tiers done already
                    call.dirs.setdefault(k, set()).add(self.tiers[k].layout.page_dir(key))
                    tiers |= 1 << k
                held_at.append((i, length, tiers & mask))  # (its room there too: left out, the new pages after
                # it took the whole capacity and evicted it)
                continue
            holders = self._holders(key, length)
            if key in held and holders & mask:
                held_at.append((i, length, holders & mask))  # (its room on the tiers holding it: fit_capacity)
                call.held.append((i, key))  # touched below (this put's writes must not evict it), and at the end
                # with the new pages (_end_call_under_writer)
                self.stats.total("pages_existing")
                call.results[i] = True
                continue
            page = WritePage(key, segments, length, block_size_for(length, self.chunk), mask & ~holders)
            page.calls.append((call, i))
            page.gate = call.gate
            call.pages.append(page)
        self.index.touch_many(call.lru_order(held=True))
        self._admit_under_queues(call.pages, ((1 << len(self.tiers)) - 1) & ~mask, held_at)
        for page in call.pages:
            if not page.targets:  # no tier can take it (capacity, every tier failed): False
                self.stats.total("pages_failed")
                continue
            # A Ctrl-C may land between any two of these lines (PutCall.withdraw then undoes what it finds).
            # So the put counts the page first (one too many never ends it early; withdraw counts afresh),
            # the page enters its FIFOs gone (its entries void: the writer or withdraw ends them counting
            # nothing, job_over_under_writer), and one line, no call between its stores, makes it a page
            # being written: its jobs, its bytes per tier and in the backlog, its key (a later put joins it).
            # Before, a cut left it in ``pending`` in no FIFO, or in one uncounted: it never ended, its
            # bytes held in the backlog, and a later put of the key joined it and waited for ever.
            call.left += 1
            page.withdrawn = True
            for k in tiers_in(page.targets):
                self.fifo[k].append(page)
            queued = [n + page.file_bytes * (page.targets >> k & 1) for k, n in enumerate(self.queued)]
            self.pending[page.key], self.backlog, self.queued, page.left, page.withdrawn = \
                page, self.backlog + page.length, queued, page.targets.bit_count(), False
        call.pages = [p for p in call.pages if p.targets]
        if call.left:
            self.wake_under_queues()

    def _holders(self, key: str, length: int) -> int:
        """The tiers the index lists for ``key`` at ``length`` bytes. A version of another length
        (another deployment's in the namespace: another KV dtype) is no copy of this page: the put
        writes it to every tier it goes to, over that version (Index.commit forgets the other one)."""
        if not self.index.holders(key):  # (lock-free: most keys of a put are new)
            return 0
        info = self.index.get(key)
        return info.tiers if info is not None and info.length == length else 0

    def _still_held(self, key: str, mask: int) -> bool:
        """Whether a usable tier the index lists for ``key`` still has its file (one stat per tier
        until one does; on a network file system a read of its header: a stat there is answered from
        the client's cache, GlusterFS's for about a second after another node removed the file). A put
        answers True without writing only then: a copy deleted behind the engine's back (an operator,
        another process's eviction, another node's delete or clear) is forgotten and written again."""
        for k in tiers_in(self.index.holders(key) & mask):
            tier = self.tiers[k]
            path = tier.layout.page_path(key)
            try:
                if tier.local:  # (a stat there is the disk's word)
                    st = os.stat(path, follow_symlinks=False)
                    ours = stat.S_ISREG(st.st_mode) and tier.trust.owns(st)
                else:
                    try:
                        tier.calls.run(read_header, path, tier.trust)  # (bounded: it may hang, bounded.py)
                        ours = True
                    except (HeaderError, NotRegularFile):  # (untrusted too) damaged, or none of ours
                        ours = False
            except OSError as exc:
                if tier.copy_gone(exc.errno, key):  # this file alone is gone (deleted, or replaced
                    self.index.remove(key, k)  # by another node: ESTALE); a tier that went keeps its entries,
                elif exc.errno in (errno.ENOENT, errno.ETIMEDOUT):  # as on a read: its copies may come back
                    tier.fail(exc.errno, f"look up {key}")  # with it; or it did not answer in time
                continue  # (else cannot tell, EIO...: the entry stays, the page is written again)
            if ours:
                return True
            # A link or another owner's file under the name is never read (trust.py), so no copy: the
            # write renames one of ours over the name.
            self.index.remove(key, k)
        return False

    def _admit_under_queues(self, new: list[WritePage], failed_tiers: int,
                            held_at: Sequence[tuple[int, int, int]] = ()) -> None:
        """Each new page's target tiers (admission.py), each admitted after the bytes of the ones before it
        (counted in self.queued as the pages are queued: _enqueue_under_queues). ``held_at``: the put's pages
        held already or being written by another put, (batch index, length, their tiers): they keep their room
        on a capacity-limited tier."""
        batch = sorted([(page.calls[0][1], page.length, page.targets, page) for page in new] +
                       [(i, length, tiers, None) for i, length, tiers in held_at], key=lambda e: e[0])
        targets = [e[2] for e in batch]
        queued = list(self.queued)  # (a Ctrl-C in here leaves self.queued as it was)
        for k, n in enumerate(fit_capacity([e[1] for e in batch], targets, self.index.capacities,
                                           [e[3] is None for e in batch])):
            if n:
                self.stats.add(k, "skipped_writes", n)
        targets = [t for t, e in zip(targets, batch) if e[3] is not None]
        new = [e[3] for e in batch if e[3] is not None]
        bandwidth = [self.bandwidth(k) for k in range(len(self.tiers))]
        replicate, slack = self.settings.replicate, self.settings.replicate_slack
        for page, wanted in zip(new, targets):
            page.expected = wanted | failed_tiers
            page.targets = admit(page.file_bytes, wanted, queued, bandwidth, replicate, slack)
            for k in tiers_in(wanted & ~page.targets):  # a skipped replica: not expected, not a failure
                page.expected &= ~(1 << k)
                page.spare |= 1 << k
                self.stats.add(k, "replica_skipped_pages")
                self.stats.add(k, "replica_skipped_bytes", page.file_bytes)
            for k in tiers_in(page.targets):
                queued[k] += page.file_bytes

    # -- the end of a page, and of a put (the writer, under WritePath.lock) ------------------------
    def job_over_under_writer(self, page: WritePage, k: int) -> None:
        """One tier of the page is done (written, failed or skipped); the last one ends the page."""
        if page.copied is not None:  # a catch-up copy: no put waits, nothing was counted for it
            page.copied(bool(page.committed), time.monotonic() - page.started if page.started else 0.0, page.refused)
            return
        with self.lock:  # (callers add to queued and backlog under it too)
            if not page.left:  # an entry of a page whose put a Ctrl-C cut short before counting it: void
                return  # (nothing of it was counted, nothing ends: _enqueue_under_queues)
            self.queued[k] -= page.file_bytes
            page.left -= 1
            if page.left or self._spare_job_under_queues(page):
                return
            heir = self._hand_over_under_queues(page)
            if heir is None:
                if self.pending.get(page.key) is page:  # (not a page clear() cancelled: the key's may be
                    del self.pending[page.key]  # a later put's, being written now)
                self.cancelled.discard(page)
                self.backlog -= page.length  # (a page handed over keeps its bytes in the backlog)
                self.room.notify_all()
        ok = bool(page.committed)
        if ok:
            self.stats.total("pages_stored")
            if page.expected & ~self.index.holders(page.key):
                self.stats.total("under_replicated")
        elif heir is None:  # (a page handed over is counted once, when its heir ends)
            self.stats.total("pages_failed")
        if ok and len(page.committed) < len(self.tiers):
            self.thinned([page.key])  # a skipped or failed replica: background replication owes it
        for call, i in page.calls:
            if heir is not None and (call, i) in heir.calls:
                continue  # (waits for the heir now)
            call.results[i] = ok
            call.left -= 1
            if not call.left:
                self._end_call_under_writer(call)

    def _spare_job_under_queues(self, page: WritePage) -> bool:
        """Every tier of the page failed it (the home tier's quota, EIO): a healthy tier that
        replicate=budget skipped writes it after all, before the put answers (promise 4: writes go to
        the healthy tiers). True when one took it. Not a page whose caller let go of its memory (gone):
        what is left of it is for a put that joined it (_hand_over_under_queues)."""
        if page.committed or page.gone():
            return False
        for k in tiers_in(page.spare):
            page.spare &= ~(1 << k)
            if self.tiers[k].healthy:
                log.info("kvstream: page %s failed on its tiers; written to tier %d, which skipped it", page.key, k)
                page.targets |= 1 << k
                page.expected |= 1 << k
                page.left += 1
                self.queued[k] += page.file_bytes
                self.fifo[k].append(page)
                self.wake_under_queues()
                return True
        return False

    def _hand_over_under_queues(self, page: WritePage) -> WritePage | None:
        """The page's caller let go of its memory (WritePage.gone: a gated put_deferred's caller closed,
        L2Core.close; a put interrupted, withdrawn) before a tier committed it, so it is cancelled. The
        puts that joined it (a key being written waits for that copy) did not let go of theirs: the
        first of them writes the page from its own memory, as a page of its own (withdrawn with it, gone
        with its gate) that the others join, on the tiers the page was admitted to; the caller that let
        go gets False. Returns that page, queued (its bytes stay in the backlog), or None: no put waits
        whose memory can be read, or clear() cancelled the page (never written after it)."""
        if page.committed or page.cleared or not page.gone():
            return None
        heirs = [(call, i) for call, i in page.calls[1:]  # (calls[0]: the one that let go; a put whose join a
                 if not call.let_go() and page in call.joined]  # Ctrl-C cut short took its memory back)
        if not heirs:
            return None
        owner, i = heirs[0]
        heir = WritePage(page.key, owner.sources[i], page.length, page.block, page.targets)
        heir.expected, heir.spare, heir.gate, heir.calls = page.expected, page.spare, owner.gate, heirs
        owner.joined.remove(page)
        owner.pages.append(heir)  # (its own now: withdrawn with it, PutCall.withdraw)
        for call, _ in heirs[1:]:
            call.joined[call.joined.index(page)] = heir
        self.pending[page.key] = heir
        for k in tiers_in(heir.targets):
            self.queued[k] += heir.file_bytes
            self.fifo[k].append(heir)
            heir.left += 1
        self.wake_under_queues()
        log.info("kvstream: page %s: its caller let go of its memory; written from the memory of a put that "
                 "joined it", page.key)
        return heir

    def _end_call_under_writer(self, call: PutCall) -> None:
        call.sync_dirs(self.tiers, self.stats)
        self.index.touch_many(call.lru_order())  # (not completion order)
        call.signal()

