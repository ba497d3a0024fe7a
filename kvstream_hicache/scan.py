"""The start-up scan, in the background: an engine serves at once, and learns its tiers as it goes.

Until the scan of a tier ends, a page written before the restart is found on its first lookup
(discovery, engine.py: one header read, verified as the scan would); the scan itself, one thread per
tier, walks that tier's shard directories and:

- removes stale temporary files (crashed writers'), as the foreground scan did, one entry of the
  tmp directory at a time, each paced as a page file (another user may have left millions there);
- reads each page file's header (a shard one entry at a time, as tmp/) and indexes the valid pages
  the index does not know yet (``Index.add_scanned``: at the oldest end, so a page used since start
  stays more recent);
- removes damaged, truncated and misplaced files, after reading them a second time (a writer may
  have renamed a valid page over the name since the first read: a valid page is never deleted), and
  only the very file judged then, held open from before (integrity.judge_and_fix: one renamed over it
  since stays);
- counts, and leaves, the pages of a later format (integrity.NewerFormat: a newer kvstream's, on a
  tier shared across an upgrade): not indexed, never removed;
- at the end, sorts the pages it found by write time (``Index.settle``: the write order of before the
  restart; reads leave nothing on disk) and trims a tier over its capacity (one lowered since the last run, or
  a tier other processes filled too).

When every tier is scanned, ``done()`` runs (the engine's: background replication then owes each
tier the pages it lacks, replication.py; only then is it known what a tier lacks).

A tier that fails during its scan ends it (its tree is unusable meanwhile). When it is back, the
engine's next call that may look a key up (``Engine._discover``), or a wait for the scan (``check()``),
has it scanned on (:meth:`BackgroundScan.resume`),
from the shard it was reading when it failed, on a thread of its own paced as the start-up scan: the
scan is not done until that ends (discovery stays on, whatever the ``discover`` setting, and
``done()`` runs again at its end). Else the pages it had not read were never indexed: with
``discover=0`` never found again, with discovery found but never counted against the capacity.

Its cost is bounded, for a shared file system many servers restart against at once: at most
``scan_rate`` page files a second per tier (each an open, one 4 KiB read, a close), and at most
``scan_cpu`` of a core per tier thread (it sleeps to stay within both). While it reads, it takes no lock a
request waits on: only the index's, one page (or one chunk of the final sort) at a time; a trim at its end
(a tier over its capacity) takes the writer's, as a put's eviction does (WritePath.trim). Until it is done,
capacity eviction works from the pages known (those written, read or scanned so far), and
``progress()`` (``Engine.stats()["scan"]``, ``Engine.scan``) says so. For ``kvstream info`` (another
process) the progress is also written, at most once a second, to this user's file
``<runtime dir>/kvstream-<uid>/scan-<pid>-<digest>.json`` on this host (removed at close; one whose
process is gone, killed, is removed by the next ``kvstream info`` or the next engine's start: :func:`running_scans`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence

from .config import Capacity
from .index import RETRY, Index
from .integrity import (
    Reason, ScannedPage, each_shard_entry, each_tmp_problem, judge_and_fix, restored, scan_entry, shards,
)
from .layout import key_of_page_file
from .locks import ranked_lock
from .tiers import Tier
from .tmpfiles import local_writer_alive, pid_namespace, started
from .trust import DIR_FLAGS, LOOK_FLAGS

log = logging.getLogger("kvstream")

PROGRESS_S = 1.0  # the progress file (kvstream info) is rewritten at most this often, s
PROGRESS_MAX = 1 << 20  # a progress file longer than this is none (kvstream info reads it whole)
PROGRESS_TMP_S = 60.0  # a progress file's temporary one older than this is no write in flight (_publish renames it)
_PROGRESS_TMP = re.compile(r"scan-\d+-[0-9a-f]+\.json\.\d+\.tmp")  # its name (_publish)
NAP_S = 0.25  # longest sleep between two looks at the limits (set_limits, stop)
RETRIES = 3  # reads of one file while removals of keys like its own race the scan
KEPT_LOGGED = 10  # entries a tier's scan must leave (another user's files, strays) logged one by one; the rest counted


class TierScan:
    """Progress of one tier's scan (written by its thread, read by ``progress``)."""

    def __init__(self, tier: Tier):
        self.tier = tier
        self.files = self.indexed = self.damaged = self.tmp = self.kept = self.newer = 0
        self.shards = self.shards_done = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.done = False
        self.stopped = ""  # why it ended before its last file, if it did
        # the tier failed during the scan: the shard to scan on from once it is back (resume); else None
        self.resume_at: str | None = None
        # every shard of the tier was listed (its scan went through them all, a resumed one included): a
        # page file found there after was not there then (BackgroundScan.listed). Never set for a tier
        # whose scan stopped when it failed (nor one that did not answer at start-up) until its scan resumed
        # and ended: the shards not listed hold pages of before the restart, this process's to count
        self.listed = False
        # payload bytes of the pages it indexed that count against the tier's capacity (not another process's):
        # over the capacity alone, the capacity is below what the last run held (the trim's warning)
        self.found_bytes = 0


def index_found(index: Index, k: int, page: ScannedPage, epoch: int, mark: int, versions: bool = True,
                since: bool = False) -> int:
    """Index a valid page file found on tier ``k``, read after ``mark`` (Index.mark) by a look that began
    in index ``epoch``, as the scan does (Index.add_scanned: at the oldest end, unless the index knows
    better; ``versions=False``: never another version than the indexed one; ``since``: the look began once
    the scan had listed every tier). Returns add_scanned's answer (a slot, -1, RETRY)."""
    h = page.header
    return index.add_scanned(h.key, k, h.length, h.block, h.crcs, h.length, h.created_ns, epoch, mark, versions,
                             (h.writer_ns, page.mtime_ns), since)


class BackgroundScan:
    """One scan thread per tier over ``tiers`` for the namespace ``digest``.

    :param rate: page files per second per tier (0: unbounded).
    :param cpu: share of one core per tier thread, (0, 1] (1: unbounded).
    :param level: of the line each tier's scan logs when done (the engine's start-up line's).
    :param trim: ``trim(k)`` evicts and removes tier ``k``'s least recent pages beyond its capacity
        (the engine does it as its writer would, behind writes in progress).
    :param done: called once, on the last scan thread, when every tier's scan has ended (also one
        that stopped early), with no lock held.
    """

    def __init__(self, tiers: Sequence[Tier], index: Index, digest: str, rate: float, cpu: float,
                 trim: Callable[[int], int], level: int = logging.INFO,
                 done: Callable[[], None] = lambda: None):
        self.index = index
        self.level = level
        self.digest = digest
        self.rate = rate
        self.cpu = cpu
        self.trim = trim
        self.on_done = done
        self.epoch = index.epoch
        self.parts = [TierScan(t) for t in tiers]
        self._stop = threading.Event()
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(part,), name=f"kvstream-scan-{part.tier.k}",
                                          daemon=True) for part in self.parts]
        self._left = len(self._threads)
        self._lock = ranked_lock("scan")
        self.unfinished = 0  # tiers (bitmask) whose scan ended when the tier failed: resumed when it is back
        self._written = 0.0  # when the progress file was last written (monotonic)
        self.progress_path = os.path.join(progress_dir(), f"scan-{os.getpid()}-{digest}.json")

    def start(self) -> None:
        # The files of engines whose process is gone: an SGLang scheduler is killed at shutdown, its engine
        # never closed (close_at_exit off), so each start left its file for good unless `kvstream info` ran
        running_scans()
        for thread in self._threads:
            thread.start()
        if not self._threads:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def listed(self, k: int) -> bool:
        """Tier ``k``'s scan has listed every shard of it: a page file found there now was not there then
        (Index._theirs ``since``). Per tier, not :attr:`done`: a tier whose scan stopped when it failed
        ends the scan too, its shards not read yet holding pages of before the restart (lock-free: set once)."""
        return self.parts[k].listed

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every tier is scanned (a tier back whose scan stopped when it failed: resumed
        first); True when it is."""
        self.resume()
        return self._done.wait(timeout)

    def wait_healthy(self) -> None:
        """Wait until every healthy tier is scanned (check()): a failed tier's scan is not waited for, for
        one that hung may be in a call that never returns (its tier failed by a bounded call meanwhile)."""
        while not self.wait(NAP_S):
            if all(part.done or not part.tier.healthy for part in self.parts):
                return

    def stop(self, timeout: float) -> None:
        """Stop between two files (close, clear); wait up to ``timeout`` s for the threads."""
        self._stop.set()
        end = time.monotonic() + timeout
        with self._lock:  # (no resume starts one once stopped)
            threads = list(self._threads)
        for thread in threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(max(0.0, end - time.monotonic()))
        with self._lock:  # after a _publish in progress (it writes nothing once stopped)
            try:
                os.unlink(self.progress_path)
            except OSError:  # never written, or /tmp cleaned: nothing to remove
                pass

    def resume(self) -> None:
        """Scan on each tier whose scan ended because it failed and that is healthy again (back: its
        index reconciled by the rejoin, engine._forget_lost): the pages of the shards not read yet are
        indexed only by its scan. A thread of its own, from the shard it was reading when it failed
        (every shard before it was read whole), paced as the start-up scan; the scan is not done until
        it ends. Not after a ``clear()`` (the tier's pages were removed) nor ``stop()``. Called by every
        engine call that may look a key up (Engine._discover) and by :meth:`wait` (check()): whatever
        found the tier back (a probe, a get's forced one), the next of those resumes its scan."""
        if not self.unfinished:
            return
        with self._lock:
            for part in self.parts:
                k = part.tier.k
                if not (self.unfinished >> k & 1 and part.tier.healthy):
                    continue
                self.unfinished &= ~(1 << k)  # (set by its last thread as it ended: none runs now)
                if self._stop.is_set() or self.index.epoch != self.epoch:
                    continue
                log.warning("kvstream: tier %d is back: its background scan, stopped when it failed, goes on "
                            "from shard %s", k, part.resume_at or "(the first)")
                part.done, part.stopped, part.shards_done = False, "", 0
                self._left += 1
                self._done.clear()
                thread = threading.Thread(target=self._run, args=(part,), name=f"kvstream-scan-{k}", daemon=True)
                self._threads.append(thread)
                thread.start()

    def set_limits(self, rate: float, cpu: float) -> None:
        """Change ``scan_rate`` and ``scan_cpu`` of the scan running (takes effect within NAP_S)."""
        self.rate, self.cpu = rate, cpu

    def progress(self) -> dict:
        parts = self.parts
        seconds = max((p.seconds for p in parts), default=0.0)
        files = sum(p.files for p in parts)
        return {
            "done": self.done,
            "eviction": ("from the pages known so far (the scan is running)" if not self.done else
                         "from the pages known (the scan of a failed tier stopped)" if any(p.stopped for p in parts)
                         else "exact LRU"),
            "files": files, "indexed": sum(p.indexed for p in parts), "pages": len(self.index),
            "damaged_removed": sum(p.damaged for p in parts), "tmp_removed": sum(p.tmp for p in parts),
            "kept": sum(p.kept for p in parts), "newer_format": sum(p.newer for p in parts), "seconds": seconds,
            "cpu_seconds": sum(p.cpu_seconds for p in parts),
            "rate": files / seconds if seconds > 0 else 0.0,
            "tiers": [{"shards": p.shards, "shards_done": p.shards_done, "files": p.files, "done": p.done,
                       "stopped": p.stopped} for p in parts],
        }

    # -- the thread of one tier ----------------------------------------------------------------
    def _run(self, part: TierScan) -> None:
        try:
            self._scan_tier(part)
        except Exception:  # never raise in a thread of ours: the engine serves on, from what it knows
            log.exception("kvstream: background scan of tier %d (%s) stopped", part.tier.k, part.tier.root)
        finally:
            part.done = True
            with self._lock:
                if part.resume_at is not None:
                    self.unfinished |= 1 << part.tier.k
                self._left -= 1
                last = not self._left
            if last:
                try:
                    if not self._stop.is_set():
                        self.on_done()
                except Exception:  # (as above)
                    log.exception("kvstream: the end of the background scan")
                with self._lock:  # (after on_done: who waits for the scan finds catch-up's work owed)
                    if not self._left:  # (else a tier's scan resumed meanwhile: done when that ends)
                        self._done.set()
            self._publish(force=True)

    def _scan_tier(self, part: TierScan) -> None:
        tier, layout = part.tier, part.tier.layout
        w0, c0 = time.monotonic() - part.seconds, time.thread_time() - part.cpu_seconds  # (a resumed scan adds)
        at, part.resume_at = part.resume_at or "", None  # the shard being read (a resumed scan's first)
        if tier.trust is None and self._failed(part, at):  # did not answer at start-up: scanned once it is back
            return
        pace = _Pace(self)  # a directory listing counts as one file
        pace.step()

        def step() -> bool:  # each entry of tmp/ counts as a file (another user may have put millions there)
            pace.step()
            return not (self._stop.is_set() or self.index.epoch != self.epoch)

        try:
            for problem in each_tmp_problem(tier.root, layout.tmp, None, True, tier.trust, step):
                if problem.fixed:
                    part.tmp += 1
                else:
                    self._kept(part, problem)
        except OSError as exc:  # (EIO, EACCES listing tmp/): its leftovers wait for the next start; the pages don't
            part.kept += 1
            log.warning("kvstream: background scan of tier %d: %s unreadable: %s; going on with the pages", tier.k,
                        layout.tmp, os.strerror(exc.errno or 0))
        if self._stop.is_set() or self.index.epoch != self.epoch:
            return
        pace.step()
        try:
            names = shards(layout)
        except OSError as exc:  # the namespace directory is a link or a file (never followed: trust.py),
            names = []  # or the tier failed as it was listed (EIO, ...): then its scan goes on once it is back
            tier.fail(exc.errno or errno.EIO, f"list {layout.pages}")
            if not self._failed(part, at):  # (a resumed scan keeps the shard it goes on from)
                part.stopped = f"namespace directory unusable: {os.strerror(exc.errno or 0)}"
                log.warning("kvstream: background scan of tier %d: %s: %s", tier.k, layout.pages, part.stopped)
        part.shards = len(names)
        added = array("i")
        for shard in names:
            if shard < at:  # read whole before the tier failed (this is its scan resumed)
                part.shards_done += 1
                continue
            if self._failed(part, at):
                break
            at = shard
            pace.step()
            for name, path in self._entries(part, shard):
                if self._stop.is_set() or self.index.epoch != self.epoch:
                    return
                pace.step()
                part.files += 1
                page = self._visit(part, shard, name, path, added)
                if page.problem is not None and page.problem.reason is Reason.NEWER:
                    part.newer += 1  # (another version's valid page: logged once, at the end)
                elif page.problem is not None and page.problem.reason is not Reason.VANISHED:
                    # a writer may have put a valid page under the name since: read it again first (a
                    # valid one is indexed), and remove only the very file judged then (judge_and_fix)
                    page, problem = judge_and_fix(path, lambda: self._visit(part, shard, name, path, added),
                                                  tier.trust)
                    back = restored(page._replace(problem=problem)) if problem is not None else None
                    if back is not None:  # (indexed now: the listing may never name it)
                        log.warning("kvstream: background scan of tier %d: %s", tier.k, problem.detail)
                        self._visit(part, shard, os.path.basename(back.path), back.path, added)
                    elif problem is not None and problem.fixed:
                        part.damaged += 1
                    elif problem is not None:
                        self._kept(part, problem)
            part.shards_done += 1
            part.seconds, part.cpu_seconds = time.monotonic() - w0, time.thread_time() - c0
            self._publish()
        if not self._failed(part, at):  # (a stop or a clear returned above)
            part.listed = True  # (before the settle and the trim: every file listed is indexed now)
        self.index.settle(tier.k, added, self.epoch)
        trimmed = self.trim(tier.k)
        if trimmed and tier.capacity is not None and part.found_bytes > tier.capacity:  # (an operator lowered
            # the capacity, or other processes filled a tier they share: the pages that go are said once, with the
            # setting; the scan cannot tell the two apart, and a shared tier's other writer was never told)
            log.warning("kvstream: tier %d (%s) held more than its capacity of %s (setting capacity, "
                        "KVSTREAM_CAPACITY): evicted its %d least recent pages. Either the capacity was lowered since "
                        "the last run, or other processes put pages on this tier too (a restart counts every page "
                        "it finds, docs/guarantees.md \"Capacity is per process\": give each the tier's room "
                        "divided by their number)", tier.k, tier.root, Capacity(tier.capacity), trimmed)
        elif trimmed:  # (within it, the last run's pages and the puts served before the scan listed them are
            # not: the usual LRU eviction, late; named the setting, a busy server's every restart blamed it)
            log.log(self.level, "kvstream: tier %d: the background scan evicted its %d least recent pages (pages "
                    "written since the start, before the scan listed the tier's, took their room)", tier.k, trimmed)
        part.seconds, part.cpu_seconds = time.monotonic() - w0, time.thread_time() - c0
        if part.damaged or part.tmp:
            log.warning("kvstream: background scan of tier %d removed %d damaged page files and %d temporary "
                        "leftovers", tier.k, part.damaged, part.tmp)
        if part.kept > KEPT_LOGGED:
            log.warning("kvstream: background scan of tier %d left %d entries in place (the first %d logged above: "
                        "files of owners it does not trust, strays, files it could not read); `kvstream check` "
                        "lists them all", tier.k, part.kept, KEPT_LOGGED)
        if part.newer:
            log.warning("kvstream: background scan of tier %d left %d pages of a later format than this kvstream's "
                        "(a newer version's, on a tier shared during an upgrade): never served nor removed by this "
                        "one; upgrade it to serve them", tier.k, part.newer)
        log.log(self.level, "kvstream: background scan of tier %d done: %d files read, %d pages added in %.1f s "
                "(%.1f CPU s)", tier.k, part.files, part.indexed, part.seconds, part.cpu_seconds)

    @staticmethod
    def _entries(part: TierScan, shard: str) -> Iterator[tuple[str | None, str]]:
        """The entries of one shard, one at a time (integrity.each_shard_entry: another user may leave
        millions of files in a shard; before, a list of them all was held while it was read). An error
        listing it ends them: the tier's (it fails, logged once: its scan goes on from this shard once it
        is back), or this shard's alone (counted and logged: its pages are found by discovery)."""
        tier = part.tier
        try:
            yield from each_shard_entry(tier.layout, shard)
        except OSError as exc:
            if tier.fail(exc.errno or errno.EIO, f"list shard {shard}"):
                return
            part.kept += 1
            log.warning("kvstream: background scan of tier %d: shard %s unreadable: %s", tier.k, shard,
                        os.strerror(exc.errno or 0))

    @staticmethod
    def _failed(part: TierScan, at: str = "") -> bool:
        """The tier failed: its scan ends (a failed tier's tree is unusable; when it rejoins, the engine
        reconciles the index with what survived, and :meth:`resume` scans on from ``at``, the shard
        being read: it failed during that one, maybe read only in part)."""
        tier = part.tier
        if tier.healthy or part.stopped:
            return bool(part.stopped)
        part.stopped = f"tier failed: {tier.last_error}"
        part.resume_at = at
        log.warning("kvstream: background scan of tier %d stopped after %d files: the tier failed", tier.k, part.files)
        return True

    def _visit(self, part: TierScan, shard: str, name: str | None, path: str, added: array) -> ScannedPage:
        """Read one entry and index it when it is a valid page the index lacks. A copy of a key
        like it that left the index meanwhile (evicted, removed as damaged) may be this very file,
        deleted since it was read: then it is read again (a few times, then left to discovery)."""
        key = key_of_page_file(name) if name else None
        tier = part.tier
        for _ in range(RETRIES):
            mark = self.index.mark(key) if key else 0
            page = scan_entry(tier.layout, self.digest, shard, name, path, trust=tier.trust)
            if page.problem is not None:
                return page
            slot = index_found(self.index, tier.k, page, self.epoch, mark)
            if slot != RETRY:
                if slot >= 0:
                    added.append(slot)
                    part.indexed += 1
                    if not self.index.is_theirs(page.header.key, tier.k):
                        part.found_bytes += page.header.length
                return page
        return page

    def _publish(self, force: bool = False) -> None:
        """Write the progress file (atomically: a reader never sees half of it); best effort."""
        with self._lock:
            now = time.monotonic()
            if self._stop.is_set() or not force and now - self._written < PROGRESS_S:
                return
            self._written = now
            doc = dict(self.progress(), pid=os.getpid(), started=started(os.getpid()), pidns=pid_namespace(),
                       namespace=self.digest, tier_dirs=[p.tier.root for p in self.parts])
            try:
                where = os.path.dirname(self.progress_path)
                os.makedirs(where, mode=0o700, exist_ok=True)
                if os.lstat(where).st_uid != os.getuid():  # made by someone else: not ours to write in
                    return
                tmp = f"{self.progress_path}.{threading.get_ident()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, self.progress_path)
            except OSError as exc:  # a full or read-only /tmp costs the report, never the scan
                log.debug("kvstream: scan progress file %s: %s", self.progress_path, exc)

    @staticmethod
    def _kept(part: TierScan, problem) -> None:
        """What the scan could not (or must not) remove: reported, never fatal. The first KEPT_LOGGED of a
        tier's scan each on a line, the rest counted (one line at its end): another user may leave
        millions of files in a shared tier, which must not become millions of lines in the server's log
        at every start (``kvstream check`` lists them all)."""
        part.kept += 1
        if part.kept <= KEPT_LOGGED:
            log.warning("kvstream: background scan: %s %s: %s", problem.kind, problem.path, problem.detail)


def progress_dir() -> str:
    """This user's directory of scan progress files on this host."""
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(), f"kvstream-{os.getuid()}")


def running_scans() -> list[dict]:
    """The progress of every engine of this user on this host whose process is alive (kvstream info).
    The file of a process that is gone (killed: it could not remove it at close), or whose pid another
    process has now (its start time differs), is removed."""
    out: list[dict] = []
    # Only this user's own directory, reached following no link, that no one else may write: its name in /tmp is
    # anyone's to take first (a directory of another user's held a FIFO that hung `kvstream info` and forged
    # scans listed as this user's; a link to a directory of this user's had its files named so removed)
    try:
        fd = os.open(progress_dir(), DIR_FLAGS)
    except OSError:
        return out
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return out
        for name in sorted(os.listdir(fd)):
            if name.startswith("scan-") and name.endswith(".json"):
                doc = _live_scan(name, fd)
                if doc is not None:
                    out.append(doc)
            elif _PROGRESS_TMP.fullmatch(name):
                _drop_killed_writers_tmp(name, fd)
    except OSError:
        pass
    finally:
        os.close(fd)
    return out


def _drop_killed_writers_tmp(name: str, dir_fd: int) -> None:
    """Remove ``name``, a progress file's temporary one (:meth:`BackgroundScan._publish`), where its writer was
    killed between its write and its rename (nothing else ever removes it): its pid is gone or another
    process's now, and it is older than any write in flight (a writer renames it at once; the age also spares
    one of another pid namespace, whose pid says nothing here)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or time.time() - st.st_mtime < PROGRESS_TMP_S
                or local_writer_alive(int(name.split("-", 2)[1]), st.st_mtime)):
            return
        os.unlink(name, dir_fd=dir_fd)
    except OSError:  # gone meanwhile (another info, another start), or not ours to judge
        pass


def _live_scan(name: str, dir_fd: int) -> dict | None:
    """The progress file ``name`` in this user's progress directory (open on ``dir_fd``) of a live process;
    None where it is not one (a link, a FIFO, another owner's file: never followed nor waited for), and
    removed where its process is gone."""
    try:
        with open(os.open(name, LOOK_FLAGS, dir_fd=dir_fd)) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > PROGRESS_MAX:
                return None
            doc = json.loads(f.read(PROGRESS_MAX))
        if "pidns" in doc and doc["pidns"] not in (None, pid_namespace()):
            # another pid namespace's engine (containers sharing a temporary directory): its pid says nothing
            # here, and a live engine's file was removed at every start of an engine here
            return None
        pid = int(doc["pid"])
        os.kill(pid, 0)
        if "started" not in doc:  # an earlier version's (before 8ea3036, no start time): a process begun well
            # after the file was last written has its pid now (a killed engine's; it was listed for good)
            if not local_writer_alive(pid, st.st_mtime):
                raise ProcessLookupError
        elif doc["started"] != started(pid):
            raise ProcessLookupError  # (its pid, reused)
    except PermissionError:  # alive, another user's process (a shared runtime directory)
        pass
    except ProcessLookupError:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        return None
    except (OSError, ValueError, KeyError, TypeError):  # a file being replaced, or not a progress file
        return None
    return doc


class _Pace:
    """Sleeps to hold a scan thread to its scan's ``rate`` files a second and ``cpu`` of a core."""

    def __init__(self, scan: BackgroundScan):
        self.scan = scan
        self.n = 0
        self.w0, self.c0 = time.monotonic(), time.thread_time()

    def step(self) -> None:
        self.n += 1
        scan = self.scan
        while not scan._stop.is_set():
            wall = time.monotonic() - self.w0
            want = self.n / scan.rate if scan.rate > 0 else 0.0
            if scan.cpu < 1:
                want = max(want, (time.thread_time() - self.c0) / scan.cpu)
            if want <= wall:
                return
            scan._stop.wait(min(want - wall, NAP_S))
