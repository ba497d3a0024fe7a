"""A throttled multi-tier testbed on one host: loop devices, ext4, cgroup v1 blkio throttles, fio on record.

Lifecycle (every step is undone by :func:`down`, which is idempotent and also cleans half-built testbeds)::

    up(profile)     preflight -> per tier: sparse image -> losetup -> mkfs.ext4 -> mount
                    -> blkio cgroup with each device's read/write bytes-per-second limit -> state file
                    -> fio: each tier alone, then all tiers at once (the physical bound, on record)
    join(pid)       a process (the bench; fio; a competing tenant) enters the throttled group.
                    Children inherit it, so fio started by a joined process is throttled too.
    set_read_bps()  drift scenarios change a tier's limit while a benchmark runs
    down()          leave the group, remove it, unmount, detach, delete images and the state file

The throttle is per cgroup and per device: every process in the group shares each device's budget
(a competing tenant in the group takes bandwidth from the bench); reads and writes have separate
budgets (blk-throttle v1 meters them independently). Buffered writes are not throttled (writeback
runs outside the group); the engine writes with O_DIRECT, so its writes are.

Three kinds of tier (``TierLimit.backing``):

* ``disk``: a sparse image on the machine's disk (``/var/lib/kvstream-testbed``) attached with
  ``losetup --direct-io=on``: the throttle is the limit (the 1:20 profiles).
* ``ram``: an image in ``/dev/shm`` attached *without* direct I/O, so the loop device reads RAM
  (its memcpy runs in a kernel worker): a device-speed tier, unthrottled or read-limited to a
  PFS-like rate. Mounted with ``discard``, so pages deleted from it give their RAM back.
* ``dir``: a plain directory on the machine's own disk (no loop device, never throttled): what a
  node's local file system does, page cache of the VM host included.
* ``gluster``: a real distributed file system on this machine (glusterfs.py: glusterd, one brick on
  an ext4 loop image, the volume mounted through FUSE), never throttled: the shared tier as a network
  file system serves it (the ``dfs`` profile). Its ``image`` field records the GlusterFS directory.

The state lives in ``/run/kvstream-testbed/<name>.json`` (tmpfs: it disappears at reboot, like the
loop devices). Commands are built by small pure functions (``*_cmd``) so they can be unit-tested.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from . import fio as _fio
from .glusterfs import GlusterError, GlusterFS

BLKIO_ROOT = "/sys/fs/cgroup/blkio"
STATE_DIR = "/run/kvstream-testbed"
IMAGE_DIR = "/var/lib/kvstream-testbed"  # disk images and dir tiers: on the machine's disk
RAM_IMAGE_DIR = "/dev/shm"  # images of ram tiers (tmpfs)
MOUNT_ROOT = "/mnt"
DEFAULT_NAME = "kvstream"
DEFAULT_TIER_BYTES = 16 << 30  # sparse image size per tier: room for the bench data set and the fio probe file
DEFAULT_RAM_TIER_BYTES = 6 << 30  # a ram tier only takes RAM for what is written, and its ext4 metadata
MB = 1_000_000  # profiles are in MB/s (decimal, like fio's and the paper's figures)


class TestbedError(RuntimeError):
    """The testbed cannot be built or used here; the message says why and how to fix it."""


# ----------------------------------------------------------------------------------------- profiles
@dataclass(frozen=True)
class TierLimit:
    read_bps: int  # 0: not throttled
    write_bps: int
    backing: str = "disk"  # disk | ram | dir (module docstring)


@dataclass(frozen=True)
class Profile:
    name: str
    tiers: tuple[TierLimit, ...]
    note: str = ""
    fio_iodepth: int = _fio.FIO_IODEPTH  # fio's requests in flight per tier: enough to reach the tier's rate
    fio_file_bytes: int = _fio.FIO_FILE_BYTES  # fio's probe file per tier

    @property
    def bound_read_bps(self) -> int:
        return sum(t.read_bps for t in self.tiers)

    @property
    def slowest_write_tier(self) -> int:
        return min(range(len(self.tiers)), key=lambda i: self.tiers[i].write_bps or float("inf"))  # 0: no limit


# The paper's testbeds scaled by 1/20 (tier 0 = local NVMe, tier 1 = the shared file system), and the
# device-speed testbeds: RAM-backed tiers (tier 0 unthrottled or Testbed-2 at 1/7), or the machine's disk.
DEVICE_FIO_IODEPTH = 32  # a RAM-backed or real device needs many requests in flight to reach its rate
RAM_FIO_FILE_BYTES = 512 << 20  # the probe file costs RAM on a ram tier
PROFILES: dict[str, Profile] = {
    "testbed2-1:20": Profile(
        "testbed2-1:20",
        (TierLimit(580 * MB, 255 * MB), TierLimit(180 * MB, 140 * MB)),
        "paper Testbed-2 (NVMe + Lustre) / 20",
    ),
    "testbed1-1:20": Profile(
        "testbed1-1:20",
        (TierLimit(685 * MB, 230 * MB), TierLimit(310 * MB, 355 * MB)),
        "paper Testbed-1 / 20",
    ),
    "ram-0.7": Profile(
        "ram-0.7",
        (TierLimit(0, 0, "ram"), TierLimit(700 * MB, 0, "ram")),
        "device speed: RAM-backed tier 0 unthrottled, tier 1 read-limited to a PFS-like 0.7 GB/s",
        DEVICE_FIO_IODEPTH, RAM_FIO_FILE_BYTES,
    ),
    "testbed2-1:7": Profile(
        "testbed2-1:7",
        (TierLimit(1650 * MB, 730 * MB, "ram"), TierLimit(515 * MB, 400 * MB, "ram")),
        "device speed: paper Testbed-2 (11.6 GB/s NVMe + 3.6 GB/s Lustre) / 7 on RAM-backed tiers",
        DEVICE_FIO_IODEPTH, RAM_FIO_FILE_BYTES,
    ),
    "dfs": Profile(
        "dfs",
        (TierLimit(0, 0, "dir"), TierLimit(0, 0, "gluster")),
        "a directory on the machine's disk beside GlusterFS 10.3 (one brick on an ext4 loop image, a FUSE "
        "mount) as the shared tier; both unthrottled, the daemons on the same cores as the bench",
        DEVICE_FIO_IODEPTH, RAM_FIO_FILE_BYTES,
    ),
    "disk+ram-0.7": Profile(
        "disk+ram-0.7",
        (TierLimit(0, 0, "dir"), TierLimit(700 * MB, 0, "ram")),
        "device speed: tier 0 a directory on the machine's own disk, tier 1 RAM-backed at 0.7 GB/s",
        DEVICE_FIO_IODEPTH, RAM_FIO_FILE_BYTES,
    ),
}


def parse_profile(spec: str) -> Profile:
    """A profile name from :data:`PROFILES`, or explicit tiers: ``"R0/W0,R1/W1"`` in MB/s
    (``"400/200,150/100"``; 0 = not throttled), each optionally prefixed by its backing
    (``"ram:0/0,ram:700/0"``), or ``dir`` for a directory on the machine's disk (``"dir,ram:700/0"``)."""
    if spec in PROFILES:
        return PROFILES[spec]
    tiers = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(?:(disk|ram):)?\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)\s*|\s*(dir)\s*", part)
        if not m:
            known = ", ".join(PROFILES)
            raise TestbedError(f"unknown testbed profile {spec!r}: use one of {known}, or 'R0/W0,R1/W1' in MB/s "
                               "(each optionally 'ram:R/W', or 'dir' for a directory on this machine's disk)")
        if m[4]:
            tiers.append(TierLimit(0, 0, "dir"))
        else:
            tiers.append(TierLimit(int(float(m[2]) * MB), int(float(m[3]) * MB), m[1] or "disk"))
    fast = any(t.backing != "disk" for t in tiers)  # device speed: fio needs the depth to reach the device
    return Profile(spec, tuple(tiers), "explicit limits", DEVICE_FIO_IODEPTH if fast else _fio.FIO_IODEPTH,
                   RAM_FIO_FILE_BYTES if fast else _fio.FIO_FILE_BYTES)


def parse_size(text: str) -> int:
    """``"16G"``, ``"512M"``, ``"4096"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise TestbedError(f"cannot parse size {text!r}: use e.g. 16G, 512M")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m[2].upper()]
    return int(float(m[1]) * scale)


# ------------------------------------------------------------------------------------- pure builders
def names(name: str, n_tiers: int, image_dir: str = IMAGE_DIR, ram_image_dir: str | None = None) -> dict:
    """Paths of a testbed called ``name``: images (disk and ram backings), the directories of dir
    tiers, mount points, cgroup, state file. Tier ``i`` of a kind uses that kind's entry ``i``."""
    suffix = "" if name == DEFAULT_NAME else f"-{name}"
    ram = RAM_IMAGE_DIR if ram_image_dir is None else ram_image_dir
    return {
        "images": [os.path.join(image_dir, f"{name}-tier{i}.img") for i in range(n_tiers)],
        "ram_images": [os.path.join(ram, f"{name}-tier{i}.img") for i in range(n_tiers)],
        "dir_tiers": [os.path.join(image_dir, f"{name}-tier{i}") for i in range(n_tiers)],
        "mounts": [os.path.join(MOUNT_ROOT, f"kvstream{suffix}", f"tier{i}") for i in range(n_tiers)],
        "cgroup": os.path.join(BLKIO_ROOT, f"kvstream{suffix}"),
        "state": os.path.join(STATE_DIR, f"{name}.json"),
    }


def losetup_attach_cmd(image: str, direct_io: bool = True) -> list[str]:
    # --direct-io=on: the loop device reads its image with O_DIRECT, so the host page cache of the
    # image file never serves (and never inflates) a tier's reads. A ram tier's image is in tmpfs,
    # whose page cache *is* the storage: without direct I/O the device reads RAM.
    return ["losetup", *(["--direct-io=on"] if direct_io else []), "--find", "--show", image]


def losetup_detach_cmd(device: str) -> list[str]:
    return ["losetup", "--detach", device]


def mkfs_cmd(device: str, label: str) -> list[str]:
    # Eager inode-table and journal init: a lazily initialized ext4 zeroes its tables in the background
    # for minutes after mount, which would steal device bandwidth from the first measurements.
    return ["mkfs.ext4", "-q", "-F", "-m", "0", "-L", label, "-E", "lazy_itable_init=0,lazy_journal_init=0", device]


def mount_cmd(device: str, mountpoint: str, discard: bool = False) -> list[str]:
    # discard (ram tiers): a deleted file's blocks are punched out of the tmpfs image, so its RAM comes back
    return ["mount", "-o", "noatime,discard" if discard else "noatime", device, mountpoint]


def umount_cmd(mountpoint: str) -> list[str]:
    return ["umount", mountpoint]


def throttle_line(devnum: str, bps: int) -> str:
    """The blkio throttle rule ``"MAJOR:MINOR BYTES_PER_S"`` (0 removes the rule)."""
    return f"{devnum} {int(bps)}"


def throttle_writes(cgroup: str, devnums: Sequence[str], profile: Profile) -> list[tuple[str, str]]:
    """``(file, line)`` pairs that apply ``profile`` to the devices, tier by tier (a limit of 0 removes
    the rule: not throttled). A dir tier has no device of its own (devnum ``""``): no rule."""
    if len(devnums) != len(profile.tiers):
        raise TestbedError(f"profile {profile.name} has {len(profile.tiers)} tiers, testbed has {len(devnums)}")
    out = []
    for dev, lim in zip(devnums, profile.tiers):
        if not dev:
            continue
        out.append((os.path.join(cgroup, "blkio.throttle.read_bps_device"), throttle_line(dev, lim.read_bps)))
        out.append((os.path.join(cgroup, "blkio.throttle.write_bps_device"), throttle_line(dev, lim.write_bps)))
    return out


# --------------------------------------------------------------------------------------- preflight
def preflight(image_dir: str = IMAGE_DIR, *, need_fio: bool = True) -> list[str]:
    """Everything that stops :func:`up` here, each as one line with its fix. Empty list: ready."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root: loop devices, mount and cgroups need root. "
                        f"Fix: sudo {_self_command()} testbed up ...")
    for tool, pkg in (("losetup", "util-linux"), ("mkfs.ext4", "e2fsprogs"), ("mount", "mount")):
        if shutil.which(tool, path=_tool_path()) is None:
            problems.append(f"{tool} not found. Fix: apt-get install {pkg}")
    if need_fio and not _fio.available():
        problems.append("fio not found (it puts the physical bound on record). Fix: apt-get install fio, or --no-fio")
    if not os.path.exists("/dev/loop-control"):
        problems.append(
            "no loop devices (/dev/loop-control missing). Fix: modprobe loop; in a container run it with "
            "--privileged (or --device /dev/loop-control plus /dev/loopN)"
        )
    if not os.path.exists(os.path.join(BLKIO_ROOT, "blkio.throttle.read_bps_device")):
        problems.append(
            f"no cgroup v1 blkio controller at {BLKIO_ROOT} (a cgroup-v2-only host?). Fix: boot with "
            "systemd.unified_cgroup_hierarchy=0, or mount it: mkdir -p /sys/fs/cgroup/blkio && "
            "mount -t cgroup -o blkio none /sys/fs/cgroup/blkio (fails if blkio is bound to cgroup v2)"
        )
    return problems


# ------------------------------------------------------------------------------------------- state
@dataclass
class Tier:
    image: str  # "" for a dir tier
    device: str  # "" for a dir tier
    devnum: str  # "MAJOR:MINOR"; "" for a dir tier (no throttle)
    mount: str  # the tier's directory: a mount point, or the dir tier itself
    size: int
    backing: str = "disk"


@dataclass
class Testbed:
    """A testbed that is up (as recorded in its state file)."""

    name: str
    profile: Profile
    cgroup: str
    tiers: list[Tier]
    state_path: str
    fio: dict = field(default_factory=dict)  # {"read": {job: MB/s}, "write": {...}, "bs": bytes, "iodepth": n}
    created: float = field(default_factory=time.time)

    @property
    def dirs(self) -> list[str]:
        return [t.mount for t in self.tiers]

    # -- throttles -------------------------------------------------------------------------------
    def apply(self, profile: Profile) -> None:
        for path, line in throttle_writes(self.cgroup, [t.devnum for t in self.tiers], profile):
            _write(path, line)
        if profile != self.profile:
            self.fio = {}  # figures of the previous limits are no longer on record
        self.profile = profile

    def set_read_bps(self, tier: int, bps: int) -> None:
        _write(os.path.join(self.cgroup, "blkio.throttle.read_bps_device"), throttle_line(self.tiers[tier].devnum, bps))

    def set_write_bps(self, tier: int, bps: int) -> None:
        _write(os.path.join(self.cgroup, "blkio.throttle.write_bps_device"), throttle_line(self.tiers[tier].devnum, bps))

    def limits(self) -> dict[str, dict[str, int]]:
        """The live rules, ``{"read": {devnum: bps}, "write": {...}}`` (read back from the cgroup)."""
        out = {}
        for kind in ("read", "write"):
            rules = {}
            with open(os.path.join(self.cgroup, f"blkio.throttle.{kind}_bps_device")) as f:
                for line in f:
                    dev, _, bps = line.strip().partition(" ")
                    if bps:
                        rules[dev] = int(bps)
            out[kind] = rules
        return out

    def join(self, pid: int | None = None) -> None:
        """Move ``pid`` (default: this process, all its threads) into the throttled group."""
        _write(os.path.join(self.cgroup, "cgroup.procs"), str(pid or os.getpid()))

    def joined_preexec(self) -> Callable[[], None]:
        """A ``preexec_fn`` putting a child process into the group before it execs."""
        procs = os.path.join(self.cgroup, "cgroup.procs")
        return lambda: _write(procs, str(os.getpid()))

    # -- fio -------------------------------------------------------------------------------------
    def probe_files(self) -> list[str]:
        return [os.path.join(t.mount, ".fio-probe") for t in self.tiers]

    def measure(self, bs: int, *, runtime_s: float = _fio.FIO_RUNTIME_S, iodepth: int | None = None,
                log: Callable[[str], None] = print) -> dict:
        """fio writes and reads of each tier alone, then all tiers at once, inside the group
        (``iodepth`` default: the profile's)."""
        iodepth = iodepth or self.profile.fio_iodepth
        files = self.probe_files()
        pre = self.joined_preexec()
        size = self.profile.fio_file_bytes
        _fio.fill(files, bs, size, iodepth, preexec_fn=pre)
        result: dict = {"bs": bs, "iodepth": iodepth, "runtime_s": runtime_s}
        for rw, kind in (("write", "write"), ("randread", "read")):
            result[kind] = _fio.alone_and_together(files, rw, bs, size=size, iodepth=iodepth, runtime_s=runtime_s,
                                                   preexec_fn=pre, log=log)
        self.fio = result
        self.save()
        return result

    # -- persistence -----------------------------------------------------------------------------
    def save(self) -> None:
        os.makedirs(os.path.dirname(self.state_path), exist_ok=True)
        doc = asdict(self)
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, self.state_path)

    @classmethod
    def load(cls, name: str = DEFAULT_NAME) -> "Testbed | None":
        path = os.path.join(STATE_DIR, f"{name}.json")
        try:
            with open(path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return None
        prof = dict(doc["profile"])
        prof["tiers"] = tuple(TierLimit(**t) for t in prof["tiers"])
        doc["profile"] = Profile(**prof)
        doc["tiers"] = [Tier(**t) for t in doc["tiers"]]
        return cls(**doc)

    def problems(self) -> list[str]:
        """What is wrong with a recorded testbed now (unmounted, detached, group gone). Empty: healthy."""
        out = []
        mounted = _mounts()
        for i, t in enumerate(self.tiers):
            if t.backing == "gluster":
                if not mounted.get(t.mount, "").endswith(f":/{_gluster_volume(self.name)}"):
                    out.append(f"tier{i}: GlusterFS is not mounted on {t.mount}")
                continue
            if t.backing == "dir":
                if not os.path.isdir(t.mount):
                    out.append(f"tier{i}: directory {t.mount} is missing")
                continue
            if mounted.get(t.mount) != t.device:
                out.append(f"tier{i}: {t.device} is not mounted on {t.mount}")
            if _backing_file(t.device) != t.image:
                out.append(f"tier{i}: {t.device} is not attached to {t.image}")
        if not os.path.isdir(self.cgroup):
            out.append(f"cgroup {self.cgroup} is missing")
        return out


# ------------------------------------------------------------------------------------------ up/down
def up(profile: Profile, *, name: str = DEFAULT_NAME, sizes: Sequence[int] | None = None, image_dir: str = IMAGE_DIR,
       ram_image_dir: str = RAM_IMAGE_DIR, fio_bs: int | None = 8 << 20, fio_runtime_s: float = _fio.FIO_RUNTIME_S,
       log: Callable[[str], None] = print) -> Testbed:
    """Build (or re-profile) the testbed and put fio's figures on record. ``fio_bs=None`` skips fio.

    An existing healthy testbed of the same name and the same tiers (count and backing) is reused:
    only its throttles change (and fio runs again). A broken one is torn down first. Anything
    half-built is undone on failure. ``sizes``: image bytes per tier (default 16 GiB on disk, 6 GiB
    in RAM, sparse; unused for a dir tier).
    Raises :class:`TestbedError` with the reasons and fixes when this host cannot run it.
    """
    n = len(profile.tiers)
    problems = preflight(image_dir, need_fio=fio_bs is not None)
    if problems:
        raise TestbedError("cannot build the testbed here:\n  - " + "\n  - ".join(problems))
    backings = [t.backing for t in profile.tiers]
    existing = Testbed.load(name)
    if existing is not None:
        if [t.backing for t in existing.tiers] == backings and not existing.problems():
            log(f"testbed {name!r} is up ({existing.profile.name}); applying {profile.name}")
            existing.apply(profile)
            existing.save()
            if fio_bs is not None:
                existing.measure(fio_bs, runtime_s=fio_runtime_s, log=log)
            return existing
        log(f"testbed {name!r} exists but is broken or has other tiers: tearing it down first")
        down(name, image_dir=image_dir, ram_image_dir=ram_image_dir, log=log)
    sizes = list(sizes or [DEFAULT_RAM_TIER_BYTES if b == "ram" else DEFAULT_TIER_BYTES for b in backings])
    if len(sizes) != n:
        raise TestbedError(f"{len(sizes)} sizes given for {n} tiers")
    paths = names(name, n, image_dir, ram_image_dir)
    os.makedirs(image_dir, exist_ok=True)
    for where, kind in ((image_dir, "disk"), (ram_image_dir, "ram")):
        want = sum(sz for sz, b in zip(sizes, backings) if b == kind)
        free = shutil.disk_usage(where).free if want else 0
        if want > free:
            log(f"warning: {kind} images total {want >> 30} GiB (sparse) but {where} has {free >> 30} GiB free")
    bed = Testbed(name, profile, paths["cgroup"], [], paths["state"])
    try:
        bed.save()  # recorded first, so that down() can clean up whatever the next steps leave
        for i, backing in enumerate(backings):
            if backing == "gluster":
                fs = GlusterFS(paths["dir_tiers"][i] + "-gluster", _gluster_volume(name), sizes[i])
                bed.tiers.append(Tier(fs.root, "", "", fs.mount("a"), sizes[i], backing))
                bed.save()
                try:
                    fs.start()
                except GlusterError as exc:
                    raise TestbedError(f"tier{i}: GlusterFS: {exc}") from None
                bed.tiers[i].device = fs.loop or ""
                bed.save()
                continue
            if backing == "dir":
                d = paths["dir_tiers"][i]
                bed.tiers.append(Tier("", "", "", d, 0, backing))
                bed.save()
                os.makedirs(d, exist_ok=True)
                continue
            ram = backing == "ram"
            image, mnt = paths["ram_images" if ram else "images"][i], paths["mounts"][i]
            _make_image(image, sizes[i])
            device = _run(losetup_attach_cmd(image, direct_io=not ram)).strip()
            bed.tiers.append(Tier(image, device, "", mnt, sizes[i], backing))
            bed.save()
            if not ram and _dio(device) != "1":
                log(f"warning: {device} did not enable direct I/O (backing fs block size?); host page cache may serve reads")
            _run(mkfs_cmd(device, f"kvs-{name[:8]}-t{i}"))
            os.makedirs(mnt, exist_ok=True)
            _run(mount_cmd(device, mnt, discard=ram))
            bed.tiers[i].devnum = _devnum(device)
            bed.save()
        os.makedirs(bed.cgroup, exist_ok=True)
        bed.apply(profile)
        bed.save()
        log(f"testbed {name!r} up: " + ", ".join(f"tier{i} {t.mount} ({t.device or 'directory'} {t.devnum}, {t.backing})"
                                                 for i, t in enumerate(bed.tiers)) + f"; blkio group {bed.cgroup}")
        for i, lim in enumerate(profile.tiers):
            log(f"  tier{i} throttle: read {_limit_text(lim.read_bps)}, write {_limit_text(lim.write_bps)}")
        if fio_bs is not None:
            bed.measure(fio_bs, runtime_s=fio_runtime_s, log=log)
    except BaseException:
        with suppress(Exception):  # the original error is the one worth seeing
            down(name, image_dir=image_dir, ram_image_dir=ram_image_dir, log=log)
        raise
    return bed


def _make_image(path: str, size: int) -> None:
    """A sparse image of ``size`` bytes at ``path``, a new file of this user's, or its own left by a run cut short.
    A ram tier's is in /dev/shm, which every user writes: its name is known in advance, and open(path, "wb")
    followed a link another user put there (the target, a file only root may write, was truncated, then
    formatted through the loop device) or took a file of theirs for the image (theirs to read and rewrite under
    the mounted tier). Never a link (O_NOFOLLOW), never another owner's file, nor one with other names.
    :raises TestbedError: something else has the name (what, and the fix)."""
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (O_NONBLOCK: a FIFO there never waits)
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = os.open(path, flags)
    except OSError as exc:
        raise TestbedError(f"cannot make the tier image {path}: {exc.strerror} (a link or a special file there is "
                           f"not made by the testbed: rm {path}, then run again)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise TestbedError(f"the tier image {path} exists and is not a file of this user's alone (uid "
                               f"{st.st_uid}, {st.st_nlink} names): another user may have put it there; rm {path}, "
                               "then run again")
        os.ftruncate(fd, 0)  # (a leftover's old file system goes: mkfs makes a new one)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _limit_text(bps: int) -> str:
    return f"{bps / MB:.0f} MB/s" if bps else "not throttled"


def down(name: str = DEFAULT_NAME, *, image_dir: str = IMAGE_DIR, ram_image_dir: str = RAM_IMAGE_DIR,
         log: Callable[[str], None] = print) -> bool:
    """Tear the testbed down: idempotent, and safe on a half-built one. Returns True if anything was removed.

    Without a state file it still looks for this name's images, dir tiers, mounts and group at the
    default places.
    """
    bed = Testbed.load(name)
    n_guess = max(2, len(bed.tiers) if bed else 0)
    paths = names(name, n_guess, image_dir, ram_image_dir)
    recorded = bed.tiers if bed else []
    # The recorded tiers plus this name's default places: a half-built testbed may have created an
    # image or a directory before recording it.
    for t in recorded:
        if t.backing == "gluster":
            GlusterFS(t.image, _gluster_volume(name)).stop()
            removed = True
    recorded = [t for t in recorded if t.backing != "gluster"]
    images = _unique([t.image for t in recorded if t.image]
                     + [p for p in paths["images"] + paths["ram_images"] if _own_file(p)])
    dir_tiers = _unique([t.mount for t in recorded if t.backing == "dir"]
                        + [p for p in paths["dir_tiers"] if os.path.isdir(p)])
    mounts = _unique([t.mount for t in recorded if t.backing != "dir"] + paths["mounts"])
    cgroup = bed.cgroup if bed else paths["cgroup"]
    removed = False
    mounted = _mounts()
    for mnt in mounts:
        if mnt in mounted:
            _run(umount_cmd(mnt))
            removed = True
        with suppress(FileNotFoundError, OSError):  # not empty or already gone: leave it
            os.rmdir(mnt)
    with suppress(FileNotFoundError, OSError):
        os.rmdir(os.path.dirname(paths["mounts"][0]))
    for image in images:
        for dev in _devices_of(image):
            _run(losetup_detach_cmd(dev))
            removed = True
        if os.path.exists(image):
            os.unlink(image)
            removed = True
    for d in dir_tiers:
        if os.path.isdir(d):
            shutil.rmtree(d)
            removed = True
    if os.path.isdir(cgroup):
        _empty_cgroup(cgroup)
        os.rmdir(cgroup)
        removed = True
    path = bed.state_path if bed else paths["state"]
    if os.path.exists(path):
        os.unlink(path)
        removed = True
    log(f"testbed {name!r} down" if removed else f"testbed {name!r} was not up: nothing to do")
    return removed


def status(name: str = DEFAULT_NAME) -> dict:
    """The recorded testbed with its live state: ``{"up": bool, ...}``."""
    bed = Testbed.load(name)
    if bed is None:
        return {"up": False, "name": name}
    doc = asdict(bed)
    doc["up"] = True
    doc["problems"] = bed.problems()
    with suppress(OSError):
        doc["live_limits"] = bed.limits()
    return doc


# ----------------------------------------------------------------------------------------- helpers
def _gluster_volume(name: str) -> str:
    return f"kvs-{name}"


def _unique(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


# A user's PATH (Debian, `su` without `-`) has no sbin: losetup and mkfs.ext4 are there, installed
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def _tool_path() -> str:
    """PATH with the sbin directories it lacks appended: where the testbed's tools are looked for and run."""
    dirs = [d for d in os.environ.get("PATH", os.defpath).split(os.pathsep) if d]
    return os.pathsep.join(dirs + [d for d in SBIN if d not in dirs])


def _self_command() -> str:
    """How sudo runs this command: the full path of a `kvstream` outside sudo's secure_path (a venv's,
    as the README runs it), else its name."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "kvstream" and os.path.isfile(argv0):
        return os.path.abspath(argv0)
    return "kvstream"


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PATH=_tool_path()))
    if proc.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _write(path: str, text: str) -> None:
    # One write(2) per rule: cgroup files parse each write as one command.
    with open(path, "w") as f:
        f.write(text)


def _devnum(device: str) -> str:
    st = os.stat(device)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def _dio(device: str) -> str:
    try:
        with open(f"/sys/block/{os.path.basename(device)}/loop/dio") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _backing_file(device: str) -> str | None:
    try:
        with open(f"/sys/block/{os.path.basename(device)}/loop/backing_file") as f:
            return f.read().strip()
    except OSError:
        return None


def _own_file(path: str) -> bool:
    """``path`` is a file of this user's (lstat: never a link's target). At /dev/shm's known names, another user's
    link to an image a loop device reads had that device detached by down() (losetup -j follows links)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _devices_of(image: str) -> list[str]:
    """Loop devices attached to ``image`` (``losetup -j``)."""
    if not os.path.exists(image):
        return []
    out = _run(["losetup", "-j", image])
    return [line.split(":", 1)[0] for line in out.splitlines() if line.strip()]


def _mounts() -> dict[str, str]:
    """``{mount point: device}`` from /proc/self/mounts."""
    out = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt = line.split()[:2]
            out[mnt.replace("\\040", " ")] = dev
    return out


def _empty_cgroup(cgroup: str) -> None:
    """Move every process still in ``cgroup`` back to the root group (rmdir needs it empty)."""
    root_procs = os.path.join(os.path.dirname(cgroup), "cgroup.procs")
    with open(os.path.join(cgroup, "cgroup.procs")) as f:
        pids = [p for p in f.read().split() if p]
    for pid in pids:
        with suppress(ProcessLookupError, OSError):  # exited meanwhile
            _write(root_procs, pid)


def leave(pid: int | None = None) -> None:
    """Move ``pid`` (default: this process) back to the root blkio group."""
    _write(os.path.join(BLKIO_ROOT, "cgroup.procs"), str(pid or os.getpid()))
