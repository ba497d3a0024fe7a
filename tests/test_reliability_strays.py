"""Hostile files in kvstream's own directories: a FIFO (named pipe) under a page's name, directories
where kvstream keeps only files, a second tier configured inside the first one's tree. Start-up,
reads and ``kvstream check`` survive every type of stray: a FIFO is never opened blocking (that would
hang forever), a non-regular file is a stray (reported, removed by ``--fix``), never a tier failure;
a directory is reported and never removed; ``--fix`` says exactly what it did and did not repair;
overlapping tiers are refused at start-up. Real files, real processes for everything that could hang.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from kvstream_hicache import Config, TierError, check_tiers
from kvstream_hicache.router import SingleTier

from helpers import HERE, PAGE_BYTES, PageSet, gone_or_restored, kvstream_cli, loop_devices_usable, make_engine

HANG_S = 60  # a call that has not returned by then is hung (a FIFO opened blocking waits forever)


def _start_in_a_child(dirs) -> subprocess.CompletedProcess:
    """Open (and close) an engine on ``dirs`` in a fresh process: a hang there fails the test, not the run."""
    code = ("import sys; from helpers import make_engine\n"
            "e = make_engine(sys.argv[1:]); e.wait_scan(); print(e.scan); e.close()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH", "")]))}
    try:
        return subprocess.run([sys.executable, "-c", code, *dirs], capture_output=True, text=True, env=env,
                              timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"engine start-up hung for {HANG_S} s")


def test_a_fifo_under_a_page_name_never_hangs_nor_fails_the_tier(tier_dirs):
    pages = PageSet()
    keys = pages.keys(3)
    with make_engine(tier_dirs[:2], catchup="off") as engine:  # a removed copy stays removed: no catch-up race
        assert pages.put(engine, keys) == [True] * 3
        fifo = engine.tiers[0].layout.page_path(keys[1])
        os.unlink(fifo)
        os.mkfifo(fifo)
        result: list = []
        reader = threading.Thread(target=lambda: result.append(pages.checked_get(engine, keys, SingleTier(0))),
                                  daemon=True)
        reader.start()
        reader.join(HANG_S)
        if reader.is_alive():  # the old engine opened the FIFO for reading and waits for a writer: free it
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(HANG_S)
            os.unlink(fifo)  # (the check at close would hang on it too)
            pytest.fail("a read hung on a FIFO planted under a page's name")
        assert result == [[True] * 3]  # the page from tier 1
        stats = engine.stats()["tiers"][0]
        assert stats["healthy"] and stats["failures"] == 0, "a stray is not a tier failure"
        assert stats["quarantined"] == 1 and gone_or_restored(engine, 0, keys[1])  # (a fresh copy: catch-up)
        assert engine.check() == []

    if os.path.lexists(fifo):
        os.unlink(fifo)
    os.mkfifo(fifo)  # at start-up, and for kvstream check
    proc = _start_in_a_child(tier_dirs[:2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'damaged_removed': 1" in proc.stdout
    if os.path.lexists(fifo):  # a fresh copy background replication wrote there, not the FIFO
        assert stat.S_ISREG(os.lstat(fifo).st_mode)
        os.unlink(fifo)
    os.mkfifo(fifo)
    try:
        proc = kvstream_cli("check", "--tiers", *tier_dirs[:2], timeout=HANG_S)
        assert proc.returncode == 1, proc.stderr
        assert "stray" in proc.stdout and "FIFO" in proc.stdout and fifo in proc.stdout
        proc = kvstream_cli("check", "--fix", "--tiers", *tier_dirs[:2], timeout=HANG_S)
        assert proc.returncode == 0 and "1 problem(s) found: 1 repaired" in proc.stdout, proc.stdout
        assert not os.path.lexists(fifo)
    except subprocess.TimeoutExpired:
        pytest.fail("kvstream check hung on a FIFO")
    finally:
        if os.path.lexists(fifo):
            os.unlink(fifo)
    with make_engine(tier_dirs[:2]) as engine:
        assert pages.checked_get(engine, keys) == [True] * 3


def test_directories_where_kvstream_keeps_files_never_stop_start_up(tier_dirs):
    """A directory in ``<tier>/kvstream/tmp``, one under a page's name and one at the shard level: the
    engine starts (each is logged), check reports each as a stray it did not remove, and ``--fix``
    says so instead of claiming a repair."""
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 2
        layout = engine.tiers[0].layout
    page_name = keys[0][:2] + "0" * 62 + ".kvp"  # a valid page name in keys[0]'s shard
    strays = [os.path.join(layout.tmp, "adir"),
              os.path.join(os.path.dirname(layout.page_path(keys[0])), page_name),
              os.path.join(layout.pages, "zz")]  # scanned as a shard: empty, nothing to report
    for d in strays:
        os.makedirs(d)
    open(os.path.join(layout.pages, "stray-file"), "w").close()  # a file where shards live: removed at start
    proc = _start_in_a_child(tier_dirs[:1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'kept': 2" in proc.stdout  # the two directories in kvstream's places for files, logged
    assert not os.path.exists(os.path.join(layout.pages, "stray-file"))
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.checked_get(engine, keys) == [True] * 2
        problems = engine.check(fix=True)
        assert {(p.kind, p.path, p.fixed) for p in problems} == {("stray", d, False) for d in strays[:2]}
        assert all("left in place" in p.detail for p in problems)
        for d in strays:
            os.rmdir(d)
    for d in strays[:2]:
        os.makedirs(d)
    proc = kvstream_cli("check", "--fix", "--tiers", tier_dirs[0])
    assert proc.returncode == 1, proc.stdout + proc.stderr  # something is left to do by hand
    assert "2 problem(s) found: 0 repaired, 2 not repaired" in proc.stdout, proc.stdout
    assert all(os.path.isdir(d) for d in strays[:2]), "a directory is never removed"
    for d in strays[:2]:
        os.rmdir(d)


def test_a_tier_inside_another_tiers_tree_is_refused(tier_dirs):
    outer = tier_dirs[0]
    with make_engine([outer]) as engine:
        tmp, pages = engine.tiers[0].layout.tmp, engine.tiers[0].layout.pages
    for inner in (tmp, os.path.join(outer, "kvstream", "nested"), pages):
        os.makedirs(inner, exist_ok=True)
        for order in ([outer, inner], [inner, outer]):
            with pytest.raises(TierError) as info:
                make_engine(order)
            message = str(info.value)
            assert inner in message and os.path.join(outer, "kvstream") in message and "outside" in message
            with pytest.raises(TierError):  # kvstream check refuses the same configuration
                check_tiers(Config.from_sources({"tiers": order}, environ={}))
    assert os.listdir(tmp) == [], "nothing was created inside the first tier's tree"
    with make_engine([outer, tier_dirs[1]]) as engine:  # and the outer tier alone still starts
        assert engine.wait_scan(30)
        assert engine.scan["kept"] == 0


def test_one_directory_under_two_paths_is_refused(tier_dirs, tier_root):
    """A bind mount makes one directory two paths that no path comparison can tell apart."""
    why = loop_devices_usable()  # mount --bind needs root, as the loop devices do
    if why:
        pytest.skip(why)
    alias = os.path.join(tier_root, "alias")
    os.makedirs(alias)
    subprocess.run(["mount", "--bind", tier_dirs[0], alias], check=True)
    try:
        with pytest.raises(TierError) as info:
            make_engine([tier_dirs[0], alias])
        assert "same directory" in str(info.value) and alias in str(info.value) and "list it once" in str(info.value)
    finally:
        subprocess.run(["umount", alias], check=True)


def _plant_socket(path: str) -> None:
    os.mknod(path, stat.S_IFSOCK | 0o600)  # (what bind() leaves: a socket inode; open() answers ENXIO)


def test_a_get_that_meets_a_socket_under_a_page_name_keeps_the_tier_healthy(tier_dirs):
    """guarantees.md (Hostile files): "A FIFO, socket or device under a page's name is never opened
    blocking: reads, start-up and check see a stray, remove it (when its owner is trusted), and keep
    the tier healthy". Opening a socket answers ENXIO, a tier errno: integrity.open_regular now tells
    it apart as the entry's (before, the get's open failed the whole tier; found by the review of this
    stop's last changes)."""
    pages = PageSet()
    keys = pages.keys(1)
    with make_engine(tier_dirs[:2], catchup="off") as engine:
        assert pages.put(engine, keys) == [True]
        path = engine.tiers[0].layout.page_path(keys[0])
        os.unlink(path)
        _plant_socket(path)
        assert pages.checked_get(engine, keys, SingleTier(0)) == [True]  # (from tier 1)
        st = engine.stats()["tiers"][0]
        assert st["healthy"] and st["failures"] == 0, f"a stray socket failed the tier: {engine.tiers[0].last_error}"


@contextlib.contextmanager
def _nodev(path: str):
    """``path`` bind-mounted onto itself with ``nodev`` (same file system underneath: O_DIRECT as before)."""
    try:
        subprocess.run(["mount", "--bind", path, path], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot bind-mount here: {exc}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,nodev", path], check=True, capture_output=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False, capture_output=True)


def _device_in_place_of(engine, pages: PageSet, keys: list[str]) -> str:
    """``keys`` stored on tier 0, then a char device under the first one's page name; its path."""
    assert pages.put(engine, keys) == [True] * len(keys)
    path = engine.tiers[0].layout.page_path(keys[0])
    _plant_device(path)
    return path


def _plant_device(path: str) -> None:
    os.unlink(path)
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(250, 250))  # (on a nodev mount its open answers EACCES)


def test_a_get_that_meets_a_device_on_a_nodev_tier_keeps_the_tier_healthy(tier_dirs):
    """On a tier mounted ``nodev`` (/tmp, /var/tmp, removable and user mounts) opening any device node
    answers EACCES, a tier errno: open_regular tells it apart by the entry's lstat, so a get reads the
    page from the replica and the tier stays healthy (before: the tier failed; this test and the two
    below were found by the review of special files, after the socket's fix)."""
    pages = PageSet()
    keys = pages.keys(1)
    with _nodev(tier_dirs[0]):
        with make_engine(tier_dirs[:2], catchup="off") as engine:
            _device_in_place_of(engine, pages, keys)
            assert pages.checked_get(engine, keys, SingleTier(0)) == [True]  # (from tier 1)
            st = engine.stats()["tiers"][0]
            assert st["healthy"] and st["failures"] == 0, (
                f"a stray device node failed the tier: {engine.tiers[0].last_error}")


def test_check_fix_removes_a_device_under_a_page_name_on_a_nodev_tier(tier_dirs):
    """... and ``check(fix=True)`` reports it as a stray and removes it (before: "unreadable", left)."""
    pages = PageSet()
    keys = pages.keys(2)
    with _nodev(tier_dirs[0]):
        with make_engine(tier_dirs[:1], catchup="off") as engine:
            path = _device_in_place_of(engine, pages, keys)
            problems = engine.check(fix=True)
            mine = [p for p in problems if p.path == path]
            assert mine and mine[0].kind == "stray" and mine[0].fixed, (
                f"a device under a page's name is not reported as a stray and removed: {mine}")
            assert not os.path.lexists(path)
            assert engine.stats()["tiers"][0]["healthy"]
            assert pages.checked_get(engine, keys[1:]) == [True]


def test_start_up_scan_removes_a_device_under_a_page_name_on_a_nodev_tier(tier_dirs):
    """... and the start-up scan removes it (before: left in place)."""
    pages = PageSet()
    keys = pages.keys(2)
    with _nodev(tier_dirs[0]):
        with make_engine(tier_dirs[:1], catchup="off") as engine:
            assert pages.put(engine, keys) == [True, True]
        path = engine.tiers[0].layout.page_path(keys[0])
        _plant_device(path)  # (while no engine is open: the scan of the next start meets it)
        with make_engine(tier_dirs[:1], catchup="off") as engine:
            st = engine.stats()["tiers"][0]
            assert st["healthy"] and st["failures"] == 0, (
                f"a stray device node failed the tier at start-up: {engine.tiers[0].last_error}")
            assert not os.path.lexists(path), "the start-up scan left a stray device node under a page's name"
            assert pages.checked_get(engine, keys[1:]) == [True]


def _plant_driverless_misc_device(path: str) -> None:
    """A char device of the misc major (10) at a minor no driver registered: its open answers ENODEV, a
    tier errno (on a mount without ``nodev``: the test's scratch file system)."""
    os.unlink(path)
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(10, 250))
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            return
        pytest.skip(f"opening a driverless misc device answers {errno.errorcode.get(exc.errno)} here, not ENODEV")
    pytest.skip("misc minor 250 has a driver on this machine")


@pytest.mark.skipif(os.geteuid() != 0, reason="a device node (mknod of a char device) needs root (CI runs as root)")
def test_an_eviction_that_meets_a_device_under_the_victims_name_keeps_the_tier_healthy(tier_dirs):
    """The eviction's look at the victim's file (trust.unlink_unless, stop 50) opens the name: a device
    planted there whose open answers ENODEV is the entry's error, a stray left for the scan or ``check``,
    never the tier's (review unlink: before, the tier failed, every page on it missed until its probe)."""
    pages = PageSet()
    x, y = pages.keys(2)
    with make_engine(tier_dirs[:1], capacity=str(PAGE_BYTES), catchup="off") as engine:
        assert pages.put(engine, [x]) == [True]
        path = engine.tiers[0].layout.page_path(x)
        _plant_driverless_misc_device(path)
        assert pages.put(engine, [y]) == [True]  # X evicted: its name holds the device
        st = engine.stats()["tiers"][0]
        assert st["evictions"] == 1
        assert st["healthy"] and st["failures"] == 0, (
            f"a stray device under an evicted page's name failed the tier: {engine.tiers[0].last_error}")
        assert stat.S_ISCHR(os.lstat(path).st_mode)  # (left, as a link or a FIFO is: the scan or check judges)
        assert pages.checked_get(engine, [y]) == [True]
        os.unlink(path)  # (the check at close reports strays)


_TTY_CHILD = r'''
import errno, fcntl, json, os, signal, stat, subprocess, sys, termios
sys.path.insert(0, sys.argv[1])
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (took: giving a controlling terminal up hangs its group up)
dirs = json.loads(sys.argv[2])
os.setsid()  # a session leader with no controlling terminal: a daemon's main process (systemd's services)
from helpers import PAGE_BYTES, PageSet, make_engine
from kvstream_hicache.router import SingleTier


def has_terminal():
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY))
        return True
    except OSError as exc:
        assert exc.errno == errno.ENXIO, exc
        return False


def took(what):
    """``what`` made a terminal this process's controlling one: recorded and given up (TIOCNOTTY; its SIGHUP to
    this process's group ignored), so each open is tried on its own."""
    if not has_terminal():
        return []
    fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    fcntl.ioctl(fd, termios.TIOCNOTTY)
    os.close(fd)
    assert not has_terminal()
    return [what]


def plant(path):
    """This test's own pty's slave under the page's name: its devpts node bind-mounted there (a mknod'ed pty
    node opens nothing: a slave opens only as devpts's inode). No session has it, so a session leader's open
    without O_NOCTTY makes it the controlling terminal. (A serial line or a console, which the test used
    before, is the machine's: the probe's exit holding it hung it up, a serial getty or a root shell on it
    with it. The mounts are in a mount namespace of the child's own: none outlives it.)"""
    unplant(path)
    if not os.path.lexists(path):
        open(path, "wb").close()
    subprocess.run(["mount", "--bind", slave_path, path], check=True)


def unplant(path):
    while os.path.ismount(path):
        subprocess.run(["umount", path], check=True)


master, slave = os.openpty()
slave_path = os.ttyname(slave)
os.close(slave)
assert not has_terminal()
taken = []
pages = PageSet()
x, y, z = pages.keys(3)
with make_engine(dirs[:2], catchup="off") as engine:
    assert pages.put(engine, [x]) == [True]
    path = engine.tiers[0].layout.page_path(x)
    plant(path)
    assert pages.checked_get(engine, [x], SingleTier(0)) == [True]  # (from tier 1)
    taken += took("get")
    plant(path)  # (the get tried to remove it, as a stray: a mount point stays)
    engine.check()
    taken += took("check")
    plant(path)
with make_engine(dirs[:2], catchup="off") as engine:  # (the start-up scan meets it)
    taken += took("start-up scan")
    unplant(path)  # (a mount point: the scan cannot remove it)
with make_engine(dirs[2:], capacity=str(PAGE_BYTES), catchup="off") as engine:
    assert pages.put(engine, [y]) == [True]
    path = engine.tiers[0].layout.page_path(y)
    plant(path)
    assert pages.put(engine, [z]) == [True]  # y evicted: its look opens the name
    assert engine.stats()["tiers"][0]["evictions"] == 1
    taken += took("eviction")
    unplant(path)
    os.unlink(path)
print(json.dumps(taken))
'''


def test_a_terminal_under_a_page_name_never_becomes_the_engine_s_controlling_terminal(tier_dirs):
    """Opening a terminal device without O_NOCTTY in a session leader that has no controlling terminal (a
    daemon's main process: every systemd service) makes it that process's controlling terminal: a hangup on
    it would then signal the server (SIGHUP), and its line discipline's keys (^C) would reach it. Every open of
    a file under a tier's page name (a get's, check's, the start-up scan's, an eviction's look) is O_NOCTTY
    (noticed by the reviews of stop 50; planting a device takes root, trusted here)."""
    private = ["unshare", "--mount", "--propagation", "private"]  # (the child's mounts die with it)
    if subprocess.run([*private, "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount: root, util-linux)")
    out = subprocess.run([*private, sys.executable, "-c", _TTY_CHILD, HERE, json.dumps(tier_dirs)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    taken = json.loads(out.stdout.splitlines()[-1])
    if isinstance(taken, str):
        pytest.skip(taken)
    assert taken == [], f"a page's open made a terminal the controlling one: {taken}"
