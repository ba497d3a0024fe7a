"""The start-up checks that touch the tiers (config.py stays pure): each tier directory exists, is a
directory on a storage file system, overlaps no other tier's tree, is writable and supports O_DIRECT;
two tiers on one file system are warned about; a capacity given as a share is resolved against its
file system. Each failure is a TierError naming the tier, the setting and the fix.
"""
from __future__ import annotations

import errno
import logging
import os
import re
from typing import NamedTuple

from .config import Capacity, Config, env_name, setting_source
from .errors import TierError
from .fds import close_fd
from .layout import ROOT_DIR
from .tmpfiles import ProbeFailed, probe_direct
from .trust import open_base

log = logging.getLogger("kvstream")

# File systems that are kernel interfaces, not storage: a tier there is refused by name, not by the odd
# errno its first mkdir happens to return (procfs answers ENOENT).
PSEUDO_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs",
                       "configfs", "pstore", "bpf", "mqueue", "fusectl", "binfmt_misc", "autofs", "nsfs",
                       "efivarfs", "rpc_pipefs", "selinuxfs"})


# File systems whose writes end in this machine's block layer or memory: a page 4096-aligned in memory
# is written from the caller's memory. On any other (NFS, FUSE, SMB, Lustre, GPFS, ...) a request may
# hang as long as a server does, which is where a put gives up on a tier at write_timeout: its writes
# are staged, so that the requests left behind there read only engine memory.
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs", "jfs", "nilfs2", "zfs",
                      "tmpfs", "ramfs"})


def local_fs(path: str) -> bool:
    """Whether the tier at ``path`` is on a LOCAL_FS: its aligned pages are written from the caller's memory."""
    return fs_type(path) in LOCAL_FS

class Probed(NamedTuple):
    warnings: list[str]  # e.g. two tiers on one file system
    owners: list[int]  # per tier, the uid its probe's file came out owned by (trust.py trusts it)


def probe_tiers(config: Config) -> Probed:
    """Check every tier: exists, is a directory on a storage file system, no tier overlaps another's
    tree, is writable, supports O_DIRECT. Creates ``<tier>/kvstream/tmp``. One O_DIRECT probe per
    tier: the owner its file comes out with is handed to the tier's start-up (trust.establish).

    :raises TierError: naming the tier, the setting and the fix.
    """
    warnings = list(config.warnings)
    check_overlap(config)
    devices: dict[int, str] = {}
    owners = []
    source = config.sources.get("tiers", env_name("tiers"))
    for tier in config.tiers:
        # the entry as written too ('$HOME/kv', 'kv0'), when it is not the path the messages name
        written = "" if tier.written in (None, tier.path) else f", written {tier.written!r}"
        owners.append(probe_tier(tier.path, config.modes[1], source + written))
        dev = os.stat(tier.path).st_dev
        if dev in devices:
            warnings.append(f"tiers {devices[dev]} and {tier.path} are on the same file system: "
                            "replicas there add no bandwidth and fail together")
        devices.setdefault(dev, tier.path)
    for w in warnings:
        log.warning("kvstream: %s", w)
    return Probed(warnings, owners)


def check_overlap(config: Config) -> None:
    """Refuse tiers that share a tree: the same directory under two paths the tier list did not
    catch (a bind mount), or a tier inside another tier's ``kvstream`` directory, which kvstream
    manages (its temporary directory and page trees: start-up cleaning and ``check --fix`` walk
    them). A tier that is or lies under another's ``<root>/kvstream`` is found by the text of their
    real paths, before the probes create ``kvstream`` (else it would start once and be refused at every
    later start); a tree reached by another path (a bind mount) by its inode. Tiers that do not exist
    yet are otherwise left to the probe.

    :raises TierError: naming both tiers, the setting and the fix.
    """
    source = setting_source(config.sources, "tiers")
    roots = {tier.path: os.path.realpath(tier.path) for tier in config.tiers}
    for tier in config.tiers:
        for owner in config.tiers:
            tree = os.path.join(roots[owner.path], ROOT_DIR)
            if owner is not tier and (roots[tier.path] == tree or roots[tier.path].startswith(tree + os.sep)):
                raise _inside(tier.path, owner.path, source, roots[tier.path] == tree)
    ids: dict[tuple[int, int], str] = {}
    trees: dict[tuple[int, int], str] = {}
    for tier in config.tiers:
        for path, table in ((tier.path, ids), (os.path.join(tier.path, ROOT_DIR), trees)):
            try:
                st = os.stat(path)
            except (OSError, ValueError):
                continue
            other = table.setdefault((st.st_dev, st.st_ino), tier.path)
            if table is ids and other != tier.path:
                raise TierError(f"tiers {other} and {tier.path} (from {source}) are the same directory (a bind "
                                "mount or another path to it): list it once")
    for tier in config.tiers:
        path = roots[tier.path]
        while True:
            try:
                st = os.stat(path)
            except OSError:
                st = None
            owner = trees.get((st.st_dev, st.st_ino)) if st is not None else None
            if owner is not None and owner != tier.path:
                raise _inside(tier.path, owner, source, path == roots[tier.path])
            if path == os.path.dirname(path):
                break
            path = os.path.dirname(path)


def _inside(path: str, owner: str, source: str, itself: bool) -> TierError:
    """Tier ``path`` is (``itself``) or lies inside the ``kvstream`` directory of tier ``owner``."""
    tree = os.path.join(owner, ROOT_DIR)
    where = f"is {tree} itself, the directory kvstream manages inside tier {owner}" if itself else (
        f"is inside {tree}, the directory kvstream manages for tier {owner}")
    return TierError(f"tier {path} (from {source}) {where} (its page and temporary files): choose a directory "
                     "outside it")


def resolve_capacity(capacity: Capacity, path: str) -> int | None:
    """Bytes allowed on the tier at ``path`` (a share is taken of the file system's size)."""
    if capacity.share is None:
        return capacity.nbytes
    st = os.statvfs(path)
    return int(st.f_blocks * st.f_frsize * capacity.share)


def probe_tier(path: str, dir_mode: int, source: str) -> int:
    """Raise :class:`TierError` unless ``path`` is a writable directory with O_DIRECT support; return
    the uid the probe's file came out owned by (a file system may map owners)."""
    try:
        os.stat(path)
    except OSError as exc:
        raise _unreachable(path, source, exc) from None
    if not os.path.isdir(path):
        raise TierError(f"tier {path} (from {source}) is not a directory: point the tier list at a directory")
    fstype = fs_type(path)
    if fstype in PSEUDO_FS:
        raise TierError(f"tier {path} (from {source}) is on a {fstype} file system, a kernel interface that "
                        "cannot store files: put the tier on a disk file system such as ext4 or xfs")
    try:
        base_fd, tmp_fd = open_base(path, dir_mode, source)  # made where missing, following no link
        try:
            return probe_direct("", "config", dir_fd=tmp_fd)
        finally:
            close_fd(base_fd)
            close_fd(tmp_fd)
    except ProbeFailed as exc:
        if exc.errno == errno.EINVAL:
            raise _no_direct(path, source) from None
        if exc.step != "create":
            raise TierError(f"tier {path} (from {source}): test {exc.step} failed ({exc.strerror}): "
                            "check free space, permissions and the mount") from None
        raise _not_writable(path, source, exc.errno) from None
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise _no_direct(path, source) from None
        raise _not_writable(path, source, exc.errno) from None


def _unreachable(path: str, source: str, exc: OSError) -> TierError:
    """Why ``path`` cannot be reached, in words: a symlink loop, a dangling link, a file on the way, a
    missing directory (create it), a permission."""
    if exc.errno == errno.ELOOP:
        return TierError(f"tier {path} (from {source}) is a symbolic link loop (too many levels of symbolic "
                         "links): point the tier list at a real directory, or repair the links")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return TierError(f"tier {path} (from {source}) cannot be reached ({os.strerror(exc.errno)}): fix the "
                         "permissions of its parent directories, or choose another directory")
    if os.path.islink(path):
        return TierError(f"tier {path} (from {source}) is a symbolic link to {os.readlink(path)}, which does not "
                         "exist: create the target or point the tier list at a directory")
    parent = os.path.dirname(path)
    while parent != os.path.dirname(parent) and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if os.path.lexists(parent) and not os.path.isdir(parent):  # mkdir -p would fail too: say what is in the way
        return TierError(f"tier {path} (from {source}) cannot be created: {parent} is "
                         f"{'a dangling symbolic link' if os.path.islink(parent) else 'a file'}, not a directory; "
                         "correct the tier list or move it")
    sep = next((c for c in ",;" if c in path), None)  # ('a,b': two tiers meant)
    hint = f"; tiers are separated by '{os.pathsep}', not '{sep}'" if sep else ""
    return TierError(f"tier {path} (from {source}) does not exist: create it (mkdir -p {path}) "
                     f"or correct the tier list{hint}")


def fs_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (``/proc/self/mountinfo``: the deepest mount point
    above its real path), or None when it cannot be told."""
    real = os.path.realpath(path)
    best, kind = -1, None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: a space
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= best:  # later lines mount over earlier ones at the same point
                    best, kind = len(mnt), right.split()[0]
    except OSError:
        return None
    return kind


def _not_writable(path: str, source: str, err: int) -> TierError:
    return TierError(f"tier {path} (from {source}) is not writable ({os.strerror(err)}): "
                     "fix its permissions or mount, or choose another directory")


def _no_direct(path: str, source: str) -> TierError:
    return TierError(f"tier {path} (from {source}): its file system does not support O_DIRECT (tmpfs on older "
                     "kernels, some FUSE/overlay mounts): put the tier on a disk file system such as ext4 or xfs")
