"""One tier at run time: its directory tree, its health, and the file operations around the ring.

Health lifecycle::

    healthy --(EIO, EROFS, EACCES, EPERM, ENOTCONN, ... or its directory vanished)--> failed
    failed  --(a probe writes, reads and removes a 4 KiB file, or finds no room for it: full is not failed)--> healthy
             when: the back-off expired (it doubles after each failed probe, from Config.tier_retry
             up to 300 s); or the tier failed because its directory vanished and a look (one stat,
             at most every LOOK_S) finds it back; or a read needs it (``usable(now=True)``: it is the
             last holder of a page; once per batch, and at most every LOOK_S); before it rejoins
             it removes the pages written before a clear() it missed (failed then, or failing during it, or
             before a restart: owed.py), and the copies of the keys whose delete() it missed, on a
             thread of its own (_settle: the call whose probe found it back does not wait)

A tier that did not answer at start-up (write_timeout, on its own calls thread: probe.look_at) starts failed,
and its first probe that answers runs the start-up it missed (:meth:`Tier._start_late`) before it rejoins.

A failed tier is skipped by writes and reads; each change of state is logged once. A tier is
"gone" when ``<tier>/kvstream`` no longer exists, or is on another device than before while no file
system is mounted at the tier's mount point: an unmounted file system leaves the empty mount point
behind, and writing there would fill the parent file system, so the probe never re-creates
``<tier>/kvstream`` itself. A file system mounted there again is the tier back, whatever device number
it got (a network file system's client remounted usually gets a new one). It is gone too when the
entry at ``<tier>/kvstream`` is no longer the directory start-up (or the last rejoin) checked (its
inode and owner, ``lstat``): a scratch purge removed it and anyone the tier root lets (another user,
in a sticky 1777 root) made a directory or a link there. Every write starts with that ``lstat``
(:meth:`Tier.create_tmp`), so nothing is written through what took its place; the probe then checks
what is there as start-up would (:meth:`Tier._recheck`) before the tier rejoins.

ENOENT and ESTALE on one page file are that copy's news, not the tier's (:meth:`Tier.copy_gone`): on a
shared file system another node evicts pages and renames new versions over them, and a descriptor
(or a cached name) of the replaced file answers ESTALE. The tier fails for them only when its base
directory does not answer.
"""
from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from .bounded import BoundedCalls, GivenUp
from .errors import KVStreamError
from .fds import close_fd
from .files import TMP_FILES_PER_TIER
from .integrity import (
    HeaderError, NewerFormat, NotRegularFile, ScannedPage, UntrustedFile, open_direct, open_with_header,
    scan_file, shard_entries, shards, tier_clock, unpack_header,
)
from .layout import HEADER_SIZE, TMP_DIR, TierLayout, key_of_page_file
from .locks import ranked_lock
from .probe import Look, local_fs, probe_tier, resolve_capacity
from .tmpfiles import (
    NEW_FILE, REMOVING_PREFIX, SPACE_ERRNOS, ProbeFailed, drop_mark, hold_mark, is_engine_tmp, probe_direct,
    tmp_name,
)
from .trust import (
    CLOCK_SKEW_NS, check_dir, describe, dir_error, dir_findings, establish, honest_until, identity,
    link_new, list_below, make_dir, mark_below, marked_below, not_a_file, open_below, owner_problem, remove, root_problem, same_file,
    sealed_identity, unlink_unless, wall_ns,
)

log = logging.getLogger("kvstream")

# errnos that say the tier (not one page) is unusable
TIER_ERRNOS = frozenset({errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENODEV, errno.ENXIO,
                         errno.ESTALE, errno.ENOTCONN, errno.ECONNABORTED, errno.ESHUTDOWN, errno.EBADF,
                         errno.ETIMEDOUT})
# (ECONNABORTED: a FUSE mount whose client process died; ETIMEDOUT: a hung tier, writes.py)
SPACE_RETRIES = 8  # rewrites (or renames) of one (page, tier) after ENOSPC, each after an LRU eviction: the
# jobs of a batch compete for the room each eviction makes; jobs.py's _room_possible_under_writer stops hopeless ones
MAX_OWED_DELETES = 1 << 14  # delete()s a failed tier remembers to do before it serves again (owe_delete)
MAX_LEFTOVERS = 4096  # temporary files a failed tier kept that it removes when it rejoins (more: the next
# start's scan does)
CLEAR_SKEW_NS = CLOCK_SKEW_NS  # a clear a tier missed takes the pages headed up to this long after it too:
# another node's clock may run that much ahead, and its page of the old weights must never be served
MTIME_SLACK_NS = 2 * 10**9  # a file system may keep its times this coarsely (1-2 s): pages modified within it
# before a clear a tier missed are told apart by their headers (Tier._older_than)
MAX_RETRY_S = 300.0  # longest back-off between probes of a failed tier, s (or tier_retry, if longer)
LOOK_S = 0.5  # a tier that failed because its directory vanished is looked for (one stat) this often, s:
# a directory that is back (remounted, moved back) rejoins within a second, not after the back-off

TMP_FLAGS = os.O_WRONLY | NEW_FILE | os.O_DIRECT
SLOW_CLOSE_S = 0.2  # a temporary file's close on a network tier slower than this halves the files it keeps open
FIRST_TMP_FILES = 4  # temporary files open at once a network tier starts with: one more after as many quick
# closes, up to files.TMP_FILES_PER_TIER (Tier.tmp_files: MooseFS's client waits longer in close() the more files it
# has open for writing, and with 32 a close outlasted write_timeout, the healthy tier failed; trial moosefs)


class Room(NamedTuple):
    """A tier's file system's room, as statvfs tells it (Tier.room)."""
    free: int  # bytes free for us, plus what the file asked about already holds
    size: int  # its size, in bytes
    inodes: int | None  # inodes free for us; None: it counts none (it answers f_files 0)


class Tier:
    """Tier ``k`` of an engine: paths for one namespace, health state, file helpers.

    :param k: position (0 = fastest).
    :param root: the configured directory.
    :param digest: namespace digest (names the page directory).
    :param capacity: byte limit or None.
    :param modes: (file mode, directory mode).
    :param fsync: 'never' | 'data' | 'full'.
    :param retry_s: first back-off after a failure, s.
    :param clock: monotonic clock (injectable for tests).
    :param on_rejoin: ``on_rejoin(tier)`` before a failed tier rejoins (the engine reconciles the
        index with what survived on it); returns why the tier cannot rejoin yet ('' when it can).
    :param source: where the tier list came from (for messages).
    :param hang_timeout: write_timeout: on a tier that may hang (not on a local file system), how long
        the writer's file-system calls and a probe are waited for (bounded.py).
    :param look: its first look at start-up (probe.look_at: real path, local, its calls thread); None: made
        here. A tier that did not answer then (or does not answer its start-up here in ``hang_timeout``)
        starts failed: its first probe, once it answers, runs start-up's checks (:meth:`_start`).
    :param share: a capacity given as a share of the file system, when the tier did not answer at start-up:
        resolved when it does (``capacity`` is None until then).
    :param placed: ``placed(tier, real)``, for a tier that did not answer at start-up and answers now at real
        path ``real``: why start-up would have refused it beside the other tiers (one directory twice, one
        inside another's ``kvstream`` tree: probe.check_overlap), '' when it would not.
    :raises ConfigError: a directory of the tier fails the trust checks (trust.py).
    """

    def __init__(self, k: int, root: str, digest: str, capacity: int | None, modes: tuple[int, int],
                 fsync: str, retry_s: float, token: str, clock: Callable[[], float],
                 on_rejoin: Callable[["Tier"], str], source: str = "KVSTREAM_TIERS", owner: int | None = None,
                 hang_timeout: float = 0.0, look: Look | None = None, share=None,
                 placed: Callable[["Tier", str], str] | None = None):
        self.on_rejoin = on_rejoin
        self.k = k
        self.layout = TierLayout(root, digest)
        self.root = root
        self.capacity = capacity
        self.file_mode, self.dir_mode = modes
        self.shared = self.file_mode != 0o600
        self.fsync = fsync
        self.retry_s = retry_s
        self.token = token
        self.clock = clock
        self.healthy = True
        self.last_error = ""
        self.failures = 0  # state changes to failed
        self._backoff = retry_s
        self._next_probe = 0.0
        self._vanished = False  # failed because its directory went: look for it every LOOK_S
        self._next_look = 0.0
        self._next_forced = 0.0  # the next probe a read with no other holder may force
        self._lock = ranked_lock("tier")  # the health state below; never held across I/O
        self._probing = False  # a thread probes the failed tier now (outside the lock)
        self._settling = False  # a thread removes what the failed tier owes before it rejoins (_settle)
        self._settled = 0  # settles done: a probe that began before the last one ended is stale (usable)
        self.closed = False  # its engine closed (Engine.close): a settle thread stops, nothing more removed
        self._errors = 0  # tier errors accounted: one during a probe makes its success stale
        self._seq = itertools.count()
        # clear()s asked of this tier, and the last of them done whole: a tier failed at a clear() (or
        # failing during one) still holds the pages cleared, and removes them before it rejoins
        self._clears = self._cleared = 0
        self._clear_ns = 0  # when (trust.wall_ns) the last clear() came: an owed clear removes only the
        # pages written before it (on a shared tier other nodes put pages while this one was away)
        self._deletes_forgotten = 0  # deletes missed past MAX_OWED_DELETES (since it last served)
        # key -> (when (time_ns) a delete() it missed while failed came: the copy written before that is removed
        # before it serves; or, for an eviction it missed (Engine.evict), the judges of evict_page: only this
        # process's copy goes)
        self._deletes: dict[str, tuple[int, tuple[Callable, Callable] | None]] = {}
        self._dirs: set[str] = set()  # page directories known to exist
        self._leftovers: set[str] = set()  # temporary files of this engine whose removal failed with the tier
        # (a FUSE client killed mid-put): removed when it answers again, before it rejoins (_probe)
        # the size of its file system, as the last room() saw it (None: not yet; 0: one that does not say its
        # size, which bounds nothing: kept, so that it is not asked again for every page), and what a write can
        # ever get there (that size less the blocks the file system keeps back: _room)
        self.fs_bytes: int | None = None
        self.fs_usable: int | None = None
        self.source = source
        self._share = share
        self._placed = placed
        if look is None:
            real = os.path.realpath(root)
            look = Look(real, local_fs(root, real), None)
        # its real path (owed.py's records name it): as written until a tier that did not answer at start does
        self.real = look.real or root
        # a local disk file system answers or fails a call; a network one may hang (and one that did not answer
        # at start-up proved it may)
        self.local = look.local
        self.tmp_files = TMP_FILES_PER_TIER if self.local else FIRST_TMP_FILES  # (the writer's: seal)
        self._close_s = 0.0  # how long the last temporary file's close took (_seal)
        self._quick = 0  # quick closes since tmp_files last changed
        self.calls = look.calls or BoundedCalls(f"tier {k}", 0.0 if self.local else hang_timeout)
        # a get's opens, discovery's looks, usage()'s statvfs (write_timeout 0, no limit for the tier: the
        # caller's read_timeout still bounds them)
        self.reads = BoundedCalls(f"tier {k} reads", 0.0 if self.local else hang_timeout or float("inf"))
        self.trust = None  # who owns what we use (trust.establish); None: not started yet (did not answer)
        # this engine's temporary files in tmp/ of a local tier, and its mark there, held while there are any
        # (tmpfiles.hold_mark: a start in another pid namespace tells its death by it)
        self._mark_lock = ranked_lock("mark")
        self._in_tmp: set[str] = set()
        self._mark: tuple[int, str, int] | None = None
        self._mark_idle = False  # the writer has no job here: the mark goes with the last file (release_mark)
        self._base: tuple | None = None
        self.mount_point = ""
        started = look.real is not None
        if started:
            try:  # (bounded where it may hang: the probe before it answered, the tier may stop answering now)
                self.calls.run(self._start, owner)
            except OSError as exc:
                if exc.errno != errno.ETIMEDOUT or self.local:
                    raise
                started = False
        if not started:  # out until it answers: probed as any failed tier (usable), whose probe starts it first
            with self._lock:
                self.last_error = (f"did not answer at start-up in {hang_timeout:g} s (write_timeout): a hung "
                                   "file system; probed until it answers")
                self._out(False, retry_s)

    def _start(self, owner: int | None) -> None:
        """Start-up of the tier (trust.establish): its directories checked (made where missing), the owners it
        trusts learnt; the ``kvstream/`` writes go through (:meth:`_gone`).
        :raises ConfigError: a directory of the tier fails the trust checks."""
        self.mount_point = mount_point(self.layout.base)
        trust = establish(self.layout, self.dir_mode, self.shared, self.source, self.token, owner)
        st = os.lstat(self.layout.base)  # the kvstream/ writes go through (:meth:`_gone`), checked as establish did
        why = trust.dir_problem(st)
        if why is not None:  # (replaced since establish looked: a purge in those microseconds)
            raise dir_error(self.layout.base, st, why, trust, self.source)
        self._base = base_identity(st)
        self._dirs.update((self.layout.tmp, self.layout.pages))
        self.trust = trust

    def _start_late(self) -> str:
        """A tier that did not answer at start-up and answers now (its probe, on its calls thread): the start-up
        checks it missed (probe.probe_tier, then :meth:`_start`), its real path and a capacity given as a
        share learnt. Returns why it cannot start ('' when it did): as start-up would refuse it."""
        try:
            real = os.path.realpath(self.root)
            # first, as start-up checks it before its probes make anything there: a second path to another tier
            # (a link, a bind mount) or a tree inside another's would serve beside it, each taking the other's
            # files for its own (a page evicted from one vanishes from the other) or for strays
            why = self._placed(self, real) if self._placed is not None else ""
            if why:
                return f"start-up would refuse it: {why}"
            owner = probe_tier(self.root, self.dir_mode, self.source)
            self._start(owner)
            self.real = real
            if self._share is not None:
                self.capacity = resolve_capacity(self._share, self.root)
        except KVStreamError as exc:  # (the start-up error: said once, as a probe's refusal)
            return f"start-up would refuse it: {exc}"
        return ""

    # -- health ---------------------------------------------------------------------------------
    def usable(self, now: bool = False) -> bool:
        """Healthy, or failed and due for a probe that now succeeds (then healthy again). Due: the
        back-off expired; or the tier failed because its directory vanished and one stat (at most every
        LOOK_S) finds it back; or ``now`` (a read that has no other holder left for a page), at most
        every LOOK_S too: a tier that stays dead is not probed by every batch that misses."""
        while True:
            healthy, again = self._probe_if_due(now)
            if not again:
                return healthy

    def _probe_if_due(self, now: bool) -> tuple[bool, bool]:
        """One turn of :meth:`usable`: (healthy, whether to probe again at once: what the tier owed was
        removed while this probe ran, or a clear() or delete() came while it rejoined; else the schedule
        this probe sets would keep it out a back-off, with nothing to let it in sooner)."""
        if self.healthy:
            return True, False
        with self._lock:  # (decides who probes; the probe's I/O runs outside it)
            if self.healthy or self._probing or self.closed:  # (another thread probes now: its answer comes
                return self.healthy, False  # soon; or its engine closed: a tier of it never rejoins)
            t = self.clock()
            due = scheduled = t >= self._next_probe
            if not due and now and t >= self._next_forced:
                self._next_forced = t + LOOK_S
                due = True
            look = not due and self._vanished and t >= self._next_look
            if look:
                self._next_look = t + LOOK_S
            if not (due or look):
                return False, False
            self._probing = True
            failures, settled = self._errors, self._settled
        ok, why, vanished, again = False, "", True, False
        try:
            still_gone = look and self.gone(replaced=False)  # (another directory there: the probe judges it)
            if not still_gone:
                try:  # (bounded where the tier may hang: a probe of a hung tier holds no get or put)
                    ok, why = self.calls.run(self._probe)
                except OSError as exc:
                    ok, why = False, f"probe: {exc.strerror}"
                if ok and self.closed:  # (its engine closed during the probe: the metrics timer's, on an idle
                    ok, why = False, "its engine is closed"  # server, is no call close() waits for)
                if ok:  # before writes may go there: a page committed meanwhile stays indexed
                    why = self.on_rejoin(self)  # ('' or why not: listing its pages failed half-way)
                    ok = not why
                vanished = not ok and self.gone(replaced=False)  # (one refused: the back-off decides)
        finally:
            with self._lock:
                self._probing = False
        if still_gone:
            return False, False
        with self._lock:
            if ok and self._errors != failures:  # failed again while probing: the probe is stale
                ok, why = False, self.last_error
            if ok and (self.clear_owed or self._deletes):  # a clear() or delete() skipped it while it was
                ok, again = False, True  # probed: done before it serves, by the settle the next turn starts
            if ok:
                self.healthy = True
                self.last_error = ""  # (why it is failed: kept, an error long healed read as current in stats())
                self._backoff = self.retry_s
                self._deletes_forgotten = 0
                log.warning("kvstream: tier %d (%s) recovered; it rejoins reads and writes", self.k, self.root)
            elif again or self._settled != settled:  # (or what it owed was removed while this probe ran, which
                again = True  # saw the settle going on: the settle's own probe found this one running)
                self._next_probe = min(self._next_probe, self.clock())  # (due for that next turn: a look too)
            else:
                if scheduled:  # (a forced probe or a look, every LOOK_S, leaves the schedule: six of them
                    # doubled a few seconds' outage into 300 s out)
                    self._backoff = min(self._backoff * 2, max(MAX_RETRY_S, self.retry_s))  # (never below tier_retry)
                    self._next_probe = self.clock() + self._backoff
                self._vanished = vanished  # back but unusable (read-only, EIO): the back-off alone decides
                self.last_error = why
            return self.healthy, again

    def fail(self, err: int, what: str) -> bool:
        """Account an OS error of this tier; mark it failed when ``err`` says the tier (not one
        page) is unusable, or its directory vanished. Returns True when the tier is now failed."""
        if err not in TIER_ERRNOS and not (err == errno.ENOENT and self.gone()):
            return False
        vanished = err != errno.ETIMEDOUT and self.gone()  # (I/O: before the lock; none on a hung tier)
        with self._lock:
            self.last_error = f"{what}: {os.strerror(err)}"
            self._errors += 1
            self._out(vanished, self.retry_s)
        return True

    def owe_clear(self, when_ns: int) -> None:
        """A clear() this tier missed before the process started, at ``when_ns`` (owed.py recalls it): it
        is out now, and at its first probe, due at once, removes the pages written before then before it
        rejoins (as for a clear it misses while failed)."""
        with self._lock:
            self._clears += 1
            self._clear_ns = max(self._clear_ns, when_ns)
            self.last_error = "it owes a clear() asked before this start (a restart while it was failed)"
            self._out(False, 0.0)

    @property
    def clear_owed(self) -> bool:
        """A clear() asked of this tier is not done on it yet (it was failed, or failed during it)."""
        return self._cleared != self._clears

    @property
    def clear_ns(self) -> int:
        """When (trust.wall_ns) the last clear() asked of this tier came (0: none)."""
        return self._clear_ns

    def _out(self, vanished: bool, delay: float) -> None:
        """Healthy to failed (under the lock), the first probe ``delay`` s from now; logged once."""
        if not self.healthy:
            return
        self.healthy = False
        self.failures += 1
        self._backoff = self.retry_s
        self._next_probe = self.clock() + delay
        self._vanished = vanished
        self._next_look = self.clock() + LOOK_S
        self._dirs.clear()
        log.warning("kvstream: tier %d (%s) failed (%s); skipping it, next probe in %.0f s",
                    self.k, self.root, self.last_error, delay)

    def gone(self, replaced: bool = True) -> bool:
        """``<tier>/kvstream`` is missing, or is on another device and no file system is mounted at
        the tier's mount point (unmounted: the path is on the file system below now); with ``replaced``
        also when something else has its name (:meth:`_gone`). A tier that does not answer in time
        (bounded.py) is hung, not gone."""
        try:
            return self.calls.run(self._gone, replaced)
        except OSError:
            return False

    def _gone(self, replaced: bool = True) -> bool:
        """One ``lstat`` (a second look at the mount point only when the device changed). ``replaced``:
        also gone when the entry is not the directory last checked (:func:`base_identity`): a purge took it
        and a directory or a link of anyone's (another user's, in a sticky root) has its name now. Without
        ``replaced`` (the probe, a look for a vanished tier), something there on the tier's file system is
        worth a probe, whose checks (:meth:`_recheck`) decide whether the tier rejoins through it."""
        if self._base is None:  # (not started: it did not answer at start-up; hung, not gone)
            return False
        try:
            st = os.lstat(self.layout.base)
        except OSError:
            return True
        if st.st_dev != self._base[0] and not (self.mount_point != "/" and os.path.ismount(self.mount_point)
                                     and os.stat(self.mount_point).st_dev == st.st_dev):
            return True
        return replaced and base_identity(st)[1:] != self._base[1:]  # (a remount may change the device alone)

    def copy_gone(self, err: int, key: str) -> bool:
        """``err`` from ``key``'s page file says this copy is gone (ENOENT: deleted; ESTALE: replaced or
        deleted by another node of a shared file system), not the tier, whose base still answers."""
        return err in (errno.ENOENT, errno.ESTALE) and not self.gone()

    def look(self, digest: str, key: str, within: float | None = None) -> ScannedPage | None:
        """``key``'s page file here, read and judged (integrity.scan_file: discovery); None: the tier did
        not answer in time (write_timeout: it fails) or in ``within`` (the caller's read_timeout: it is not
        judged, as for a get's open). On the tier's read thread, as a get's open: discovery runs in a
        lookup's thread (SGLang's batch_exists, LMCache's lookup), which must not wait longer than
        read_timeout, nor for ever with write_timeout=0 (before, it waited in place, as long as the tier)."""
        try:
            return self.reads.run(functools.partial(scan_file, self.layout, digest, key, trust=self.trust),
                                  within=within)
        except OSError as exc:
            if exc.errno == errno.ETIMEDOUT:
                self.fail(errno.ETIMEDOUT, f"look up {key}")
            elif exc.errno != errno.ETIME:
                raise
            return None

    def answers(self, what: str) -> bool:
        """The tier lists its page directory in time (on a tier that may hang: write_timeout, bounded.py);
        False: it did not, and fails (ETIMEDOUT, ``what`` in its last_error). A listing's other errors
        are left to the caller's own walk (check_tier reports them)."""
        if self.local:  # (a local file system answers or fails)
            return True
        try:
            self.calls.run(shards, self.layout)
        except OSError as exc:
            if exc.errno != errno.ETIMEDOUT:
                return True
            self.fail(errno.ETIMEDOUT, what)
            return False
        return True

    def named(self, key: str) -> bool:
        """Something has ``key``'s page name on the tier (a file, a link, ...). :raises OSError: (ETIMEDOUT:
        the tier did not answer in time)"""
        return self.calls.run(os.path.lexists, self.layout.page_path(key))

    def listed(self, key: str, within: float | None = None) -> bool:
        """``key``'s page file is in a fresh listing of its directory. After ESTALE this tells a file
        replaced (a new version renamed in: look it up) from one deleted, and refreshes the client's
        cached entry of the name (a network file system's client keeps the old file's for about a
        second), so the lookup opens what the name holds now, not the stale file. A get's, so on a tier
        that may hang it runs as a get's open does (:meth:`open_page`, ``within``); a listing that does not
        answer in write_timeout fails the tier (before, the get waited as long as the server)."""
        try:
            return self.reads.run(self._listed, key, within=within)
        except OSError as exc:
            if exc.errno == errno.ETIMEDOUT:
                self.fail(errno.ETIMEDOUT, f"list {self.layout.page_dir(key)}")
            return False

    def _listed(self, key: str) -> bool:
        # (through descriptors: a shard replaced by a link is not listed, as it is not read)
        return os.path.basename(self.layout.page_path(key)) in list_below(self.root, self.layout.page_dir(key))

    def _probe(self) -> tuple[bool, str]:
        if self.trust is None:  # did not answer at start-up: its start-up now (it stays out where that refuses)
            why = self._start_late()
            if why:
                if why != self.last_error:  # (logged once, not at every probe)
                    log.warning("kvstream: tier %d (%s) stays failed: %s", self.k, self.root, why)
                return False, why
        if self.gone(replaced=False):
            return False, f"{self.layout.base} is missing or on another file system"
        try:
            self._dirs.clear()
            refused = self._recheck()
        except ProbeFailed as exc:
            return False, "probe read back different bytes" if exc.step == "verify" else f"probe: {exc.strerror}"
        except OSError as exc:
            return False, f"probe: {os.strerror(exc.errno or errno.EIO)}"
        if refused:
            why = f"probe: {refused}: start-up would refuse this tree"
            if why != self.last_error:  # (logged once, not at every probe)
                log.warning("kvstream: tier %d (%s) stays failed: %s", self.k, self.root, why)
            return False, why
        self._dirs.update((self.layout.tmp, self.layout.pages))
        with self._lock:
            leftovers, self._leftovers = self._leftovers, set()
        for tmp_path in leftovers:  # (kept in tmp/ of a shared tier until this process's next start, before)
            self._discard(None, tmp_path)
        with self._lock:
            owes, settling = self.clear_owed or bool(self._deletes), self._settling
            self._settling = owes
        if owes:  # (before it serves: never a page cleared or deleted meanwhile, found again and served)
            if not settling:
                threading.Thread(target=self._settle, name=f"kvstream-settle-{self.k}", daemon=True).start()
            return False, "it removes the pages of the clear() or delete()s it missed before it serves"
        return True, ""

    def _settle(self) -> None:
        """The clear() and delete()s a tier missed while failed, done on a thread of its own before it
        rejoins: 400k page files took 35 s to remove, and the get or put whose probe found the tier back
        (SGLang's prefetch thread, at a restart's first request: owed.py) waited for every one. The tier
        stays out meanwhile; once they are done this thread probes it again, and it rejoins (then, not at
        the next get or put: an idle server's tier would wait for traffic, and its catch-up with it)."""
        done = False
        try:
            done = self._do_owed_clear() and self._deletes_owed()
        except Exception:  # (never raise in a thread of ours: the next probe starts it again)
            log.exception("kvstream: tier %d: removing the pages of what it missed while failed", self.k)
        finally:
            with self._lock:
                self._settling = False
                if done:
                    self._settled += 1
                    self._next_probe = self.clock()
        if done and not self.closed:
            self.usable()

    def _recheck(self) -> str | None:
        """The tree of a failed tier about to rejoin, checked as start-up checks it (trust.establish):
        ``kvstream/`` may have vanished and been made again by anyone the tier root lets (another user,
        in a sticky 1777 root). The root (trust.root_problem), ``kvstream/`` (opened following no link),
        ``tmp/``, the namespace directory and its shards (trust.dir_findings); then ``tmp/`` and the
        namespace made where missing, through descriptors, and the O_DIRECT probe run in ``tmp/``; the
        ``kvstream/`` checked is then the one writes go through (:meth:`_gone`; mounted again, maybe
        another device number). Returns what start-up would refuse ('<path> <what is wrong> (owner ...,
        mode ...)'), else None.
        :raises OSError: the tier does not answer (:class:`ProbeFailed`: the probe)."""
        layout, trust = self.layout, self.trust
        st = os.stat(layout.root)
        why = root_problem(st, self.shared)
        if why is not None:
            return f"{layout.root} {why} ({describe(st)})"
        why = owner_problem(layout.root, trust)
        if why is not None:
            return why
        try:
            base_fd = open_below(layout.root, layout.base)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = os.lstat(layout.base)
            return f"{layout.base} {trust.dir_problem(st) or 'is in the way'} ({describe(st)})"
        try:
            base = os.fstat(base_fd)  # (what is there now: dir_findings' lstat may see another directory)
            why = trust.dir_problem(base)
            for path, st, why in [(layout.base, base, why)] if why else dir_findings(layout, trust):
                return f"{path} {why} ({describe(st)})"
            close_fd(make_dir(os.path.basename(layout.pages), base_fd, self.dir_mode))
            tmp_fd = make_dir(TMP_DIR, base_fd, self.dir_mode)  # (nobody else can add to a checked kvstream/)
            try:
                probe_direct("", self.token, dir_fd=tmp_fd)
            except ProbeFailed as exc:
                # A file system full of this engine's pages (it evicts on ENOSPC) may have no inode for the probe's
                # file either (probe_direct passes a write refused for room): full, not failed. Kept out, it stayed
                # out for good (only a healthy tier's puts evict); let in, its puts evict as before.
                if exc.errno not in SPACE_ERRNOS or exc.step != "create":
                    raise
            finally:
                close_fd(tmp_fd)
            self._base = base_identity(base)
        finally:
            close_fd(base_fd)
        return None

    # -- files ----------------------------------------------------------------------------------
    def open_page(self, key: str, within: float | None = None) -> int:
        """A get's O_DIRECT read descriptor of ``key``'s page (:meth:`open_here`): on a tier that may hang,
        opened on the tier's read thread and waited for at most write_timeout and ``within`` (what is left
        of the get's read_timeout; None: none); a descriptor that comes too late is closed (bounded.py).
        :raises OSError: as open_here; ETIMEDOUT: the tier did not answer in time; ETIME: ``within`` ended
        first (the tier is not judged)."""
        return self.reads.run(self.open_here, key, late=close_fd, within=within)

    def open_here(self, key: str) -> int:
        """O_DIRECT read descriptor of ``key``'s page, opened in this thread (a call already bounded: the
        catch-up's read, on the tier's calls thread).
        :raises NotRegularFile: a FIFO, directory, ... under the page's name (integrity.open_regular).
        :raises OSError: e.g. ENOENT."""
        return open_direct(self.layout.page_path(key), self.trust)

    def fresh_tmp_name(self) -> str:
        """A new name in ``tmp/`` for a file this engine writes there (start-up cleaning knows it: tmpfiles.py).
        Its seq is a count and 32 random bits: anyone who may write ``tmp/`` (a shared tier's member) sees the
        names there, and files of theirs at the next counts failed this engine's writes, one each (EEXIST)."""
        seq = next(self._seq) << 32 | secrets.randbits(32)
        return tmp_name(os.path.basename(self.layout.pages), os.getpid(), self.token, seq)

    def create_tmp(self) -> tuple[int, str]:
        """A new private temporary file for one page: (fd, path). :raises OSError: (ETIMEDOUT: the tier
        did not answer in time; the file, if the call makes it later, is removed then)"""
        return self.calls.run(self._create_tmp, late=lambda made: self._discard(*made))

    def _create_tmp(self) -> tuple[int, str]:
        # Every write starts here: its temporary file, made by path (as its shard directory and rename
        # are), only while kvstream/ is the directory checked. In a sticky root nobody else can move that
        # directory; once a purge took it, anyone may put a link there (to a directory of this user's) or
        # a directory of theirs: then the tier fails (ENOENT, gone) and nothing is written through it.
        if self._gone():
            raise FileNotFoundError(errno.ENOENT, "not the directory the tier checked (or missing)", self.layout.base)
        path = os.path.join(self.layout.tmp, self.fresh_tmp_name())
        self._track(path)
        try:
            try:
                fd = os.open(path, TMP_FLAGS, self.file_mode)
            except FileNotFoundError:
                self._dirs.discard(self.layout.tmp)
                self._mkdir(self.layout.tmp)  # removed under us (clear, operator): re-create once
                self._untrack(path)  # (the mark went with the directory: made again in the new one)
                self._track(path)
                fd = os.open(path, TMP_FLAGS, self.file_mode)
        except BaseException:
            self._untrack(path)
            raise
        if self.shared:
            try:
                os.fchmod(fd, self.file_mode)  # the umask may have cleared the group bits
            except OSError:
                self._discard(fd, path)
                raise
        return fd, path

    def seal(self, fd: int, open_files: int = 0) -> tuple[int, ...] | None:
        """Seal a fully written temporary file: fdatasync (per ``fsync``), then close ``fd``, whatever
        happens. Returns, on a local tier, the file's identity as sealed (trust.sealed_identity,
        Index.committed_file; a network tier's would cost a round trip more per page: its evictions read the
        header instead). ``open_files``: the tier's temporary files open at this close, its own counted (the
        writer's jobs): only a quick close made with :attr:`tmp_files` open counts toward one more.
        :raises OSError: a failed fdatasync is never retried (the data is not sealed); an error from close is
        one too: on a network file system it says the server did not take the data."""
        ran: list[bool] = []
        try:
            sealed = self.calls.run(self._seal, fd, ran)
        except GivenUp:  # (a close that outlasted write_timeout is a slow one: else the tier rejoined with
            self._slow_close()  # as many files open as it failed with, and failed again at its next burst)
            raise
        except OSError:
            if not ran:  # refused at once (an earlier call hung): the descriptor, a file open for writing
                self.calls.post(close_fd, fd)  # (kept for good, and counted by MooseFS's client), closes later
            raise
        if self._close_s > SLOW_CLOSE_S:
            self._slow_close()
        elif not self.local and open_files >= self.tmp_files:  # (one with fewer open says nothing of this count)
            self._quick += 1
            if self._quick >= self.tmp_files:  # (a round of quick closes at this count: one more)
                self.tmp_files, self._quick = min(TMP_FILES_PER_TIER, self.tmp_files + 1), 0
        return sealed

    def _slow_close(self) -> None:
        """A temporary file's close was slow: a network tier keeps half as many open (the writer thread's alone:
        its jobs are the files counted)."""
        if not self.local:
            self._quick, self.tmp_files = 0, max(1, self.tmp_files // 2)

    def place(self, tmp_path: str, key: str, replace: bool = True) -> str:
        """Rename a sealed temporary file into place as the page of ``key`` (:meth:`_place`, bounded): the
        page directory, fsynced by the caller under fsync=full. A full tier may refuse the rename itself (a
        new shard directory or directory block needs room): safe to call again once room is made (the
        writer: Jobs._with_room_under_writer). :raises OSError: the temporary file is left for
        :meth:`discard`."""
        return self.calls.run(self._place, tmp_path, key, replace)

    def _seal(self, fd: int, ran: list[bool]) -> tuple[int, ...] | None:
        ran.append(True)  # (it closes fd, whatever happens)
        try:
            if self.fsync != "never":
                os.fdatasync(fd)
            # (its last write done: its mtime is final. A network tier's would cost a round trip per page)
            sealed = sealed_identity(fd, os.fstat(fd)) if self.local else None
        finally:
            began = time.monotonic()
            err = close_fd(fd)
            self._close_s = time.monotonic() - began
        if err:
            raise OSError(err, f"close: {os.strerror(err)}")
        return sealed

    def room(self, fd: int | None = None, *, read: bool = False, within: float | None = None) -> Room | None:
        """The room on the tier's file system, ``fd``'s file's blocks counted free (a job's own file is
        reused), bounded where the tier may hang (bounded.py); None: cannot tell (an error, a call given up on).
        ``read``: asked for a get, on the tier's read thread within ``within`` s (what is left of its time).
        The one place that asks the file system how much room a tier has."""
        try:
            return self.reads.run(self._room, fd, within=within) if read else self.calls.run(self._room, fd)
        except OSError:
            return None

    def _room(self, fd: int | None) -> Room:
        st = os.statvfs(self.root)
        # what a write can ever get there: the size less the blocks the file system keeps back (ext4's reserve,
        # GlusterFS's storage.reserve: f_bfree - f_bavail); a page between the two evicted every valid page of
        # the tier at its ENOSPC and failed all the same (a GlusterFS volume on a 96 MiB brick)
        self.fs_usable = (st.f_blocks - max(st.f_bfree - st.f_bavail, 0)) * st.f_frsize
        self.fs_bytes = st.f_blocks * st.f_frsize  # (0: a file system that does not say its size; set last: who
        # sees it set sees fs_usable too)
        held = os.fstat(fd).st_blocks * 512 if fd is not None else 0
        return Room(st.f_bavail * st.f_frsize + held, st.f_blocks * st.f_frsize, st.f_favail if st.f_files else None)

    def _place(self, tmp_path: str, key: str, replace: bool = True) -> str:
        """Rename a sealed temporary file into place as the page of ``key`` (creating its shard
        directory); returns the page directory. Without ``replace`` (a catch-up copy) nothing under the
        name is replaced: another writer (another node) may have put its version there since the copy
        looked. Safe to retry after ENOSPC (a new directory or directory block needs room).
        :raises OSError: the temporary file is left in place; FileExistsError: a file has the name."""
        page_dir = self.layout.page_dir(key)
        final = self.layout.page_path(key)
        if page_dir not in self._dirs:
            self._mkdir(page_dir)
        try:
            self._move(tmp_path, final, replace)
        except FileNotFoundError:
            self._dirs.discard(page_dir)  # the shard directory went away (clear): re-create once
            self._mkdir(page_dir)
            self._move(tmp_path, final, replace)
        self._untrack(tmp_path)  # (renamed: no temporary file of this write is left)
        return page_dir

    def _track(self, tmp_path: str) -> None:
        """A temporary file is about to be made on a local tier: the engine's mark is held from before it
        (made by the first of the files in flight) until it is renamed or removed (:meth:`_untrack`)."""
        if not self.local:
            return
        with self._mark_lock:
            if not self._in_tmp and self._mark is None:
                self._mark = hold_mark(self.layout.tmp, self.token, self.file_mode)
            self._in_tmp.add(tmp_path)
            self._mark_idle = False

    def _untrack(self, tmp_path: str) -> None:
        """``tmp_path`` renamed into place or removed (or left for good). The mark stays until the writer has no
        job for the tier (:meth:`release_mark`): dropped at each file's rename, a mark cost a link and an unlink
        a page (single-page puts 5% more CPU on tmpfs)."""
        if not self.local:
            return
        with self._mark_lock:
            self._in_tmp.discard(tmp_path)
            if self._in_tmp or not self._mark_idle or self._mark is None:
                return
            mark, self._mark = self._mark, None  # (a file removed after the writer went idle: a discard posted
        drop_mark(mark)  # to the calls thread, an abandoned write's; else the mark stayed held, idle, for good)

    def release_mark(self) -> None:
        """The writer has no job for this tier: its mark goes unless a temporary file is still in flight."""
        with self._mark_lock:
            self._mark_idle = bool(self._in_tmp)  # (the last of them drops it: _untrack)
            if self._in_tmp or self._mark is None:
                return
            mark, self._mark = self._mark, None
        drop_mark(mark)

    def drop_mark(self) -> None:
        """The engine closed (its writes ended): the mark goes, whatever it still counted (a write left on a
        failed tier): its temporary files left are leftovers from now on."""
        with self._mark_lock:
            self._in_tmp.clear()
            mark, self._mark = self._mark, None
        if mark is not None:
            drop_mark(mark)

    def _move(self, tmp_path: str, final: str, replace: bool) -> None:
        if replace:
            os.rename(tmp_path, final)
            return
        if not link_new(tmp_path, final):
            raise FileExistsError(errno.EEXIST, "a file has the page's name", final)
        self._discard(None, tmp_path)  # (the page is in place: the temporary name, if a link left it, goes)

    def discard(self, fd: int | None, tmp_path: str) -> None:
        """Close (if open) and remove a temporary file; never raises (it runs on error paths). Where it
        cannot go (the tier failed: a FUSE client killed), it goes when the tier answers again, before it
        rejoins (:meth:`_probe`); where the tmp directory is gone, start-up cleaning removes the leftover.
        On a tier that does not answer in time it is done when the tier answers (bounded.py)."""
        self.calls.post(self._discard, fd, tmp_path)

    def _discard(self, fd: int | None, tmp_path: str) -> None:
        if fd is not None:
            close_fd(fd)  # (an error on close: the data is being thrown away anyway)
        try:
            remove(self.root, tmp_path, self.trust, is_engine_tmp)
        except OSError:
            with self._lock:
                if len(self._leftovers) < MAX_LEFTOVERS:
                    self._leftovers.add(tmp_path)
        self._untrack(tmp_path)  # (a leftover kept for its rejoin is no write in flight)

    def clear(self) -> None:
        """Remove this namespace's page files from the tier (Engine.clear). A failed tier is not
        touched now: it removes them when it rejoins, before it serves again (:meth:`usable`), as does
        one that fails during the clear. (Written down too, so a restart does not forget it: owed.py.)"""
        with self._lock:  # (counted and judged under the lock a rejoin turns healthy under)
            self._clears += 1
            self._clear_ns = wall_ns()  # (after every header this process stamped)
            failed = not self.healthy
        if failed:
            log.warning("kvstream: tier %d (%s) is failed: clear() removes the pages written before it when it "
                        "rejoins, before it serves again", self.k, self.root)
        else:
            self._remove_pages(owed=False)

    def owe_delete(self, key: str, evicted: tuple[Callable, Callable] | None = None) -> None:
        """A delete() of ``key`` this tier, failed, may not have done: its file, left, would be found again
        by a lookup once the tier is back and served. Done before it serves again (:meth:`_probe`), as a
        clear() it missed. (Kept in memory only: a restart forgets it; the page a delete leaves is valid.)
        ``evicted``: an eviction (Engine.evict), with :meth:`evict_page`'s judges: the file goes only while
        it is this process's copy (as a delete, another process's page written under the name before the
        eviction went, the page of another node LMCache's eviction here must leave)."""
        with self._lock:
            owed = self._deletes.pop(key, None)  # (to the newest end: the oldest go first, below)
            if evicted is not None and owed is not None and owed[1] is None:  # a delete owed already stays: it
                self._deletes[key] = owed  # removes more (this process writes nothing to a failed tier)
            else:  # (the time after every header this process stamped: trust.wall_ns)
                self._deletes[key] = (wall_ns(), evicted)
            if len(self._deletes) <= MAX_OWED_DELETES:
                return
            # Bounded: an outage of days with LMCache deleting as it evicts grew one entry per key, and one
            # header read each before the tier served again. A page whose delete is forgotten may be found
            # again once the tier is back: still a valid page of its key (a clear, which stale KV needs, is
            # owed whole: owed.py), and the next eviction takes it.
            del self._deletes[next(iter(self._deletes))]
            self._deletes_forgotten += 1
            if self._deletes_forgotten > 1:
                return
        log.warning("kvstream: tier %d (%s) is failed and has missed over %d delete()s: the oldest are forgotten, "
                    "and their pages (valid ones) may be found again once it is back", self.k, self.root,
                    MAX_OWED_DELETES)

    def _deletes_owed(self) -> bool:
        """A failed tier about to rejoin: the deletes it missed are done (:meth:`_remove_if_older`).
        False: a look or a removal failed for a tier error: it stays out."""
        with self._lock:
            owed, errors = dict(self._deletes), self._errors
        for key, entry in owed.items():
            if self.closed:  # (a settle thread of a closed engine: see _remove_pages)
                return False
            when, evicted = entry
            if evicted is None:
                self._remove_if_older(self.layout.page_path(key), when)
            else:
                self.evict_page(key, *evicted)
            if self._errors != errors:
                return False
            with self._lock:
                if self._deletes.get(key) is entry:  # (not deleted again meanwhile)
                    del self._deletes[key]
        return True

    def _remove_if_older(self, path: str, when: int, old: Callable[[os.stat_result], bool] | None = None) -> bool:
        """What a failed tier owes for the page file at ``path`` (a delete() or clear() at ``when``,
        trust.wall_ns) done as it rejoins: the file removed only if written before then (its header's
        ``created``): on a shared tier another process or node may have put the key since, and that
        acknowledged page stays. (The clocks of two nodes are compared: NTP's milliseconds decide only for
        a put that came that close to the delete; a clear leans to removal by CLEAR_SKEW_NS: _remove_pages.
        A clock stepped back between them may take another process's page: a cached page lost, never a
        wrong one served: trust.wall_ns.) ``old``: a first judge by the file's own times
        (:meth:`_older_than`), which spares the header read of a page written well before; a page it
        finds recent is never moved (another node may rename a new version over it meanwhile). Returns
        whether it stays: written after; not kvstream's (another owner's, one this user cannot read: as a
        delete leaves it); no valid page (for the scan or a read to judge). A later format's page (NewerFormat)
        is judged by its file's times alone, on the tier's clock. A stray that is no regular file
        goes; a look that fails: :meth:`_look_failed`."""
        if old is not None:
            try:
                st = self.calls.run(os.lstat, path)
            except OSError as exc:
                return self._look_failed(exc, path)
            if old(st):  # (that file only, should another writer's have taken the name since: trust.remove)
                return self._remove(path, same_file(identity(st))) is not None
        try:
            fd, header, st = self.calls.run(open_with_header, path, self.trust)
            try:  # (held open till the removal: the inode judged cannot be freed and handed to another
                # page meanwhile, of one size and timestamp: trust.pin; a time past honest_until is a claim,
                # not a time: the file goes)
                if not when <= header.created_ns <= honest_until():
                    return self._remove(path, same_file(identity(st))) is not None
            finally:
                close_fd(fd)
        except UntrustedFile:  # (another owner's: a delete leaves it)
            pass
        except NotRegularFile:  # a socket, a FIFO, ...: a stray under the page's name goes
            return self._remove(path, not_a_file) is not None
        except NewerFormat:  # a later format's page: its write time is in a header this version cannot read, so
            # its file's tells (docs/design.md "On-disk format"): one modified well before goes, as the delete
            # or clear removes it on a healthy tier (an owed delete left it: the newer node served a deleted key)
            if old is None and (old := self._older_than(when)) is not None:  # (a clear's judged it recent above)
                try:
                    st = self.calls.run(os.lstat, path)
                except OSError as exc:
                    return self._look_failed(exc, path)
                if old(st):
                    return self._remove(path, same_file(identity(st))) is not None
        except HeaderError:
            pass
        except OSError as exc:
            return self._look_failed(exc, path)
        return True

    def evict_page(self, key: str, mine_file: Callable[[tuple[int, ...] | None, int], bool],
                   mine: Callable[[int, int], bool]) -> bool:
        """An eviction: remove ``key``'s page file only while it is this process's copy. Another process of the
        namespace may have removed this one's copy since (its eviction, a delete) and written its own under the
        name (two servers of one model share prefixes, their KV often the same bytes): that is its live page,
        and stays (before, the eviction removed it). On a local tier ``mine_file(identity, changed)``
        (Index.mine_file) may tell this process's own file by its stat alone (trust.sealed_identity; changed:
        the later of its mtime and ctime; a network tier's times are its server's clock); else its header does:
        ``mine(writer_ns, mtime)`` (Index.mine). A file that is no valid page goes, as any eviction's unlink took
        it; a later format's page stays. One look beyond the unlink (trust.unlink_unless; the header only where
        the stat does not tell): docs/benchmarks.md. Returns whether the file stays."""
        def stays(fd: int, st: os.stat_result) -> str | None:
            if self.local and mine_file(sealed_identity(fd, st), max(st.st_mtime_ns, st.st_ctime_ns)):
                return None
            try:
                header = unpack_header(os.pread(fd, HEADER_SIZE, 0))
            except NewerFormat:
                return "a later format's page"
            except HeaderError:
                return None
            if mine(header.writer_ns, st.st_mtime_ns):
                return None
            return "another process's page, written under the name since"

        path = self.layout.page_path(key)
        try:
            return self.calls.run(unlink_unless, self.root, path, self.trust, stays) is not None
        except OSError as exc:
            return self._look_failed(exc, path)

    def marked_at(self, key: str) -> int | None:
        """When another process of the namespace last marked ``key``'s page file used (:meth:`mark_used`; wall
        clock, ns): this one's eviction spares it if that came after its own last use (Index.spare). None
        where it cannot tell (no mark, gone, the tier failed to answer: the eviction goes on as before)."""
        return self._hint(key, "look at {}'s use mark", marked_below)

    def mark_used(self, key: str) -> int | None:
        """Mark ``key``'s page file used now (its access time: trust.mark_below), for its writer, another
        process of the namespace (:meth:`marked_at`): the time marked. None: not marked (gone, another user's
        file, the tier failed to answer): a hint, never a failure of its own."""
        return self._hint(key, "mark {} used", lambda path: mark_below(self.root, path))

    def _hint(self, key: str, what: str, call: Callable[[str], int | None]) -> int | None:
        """``call(path)`` of ``key``'s page file as a bounded call; a failure is None (_hint_failed: ``what``)."""
        path = self.layout.page_path(key)
        try:
            return self.calls.run(call, path)
        except OSError as exc:
            self._hint_failed(exc, what.format(path))
            return None

    def _hint_failed(self, exc: OSError, what: str) -> None:
        """A use mark's call (or its look) failed with ``exc``: a hint lost, but a call that outlasted
        write_timeout (or met one out longer: ETIMEDOUT, bounded.py) fails the tier as any bounded call does,
        so the next caller skips it (review of 05fc333: the mark's caller, SGLang's backup thread, waited
        write_timeout and the hung tier stayed healthy, for the next look to wait again)."""
        if exc.errno == errno.ETIMEDOUT:
            self.fail(errno.ETIMEDOUT, what)

    def _look_failed(self, exc: OSError, path: str) -> bool:
        """A removal's look at ``path`` failed (:meth:`_remove_if_older`, :meth:`evict_page`): whether something
        stays there (a file this user cannot read); a gone copy is none; anything else fails the tier."""
        if exc.errno in (errno.EACCES, errno.EPERM):  # one file this user cannot read (root's, left
            return True  # by an operator): it stays, as a delete leaves another owner's; never served
        if not isinstance(exc, FileNotFoundError) and not self.copy_gone(exc.errno, path):  # (gone already)
            self.fail(exc.errno or errno.EIO, f"look at {path} to remove it")
        return False

    def _do_owed_clear(self) -> bool:
        """A failed tier about to rejoin: the clear()s it missed are done (now, if owed). False: it
        failed again on the way (a listing or a removal): it stays out."""
        return not self.clear_owed or self._remove_pages(owed=True)

    def _remove_pages(self, owed: bool) -> bool:
        """Remove this namespace's page files from the tier, as a delete removes one (trust.py: only
        a file the engine names, of a trusted owner, reached following no link). Another owner's
        file, a link, a directory and a name kvstream never writes stay, logged (``kvstream check``
        lists them); so do the shard directories, which the next writes use again. A page a removal
        holds under its private name (trust.remove: of this or another node, maybe cut short by a crash)
        goes too: the scan would put it back. ``owed``: a clear() the tier missed while failed, which
        removes only the pages written before it (judged by the file's time, and where that is close, its
        header: :meth:`_remove_if_older`), leaning to removal by CLEAR_SKEW_NS, as far as the nodes'
        clocks may differ: a page of the old weights is never served; another node's put in the minutes
        after the clear may be lost. Returns whether it went through every shard with no tier error (then
        the clears asked so far are done)."""
        with self._lock:
            asked, errors, until = self._clears, self._errors, self._clear_ns + CLEAR_SKEW_NS
        old = self._older_than(until) if owed else None
        kept = newer = 0
        try:  # (listings bounded as every call on a tier that may hang: clear() holds every get and put)
            names = self.calls.run(shards, self.layout)
        except OSError as exc:  # a link or a file (ELOOP, ENOTDIR): nothing of ours is there; EIO and
            names = []  # the like (ETIMEDOUT: hung) fail the tier, which then removes its pages when it rejoins
            self.fail(exc.errno or errno.EIO, f"list {self.layout.pages} to clear it")
        for shard in names:
            if self._errors != errors or self.closed:  # a removal failed for an I/O error: the tier is out;
                return False  # or its engine closed (a settle thread: another engine may own the tier now)
            try:
                entries = self.calls.run(shard_entries, self.layout, shard)
            except OSError as exc:
                self.fail(exc.errno or errno.EIO, f"list {shard} to clear it")
                return False
            for name, path in entries:
                if self.closed:
                    return False
                key = key_of_page_file(name) if name else None
                held = name is not None and name.startswith(REMOVING_PREFIX)
                if (key is None or key[:2] != shard) and not held:  # (misplaced: stays)
                    kept += 1
                elif owed:
                    newer += self._remove_if_older(path, until, old)
                elif self._remove(path) is not None:
                    kept += 1
        if kept:
            log.warning("kvstream: clear left %d entries of tier %d (%s) in place: not kvstream's page files "
                        "(another owner's, a link, a directory or a stray; kvstream check lists them)",
                        kept, self.k, self.layout.pages)
        if newer:
            log.warning("kvstream: the clear tier %d (%s) missed while failed left %d files in place: pages "
                        "written after it (by another process or node), or not kvstream's", self.k, self.root, newer)
        # its tree away (moved, unmounted): nothing of it was reached, the clear is owed as for a failed
        # tier (fail() takes ENOENT only where the tier is gone)
        self.fail(errno.ENOENT, f"clear {self.layout.pages}: the tier's directory is gone")
        with self._lock:
            if self._errors != errors:
                return False
            self._cleared = max(self._cleared, asked)
            return True

    def _older_than(self, when: int) -> Callable[[os.stat_result], bool] | None:
        """A judge of a page file modified well before ``when`` (trust.wall_ns), on the tier's clock
        (tmpfiles.tier_now: on NFS the server's; on GlusterFS each writer stamps its own, as it stamps a
        header): an owed clear removes such a page without reading its header (which doubled the time
        it took on a disk tier); a page modified in the last MTIME_SLACK_NS before ``when`` or after it
        has its header read. None: the tier's clock cannot be read (every header is read)."""
        try:
            now = self.calls.run(tier_clock, self.layout)  # (through no link: tmp/ may be one by now)
        except OSError:
            now = None
        if now is None:
            return None
        cutoff = when + int(now * 1e9) - time.time_ns() - MTIME_SLACK_NS
        return lambda st: st.st_mtime_ns < cutoff

    def unlink_page(self, key: str, judged: Callable[[os.stat_result], bool] | None = None) -> str | None:
        """Remove ``key``'s page file (only a file of a trusted owner, through its directory; with ``judged``
        only the entry judged damaged: trust.remove). Returns None when it is gone (or was already:
        another rank, an operator), else why it stays."""
        return self._remove(self.layout.page_path(key), judged)

    def _remove(self, path: str, judged: Callable[[os.stat_result], bool] | None = None) -> str | None:
        """:meth:`unlink_page` of the entry at ``path`` (a page's name, or a removal's private name)."""
        try:
            return self.calls.run(remove, self.root, path, self.trust, None, judged)
        except OSError as exc:
            if self.copy_gone(exc.errno, path):  # (gone: removed concurrently, by another rank or node)
                return None
            self.fail(exc.errno or errno.EIO, f"remove {path}")
            return f"could not remove it ({os.strerror(exc.errno or errno.EIO)})"

    def sync_dirs(self, dirs: set[str]) -> None:
        """fsync=full: make renames durable (the page directories and the tmp directory).
        :raises OSError: (ETIMEDOUT: the tier did not answer in time)"""
        self.calls.run(self._sync_dirs, dirs)

    def _sync_dirs(self, dirs: set[str]) -> None:
        for d in (*dirs, self.layout.tmp):
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                close_fd(fd)

    def _mkdir(self, path: str) -> None:
        """Create ``path`` (and missing parents below ``<tier>/kvstream``) with the tier's mode."""
        if path in self._dirs:
            return
        if not path.startswith(self.layout.base) or self.gone():
            raise FileNotFoundError(errno.ENOENT, f"{self.layout.base} is missing", self.layout.base)
        parent = os.path.dirname(path)
        if parent != self.layout.base and not os.path.isdir(parent):
            self._dirs.discard(parent)  # (made once, removed since: rm -rf <tier>/kvstream/*)
            self._mkdir(parent)
        try:
            os.mkdir(path, self.dir_mode)  # (no descriptor: a put that is short of them still commits)
        except FileExistsError:  # made by another writer (or ours before): checked once, as at start-up
            check_dir(path, self.trust)
        else:
            if self.shared:  # the umask may have cleared the group bits: set them on the directory made,
                self._set_mode(path)  # through its descriptor, never through a link put at its name since
        self._dirs.add(path)

    def _set_mode(self, path: str) -> None:
        """The tier's mode on the directory just made at ``path``, if it still is a directory of ours.
        :raises OSError: ELOOP/ENOTDIR: a link or a file took its place; NotADirectoryError: another's."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            why = self.trust.dir_problem(st)
            if why is not None:
                raise NotADirectoryError(errno.ENOTDIR, f"{path} {why} ({describe(st)})", path)
            os.fchmod(fd, self.dir_mode)
        finally:
            close_fd(fd)

    def __repr__(self) -> str:
        return f"Tier({self.k}, {self.root!r}, {'healthy' if self.healthy else 'failed'})"


def base_identity(st: os.stat_result) -> tuple[int, int, int, bool]:
    """What tells the tier's checked ``kvstream/`` (its ``lstat``) from what may take its name after a
    purge: device, inode, owner (an inode number freed by the purge may be reused at once) and whether
    it is a directory (a link is not)."""
    return st.st_dev, st.st_ino, st.st_uid, stat.S_ISDIR(st.st_mode)


def mount_point(path: str) -> str:
    """The mount point of the file system holding ``path``."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path
