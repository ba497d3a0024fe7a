"""GlusterFS on one machine: a real distributed file system, mounted twice as two nodes would.

One ``glusterd`` with its own volfile and working directory, one brick on an ext4 loop image, one
volume, and two FUSE clients (``mount -t glusterfs``) at ``<root>/a`` and ``<root>/b``: two independent
clients with their own caches, so what one node does (a rename, an unlink) reaches the other as on a
cluster (ESTALE on a descriptor the other had open, a metadata cache about 1 s behind). Used by the
test suite's ``glusterfs`` fixture and by ``kvstream testbed up --profile dfs``.

Life cycle::

    start()   lock -> glusterd -> loop image, mkfs.ext4, mount -> volume create + start -> mount a, b
    stop()    unmount a, b -> stop the brick, the clients and glusterd by PID -> unmount the brick,
              detach the loop device -> remove the working tree

Faults for tests: ``kill_client(node)`` (its mount answers ENOTCONN until ``remount(node)``),
``kill_brick()`` / ``start_brick()`` (readers get ENOTCONN, then recover).

glusterd listens on TCP 24007 whatever its volfile says (the brick and the clients fetch their
volfiles there), so one glusterd per machine: ``start`` holds an flock on :data:`LOCK_PATH` until
``stop`` (a second test session waits for the first).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time

LOCK_PATH = "/var/tmp/kvstream-glusterd.lock"
LOCK_WAIT_S = 900.0  # another session's GlusterFS tests run meanwhile (a whole suite takes minutes)
READY_S = 60.0
NODES = ("a", "b")
TOOLS = ("glusterd", "gluster", "mount.glusterfs", "losetup", "mkfs.ext4", "mount", "umount")


class GlusterError(RuntimeError):
    pass


def unavailable() -> str | None:
    """None when GlusterFS can run here, else why not (for a skip, or ``testbed up``'s message)."""
    if os.geteuid() != 0:
        return "needs root (glusterd, FUSE mounts, a loop device)"
    missing = [t for t in TOOLS if shutil.which(t) is None and not os.path.exists(f"/sbin/{t}")]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install glusterfs-server glusterfs-client)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def _run(cmd: list[str], timeout: float = 60.0) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise GlusterError(f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def _host() -> str:
    """A name of this machine that resolves (gluster refuses a brick on 'localhost' without force and
    compares brick hosts by name)."""
    name = socket.gethostname()
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop_pid(pid: int | None, sig: int = signal.SIGTERM, wait_s: float = 5.0) -> None:
    """Signal ``pid`` and wait for it to go; SIGKILL after ``wait_s``. Never raises."""
    if not pid:
        return
    for s in (sig, signal.SIGKILL):
        try:
            os.kill(pid, s)
        except OSError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.05)


def _mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


class GlusterFS:
    """A one-machine GlusterFS under ``root``: ``mount(node)`` is the path node ``a`` or ``b`` sees."""

    def __init__(self, root: str, volume: str = "kvstream", brick_bytes: int = 2 << 30):
        self.root = os.path.abspath(root)
        self.volume = volume
        self.brick_bytes = brick_bytes
        self.host = _host()
        self.work = os.path.join(self.root, "glusterd")
        self.socket = os.path.join(self.root, "glusterd.socket")
        self.brick_mnt = os.path.join(self.root, "brick")
        self.image = os.path.join(self.root, "brick.img")
        self.loop: str | None = None
        self.glusterd_pid: int | None = None
        self._lock_fd: int | None = None
        self.devs: dict[str, int] = {}  # node -> device number of its mount

    # -- paths and processes --------------------------------------------------------------------
    def mount(self, node: str) -> str:
        return os.path.join(self.root, node)

    @property
    def brick(self) -> str:
        return os.path.join(self.brick_mnt, "b")

    def cli(self, *args: str, timeout: float = 60.0) -> str:
        return _run(["gluster", f"--glusterd-sock={self.socket}", "--mode=script", *args], timeout=timeout)

    def _pids(self, needle: str) -> list[int]:
        """Live processes of this GlusterFS whose command line holds ``needle`` (a path of ours)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv and os.path.basename(argv[0]).startswith(b"gluster") and needle.encode() in argv \
                    and _alive(int(entry)):
                pids.append(int(entry))
        return pids

    def client_pid(self, node: str) -> int | None:
        """The FUSE client of node ``node`` ('a', 'b'), or of a mount made by :meth:`mount_at` (a path)."""
        pids = self._pids(self.mount(node))
        return pids[0] if pids else None

    def brick_pid(self) -> int | None:
        pids = self._pids(self.brick)
        return pids[0] if pids else None

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> "GlusterFS":
        """Up in 5-8 s. :raises GlusterError: (everything started so far is stopped)."""
        self._lock()
        try:
            os.makedirs(self.work, exist_ok=True)
            self._start_glusterd()
            self._make_brick()
            self.cli("volume", "create", self.volume, f"{self.host}:{self.brick}", "force")
            self.start_brick()
            for node in NODES:
                os.makedirs(self.mount(node), exist_ok=True)
                self.remount(node)
        except BaseException:
            self.stop()
            raise
        return self

    def _lock(self) -> None:
        # /var/tmp is every user's and the name known: never through a link (root made its target, anywhere),
        # never a file of another user's (theirs to flock: root's tests waited, blaming another GlusterFS)
        try:
            fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise GlusterError(f"cannot open the lock {LOCK_PATH}: {exc.strerror} (not the testbed's: rm "
                               f"{LOCK_PATH}, then run again)") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise GlusterError(f"the lock {LOCK_PATH} is not a file of this user's (uid {st.st_uid}): another user "
                               f"may have put it there; rm {LOCK_PATH}, then run again")
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise GlusterError(f"another GlusterFS of this machine held {LOCK_PATH} for "
                                       f"{LOCK_WAIT_S:.0f} s (one glusterd per machine: port 24007)") from None
                time.sleep(0.5)
        self._lock_fd = fd

    def _start_glusterd(self) -> None:
        if self._port_in_use(24007):
            raise GlusterError("a glusterd not started by kvstream listens on port 24007: stop it first")
        volfile = os.path.join(self.root, "glusterd.vol")
        with open(volfile, "w") as f:
            f.write("volume management\n    type mgmt/glusterd\n"
                    f"    option working-directory {self.work}\n"
                    f"    option glusterd-sockfile {self.socket}\n"
                    "    option transport-type socket\n    option ping-timeout 0\n    option event-threads 1\n"
                    "end-volume\n")
        pidfile = os.path.join(self.root, "glusterd.pid")
        _run(["glusterd", "-f", volfile, "-p", pidfile, "-l", os.path.join(self.root, "glusterd.log")])
        deadline = time.monotonic() + READY_S
        while True:
            try:
                with open(pidfile) as f:
                    self.glusterd_pid = int(f.read().strip() or 0) or None
                self.cli("pool", "list", timeout=10)
                return
            except (OSError, ValueError, GlusterError):
                if time.monotonic() > deadline:
                    raise GlusterError(f"glusterd did not answer within {READY_S:.0f} s "
                                       f"(log: {self.root}/glusterd.log)") from None
                time.sleep(0.2)

    @staticmethod
    def _port_in_use(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _make_brick(self) -> None:
        with open(self.image, "wb") as f:
            f.truncate(self.brick_bytes)
        self.loop = _run(["losetup", "--find", "--show", self.image]).strip()
        _run(["mkfs.ext4", "-q", "-F", "-L", "kvs-brick", self.loop])
        os.makedirs(self.brick_mnt, exist_ok=True)
        _run(["mount", self.loop, self.brick_mnt])
        os.makedirs(self.brick, exist_ok=True)

    def start_brick(self) -> None:
        """Start the volume, or restart its brick process after it died (``volume start force``), and
        wait until glusterd reports the brick online. (glusterd notices a dead brick a moment after it
        died; a start before that is a no-op, so it is repeated until the brick runs.)"""
        deadline = time.monotonic() + READY_S
        while not self.brick_online():
            if time.monotonic() > deadline:
                raise GlusterError(f"the brick of {self.volume} did not come up within {READY_S:.0f} s")
            self.cli("volume", "start", self.volume, "force")
            time.sleep(0.2)

    def brick_online(self) -> bool:
        if self.brick_pid() is None:
            return False
        status = self.cli("volume", "status", self.volume, "--xml")
        return re.search(r"<node>.*?<status>1</status>", status, re.S) is not None

    def kill_brick(self) -> None:
        _stop_pid(self.brick_pid(), signal.SIGKILL)

    def pause_brick(self, paused: bool = True) -> None:
        """SIGSTOP (or SIGCONT) the brick: the clients' requests hang, as on a hung server, until their
        ping timeout (``network.ping-timeout``, 42 s unless set) declares it dead."""
        pid = self.brick_pid()
        if pid:
            os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def kill_client(self, node: str) -> None:
        """The node's FUSE client dies: its mount answers ENOTCONN until :meth:`remount`."""
        _stop_pid(self.client_pid(node), signal.SIGKILL)

    def mount_at(self, path: str) -> None:
        """One more client of the volume, mounted at ``path`` (tests: a dead mount inside a tier's tree);
        :meth:`kill_client` and :meth:`umount` take ``path`` for it. :meth:`stop` does not know it."""
        self._mount_volume(path, path.strip("/").replace("/", "-"))

    def umount(self, node: str) -> None:
        path = self.mount(node)
        if _mounted(path) and subprocess.run(["umount", path], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True)  # a dead client: lazily
        _stop_pid(self.client_pid(node))

    def remount(self, node: str, new_device: bool = False) -> int:
        """(Re)mount the volume for ``node`` (a dead client's mount is unmounted first); returns the
        mount's device number. ``new_device``: the kernel hands out the lowest free anonymous device
        number, so the old one is taken by a mount of the volume elsewhere first, and the node's mount
        comes back under another number (as a node's remount may)."""
        old = self.devs.get(node)
        self.umount(node)
        holder = os.path.join(self.root, f"hold-{node}")
        if new_device:
            os.makedirs(holder, exist_ok=True)
            self._mount_volume(holder, f"hold-{node}")
        try:
            self._mount_volume(self.mount(node), node)
        finally:
            if new_device:
                self.umount(f"hold-{node}")
        dev = self.devs[node] = os.stat(self.mount(node)).st_dev
        if new_device and dev == old:
            raise GlusterError(f"the remount of {self.mount(node)} got its old device number {dev} again")
        return dev

    def _mount_volume(self, path: str, name: str) -> None:
        _run(["mount", "-t", "glusterfs", "-o", f"log-file={self.root}/client-{name}.log",
              f"{self.host}:/{self.volume}", path])

    def stop(self) -> None:
        """Tear everything down by PID and path. Idempotent, never raises; also from another process
        than the one that started it (``kvstream testbed down``: the PIDs and the loop device are read
        back from the directory and the image)."""
        if self.glusterd_pid is None:
            try:
                with open(os.path.join(self.root, "glusterd.pid")) as f:
                    self.glusterd_pid = int(f.read().strip() or 0) or None
            except (OSError, ValueError):
                pass
        if self.loop is None and os.path.exists(self.image):
            with contextlib.suppress(GlusterError, OSError):
                found = _run(["losetup", "-j", self.image]).split(":", 1)[0].strip()
                self.loop = found or None
        for node in NODES:
            try:
                self.umount(node)
            except OSError:
                pass
        _stop_pid(self.brick_pid())
        _stop_pid(self.glusterd_pid)
        if _mounted(self.brick_mnt):
            if subprocess.run(["umount", self.brick_mnt], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", self.brick_mnt], capture_output=True)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
            self.loop = None
        brick_log = "/var/log/glusterfs/bricks/" + self.brick.strip("/").replace("/", "-") + ".log"
        for leftover in (brick_log, f"/var/run/gluster/vols/{self.volume}"):
            shutil.rmtree(leftover, ignore_errors=True) if os.path.isdir(leftover) else _unlink(leftover)
        if not any(_mounted(p) for p in (*map(self.mount, NODES), self.brick_mnt)):
            shutil.rmtree(self.root, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
