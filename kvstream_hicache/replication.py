"""Background replication: replicas a page lacks are written later, from a copy that exists.

A page can hold fewer copies than there are tiers: ``replicate=budget`` skipped a slow tier's replica
so that a put need not wait for it, a tier failed and came back without its files, a copy was
damaged and removed, or a tier evicted it. Reads then have fewer tiers to route between, for ever.
(An evicted copy is not owed back: the tier chose to keep hotter pages. It returns when it is read
again, as a promotion, or at the next start if the tier has room then; a sweep (below) still under way
when the tier evicts it owes it, since a sweep owes what lacks a tier when it gets there: written
only into room the tier has, as its least recent page.)
The :class:`Replicator` owes such a page to each tier that lacks it and writes it there later::

    owe(key)                 the tiers that lack it (every tier, failed ones too: written when back)
    read(keys, pages, found) after a get: every page it asked for that lacks a tier is owed (a copy
                             the read removed as damaged, a stray); a page found only on slower tiers
                             (another node's page on the shared tier, a page tier 0 evicted) is
                             promoted: owed to the faster tiers first, the caller's copy kept in
                             memory as the source (at most 1/PROMOTE_SHARE of `memory`; beyond it
                             owed behind the rest, and only to a tier with room: a full one would
                             keep it owed for good, a copy from a holder never evicts)
    the replicator thread, per tier k, while
        tier k is healthy, no get reads from it (nor from the source tier), its write FIFO is empty
        (foreground puts first), its last catch-up job ended long enough ago (pacing: a job that took
        t keeps the tier's next one back for t * (1 - share) / share, so catch-up takes at most
        ``share`` of the tier's write time), and it has room within its capacity:
      a file already under the page's name there (another process sharing the namespace wrote it
      after this engine last looked): a valid page of the indexed content is indexed, as the scan would
      have (``_learn``; not where a clear() came since the key was taken), anything else left alone
      (another version too: the read path's rule); nothing is written over it. Else
      read the page from a holder (O_DIRECT, the whole file), check its header and every block CRC
      against the index, and hand it to the writer (WritePath.copy), which writes it as any job,
      after the tier's foreground FIFO, held back by reads, without evicting (a promoted page just
      read may evict the tier's least recent pages, as a put would)

Nothing of this survives a restart, and nothing needs to: the background start-up scan indexes what
each tier holds, and when it has read every tier (only then is it known what a tier lacks) the engine
owes every page that lacks a tier again (:meth:`owe_all`; also when a failed tier rejoins). That is a
sweep of the index per tier, SWEEP_BATCH pages at a time as the tier takes them (``Index.lacking``):
no list of every page is made, and a tier without room holds one batch. A tier without room
stops its catch-up (the page stays owed, ``pending``) until pages leave it; a copy it does take enters
its LRU as the least recent page (jobs.py), so it never costs a page the tier chose to keep. A page
that finds a tier full (at its capacity when it would be owed or its sweep reaches it, or on a file
system full of files no copy may evict) is not owed page by page: the tier is looked at once a second for
room, and then its sweep owes it what it lacks (``_full``, ``_room_again``).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from .bounded import GivenUp
from .fds import close_fd
from .index import Index, tiers_in
from .integrity import HeaderError, block_crcs, unpack_header
from .layout import HEADER_SIZE, file_size
from .locks import ranked_lock
from .priority import ReadPriority
from .puts import NEVER_FITS
from .scan import index_found
from .segments import Payload, Segment
from .staging import BufferPool
from .stats import Stats
from .tiers import Tier

log = logging.getLogger("kvstream")

IDLE_S = 0.25  # longest wait of the replicator thread with work it cannot start now (held, paced, full), s
FAILED_BACKOFF_S = 1.0  # a catch-up write that failed on a tier (no room, an error): its catch-up waits, s
REFUSED_BACKOFF_MAX = 64  # a tier that keeps refusing copies for room it seems to have (a quota): its looks
# back off, doubling from FAILED_BACKOFF_S up to this many times it (each look reads a page to try again)
PROMOTE_SHARE = 4  # promoted pages kept in memory as sources: at most 1/this of the `memory` setting
SWEEP_BATCH = 256  # pages the sweep of the index (owe_all) owes a tier at a time


def _above_fastest(healthy: int, holders: int) -> int:
    """The healthy tiers faster than the fastest of ``holders`` (bitmasks; tier 0 is the fastest)."""
    return healthy & ((holders & -holders) - 1) if holders else 0


class Replicator:
    """What each tier is owed, and the thread that writes it (module docstring).

    :param writes: the engine's WritePath: ``copy()`` writes a page from memory, ``idle(k)`` says the
        tier's foreground FIFO is empty.
    :param pool: buffers for source copies (the write half of ``memory``).
    :param catchup: the setting: off, nothing is owed and the thread does not run.
    :param catchup_share: the setting: the most of a tier's write time catch-up takes.
    :param promote_bytes: memory promoted pages may hold as their sources, bytes.
    :param copy_bytes: the largest page file a catch-up copy reads (``memory``), bytes, but of a page a tier of
        this user's alone holds (_users_own).

    Lock: ``_lock`` (rank ``replicator``, condition ``_work``): methods ending ``_under_replicator``
    run with it held.
    """

    def __init__(self, tiers: list[Tier], index: Index, writes, priority: ReadPriority, stats: Stats,
                 pool: BufferPool, digest: str, *, catchup: bool, catchup_share: float,
                 promote_bytes: int = 16 << 20, copy_bytes: int = 64 << 20,
                 clock: Callable[[], float] = time.monotonic):
        self.tiers, self.index, self.writes, self.priority, self.stats = tiers, index, writes, priority, stats
        self.pool, self.digest, self.enabled, self.share, self.clock = pool, digest, catchup, catchup_share, clock
        self.promote_bytes, self.copy_bytes = promote_bytes, copy_bytes
        self._told_too_large = False
        self.scanned: Callable[[int], bool] = lambda k: False  # the start-up scan listed tier k whole (the engine's)
        self.all_tiers = (1 << len(tiers)) - 1
        self._lock = ranked_lock("replicator")  # under it: the index, the write queue (a copy handed to the
        # writer), the staging pool; taken under the read and write paths' locks (a get's end, the writer's
        # callbacks, clear())
        self._work = threading.Condition(self._lock)
        self._owed: list[OrderedDict[str, None]] = [OrderedDict() for _ in tiers]  # oldest first
        self._copies: dict[str, _Source] = {}  # promoted pages' sources in memory
        self._copy_bytes = 0
        self._busy: list[str | None] = [None] * len(tiers)  # the page of the tier's job with the writer
        self._next = [0.0] * len(tiers)  # pacing: the tier's next job not before this
        self._sweep = [-1] * len(tiers)  # owe_all: the index slot the tier's sweep goes on from (-1: none)
        # A tier that had no room for a page it lacks (at its capacity, or a file system full of files this
        # engine may not evict: another program's, another node's): that page's payload bytes (0: none).
        # Nothing is owed to it one by one meanwhile (the list would grow with every put and read); once
        # it has room for such a page, its sweep owes it again what it lacks (_room_again).
        self._full = [0] * len(tiers)
        self._refused = [0] * len(tiers)  # copies the tier refused for room in a row (_finished)
        self._passed = [0] * len(tiers)  # pages passed over (_pass_over) since a job started
        self._closing = False
        self._epoch = 0  # bumped by clear(): a job of before it leaves no trace
        self._thread = None
        if catchup:
            priority.listen(self._wake)
            self._thread = threading.Thread(target=self._run, name="kvstream-replicator", daemon=True)
            self._thread.start()

    # -- what is owed ----------------------------------------------------------------------------
    def owe(self, keys: Iterable[str]) -> None:
        """Each key is owed to the tiers the index says lack it (none if it is held nowhere)."""
        if not self.enabled:
            return
        woke = False
        with self._lock:
            sweeping = max(self._sweep) >= 0
            for key in keys:
                holders = self.index.holders(key)
                if holders:
                    slot = self.index.slot(key) if sweeping else -1
                    info = None
                    for k in tiers_in(self.all_tiers & ~holders):
                        self.index.owed_again(key, k)  # (a copy it evicted: owed by this read or put)
                        if not self.tiers[k].healthy:  # out: its sweep of the index owes it what lacks it once
                            self._sweep[k] = max(self._sweep[k], 0)  # back (owe_all); a key per put kept meanwhile
                            continue  # grew for as long as the outage, pages evicted or deleted since and all
                        if 0 <= self._sweep[k] <= slot or self._full[k]:
                            continue  # the tier's sweep reaches it (a full tier's, once it has room)
                        if self.index.capacities[k] is not None:
                            info = info or self.index.get(key)
                            if info is None:
                                continue
                            if not self.index.fits(k, info.length):  # full: a copy never evicts (owed, it would stay
                                if self.index.ever_fits(k, info.length):  # so): its sweep finds it once the
                                    self._full[k] = info.length  # tier has room (before, only a restart's
                                    woke = True  # did: a replica skipped meanwhile never came back)
                                continue
                        self._owed[k][key] = None
                        woke = True
            if woke:
                self._work.notify()

    def owe_all(self) -> None:
        """Every indexed page that lacks a tier is owed to it (the start-up scan done, a tier rejoined):
        each tier's sweep of the index starts again from its first slot."""
        if not self.enabled:
            return
        with self._lock:
            self._sweep = [0] * len(self.tiers)
            for owed in self._owed:  # the sweeps owe them again, but promoted pages: they stay first
                for key in [key for key in owed if key not in self._copies]:
                    del owed[key]
            self._work.notify()

    def rejoined(self, k: int) -> None:
        """Tier ``k`` failed and rejoins (Engine's rejoin thread, before what it lacks is owed again): it is
        looked at as a fresh tier. Its back-offs and fullness were the tier's before it failed (a quota raised,
        a file system remounted since): before, a tier that had refused copies kept its catch-up waiting up to
        REFUSED_BACKOFF_MAX s after it rejoined. One still full is found so again by its first look."""
        with self._lock:
            self._refused[k], self._next[k], self._full[k] = 0, 0.0, 0
            self._work.notify()

    def read(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], found: Sequence[bool]) -> None:
        """A get asked for ``keys`` and read ``found`` into ``pages`` (called before it returns, while
        the caller's memory holds the verified pages). Each page that lacks a tier is owed to it (a copy
        the read removed as damaged, a stray, a replica skipped or lost); one that lacks a tier faster
        than its fastest holder is promoted: owed there ahead of the rest, with the caller's copy as
        its source while memory allows."""
        if not self.enabled:
            return
        healthy = sum(1 << t.k for t in self.tiers if t.healthy)
        for key, segments, ok in zip(keys, pages, found):
            # (the holders first: no lock, no entry built, for every page read; the entry only for a
            # page to promote, and its holders again from it)
            if not ok or not _above_fastest(healthy, self.index.holders(key)):
                continue
            info = self.index.get(key)
            faster = _above_fastest(healthy, info.tiers) if info is not None else 0
            # (a tier whose capacity is below the page never holds it: owed, it was tried for good, its copy held)
            faster = sum(1 << k for k in tiers_in(faster) if self.index.ever_fits(k, info.length)) if faster else 0
            if not faster:
                continue
            source, size = None, file_size(info.length)
            with self._lock:
                room = key not in self._copies and self._copy_bytes + size <= self.promote_bytes
                if room:
                    self._copy_bytes += size  # counted now: another get sees it
            if room:
                source = _Source(self.pool.get(size), info, 0)
                Payload(segments).gather(source.buf.address + HEADER_SIZE)
                pad = size - HEADER_SIZE - info.length  # the file's padding is zeros
                ctypes.memset(source.buf.address + HEADER_SIZE + info.length, 0, pad)
            with self._lock:
                if source is not None:
                    self._copies[key] = source
                for k in tiers_in(faster):
                    if source is None and not self.index.fits(k, info.length):
                        continue  # (without a copy it may not evict: a full tier would hold it owed for good)
                    self._owed[k][key] = None
                    if source is not None:  # ahead of the rest only with its copy (which may evict)
                        self._owed[k].move_to_end(key, last=False)
                self._work.notify()
        self.owe(keys)  # (after the promoted copies are in place: their jobs must find them)

    def pending(self, k: int) -> int:
        """Pages owed to tier ``k`` (a job with the writer included, and those its sweep has yet to reach)."""
        with self._lock:
            owed, at = len(self._owed[k]), self._sweep[k]
            if self._full[k]:  # its sweep owes it every page it lacks once it has room (the owed among them)
                owed, at = 0, 0
            elif at < 0:
                return owed
            else:  # promoted pages are owed ahead of the sweep: those it has yet to reach are counted once
                owed -= sum(1 for key in self._owed[k] if key in self._copies and self.index.slot(key) >= at
                            and not self.index.evicted_from(key, k))  # (one it evicted: the sweep passes it)
        return owed + self.index.count_lacking(k, at)

    def clear(self) -> None:
        """Engine.clear(): nothing is owed any more (a job with the writer is cancelled by it)."""
        with self._lock:
            self._epoch += 1
            self._sweep = [-1] * len(self.tiers)
            self._full = [0] * len(self.tiers)
            self._refused = [0] * len(self.tiers)  # (and no back-off of before carried over: _finished)
            self._next = [0.0] * len(self.tiers)
            for owed in self._owed:
                owed.clear()
            copies, self._copies, self._copy_bytes = self._copies, {}, 0
            for key in self._busy:  # a job with the writer may still read its source: freed when it ends
                copies.pop(key, None)
        for source in copies.values():
            self.pool.put(source.buf)

    def close(self) -> None:
        """Stop the thread; a job with the writer completes there (WritePath.close writes it)."""
        with self._lock:
            self._closing = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join()

    # -- the replicator thread ---------------------------------------------------------------------
    def _wake(self) -> None:
        """The end of a get (priority.py): the thread looks again, only if something is owed (else it
        would take the GIL from the reader after every batch for nothing)."""
        with self._lock:
            if any(self._owed) or max(self._sweep) >= 0:  # (a full tier is looked at on a timer: _idle_wait)
                self._work.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closing:
                    return
            started = False
            for k in range(len(self.tiers)):
                try:
                    started |= self._start(k)
                except Exception:  # a bug must not stop catch-up for good, nor reach a caller
                    log.exception("kvstream: background replication to tier %d failed", k)
            with self._lock:
                if not started and not self._closing:
                    self._work.wait(self._idle_wait_under_replicator())

    def _idle_wait_under_replicator(self) -> float | None:
        """How long the thread may sleep: until a paced tier may go again, IDLE_S with work it cannot
        start now (reads, puts, a full tier: the end of a get and a finished job wake it sooner), until
        a full tier's next look for room (_room_again) with nothing else owed, no limit with nothing
        owed (owe() wakes it)."""
        now = self.clock()
        if not any(self._owed) and max(self._sweep) < 0:
            if not any(self._full):
                return None
            # only full tiers: their next look (a second apart), never sooner than IDLE_S
            return max(IDLE_S, min(t for t, full in zip(self._next, self._full) if full) - now)
        paced = [t - now for t, owed, full, busy in zip(self._next, self._owed, self._full, self._busy)
                 if (owed or full) and busy is None and t > now]
        return min([IDLE_S, *paced])

    def _start(self, k: int) -> bool:
        """Hand tier ``k``'s next owed page to the writer if the tier may take it now; True if one went."""
        tier = self.tiers[k]
        if self._busy[k] is not None or not tier.healthy or self.clock() < self._next[k] or self.priority.reading(k) \
                or not self.writes.idle(k):
            return False
        if self._full[k] and not self._owed[k] and not self._room_again(k):
            return False
        with self._lock:
            # the index's epoch before the key is taken: Engine.clear() empties the owed lists (under this
            # lock) before the index, so a look that spans a clear() indexes nothing (_learn)
            index_epoch = self.index.epoch
            owed = self._owed[k]
            if not owed and self._sweep[k] >= 0:  # the next pages of the tier's sweep
                keys, self._sweep[k] = self.index.lacking(k, self._sweep[k], SWEEP_BATCH)
                owed.update(dict.fromkeys(keys))
                if not owed:
                    return self._sweep[k] >= 0  # (nothing lacking in that stretch: on with the next at once)
            while owed:
                key = next(iter(owed))
                info = self.index.get(key)
                if info is None or info.tiers >> k & 1 or self.writes.writing(key):
                    del owed[key]  # held there now, gone, or a put is writing it (it owes it back if it fails)
                    self._drop_copy_under_replicator(key)
                    continue
                break
            else:
                return self._sweep[k] >= 0
            source = self._copies.get(key)
            epoch = self._epoch
        try:
            named = tier.named(key)
            if named:
                self._learn(tier, key, index_epoch)
        except OSError as exc:  # (the tier did not answer in time, bounded.py: it fails; the page stays owed)
            tier.fail(exc.errno or errno.EIO, f"catch-up look at {key}")
            return True
        if named:
            # A file of that name the index did not list: learned if a valid copy of the indexed page
            # (_learn); else another writer's version of the page, or a stray; neither is ours to replace
            # (the read path and check() deal with them).
            with self._lock:
                self._owed[k].pop(key, None)
                self._drop_copy_under_replicator(key)
            return True  # (looked at one: the thread comes back at once)
        promoted = source is not None and source.info.epoch == info.epoch and \
            source.info.same_content(info.length, info.block, info.crcs)
        if source is not None and not promoted:  # the page changed since it was read: that copy is stale
            with self._lock:
                if key not in self._busy and self._copies.pop(key, None) is source:
                    self._copy_bytes -= file_size(source.info.length)
                    self.pool.put(source.buf)
        if not promoted:  # (a promoted copy may evict: its tier's room is the writer's to make)
            # Full: at its capacity (a copy never evicts; the index tells, no I/O), or its file system is, of
            # files no copy may evict (another program's, another node's). A page that never fits there (larger
            # than the capacity, or than the file system) is dropped: taken for full, the tier would wait for
            # room that never comes. Otherwise the tier is full for the catch-up, as owe() finds it: nothing is
            # owed to it one by one (the list would grow with every put), and once it has room for this page
            # its sweep owes it again what it lacks (before, at its capacity the page stayed owed and each wake
            # looked its name up on the tier again; on a full file system each page met was dropped, and its
            # replica never came back while the engine ran).
            if file_size(info.length) > self.copy_bytes and not self._users_own(info.tiers):  # (read whole into
                # one buffer: a shared tier's member writes pages of any size, and a sparse one of 64 GiB was read
                # into a buffer of 64 GiB)
                self._too_large(k, key, info.length)
                return True
            full = not self.index.fits(k, info.length)
            if full:
                never = not self.index.ever_fits(k, info.length)
            else:
                full = _fs_short(tier, info.length)
                never = full and _larger_than(tier, 2 * file_size(info.length))
            if never:
                self._dropped(k, key)
                return True
            if full:
                with self._lock:
                    self._full_under_replicator(k, info.length, self.clock() + FAILED_BACKOFF_S)
                return False
            source = self._read_source(key, info)
            if not isinstance(source, _Source):
                if source:  # holders were read and none had a valid copy: dropped
                    self._dropped(k, key)
                    return False
                return self._pass_over(k, key)  # (no holder can be read now)
        self._busy[k] = key
        self._passed[k] = 0

        def done(ok: bool, took: float, refused: bool) -> None:
            self._finished(k, key, source, promoted, ok, took, epoch, refused)

        with self._lock:  # (clear() since this began: the copy would bring a cleared page back)
            if epoch != self._epoch:  # (clear() freed the promoted copies but this one: it was busy)
                self._busy[k] = None
                if not promoted or key not in self._busy:
                    self.pool.put(source.buf)
                return False
            # A page just read is the most recent of all: it may evict the tier's least recent pages.
            self.writes.copy(key, source.buf.address + HEADER_SIZE, info, source.created, k, promoted, done)
        return True

    def _finished(self, k: int, key: str, source: "_Source", promoted: bool, ok: bool, took: float,
                  epoch: int, refused: bool | str = False) -> None:
        """The writer's callback (its thread): account, pace the tier, free the source if no tier needs
        it. ``took``: the job's time from its start on the tier (not its wait behind puts and reads).
        ``refused`` NEVER_FITS: larger than the tier's whole file system, the page alone is dropped there."""
        never, refused = refused == NEVER_FITS, refused is True
        now = self.clock()
        with self._lock:
            self._busy[k] = None
            free = not promoted
            if epoch == self._epoch:
                if ok or never:
                    self._owed[k].pop(key, None)
                elif key in self._owed[k]:  # (no room when its job started, an error, the writer gave up:
                    self._owed[k].move_to_end(key)  # still owed; the next look decides again)
                # Pacing: catch-up takes at most `share` of the tier's write time.
                self._next[k] = now + (took * (1 - self.share) / self.share if ok else FAILED_BACKOFF_S)
                self._refused[k] = self._refused[k] + 1 if refused else 0
                if refused:  # the tier is full, whatever statvfs showed (out of inodes, over a quota): as
                    # _start's look at its file system finds one (no page read each look), and a quota that
                    # no look can see is tried again less and less often
                    back_off = FAILED_BACKOFF_S * min(1 << self._refused[k] - 1, REFUSED_BACKOFF_MAX)
                    # A promoted copy refused evicted all it could: the tier's other promoted pages would be
                    # refused too, their sources held in memory for as long as it refuses (and, promote_bytes
                    # taken, no page read promoted with its copy to any tier): they leave the owed list, the
                    # sweep owes them again, from a holder, once the tier has room
                    self._full_under_replicator(k, source.info.length, now + back_off, keep_promoted=not promoted)
                if promoted:
                    self._drop_copy_under_replicator(key)
            elif promoted and key not in self._busy:  # cleared meanwhile: clear() left this copy to us
                free = True
            self._work.notify()
        if free:
            self.pool.put(source.buf)
        if never:
            self.stats.add(k, "replication_dropped")
        if ok:
            self.stats.add(k, "replication_done")
            self.stats.add(k, "replication_bytes", source.info.length)
            if promoted:
                self.stats.add(k, "replication_promoted")
        elif refused and self._refused[k] == 1:  # (once a streak: a quota's looks would repeat it)
            log.info("kvstream: tier %d refused a catch-up copy for room its file system seemed to have (out of "
                     "inodes, over a quota?): what it lacks is owed again once a copy fits", k)

    def _dropped(self, k: int, key: str) -> None:
        """The page of ``key`` will not be copied to tier ``k`` (it never fits there, or no holder has a valid
        copy): no longer owed, counted."""
        with self._lock:
            self._owed[k].pop(key, None)
        self.stats.add(k, "replication_dropped")

    def _users_own(self, holders: int) -> bool:
        """Whether a tier of ``holders`` (a mask) trusts this user alone: no one else writes there, so the page held
        there (written by this user, or copied by a catch-up within ``copy_bytes``) is of a size its caller puts,
        copied whatever ``memory`` (puts and reads take pages larger than it: LMCache's 80 MiB chunk of a 70B
        model at the default 64M; bounded on every tier, such a lost replica was dropped for good)."""
        me = frozenset({os.geteuid()})
        return any((t := self.tiers[h].trust) is not None and t.gid is None and t.uids == me for h in tiers_in(holders))

    def _too_large(self, k: int, key: str, length: int) -> None:
        """The page of ``key`` is larger than a catch-up copy may read into memory: dropped, said once."""
        self._dropped(k, key)
        if not self._told_too_large:
            self._told_too_large = True
            log.warning("kvstream: catch-up does not copy a page of %d bytes (%s) to tier %d: larger than `memory` "
                        "(%d bytes), which holds a copy whole; raise `memory` to replicate pages of that size", length,
                        key, k, self.copy_bytes)

    def _full_under_replicator(self, k: int, length: int, until: float, keep_promoted: bool = True) -> None:
        """Tier ``k`` has no room for a page of ``length`` payload bytes it lacks (_full): nothing is owed to it
        one by one until it has (a promoted page keeps its place: its copy may evict, unless ``keep_promoted``
        is False: such a copy was refused too), and it is looked at again at ``until`` (_room_again)."""
        for owed_key in [owed_key for owed_key in self._owed[k] if not keep_promoted or owed_key not in self._copies]:
            del self._owed[k][owed_key]
            self._drop_copy_under_replicator(owed_key)  # (its source, once no tier is owed it)
        self._sweep[k] = -1
        self._full[k] = length
        self._next[k] = until

    def _learn(self, tier: Tier, key: str, epoch: int) -> None:
        """Tier ``tier`` has a file under ``key``'s name that the index does not list there: index it if
        it is a valid page of the content the index holds (scan.index_found: as the start-up scan would
        have). Such a page was written there by another process sharing the namespace after this engine
        last looked: the start-up scan had passed its directory, and a lookup looks only for keys the
        index lacks on every tier. Left unknown, it was never read from that tier (one replica short for
        routing) and check() reported it "on disk but not indexed"; owed, it is here already, and is not
        written again.

        Another version is left alone, whatever its write time, as a read leaves one it meets where an
        indexed copy is left (docs/design.md "Several writers of one key"). By the scan's rule (the newer
        wins), a version another process wrote on a shared tier after this one's put took the place of
        the copies this process wrote, on its private tier too: their files stayed, valid, never indexed
        again nor evicted, room its capacity did not count (and the read that had just forgotten that
        file for the indexed version is what owed the page to this look).

        ``epoch``: the index's when the key was found owed (Index.epoch). A clear() since then empties the
        index before it removes the files, tier by tier, and a file this look reads in between is a page
        of before the clear (read at the look, the epoch was the clear's: the page was indexed after it,
        found, its file gone a moment later). Once the start-up scan has listed this tier whole, a file found
        here was not there at the start: another process's, whatever its stamps say (Index._theirs; a tier
        whose scan stopped when it failed holds pages of before the restart in the shards it did not list)."""
        since = self.scanned(tier.k)  # (before the look: a file read now was not there when the scan listed it)
        mark = self.index.mark(key)
        page = tier.look(self.digest, key)  # (None: the tier did not answer in time; it failed)
        if page is not None and page.problem is None:  # (RETRY: its copy left the index since)
            index_found(self.index, tier.k, page, epoch, mark, versions=False, since=since)

    def _pass_over(self, k: int, key: str) -> bool:
        """Tier ``k``'s next page cannot start now for a reason of its own (its holders failed, or read
        now): it goes behind the others, which start first. True (look again at once) until every
        page owed to the tier was passed over since a job last started (then the thread waits)."""
        with self._lock:
            owed = self._owed[k]
            if key in owed:
                owed.move_to_end(key)
            self._passed[k] += 1
            return self._passed[k] < len(owed)

    def _drop_copy_under_replicator(self, key: str) -> None:
        """A promoted page's source leaves memory once no tier is owed the page."""
        source = self._copies.get(key)
        if source is not None and key not in self._busy and not any(key in owed for owed in self._owed):
            del self._copies[key]
            self._copy_bytes -= file_size(source.info.length)
            self.pool.put(source.buf)

    def _room_again(self, k: int) -> bool:
        """Tier ``k`` was full (``_full``): True once it has room for the page it had none for, within its
        capacity and on its file system (a copy and as much again), and its sweep starts again from the
        first slot (what it lacks is owed); else it looks again in FAILED_BACKOFF_S (nothing else runs
        for the tier while it is full: one statvfs a second at most)."""
        length = self._full[k]
        room = self.index.fits(k, length) and not _fs_short(self.tiers[k], length)
        with self._lock:
            if not room:
                self._next[k] = self.clock() + FAILED_BACKOFF_S
                return False
            self._full[k] = 0
            self._sweep[k] = 0
        return True

    def _read_source(self, key: str, info) -> "_Source | bool":
        """The page file read whole (O_DIRECT) from a holder with no read in flight, its header and
        every block checked against the index. False when no holder could be read now (reads in
        flight, failed tiers), True when the holders were read and none had a valid copy."""
        tried = False
        for src in tiers_in(info.tiers):
            tier = self.tiers[src]
            if not tier.healthy or self.priority.reading(src):
                continue
            tried = True
            buf = self.pool.get(file_size(info.length))
            try:
                created = self._read_file(tier, key, info, buf)
            except GivenUp:  # (the tier hangs: the read still out owns the buffer, and returns it when it ends)
                tier.fail(errno.ETIMEDOUT, f"catch-up read of {key}")
                continue
            except (OSError, HeaderError) as exc:
                created = None
                log.debug("kvstream: catch-up of %s: tier %d's copy is unusable (%s)", key, src, exc)
            self.stats.add(src, "replication_read_bytes", file_size(info.length))
            if created is not None:
                return _Source(buf, info, created)
            self.pool.put(buf)
        return tried

    def _read_file(self, tier: Tier, key: str, info, buf) -> int | None:
        """Read the page file into ``buf`` (opened as a read opens it: a regular file the tier trusts);
        its header's ``created`` when it is the indexed version, intact."""
        n = tier.calls.run(_read_whole, tier, key, buf, file_size(info.length), late=lambda _: self.pool.put(buf))
        if n < 0:
            raise OSError(-n, os.strerror(-n))
        if n < HEADER_SIZE + info.length:
            return None
        h = unpack_header(memoryview(buf)[:HEADER_SIZE])
        if h.key != key or h.digest != self.digest or not info.same_content(h.length, h.block, h.crcs):
            return None  # another writer's version: the read path deals with it
        if block_crcs([(buf.address + HEADER_SIZE, info.length)], info.length, info.block) != info.crcs:
            return None  # damaged: the read path removes it when it meets it
        return h.created_ns


def _read_whole(tier: Tier, key: str, buf, nbytes: int) -> int:
    """Bytes read of ``key``'s page file into ``buf`` (opened as a read opens it: a regular file the tier
    trusts), or -errno; never raises (on a tier that may hang it runs on the tier's thread, bounded.py,
    and a read given up on hands ``buf`` back when it ends)."""
    try:
        fd = tier.open_here(key)
        try:
            return os.preadv(fd, [memoryview(buf)[:nbytes]], 0)
        finally:
            close_fd(fd)  # (only read through: a close error loses nothing)
    except OSError as exc:
        return -(exc.errno or errno.EIO)


def _fs_short(tier: Tier, length: int) -> bool:
    """The tier's file system lacks room for a copy of ``length`` payload bytes and as much again after it,
    or for two more files (a copy takes an inode, maybe its shard directory one more; a file system that
    counts none answers f_files 0): a catch-up copy never takes its last free space (a put would then evict
    the tier's pages to make room for it). False where it cannot be told: a refusal then marks the tier
    full (Replicator._finished); nor where the file system does not say its size (f_blocks 0: some FUSE and
    cloud-storage mounts, whose f_bavail is 0 too: every copy owed there was dropped as never fitting)."""
    room = tier.room()
    return room is not None and room.size > 0 and (room.free < 2 * file_size(length)
                                                   or room.inodes is not None and room.inodes < 2)


def _larger_than(tier: Tier, nbytes: int) -> bool:
    """Is ``nbytes`` more than the tier's whole file system (a copy that can never go there)?"""
    room = tier.room()
    return room is not None and room.size > 0 and nbytes > room.size  # (0: it does not say, Tier._room)


class _Source:
    """A page's bytes in memory, a file image (payload at HEADER_SIZE), the source of its copies."""

    __slots__ = ("buf", "info", "created")

    def __init__(self, buf, info, created: int):
        self.buf, self.info, self.created = buf, info, created
