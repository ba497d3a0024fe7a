"""Who the engine trusts on a tier, and the file operations that follow no link inside one.

A tier may be a scratch area other users write (a parallel or cloud file system, a 1777 directory).
CRC32C is no signature: anyone can write a page file with a valid header and checksums. What keeps
another user's file from being served, and keeps the engine from writing or deleting through another
user's link, is ownership, checked the way OpenSSH's StrictModes checks ``~/.ssh``:

* **Trusted owners** (:class:`Trust`): the engine's own uid, and the uid its own files come out with
  on the tier (learnt by the start-up probe: NFS root squash and some FUSE mounts map owners); with
  ``file_mode=shared`` also the tier directory's group. Nobody else.
* **Directories** the engine uses (``kvstream/``, ``tmp/``, the namespace, its shards) must be real
  directories (no link), owned by a trusted owner, writable by nobody else: then no one else can add,
  rename or remove an entry in them, and a path walk through them cannot be redirected. A directory
  that fails is a ConfigError at start-up naming it, its owner and mode and the fix
  (:func:`establish`; and again before a failed tier rejoins, tiers.py). The tier root may be writable
  by every user, or (private mode) by its group, only with the sticky bit (as ``/tmp``): then nobody
  can move the engine's own ``kvstream/`` there (:func:`root_problem`); it and every directory above it
  must be this user's, root's or a trusted owner's (:func:`owner_problem`: an owner may move anything).
* **Files**: opened with O_NOFOLLOW (a link is ELOOP, never followed) and served or indexed only when
  ``fstat`` shows a regular file of a trusted owner (:meth:`Trust.owns`); removed only through the
  directory descriptor they were found in, after ``fstat`` there shows an engine-owned, non-directory,
  non-link entry, and (a file judged damaged) only the very file judged (:func:`remove`). Start-up,
  ``check`` and their fixes walk the tree through descriptors opened O_DIRECTORY|O_NOFOLLOW
  (:func:`open_below`).

The read and write paths open pages by path (one path walk, as before: no descriptor is held per
directory, so a tier moved away or unmounted is still noticed, never written through) with O_NOFOLLOW
on the file: the directories on the way were checked at start-up, or when first used (a new shard),
and only a trusted owner can change them. The one a purge can take from under a running engine is
``kvstream/`` itself (anyone may make that name again in a sticky root): every write first looks that
it is still the directory checked (tiers.Tier._gone, one ``lstat``), else the tier fails.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import stat
import struct
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from ._uring import touch_atime
from .errors import ConfigError, TierError, printable
from .fds import close_fd
from .layout import ROOT_DIR, TMP_DIR, TierLayout
from .locks import ranked_lock
from .tmpfiles import probe_direct, removing_name

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A file under a tier's name, opened to read or judge it: never a link's target (O_NOFOLLOW: ELOOP), never
# blocking (O_NONBLOCK: a FIFO's open for reading waits for a writer), and never made this process's controlling
# terminal (O_NOCTTY: a server started as a daemon is a session leader without one, and a terminal's open would
# give it one: a hangup there signals the server). _uring.open_owned opens with the same flags.
LOOK_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
CLOCK_SKEW_NS = 300 * 10**9  # a header's created_ns further ahead of this host's clock is not clock skew
# What opening a special file may answer: a socket ENXIO, a device without its driver ENXIO or ENODEV (a misc
# minor no driver registered), any device on a nodev mount (/tmp, removable, many network mounts) EACCES, in a
# device cgroup EPERM. Each is also a tier's error for a regular file: the entry's lstat tells which
# (integrity.open_regular, unlink_unless).
NODE_ERRNOS = frozenset({errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP, errno.EACCES, errno.EPERM})


class Trust(NamedTuple):
    """The owners whose files and directories one tier's engine trusts."""

    uids: frozenset[int]
    gid: int | None = None  # file_mode=shared: the tier directory's group (its members are trusted)

    @classmethod
    def user(cls) -> "Trust":
        """This process's user alone (before, or without, a probe of the tier)."""
        return cls(frozenset({os.geteuid()}))

    def owns(self, st: os.stat_result) -> bool:
        return st.st_uid in self.uids or (self.gid is not None and st.st_gid == self.gid)

    def dir_problem(self, st: os.stat_result) -> str | None:
        """What makes a directory (its ``lstat``) untrustworthy, or None."""
        if stat.S_ISLNK(st.st_mode):
            return "is a symbolic link"
        if not stat.S_ISDIR(st.st_mode):
            return "is not a directory"
        if not self.owns(st):
            return "belongs to a user this engine does not trust"
        if st.st_mode & stat.S_IWOTH:
            return "is writable by every user"
        if st.st_mode & stat.S_IWGRP and st.st_gid != self.gid:
            return "is writable by a group this engine does not trust"
        return None

    def describe(self) -> str:
        """For the start-up line: 'trusts alice (uid 1000)', '... and group kv', '... and nobody (uid 65534)
        (its files come out owned by nobody (uid 65534) there)'."""
        me = os.geteuid()
        text = f"trusts {user_name(me)}"
        mapped = sorted(self.uids - {me})
        if mapped:
            text += " and " + ", ".join(user_name(u) for u in mapped) + " (its files come out owned by " + \
                    ", ".join(user_name(u) for u in mapped) + " there)"
        if self.gid is not None:
            text += f" and group {group_name(self.gid)}"
        return text


def user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


# ---------------------------------------------------------------------------------- directories
def open_dir(name: str, dir_fd: int | None = None) -> int:
    """A directory descriptor that followed no link: a link is ELOOP (or ENOTDIR), never followed."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def open_below(root: str, path: str) -> int:
    """Open directory ``path`` inside tier ``root`` through descriptors, following no link below the
    root (the root itself is the operator's configured path, links and all).
    :raises OSError: ELOOP or ENOTDIR where a link or a file is on the way, ENOENT, ..."""
    prefix = root.rstrip(os.sep) + os.sep
    parts = path[len(prefix):].split(os.sep) if path.startswith(prefix) else []
    if not parts or {"", ".", ".."} & set(parts):  # (the layout's own paths take the fast way: relpath
        rel = os.path.relpath(path, root)  # costs 11 us, a fifth of an eviction's unlink on tmpfs)
        parts = [] if rel == "." else rel.split(os.sep)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            below = open_dir(part, fd)
            close_fd(fd)
            fd = below
    except BaseException:
        close_fd(fd)
        raise
    return fd


def list_below(root: str, path: str) -> list[str]:
    """The names in directory ``path`` of tier ``root``, listed through a descriptor reached following
    no link. :raises OSError: as :func:`open_below`."""
    fd = open_below(root, path)
    try:
        return os.listdir(fd)
    finally:
        close_fd(fd)


LINK, DIRECTORY, OTHER = "link", "directory", "other"


def scandir_below(root: str, path: str) -> Iterator[tuple[str, str]]:
    """(name, LINK | DIRECTORY | OTHER) of every entry of directory ``path`` in tier ``root``, listed
    through a descriptor reached following no link (the kind from the directory entry: no stat per
    entry where the file system reports it), one at a time: another user may keep millions of files
    there, which must cost no list of them. :raises OSError: as :func:`open_below` (at the first entry)."""
    fd = open_below(root, path)
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    kind = LINK if entry.is_symlink() else DIRECTORY if entry.is_dir(follow_symlinks=False) else OTHER
                except OSError:  # vanished meanwhile
                    kind = OTHER
                yield entry.name, kind
    finally:
        close_fd(fd)


def make_dir(name: str, dir_fd: int, mode: int) -> int:
    """Create directory ``name`` in ``dir_fd`` with ``mode`` (unless it exists) and open it, following
    no link. :raises OSError: ELOOP/ENOTDIR when a link or file is in its place."""
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        created = False
    fd = open_dir(name, dir_fd)
    if created:
        try:
            os.fchmod(fd, mode)  # the umask may have cleared the group bits (file_mode=shared)
        except BaseException:  # (EPERM on a mount that forces modes, EIO): the descriptor is not the caller's
            close_fd(fd)
            raise
    return fd


def describe(st: os.stat_result) -> str:
    """'owner alice (uid 1000), group kv, mode 0770' of an ``lstat``."""
    return f"owner {user_name(st.st_uid)}, group {group_name(st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def dir_error(path: str, st: os.stat_result, why: str, trust: Trust, source: str) -> ConfigError:
    """A directory the engine would use fails :meth:`Trust.dir_problem`: say so with the exact fix."""
    text = f"tier directory {path} (from {source}) {why} ({describe(st)}): {dir_fix(path, st, trust)}"
    return ConfigError(printable(text))  # (a shard's name is anyone's who may write the namespace directory)


def dir_fix(path: str, st: os.stat_result, trust: Trust, shards: bool = False) -> str:
    """The commands that make directory ``path`` (its ``lstat``) pass :meth:`Trust.dir_problem`; ``shards``: those
    that make its subdirectories pass (each failing alike, their ``lstat`` ``st``: :func:`_refusal`)."""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return (f"kvstream follows no link and keeps only directories there: replace it with a directory "
                f"(rm {path} && mkdir -m 700 {path}) or choose another tier directory")
    if not trust.owns(st):  # (not `chown -R`: it would make every file in it this engine's, any page planted there
        # with them, served as its own after the next fixes advised; a cache loses nothing kvstream cannot write again)
        return (f"another user's directory could hand this engine pages it never stored, or take its own: remove "
                f"it (as its owner or root: rm -r {path}), or choose another tier directory")
    if st.st_mode & stat.S_IWOTH:
        return f"chmod -R o-w {path} (or choose another tier directory)"
    if trust.gid is None:
        return f"chmod -R g-w {path} (or set file_mode=shared to trust its group, or choose another tier directory)"
    # (chgrp of the directories alone, not -R: shared mode trusts a file by its group, and `chgrp -R` gave it to every
    # page another group's member had planted there, served then; a planted file keeps its group and stays untrusted)
    dirs = f"{path}/*/" if shards else path
    return (f"chgrp {_group_arg(trust.gid)} {dirs} (the tier directory's group), or chmod -R g-w {path}, "
            "or choose another tier directory")


def _group_arg(gid: int) -> str:
    """``gid`` as chgrp takes it: its name, or the number where it has none ('gid N' is no group)."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def root_problem(st: os.stat_result, shared: bool) -> str | None:
    """What lets someone the engine does not trust replace ``kvstream/`` in a tier root (its ``stat``),
    or None: writable by every user, or (``shared`` False: no group is trusted) by its group, without
    the sticky bit (with it, as in /tmp, only an entry's owner may move or remove it)."""
    if st.st_mode & stat.S_ISVTX:
        return None
    if st.st_mode & stat.S_IWOTH:
        return "is writable by every user without the sticky bit"
    if st.st_mode & stat.S_IWGRP and not shared and not _own_group(st.st_gid):
        return (f"is writable by its group {group_name(st.st_gid)} without the sticky bit, and file_mode=private "
                "trusts no group")
    return None


_OWN_DIR = "use a directory of your own in a directory only root or you own (mkdir -m 700 <dir>/$USER)"  # (the first
# fix owner_problem names, whoever else may move the tier: a directory no one else may touch)


def owner_problem(root: str, trust: Trust) -> str | None:
    """Why tier ``root`` (as configured, and where its links lead) may be taken from under the engine by
    another user, or None: it, a directory above it, or a link (or a directory) it is reached through belongs to
    a user ``trust`` does not trust (nor root: :func:`_resolved`).
    A directory's owner may rename anything in it, whatever its mode (the sticky bit binds everyone but the
    owner): move ``kvstream/`` (or the tier root) away and put a link in its place between a write's look at
    it (Tier._gone: one lstat) and its open of ``tmp/<name>`` by path, so that the page is written through the
    link (before: a tier root owned by another user was used; their loop of such swaps made a put's temporary
    file in a directory of the victim's). As OpenSSH's StrictModes checks every directory up to ``~/.ssh``."""
    with contextlib.closing(_resolved(os.path.abspath(root))) as walk:  # (its descriptor closed on a return)
        return _owner_problem(walk, trust)


def _owner_problem(walk: Iterator[tuple[str, os.stat_result]], trust: Trust) -> str | None:
    """:func:`owner_problem` of the (path, lstat) of ``walk`` (:func:`_resolved`)."""
    for path, st in walk:  # (a link's owner may point it elsewhere at any time)
        if st.st_uid != 0 and st.st_uid not in trust.uids:  # (chown -h: a plain chown of a link changed its
            # target's owner, whatever the link's owner pointed it at then, and left the link theirs: refused again)
            return (f"{path} belongs to a user this engine does not trust ({describe(st)}): "
                    "a directory's owner may move kvstream's directory out of it and put a link in its place, "
                    f"sticky bit or not; {_OWN_DIR}, or have root take it over (as root: chown -h root {path})")
        writable = not stat.S_ISLNK(st.st_mode) and not st.st_mode & stat.S_ISVTX and (
            st.st_mode & stat.S_IWOTH or st.st_mode & stat.S_IWGRP and st.st_gid != trust.gid
            and not _own_group(st.st_gid))
        if writable:  # (as its owner: anyone who may write a directory without the sticky bit may rename in it;
            # before, a directory of another user's chowned to root as advised stayed theirs to swap, mode 0777)
            trust_group = "" if st.st_mode & stat.S_IWOTH else (  # (a project directory of a group, as on HPC)
                f", or trust its group: file_mode=shared (KVSTREAM_FILE_MODE=shared) and the tier directory of "
                f"that group (chgrp {_group_arg(st.st_gid)} <tier directory>)")
            return (f"{path} may be written by users this engine does not trust, without the sticky bit "
                    f"({describe(st)}): they may move kvstream's directory out of it and put a link in its place; "
                    f"{_OWN_DIR}, or have root close it (as root: chmod go-w {path}){trust_group}")
    return None


def _resolved(path: str) -> Iterator[tuple[str, os.stat_result]]:
    """(path, lstat) of every directory and link the kernel goes through resolving absolute ``path``, in
    order: each directory from ``/`` down, and each link met with the directories its target leads through.
    A link behind another (root's link to another user's, or to a link in another user's directory) is on
    neither the configured path nor the real one, and is as much its owner's to point elsewhere.
    Walked through descriptors, one name at a time, as the kernel walks it: the path reached through links may be
    longer than PATH_MAX where the kernel still resolves it (an lstat of it as one string was ENAMETOOLONG, and the
    start a traceback); the paths yielded are for the messages.
    :raises OSError: ELOOP past 40 links, or a directory on the way that cannot be looked at."""
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    try:
        yield "/", os.fstat(fd)
        here, todo, links = "/", path.split("/")[::-1], 0
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":  # (of the directory reached, as the kernel takes it: not of the path as written)
                up = os.open("..", flags, dir_fd=fd)
                close_fd(fd)
                fd, here = up, os.path.dirname(here)
                continue
            step = os.path.join(here, name)
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            yield step, st
            if not stat.S_ISLNK(st.st_mode):
                below = os.open(name, flags, dir_fd=fd)
                close_fd(fd)
                fd, here = below, step
                continue
            links += 1
            if links > 40:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(name, dir_fd=fd)
            todo.extend(target.split("/")[::-1])
            if target.startswith("/"):
                top = os.open("/", flags)
                close_fd(fd)
                fd, here = top, "/"
    finally:
        close_fd(fd)


def _own_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group (Debian's and Ubuntu's user private groups, whose
    umask 002 makes every new directory group-writable): named as the user, the user's primary group,
    no other member listed. Writable by it is writable by the user alone."""
    try:
        user, group = pwd.getpwuid(os.geteuid()), grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def open_base(root: str, dir_mode: int, source: str) -> tuple[int, int]:
    """Descriptors of ``<root>/kvstream`` and its ``tmp``, each created (``dir_mode``) where missing,
    following no link; the tier root passes :func:`root_problem` (file_mode=shared when ``dir_mode``
    is group-writable, config.MODES: its group is trusted).

    :raises ConfigError: the root fails :func:`root_problem`, or a link is in the way.
    :raises TierError: a file is in the way."""
    root_st = os.stat(root)
    why = root_problem(root_st, bool(dir_mode & stat.S_IWGRP))
    if why is not None:
        who, w = ("anyone", "o") if root_st.st_mode & stat.S_IWOTH else ("any member of the group", "g")
        also = "" if w == "o" else ", set file_mode=shared (KVSTREAM_FILE_MODE=shared) to trust the group"
        raise ConfigError(f"tier directory {root} (from {source}) {why} (mode {stat.S_IMODE(root_st.st_mode):04o}): "
                          f"{who} could replace kvstream's directory in it; chmod +t {root} (as /tmp), chmod {w}-w "
                          f"{root}{also}, or use a directory of your own below it (mkdir -m 700 {root}/$USER)")
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        base = os.path.join(root, ROOT_DIR)
        for path in (base, os.path.join(base, TMP_DIR)):
            fds.append(_tier_dir(root, path, fds[-1], dir_mode, source))
        return fds[1], fds[2]
    except BaseException:
        for fd in fds[1:]:
            close_fd(fd)
        raise
    finally:
        close_fd(fds[0])


def _tier_dir(root: str, path: str, parent_fd: int, dir_mode: int, source: str) -> int:
    """:func:`make_dir` of ``path`` with a message for what is in its way."""
    try:
        return make_dir(os.path.basename(path), parent_fd, dir_mode)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM) and os.path.lexists(path):
            # it exists and cannot be opened (another user's, chmod'ed): say which and how to fix (a mkdir
            # refused is the caller's "not writable")
            try:
                st = describe(os.lstat(path))
            except OSError:
                st = "its owner and mode unknown"
            raise TierError(f"tier {root} (from {source}): its directory {path} cannot be opened "
                            f"({os.strerror(exc.errno)}; {st}): run the engine as the user that owns it, give this "
                            f"user access (as its owner or root: chmod -R u+rwX {path}), or with tiers "
                            "shared by a group, file_mode=shared (KVSTREAM_FILE_MODE=shared) for every writer"
                            ) from None
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise dir_error(path, st, "is a symbolic link", Trust.user(), source) from None
        raise TierError(f"tier {root} (from {source}): {path} is in the way (a file, not the directory kvstream "
                        "keeps its pages in): move or remove it, or choose another directory") from None


def _trust(root: str, base_fd: int, tmp_fd: int, shared: bool, tag: str, owner: int | None = None) -> Trust:
    """This user, the owner the probe's file comes out with in ``tmp`` (``owner``: already probed),
    and (shared) the tier's group: the root's, or in a root every user may write (sticky), that of
    the engine's own ``kvstream/``."""
    uids = frozenset({os.geteuid(), probe_direct("", tag, dir_fd=tmp_fd) if owner is None else owner})
    if not shared:
        return Trust(uids)
    return Trust(uids, tier_group(os.stat(root), lambda: os.fstat(base_fd), uids))


def tier_group(root_st: os.stat_result, base_st: Callable[[], os.stat_result],
               uids: frozenset[int] | None = None) -> int | None:
    """The group shared mode trusts on a tier whose root has stat ``root_st``: the root's, or in a root every
    user may write (sticky), that of the engine's own ``kvstream/`` (``base_st()``): one owned by a trusted uid
    (``uids``, default this user), or of a group this user is a member of. Anyone may make ``kvstream/`` first
    in such a root, of their own group: None then (no group trusted, so that directory fails its checks as
    another user's; before, root's engine trusted the other user's group and served their pages)."""
    if not root_st.st_mode & stat.S_IWOTH:
        return root_st.st_gid
    st = base_st()
    if st.st_uid in (frozenset({os.geteuid()}) if uids is None else uids) or _member(st.st_gid):
        return st.st_gid
    return None


def _member(gid: int) -> bool:
    """Whether this process's user is a member of group ``gid``."""
    return gid == os.getegid() or gid in os.getgroups()


def establish(layout: TierLayout, dir_mode: int, shared: bool, source: str, tag: str,
              owner: int | None = None) -> Trust:
    """Start-up of one tier: its directories (``kvstream/``, ``tmp/``, the namespace) created where
    missing through descriptors, the trusted owners learnt (the O_DIRECT probe in ``tmp``, named with
    ``tag``; or ``owner``, what the engine's start-up probe of the tier found: one probe, not two),
    and every directory the engine uses checked (:func:`dir_findings`, shards included).

    :raises ConfigError: a directory fails the checks (naming it, its owner and mode, and the fix).
    :raises TierError: a file is in the way of ``kvstream/`` or ``tmp/``.
    :raises OSError: the tier cannot be written (the probe, a mkdir)."""
    base_fd, tmp_fd = open_base(layout.root, dir_mode, source)
    try:
        trust = _trust(layout.root, base_fd, tmp_fd, shared, tag, owner)
        try:
            why = owner_problem(layout.root, trust)
        except OSError as exc:  # (ELOOP past 40 links, EACCES: what the walk met, as the setting's error)
            raise ConfigError(printable(f"tier directory {layout.root} (from {source}): the owners of the directories "
                                        f"and links it is reached through cannot be checked ({exc}): point the tier "
                                        "list at a directory of your own reached through fewer links")) from None
        if why is not None:
            raise ConfigError(f"tier directory {layout.root} (from {source}): {why}")
        for path, st, why in dir_findings(layout, trust, pages=False):  # a parent before its children
            raise dir_error(path, st, why, trust, source)
        close_fd(_tier_dir(layout.root, layout.pages, base_fd, dir_mode, source))
        findings = dir_findings(layout, trust, base=False)
        if findings:
            raise _refusal(findings, layout, trust, source)
        return trust
    finally:
        close_fd(base_fd)
        close_fd(tmp_fd)


def _refusal(findings: list[tuple[str, os.stat_result, str]], layout: TierLayout, trust: Trust,
             source: str) -> ConfigError:
    """The start-up's refusal of the first of ``findings``; where several shards fail alike (a tree that
    file_mode=shared added shards to, started private again), the fix names their namespace directory: run
    once, it is the whole fix (one shard's was: each restart refused the next)."""
    path, st, why = findings[0]
    fixes = {dir_fix(layout.pages, s, trust, shards=True) for p, s, _ in findings}
    if len(findings) < 2 or len(fixes) > 1 or any(os.path.dirname(p) != layout.pages for p, _, _ in findings):
        return dir_error(path, st, why, trust, source)
    return ConfigError(f"tier directory {path} (from {source}) {why} ({describe(st)}), and {len(findings) - 1} "
                       f"more shard directories of its namespace: {fixes.pop()}")


def dir_findings(layout: TierLayout, trust: Trust, base: bool = True,
                 pages: bool = True) -> list[tuple[str, os.stat_result, str]]:
    """(path, lstat, what is wrong) of each directory of one tier the engine uses that fails
    :meth:`Trust.dir_problem`: ``kvstream/`` and ``tmp/`` (``base``), the namespace directory and its
    shards (``pages``). A parent comes before its children, which are not looked at when it fails (nobody
    can vouch for them); a missing directory is no finding (the engine makes it)."""
    out: list[tuple[str, os.stat_result, str]] = []

    def passes(path: str) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return True
        why = trust.dir_problem(st)
        if why is not None:
            out.append((path, st, why))
        return why is None

    if base and not passes(layout.base):
        return out
    if base:
        passes(layout.tmp)
    if pages and passes(layout.pages):
        # one entry at a time, no list of them (another user may keep millions of files beside the shards:
        # start-up must not hold them all); the findings by name, the first the one start-up names
        first = len(out)
        try:
            for name, kind in scandir_below(layout.root, layout.pages):
                if kind != OTHER:  # a file where shards belong is a stray: the scan's
                    passes(os.path.join(layout.pages, name))
        except FileNotFoundError:
            pass
        out[first:] = sorted(out[first:], key=lambda finding: finding[0])
    return out


def learn(root: str, shared: bool) -> Trust:
    """The trust an engine would establish on tier ``root``, without creating its directories (``check``):
    this user alone when the tier's ``kvstream/tmp`` cannot be probed."""
    try:
        base_fd = open_below(root, os.path.join(root, ROOT_DIR))
    except OSError:
        return Trust.user()
    try:
        tmp_fd = open_dir(TMP_DIR, base_fd)
        try:
            return _trust(root, base_fd, tmp_fd, shared, "check")
        finally:
            close_fd(tmp_fd)
    except OSError:
        return Trust.user()
    finally:
        close_fd(base_fd)


def check_dir(path: str, trust: Trust) -> None:
    """A directory the engine came upon while running (a shard a write needs: made by another trusted
    writer, or by us): one ``lstat`` the first time. :raises NotADirectoryError: it fails the checks
    (the write fails on that tier; start-up and ``check`` say why)."""
    st = os.lstat(path)
    why = trust.dir_problem(st)
    if why is not None:
        raise NotADirectoryError(errno.ENOTDIR, f"{path} {why} ({describe(st)})", path)


# ---------------------------------------------------------------------------------------- files
NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS})  # os.link: none here


def not_trusted(st: os.stat_result) -> str:
    """Why a file that fails :meth:`Trust.owns` (its ``fstat``) is not read past that fstat."""
    return f"of a user this engine does not trust ({describe(st)})"


def remove(root: str, path: str, trust: Trust, name_ok: Callable[[str], bool] | None = None,
           judged: Callable[[os.stat_result], bool] | None = None) -> str | None:
    """Remove file ``path`` of tier ``root`` through the descriptor of its directory (reached following
    no link), only if ``lstat`` there shows an entry that is no directory and no link, of a trusted
    owner, and (``name_ok``) named as the engine names it. Returns None when it is gone (or was
    already), else why it was left in place.

    ``judged``: the entry was found damaged (or a stray) by a look that may be older than what the name
    holds now: another writer may have renamed a valid page over it since. Then it is first renamed
    to a private name in its directory, where no one else renames anything, and removed there only
    when ``judged(lstat)`` (:func:`same_file`, :func:`not_a_file`) says it is the entry judged; else it
    goes back under its name (a valid page is never deleted), unless another writer renamed a file there
    meanwhile: that one is newer and stays (before, the one put back replaced it). None: whatever is there goes
    (``clear``, ``delete``, the engine's own temporary file; an eviction looks first: :func:`unlink_unless`).
    :raises OSError: the directory, the lstat or the unlink failed for an I/O error."""
    if name_ok is not None and not name_ok(os.path.basename(path)):
        return "not a name kvstream writes"
    fd, name, why = _parent_below(root, path)
    if fd is None:
        return why
    try:
        why = _not_removable(os.stat(name, dir_fd=fd, follow_symlinks=False), trust)
        if why is not None or judged is None:
            if why is None:
                os.unlink(name, dir_fd=fd)
            return why
        held = removing_name(os.getpid())  # (a crash between the renames leaves it: integrity puts it back)
        os.rename(name, held, src_dir_fd=fd, dst_dir_fd=fd)
        st = os.stat(held, dir_fd=fd, follow_symlinks=False)
        why = _not_removable(st, trust) or (None if judged(st) else
                                            "replaced since it was judged (another writer's page): kept")
        if why is None:
            os.unlink(held, dir_fd=fd)
        elif link_new(held, name, fd, fd):  # back under its name, replacing nothing: a file another writer
            with contextlib.suppress(FileNotFoundError):  # renamed there meanwhile is newer, and stays
                os.unlink(held, dir_fd=fd)  # (the second name of the link; gone after a rename)
        elif not _not_removable(st, trust):  # its name taken meanwhile: a newer version has it, this goes
            os.unlink(held, dir_fd=fd)
        else:  # (not ours to remove, nor to put over the newer one: left, `kvstream check` lists it)
            why += "; left under its private name (a newer file has its name)"
        return why
    except FileNotFoundError:  # removed concurrently: gone all the same
        return None
    finally:
        close_fd(fd)


def unlink_unless(root: str, path: str, trust: Trust,
                  stays: Callable[[int, os.stat_result], str | None]) -> str | None:
    """Remove file ``path`` of tier ``root`` (a regular file of a trusted owner, reached following no link)
    unless ``stays(fd, stat)``, given the file open for reading, says why it stays. Returns None when it is
    gone (or was already), else why it was left. An eviction's path (Tier.evict_page): one look at the file
    and its unlink, through its directory's descriptor. Unlike :func:`remove`'s ``judged`` (a rename to a
    private name and a stat first: on ext4 a journaled metadata write per page, a fifth more CPU per page
    put at full eviction churn), a file another writer renames over the name between the look and the
    unlink is not told apart: the window of every unlink by name, microseconds, where ``judged`` guards a
    judgement that may be old (a damaged copy found by a long verify).
    :raises OSError: the directory, the open or the unlink failed for an I/O error."""
    dir_fd, name, why = _parent_below(root, path)
    if dir_fd is None:
        return why
    try:
        fd = os.open(name, LOOK_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        close_fd(dir_fd)
        return None
    except OSError as exc:  # (a link: ELOOP. A FIFO opens, O_NONBLOCK)
        try:  # a socket, a device: the entry's errno (NODE_ERRNOS), not the tier's: its lstat tells which
            special = exc.errno == errno.ELOOP or (exc.errno in NODE_ERRNOS and not stat.S_ISREG(
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode))
        finally:  # (before, a device answering ENODEV failed the tier at its eviction: review unlink)
            close_fd(dir_fd)
        if special:
            return "not a regular file: left for the scan or `kvstream check` to judge"
        raise
    try:
        st = os.fstat(fd)
        why = _not_removable(st, trust) or (None if stat.S_ISREG(st.st_mode) else
                                            "not a regular file: left for the scan or `kvstream check` to judge")
        why = why or stays(fd, st)
        if why is None:
            os.unlink(name, dir_fd=dir_fd)
        return why
    except FileNotFoundError:  # removed concurrently: gone all the same
        return None
    finally:
        close_fd(fd)
        close_fd(dir_fd)


USE_MARK_US = 999  # a use mark's access time ends its millisecond at this microsecond (marked_below)


def marked_below(path: str) -> int | None:
    """When a process last marked the regular file ``path`` of tier ``root`` used (:func:`mark_below`: its
    access time, ns); None where its access time is no mark: an ordinary read's (relatime: the first read after a
    write; the scan's, a check's, a catch-up copy's, none a use of the page as a prefix) carries the microsecond
    USE_MARK_US in 1 of 1000, a file system that keeps whole seconds never; or the file is gone, not a regular
    file, or its directory is a link. A look on every eviction: two ``lstat`` calls, the directory's and the
    file's, where :func:`open_below`'s walk of descriptors cost 14 us an eviction (10% more CPU a page put at full
    eviction churn); a link put at the directory's name between the two reads another file's time, which only
    orders an eviction (nothing is opened, read or removed through it)."""
    try:
        if not stat.S_ISDIR(os.lstat(os.path.dirname(path)).st_mode):
            return None
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    marked = stat.S_ISREG(st.st_mode) and st.st_atime_ns // 1000 % 1000 == USE_MARK_US
    return st.st_atime_ns if marked else None


def mark_below(root: str, path: str) -> int | None:
    """Mark ``path`` of tier ``root`` used now: its access time set to this millisecond's microsecond USE_MARK_US
    (at most 1 ms ahead; its mtime kept: _uring.touch_atime), reached following no link; the time set. None:
    gone, reached through a link, or not this user's file (EPERM: only the owner may).
    :raises OSError: any other error."""
    dir_fd, name, _why = _parent_below(root, path)
    if dir_fd is None:
        return None
    now = time.time_ns()
    at = now - now % 1_000_000 + USE_MARK_US * 1000
    try:
        touch_atime(dir_fd, os.fsencode(name), at)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EPERM, errno.EACCES):
            return None
        raise
    finally:
        close_fd(dir_fd)
    return at


def _parent_below(root: str, path: str) -> tuple[int | None, str, str | None]:
    """(a descriptor of the directory of ``path`` in tier ``root``, reached following no link; the entry's
    name; None), or (None, name, why) when there is none to act in: gone (why None) or reached through a
    link. :raises OSError: as :func:`open_below`."""
    directory, name = os.path.split(path)
    try:
        return open_below(root, directory), name, None
    except FileNotFoundError:
        return None, name, None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return None, name, "its directory is reached through a symbolic link (or a file): kvstream follows none"
        raise


def put_back(root: str, path: str, name: str, trust: Trust) -> str | None:
    """Put the file at ``path`` (a page :func:`remove` had renamed to its private name when its process
    died) back under ``name`` in the same directory, replacing nothing there, and remove the private
    name. Returns None when done, else why it was left: where something has the name (the hard link
    fails with EEXIST) the copy stays under its private name, whatever that is: a link or a directory
    there is never removed, and a page there may be damaged (the scan that judged this copy found no
    valid page under the name: integrity._left_by_removal; a valid one written since is met by the next).
    :raises OSError: the directory, the link or the unlink failed for an I/O error."""
    directory, private = os.path.split(path)
    try:
        fd = open_below(root, directory)
    except FileNotFoundError:
        return None
    try:
        why = _not_removable(os.stat(private, dir_fd=fd, follow_symlinks=False), trust)
        if why is not None:
            return why
        if not link_new(private, name, fd, fd):
            return "its name is taken since it was judged: kept under its private name for the next look"
        os.unlink(private, dir_fd=fd)  # (FileNotFoundError: renamed, where no hard links: done)
        return None
    except FileNotFoundError:  # (put back by another process's scan meanwhile)
        return None
    finally:
        close_fd(fd)


def link_new(src: str, dst: str, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> bool:
    """Give the file ``src`` the name ``dst``, replacing nothing: a hard link, which fails with EEXIST
    atomically where something has the name (GlusterFS and NFS too); on a file system without hard
    links, a look and then a rename (a narrow window another node's writer may fall in). True: the file
    has the name, and ``src`` is a second name of it after a link, gone after a rename (the caller
    removes it where it is); False: something had the name.
    :raises OSError: the link or the rename failed otherwise."""
    try:
        os.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in NO_LINKS:
            raise
    try:
        os.stat(dst, dir_fd=dst_dir_fd, follow_symlinks=False)
        return False
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        return True


def _not_removable(st: os.stat_result, trust: Trust) -> str | None:
    """Why :func:`remove` leaves an entry (its ``lstat``) in place, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link: kvstream follows none and removes none"
    if stat.S_ISDIR(st.st_mode):
        return "kvstream never removes a directory (remove it by hand if nothing needs it)"
    if not trust.owns(st):
        return f"not kvstream's: {not_trusted(st)}"
    return None


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file from another that took its name since, with no descriptor held: device, inode,
    size, modification time (the inode number alone may be reused once the file is gone)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


FS_IOC_GETVERSION = 0x80087601  # _IOR('v', 1, long): an inode's generation (ext2/3/4, XFS, btrfs)


def sealed_identity(fd: int, st: os.stat_result) -> tuple[int, ...] | None:
    """What tells the regular file open on ``fd`` (its ``fstat`` ``st``) from any later file under its name
    on a local file system: its inode, that inode's generation and its mtime; or None where they may not.
    ext4 hands a freed inode to the next file at once (200 of 200 delete-then-create cycles here), its
    generation new each time; its mtime moves by the kernel's clock tick (4 ms), and on a file system that
    keeps whole seconds (ext2/ext3, ext4 with 128-byte inodes) by seconds. Without a generation (tmpfs: no
    such ioctl, and no quick reuse of inode numbers) the inode and a sub-second mtime; a whole-second mtime
    and no generation: None (review stat). Index.committed_file, Tier.evict_page."""
    try:
        generation = struct.unpack("q", fcntl.ioctl(fd, FS_IOC_GETVERSION, bytes(8)))[0]
    except OSError:
        generation = 0
    if generation:  # (0: none kept; a file system that answers 0 for every inode tells nothing by it)
        return st.st_ino, generation, st.st_mtime_ns
    return None if st.st_mtime_ns % 10**9 == 0 else (st.st_ino, st.st_mtime_ns)


def same_file(ident: tuple[int, int, int, int]) -> Callable[[os.stat_result], bool]:
    """:func:`remove`'s ``judged`` for the file whose :func:`identity` was ``ident`` when judged."""
    return lambda st: identity(st) == ident


def pin(path: str) -> int | None:
    """An O_PATH descriptor of the entry at ``path`` itself (never followed, never read: a FIFO or a
    device too), taken before the entry is judged and held until it is removed: while it is held, the
    file's inode cannot be freed and handed to another file, so :func:`same_file` cannot mistake a new
    page of the same size and timestamp (a coarse-timestamp file system, ``cp -p``) for the file judged.
    None when nothing can be opened (gone)."""
    try:
        return os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def holds(fd: int | None, ident: tuple[int, int, int, int]) -> bool:
    """Whether ``fd`` (:func:`pin`, or any descriptor) is open on the file of :func:`identity` ``ident``."""
    try:
        st = os.fstat(fd) if fd is not None else None
    except OSError:  # (ESTALE: replaced on another node)
        return False
    return st is not None and (st.st_dev, st.st_ino) == ident[:2]


def not_a_file(st: os.stat_result) -> bool:
    """:func:`remove`'s ``judged`` for an entry judged not to be a regular file (a FIFO, a socket, ...
    under a page's name) with no descriptor of it: a page, always a regular file, never matches."""
    return not stat.S_ISREG(st.st_mode)


# ---------------------------------------------------------------------------------------- order
def age_key(created_ns: int, honest_until_ns: int) -> tuple[bool, int]:
    """Sort key of a copy by its header's write time, oldest first (where copies differ, the last one
    indexed wins). A time after ``honest_until_ns`` (:func:`honest_until`) is a claim, not a time, and
    sorts before every honest one, so it never wins over another copy."""
    return (created_ns <= honest_until_ns, created_ns)


def honest_until(now_ns: int | None = None) -> int:
    """The latest write time a header may claim now: this host's clock plus CLOCK_SKEW_NS."""
    return (time.time_ns() if now_ns is None else now_ns) + CLOCK_SKEW_NS


def created_ns(claimed: int) -> int:
    """A found page's write time, as its header (or its file's stat) claims it. A claim beyond the clock's
    skew is not a time (honest_until): 0, so that it never wins over another version, nor passes for a file
    written since this engine began (another process's, Index THEIRS: never evicted here)."""
    return claimed if claimed <= honest_until() else 0


def written_ns(writer_ns: int, mtime_ns: int) -> int:
    """When a found page's file was written: the later of its header's write stamp (PageHeader.writer_ns) and
    its file's mtime. A catch-up copy keeps the page's ``created`` (the order of versions and of the LRU at a
    restart), but its file is new: made since this engine began, it is the copying process's bytes (Index
    THEIRS), never this one's to count or evict (review theirs2: a copy of an older page was this process's
    first victim; the mtime tells it from a copier that stamps none, of before copied_ns)."""
    return max(created_ns(writer_ns), created_ns(mtime_ns))


_wall_lock = ranked_lock("clock")
_wall_last = 0  # the latest time wall_ns() answered in this process


def wall_ns() -> int:
    """This process's wall clock, ns, for the times it writes to a tier and compares with them: a page
    header's ``created`` (puts.py) and the time of a delete a failed tier owes (tiers.Tier.owe_delete).
    This host's clock, never earlier than a time it answered before: NTP or an operator may step the
    clock back (by less than CLOCK_SKEW_NS: a time, not a claim), and a delete after the step would
    else find this engine's own older page "written after it" and keep it, served again. After a step
    back the times run on from the last one answered until the clock catches up with it."""
    global _wall_last
    with _wall_lock:
        _wall_last = max(time.time_ns(), _wall_last + 1)
        return _wall_last
