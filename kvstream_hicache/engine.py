"""The KVStream engine: replicated tiers, one routed pool per read, a rebuilt index. No sglang/torch.

Composition::

    Engine
      tiers    [Tier]         health, paths, commit (tiers.py)
      index    Index          key -> tiers, LRU, capacity, pins (index.py, pure)
      reads    ReadPath       read ring + staging pool + router (reads.py, router.py)
      writes   WritePath      write ring + staging pool + writer thread (writes.py), per-tier queues (writequeue.py),
                              a page on a tier from temp file to commit (jobs.py)
      priority ReadPriority   which tiers a read uses now: writes there wait (priority.py)
      replicas Replicator     what each tier is owed, written later from a copy (replication.py)
      stats    Stats          counters, per-batch bound (stats.py)

Threads: SGLang calls get (prefetch I/O thread), put (backup thread) and contains/prefix_len
(prefetch thread) at once. Reads and writes have separate rings, each behind its own lock; every
write is done by the engine's writer thread (put waits for it, put_deferred does not); the index has
its own lock; existence queries read the index, and look on disk for a key it lacks (discovery).
``close()`` racing a call on another thread: the call either completes or raises EngineClosedError.

Locks: one order, outermost first, in locks.ORDER (a lock is taken only under those before it; the
tests fail a run that breaks it); docs/design.md "Locks" has the table of what each guards and what is
taken under it, the adapters' locks included.

fork(): an engine belongs to the process that opened it. Its io_uring rings are memory shared with
the kernel (a child using them would corrupt the parent's) and its I/O threads do not exist in a
child, so in a forked child an engine is closed without touching its rings (``io.forks()``, the one
fork detector, tells) and any call raises EngineClosedError naming fork: open a new Engine in the
child. The parent is untouched.
"""
from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence

from . import tmpfiles
from .bounded import shielded
from .config import Config, check_capacities, setting_source
from .probe import Look, check_overlap, let_go, probe_tiers
from .errors import ConfigError, EngineClosedError, TierError
from .faults import FaultyRing
from .index import Index
from .integrity import Problem, Reason, ScannedPage, check_tier
from .io import RING_ENTRIES, ThreadRing, forks, memlock_hint, open_ring
from .layout import Namespace, is_digest, is_valid_key, key_of_page_file
from .locks import ranked_lock
from .memory import CallerGate
from .owed import OwedClears
from .priority import ReadPriority
from .reads import ReadPath
from .replication import PROMOTE_SHARE, Replicator
from .router import Policy, parse_policy
from .scan import RETRIES, BackgroundScan
from .segments import Segment
from .staging import BufferPool
from .stats import Stats
from .tiers import Tier
from .trust import age_key, honest_until
from .writequeue import WriteSettings
from .writes import WritePath

log = logging.getLogger("kvstream")

CLOSE_DRAIN_S = 5.0  # close() waits this long for orphan reads before closing the ring, s
CLOSE_HANG_S = 10.0  # with write_timeout=0, close() gives up on a tier whose writes make no progress for this
# long, s (the default write_timeout): else a hung tier held close(), and the process's exit, for ever
MARK_EVERY_S = 1.0  # touch_prefix(mark=True) marks another process's page used at most this often, s
MARKS_KEPT = 1 << 16  # (key, tier) marks remembered for that, at most
EXIT_HANG_S = 2 * CLOSE_HANG_S  # the exit hook and LMCache's close leave a writer without progress this long, s
CLOSED = "kvstream engine is closed"


def _forget_lost(tier: Tier, index: Index, replicas: Replicator, scan) -> None:
    """The rejoin thread (Engine._reconcile; it holds no engine, as the scan's): the pages indexed on
    ``tier`` before its listing began (a page committed there is renamed into place before it is
    indexed, so a page indexed then is listed unless lost) that are not in it leave the index, unless a
    file of theirs is there now (this engine writes no page to a tier that holds it, so only another
    writer's could be); then every page lacking a tier is owed again (at the scan's end if it still
    runs). An error while listing leaves the index alone: pages not listed yet are not lost.

    The index is read a bounded step at a time (``Index.holding``: gets and puts never wait for a walk
    of every page, 0.4 s at 1M): a key taken was held on the tier at that moment, so before the listing
    (its file in place then); one indexed again meanwhile may be missed (not forgotten: found gone when
    it is read). Its keys are one set, each listed file's key taken out of it (no second set of every
    file: ~140 B a page)."""
    replicas.rejoined(tier.k)  # (its catch-up's back-offs were the tier's before it failed)
    unlisted: set[str] = set()  # (here, not in the call that found the tier back: millions of keys)
    start = 0
    while start >= 0:
        keys, start = index.holding(tier.k, start)
        unlisted.update(keys)
    try:
        with os.scandir(tier.layout.pages) as listing:
            for shard in listing:
                if shard.is_dir(follow_symlinks=False):
                    with os.scandir(shard.path) as files:
                        for entry in files:
                            unlisted.discard(key_of_page_file(entry.name))
    except OSError as exc:
        log.warning("kvstream: tier %d rejoined, but listing its pages failed (%s): a page it lost is found "
                    "when it is read", tier.k, os.strerror(exc.errno or errno.EIO))
        return
    lost = [key for key in unlisted
            if not os.path.lexists(tier.layout.page_path(key)) and index.remove(key, tier.k)]
    if lost:
        log.warning("kvstream: tier %d rejoined without %d of its pages; they are forgotten (and written "
                    "there again by background replication)", tier.k, len(lost))
    if scan is not None and scan.done:  # (a tier rejoining during the scan: owed at its end)
        replicas.owe_all()


def _scan_done(index: Index, replicas: Replicator) -> None:
    """The start-up scan has read every tier: the index forgets the keys it remembered as evicted meanwhile
    (Index.scan_over), and catch-up resumes after a restart (Replicator.owe_all: what each tier lacks)."""
    index.scan_over()
    replicas.owe_all()


_OPEN: weakref.WeakSet[Engine] = weakref.WeakSet()  # engines not closed yet (the exit hook closes them)


@atexit.register
def _close_open_engines() -> None:
    """At interpreter exit, before the daemon threads stop: close the engines still open (one a
    traceback keeps alive after Ctrl-C, one never closed), so their queued writes land from memory
    that is still there and their threads end. Later, during finalization, close() waits for nothing.
    An engine whose ``close_at_exit`` is off (the SGLang backend's) is left open for its callers'
    threads, which go on until the interpreter stops them.

    With write_timeout=0 a tier's file-system calls run in place, unbounded: the writer (or the catch-up
    thread) in one on a hung tier held close(), and the process's exit, for ever. There, the close runs
    on a thread of its own and is left once the writer has made no progress for EXIT_HANG_S (its own
    hang check, CLOSE_HANG_S, fails a tier whose writes are held first): said, and the process exits
    without it, the page files being written left temporary files the next start removes."""
    for engine in [e for e in _OPEN if e.close_at_exit]:
        if engine.config.write_timeout > 0:  # (every wait of close() is bounded by it)
            _close_at_exit(engine)
            continue
        closing = threading.Thread(target=_close_at_exit, args=(engine,), name="kvstream-exit-close", daemon=True)
        closing.start()
        start = time.monotonic()
        while closing.is_alive():
            closing.join(1.0)  # (the writer's hang clock: when it last sent or reaped a write, any tier)
            if closing.is_alive() and engine.stalled(start):
                log.warning("kvstream: exit: the engine's writes made no progress for %.0f s (a hung tier, "
                            "write_timeout=0); the process exits without them: pages still queued are not "
                            "stored", EXIT_HANG_S)
                break


def _close_at_exit(engine: Engine) -> None:
    try:
        engine.close()
    except Exception:  # (one engine's error must not leave the others open)
        log.exception("kvstream: closing an engine at exit failed")


def _weak(method: Callable, dead):
    """``method`` as a hook that does not keep its engine alive (returns ``dead`` once the engine is
    gone). The writer thread reaches the tiers and the read path; a bound method there would keep a
    dropped engine reachable for ever: never collected, never closed, its rings, descriptors and
    writer thread leaked, and ``__del__``'s ResourceWarning never given."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        live = ref()
        return dead if live is None else live(*args)

    return hook


class Engine:
    """A multi-tier, replicated page store for one namespace.

    :param config: effective settings (``Config.from_sources``).
    :param namespace: what the pages are (model, layout, dtype, geometry, rank); its digest names
        the page directory on each tier.
    :param policy: read routing; default from ``config.policy_spec``.
    :param ring_factory: ``ring_factory(entries=..., engine=...)`` opens an I/O ring
        (default :func:`kvstream_hicache.io.open_ring`).
    :param fault_plan: wrap both rings in ``FaultyRing(ring, fault_plan)`` (tests, fault drills).
    :param clock: monotonic clock for tier back-off (tests inject one).
    :param announce: log the one-line start-up summary at INFO (else at DEBUG): an adapter that logs
        its own line with the same facts (the SGLang backend, once per server) turns it off.
    :param warn: log the configuration's warnings (two tiers on one file system, a ``KVSTREAM_*`` typo) at
        WARNING, else at DEBUG: the SGLang backend on a server's ranks other than rank 0, which read the same
        configuration (rank 0 says it once for the server).
    :param page_bytes: the payload size of the pages the caller will store, when it knows it (the
        SGLang adapter does): a tier whose capacity cannot hold one such page is refused at start-up.
    :raises ConfigError: a tier directory is unusable, a capacity holds no page, or no I/O ring opens
        (``io_engine``).
    """

    def __init__(self, config: Config, namespace: Namespace, *, policy: Policy | None = None,
                 ring_factory: Callable = open_ring, fault_plan=None, clock: Callable[[], float] = time.monotonic,
                 announce: bool = True, warn: bool = True, page_bytes: int | None = None):
        self._closed = True
        self._closed_why = CLOSED
        self._pid = os.getpid()
        self._forks = forks()
        if config.log_level:
            log.setLevel(config.log_level)
        self.config = config
        self.namespace = namespace
        # (a tier that may hang is probed on its own thread, bounded by write_timeout: one that does not answer
        # starts failed, probed until it answers, and the engine serves from the others: probe.py, tiers.py)
        self.warnings, owners, looks, capacities = probe_tiers(config, level=logging.WARNING if warn else logging.DEBUG)
        self.policy = policy if policy is not None else parse_policy(config.policy_spec)  # Config checked it
        self.discover = config.discover
        self.tiers: list[Tier] = []
        # the tiers' real paths checked against each other (None: not answered yet; _placed)
        self._reals = [look.real for look in looks]
        self._page_bytes = page_bytes  # (a share resolved when a tier answers is checked as above: _reconcile)
        self._placing = ranked_lock("placing")
        try:
            check_capacities(config, capacities, page_bytes)
            self._token = tmpfiles.register()
            source = config.sources.get("tiers", "KVSTREAM_TIERS")
            for k, (t, cap) in enumerate(zip(config.tiers, capacities)):
                late = t.capacity if looks[k].real is None and t.capacity.share is not None else None
                self.tiers.append(Tier(k, t.path, namespace.digest, cap, config.modes, config.fsync,
                                       config.tier_retry, self._token, clock, _weak(self._reconcile, ""), source,
                                       owners[k], config.write_timeout, looks[k], late, _weak(self._placed, "")))
        except BaseException:
            self._let_go(looks)
            raise
        self._owed = OwedClears(self.tiers, namespace.digest)
        self._owed.recall()  # (before the scan and any lookup: a tier that owes a clear serves nothing)
        self.index = Index([t.capacity for t in self.tiers])
        for tier, look in zip(self.tiers, looks):
            if look.real is not None:  # (one that did not answer: its calls thread is held; when it rejoins)
                self._bound_theirs(tier)
        self._stats = Stats(len(self.tiers))
        self._marked: dict[tuple[str, int], float] = {}  # (key, tier) -> when marked used (_mark_used)
        rings = []
        choice = config.io_engine

        def open_one():  # (the paths open another one where theirs failed: inflight.py)
            ring = ring_factory(entries=RING_ENTRIES, engine=choice)
            return FaultyRing(ring, fault_plan) if fault_plan is not None else ring

        try:
            for _ in range(2):
                rings.append(open_one())
                if choice == "auto" and isinstance(getattr(rings[-1], "inner", rings[-1]), ThreadRing):
                    choice = "threads"  # io_uring refused: the write ring follows without a second log line
            if choice == "threads" and config.io_engine == "auto" and not isinstance(
                    getattr(rings[0], "inner", rings[0]), ThreadRing):  # refused only the second time (the
                rings[0].close()  # memlock limit): both paths on one engine, the one reported
                rings[0] = open_one()
        except OSError as exc:
            for ring in rings:
                ring.close()
            self._let_go(looks)
            raise ConfigError(f"{setting_source(config.sources, 'io_engine')} = {config.io_engine!r}: cannot open an "
                              f"I/O ring ({exc}{memlock_hint(exc)}); use 'auto' or 'threads' where io_uring is "
                              "blocked (containers, seccomp)") from None
        half = config.memory // 2  # staging: half for reads in flight, half for writes (config.py)
        share = half // len(self.tiers)  # a tier's window ceiling, reads and writes alike
        self.priority = ReadPriority(len(self.tiers), config.read_priority, clock)
        self._reads = ReadPath(rings[0], self.tiers, self.index, self._stats, BufferPool(half), config.chunk,
                               config.read_timeout, share, namespace.digest, self.priority, _weak(self._recover, 0),
                               _weak(self._read_done, None), reopen=open_one, register_memory=config.register_memory)
        self._writes = WritePath(rings[1], self.tiers, self.index, self._stats, BufferPool(half), config.chunk,
                                 namespace.digest, self.priority, WriteSettings.of(config), reopen=open_one,
                                 staging_limit=half, ceiling=share, thinned=_weak(self._thinned, None))
        self._replicas = Replicator(self.tiers, self.index, self._writes, self.priority, self._stats,
                                    self._writes.pool, namespace.digest, catchup=config.catchup,
                                    catchup_share=config.catchup_share, promote_bytes=config.memory // PROMOTE_SHARE,
                                    copy_bytes=config.memory)
        self.io_engine = type(rings[0].inner if fault_plan is not None else rings[0]).__name__
        # Served from now on: pages of before the restart are found by discovery until the scan has them.
        level = logging.INFO if announce else logging.DEBUG
        self._scan = BackgroundScan(self.tiers, self.index, namespace.digest, config.scan_rate, config.scan_cpu,
                                    self._writes.trim, level,  # the write path's: the scan holds no engine
                                    functools.partial(_scan_done, self.index, self._replicas))  # (holds no engine)
        self._replicas.scanned = self._scan.listed  # (catch-up's look: what it finds after is another's)
        self._closed = False
        # The exit hook closes the engine (its queued writes land; _close_open_engines). Off for a caller
        # whose own threads go on calling it at exit and has nothing queued (SGLang: puts wait for their pages)
        self.close_at_exit = True
        self._bounds = 0  # callers waiting for their writes before they close (bound_writes)
        self.reads_drained = False  # close() is past its reads: no get touches a caller's memory any more
        _OPEN.add(self)
        self._scan.start()
        log.log(level,
                "kvstream: %s; namespace %s; serving, start-up scan in the background; io %s; %s", config.summary(),
                namespace.digest, self.io_engine, self.trust_summary())

    def _let_go(self, looks) -> None:
        """A start that fails: the calls threads of its tiers (started by their first looks, probe.py) end."""
        let_go(looks)
        for tier in self.tiers:
            tier.calls.close()
            tier.reads.close()
        token = getattr(self, "_token", None)
        if token is not None:
            tmpfiles.release(token)

    # -- pages ---------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]]) -> list[bool]:
        """Store pages on every usable tier in parallel.

        :param keys: page keys (``[0-9A-Za-z_-]{1,200}``; invalid keys are refused: False).
        :param pages: per key, the payload as ``(address, nbytes)`` segments of caller memory;
            4096-aligned segments are written zero-copy, others through one staging copy.
        :returns: per key, True when >= 1 tier holds a verified copy (already held: True, no I/O).
            Returns when every byte has been read out of the caller's memory, but for the writes
            of a tier that hung (``write_timeout``): abandoned, they may still read it, into a
            file that is never committed (docs/guarantees.md). An exception that ends the wait
            (Ctrl-C) is raised once nothing reads the caller's memory either: its pages withdrawn.
        :raises ValueError: ``keys`` and ``pages`` differ in length (a caller bug).
        """
        self._check_open()
        mask = self._usable_mask()
        self._discover(keys, mask)
        return self._writes.put(keys, pages, mask)

    def put_deferred(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]],
                     done: Callable[[list[bool]], None], gate: CallerGate | None = None) -> None:
        """Queue pages to store behind reads (the paper's M2, the LMCache path) and return.

        Pages go out on each tier when it has no read in flight; ``done(results)`` runs once every
        page is committed (or failed), ``results`` as :meth:`put` returns them: on the engine's
        writer thread, or before this returns when nothing needed writing, or in the thread of
        :meth:`clear`, or of a put ended by Ctrl-C whose page it waited for, for pages they cancel.
        So it must not block, nor call the engine (it may hold the
        engine's locks). The caller keeps the pages' memory
        unchanged until then. Waits only while the pages not yet written exceed the
        ``write_backlog`` setting (back-pressure). A page is found by ``contains``/``get`` once
        committed on a tier, not before.

        :param gate: the caller's ``CallerGate("source")``, for a caller that may have to take the
            memory back before ``done`` (L2Core.close, when a hung tier holds the writer in a call:
            :meth:`stalled`): once it is shut (``gate.close``), the writer reads that memory no more
            (a read in progress ends first: it holds the gate), and no page of it commits any more
            (``done`` reports them False, when the writer gets to them).
        :raises ValueError: ``keys`` and ``pages`` differ in length (a caller bug).
        """
        self._check_open()
        mask = self._usable_mask()
        self._discover(keys, mask)
        self._writes.put_deferred(keys, pages, mask, done, gate)

    def get(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]],
            policy: Policy | None = None) -> list[bool]:
        """Read pages into caller memory: one pool of blocks, routed over the tiers by ``policy``.

        :param pages: per key, ``(address, nbytes)`` segments whose total equals the stored length.
        :returns: per key, True when every byte arrived verified (False: missing, size mismatch,
            damaged on every tier, or read_timeout passed). No read lands in caller memory after
            return: reads still in flight (a stalled tier) stay engine-owned until reaped.
        """
        self._check_open()
        mask = self._usable_mask()
        self._discover(keys, mask)
        return self._reads.get(keys, pages, policy or self.policy, mask)

    def touch_prefix(self, keys: Sequence[str], mark: bool = False) -> None:
        """After a ``get`` or ``put``: the pages before its keys (SGLang's ``prefix_keys``, in chain order) end
        more recent than them, the first the most recent, so that a prefix's head outlives every page after it
        (each call leaves its own pages so: PutCall.lru_order). O(len(keys)) a call, 1-2 us a page held: a
        request whose pages L3 reads 128 a call pays it per call (docs/benchmarks.md, "A prefix's head").
        ``mark``: the pages another process of the namespace may use too (THEIRS, found on disk: Index.others_in)
        are marked used on their tiers too, each at most once every MARK_EVERY_S (a metadata write a page and
        tier: the adapters mark on their write path), so that their writer's eviction spares them (Index.spare)."""
        self._check_open()
        self.index.touch_many(keys[::-1])
        if mark:
            self.mark_used(keys)

    def mark_used(self, keys: Sequence[str]) -> None:
        """Mark each of ``keys``' copies that may be another process's (Index.others_in) used on its tier
        (Tier.mark_used), unless marked in the last MARK_EVERY_S, so that their writer's eviction spares them
        (Index.spare). A hint: nothing fails. (``_marked``: a plain dict, each step atomic, shared by the
        host's threads.)"""
        self._check_open()
        now = time.monotonic()
        for key, k in self.index.others_in(keys):
            last = self._marked.get((key, k))
            if last is not None and now - last < MARK_EVERY_S or not self.tiers[k].healthy:
                continue
            if len(self._marked) >= MARKS_KEPT:
                self._marked.clear()  # (forgetting marks made costs at most one more mark a page)
            self._marked[(key, k)] = now
            at = self.tiers[k].mark_used(key)
            if at is not None:
                self.index.marked(key, at)
                self._stats.add(k, "used_marks")

    def pin(self, keys: Sequence[str]) -> list:
        """Keep ``keys`` from being evicted until :meth:`unpin` (LMCache's lookup-and-lock): one
        handle per key, None for a key the index lacks. (In a forked child it raises EngineClosedError,
        as every call: the index lock may have been held by a thread of the parent, which the child
        lacks, and would never be released.)"""
        self._refuse_in_fork()
        return self.index.pin(keys)

    def unpin(self, handles) -> None:
        """Release what :meth:`pin` returned (each handle once; in a forked child nothing: the pins are
        the parent's)."""
        if not self._in_fork():
            self.index.unpin(handles)

    def delete(self, keys: Sequence[str]) -> int:
        """Remove ``keys`` from the index and from every tier (a missing file is already gone), the
        copies the index never learned of too (another node's, one the start-up scan has not read yet:
        found again by the next lookup, they made a delete a no-op); returns how many keys were held.
        A failed tier's copy goes before the tier serves again (Tier.owe_delete). Writes wait meanwhile;
        a read in progress keeps its pins."""
        self._check_open()
        held = 0
        with self._writes.exclusive():
            for key in keys:
                holders = self.index.holders(key)
                held += bool(holders)
                for tier in self.tiers:
                    listed = holders >> tier.k & 1 and self.index.remove(key, tier.k)
                    if listed or tier.healthy and is_valid_key(key):
                        tier.unlink_page(key)
                        self.index.file_removed(key, tier.k)
                    if not tier.healthy and is_valid_key(key):  # (failed, before or by this removal: its
                        tier.owe_delete(key)  # copy, if any, goes before it serves again)
            valid = any(map(is_valid_key, keys))  # (a call of no key removes nothing: no look either)
            for tier in self.tiers if valid else ():  # a tier whose tree is away (moved, unmounted) and that
                # nothing noticed yet: a removal there answers "already gone", reaching nothing. Failed now,
                # it owes them all
                if tier.healthy and tier.fail(errno.ENOENT, "delete: the tier's directory is gone"):
                    for key in filter(is_valid_key, keys):  # (as clear() does: Tier._remove_pages)
                        tier.owe_delete(key)
        return held

    def evict(self, keys: Sequence[str]) -> int:
        """Evict ``keys`` as the capacity eviction does (LMCache's L2 eviction, through the adapter's delete):
        they leave the index, and each tier's file goes only while it is this process's copy (the writer's
        eviction, Jobs.evicted_under_writer). Another process's copy on a shared tier (THEIRS, or a file written
        under the name since) stays, found again by a lookup: a delete removed it, the page another node had
        just stored and still counted (test_lmcache_l2_eviction_on_one_node_never_deletes_the_chunks_another_
        node_stored_on_the_shared_tier). A failed tier's copy goes before it serves again (Tier.owe_delete).
        Returns how many keys were held."""
        self._check_open()
        held = 0
        with self._writes.exclusive():
            victims: list[list[str]] = [[] for _ in self.tiers]
            for key in keys:
                holders = self.index.holders(key)
                held += bool(holders)
                for tier in self.tiers:
                    if not (holders >> tier.k & 1 and self.index.remove_mine(key, tier.k)):  # (another's: file stays)
                        continue
                    if tier.healthy:
                        victims[tier.k].append(key)
                    else:  # its copy, if still this process's, goes before it serves again (as evicted: another
                        # process's page under the name since stays, as on a healthy tier)
                        tier.owe_delete(key, self.index.judges(key, tier.k))
            for k, gone in enumerate(victims):
                self._writes.jobs.evicted_under_writer(k, gone)
        return held

    def register_memory(self, address: int, nbytes: int) -> bool:
        """Say where pages will be read into (a host pool, a destination buffer), memory that stays
        mapped while the engine is open. With ``register_memory`` on (the default) the read ring pins
        it now (io_uring fixed buffers), so reads of pages one tier alone holds land in it directly and
        pin nothing; the engine also learns now, off the read path, whether it is huge-page backed
        (memory.py). Without it, reads into memory of 4 KiB pages are staged, and the first reads into
        new memory are staged while the engine learns it in the background. Returns whether reads
        land in it (where a page's pieces are also 4096-aligned)."""
        self._check_open()
        return self._reads.register_memory(address, nbytes)

    def contains(self, key: str) -> bool:
        """True when a healthy tier holds ``key``: the index, and for a key it lacks, one header
        lookup per tier (pages written by another process sharing the namespace, see _discover)."""
        self._check_open()
        mask = self._healthy_mask()
        return is_valid_key(key) and (self.index.contains(key, mask) or bool(self._discover([key], mask)))

    def prefix_len(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` held by a usable tier. Answered from the index; only the
        first key it lacks costs a lookup per tier (and, if found there, the next one, and so on). A
        failed tier whose back-off expired is probed first, as by a get or put: a process whose only
        calls are these queries (an MLA rank that never writes asks before it reads; with every tier
        failed it answered 0 for ever, and sglang's hit count is the least of its ranks')."""
        self._check_open()
        mask = self._usable_mask()
        n = 0
        while True:
            n += self.index.prefix_len(keys[n:], mask)
            if n >= len(keys) or not self._discover([keys[n]], mask):
                return n

    def usage(self) -> tuple[int, int]:
        """(bytes held, capacity) in payload bytes, as LMCache's usage counts them: the distinct pages
        the index holds on any tier, against the largest tier's capacity (every tier takes every page; an
        unlimited tier counts its file system's size). Held may pass it for a while: tiers evict by their own
        capacity, and a page a small tier keeps that the largest evicted counts too (an LMCache soak: 1.26-1.33x
        at times); LMCache's eviction then deletes its least recent chunks until held is back under it."""
        caps = [tier.capacity if tier.capacity is not None else self._fs_bytes(tier) for tier in self.tiers]
        return self.index.held_bytes, max((c for c in caps if c is not None), default=0)

    def capacity_limit(self, fresh: bool = False) -> int | None:
        """The largest tier's capacity (an unlimited tier's: what a write can ever get on its file system, as last
        seen; ``fresh``: asked again), or None when an unlimited tier cannot tell its size: no page set larger than
        this can be held whole. (With the unlimited tiers left out, a store task larger than every file system was
        written: each of its pages evicted the tiers' valid pages for the next, and it failed all the same; one
        between the size and what a write can get, on GlusterFS with its storage.reserve, alike.)"""
        caps = [tier.capacity if tier.capacity is not None else self._fs_bytes(tier, cached=not fresh, usable=True)
                for tier in self.tiers]
        return None if None in caps else max(caps)

    def _fs_bytes(self, tier: Tier, cached: bool = False, usable: bool = False) -> int | None:
        """The size of ``tier``'s file system (``usable``: less the blocks it reserves, Tier.fs_usable; with
        ``cached``, as its last look saw it, if it looked), or None where it cannot say (gone, ESTALE, hung; a
        file system that does not say its size) or did not answer at start-up (not started yet: unasked, a
        statvfs there would wait write_timeout again: LMCache's adapter asks as it starts)."""
        if not (cached and tier.fs_bytes is not None):
            if tier.trust is None:
                return None
            # (on the tier's read thread, by read_timeout too, as a lookup: LMCache's get_usage and store
            # submissions must not wait for ever where the tier may hang with write_timeout=0, bounded.py)
            if tier.room(read=True, within=self.config.read_timeout or None) is None:
                return None
        return (tier.fs_usable if usable else tier.fs_bytes) or None  # (0: it does not say its size)

    def held(self, key: str) -> bool:
        """Whether the index lists a copy of ``key`` on any tier (no disk access, healthy or not).
        :raises EngineClosedError: in a forked child (:meth:`pin`)."""
        self._refuse_in_fork()
        return self.index.contains(key)

    def holds_own(self, key: str) -> bool:
        """Whether the index lists a copy of ``key`` that is this process's (not another process's, found on a
        shared tier: THEIRS, which an eviction here only forgets). :raises EngineClosedError: as :meth:`held`."""
        self._refuse_in_fork()
        return self.index.holds_own(key)

    def on_gone(self, callback: Callable[[str], None] | None) -> None:
        """Call ``callback(key)`` whenever a key leaves the index on every tier (evicted, deleted,
        damaged, vanished), or its last copy of this process's does while another process's stay (THEIRS:
        :meth:`holds_own` is False from then). It runs under the index lock: it must not block nor call the
        engine."""
        self.index.on_gone = callback

    def on_own(self, callback: Callable[[str], None] | None) -> None:
        """Call ``callback(key)`` whenever a key held only as another process's copies (THEIRS) gains a copy of
        this process's (:meth:`holds_own` is True from then: catch-up, promotion). Under the index lock, as
        :meth:`on_gone`."""
        self.index.on_own = callback

    def clear(self) -> None:
        """Remove every page of this namespace from every tier. A failed tier is probed now (it may be
        back); one still failed removes its pages when it rejoins, before it serves again (tiers.py):
        a page cleared (stale KV after a weight update) is never served again, nor found, unless another
        process sharing a tier, not cleared itself, copies its own copy back there (its catch-up): clear each.
        A Ctrl-C during it is raised once it is whole (bounded.shielded)."""
        self._check_open()
        for tier in self.tiers:  # (before the locks: a probe of a hung tier holds no get or put up)
            tier.usable(now=True)
        interrupt = shielded(self._clear_whole)  # (a Ctrl-C cut it half-way: a page dropped from its FIFO
        # and never ended, its bytes in the backlog for good, its put never answered; or a write in flight
        # not cancelled, committed after the clear raised)
        self._owed.note()  # (the tiers that missed it: written down, so a restart does not forget)
        if interrupt is not None:
            raise interrupt

    def _clear_whole(self) -> None:
        """clear()'s work, on a thread no signal reaches (bounded.shielded)."""
        with self._reads.lock, self._writes.exclusive():
            self._writes.cancel_under_writer()  # a put in progress reports its pages False
            self._replicas.clear()
            self.index.clear()
            for tier in self.tiers:
                tier.clear()
            # Again, once the files are gone: a lookup (discovery, no lock of these) that read a file of
            # before the clear while the tiers were being cleared indexed it, in the index's new epoch,
            # and the file went a moment later (one that indexes after this is refused: _lookup's epoch)
            self.index.clear()

    def close(self) -> None:
        """Wait briefly for orphan reads, write what is queued, close the rings and free buffers.
        Idempotent. A call running on another thread finishes first; one that starts later raises
        EngineClosedError. With write_timeout=0, a tier whose writes make no progress for CLOSE_HANG_S
        is failed, as write_timeout fails it: close() (and a process's exit) is bounded."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if self._in_fork():  # the rings are the parent's: not touched (the parent still uses them)
            return
        if sys.is_finalizing():  # (the exit hook, _close_open_engines, did not reach it) the daemon threads
            # stopped where they were, maybe holding a lock or a join close() would wait on for ever; none
            # writes any more, and the rings end with the process. A page file being written stays a
            # temporary file, removed by the next start
            return
        for tier in self.tiers:  # (first: a tier's settle thread removes nothing more, nor lets it rejoin)
            tier.closed = True
        self.bound_writes()
        self._scan.stop(CLOSE_DRAIN_S)
        self._owed.note()  # (a record of clears owed that a clear() or a rejoin could not write: once more)
        left = self._reads.drain(CLOSE_DRAIN_S, closing=True)
        if left:  # a hung tier: the kernel holds reads into the ring's buffers, and closing the ring
            # waits for them, however long; the caller does not (the buffers stay the ring's till then)
            log.warning("kvstream: close(): %d reads still in flight after %.0f s (a hung tier); the read ring "
                        "and its buffers are released by a background thread once they end", left, CLOSE_DRAIN_S)
            threading.Thread(target=self._reads.close, name="kvstream-close", daemon=True).start()
        else:
            self._reads.close()
        self.reads_drained = True  # (LMCache's close may leave the rest, held by a hung tier, to this thread)
        self._replicas.close()
        self._writes.close()
        for tier in self.tiers:
            tier.drop_mark()
            tier.calls.close()
            tier.reads.close()
        tmpfiles.release(self._token)

    def bound_writes(self, bounded: bool = True) -> None:
        """Closing (close(), or a caller about to close that waits for its writes first: LMCache's
        adapter): with write_timeout=0 (wait for ever), a tier whose writes make no progress for
        CLOSE_HANG_S from now on is failed as write_timeout fails it (its pages fail there), so that
        the wait ends: a server's shutdown is bounded. ``bounded=False`` ends such a caller's bound (its
        wait is over): an engine it was given, which its owner goes on using, waits for ever again as
        set (before, LMCache's close() left it failing a tier slower than CLOSE_HANG_S for good)."""
        self._bounds += 1 if bounded else -1
        if self.config.write_timeout <= 0:  # (read by the writer thread at its next step: one float)
            self._writes.write_timeout = CLOSE_HANG_S if self._bounds > 0 or self._closed else 0.0

    def stalled(self, since: float) -> str | None:
        """Whether the writer has made no progress (no write sent or completed on any tier) for
        EXIT_HANG_S since ``since``: then, with write_timeout=0, a call on a hung tier holds it, which
        nothing can end (its own hang check, CLOSE_HANG_S under bound_writes, fails a tier whose writes
        the ring holds well before). Returns what holds it ("tier 1 (/mnt/x)": the tier whose create
        or commit it is in, else "a tier"), or None.

        Writes that wait for reads (read priority: a tier with writes to do and a get reading from it)
        are no stall: they go out when the reads end, which progress meanwhile (else they hold no write
        back: priority.STALL_S). The writer's clock counts such a tier's reads' progress as its own;
        before, a close() during a long load let go of the stores queued behind it, as if hung."""
        writes, now = self._writes, time.monotonic()
        last = max(since, *writes._progress)
        if self.priority.enabled:  # (lists and deques read unlocked: a glance, the writer may change them)
            last = max([last] + [now - self.priority.idle_for(k) for k in range(len(self.tiers))
                                 if writes.queue.fifo[k] or writes.jobs.active[k]])
        if now - last <= EXIT_HANG_S:
            return None
        k = self._writes.jobs.calling
        return "a tier" if k is None else f"tier {k} ({self.tiers[k].root})"

    def _in_fork(self) -> bool:
        """This is a forked child of the process that opened the engine: closed, its rings untouched
        (they are the parent's; the rings themselves refuse use and skip their close in a child)."""
        if forks() == self._forks:
            return False
        self._closed = True
        self._closed_why = (f"kvstream engine was opened in process {self._pid}; this process ({os.getpid()}) "
                            "is a fork of it and cannot use its I/O rings: open a new Engine in this process")
        return True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- observability -------------------------------------------------------------------------
    def trust_summary(self) -> str:
        """Whose files the engine trusts on its tiers (trust.py), for start-up lines: 'trusts alice (uid
        1000)' when every tier says the same, else per tier."""
        texts = [t.trust.describe() if t.trust is not None else "did not answer at start-up" for t in self.tiers]
        if len(set(texts)) == 1:
            return texts[0] + (" on every tier" if len(texts) > 1 else "")
        return "; ".join(f"tier {t.k} {text}" for t, text in zip(self.tiers, texts))

    @property
    def scan(self) -> dict:
        """Progress of the background start-up scan (scan.py): ``done``, files read, pages indexed,
        damaged files and temporary leftovers removed, seconds, rate, per tier shards done."""
        return self._scan.progress()

    def wait_scan(self, timeout: float | None = None) -> bool:
        """Wait until the start-up scan has read every tier; True when it has (False: ``timeout``)."""
        return self._scan.wait(timeout)

    def namespace_dirs(self, digest: str) -> list[tuple[int, str]]:
        """(tier, path) of each tier holding the directory of the namespace ``digest`` (an adapter's namespace
        as an earlier version named it: its pages are never served here, and no capacity counts them). Each
        look is bounded as the tier's calls (a failed tier, or one that does not answer, holds none)."""
        self._check_open()
        found = []
        for tier in self.tiers if is_digest(digest) else ():
            if not tier.healthy:  # (one that did not answer at start: not waited for again)
                continue
            path = os.path.join(tier.layout.base, digest)
            try:
                tier.calls.run(os.lstat, path)
            except OSError:  # (none there; or the tier does not answer)
                continue
            found.append((tier.k, path))
        return found

    @property
    def last_batch(self) -> dict:
        """Figures of the last read batch (see stats.py)."""
        return self._stats.snapshot()["last_batch"]

    def stats(self) -> dict:
        """Counters as a plain dict: totals, ``tiers`` (per tier), ``last_batch``, ``history``."""
        out = self._stats.snapshot()
        writes = self._writes
        for k, (tier, row) in enumerate(zip(self.tiers, out["tiers"])):
            row.update(path=tier.root, healthy=tier.healthy, last_error=tier.last_error, failures=tier.failures,
                       pages=self.index.pages_on(k), theirs_pages=self.index.theirs(k),
                       theirs_forgotten=self.index.forgotten[k],
                       used_bytes=self.index.used[k], capacity_bytes=tier.capacity,
                       write_queued_bytes=writes.queue.queued[k], write_bandwidth=writes.io.flows[k].rate,
                       write_window=writes.io.flows[k].window, replication_pending=self._replicas.pending(k))
        out["write_backlog_bytes"] = writes.queue.backlog
        out["replication_pending"] = sum(row["replication_pending"] for row in out["tiers"])
        reads, writes = self._reads.pool, writes.pool
        out["memory"] = {"limit_bytes": self.config.memory,
                         "read_bytes": reads.held_bytes, "read_peak_bytes": reads.peak_bytes,
                         "write_bytes": writes.held_bytes, "write_peak_bytes": writes.peak_bytes}
        out.update(pages=len(self.index), orphan_reads_in_flight=self._reads.orphans, policy=self.policy.name,
                   io_engine=self.io_engine, namespace=self.namespace.digest, scan=dict(self.scan))
        return out

    def check(self, fix: bool = False) -> list[Problem]:
        """Verify every page file of this namespace (headers and block CRCs), temp leftovers, and
        that the index matches the disk. ``fix`` removes damaged files and leftovers and brings
        the index in line with the disk. A tier that may hang and does not list its pages in
        write_timeout fails and is reported ``unreadable``, unchecked (its walk would hold every get and put).

        :returns: the problems found (``Problem.fixed`` where repaired); empty when consistent.
        """
        self._check_open()
        problems: list[Problem] = []
        for tier in self.tiers:  # (first: check_tier's walk of a hung tier would hold every get and put, under
            # the locks below, as long as it hangs; one that does not list its pages in write_timeout fails)
            if tier.healthy and not tier.answers("list its pages to check them"):
                problems.append(Problem("unreadable", tier.root, tier.layout.pages, f"did not answer in "
                                        f"{self.config.write_timeout:g} s (write_timeout): a hung file system; "
                                        "not checked, the tier failed", Reason.UNREADABLE))
        # check reads everything anyway: the scan finishes first, unpaced (else the pages it has not
        # reached yet would read as 'index_missing'); a failed tier's is not waited for (it may hang)
        self._scan.set_limits(0, 1)
        self._scan.wait_healthy()
        with self._reads.lock, self._writes.exclusive():
            for k, tier in enumerate(self.tiers):
                if not tier.healthy:
                    continue
                found, valid = check_tier(tier.layout, self.namespace.digest, fix=fix, payload=True, trust=tier.trust)
                problems += found
                indexed = set(self.index.keys(k))
                for key in sorted(indexed - valid.keys()):
                    problems.append(Problem("index_stale", tier.root, tier.layout.page_path(key),
                                            "indexed but not on disk", Reason.INDEX, fixed=fix))
                    if fix:
                        self.index.remove(key, k)
                for key in sorted(indexed & valid.keys()):
                    page = valid[key]
                    if self._same_version(key, page):
                        continue
                    # Another process of the namespace stored this key since, with other bytes: a valid
                    # page. Fixed as a read would: forget this copy (the file stays), or, where it was the
                    # only indexed copy, index the version on disk.
                    problems.append(Problem("index_stale", tier.root, page.path, "indexed with other content than "
                                            "the file holds (another writer's version)", Reason.INDEX, fixed=fix))
                    if fix:
                        self.index.remove(key, k)
                        if not self.index.holders(key):
                            self._index_page(k, page)
                for key in sorted(valid.keys() - indexed):
                    page = valid[key]
                    if self.index.holders(key) and not self._same_version(key, page):
                        continue  # another writer's version of an indexed page: valid, kept, not indexed
                    # A bug, or (shared namespace) another process's page that discovery will find.
                    problems.append(Problem("index_missing", tier.root, page.path, "on disk but not indexed",
                                            Reason.INDEX, fixed=fix))
                    if fix:
                        self._index_page(k, page)
        return problems

    def _same_version(self, key: str, page: ScannedPage) -> bool:
        """The valid file ``page`` holds the content the index has for ``key``."""
        info, h = self.index.get(key), page.header
        return info is not None and info.same_content(h.length, h.block, h.crcs)

    # -- internals -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or self._in_fork():
            raise EngineClosedError(self._closed_why)

    def _refuse_in_fork(self) -> None:
        """The index's own calls, which serve after close() too (LMCache's unlocks as it shuts down)."""
        if self._in_fork():
            raise EngineClosedError(self._closed_why)

    def _healthy_mask(self) -> int:
        return sum(1 << t.k for t in self.tiers if t.healthy)

    def _usable_mask(self) -> int:
        """Healthy tiers, after probing failed ones whose back-off expired."""
        return sum(1 << t.k for t in self.tiers if t.usable())

    def _bound_theirs(self, tier: Tier, **how) -> None:
        """Another process's copies indexed on ``tier`` add up to at most its file system's size (Index.theirs_limits;
        a tier that does not answer now: when it rejoins). ``how``: Tier.room's (asked for a get)."""
        room = tier.room(**how)
        if room is not None and room.size > 0:
            self.index.theirs_limits[tier.k] = room.size

    def _rebound_theirs(self, k: int, nbytes: int, within: Callable[[int], float | None], asked: set[int]) -> None:
        """A page of ``nbytes`` discovery found on tier ``k`` would take another process's copies there past
        their bound (the file system's size when last asked): ask it again first, once per lookup (a file system
        grown since, an online resize, held the bound of before: the index forgot live pages of the very get
        that discovered them, and the get missed them). On the tier's read thread, within the lookup's time;
        no answer: the bound stays."""
        if k not in asked and not self.index.theirs_fit(k, nbytes):
            asked.add(k)
            self._bound_theirs(self.tiers[k], read=True, within=within(k))

    def _discover(self, keys: Sequence[str], mask: int) -> int:
        """Index pages of ``keys`` the index lacks but a tier in ``mask`` holds: written by another
        process sharing this namespace (MLA's writer rank, a second engine) since our start-up scan.
        Costs one failed open per tier for a truly missing key. Returns how many keys were found.
        Until the start-up scan is done this is how pages of before the restart are found, whatever
        the ``discover`` setting; a tier whose scan ended when it failed and that is back has its scan
        resumed first, so until that one is done too (scan.py)."""
        self._scan.resume()
        if not self.discover and self._scan.done:
            return 0
        return self._lookup([k for k in keys if is_valid_key(k) and not self.index.contains(k, mask)], mask)

    def _lookup(self, keys: Sequence[str], mask: int, sizes: Mapping[str, int] | None = None) -> int:
        """Read the headers of ``keys`` on the tiers in ``mask`` and index the valid pages (where
        tiers hold different versions of a page, the newest is indexed), of ``sizes[key]`` bytes when
        given. Returns the keys found."""
        found = 0
        until = honest_until()
        # A look is a read (tiers.py look): a tier's looks in the call, all keys, end by its read_timeout. Each
        # tier has its own (from its first look): with one deadline for all, a hung tier first in line spent
        # it, and a network tier behind it that answers was given no time (its pages missed).
        timeout, deadlines = self.config.read_timeout, {}

        def within(k: int) -> float | None:
            now = time.monotonic()
            return None if timeout <= 0 else max(0.0, deadlines.setdefault(k, now + timeout) - now)

        # (before the reads: a file found now on a tier whose scan listed it whole was not there then)
        since = [self._scan.listed(tier.k) for tier in self.tiers]
        asked: set[int] = set()  # tiers whose size this lookup asked again (_rebound_theirs)
        for key in keys:
            for _ in range(RETRIES):  # (a copy of a key like it left the index while its file was read, or
                # a clear() came: its file may be going, the look again finds it gone or one written since)
                epoch, mark = self.index.epoch, self.index.mark(key)
                pages = [(age_key(page.header.created_ns, until), tier.k, page) for tier in self.tiers
                         if mask >> tier.k & 1
                         for page in [tier.look(self.namespace.digest, key, within(tier.k))]  # (None: no answer)
                         if page is not None and page.problem is None
                         and (sizes is None or page.header.length == sizes[key])]
                for _, k, page in pages:
                    self._rebound_theirs(k, page.header.length, within, asked)
                if all([self._index_page(k, page, mark, epoch, since[k])
                        for _, k, page in sorted(pages, key=lambda e: e[:2])]):
                    break
            if pages and self.index.contains(key, mask):  # (pages: a key held at another size found none)
                found += 1
                self._stats.total("discovered")
        return found

    def _recover(self, missed: list[str], relook: Mapping[str, int], mask: int) -> int:
        """The read path missed ``missed``: probe now (once per batch, whatever their back-off) the
        failed tiers that hold them, which may be the last copies (the others were damaged), and look
        up on disk the ``relook`` keys no indexed copy of the caller's size (``relook[key]`` bytes) is
        left of (their copies were gone, another writer's version, or a version of another size: a copy
        of the caller's size the tiers hold is indexed). Returns the tiers usable now."""
        wanted = 0
        for key in missed:
            info = self.index.get(key)
            if info is not None:
                wanted |= info.tiers & ~mask  # tiers failed before this batch (one that failed in it just did)
        for tier in self.tiers:
            if wanted >> tier.k & 1:
                tier.usable(now=True)
        mask = self._usable_mask()
        def held(key: str) -> bool:
            info = self.index.get(key)
            return info is not None and bool(info.tiers & mask) and info.length == relook[key]

        self._lookup([k for k in sorted(relook) if not held(k)], mask, relook)
        return mask

    def _index_page(self, k: int, page: ScannedPage, mark: int | None = None, epoch: int | None = None,
                    since: bool | None = None) -> bool:
        """Index a valid page file on tier ``k``, read after ``mark`` (Index.mark; None: now, with every
        writer held) in index ``epoch``; ``since``: read once the start-up scan had listed tier ``k``
        whole (BackgroundScan.listed, Index.commit; None: whether it has now). An indexed copy of other
        content on another tier leaves the index (one version per key) but not the disk: it is a valid page
        too. False: a copy of a key like it left the index since ``mark``, maybe this one, its file being
        deleted, or a clear() came since ``epoch``: nothing indexed, read it again."""
        h = page.header
        mark = self.index.mark(h.key) if mark is None else mark
        since = self._scan.listed(k) if since is None else since
        return self.index.commit(h.key, k, h.length, h.block, h.crcs, h.length, reserved=False, mark=mark, epoch=epoch,
                                 stamp=(h.writer_ns, page.mtime_ns), since=since) is not None

    def _placed(self, tier: Tier, real: str) -> str:
        """A tier that did not answer at start-up answers, at real path ``real`` (Tier._start_late, before its
        probe): why start-up would have refused it beside the others, checked against those whose real path is
        known (probe.check_overlap; each one's stats on its calls thread, bounded), '' when none. One at a time:
        of two paths to one directory that both did not answer, the first to answer serves, the other stays out."""
        with self._placing:
            looks = [Look(real, False, None) if t is tier else  # (this one's calls thread runs this)
                     Look(self._reals[t.k], t.local, None if t.local else t.calls) for t in self.tiers]
            try:
                check_overlap(self.config, looks, only=tier.k)
            except TierError as exc:
                return str(exc)
            self._reals[tier.k] = real
        return ""

    def _reconcile(self, tier: Tier) -> str:
        """A failed tier rejoins (its tree checked as start-up checks it: tiers.py): it serves at once,
        and a thread of its own forgets the indexed pages whose files did not survive. Listing a tier
        of millions of files takes minutes on a network file system; the get or put that noticed the
        tier back must not wait for it (it did). Until then a read of a lost page fails over to a
        replica and forgets that copy, as for any copy that vanished."""
        scan = getattr(self, "_scan", None)
        try:  # a share resolved now (a tier that did not answer at start-up) that cannot hold a page: out, as
            # start-up refuses it (serving, every put would skip it: one replica short, quietly)
            check_capacities(self.config, [tier.capacity if t is tier else None for t in self.tiers], self._page_bytes)
        except ConfigError as exc:
            why = f"start-up would refuse it: {exc}"
            if why != tier.last_error:  # (logged once, not at every probe)
                log.warning("kvstream: tier %d (%s) stays failed: %s", tier.k, tier.root, why)
            return why
        # a tier that did not answer at start-up: its capacity given as a share, and a clear a record names it
        # by its real path for, known now (the clear is done before it serves: tiers.py)
        self.index.capacities[tier.k] = tier.capacity
        self._bound_theirs(tier)
        self._owed.recall_for(tier)
        self._owed.note()  # (its clear owed, if any, is done: _probe)
        threading.Thread(target=_forget_lost, args=(tier, self.index, self._replicas, scan),
                         name="kvstream-rejoin", daemon=True).start()
        return ""

    # Background replication's hooks in the read and write paths (weak, as _recover: see _weak).
    def _read_done(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]],
                   found: Sequence[bool]) -> None:
        self._replicas.read(keys, pages, found)

    def _thinned(self, keys: list[str]) -> None:
        self._replicas.owe(keys)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.index)} pages"
        return f"<Engine {self.namespace.digest} {len(self.tiers)} tiers, {state}>"

    def __del__(self):
        if not getattr(self, "_closed", True) and not self._in_fork():
            if not sys.is_finalizing():  # (at exit: close() does nothing then, nor would a warning show)
                warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)
            self.close()


__all__ = ["Engine"]
