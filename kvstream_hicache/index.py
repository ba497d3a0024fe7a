"""The in-memory index: which tiers hold which page, per-tier LRU and byte accounting. Pure (no I/O).

Lifecycle of a page on a tier (as SGLang's LRU file evictor)::

    reserve(tier, nbytes) -> victims to delete      (capacity made before the write starts)
        commit(key, tier, ...)  |  abort(tier, nbytes)
    add_scanned(key, tier, ...)                     (found by the background scan: oldest end)
    touch(key)                                      (a hit or a repeated put: most recent)
    touch_many(keys)                                (a get's or put's keys, the head last: a prefix's
                                                     tail is evicted before its head)
    pin(keys) ... unpin(infos)                      (a read in progress: never a victim)
    remove(key, tier)                               (damaged, vanished, or tier reconciled)

Bytes are counted as the caller passes them: the engine counts a page's payload, so a capacity holds
what callers stored (LMCache's adapters count the same), not the 4 KiB header and padding of its file.

The engine's read, write, existence and scan threads call at once. Every method that changes the
index, and ``get``/``keys``, takes the index lock, for a bounded step (a sub-table's resize, a chunk
of a sort); the existence queries (``holders``, ``contains``, ``prefix_len``, ``pages_on``, ``len``)
do not, so SGLang's prefetch thread never waits behind an eviction or the scan: the key lookups run
in C (``_uring.KeyTable``) holding the GIL, each key's answer from one moment of the table.
Methods ending ``_under_index`` run with the lock held.
Victims are removed from the index *before* the caller deletes their files, so a reader either
pinned a page before it was chosen (it is then not chosen) or never finds it.

Packed, not one object per page (a tier of millions of pages, docs/design.md "The index"): a page is
a *slot*, a row across flat ``array`` columns (length, block, bytes counted, write time, tiers, pins,
where its CRCs start in one shared CRC array, per tier its LRU links); a 64-hex key (SGLang's and
LMCache's) is kept as its 32 bytes; keys map to slots through open-addressing sub-tables of slot
numbers (``_uring.KeyTable``, in C: a lookup costs about what a dict's does), so growing the table
re-hashes one small sub-table at a time. About 100 bytes a page at one tier, 4 KiB pages
(docs/benchmarks.md "Scale"), and in a process that writes a fixed 4 MiB filter of what it wrote
(:meth:`Index.wrote`). :class:`PageInfo` is a snapshot made on demand.

Per tier a page is on one of three LRU lists, evicted in this order: ``OLD`` (pages from before the
restart, sorted by write time once the scan is done, :meth:`settle`), ``SCANNED`` (found by the scan,
in the order it found them: until it is done, eviction works from what is known), ``HOT`` (written,
read or discovered since start, least recent first); or on ``THEIRS``: a copy found on disk whose file
was written after this index began (``started_ns``) and not by this process (:meth:`Index.wrote`'s filter
of the (key, tier, header's created) copies it wrote), so by another process sharing the namespace (an
MLA writer rank, a second server on a shared tier). Such a copy is read as any other, but it is not in the
tier's used bytes and never a victim of this process's room: a capacity bounds the bytes a process put
on the tier (its writes, its catch-up copies, and the tier as it found it at start), each process its
own. Counted, a reader that never writes there stayed over its capacity for good, its catch-up "full";
trimmed to it, its index's stale view (pages the writer evicted since) removed live pages of the
writer's while the directory was within its capacity (docs/data/learncap-49).
"""
from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from ._uring import KeyTable, unhex
from .locks import ranked_lock
from .trust import CLOCK_SKEW_NS, created_ns, wall_ns, written_ns

OLD, SCANNED, HOT, THEIRS = 0, 1, 2, 3
_LISTS = (OLD, SCANNED, HOT)  # eviction order (THEIRS: never a victim)
_ALL = (*_LISTS, THEIRS)
_NONE = 255  # not on a list of this tier
_NIL = -1  # end of a list
_SUB_BITS = 10  # 1024 sub-tables: a resize re-hashes ~1/1024 of the keys
_KEY_BYTES = 32
_DROP_BUCKETS = 4095  # mask: removals counted in 4096 buckets of keys (see mark)
RETRY = -2  # add_scanned: a copy of a key of that bucket left the index since the scan read the file
SWEEP_SLOTS = 1 << 16  # slots lacking/count_lacking look at per lock hold: a 256 KiB copy, well under 1 ms
SETTLE_CHUNK = 2_000  # slots moved (settle) or keys made (holding) per lock hold: a few ms
# Pages a step of the scan's trim evicts at most, and a page's reserve beyond its own room, from a tier over its
# capacity (pages the scan indexed, or discovery): each is a file the writer removes while every write waits. One put
# evicted a scan's whole excess, 27,841 files of 4 KiB over GlusterFS: no write for 45 s (trial 'scale'). A put's
# extra is small (its every page pays it, ~2 ms a file there): the trim at the scan's end takes the excess.
EVICT_FILES = 128
EVICT_EXTRA = 8
EVICT_PAUSE_S = 0.005  # between two steps of a trim while writes wait: the writer's turn (re-entered at once: none)
MAX_TIERS = 32  # bits of the tiers column
GONE_EVICTED_MAX = 1 << 16  # keys remembered as evicted while the start-up scan runs (Index.scan_over), at most
MINE_BITS = 1 << 25  # the filter of (key, tier, created) copies this process wrote (Index.wrote): 4 MiB; 1 in
# 200 false "may be mine" at a million pages written, 1 in 5 at five million (such a copy counts, as before)
_MINE_HASHES = 3


class PageInfo:
    """What the index knows of one page, as of the call that returned it. ``tiers`` is a bitmask
    (bit k = tier k holds a copy); ``slot`` and ``epoch`` let :meth:`Index.unpin` find the row."""

    __slots__ = ("length", "block", "crcs", "nbytes", "tiers", "pins", "slot", "epoch")

    def __init__(self, length: int, block: int, crcs: tuple[int, ...], nbytes: int, tiers: int, pins: int,
                 slot: int, epoch: int):
        self.length = length
        self.block = block
        self.crcs = crcs
        self.nbytes = nbytes
        self.tiers = tiers
        self.pins = pins
        self.slot = slot
        self.epoch = epoch

    def same_content(self, length: int, block: int, crcs: Sequence[int]) -> bool:
        return self.length == length and self.block == block and tuple(self.crcs) == tuple(crcs)

    def __repr__(self) -> str:
        return f"PageInfo(length={self.length}, block={self.block}, tiers={self.tiers:#b}, pins={self.pins})"


class Index:
    """key -> slot, packed per-slot columns, per tier three LRU lists and byte counts.

    :param capacities: per tier, the byte limit or None (unlimited).
    """

    def __init__(self, capacities: Sequence[int | None]):
        # Called, under the index lock, with a key no tier holds any more (evicted, removed, deleted), or
        # whose last copy of this process's left while another process's stay (holds_own: False);
        # it must not block nor call the index (the LMCache adapter queues the key for its accounting).
        self.on_gone: Callable[[str], None] | None = None
        # Called, under the index lock, with a key held only as another process's copies (THEIRS) that gains a
        # copy of this process's (catch-up, promotion, a put): LMCache's usage counts it from then, as on_gone.
        self.on_own: Callable[[str], None] | None = None
        self.capacities = list(capacities)
        self.n_tiers = len(self.capacities)
        if self.n_tiers > MAX_TIERS:
            raise ValueError(f"at most {MAX_TIERS} tiers")
        self._lock = ranked_lock("index")
        self.used = [0] * self.n_tiers  # committed bytes per tier
        self.reserved = [0] * self.n_tiers  # bytes of writes in progress per tier
        self.evictions = [0] * self.n_tiers
        # Per tier, the most bytes of another process's copies (THEIRS) indexed: its file system's size (Engine).
        # Never evicted here nor read again once their writer evicted them (an MLA reader rank: sglang reads
        # the MIN of the ranks' hits), such entries stayed for the process's life; past it the oldest are
        # forgotten (their files stay: discovery finds a live one again)
        self.theirs_limits: list[int | None] = [None] * self.n_tiers
        self.forgotten = [0] * self.n_tiers
        self.epoch = 0  # clear() counts up: pins and scan results of before it are void
        # a copy found on disk written since, not by this process: another's (THEIRS). The clock of the times
        # this process writes in headers (trust.wall_ns: never back, whatever a clock step did before)
        self.started_ns = wall_ns()
        self._mine: bytearray | None = None  # (key, tier, created) this process wrote, a Bloom filter (wrote):
        # made at the first write (a process that only reads, an MLA reader rank, holds none)
        self._drops = array("q", bytes(8 * (_DROP_BUCKETS + 1)))  # removals per bucket of keys, ever
        # Until the start-up scan has read every tier (scan_over): key -> the tiers that evicted its last indexed
        # copy (its slot freed, the _evicted marks with it). The scan (or discovery) may index another tier's copy
        # of it afterwards, in a new slot: the marks go there (_new_slot_under_index). Before, such a copy, evicted
        # in this run, was owed back by the sweep (a restart under constant eviction: every page tier 0 evicted
        # before tier 1's scan reached it). None once the scan is over (a page evicted from its last copy is gone).
        self._gone_evicted: OrderedDict[str, int] | None = OrderedDict()
        # Per tier: this process has indexed a copy another process of the namespace wrote since it began
        # (THEIRS): it shares the tier with a live writer (others_in). Kept across clear().
        self.peer_seen = [False] * self.n_tiers
        self._reset()

    def _reset(self) -> None:
        self._hash = array("q")
        self._key = bytearray()
        self._odd: dict[int, str] = {}  # slot -> a key that is not 64-hex
        self._length = array("q")
        self._block = array("I")
        self._nbytes = array("q")
        self._created = array("q")  # write time (ns): orders the old pages
        self._used = array("q")  # when this process last used (wrote, read, touched, found) the page: wall ns
        self._tiers = array("I")
        self._pins = array("i")
        self._crc_at = array("q")
        self._ncrc = array("H")
        self._crcs = array("I")  # every page's block CRCs, end to end
        self._crc_free: dict[int, list[int]] = {}  # run size (_run) -> offsets of freed runs
        self._free = array("i")  # slots to reuse
        self._prev = [array("i") for _ in range(self.n_tiers)]
        self._next = [array("i") for _ in range(self.n_tiers)]
        self._on = [bytearray() for _ in range(self.n_tiers)]  # which list, or _NONE
        # 1: this copy was indexed from a read of its file (the scan, discovery), not written here: a
        # removal of the file racing that read takes the copy out again (file_removed)
        self._found = [bytearray() for _ in range(self.n_tiers)]
        # 1: this tier evicted its copy in this run (and holds none since): not what it lacks (lacking,
        # count_lacking), so a sweep never writes it back there (the tier chose to keep hotter pages)
        self._evicted = [bytearray() for _ in range(self.n_tiers)]
        self._head = [[_NIL] * len(_ALL) for _ in range(self.n_tiers)]
        self._tail = [[_NIL] * len(_ALL) for _ in range(self.n_tiers)]
        self._count = [0] * self.n_tiers  # pages per tier
        self._len = [[0] * len(_ALL) for _ in range(self.n_tiers)]  # pages per tier and list
        self._theirs_bytes = [0] * self.n_tiers  # bytes of the copies on THEIRS, per tier
        # The columns above grow in place and are replaced only here: the key table reads them.
        self._table = KeyTable(self._hash, self._key, self._odd, self._tiers, _SUB_BITS)
        # The existence queries are the table's own methods, without the lock: no Python frame on
        # SGLang's prefetch path (one costs about what the lookup does).
        self.holders: Callable[[str], int] = self._table.holders  # the tiers holding a key (bitmask)
        self.contains: Callable[..., bool] = self._table.contains  # (key, mask=-1): some tier in mask holds it
        self.prefix_len: Callable[..., int] = self._table.prefix_len  # (keys, mask=-1): leading run held
        self._live = 0
        self.used = [0] * self.n_tiers
        self.held_bytes = 0  # bytes of the distinct pages held on any tier

    # -- queries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._live

    def get(self, key: str) -> PageInfo | None:
        with self._lock:
            slot = self._table.find(key)
            return self._info_under_index(slot) if slot >= 0 else None

    def slot(self, key: str) -> int:
        """The row of ``key`` (-1: not indexed), without the lock: where a walk of the index by slot
        (:meth:`lacking`) meets it."""
        return self._table.find(key)

    def keys(self, tier: int | None = None) -> list[str]:
        """Every indexed key, or ``tier``'s in eviction order (oldest first; another process's copies last)."""
        with self._lock:
            if tier is None:
                return [self._key_of_under_index(s) for s in range(len(self._tiers)) if self._tiers[s]]
            return [self._key_of_under_index(s) for s in self._order_under_index(tier, _ALL)]

    def theirs(self, tier: int) -> int:
        """Copies on ``tier`` another process wrote since this index began (not counted in ``used``)."""
        return self._len[tier][THEIRS]

    def theirs_fit(self, tier: int, nbytes: int) -> bool:
        """Whether ``nbytes`` more of another process's copies on ``tier`` stay within theirs_limits (nothing
        forgotten for them). A look without the lock, as fits."""
        limit = self.theirs_limits[tier]
        return limit is None or self._theirs_bytes[tier] + nbytes <= limit

    def pages_on(self, tier: int) -> int:
        return self._count[tier]

    def lacking(self, tier: int, start: int, limit: int) -> tuple[list[str], int]:
        """Keys of pages some tier holds and ``tier`` lacks, from slot ``start`` on: at most ``limit``,
        from at most SWEEP_SLOTS slots (one bounded lock hold), and the slot to go on from (-1: the
        end). Background replication walks the index with it (replication.py): no list of every key."""
        return self._walk(tier, start, limit, False)

    def holding(self, tier: int, start: int, limit: int = SETTLE_CHUNK) -> tuple[list[str], int]:
        """Keys of pages ``tier`` holds, as :meth:`lacking` walks those it lacks: the rejoin's walk of a
        tier of millions of pages (engine._forget_lost), in bounded lock holds, where :meth:`keys` makes
        every key under one (0.4 s at 1M pages, every get and put waiting). A key is listed if the tier
        held it when its slot was read; one indexed again meanwhile (in another slot) may be missed, or
        listed twice."""
        return self._walk(tier, start, limit, True)

    def _walk(self, tier: int, start: int, limit: int, holds: bool) -> tuple[list[str], int]:
        with self._lock:
            n = len(self._tiers)
            end = min(n, start + SWEEP_SLOTS)
            held = np.frombuffer(self._tiers[start:end], dtype=np.uint32)  # (a copy: the column may grow)
            on = (held >> tier) & 1 == 1
            lacks = None if holds else (held != 0) & ~on & self._not_evicted_under_index(tier, start, end)
            found = np.flatnonzero(on if holds else lacks)[:limit]
            keys = [self._key_of_under_index(start + i) for i in found.tolist()]
            if len(found) == limit > 0:
                return keys, start + int(found[-1]) + 1
            return keys, end if end < n else -1

    def count_lacking(self, tier: int, start: int = 0) -> int:
        """How many pages some tier holds and ``tier`` lacks, from slot ``start`` on (as :meth:`lacking`
        would list them; SWEEP_SLOTS slots per lock hold)."""
        count = 0
        while True:
            with self._lock:
                n = len(self._tiers)
                if start >= n:
                    return count
                end = min(n, start + SWEEP_SLOTS)
                held = np.frombuffer(self._tiers[start:end], dtype=np.uint32)
                count += int(np.count_nonzero((held != 0) & ((held >> tier) & 1 == 0)
                                              & self._not_evicted_under_index(tier, start, end)))
            start += SWEEP_SLOTS

    def evicted_from(self, key: str, tier: int) -> bool:
        """``tier`` evicted its copy of ``key`` in this run and holds none since (not what it lacks)."""
        with self._lock:
            slot = self._table.find(key)
            return slot >= 0 and bool(self._evicted[tier][slot])

    def owed_again(self, key: str, tier: int) -> None:
        """``key`` is owed to ``tier`` once more (read, or a put's replica there skipped or failed): a copy
        it evicted is what it lacks again, for its sweep too."""
        with self._lock:
            slot = self._table.find(key)
            if slot >= 0:
                self._evicted[tier][slot] = 0

    def scan_over(self) -> None:
        """The start-up scan has read every tier: a page evicted from its last indexed copy is gone from now on
        (no tier's copy is indexed later by the scan), nothing more is remembered of it (_gone_evicted)."""
        with self._lock:
            self._gone_evicted = None

    def _not_evicted_under_index(self, tier: int, start: int, end: int) -> np.ndarray:
        return np.frombuffer(self._evicted[tier][start:end], dtype=np.uint8) == 0

    def old_pages(self, tier: int) -> tuple[int, int]:
        """(pages on ``tier`` whose LRU place is their write time, pages found by the scan and not
        placed yet): the second is what :meth:`settle` still has to sort."""
        with self._lock:
            return self._len[tier][OLD], self._len[tier][SCANNED]

    # -- reads ----------------------------------------------------------------------------------
    def pin(self, keys: Sequence[str]) -> list[PageInfo | None]:
        """Look up and pin every key (pins nest); None for keys not held anywhere."""
        out: list[PageInfo | None] = []
        with self._lock:
            for key in keys:
                slot = self._table.find(key)
                if slot >= 0:
                    self._pins[slot] += 1
                    out.append(self._info_under_index(slot))
                else:
                    out.append(None)
        return out

    def unpin(self, infos: Iterable[PageInfo | None]) -> None:
        with self._lock:
            for info in infos:
                if info is None or info.epoch != self.epoch:
                    continue  # cleared since: the row is gone
                slot = info.slot
                self._pins[slot] -= 1
                if not self._pins[slot] and not self._tiers[slot]:
                    self._free_slot_under_index(slot)  # removed while pinned: the row goes now

    def wrote(self, key: str, tier: int, writer_ns: int) -> None:
        """This process starts writing ``key``'s page, its file stamped ``writer_ns`` (PageHeader.writer_ns: a
        catch-up copy's own stamp, else the page's created), to ``tier`` (the writer, before its file can be
        renamed into place): a copy of it found there later with that stamp may be this process's own, not
        another's (THEIRS). Its index entry can be lost while the file stays (a rename that
        answered only after write_timeout on a network tier: the tier failed, the copy never indexed); found
        again, it was taken for another process's, never counted nor evicted while the engine ran. The stamp
        is in the filter's key: a page another process wrote under that key since (this process's copy evicted
        or deleted meanwhile: two servers of one model share prefixes) carries its own, and stays theirs
        (review mine: on (key, tier) alone it was counted, and this process's eviction took it, live)."""
        with self._lock:
            self._mark_mine_under_index(key, tier, writer_ns)

    def committed_file(self, key: str, tier: int, identity: tuple[int, ...]) -> None:
        """This process committed ``key``'s file on ``tier``, whose identity as sealed after its last write is
        ``identity`` (a local tier's: trust.sealed_identity, Tier.seal): its eviction knows it by that alone
        (mine_file), with no header read, a disk read for a file written O_DIRECT (a fifth more CPU per page
        put at full eviction churn on this machine's disk). Another process's file under the name since has
        another inode, or the same one reused under another generation (or mtime, where none is kept)."""
        with self._lock:
            self._mark_mine_under_index(key, tier, identity)

    def mine_file(self, key: str, tier: int, identity: tuple[int, ...] | None, changed_ns: int) -> bool:
        """The file under ``key``'s name on a local ``tier`` (``changed_ns``: the later of its mtime and ctime,
        this host's clock) is this process's by its stat alone: written and put under the name before this
        index began (found at its start: counted) by more than the clock's honest skew (a file system keeping
        whole seconds stamps a page another process wrote in the second this one began before it, review
        stat; a clock stepped back stamps one written since before it), or its ``identity``
        (trust.sealed_identity) is one this process committed (committed_file). The ctime, which no writer
        sets: a file put under the name since with its times kept (rsync -a, cp -p: another node's page, a
        later format's) has an old mtime, and was taken for one found at the start (review upgrade).
        False: its header tells (mine). (Lock-free, as mine.)"""
        return changed_ns < self.started_ns - CLOCK_SKEW_NS or (
            identity is not None and self._maybe_mine(key, tier, identity))

    def _mark_mine_under_index(self, key: str, tier: int, stamp: int | tuple[int, ...]) -> None:
        """The copy (key, tier, write stamp or sealed identity) is this process's (the filter: wrote,
        committed_file, _found_mine_under_index).
        Under the index lock: a byte's bits set by two threads at once (read, or, store back) could lose one."""
        mine = self._mine
        if mine is None:
            mine = self._mine = bytearray(MINE_BITS // 8)
        for bit in _mine_bits(key, tier, stamp):
            mine[bit >> 3] |= 1 << (bit & 7)

    def _maybe_mine(self, key: str, tier: int, stamp: int | tuple[int, ...]) -> bool:
        """Whether the filter says (key, tier, write stamp or identity) may be this process's copy (no false no).
        Lock-free, with or without the index lock: a reader sees a bit set or not yet, and bits are never cleared."""
        mine = self._mine
        return mine is not None and all(mine[b >> 3] >> (b & 7) & 1 for b in _mine_bits(key, tier, stamp))

    def mine(self, key: str, tier: int, writer_ns: int, mtime_ns: int) -> bool:
        """A copy on disk, its header's write stamp ``writer_ns`` (PageHeader.writer_ns), its file's mtime
        ``mtime_ns``, is this process's to
        count and to evict (not THEIRS): written before this index began (an earlier run's), or by this process.
        An eviction asks it of the file under the victim's name (Tier.evict_page): another process may have
        replaced this one's copy since. A copy the index counted when found stays its to evict
        (_found_mine_under_index). (Lock-free: started_ns is fixed, the filter only gains bits.)"""
        return not self._theirs(key, tier, (writer_ns, mtime_ns))

    def judges(self, key: str, tier: int) -> tuple[Callable[..., bool], Callable[..., bool]]:
        """Tier.evict_page's judges of whether the file under ``key``'s name on ``tier`` is this process's copy
        (mine_file, mine), bound to the key: one may run after its caller moved on (Tier.owe_delete)."""
        return partial(self.mine_file, key, tier), partial(self.mine, key, tier)

    def _found_mine_under_index(self, key: str, tier: int, stamp: tuple[int, int]) -> None:
        """A copy found on disk was counted as this process's (not THEIRS), its write stamp and its file's
        mtime ``stamp`` as found: one claiming a time at or after this index began (beyond the skew,
        so no time then) goes in the filter of this process's copies: once the clock reaches the stamp, mine()
        would take it for another's, and its eviction would leave the file, counted nowhere (review evict)."""
        if max(stamp) >= self.started_ns:
            self._mark_mine_under_index(key, tier, stamp[0])

    def _theirs(self, key: str, tier: int, stamp: tuple[int, int], since: bool = False) -> bool:
        """A copy found on disk, its write stamp (PageHeader.writer_ns) and its file's mtime ``stamp``, is
        another process's (THEIRS): written since this index began (trust.written_ns), or found ``since``
        the start-up scan listed every tier (it was not there then, whatever its stamps say: another node's
        clock may run behind this one's, within the honest skew), and not by this process (as far as wrote's
        filter knows). Lock-free, as _maybe_mine."""
        return (since or written_ns(*stamp) >= self.started_ns) and not self._maybe_mine(key, tier, stamp[0])

    def touch(self, key: str) -> bool:
        """Make ``key`` the most recent on every tier holding it (another process's copy stays theirs);
        False if not held."""
        with self._lock:
            return self._touch_under_index(key)

    def touch_many(self, keys: Sequence[str], chunk: int = SETTLE_CHUNK) -> None:
        """:meth:`touch` each of ``keys`` held, in order (the last ends the most recent), ``chunk`` keys a
        lock hold."""
        for start in range(0, len(keys), chunk):
            with self._lock:
                for key in keys[start:start + chunk]:
                    self._touch_under_index(key)

    def _touch_under_index(self, key: str) -> bool:
        slot = self._table.find(key)
        if slot < 0:
            return False
        for tier in tiers_in(self._tiers[slot]):
            where = THEIRS if self._on[tier][slot] == THEIRS else HOT
            self._unlink_under_index(tier, slot)
            self._append_under_index(tier, where, slot)
        return True

    # -- writes ---------------------------------------------------------------------------------
    def reserve(self, tier: int, nbytes: int, evict: bool = True) -> list[str] | None:
        """Make room for ``nbytes`` on ``tier`` within its capacity (by evicting only if ``evict``).

        :returns: keys evicted from the index for this (delete their files on ``tier``), or None
            when the room cannot be made (too many pinned pages, a page larger than the tier, or no
            room without eviction); nothing is evicted then. A tier already over its capacity (the scan's
            or discovery's pages) evicts the page's room and at most EVICT_EXTRA pages more.
        """
        with self._lock:
            excess = self._excess(tier, nbytes)
            if excess is None:
                self.reserved[tier] += nbytes
                return []
            if excess > 0 and not evict:
                return None
            victims = self._victims_under_index(tier, min(excess, nbytes)) if excess > 0 else []
            if victims is None:
                return None
            if excess > nbytes:  # over before this page: its room now, the rest EVICT_EXTRA a page (and the trim)
                victims = self._victims_under_index(tier, excess, partial=True, files=len(victims) + EVICT_EXTRA)
            self.reserved[tier] += nbytes
            return self._evict_under_index(tier, victims)

    def evict(self, tier: int, nbytes: int) -> list[str]:
        """Evict least-recent unpinned pages of ``tier`` totalling >= ``nbytes`` (or as many as
        there are), regardless of capacity: the file system said ENOSPC."""
        with self._lock:
            return self._evict_under_index(tier, self._victims_under_index(tier, nbytes, partial=True) or [])

    def evict_excess(self, tier: int, limit: int, files: int | None = None) -> list[str]:
        """Evict least-recent unpinned pages of ``tier`` until what it holds and has reserved fits its
        capacity, at most about ``limit`` bytes of them and at most ``files`` pages (a trim: the scan found
        pages beyond a capacity lowered since the last run; each page evicted is a file removed while the
        caller holds the writer). The excess is measured under the lock, at this call: writes that
        made room meanwhile are not evicted for twice."""
        with self._lock:
            excess = self._excess(tier, 0)
            if excess is None or excess <= 0:
                return []
            return self._evict_under_index(tier, self._victims_under_index(tier, min(excess, limit), partial=True,
                                                                           files=files) or [])

    def next_victims(self, tier: int, nbytes: int, most: int, full: bool = False) -> list[tuple[str, int]]:
        """The first ``most`` pages that :meth:`reserve` of ``nbytes`` would evict from ``tier`` now ([]: they fit),
        or with ``full`` :meth:`evict` (the file system is full: whatever the capacity), each with the time (wall
        clock, ns) this process last used it: a file used later (its access time, another process's mark:
        Tier.mark_used) was used by another process of the namespace since (spare)."""
        with self._lock:
            excess = nbytes if full else self._excess(tier, nbytes)
            if excess is None or excess <= 0:
                return []
            victims = self._victims_under_index(tier, excess, partial=True, files=most) or []  # (most only: a tier far
            # over its capacity, the scan's excess, has thousands of victims, each write would list them all)
            return [(self._key_of_under_index(slot), self._used[slot])
                    for slot in victims]

    def spare(self, key: str, tier: int) -> bool:
        """Another process of the namespace used ``tier``'s copy of ``key`` since this one last did (next_victims):
        it becomes the most recent, as a use here would make it. A process evicts by its own uses (its LRU);
        without this, the writer of a prefix's head evicted it while another process read it and wrote its
        tails after it (DP ranks, servers of one model sharing a tier), and those tails then served nothing.
        False: not this process's copy there (any more)."""
        with self._lock:
            slot = self._table.find(key)
            if slot < 0 or self._on[tier][slot] in (THEIRS, _NONE):
                return False
            self._unlink_under_index(tier, slot)
            self._append_under_index(tier, HOT, slot)
            return True

    def others_in(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """The (key, tier) of ``keys``' copies that may be another live process's, for Tier.mark_used: THEIRS, or,
        on a tier where this process has seen another's copy (peer_seen), found on disk (the scan, discovery),
        not written here: a page of an earlier run that every process started since found, and counts as its
        own (review: marking THEIRS alone, the DP ranks or servers started on a tier holding pages never marked
        those, and each evicted the heads the others used). A process alone on its tier (a server restarted
        over its pages) marks nothing: a metadata write a page and second for no one."""
        out = []
        with self._lock:
            for key in keys:
                slot = self._table.find(key)
                if slot >= 0:
                    out += [(key, tier) for tier in tiers_in(self._tiers[slot]) if self._on[tier][slot] == THEIRS
                            or self._found[tier][slot] and self.peer_seen[tier]]
        return out

    def marked(self, key: str, at_ns: int) -> None:
        """This process marked ``key``'s file used at ``at_ns`` (Tier.mark_used: up to 1 ms ahead): a use of its
        own, so that its own eviction never takes its own mark for another process's (next_victims)."""
        with self._lock:
            slot = self._table.find(key)
            if slot >= 0 and self._used[slot] < at_ns:
                self._used[slot] = at_ns

    def abort(self, tier: int, nbytes: int) -> None:
        with self._lock:
            self.reserved[tier] -= nbytes

    def commit(self, key: str, tier: int, length: int, block: int, crcs: Sequence[int],
               nbytes: int, *, reserved: bool = True, oldest: bool = False, mark: int | None = None,
               epoch: int | None = None, stamp: tuple[int, int] = (0, 0), since: bool = False) -> list[int] | None:
        """Record that ``tier`` holds ``key`` (most recent, or with ``oldest`` the least recent: a
        catch-up copy, replication.py). With ``reserved`` the bytes move from the reservation to the
        used count. ``mark`` (:meth:`mark`, read before the file was read): the copy was found on disk
        (discovery, check), not written here, its write stamp (PageHeader.writer_ns) and its file's mtime
        ``stamp`` (written since this index began, another process's: THEIRS, unless this process wrote that
        stamp there: :meth:`wrote`; trust.written_ns), unless ``tier``'s entry is that copy already (it stays as it is);
        None is returned, and nothing indexed, when a copy of a key
        like it left the index since (maybe this one, its file being deleted: read it again), or when the
        index was cleared since ``epoch`` (read with ``mark``: the file may be one the clear is removing).
        ``since``: the copy was found after this process's start-up scan listed every tier (_theirs).

        :returns: tiers whose copy the index forgot because it describes other content (one key
            holds one content in the index); normally empty. Their files stay: another writer's
            version of the page is valid, and is found again when no indexed copy is left.
        """
        with self._lock:
            if mark is not None and self._drops[hash(key) & _DROP_BUCKETS] != mark or \
                    epoch is not None and epoch != self.epoch:
                return None
            if reserved:
                self.reserved[tier] -= nbytes
            slot = self._table.find(key)
            displaced: list[int] = []
            if slot >= 0 and not self._same_under_index(slot, length, block, crcs):
                held = self._tiers[slot]
                displaced = [t for t in tiers_in(held) if t != tier]
                for t in tiers_in(held):  # this tier's own entry too: it described the other content
                    self._drop_under_index(slot, t)
                slot = -1
            if slot < 0:
                slot = self._new_slot_under_index(key, length, block, crcs, nbytes, time.time_ns(), mark is not None)
            elif mark is not None and self._tiers[slot] >> tier & 1:
                # A copy found on disk that this tier's entry already describes: the index knows better (as
                # add_scanned). A lookup that read the file of this process's put before the put indexed it
                # moved it to THEIRS: its own page, never counted nor evicted by it (nor by anyone)
                return displaced
            theirs = mark is not None and self._theirs(key, tier, stamp, since)
            if mark is not None and not theirs:
                self._found_mine_under_index(key, tier, stamp)
            self._hold_under_index(slot, tier, THEIRS if theirs else OLD if oldest else HOT, first=oldest)
            self._found[tier][slot] = mark is not None
            return displaced

    def mark(self, key: str) -> int:
        """Read before the scan reads ``key``'s file, handed to :meth:`add_scanned`: it counts the
        copies of keys like it that left the index (evicted, removed as damaged: their files deleted)."""
        return self._drops[hash(key) & _DROP_BUCKETS]

    def add_scanned(self, key: str, tier: int, length: int, block: int, crcs: Sequence[int], nbytes: int,
                    created: int, epoch: int, mark: int, versions: bool = True,
                    stamp: tuple[int, int] | None = None, since: bool = False) -> int:
        """The background scan found a valid page file from before the restart: index it at the
        oldest end of ``tier`` unless the index knows better (that copy already, or a newer version
        of the key: one written, read or discovered since start, or a newer file the scan found
        first; an older one it found first is forgotten, its files stay), or the index was cleared
        since the scan began (``epoch``). Returns the slot indexed (for
        :meth:`settle`), -1, or RETRY: a copy of a key like it left the index since :meth:`mark`,
        maybe this one, its file deleted after the scan read it (read the file again). ``versions=False``:
        another version than the indexed one is never indexed, whatever its write time (catch-up's look,
        replication.py _learn: a file of after this start, next to the version this process uses). The page's
        version is its header's ``created`` (trust.created_ns: a claim beyond the clock's skew is none).
        ``stamp``: the file's write stamp (PageHeader.writer_ns) and its mtime, as found (a claim included:
        _found_mine_under_index; default: ``created`` for both): a file written since this index began
        (trust.written_ns) is another process's (THEIRS: not counted, never a victim) unless this process
        wrote that stamp there (wrote); so is one found ``since`` the scan listed every tier (catch-up's look:
        _theirs)."""
        with self._lock:
            if epoch != self.epoch:
                return -1
            if self._drops[hash(key) & _DROP_BUCKETS] != mark:
                return RETRY
            slot = self._table.find(key)
            if slot >= 0 and self._tiers[slot] >> tier & 1:
                return -1
            stamp = stamp or (created, created)  # (the header's value as found: the filter's key is that)
            created = created_ns(created)  # (the version: a claim beyond the skew is none)
            if slot >= 0 and not self._same_under_index(slot, length, block, crcs):
                if not versions or self._created[slot] >= created:  # (versions=False: never another)
                    return -1  # a newer version (one used since start is newer)
                for t in tiers_in(self._tiers[slot]):  # an older version the scan found: the newest wins
                    self._drop_under_index(slot, t)
                slot = -1
            if slot < 0:
                slot = self._new_slot_under_index(key, length, block, crcs, nbytes, created, True)
            theirs = self._theirs(key, tier, stamp, since)
            if not theirs:
                self._found_mine_under_index(key, tier, stamp)
            self._hold_under_index(slot, tier, THEIRS if theirs else SCANNED)
            self._found[tier][slot] = 1
            return slot

    def is_theirs(self, key: str, tier: int) -> bool:
        """Whether ``tier``'s indexed copy of ``key`` is another process's (THEIRS: not counted, never a victim)."""
        with self._lock:
            slot = self._table.find(key)
            return slot >= 0 and bool(self._tiers[slot] >> tier & 1) and self._on[tier][slot] == THEIRS

    def holds_own(self, key: str) -> bool:
        """Whether some tier's indexed copy of ``key`` is this process's (counted: not THEIRS)."""
        with self._lock:
            slot = self._table.find(key)
            return slot >= 0 and self._own_under_index(slot)

    def _own_under_index(self, slot: int) -> bool:
        """Whether some tier's copy of ``slot`` is this process's (not THEIRS)."""
        return any(self._on[tier][slot] != THEIRS for tier in tiers_in(self._tiers[slot]))

    def remove(self, key: str, tier: int) -> bool:
        """Forget ``tier``'s copy of ``key``; True when there was one."""
        with self._lock:
            slot = self._table.find(key)
            return slot >= 0 and self._drop_under_index(slot, tier)

    def remove_mine(self, key: str, tier: int) -> bool:
        """Forget ``tier``'s copy of ``key``, whoever's; True when there was one and it was this process's (not
        THEIRS): its file is this process's to remove (Engine.evict). Whose, told in the same lock hold."""
        with self._lock:
            slot = self._table.find(key)
            if slot < 0:
                return False
            mine = self._on[tier][slot] != THEIRS  # (_NONE where the tier holds none: dropped nothing, False)
            return self._drop_under_index(slot, tier) and mine

    def file_removed(self, key: str, tier: int) -> None:
        """``key``'s file on ``tier`` was removed after its copy left the index (delete, eviction,
        damage). A scan or a discovery that read the file between the two must not index it: a copy it
        indexed meanwhile leaves again (wherever it moved since: read, settled), and one it read before
        and indexes after is read again (the drop count moves, :meth:`mark`), and is gone."""
        with self._lock:
            self._drops[hash(key) & _DROP_BUCKETS] += 1
            slot = self._table.find(key)
            if slot >= 0 and self._tiers[slot] >> tier & 1 and self._found[tier][slot]:
                self._drop_under_index(slot, tier)  # (scanned or discovered, moved since or not)

    def clear(self) -> None:
        with self._lock:
            self.epoch += 1
            if self._gone_evicted is not None:
                self._gone_evicted.clear()
            if self.on_gone is not None:  # every key leaves the index (LMCache's accounting: on_gone)
                for slot in range(len(self._tiers)):
                    if self._tiers[slot]:
                        self.on_gone(self._key_of_under_index(slot))
            self._reset()

    def settle(self, tier: int, slots: array, epoch: int, chunk: int = SETTLE_CHUNK) -> int:
        """Sort the pages the scan found on ``tier`` (``slots``, as :meth:`add_scanned` returned
        them) by write time, oldest first, ahead of every page used since start: the LRU order of
        before the restart. Only reading the write times and moving the pages take the lock, a chunk
        at a time; the sort runs outside it. Returns the pages placed."""
        created = np.empty(len(slots), dtype=np.int64)
        for start in range(0, len(slots), chunk):
            with self._lock:
                if epoch != self.epoch:
                    return 0
                created[start:start + chunk] = [self._created[s] for s in slots[start:start + chunk]]
        order = np.argsort(created, kind="stable")
        placed = 0
        for start in range(0, len(order), chunk):
            with self._lock:
                if epoch != self.epoch:
                    return placed
                on = self._on[tier]
                for i in order[start:start + chunk].tolist():
                    slot = slots[i]
                    if on[slot] == SCANNED:  # else touched, evicted or removed since: it has its place
                        self._unlink_under_index(tier, slot)
                        self._append_under_index(tier, OLD, slot)
                        placed += 1
        return placed

    # -- internals: rows ------------------------------------------------------------------------
    def _info_under_index(self, slot: int) -> PageInfo:
        return PageInfo(self._length[slot], self._block[slot], self._crcs_of_under_index(slot), self._nbytes[slot],
                        self._tiers[slot], self._pins[slot], slot, self.epoch)

    def _crcs_of_under_index(self, slot: int) -> tuple[int, ...]:
        at = self._crc_at[slot]
        return tuple(self._crcs[at:at + self._ncrc[slot]])

    def _same_under_index(self, slot: int, length: int, block: int, crcs: Sequence[int]) -> bool:
        return self._length[slot] == length and self._block[slot] == block and self._crcs_of_under_index(slot) == tuple(crcs)

    def _key_of_under_index(self, slot: int) -> str:
        odd = self._odd.get(slot)
        return odd if odd is not None else self._key[slot * _KEY_BYTES:(slot + 1) * _KEY_BYTES].hex()

    def _new_slot_under_index(self, key: str, length: int, block: int, crcs: Sequence[int], nbytes: int,
                  created_ns: int, found: bool = False) -> int:
        """A row for ``key``; ``found``: from a copy found on disk (the scan, discovery), which carries the
        marks of the tiers that evicted the key's last indexed copy during the scan (_gone_evicted); a put's
        row none."""
        gone = self._gone_evicted.pop(key, 0) if self._gone_evicted else 0
        raw = unhex(key)
        n = len(crcs)
        runs = self._crc_free.get(_run(n))
        if runs:
            at = runs.pop()
            self._crcs[at:at + n] = array("I", crcs)
        else:
            at = len(self._crcs)
            self._crcs.extend(crcs)
            self._crcs.extend(bytes(_run(n) - n))  # (the run's spare room: zeros)
        if self._free:
            slot = self._free.pop()
            self._hash[slot], self._length[slot], self._block[slot] = hash(key), length, block
            self._nbytes[slot], self._created[slot], self._crc_at[slot] = nbytes, created_ns, at
            self._used[slot] = 0
            self._ncrc[slot] = n
            self._key[slot * _KEY_BYTES:(slot + 1) * _KEY_BYTES] = raw or bytes(_KEY_BYTES)
            for evicted in self._evicted:  # (a new page: no tier evicted it)
                evicted[slot] = 0
        else:
            slot = len(self._tiers)
            self._hash.append(hash(key))
            self._length.append(length)
            self._block.append(block)
            self._nbytes.append(nbytes)
            self._created.append(created_ns)
            self._used.append(0)
            self._crc_at.append(at)
            self._ncrc.append(n)
            self._tiers.append(0)
            self._pins.append(0)
            self._key += raw or bytes(_KEY_BYTES)
            for tier in range(self.n_tiers):
                self._prev[tier].append(_NIL)
                self._next[tier].append(_NIL)
                self._on[tier].append(_NONE)
                self._found[tier].append(0)
                self._evicted[tier].append(0)
        for tier in tiers_in(gone if found else 0):
            self._evicted[tier][slot] = 1  # (cleared when the tier holds it: the copy found may be its own)
        if raw is None:
            self._odd[slot] = key
        self._table.insert(slot)
        self._live += 1
        self.held_bytes += nbytes
        return slot

    def _hold_under_index(self, slot: int, tier: int, where: int, first: bool = False) -> None:
        """``tier`` holds the page of ``slot``: counted once (not on THEIRS), on list ``where`` (at its
        end, or with ``first`` at its head: the next to go)."""
        gains_own = where != THEIRS and self.on_own is not None and bool(self._tiers[slot]) and \
            not self._own_under_index(slot)
        if self._tiers[slot] >> tier & 1:
            self.used[tier] -= self._counted_under_index(slot, tier)  # re-commit of the same copy: count once
            self._unlink_under_index(tier, slot)
        else:
            self._count[tier] += 1
        self._tiers[slot] |= 1 << tier
        self._evicted[tier][slot] = 0
        self._append_under_index(tier, where, slot, first)
        self.used[tier] += self._counted_under_index(slot, tier)
        if where == THEIRS:
            self._forget_theirs_under_index(tier, slot)
        elif gains_own:  # (the first copy of a new key needs none: its put's pop counts it)
            self.on_own(self._key_of_under_index(slot))

    def _forget_theirs_under_index(self, tier: int, keep: int) -> None:
        """Forget the oldest of another process's copies on ``tier`` (not ``keep``, just indexed) while they
        add up to more than the tier can hold (theirs_limits): some are gone, evicted by their writer."""
        limit = self.theirs_limits[tier]
        while limit is not None and self._theirs_bytes[tier] > limit:
            victim = self._head[tier][THEIRS]
            if victim in (_NIL, keep):
                return
            self._drop_under_index(victim, tier)
            self.forgotten[tier] += 1

    def _counted_under_index(self, slot: int, tier: int) -> int:
        """The bytes ``tier``'s copy of ``slot`` counts in ``used`` (none for another process's)."""
        return 0 if self._on[tier][slot] == THEIRS else self._nbytes[slot]

    def _drop_under_index(self, slot: int, tier: int) -> bool:
        bit = 1 << tier
        if not self._tiers[slot] & bit:
            return False
        own = self._on[tier][slot] != THEIRS
        self._tiers[slot] &= ~bit
        self._found[tier][slot] = 0
        self.used[tier] -= self._counted_under_index(slot, tier)
        self._count[tier] -= 1
        self._unlink_under_index(tier, slot)
        self._drops[self._hash[slot] & _DROP_BUCKETS] += 1
        if not self._tiers[slot]:
            self._table.delete(slot)
            self._live -= 1
            self.held_bytes -= self._nbytes[slot]
            if self.on_gone is not None:
                self.on_gone(self._key_of_under_index(slot))
            if not self._pins[slot]:
                self._free_slot_under_index(slot)  # else unpin frees it: a reader still holds its snapshot
        elif own and self.on_gone is not None and not self._own_under_index(slot):
            # its last copy of this process's: another process's copies left (LMCache's usage counts only a
            # key with a copy of its own; one still counted when tier 0 evicted it kept its room counted)
            self.on_gone(self._key_of_under_index(slot))
        return True

    def _free_slot_under_index(self, slot: int) -> None:
        self._crc_free.setdefault(_run(self._ncrc[slot]), []).append(self._crc_at[slot])
        self._odd.pop(slot, None)
        self._free.append(slot)

    # -- internals: eviction --------------------------------------------------------------------
    def _excess(self, tier: int, nbytes: int) -> int | None:
        """Bytes by which ``tier`` would exceed its capacity, with what it holds, what writes in
        progress reserved and ``nbytes`` more (<= 0: it fits); None when it has no capacity limit.
        Under the lock for a decision (reserve, evict_excess); without it, a look (fits)."""
        cap = self.capacities[tier]
        return None if cap is None else self.used[tier] + self.reserved[tier] + nbytes - cap

    def fits(self, tier: int, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit ``tier``'s capacity now, with no eviction (a catch-up copy never evicts:
        replication.py). A look without the lock, as holders: reserve decides when the copy is written."""
        excess = self._excess(tier, nbytes)
        return excess is None or excess <= 0

    def ever_fits(self, tier: int, nbytes: int) -> bool:
        """Whether ``nbytes`` are within ``tier``'s capacity at all (no limit: True): a page larger never fits
        there, whatever leaves the tier."""
        cap = self.capacities[tier]
        return cap is None or nbytes <= cap

    def _victims_under_index(self, tier: int, nbytes: int, partial: bool = False, files: int | None = None
                             ) -> list[int] | None:
        victims: list[int] = []
        freed = 0
        for slot in self._order_under_index(tier):
            if freed >= nbytes or files is not None and len(victims) >= files:
                break
            if self._pins[slot]:
                continue
            victims.append(slot)
            freed += self._nbytes[slot]
        if freed < nbytes and not partial:
            return None
        return victims

    def _evict_under_index(self, tier: int, victims: list[int]) -> list[str]:
        keys = [self._key_of_under_index(slot) for slot in victims]
        gone = self._gone_evicted
        for slot, key in zip(victims, keys):
            self._drop_under_index(slot, tier)
            self._evicted[tier][slot] = 1  # (reset when the slot is reused or the tier holds it again)
            if gone is not None and not self._tiers[slot]:  # its last indexed copy: the scan may find another
                gone[key] = gone.pop(key, 0) | 1 << tier
                if len(gone) > GONE_EVICTED_MAX:
                    gone.popitem(last=False)
        self.evictions[tier] += len(victims)
        return keys

    # -- internals: LRU lists -------------------------------------------------------------------
    def _order_under_index(self, tier: int, lists: Sequence[int] = _LISTS) -> Iterable[int]:
        """``tier``'s copies in eviction order (with ``_ALL``, another process's after them)."""
        nxt = self._next[tier]
        for where in lists:
            slot = self._head[tier][where]
            while slot != _NIL:
                following = nxt[slot]  # the caller may not unlink it, but read it before yielding
                yield slot
                slot = following

    def _append_under_index(self, tier: int, where: int, slot: int, first: bool = False) -> None:
        """Link ``slot`` at the end of list ``where`` (with ``first``, at its head)."""
        ends, other = (self._head[tier], self._tail[tier]) if first else (self._tail[tier], self._head[tier])
        before, after = (self._next[tier], self._prev[tier]) if first else (self._prev[tier], self._next[tier])
        end = ends[where]
        before[slot] = end
        after[slot] = _NIL
        if end == _NIL:
            other[where] = slot
        else:
            after[end] = slot
        ends[where] = slot
        self._on[tier][slot] = where
        self._len[tier][where] += 1
        self._used[slot] = time.time_ns()  # (Tier.mark_used stamps access times by this clock)
        if where == THEIRS:
            self._theirs_bytes[tier] += self._nbytes[slot]
            self.peer_seen[tier] = True

    def _unlink_under_index(self, tier: int, slot: int) -> None:
        where = self._on[tier][slot]
        if where == _NONE:
            return
        prev, nxt = self._prev[tier], self._next[tier]
        p, n = prev[slot], nxt[slot]
        if p == _NIL:
            self._head[tier][where] = n
        else:
            nxt[p] = n
        if n == _NIL:
            self._tail[tier][where] = p
        else:
            prev[n] = p
        self._on[tier][slot] = _NONE
        self._len[tier][where] -= 1
        if where == THEIRS:
            self._theirs_bytes[tier] -= self._nbytes[slot]


def _run(n: int) -> int:
    """The room a page of ``n`` block CRCs takes in the CRC column: ``n`` rounded up to a power of two,
    so that a run freed by a page of one size is reused by a page of a nearby size (exact sizes left
    the runs of every block count ever seen, LMCache's short last chunks, to pile up); at most twice
    the CRCs, and nothing more for pages of one block, or of a power of two."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _mine_bits(key: str, tier: int, stamp: int | tuple[int, ...]) -> tuple[int, ...]:
    """The filter's bits of (key, tier, the header's write stamp, or the committed file's identity): double
    hashing of one 64-bit hash (per process: a filter is never written to disk)."""
    h = hash((key, tier, stamp)) & 0xFFFF_FFFF_FFFF_FFFF
    step = h >> 32 | 1
    return tuple((h + i * step) & (MINE_BITS - 1) for i in range(_MINE_HASHES))


def tiers_in(mask: int) -> Iterable[int]:
    """The tiers of a bitmask (bit k = tier k), lowest first."""
    tier = 0
    while mask:
        if mask & 1:
            yield tier
        mask >>= 1
        tier += 1
