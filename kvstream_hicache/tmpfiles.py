"""Everything kvstream writes under ``<tier>/kvstream/tmp``, and which of it is a leftover.

Names in the tmp directory::

    <digest>.<host>.<pid>.<token>.<seq>.tmp    a page being written by the engine <token> of process <pid>
    probe.<pid>.<tag>.<seq>.<random>           an O_DIRECT probe (a tier checked at start-up, or re-probed
                                               after it failed): lives for milliseconds
    live.<host>.<pid>.<token>                  the mark of the engine <token>, on a local tier: its lock
                                               (flock) held while it has temporary files there

A temporary file is *live* while its writer may still write it: another host's, or this host's whose
process is alive and, for this process, whose engine is open (its token registered here). Engine
start-up, ``Engine.check`` and ``check_tiers`` all decide with :func:`stale_tmp`, so none of them can
take another engine's write in progress.

The mark tells a writer's death where its pid cannot: a container's restart runs in a new pid namespace (the
same hostname, a host of another name here), so the temporary files of the server the OOM killer took were
another host's, kept for TMP_STALE_S (an hour), and a node rebooted after a power cut may hand the dead
writer's pid to a live process (judged by times then, PID_REUSE_S). A lock on a local file system is the
kernel's, whatever the namespace: a file whose writer's mark is there and nobody holds it is a leftover. The
mark is held only while the engine has temporary files on the tier (Tier._track): an idle engine holds nothing
open there, so the tier's file system can still be unmounted under it. A writer without a mark (another
version, a network tier: a lock there may outlive its node or be lost while it lives) is judged as before.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable
from typing import NamedTuple

from .fds import close_fd
from .layout import ALIGN


def pid_namespace() -> int | None:
    """This process's pid namespace (the inode of /proc/self/ns/pid), or None without /proc: a pid says
    something of a process only inside its own namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _host() -> str:
    """This host as the names of what it writes say it: the hostname, and the pid namespace (two
    containers with the host's network share a hostname, not their pids: a pid alive in one says
    nothing of the other, whose temporary files would be judged by it)."""
    name = socket.gethostname().replace(".", "_") or "host"
    ns = pid_namespace()
    return name if ns is None else f"{name}-{ns}"  # (no /proc: the hostname alone)


HOST = _host()
TMP_SUFFIX = ".tmp"
REMOVING_PREFIX = ".kvstream-removing."  # an entry trust.remove judges, for microseconds (removing_name)
PROBE_PREFIX = "probe."
MARK_PREFIX = "live."  # an engine's mark (hold_mark)
MARKS_KEPT = 4096  # the marks one judge remembers (Leftovers._gone): a tmp/ filled with names of a million owners
TMP_STALE_S = 3600.0  # a temp file of another host (or a probe) older than this is a leftover, s
# A file of this host last changed this long before the process that has its pid now began was an earlier
# process's of that pid (pids wrap: 32768 in a container); the margin is the honest skew of a network tier's
# clock (its server's stamps the file) and of a clock step, as trust.CLOCK_SKEW_NS, s
PID_REUSE_S = 300.0
_PROBE_BYTES = b"kvsprobe"  # what a probe writes and expects to read back
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # refused for room: handled by eviction, not by failing the tier

_live_tokens: set[str] = set()  # tokens of this process's open engines (their temp files are live)
_probe_seq = itertools.count()  # probes running at once in one process (engines starting together) never share a file


# ---------------------------------------------------------------------------------- live engines
def register() -> str:
    """A new engine token, live until :func:`release`; it names the engine's temporary files and tells
    engines of one process apart."""
    token = secrets.token_hex(4)
    _live_tokens.add(token)
    return token


def release(token: str) -> None:
    """The engine of ``token`` closed: its temporary files are leftovers from now on."""
    _live_tokens.discard(token)


def live_tokens() -> frozenset[str]:
    return frozenset(_live_tokens)


# ------------------------------------------------------------------------------------------ names
def tmp_name(digest: str, pid: int, token: str, seq: int) -> str:
    """Unique temporary name: host and pid tell start-up cleaning whether the writer is alive,
    the per-engine token tells engines of one process apart."""
    return f"{digest}.{HOST}.{pid}.{token}.{seq}{TMP_SUFFIX}"


class TmpOwner(NamedTuple):
    digest: str
    host: str
    pid: int
    token: str


def removing_name(pid: int) -> str:
    """The private name trust.remove gives an entry while it judges it (in the entry's own directory)."""
    return f"{REMOVING_PREFIX}{HOST}.{pid}.{secrets.token_hex(4)}"


def removal_live(name: str, ctime: float, tmp_dir: str, now: Callable[[], float | None] | None = None) -> bool:
    """Whether the removal that renamed an entry to ``name`` (:func:`removing_name`; ``ctime``: the
    entry's, which the rename set) may still be going on: this host's process is alive, or another
    host's renamed it within TMP_STALE_S on the tier's clock (:func:`tier_now`; ``tmp_dir``: the
    tier's tmp directory; when it cannot be read, live; ``now``: reads that clock instead, as a walk that
    follows no link does: integrity). Else its process died between the two renames."""
    parts = name[len(REMOVING_PREFIX):].split(".")
    pid = _pid(parts[1]) if len(parts) == 3 and parts[0] == HOST else None
    read = (lambda: tier_now(tmp_dir)) if now is None else now
    if pid is not None:
        return _writer_alive(pid, lambda: ctime, read)
    clock = read()
    return clock is None or clock - ctime <= TMP_STALE_S


def parse_tmp_name(name: str) -> TmpOwner | None:
    if not name.endswith(TMP_SUFFIX):
        return None
    parts = name[: -len(TMP_SUFFIX)].split(".")
    pid = _pid(parts[2]) if len(parts) == 5 else None
    if pid is None:
        return None
    return TmpOwner(parts[0], parts[1], pid, parts[3])


def _pid(text: str) -> int | None:
    """The pid a name written by kvstream gives (ASCII digits), else None. Anyone who may write the tier's
    tmp directory or a shard names files as they like: str.isdigit() also takes digits int() refuses
    ('\u00b2'), and a ValueError there stopped the tier's background scan (and check) at every start."""
    return int(text) if text.isascii() and text.isdigit() else None


def is_engine_tmp(name: str) -> bool:
    """A name the engine gives what it writes in the tmp directory (a temporary page, a probe or a mark): only
    such a file may be removed from there as a leftover (trust.remove)."""
    return parse_tmp_name(name) is not None or name.startswith(PROBE_PREFIX) or parse_mark(name) is not None


def mark_name(host: str, pid: int, token: str) -> str:
    return f"{MARK_PREFIX}{host}.{pid}.{token}"


def parse_mark(name: str) -> tuple[str, int, str] | None:
    """(host, pid, token) of an engine's mark's name, else None."""
    parts = name[len(MARK_PREFIX):].split(".") if name.startswith(MARK_PREFIX) else []
    pid = _pid(parts[1]) if len(parts) == 3 else None
    return None if pid is None else (parts[0], pid, parts[2])


def hold_mark(tmp_dir: str, token: str, mode: int = 0o600) -> tuple[int, str, int] | None:
    """The mark of the engine ``token`` in ``tmp_dir`` (a local tier's), locked before it has its name (made
    unnamed, O_TMPFILE, then linked): a judge that finds it unlocked knows its engine died. (descriptor, path,
    a descriptor of ``tmp_dir``), held until :func:`drop_mark`. None where it cannot be made (no O_TMPFILE): the
    engine's files are then judged by their names alone, as before marks. A file under its name already is a
    mark of this engine's that a drop could not remove (its name holds this pid and token): replaced."""
    name = mark_name(HOST, os.getpid(), token)
    fd = dir_fd = None
    try:
        dir_fd = os.open(tmp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        os.fchmod(fd, mode)  # (the umask may have cleared the group bits of a shared tier's)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc link (a dir_fd makes os.link call linkat): no
        # capability needed, as AT_EMPTY_PATH would
        try:
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
        except FileExistsError:  # (linked and unlocked, it said this live engine was gone: review of the CI run)
            os.unlink(name, dir_fd=dir_fd)
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
    except OSError:
        for held in (fd, dir_fd):
            if held is not None:
                close_fd(held)
        return None
    return fd, os.path.join(tmp_dir, name), dir_fd


def drop_mark(mark: tuple[int, str, int]) -> None:
    """Remove the mark, then let its lock go (in that order: a judge that gets the lock finds it unlinked), only
    while its name is this mark's file (the engine's writes ended: its temporary files left are leftovers).
    Through the directory's descriptor: a tier whose directory was renamed away meanwhile (and back later) kept
    the mark linked, unlocked, and a judge took this live engine's files there for a dead one's (a model test's
    invariant in a fresh-clone CI run: `check()` listed a live engine's file as a leftover)."""
    fd, path, dir_fd = mark
    name = os.path.basename(path)
    try:
        st, here = os.fstat(fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
            os.unlink(name, dir_fd=dir_fd)
    except OSError:  # (gone already: the tier's tmp/ removed, the tier failed)
        pass
    close_fd(fd)
    close_fd(dir_fd)


def _mark_free(tmp_dir: str, dir_fd: int | None, name: str) -> bool:
    """The mark ``name`` is there, a regular file of this user's, and nobody holds its lock though it is still
    linked (its engine died: a live one unlinks it before it lets go): False when held, missing, unlinked
    meanwhile, or not one to judge by."""
    path = name if dir_fd is not None else os.path.join(tmp_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (let go at the close below)
        return os.fstat(fd).st_nlink > 0
    except OSError:  # EWOULDBLOCK: its engine holds it
        return False
    finally:
        close_fd(fd)


def probe_name(tag: str) -> str:
    # the random part: no one can plant a link or file at the name a probe is about to create
    return f"{PROBE_PREFIX}{os.getpid()}.{tag}.{next(_probe_seq)}.{secrets.token_hex(4)}"


# ------------------------------------------------------------------------------------------ probe
class ProbeFailed(OSError):
    """The O_DIRECT probe failed at ``step``: 'create', 'write', 'read' or 'verify' (read back other bytes)."""

    def __init__(self, err: int, step: str, detail: str | None = None):
        super().__init__(err, detail or os.strerror(err))
        self.step = step


# a new file, never an existing one nor a link's target (O_EXCL creates the name itself, O_NOFOLLOW
# refuses a link there even without O_EXCL's guarantee on every file system)
NEW_FILE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def probe_direct(tmp_dir: str, tag: str, dir_fd: int | None = None,
                 full: Callable[[int], None] = lambda err: None) -> int:
    """Write a 4 KiB block to a new file ``<tmp_dir>/probe.<pid>.<tag>.<seq>.<random>`` with O_DIRECT,
    read it back, remove the file. With ``dir_fd`` the file is made in that directory (``tmp_dir`` is
    then ignored). Returns the uid the file came out owned by (a file system may map owners: NFS root
    squash, FUSE). A write refused for want of room (ENOSPC, EDQUOT) passes: the tier is full, not failed
    (its pages are evicted to make room), and the file was made with O_DIRECT: ``full(errno)`` is told. So does
    a refusal for room that comes at the read back or the close: a network file system may report the write's
    refusal at the next call on the file (a full GlusterFS volume: ``test read failed (No space left on
    device)`` refused a node's restart on its shared tier, full of the nodes' pages).

    :raises ProbeFailed: the step that failed and its errno (EINVAL from 'create' or 'write': the
        file system refuses O_DIRECT).
    """
    name = probe_name(tag)
    path = name if dir_fd is not None else os.path.join(tmp_dir, name)
    with mmap.mmap(-1, ALIGN) as block:  # page-aligned anonymous memory: valid for O_DIRECT
        block[:len(_PROBE_BYTES)] = _PROBE_BYTES
        try:
            fd = os.open(path, os.O_RDWR | NEW_FILE | os.O_DIRECT, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            raise ProbeFailed(exc.errno or errno.EIO, "create") from None
        step = "write"
        try:
            owner = os.fstat(fd).st_uid
            try:
                os.pwrite(fd, block, 0)
            except OSError as exc:
                if exc.errno not in SPACE_ERRNOS:
                    raise
                # a full file system (a fleet's shared tier full of its servers' pages): made room on by
                # eviction, as a put's ENOSPC is (full is not failed); the file was made O_DIRECT
                full(exc.errno)
                return owner
            block[:len(_PROBE_BYTES)] = bytes(len(_PROBE_BYTES))
            step = "read"
            os.preadv(fd, [block], 0)
        except OSError as exc:
            if step == "read" and exc.errno in SPACE_ERRNOS:  # (the write's refusal, reported late: see above)
                full(exc.errno)
                return owner
            raise ProbeFailed(exc.errno or errno.EIO, step) from None
        finally:
            err = close_fd(fd)
            try:
                os.unlink(path, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
        if err in SPACE_ERRNOS:  # (the write's refusal for room, reported at the close)
            full(err)
            return owner
        if err:  # the server refused the write at close (EIO, ENOTCONN): the tier cannot store
            raise ProbeFailed(err, "close")
        if block[:len(_PROBE_BYTES)] != _PROBE_BYTES:
            raise ProbeFailed(errno.EIO, "verify", "read back different bytes")
    return owner


# -------------------------------------------------------------------------------------- leftovers
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (OverflowError: past any pid_t, as only a name another
        return False  # user made can say: no process has it; raised, it stopped the scan at every start)
    except PermissionError:  # alive, another user's
        return True
    return True


def started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat): a pid tells a process apart
    only with it, pids being reused; None when it cannot be told (gone, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime (the name may hold ')')
    except (OSError, ValueError, IndexError):
        return None


def _running(pid: int) -> float | None:
    """How long process ``pid`` has run, s (from its start in the boot clock's ticks: no wall clock, which
    may step); None when it cannot be told."""
    ticks = started(pid)
    return None if ticks is None else time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def _writer_alive(pid: int, changed: Callable[[], float | None], clock: Callable[[], float | None]) -> bool:
    """Whether the process of this host that wrote a file named by ``pid`` may still write it: ``pid`` is
    alive, and the file (last changed at ``changed()``, on the tier's clock) is no older on the tier's
    ``clock()`` than that process has run (beyond PID_REUSE_S: else the pid is a later process's, and the
    writer was killed, its file left for good while that one lives). The age is told on the clock that
    stamped the file, as another host's is (tier_now: an NFS server's clock may run hours behind this host's,
    and a writer begun a minute ago had its file taken for an earlier process's). Read only for a live pid
    (one lstat and /proc read each, not one per dead writer's file of a tmp/ of millions)."""
    if not _pid_alive(pid):
        return False
    mtime = changed()
    running = _running(pid) if mtime is not None else None
    now = clock() if running is not None else None
    return now is None or now - mtime <= running + PID_REUSE_S


def local_writer_alive(pid: int, mtime: float) -> bool:
    """:func:`_writer_alive` for a file on this host's own clock (a scan's progress file of a version that
    kept no start time in it: its pid may be a later process's)."""
    return _writer_alive(pid, lambda: mtime, time.time)


def _mtime(entry: os.DirEntry) -> float | None:
    """The entry's mtime (its own ``lstat``), None when it cannot be told."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return None


def stale_tmp(tmp_dir: str, live: frozenset[str] | set[str] | None = None, now: float | None = None) -> list[str]:
    """Temporary files no live writer owns: this host's whose process is gone (or is this process
    but not one of its live engines: ``live``, default every engine open in this process), other
    hosts' and probes older than TMP_STALE_S on the tier's clock (``now``, default :func:`tier_now`),
    and names no engine writes. Never a file another live engine may still be writing."""
    try:
        entries = list(os.scandir(tmp_dir))
    except OSError:  # gone, or unreadable (EIO, EACCES, ESTALE): nothing is judged a leftover now
        return []
    judge = Leftovers(tmp_dir, live, now)
    return [entry.path for entry in entries if _is_file(entry) and judge(entry)]


class Leftovers:
    """Judges the entries of one tier's tmp directory ``tmp_dir``, one at a time (:func:`stale_tmp`;
    the background scan walks a tmp directory another user may have filled with millions of names
    an entry at a time, paced, never holding a list of them): ``judge(entry)`` is True for a leftover
    (see :func:`stale_tmp`; ``entry`` a regular file's ``os.DirEntry``). The tier's clock is read once,
    at the first entry judged by its age, in the directory of ``dir_fd`` where given (the one walked:
    :func:`tier_now`)."""

    def __init__(self, tmp_dir: str, live: frozenset[str] | set[str] | None = None, now: float | None = None,
                 dir_fd: int | None = None):
        self.tmp_dir, self.dir_fd = tmp_dir, dir_fd
        self.live = _live_tokens if live is None else live
        self.me = os.getpid()
        self.now, self._clock_read = now, now is not None
        self._marks: dict[tuple[str, int, str], bool] = {}  # owner -> its mark was there, unlocked (_gone)

    def _gone(self, host: str, pid: int, token: str) -> bool:
        """The engine's mark is there and nobody holds it (remembered: a mark judged first and removed still
        tells of the files of its engine walked after it)."""
        owner = (host, pid, token)
        gone = self._marks.get(owner)
        if gone is None:
            if len(self._marks) >= MARKS_KEPT:
                self._marks.clear()
            gone = self._marks[owner] = _mark_free(self.tmp_dir, self.dir_fd, mark_name(host, pid, token))
        return gone

    def __call__(self, entry: os.DirEntry) -> bool:
        mark = parse_mark(entry.name)
        if mark is not None:
            return self._gone(*mark)
        owner = parse_tmp_name(entry.name)
        if owner is None and not entry.name.startswith(PROBE_PREFIX):
            return True  # a name no engine writes
        if owner is not None and self._gone(owner.host, owner.pid, owner.token):
            return True  # its engine's mark is let go: whatever its pid says (another namespace's, reused)
        if owner is not None and owner.host == HOST:
            return (owner.token not in self.live) if owner.pid == self.me else not _writer_alive(
                owner.pid, lambda: _mtime(entry), self._clock)
        # another host's writer cannot be asked whether it lives, and a probe of another process or host
        # lives for milliseconds and may be in use right now: only an old one goes
        now = self._clock()
        return now is not None and _older(entry, now)

    def _clock(self) -> float | None:
        """The tier's clock, read at the first entry judged by its age (tier_now)."""
        if not self._clock_read:
            self.now, self._clock_read = tier_now(self.tmp_dir, self.dir_fd), True
        return self.now


def tier_now(tmp_dir: str, dir_fd: int | None = None) -> float | None:
    """The tier's clock now, s: the modification time of a file made in its tmp directory ``tmp_dir``
    this moment (then removed). The age of a file on a tier (another host's temporary file, a probe, a
    removal's private name) is measured on the clock that stamped it: on NFS the file server's, which
    this host's clock may run hours ahead of (before, a host ahead by over TMP_STALE_S took a live
    writer's temporary files for leftovers). On a local tier both are this host's clock. GlusterFS
    (features.ctime on, its default) keeps what each client stamps, this host's kernel time here: its
    nodes' clocks must agree within TMP_STALE_S (docs/design.md).
    None when no file can be made there (read-only, full, gone): then no age is told, nothing judged old.
    ``dir_fd``: the tmp directory's descriptor (``tmp_dir`` then ignored): a walk of tmp/ reads the clock
    in the directory it walks, not through its path, which a member of a shared tier's group may have
    made a link to another directory meanwhile (the file was made, and removed, in the link's target)."""
    path = probe_name("clock") if dir_fd is not None else os.path.join(tmp_dir, probe_name("clock"))
    try:
        fd = os.open(path, os.O_WRONLY | NEW_FILE, 0o600, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        try:  # stamped now by the file system (an NFSv3 exclusive create may keep its verifier in the times)
            os.utime(fd)
        except OSError:  # (a file system that sets no times: the create's stamp)
            pass
        return os.fstat(fd).st_mtime
    except OSError:
        return None
    finally:
        close_fd(fd)
        try:
            os.unlink(path, dir_fd=dir_fd)
        except OSError:  # (left: an old probe, removed as one by the next cleaning)
            pass


def _is_file(entry: os.DirEntry) -> bool:
    """Neither a link nor a directory (neither followed); False when it cannot be told (vanished, EIO)."""
    try:
        return not entry.is_symlink() and not entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _older(entry: os.DirEntry, now: float) -> bool:
    """Not modified for TMP_STALE_S (its own ``lstat``: a link is never followed); False when it cannot
    be told (vanished, ELOOP, EACCES, ESTALE, EIO): never removed on a guess."""
    try:
        return now - entry.stat(follow_symlinks=False).st_mtime > TMP_STALE_S
    except OSError:
        return False
