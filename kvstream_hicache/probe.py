"""The start-up checks that touch the tiers (config.py stays pure): each tier directory exists, is a
directory on a storage file system, overlaps no other tier's tree, is writable and supports O_DIRECT;
two tiers on one file system are warned about; a capacity given as a share is resolved against its
file system. Each failure is a TierError naming the tier, the setting and the fix.

A tier that may hang (not on a local file system) is probed on its own calls thread (bounded.py), each
call waited for at most write_timeout, as its calls are once the engine serves: first its real path
(``look_at``, which also tells a local file system from another: until then nothing says whether a
call there may hang), then the probe. One that does not answer in time is no error: the engine starts
it failed and probes it in the background until it answers (tiers.py). Before, a tier on a FUSE or NFS
mount whose server stopped held ``Engine()`` as long as the server.
"""
from __future__ import annotations

import errno
import logging
import os
import re
from typing import NamedTuple

from .bounded import BoundedCalls
from .config import Capacity, Config, TierConfig, env_name, real_path_on, setting_source
from .errors import TierError
from .fds import close_fd
from .layout import ROOT_DIR
from .tmpfiles import SPACE_ERRNOS, ProbeFailed, probe_direct
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


def local_fs(path: str, real: str | None = None) -> bool:
    """Whether the tier at ``path`` (whose real path is ``real``, when known) is on a LOCAL_FS: its aligned
    pages are written from the caller's memory, and its calls are made in place (they cannot hang)."""
    return fs_type(path, real) in LOCAL_FS


class Look(NamedTuple):
    """A tier's first look at start-up (:func:`look_at`)."""
    real: str | None  # its real path; None: it did not answer in write_timeout (it starts failed)
    local: bool  # on a LOCAL_FS (its calls are made in place)
    calls: BoundedCalls | None  # a tier that may hang: its calls thread (the Tier takes it); None: local

    def run(self, fn, *args):
        """``fn(*args)``: in place on a local tier, else on the tier's thread, bounded (bounded.py).
        :raises OSError: ETIMEDOUT, the tier did not answer in time."""
        return fn(*args) if self.calls is None else self.calls.run(fn, *args)


def look_at(tier: TierConfig, name: str, bound: float) -> Look:
    """The real path of ``tier`` and whether it is local, on the tier's calls thread waited for at most
    ``bound`` s (write_timeout; 0: in place): whether a tier may hang is known only from its real path,
    and a realpath through a mount whose server stopped never returns. A local tier's thread ends here
    (its calls are made in place, as before); another's is handed to its Tier (a call that hung still
    holds it: the tier's next calls fail at once until it returns, bounded.py). A tier whose real path
    did not answer when the settings were read is not waited for again: it did not answer (before, a
    start waited twice write_timeout for it)."""
    path = tier.path
    calls = BoundedCalls(name, bound)
    if not tier.answered:
        return Look(None, False, calls)
    real = real_path_on(calls, path)
    if real is None:
        return Look(None, False, calls)
    if local_fs(path, real):
        calls.close()
        return Look(real, True, None)
    return Look(real, False, calls)


def answering(config: Config) -> list[Look]:
    """Each tier's first look (:func:`look_at`), then a stat of it and a listing of its ``kvstream/``, each
    waited for at most write_timeout, for what walks the tiers without an engine (integrity.check_tiers,
    ``kvstream check`` and ``info``): a tier that does not answer in time has a real path of None, and is
    reported, never walked (before, the command waited as long as the server). A tier that may hang keeps
    its calls thread (the caller's checks of every tier, check_overlap, run there) until :func:`let_go`; the
    walk of one whose first look answered runs in place, unbounded (an operator's command, as check()'s)."""
    looks = [look_at(tier, f"tier {k}", config.write_timeout) for k, tier in enumerate(config.tiers)]
    for k, (tier, look) in enumerate(zip(config.tiers, looks)):
        if look.real is None:
            continue
        try:  # (a realpath may be answered from the client's caches: a stat and a listing reach the server)
            look.run(_first_look, tier.path)
        except OSError as exc:
            if exc.errno == errno.ETIMEDOUT:
                looks[k] = look._replace(real=None)
    return looks


def let_go(looks: list[Look]) -> None:
    """The calls threads of ``looks`` end (at once where idle; one in a call that hung, when the tier answers)."""
    for look in looks:
        if look.calls is not None:
            look.calls.close()


def _first_look(path: str) -> None:
    for call, where in ((os.stat, path), (os.listdir, os.path.join(path, ROOT_DIR))):
        try:
            call(where)
        except OSError as exc:  # (missing, not a directory, not ours to read: the walk says so; not a hang)
            if exc.errno == errno.ETIMEDOUT:
                raise


class Probed(NamedTuple):
    warnings: list[str]  # e.g. two tiers on one file system
    owners: list[int | None]  # per tier, the uid its probe's file came out owned by (trust.py trusts it); None:
    # the tier did not answer
    looks: list[Look]  # per tier, its first look (a real path of None: it did not answer in write_timeout)
    capacities: list[int | None]  # per tier, its capacity in bytes (a share resolved; None: no limit, or a share
    # unknown yet for a tier that did not answer: resolved when it does, tiers.py)


def probe_tiers(config: Config, announce: bool = True, level: int = logging.WARNING) -> Probed:
    """Check every tier: exists, is a directory on a storage file system, no tier overlaps another's
    tree, is writable, supports O_DIRECT. Creates ``<tier>/kvstream/tmp``. One O_DIRECT probe per
    tier: the owner its file comes out with is handed to the tier's start-up (trust.establish). A tier
    that may hang is probed on its own calls thread, waited for at most write_timeout; one that does not
    answer in time is left out of the checks (its look's real path is None: the engine starts it failed).

    ``announce`` False: the warnings are returned, not logged (a check before the engine that logs them).
    ``level``: what they are logged at (DEBUG for the ranks of a server other than its rank 0, which say the
    same facts of the same configuration: one warning a server, not one a rank).

    :raises TierError: naming the tier, the setting and the fix.
    """
    warnings = list(config.warnings)
    looks = [look_at(tier, f"tier {k}", config.write_timeout) for k, tier in enumerate(config.tiers)]
    try:
        check_overlap(config, looks)
        devices: dict[int, str] = {}
        owners: list[int | None] = []
        capacities: list[int | None] = []
        source = config.sources.get("tiers", env_name("tiers"))
        for k, tier in enumerate(config.tiers):
            # the entry as written too ('$HOME/kv', 'kv0'), when it is not the path the messages name
            written = "" if tier.written in (None, tier.path) else f", written {tier.written!r}"
            try:
                owner, dev, cap = (None, None, None) if looks[k].real is None else looks[k].run(
                    _probe_one, tier, config.modes[1], source + written)
            except OSError as exc:
                if exc.errno != errno.ETIMEDOUT:
                    raise
                owner, dev, cap = None, None, None
                looks[k] = looks[k]._replace(real=None)  # (did not answer: it starts failed)
            if looks[k].real is None:  # a capacity in bytes needs no answer (a share is resolved when it answers,
                cap = tier.capacity.nbytes  # tiers.py); else the tier would serve unlimited once it rejoins
            owners.append(owner)
            capacities.append(cap)
            if dev is None:
                continue
            if dev in devices:
                warnings.append(f"tiers {devices[dev]} and {tier.path} are on the same file system: "
                                "replicas there add no bandwidth and fail together")
            devices.setdefault(dev, tier.path)
    except BaseException:
        let_go(looks)  # (no Tier takes them: their threads end)
        raise
    for w in warnings if announce else ():
        log.log(level, "kvstream: %s", w)
    return Probed(warnings, owners, looks, capacities)


def _probe_one(tier, dir_mode: int, source: str) -> tuple[int, int, int | None]:
    """(owner, device, capacity) of one tier: probe_tier, then its device and its capacity resolved."""
    owner = probe_tier(tier.path, dir_mode, source)
    return owner, os.stat(tier.path).st_dev, resolve_capacity(tier.capacity, tier.path)


def check_overlap(config: Config, looks: list[Look] | None = None, only: int | None = None) -> None:
    """Refuse tiers that share a tree: the same directory under two paths the tier list did not
    catch (a bind mount), or a tier inside another tier's ``kvstream`` directory, which kvstream
    manages (its temporary directory and page trees: start-up cleaning and ``check --fix`` walk
    them). A tier that is or lies under another's ``<root>/kvstream`` is found by the text of their
    real paths, before the probes create ``kvstream`` (else it would start once and be refused at every
    later start); a tree reached by another path (a bind mount) by its inode. Tiers that do not exist
    yet are otherwise left to the probe.

    ``looks``: the tiers' first looks (:func:`look_at`; None: made here, in place): a tier's stats run
    as its calls do (bounded where it may hang); one that did not answer is checked by the text of its
    path as written only (a look there would hang), one whose stat does not answer in time is left out.
    ``only``: the tiers overlapping tier ``only`` alone are refused (one that did not answer at start-up
    and answers now, checked against the others: Engine._placed; the others were checked at start-up).

    :raises TierError: naming both tiers, the setting and the fix.
    """
    source = setting_source(config.sources, "tiers")
    if looks is None:
        looks = [Look(os.path.realpath(tier.path), True, None) for tier in config.tiers]
    roots = {tier.path: look.real or tier.path for tier, look in zip(config.tiers, looks)}
    answered = [(tier, look) for tier, look in zip(config.tiers, looks) if look.real is not None]
    mine = lambda *paths: only is None or config.tiers[only].path in paths  # noqa: E731
    for tier in config.tiers:
        for owner in config.tiers:
            if owner is not tier and roots[tier.path] == roots[owner.path] and mine(tier.path, owner.path):
                raise _same(owner.path, tier.path, source)  # (a second path to one that did not answer at first)
            tree = os.path.join(roots[owner.path], ROOT_DIR)
            if owner is not tier and (roots[tier.path] == tree or roots[tier.path].startswith(tree + os.sep)) \
                    and mine(tier.path, owner.path):
                raise _inside(tier.path, owner.path, source, roots[tier.path] == tree)
    ids: dict[tuple[int, int], str] = {}
    trees: dict[tuple[int, int], str] = {}
    for tier, look in answered:
        for path, table in ((tier.path, ids), (os.path.join(tier.path, ROOT_DIR), trees)):
            try:
                st = look.run(os.stat, path)
            except (OSError, ValueError):
                continue
            other = table.setdefault((st.st_dev, st.st_ino), tier.path)
            if table is ids and other != tier.path and mine(other, tier.path):
                raise _same(other, tier.path, source)
    for tier, look in answered:
        try:
            above = look.run(_ids_above, roots[tier.path])
        except OSError:  # (did not answer in time: its probe, next, finds it hung)
            continue
        for path, ident in above:
            owner = trees.get(ident) if ident is not None else None
            if owner is not None and owner != tier.path and mine(owner, tier.path):
                raise _inside(tier.path, owner, source, path == roots[tier.path])


def _ids_above(path: str) -> list[tuple[str, tuple[int, int] | None]]:
    """(path, (device, inode) or None) of ``path`` and each directory above it, up to ``/``."""
    out = []
    while True:
        try:
            st = os.stat(path)
        except OSError:
            st = None
        out.append((path, (st.st_dev, st.st_ino) if st is not None else None))
        if path == os.path.dirname(path):
            return out
        path = os.path.dirname(path)


def _same(one: str, other: str, source: str) -> TierError:
    return TierError(f"tiers {one} and {other} (from {source}) are the same directory (a bind mount or another path "
                     "to it): list it once")


def _inside(path: str, owner: str, source: str, itself: bool) -> TierError:
    """Tier ``path`` is (``itself``) or lies inside the ``kvstream`` directory of tier ``owner``."""
    tree = os.path.join(owner, ROOT_DIR)
    where = f"is {tree} itself, the directory kvstream manages inside tier {owner}" if itself else (
        f"is inside {tree}, the directory kvstream manages for tier {owner}")
    return TierError(f"tier {path} (from {source}) {where} (its page and temporary files): choose a directory "
                     "outside it")


def resolve_capacity(capacity: Capacity, path: str) -> int | None:
    """Bytes allowed on the tier at ``path`` (a share is taken of the file system's size).

    :raises TierError: a share of a file system that does not say its size."""
    if capacity.share is None:
        return capacity.nbytes
    st = os.statvfs(path)
    if not st.f_blocks:  # (0 bytes taken for its size: refused as "0 bytes, less than one page, give at least 1")
        raise TierError(f"tier {path}: capacity {capacity} is a share of its file system, which does not say its "
                        "size (statvfs: 0 blocks, as some FUSE and cloud-storage mounts): give the capacity in "
                        "bytes (e.g. '100G'), or leave it empty for unlimited")
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

    def full(err: int) -> None:
        log.warning("kvstream: tier %s (from %s) is full (its test write: %s): it serves, and the engine evicts its "
                    "own least recent pages there to make room; if it holds none (another program's files, another "
                    "user's, a quota), every write to it fails until room is made: free space there or raise the "
                    "quota", path, source, os.strerror(err))

    try:
        base_fd, tmp_fd = open_base(path, dir_mode, source)  # made where missing, following no link
        try:
            return probe_direct("", "config", dir_fd=tmp_fd, full=full)
        except ProbeFailed as exc:
            if exc.step != "create" or exc.errno not in SPACE_ERRNOS:
                raise
            # Full, not failed, as when a tier rejoins (Tier._probe): no inode left, or a file system that refuses
            # every new file once full (GlusterFS's storage.reserve). Refused, a node restarting on a shared tier
            # full of the nodes' pages was told it 'is not writable (No space left on device)', in a crash loop.
            full(exc.errno)
            return _owner_without_probe(path, source, base_fd, fstype)
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


# file systems that may give this engine's files another owner (NFS root squash, FUSE mounts that map owners)
MAPPING_FS = ("nfs", "nfs4", "cifs", "smb3", "9p", "ceph")


def _owner_without_probe(path: str, source: str, base_fd: int, fstype: str | None) -> int:
    """The owner this engine's files come out with on tier ``path`` when the probe could make no file there (full):
    this user's where its ``kvstream/`` (``base_fd``) is this user's, or the file system maps no owner (another
    user's ``kvstream/`` is then refused by the trust checks). On a file system that may map owners, a
    ``kvstream/`` of another uid may be this engine's own, mapped, or another user's: the file the probe could
    not make alone tells, and trusting that uid on a guess would let this engine evict another user's pages.
    :raises TierError: that case, naming the fix (before: refused as 'a user this engine does not trust')."""
    owner = os.fstat(base_fd).st_uid
    if owner == os.geteuid() or fstype is not None and not fstype.startswith("fuse") and fstype not in MAPPING_FS:
        return os.geteuid()
    raise TierError(f"tier {path} (from {source}) is full (no room for the start-up probe's test file) on a "
                    f"{fstype or 'network'} file system that may give this engine's files another owner, and its "
                    f"kvstream/ directory is uid {owner}'s: whether that is this engine's own files, mapped, cannot "
                    "be learnt without a file; free space (or an inode) there, then start again")


def _unreachable(path: str, source: str, exc: OSError) -> TierError:
    """Why ``path`` cannot be reached, in words: a symlink loop, a dangling link, a file on the way, a
    missing directory (create it), a permission."""
    if exc.errno == errno.ELOOP:
        return TierError(f"tier {path} (from {source}) is a symbolic link loop (too many levels of symbolic "
                         "links): point the tier list at a real directory, or repair the links")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return TierError(f"tier {path} (from {source}) cannot be reached ({os.strerror(exc.errno)}): fix the "
                         "permissions of its parent directories, or choose another directory")
    if exc.errno not in (errno.ENOENT, errno.ENOTDIR):  # (ENOTCONN, ESTALE, EIO: a mount that fails, e.g. a
        # network file system's client killed; its lstat fails too, and 'does not exist: mkdir -p' hid the cause)
        return TierError(f"tier {path} (from {source}) cannot be reached ({os.strerror(exc.errno)}): its file system "
                         "or mount fails (a network file system's client gone, its server unreachable): mount it "
                         "again (umount -l, then mount), or correct the tier list")
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


def mount_field(field: str) -> str:
    """A field of /proc/self/mounts or mountinfo as it is: the kernel writes a space, tab, newline and
    backslash in it as octal escapes (\\040 ...), and a source such as MooseFS's 'mfs#host:port' with \\043."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def fs_type(path: str, real: str | None = None) -> str | None:
    """The type of the file system holding ``path`` (``/proc/self/mountinfo``: the deepest mount point
    above its real path, ``real`` when known), or None when it cannot be told."""
    real = os.path.realpath(path) if real is None else real
    best, kind = -1, None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = mount_field(fields[4])
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
