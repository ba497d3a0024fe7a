"""A throttled multi-tier testbed on one host: loop devices, ext4, cgroup v1 blkio throttles, fio on record.

Lifecycle (every step is undone by :func:`down`, which is idempotent and also cleans half-built testbeds)::

    up(profile)     preflight -> per tier: sparse image -> losetup --direct-io=on -> mkfs.ext4 -> mount
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

The state lives in ``/run/kvstream-testbed/<name>.json`` (tmpfs: it disappears at reboot, like the
loop devices). Commands are built by small pure functions (``*_cmd``) so they can be unit-tested.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from . import fio as _fio

BLKIO_ROOT = "/sys/fs/cgroup/blkio"
STATE_DIR = "/run/kvstream-testbed"
IMAGE_DIR = "/var/lib/kvstream-testbed"
MOUNT_ROOT = "/mnt"
DEFAULT_NAME = "kvstream"
DEFAULT_TIER_BYTES = 16 << 30  # sparse image size per tier: room for the bench data set and the fio probe file
MB = 1_000_000  # profiles are in MB/s (decimal, like fio's and the paper's figures)


class TestbedError(RuntimeError):
    """The testbed cannot be built or used here; the message says why and how to fix it."""


# ----------------------------------------------------------------------------------------- profiles
@dataclass(frozen=True)
class TierLimit:
    read_bps: int
    write_bps: int


@dataclass(frozen=True)
class Profile:
    name: str
    tiers: tuple[TierLimit, ...]
    note: str = ""

    @property
    def bound_read_bps(self) -> int:
        return sum(t.read_bps for t in self.tiers)

    @property
    def slowest_write_tier(self) -> int:
        return min(range(len(self.tiers)), key=lambda i: self.tiers[i].write_bps)


# The paper's testbeds scaled by 1/20 (tier 0 = local NVMe, tier 1 = the shared file system).
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
}


def parse_profile(spec: str) -> Profile:
    """A profile name from :data:`PROFILES`, or explicit limits ``"R0/W0,R1/W1"`` in MB/s (``"400/200,150/100"``)."""
    if spec in PROFILES:
        return PROFILES[spec]
    tiers = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)\s*", part)
        if not m:
            known = ", ".join(PROFILES)
            raise TestbedError(f"unknown testbed profile {spec!r}: use one of {known}, or 'R0/W0,R1/W1' in MB/s")
        tiers.append(TierLimit(int(float(m[1]) * MB), int(float(m[2]) * MB)))
    return Profile(spec, tuple(tiers), "explicit limits")


def parse_size(text: str) -> int:
    """``"16G"``, ``"512M"``, ``"4096"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise TestbedError(f"cannot parse size {text!r}: use e.g. 16G, 512M")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m[2].upper()]
    return int(float(m[1]) * scale)


# ------------------------------------------------------------------------------------- pure builders
def names(name: str, n_tiers: int, image_dir: str = IMAGE_DIR) -> dict:
    """Paths of a testbed called ``name``: images, mount points, cgroup, state file."""
    suffix = "" if name == DEFAULT_NAME else f"-{name}"
    return {
        "images": [os.path.join(image_dir, f"{name}-tier{i}.img") for i in range(n_tiers)],
        "mounts": [os.path.join(MOUNT_ROOT, f"kvstream{suffix}", f"tier{i}") for i in range(n_tiers)],
        "cgroup": os.path.join(BLKIO_ROOT, f"kvstream{suffix}"),
        "state": os.path.join(STATE_DIR, f"{name}.json"),
    }


def losetup_attach_cmd(image: str) -> list[str]:
    # --direct-io=on: the loop device reads its image with O_DIRECT, so the host page cache of the
    # image file never serves (and never inflates) a tier's reads.
    return ["losetup", "--direct-io=on", "--find", "--show", image]


def losetup_detach_cmd(device: str) -> list[str]:
    return ["losetup", "--detach", device]


def mkfs_cmd(device: str, label: str) -> list[str]:
    # Eager inode-table and journal init: a lazily initialized ext4 zeroes its tables in the background
    # for minutes after mount, which would steal device bandwidth from the first measurements.
    return ["mkfs.ext4", "-q", "-F", "-m", "0", "-L", label, "-E", "lazy_itable_init=0,lazy_journal_init=0", device]


def mount_cmd(device: str, mountpoint: str) -> list[str]:
    return ["mount", "-o", "noatime", device, mountpoint]


def umount_cmd(mountpoint: str) -> list[str]:
    return ["umount", mountpoint]


def throttle_line(devnum: str, bps: int) -> str:
    """The blkio throttle rule ``"MAJOR:MINOR BYTES_PER_S"`` (0 removes the rule)."""
    return f"{devnum} {int(bps)}"


def throttle_writes(cgroup: str, devnums: Sequence[str], profile: Profile) -> list[tuple[str, str]]:
    """``(file, line)`` pairs that apply ``profile`` to the devices, tier by tier."""
    if len(devnums) != len(profile.tiers):
        raise TestbedError(f"profile {profile.name} has {len(profile.tiers)} tiers, testbed has {len(devnums)}")
    out = []
    for dev, lim in zip(devnums, profile.tiers):
        out.append((os.path.join(cgroup, "blkio.throttle.read_bps_device"), throttle_line(dev, lim.read_bps)))
        out.append((os.path.join(cgroup, "blkio.throttle.write_bps_device"), throttle_line(dev, lim.write_bps)))
    return out


# --------------------------------------------------------------------------------------- preflight
def preflight(image_dir: str = IMAGE_DIR, *, need_fio: bool = True) -> list[str]:
    """Everything that stops :func:`up` here, each as one line with its fix. Empty list: ready."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root: loop devices, mount and cgroups need root. Fix: sudo kvstream testbed up ...")
    for tool, pkg in (("losetup", "util-linux"), ("mkfs.ext4", "e2fsprogs"), ("mount", "mount")):
        if shutil.which(tool) is None:
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
    image: str
    device: str
    devnum: str  # "MAJOR:MINOR"
    mount: str
    size: int


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

    def measure(self, bs: int, *, runtime_s: float = _fio.FIO_RUNTIME_S, iodepth: int = _fio.FIO_IODEPTH,
                log: Callable[[str], None] = print) -> dict:
        """fio writes and reads of each tier alone, then all tiers at once, inside the group."""
        files = self.probe_files()
        n = len(files)
        pre = self.joined_preexec()
        fill = [_fio.FioJob(f"fill{i}", f, "write", bs, runtime_s=None, iodepth=iodepth) for i, f in enumerate(files)]
        _fio.run(fill, preexec_fn=pre)  # probe files exist and are allocated before anything is timed
        result: dict = {"bs": bs, "iodepth": iodepth, "runtime_s": runtime_s, "read": {}, "write": {}}
        for rw, key, kind in (("write", "write_bps", "write"), ("randread", "read_bps", "read")):
            for i in range(n):
                job = _fio.FioJob(f"tier{i}", files[i], rw, bs, iodepth=iodepth, runtime_s=runtime_s)
                result[kind][f"tier{i}"] = _fio.summarize(_fio.run([job], preexec_fn=pre), key)[f"tier{i}"]
                log(f"  fio {kind:5s} tier{i} alone: {result[kind][f'tier{i}']:8.1f} MB/s")
            jobs = [_fio.FioJob(f"tier{i}+", files[i], rw, bs, iodepth=iodepth, runtime_s=runtime_s) for i in range(n)]
            both = _fio.summarize(_fio.run(jobs, preexec_fn=pre), key)
            result[kind].update(both)
            result[kind]["all"] = round(sum(both.values()), 1)
            log(f"  fio {kind:5s} all at once: " + ", ".join(f"{k} {v:.1f}" for k, v in both.items())
                + f" -> {result[kind]['all']:.1f} MB/s")
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
        prof = doc["profile"]
        doc["profile"] = Profile(prof["name"], tuple(TierLimit(**t) for t in prof["tiers"]), prof.get("note", ""))
        doc["tiers"] = [Tier(**t) for t in doc["tiers"]]
        return cls(**doc)

    def problems(self) -> list[str]:
        """What is wrong with a recorded testbed now (unmounted, detached, group gone). Empty: healthy."""
        out = []
        mounted = _mounts()
        for i, t in enumerate(self.tiers):
            if mounted.get(t.mount) != t.device:
                out.append(f"tier{i}: {t.device} is not mounted on {t.mount}")
            if _backing_file(t.device) != t.image:
                out.append(f"tier{i}: {t.device} is not attached to {t.image}")
        if not os.path.isdir(self.cgroup):
            out.append(f"cgroup {self.cgroup} is missing")
        return out


# ------------------------------------------------------------------------------------------ up/down
def up(profile: Profile, *, name: str = DEFAULT_NAME, sizes: Sequence[int] | None = None, image_dir: str = IMAGE_DIR,
       fio_bs: int | None = 8 << 20, fio_runtime_s: float = _fio.FIO_RUNTIME_S,
       log: Callable[[str], None] = print) -> Testbed:
    """Build (or re-profile) the testbed and put fio's figures on record. ``fio_bs=None`` skips fio.

    An existing healthy testbed of the same name and tier count is reused: only its throttles change
    (and fio runs again). A broken one is torn down first. Anything half-built is undone on failure.
    Raises :class:`TestbedError` with the reasons and fixes when this host cannot run it.
    """
    n = len(profile.tiers)
    problems = preflight(image_dir, need_fio=fio_bs is not None)
    if problems:
        raise TestbedError("cannot build the testbed here:\n  - " + "\n  - ".join(problems))
    existing = Testbed.load(name)
    if existing is not None:
        if len(existing.tiers) == n and not existing.problems():
            log(f"testbed {name!r} is up ({existing.profile.name}); applying {profile.name}")
            existing.apply(profile)
            existing.save()
            if fio_bs is not None:
                existing.measure(fio_bs, runtime_s=fio_runtime_s, log=log)
            return existing
        log(f"testbed {name!r} exists but is broken or has another tier count: tearing it down first")
        down(name, image_dir=image_dir, log=log)
    sizes = list(sizes or [DEFAULT_TIER_BYTES] * n)
    if len(sizes) != n:
        raise TestbedError(f"{len(sizes)} sizes given for {n} tiers")
    paths = names(name, n, image_dir)
    os.makedirs(image_dir, exist_ok=True)
    free = shutil.disk_usage(image_dir).free
    if sum(sizes) > free:
        log(f"warning: images total {sum(sizes) >> 30} GiB (sparse) but {image_dir} has {free >> 30} GiB free")
    bed = Testbed(name, profile, paths["cgroup"], [], paths["state"])
    try:
        bed.save()  # recorded first, so that down() can clean up whatever the next steps leave
        for i in range(n):
            image, mnt = paths["images"][i], paths["mounts"][i]
            with open(image, "wb") as f:
                f.truncate(sizes[i])
            device = _run(losetup_attach_cmd(image)).strip()
            bed.tiers.append(Tier(image, device, "", mnt, sizes[i]))
            bed.save()
            if _dio(device) != "1":
                log(f"warning: {device} did not enable direct I/O (backing fs block size?); host page cache may serve reads")
            _run(mkfs_cmd(device, f"kvs-{name[:8]}-t{i}"))
            os.makedirs(mnt, exist_ok=True)
            _run(mount_cmd(device, mnt))
            bed.tiers[i].devnum = _devnum(device)
            bed.save()
        os.makedirs(bed.cgroup, exist_ok=True)
        bed.apply(profile)
        bed.save()
        log(f"testbed {name!r} up: " + ", ".join(f"tier{i} {t.mount} ({t.device} {t.devnum})" for i, t in enumerate(bed.tiers))
            + f"; blkio group {bed.cgroup}")
        for i, lim in enumerate(profile.tiers):
            log(f"  tier{i} throttle: read {lim.read_bps / MB:.0f} MB/s, write {lim.write_bps / MB:.0f} MB/s")
        if fio_bs is not None:
            bed.measure(fio_bs, runtime_s=fio_runtime_s, log=log)
    except BaseException:
        with suppress(Exception):  # the original error is the one worth seeing
            down(name, image_dir=image_dir, log=log)
        raise
    return bed


def down(name: str = DEFAULT_NAME, *, image_dir: str = IMAGE_DIR, log: Callable[[str], None] = print) -> bool:
    """Tear the testbed down: idempotent, and safe on a half-built one. Returns True if anything was removed.

    Without a state file it still looks for this name's images, mounts and group at the default places.
    """
    bed = Testbed.load(name)
    n_guess = max(2, len(bed.tiers) if bed else 0)
    paths = names(name, n_guess, image_dir)
    # The recorded tiers plus this name's default places: a half-built testbed may have created an
    # image before recording it.
    images = _unique(([t.image for t in bed.tiers] if bed else []) + [p for p in paths["images"] if os.path.exists(p)])
    mounts = _unique(([t.mount for t in bed.tiers] if bed else []) + paths["mounts"])
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
        os.rmdir(os.path.dirname(mounts[0]))
    for image in images:
        for dev in _devices_of(image):
            _run(losetup_detach_cmd(dev))
            removed = True
        if os.path.exists(image):
            os.unlink(image)
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
def _unique(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
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
