"""Shared test configuration.

* ``KVSTREAM_STRICT=1`` (set by scripts/test.sh in CI) turns every skip into a failure: in CI the
  io_uring, sglang and LMCache tests must run, and a skip there means a missing install.
* ``tier_root``: a scratch directory on a file system that supports O_DIRECT (tmpfs on older
  kernels does not), removed afterwards.
* ``glusterfs``: a real GlusterFS (glusterd, a brick on an ext4 loop image, the volume mounted twice
  as two nodes' mounts), started once per session and torn down by PID at its end; root only (a skip
  elsewhere, a failure under KVSTREAM_STRICT=1).
* Every Engine a test opens ends consistent: ``check() == []`` just before it closes, and it is closed
  by the end of the test (autouse ``engines_end_consistent``). A test that leaves damage on purpose
  says so: ``@pytest.mark.leaves_problems("why")``.
* The lock order is checked in every test (kvstream_hicache/locks.py): ``KVSTREAM_LOCK_CHECK=1`` is set
  before kvstream is imported, so every lock the suite builds is a checking one (subprocesses inherit
  it), and a test during which a thread took a lock out of order fails (autouse ``locks_in_order``),
  even where the engine turned the error into a miss.
"""
from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import weakref
from contextlib import contextmanager

import pytest

os.environ.setdefault("KVSTREAM_LOCK_CHECK", "1")  # before any lock is built: see locks_in_order

from helpers import ENGINES, uring_available, wait_until  # noqa: E402  (after the lock check is on)

STRICT = os.environ.get("KVSTREAM_STRICT") == "1"
# A disk-backed scratch root: /var/tmp is on disk on Debian/Ubuntu even where /tmp is tmpfs.
SCRATCH = os.environ.get("KVSTREAM_TEST_DIR", "/var/tmp")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under KVSTREAM_STRICT=1 (CI must run this test): {reason}"


@pytest.fixture
def tier_root():
    path = tempfile.mkdtemp(prefix="kvstream-test-", dir=SCRATCH)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fd_limit():
    """Lower this process's descriptor limit for the test (restored after): ``fd_limit(n)``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def lower(n: int) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))

    yield lower
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="session")
def glusterfs():
    """A running GlusterFS: ``.mount('a')`` and ``.mount('b')`` are two nodes' mounts of one volume."""
    from kvstream_hicache.tools.bench import glusterfs as gfs

    why = gfs.unavailable()
    if why:
        pytest.skip(f"GlusterFS unavailable: {why}")
    fs = gfs.GlusterFS(tempfile.mkdtemp(prefix="kvstream-gfs-", dir=SCRATCH)).start()
    try:
        yield fs
    finally:
        fs.stop()


@pytest.fixture(params=ENGINES)
def io_engine(request):
    """Each I/O engine in turn; io_uring refused here is a skip (a failure under KVSTREAM_STRICT=1)."""
    if request.param == "uring" and not uring_available():
        pytest.skip("io_uring_setup refused on this host")
    return request.param


@pytest.fixture
def tier_dirs(tier_root):
    """Three empty tier directories on an O_DIRECT-capable file system."""
    dirs = [os.path.join(tier_root, f"tier{i}") for i in range(3)]
    for d in dirs:
        os.makedirs(d)
    return dirs


@pytest.fixture(autouse=True)
def locks_in_order():
    """Fail the test if any thread took a lock out of kvstream_hicache.locks.ORDER while it ran."""
    from kvstream_hicache import locks

    seen = len(locks.VIOLATIONS)
    yield
    new = locks.VIOLATIONS[seen:]
    del locks.VIOLATIONS[seen:]
    assert not new, "locks taken out of order:\n" + "\n".join(new)


@pytest.fixture(autouse=True)
def engines_end_consistent(request, monkeypatch):
    """Check every engine the test opens just before it closes, and that the test closed it."""
    marker = request.node.get_closest_marker("leaves_problems")
    if marker is not None and not (marker.args and str(marker.args[0]).strip()):
        pytest.fail("@pytest.mark.leaves_problems needs a reason: what the test leaves behind and why")
    from kvstream_hicache.engine import Engine

    opened: list[weakref.ref] = []
    problems: list[str] = []
    init, close = Engine.__init__, Engine.close

    def checked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(weakref.ref(self))

    def checked_close(self):
        if not self._closed and marker is None:
            problems.extend(f"{self!r}: {p}" for p in self.check())
        close(self)

    monkeypatch.setattr(Engine, "__init__", checked_init)
    monkeypatch.setattr(Engine, "close", checked_close)
    yield
    leaked = [e for e in (ref() for ref in opened) if e is not None and not e._closed]
    for engine in leaked:  # closed here, so the leak fails this test and not one that collects it later
        checked_close(engine)
    assert not leaked, f"engines left open by the test: {leaked}"
    assert not problems, "engines closed with problems on their tiers:\n" + "\n".join(problems)


@contextmanager
def _bindfs(tier_root: str, name: str, watchdog_s: float | None):
    """A tier directory on a FUSE mount (bindfs, in the foreground) and its daemon, unmounted after; with
    ``watchdog_s``, a watchdog resumes the daemon after that long (the unmount would hang with it stopped)."""
    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed (scripts/system-deps.sh installs it)")
    try:  # (a user outside root and the fuse group: bindfs says "failed to open /dev/fuse" and never mounts)
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        pytest.skip(f"/dev/fuse cannot be opened by this user ({exc.strerror}): FUSE tiers need root")
    src, mnt = os.path.join(tier_root, f"src{name}"), os.path.join(tier_root, f"fuse{name}")
    os.mkdir(src, 0o700)
    os.mkdir(mnt)
    daemon = subprocess.Popen(["bindfs", "-f", src, mnt])
    watchdog = None if watchdog_s is None else subprocess.Popen(["sh", "-c", f"sleep {watchdog_s}; kill -CONT {daemon.pid}"],
                                                                start_new_session=True)
    try:
        wait_until(lambda: os.path.ismount(mnt), 10, "bindfs never mounted")
        os.mkdir(os.path.join(mnt, "tier"), 0o700)
        yield os.path.join(mnt, "tier"), daemon
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        if watchdog is not None:
            os.killpg(watchdog.pid, signal.SIGKILL)
            watchdog.wait()
        if subprocess.run(["fusermount", "-u", mnt], capture_output=True).returncode and os.path.ismount(mnt):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        daemon.wait(10)


@pytest.fixture
def fuse_tier(tier_root, request):
    """A tier on a FUSE file system (bindfs, in the foreground) and its daemon: SIGSTOP to the daemon
    hangs every call on the tier, as a FUSE or NFS server that stops answering does. A watchdog
    resumes the daemon after 30 s (a test module's FUSE_WATCHDOG_S, where its hangs must outlast
    that), should the test end with it stopped (the unmount would hang)."""
    with _bindfs(tier_root, "", getattr(request.module, "FUSE_WATCHDOG_S", 30)) as tier:
        yield tier


@pytest.fixture
def second_fuse_tier(tier_root):
    """A second tier on FUSE (bindfs) beside ``fuse_tier``'s, left answering: a network tier (not local,
    its calls bounded as on one that may hang) that does not hang."""
    with _bindfs(tier_root, "2", None) as (tier, _):
        yield tier


# ------------------------------------------------------------------------------------------- Ctrl-C
class _CtrlC:
    """Ctrl-C in a test: ``press`` sends SIGINT to the main thread (pytest's, where the call under test
    runs), which raises KeyboardInterrupt there, as by default, but only ``during`` the call (a press
    that comes after the call raised, as with a bug, must not end the test session)."""

    def __init__(self):
        self._inside = False

    def handler(self, signum, frame) -> None:
        if self._inside:
            raise KeyboardInterrupt

    @contextmanager
    def during(self):
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    @staticmethod
    def press() -> None:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


@pytest.fixture
def ctrl_c():
    """The main thread's SIGINT handler for the test (restored after it)."""
    presses = _CtrlC()
    default = signal.signal(signal.SIGINT, presses.handler)
    yield presses
    signal.signal(signal.SIGINT, default)
