"""The tests' helpers, one module (tests import it, never another test module): pages with known
content (``PageSet``, ``content``; ``Pages``: some held as numpy arrays), the engine factory, rings, a fake
clock, ``wait_until``, a fault plan by tier, real loop-device file systems, and the child processes of
the crash and multi-process tests. Fixtures are in conftest.py.

Page content is a pure function of the key (``content(key, size)``), so a child process, a
restarted engine and the test itself agree on every byte without passing data around.

Run as a script it is a child process (see ``main``): ``python helpers.py writer ...``.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence

import numpy as np
import pytest

from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.faults import Fault, FaultPlan, TierFaultPlan  # noqa: F401  (re-exported for the tests)
from kvstream_hicache.io import OP_READ, RING_ENTRIES, AlignedBuffer, Ring, ThreadRing, crc32c
from kvstream_hicache.layout import HEADER_SIZE, TierLayout, round_up
from kvstream_hicache.tmpfiles import MARK_PREFIX
from pagebytes import CHUNK, NS_FIELDS, PAGE_BYTES, content, key, twin_content  # noqa: F401  (re-exported)

NS = Namespace(NS_FIELDS)
HERE = os.path.dirname(os.path.abspath(__file__))
SCAN_WAIT_S = 120  # the longest a start-up scan of a test's few pages may take on a loaded machine
# An engine with a fault plan: a write the plan holds is the test's to release, and the hang clock (write_timeout,
# 10 s by default) is not what it tests (a test of it sets its own). At 10 s, a stall of the landing CI's loaded
# cores while a write was held failed the tier, which ended the put waiting on that write early (stop 49's landing
# CI: test_reliability_interrupts). A test that hangs for real fails at its own bound first (wait_until: 60 s).
HELD_WRITE_TIMEOUT_S = 120
# The engine tests' pages (``Pages``: 192 KiB, in 64 KiB blocks: several items per page, blocks
# straddling segments): test_engine, test_reads, test_engine_faults build engines with these.
ARRAY_NS = Namespace({"model": "test-model", "layout": "page_first", "dtype": "bf16", "page": 64, "tp": [0, 1]})
ARRAY_CHUNK = 64 << 10
ARRAY_PAGE = 192 << 10
ENGINES = ["uring", "threads"]  # the I/O engines every ring and engine test runs on
REQUIRE_URING = os.environ.get("KVSTREAM_REQUIRE_URING") == "1" or os.environ.get("KVSTREAM_STRICT") == "1"

Segment = tuple[int, int]


# ------------------------------------------------------------------------------------------- pages
class _Memory:
    """Caller memory for one page: 4096-aligned (the zero-copy write path) or at an odd address
    (the staging path), cut into segments as a host KV pool would be: K and V halves, or odd
    lengths (one of a single byte) so that blocks straddle segments."""

    def __init__(self, size: int, aligned: bool):
        self.size = size
        if aligned:
            self._buf = AlignedBuffer(round_up(max(size, 1)))
            self.array = np.frombuffer(self._buf, dtype=np.uint8)[:size]
        else:
            self._buf = np.zeros(size + 1, dtype=np.uint8)
            self.array = self._buf[1:]  # odd address
        if aligned and size % 8192 == 0:
            half = size // 2  # K and V
            self.shape = [half, half]
        elif size > 16:
            a, b = size // 5 + 1, size // 3 + 3
            self.shape = [a, 1, b, size - a - b - 1]
        else:
            self.shape = [size]
        starts = np.cumsum([0] + self.shape[:-1])
        self.arrays = [self.array[o:o + n] for o, n in zip(starts, self.shape)]
        self.segments = [(a.ctypes.data, a.nbytes) for a in self.arrays]

    def bytes(self) -> bytes:
        return self.array.tobytes()


class PageSet:
    """Pages of one size whose content is ``content(key, size)`` (or ``data(key)``); puts and checked
    gets through fresh caller memory, and, with ``held``, that many numbered pages (``keys(held)``)
    kept in caller memory: ``src`` (their content) and ``dst`` (zeroed), per page a list of numpy
    arrays, one per segment."""

    def __init__(self, size: int = PAGE_BYTES, aligned: bool = True, salt: str = "p", data=None, held: int = 0):
        self.size, self.aligned, self.salt = size, aligned, salt
        self._data = data  # key -> payload, overriding content(key, size)
        self._src = [self._memory(k) for k in self.keys(held)]
        self.src = [m.arrays for m in self._src]
        self.shapes = [m.shape for m in self._src]
        self.dst = self.fresh()

    def keys(self, n: int, start: int = 0) -> list[str]:
        return [key(i, self.salt) for i in range(start, start + n)]

    def data(self, k: str) -> bytes:
        return self._data(k) if self._data is not None else content(k, self.size)

    def _memory(self, k: str | None = None) -> _Memory:
        m = _Memory(self.size, self.aligned)
        if k is not None:
            m.array[:] = np.frombuffer(self.data(k), dtype=np.uint8)
        return m

    def put(self, engine: Engine, keys: Sequence[str]) -> list[bool]:
        return put_items(engine, [(k, self.data(k), self.aligned) for k in keys])

    def get(self, engine: Engine, keys: Sequence[str], policy=None) -> tuple[list[bool], list[bytes]]:
        return get_items(engine, [(k, self.size, self.aligned) for k in keys], policy)

    def checked_get(self, engine: Engine, keys: Sequence[str], policy=None) -> list[bool]:
        """get, asserting that every page reported found is byte-exact (never a wrong byte)."""
        found, got = self.get(engine, keys, policy)
        for k, ok, data in zip(keys, found, got):
            if ok:
                assert data == self.data(k), f"page {k[:12]} served with wrong bytes"
        return found

    # the held pages, for tests that pass their own keys and memory to the engine
    def fresh(self) -> list[list[np.ndarray]]:
        """New zeroed memory for every held page."""
        return [self._memory().arrays for _ in self._src]

    @property
    def src_segments(self) -> list[list[Segment]]:
        return segments_of(self.src)

    @property
    def dst_segments(self) -> list[list[Segment]]:
        return segments_of(self.dst)

    def equal(self, i: int, dst=None) -> bool:
        """Held page ``i`` arrived whole in ``dst`` (default: ``self.dst``)."""
        dst = self.dst if dst is None else dst
        return all(np.array_equal(a, b) for a, b in zip(self.src[i], dst[i]))


def segments_of(pages: Sequence[Sequence[np.ndarray]]) -> list[list[Segment]]:
    """The ``(address, nbytes)`` segments of pages given as lists of arrays."""
    return [[(a.ctypes.data, a.nbytes) for a in page] for page in pages]


def Pages(n: int, aligned: bool = True, seed: int = 0, size: int = ARRAY_PAGE) -> PageSet:  # noqa: N802
    """The engine tests' pages: ``n`` held pages of a PageSet, ARRAY_PAGE bytes by default (the
    ARRAY_CHUNK blocks of :func:`make_array_engine`); ``seed`` picks the content."""
    return PageSet(size, aligned, salt=f"held{seed}", held=n)


def put_items(engine: Engine, items: Sequence[tuple[str, bytes, bool]]) -> list[bool]:
    """``engine.put`` of ``(key, payload, aligned)`` items, from fresh caller memory."""
    mem = [_Memory(len(data), aligned) for _, data, aligned in items]
    for m, (_, data, _) in zip(mem, items):
        m.array[:] = np.frombuffer(data, dtype=np.uint8)
    return engine.put([k for k, _, _ in items], [m.segments for m in mem])


def get_items(engine: Engine, items: Sequence[tuple[str, int, bool]], policy=None
              ) -> tuple[list[bool], list[bytes]]:
    """``engine.get`` of ``(key, size, aligned)`` items into fresh zeroed memory: (found, bytes)."""
    mem = [_Memory(size, aligned) for _, size, aligned in items]
    found = engine.get([k for k, _, _ in items], [m.segments for m in mem], policy)
    return found, [m.bytes() for m in mem]


def make_engine(dirs: Sequence[str], io_engine: str = "auto", *, clock=None, fault_plan=None, ring_factory=None,
                namespace: Namespace = NS, chunk: int | str = CHUNK, **settings) -> Engine:
    """The tests' engine: the tiers ``dirs``, settings as a caller passes them (no environment).
    Its start-up scan is over when it returns, unless the test sets ``scan_rate`` (the scan's own
    tests): a test that damages or removes files must not race the engine's scan of them."""
    if fault_plan is not None:
        settings.setdefault("write_timeout", HELD_WRITE_TIMEOUT_S)
    explicit = {"tiers": list(dirs), "io_engine": io_engine, "chunk": chunk, **settings}
    kwargs = {"fault_plan": fault_plan}
    if clock is not None:
        kwargs["clock"] = clock
    if ring_factory is not None:
        kwargs["ring_factory"] = ring_factory
    engine = Engine(Config.from_sources(explicit, environ={}), namespace, **kwargs)
    if "scan_rate" not in settings and not engine.wait_scan(SCAN_WAIT_S):
        engine.close()
        raise AssertionError(f"the start-up scan of {dirs} did not end in {SCAN_WAIT_S} s")
    return engine


make_array_engine = functools.partial(make_engine, namespace=ARRAY_NS, chunk=ARRAY_CHUNK)
make_array_engine.__doc__ = "make_engine with the defaults of the tests that use ``Pages``."


# -------------------------------------------------------------------------------------- rings
def lockable(nbytes: int) -> None:
    """Skip unless this user may pin ``nbytes`` with io_uring (root may; another user up to its memlock
    limit, which the kernel charges registered buffers to: test_registered_memory.py tests the refusal)."""
    import pytest

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < 2 * nbytes:
        pytest.skip(f"the memlock limit ({soft} bytes) is below what this test pins: run as root or raise ulimit -l")


def uring_available() -> bool:
    try:
        Ring(8).close()
        return True
    except OSError:
        return False


def make_ring(engine: str, entries: int = RING_ENTRIES, **kwargs):
    """A ring of I/O engine ``engine`` (``kwargs``: Ring's); io_uring refused here is a skip, or a
    failure where it is required."""
    if engine == "threads":
        return ThreadRing(entries)
    try:
        return Ring(entries, **kwargs)
    except OSError as exc:
        if REQUIRE_URING:
            pytest.fail(f"KVSTREAM_REQUIRE_URING=1 but io_uring_setup was refused: {exc}")
        pytest.skip(f"io_uring unavailable here: {exc}")


def run(ring, ops) -> dict[int, int]:
    """Submit a batch and reap all of it: {tag: res}."""
    ops = list(ops)
    assert ring.submit(ops) == len(ops)
    out: dict[int, int] = {}
    while ring.in_flight:
        for tag, res in ring.reap(ring.in_flight):
            assert tag not in out, f"tag {tag} completed twice"
            out[tag] = res
    assert set(out) == {op[4] for op in ops}
    return out


def io_uring_fds() -> set[int]:
    """This process's io_uring descriptors."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[io_uring]":
                fds.add(int(name))
        except OSError:  # (the listing's own descriptor, gone by now)
            pass
    return fds


def sq_tail(fd: int) -> int:
    """How many SQEs the io_uring behind ``fd`` has been given (its fdinfo's SqTail)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("SqTail:"))


def as_user(uid: int, fn, *args, groups: tuple[int, ...] = ()) -> None:
    """Run ``fn(*args)`` in a child process as ``uid`` (its own gid, plus ``groups``), umask 0 as a
    careless or hostile user would; its exception fails the test."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0)
            fn(*args)
        except BaseException:
            os.write(w, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, err


def run_child(child, timeout: float) -> int:
    """Fork; in the child run ``child()`` and exit with its return code (1 on any exception), never
    returning into pytest. In the parent: the child's exit code, failing if it does not exit within
    ``timeout`` seconds (then killed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = child()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child hung for {timeout} s")
        time.sleep(0.01)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def make_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


class FakeClock:
    """Monotonic clock for tier back-off: tests move time instead of sleeping."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def gone_or_restored(engine: Engine, k: int, key: str) -> bool:
    """The copy of ``key`` that tier ``k`` had is gone (removed as damaged, a stray), or background
    replication has already written a fresh one there: indexed and intact, header and every block."""
    from kvstream_hicache.integrity import scan_file

    tier = engine.tiers[k]
    if not os.path.lexists(tier.layout.page_path(key)):
        return True
    if scan_file(tier.layout, engine.namespace.digest, key, payload=True).problem is not None:
        return False
    # An intact file: a fresh copy. Catch-up renames it into place and then indexes it (jobs.py), so
    # it may be looked at in between: it must be indexed within a bound.
    deadline = time.monotonic() + 10.0
    while not engine.index.holders(key) >> k & 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def wait_until(predicate, timeout: float = 60.0, what: str = "the condition never held") -> None:
    """Poll ``predicate()`` until true (for what has no completion to wait on); fail with ``what`` after
    ``timeout`` s, a bound on a hang, never a measure of speed."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def tier_stats_once(engine: Engine, k: int, counter: str, n: int, timeout: float = 30.0) -> dict:
    """Tier ``k``'s row of ``engine.stats()`` once its ``counter`` reached ``n`` (at least: the caller asserts
    it is ``n``), waited for up to ``timeout`` s. For a counter a thread of the engine moves after the state a
    test waits for shows: the catch-up's copies are counted (replication_done, replication_promoted) by their
    callback on the writer thread, after the copy's commit reached the index (holders, replication_pending 0):
    that thread descheduled in between, the count trailed the wait by one page."""
    wait_until(lambda: engine.stats()["tiers"][k][counter] >= n, timeout,
               f"tier {k}'s {counter} never reached {n}: {engine.stats()['tiers'][k][counter]} before the wait")
    return engine.stats()["tiers"][k]


def clear_while_a_look_hangs(engine: Engine, daemon, network: str, k: str, look, looking) -> None:
    """clear() while a look at page ``k`` on the FUSE tier ``network`` (tier 1; ``daemon`` its server,
    stopped meanwhile) waits for its server: ``look()`` starts it on a thread of its own, ``looking()``
    says it reached the tier. Tier 0 gets 20,000 files under page names first, so that clear()'s removal
    there takes a while: the server answers (resumed once clear() emptied the index) before clear() gets
    to tier 1. Then the page must be gone, and not indexed: a page of before a clear() never is after it."""
    layout = TierLayout(engine.tiers[0].root, engine.namespace.digest)
    for i in range(20000):
        path = layout.page_path(key(i, "junk"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()
    time.sleep(2)  # (past FUSE's 1 s entry cache: the look at the name reaches the daemon)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        look()
        wait_until(looking, what="the look never reached the tier")
        epoch = engine.index.epoch
        clearing = threading.Thread(target=engine.clear, daemon=True)
        clearing.start()
        wait_until(lambda: engine.index.epoch != epoch, what="clear() never emptied the index")
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    clearing.join(60)
    assert not clearing.is_alive()
    assert not os.path.exists(TierLayout(network, engine.namespace.digest).page_path(k))
    assert engine.index.holders(k) == 0, "a page of before the clear() is indexed after it"
    assert not engine.contains(k)


def wait_for_fault(plan, timeout: float = 60.0, what: str = "the held op never reached the ring") -> None:
    """Wait until ``plan`` has applied a fault (a held op is in flight)."""
    wait_until(lambda: plan.hits, timeout, what)


def held_read(engine: Engine, pages: "PageSet", plan: FaultPlan, key: str) -> threading.Thread:
    """A get of ``key`` on a thread of its own, its read held by ``plan`` (until ``plan.release()``):
    read priority holds the tier's writes back meanwhile. Returns once the read is in flight."""
    plan.add(Fault.hold(), opcode=OP_READ, times=1)
    reader = threading.Thread(target=lambda: pages.get(engine, [key]), daemon=True)
    reader.start()
    wait_for_fault(plan, what="the get never submitted its read")
    return reader


def flip_byte(path: str, offset: int, mask: int = 0x01) -> None:
    """Damage a stored file in place: XOR the byte at ``offset`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def messages(caplog, *needles: str, level: int | None = None) -> list[str]:
    """Log messages of the 'kvstream' loggers containing every needle."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("kvstream")
            and (level is None or r.levelno == level) and all(n in r.getMessage() for n in needles)]


VERSION_OFF, FLAGS_OFF = 8, 10  # the header's format version and flags (docs/design.md "On-disk format")
CREATED_OFF = 24  # the header's 8-byte ``created`` (set_header_field(path, CREATED_OFF, ns, 8))


def set_header_field(path: str, offset: int, value: int, width: int = 2) -> None:
    """A stored page's header field of ``width`` bytes (16 bits unless said) at ``offset`` set to ``value``
    and the header's CRC made again over it, as a writer of a later format would write it (a page of this
    format otherwise), or one whose clock differs (the 8-byte ``created``)."""
    with open(path, "r+b") as f:
        header = bytearray(f.read(HEADER_SIZE))
        header[offset:offset + width] = value.to_bytes(width, "little")
        header[HEADER_SIZE - 4:] = crc32c(bytes(header[:HEADER_SIZE - 4])).to_bytes(4, "little")
        f.seek(0)
        f.write(header)


def tmp_files(tier_dir: str) -> list[str]:
    """The temporary files in ``tmp/`` of ``tier_dir``, less the marks of engines writing there
    (tmpfiles.hold_mark)."""
    tmp = os.path.join(tier_dir, "kvstream", "tmp")
    try:
        return sorted(n for n in os.listdir(tmp) if not n.startswith(MARK_PREFIX))
    except FileNotFoundError:
        return []


def page_files(tier_dir: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(os.path.join(tier_dir, "kvstream")):
        out += [os.path.join(root, f) for f in files if f.endswith(".kvp")]
    return sorted(out)


# -------------------------------------------------------------------------------- loop devices
class LoopFs:
    """A small ext4 file system on a loop device, mounted at ``mnt``, for faults no permission bit
    can make for root: unmount, read-only remount, a full disk. Built with the bench testbed's
    command builders (kvstream_hicache.tools.bench.testbed), so both build loop tiers the same way."""

    def __init__(self, root: str, name: str, size: int, inode_size: int | None = None):
        self.image = os.path.join(root, f"{name}.img")
        self.inode_size = inode_size  # 128: ext4 keeps whole seconds (an ext3-era file system's inodes)
        self.mnt = os.path.join(root, name)
        self.size = size
        self.device: str | None = None

    def create(self) -> "LoopFs":
        from kvstream_hicache.tools.bench import testbed as tb

        with open(self.image, "wb") as f:
            f.truncate(self.size)
        self.device = _run(tb.losetup_attach_cmd(self.image)).strip()
        cmd = tb.mkfs_cmd(self.device, "kvs-rel")
        _run(cmd if self.inode_size is None else [*cmd[:-1], "-I", str(self.inode_size), cmd[-1]])
        os.makedirs(self.mnt, exist_ok=True)
        self.mount()
        return self

    @property
    def mounted(self) -> bool:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == self.mnt for line in f)

    def mount(self) -> None:
        from kvstream_hicache.tools.bench import testbed as tb

        _run(tb.mount_cmd(self.device, self.mnt))

    def umount(self) -> None:
        from kvstream_hicache.tools.bench import testbed as tb

        _run(tb.umount_cmd(self.mnt))

    def remount(self, mode: str) -> None:
        """'ro' or 'rw'."""
        _run(["mount", "-o", f"remount,{mode}", self.mnt])

    def destroy(self) -> None:
        """Unmount (lazily if busy), detach, delete the image. Idempotent, never raises."""
        from kvstream_hicache.tools.bench import testbed as tb

        for _ in range(3):
            if not self.mounted:
                break
            if subprocess.run(tb.umount_cmd(self.mnt), capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", self.mnt], capture_output=True)
        if self.device:
            subprocess.run(tb.losetup_detach_cmd(self.device), capture_output=True)
            self.device = None
        with_suppress_remove(self.image)


def with_suppress_remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def loop_devices_usable() -> str | None:
    """None when loop file systems can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root (loop devices and mount)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control"
    return None


@pytest.fixture
def loop_fs(tier_root):
    """Factory: ``loop_fs(size=64 MiB, name=..., inode_size=...)`` -> a mounted LoopFs, destroyed at teardown
    (even when the test fails)."""
    why = loop_devices_usable()
    if why:
        pytest.skip(f"loop-device file systems unavailable: {why}")
    made: list[LoopFs] = []

    def make(size: int = 64 << 20, name: str | None = None, inode_size: int | None = None) -> LoopFs:
        fs = LoopFs(tier_root, name or f"loop{len(made)}", size, inode_size)
        made.append(fs)
        return fs.create()

    try:
        yield make
    finally:
        for fs in reversed(made):
            fs.destroy()


@pytest.fixture
def small_volume(glusterfs, loop_fs, tier_root):
    """A second GlusterFS volume of the session's glusterd (the ``glusterfs`` fixture), on a brick of 96 MiB (the
    session's is 2 GiB: pages as large as the volume), mounted once: its path. Stopped and deleted at teardown."""
    brick = os.path.join(loop_fs(96 << 20, "gbrick").mnt, "b")
    os.makedirs(brick)
    glusterfs.cli("volume", "create", "kvsmall", f"{glusterfs.host}:{brick}", "force")
    mnt = os.path.join(tier_root, "small")
    os.makedirs(mnt)
    try:
        glusterfs.cli("volume", "start", "kvsmall", "force")
        subprocess.run(["mount", "-t", "glusterfs", "-o", f"log-file={glusterfs.root}/client-kvsmall.log",
                        f"{glusterfs.host}:/kvsmall", mnt], check=True, capture_output=True, timeout=60)
        yield mnt
    finally:
        if os.path.ismount(mnt) and subprocess.run(["umount", mnt], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        glusterfs.cli("volume", "stop", "kvsmall", "force")  # (its brick process ends: loop_fs unmounts the brick)
        glusterfs.cli("volume", "delete", "kvsmall")
        # what the brick leaves outside the session's root, as GlusterFS.stop removes its own volume's
        shutil.rmtree("/var/run/gluster/vols/kvsmall", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink("/var/log/glusterfs/bricks/" + brick.strip("/").replace("/", "-") + ".log")


# ------------------------------------------------------------------------------ child processes
def kvstream_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the installed ``kvstream`` command of this venv (``python -m kvstream_hicache.tools.cli`` if the
    console script is missing)."""
    script = os.path.join(os.path.dirname(sys.executable), "kvstream")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "kvstream_hicache.tools.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env or dict(os.environ),
                          timeout=timeout)


def spawn(role: str, *args: str, wrap: Sequence[str] = (), **kw) -> subprocess.Popen:
    """Start ``python helpers.py ROLE ARGS...`` (a fresh interpreter of this venv); ``wrap``: a command it runs
    under (``unshare --pid ...``: a container's own pid namespace)."""
    env = dict(os.environ)
    # the tree under test first (else the child imports the installed kvstream, which may be another tree)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")]))
    return subprocess.Popen([*wrap, sys.executable, os.path.join(HERE, "helpers.py"), role, *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _writer(tiers: str, ack_path: str, start: int, batch: int, rounds: int, size: int, hold_after: int) -> int:
    """Crash-test child: a stream of batch puts (keys ``start``, ``start + 1``, ... of PageSet
    salt 'crash'); after each put returns, the acknowledged keys are
    appended to ``ack_path`` and fsynced. With ``hold_after`` >= 0, the writes of the batch after
    that many batches are held in the ring (their temp files exist) and 'HOLDING' is logged."""
    pages = PageSet(size, aligned=True, salt="crash")
    ack_fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    plan = HoldWrites(lambda: _ack(ack_fd, "HOLDING")) if hold_after >= 0 else None
    engine = make_engine(tiers.split(os.pathsep), fault_plan=plan)
    _ack(ack_fd, f"START {os.getpid()}")
    for r in range(rounds):
        if plan is not None and r == hold_after:
            plan.armed = True
        keys = pages.keys(batch, start + r * batch)
        ok = pages.put(engine, keys)
        _ack(ack_fd, "\n".join(k for k, good in zip(keys, ok) if good))
    _ack(ack_fd, "DONE")
    engine.close()
    return 0


def _ack(fd: int, text: str) -> None:
    if text:
        os.write(fd, (text + "\n").encode())
        os.fsync(fd)


def _rank(tiers: str, rank: int, n_ranks: int, rounds: int, out: str) -> int:
    """Two-TP-ranks child: same keys as the other rank, this rank's namespace and content."""
    ns = Namespace({**NS.fields, "tp": [rank, n_ranks]})
    pages = PageSet(PAGE_BYTES, aligned=rank % 2 == 0, salt="tp", data=lambda k: rank_content(k, rank))
    engine = make_engine(tiers.split(os.pathsep), namespace=ns)
    bad = []
    keys = pages.keys(rounds * 4)
    for r in range(rounds):
        batch = keys[r * 4:(r + 1) * 4]
        if not all(pages.put(engine, batch)):
            bad.append(f"put {r}")
        found, got = pages.get(engine, keys[:(r + 1) * 4])
        bad += [f"get {k[:8]}: {'wrong bytes' if ok else 'miss'}" for k, ok, data in
                zip(keys, found, got) if not ok or data != pages.data(k)]
    problems = engine.check()
    engine.close()
    with open(out, "w") as f:
        json.dump({"bad": bad, "problems": [p._asdict() for p in problems]}, f)
    return 0


def rank_content(k: str, rank: int) -> bytes:
    return content(hashlib.sha256(f"{k}/{rank}".encode()).hexdigest(), PAGE_BYTES)


def _mla(tiers: str, role: str, rounds: int, out: str, go: str, capacity: str) -> int:
    """Same-namespace child (an MLA writer rank or a reader rank). The writer stores ``rounds``
    batches of 4 pages, evicting from tier 0 (``capacity``), then creates ``go + '.done'``. The
    reader (another process, its own index) reads every key again and again while the writer
    works, then once more after it is done; pages the writer stored since the reader's start-up
    scan are found by the engine's on-disk lookup. Any wrong byte fails the child
    (PageSet.checked_get asserts)."""
    pages = PageSet(PAGE_BYTES, aligned=True, salt="mla")
    keys = pages.keys(rounds * 4)
    dirs = tiers.split(os.pathsep)
    # the reader is an MLA non-writer rank: its adapter turns catch-up off (a write; the writer does it)
    settings = {"capacity": capacity, **({} if role == "writer" else {"catchup": False})}
    bad, seen, reads = [], [], 0
    deadline = time.monotonic() + 120
    while not os.path.exists(go):
        assert time.monotonic() < deadline, "no start signal"
        time.sleep(0.005)  # start line: both processes open their engines together
    engine = make_engine(dirs, **settings)
    if role == "writer":
        for r in range(rounds):
            if not all(pages.put(engine, keys[r * 4:(r + 1) * 4])):
                bad.append(f"put {r}")
        open(go + ".done", "w").close()
    else:
        while True:
            last = os.path.exists(go + ".done")
            found = pages.checked_get(engine, keys)  # never a wrong byte, whatever the writer does
            seen.append(sum(found))
            reads += 1
            if last or time.monotonic() > deadline:
                break
    problems = engine.check()
    engine.close()
    with open(out, "w") as f:
        json.dump({"bad": bad, "seen": seen, "reads": reads, "problems": [p._asdict() for p in problems]}, f)
    return 0


class HoldWrites(FaultPlan):
    """Holds every write of the engine while ``armed`` (the I/O happens, its completion waits for
    ``release()``); the first held write calls ``on_hold()``, so another process can learn that this
    one is inside its put with its temporary files written and nothing committed yet."""

    def __init__(self, on_hold):
        super().__init__()
        self.on_hold = on_hold
        self.armed = False

    def decide(self, opcode, fd, offset, length):
        from kvstream_hicache.faults import Fault
        from kvstream_hicache.io import OP_WRITE

        if not (self.armed and opcode == OP_WRITE):
            return None
        if not self.hits:
            self.on_hold()
        self.hits.append((Fault.hold(), opcode, fd, offset, length))
        return Fault.hold()


def wait_for_file(path: str, timeout: float = 240.0, children: Sequence[subprocess.Popen] = ()) -> None:
    """Wait for ``path`` to appear; fail at ``timeout``, or at once when one of ``children`` died."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        for child in children:
            if child.poll() is not None:
                _, err = child.communicate()
                raise AssertionError(f"child exited ({child.returncode}) before {path} appeared: {err[-3000:]}")
        time.sleep(0.005)


def release_on(plan: HoldWrites, path: str) -> threading.Thread:
    """A thread that lets ``plan``'s held writes go when ``path`` appears."""
    def run():
        wait_for_file(path)
        plan.armed = False
        plan.release()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def store_at_once(children: Sequence[subprocess.Popen], outs: Sequence[str], go: str,
                  timeout: float = 240.0) -> list[dict]:
    """Drive two writer children (roles 'twin', tests/sglang_server_child.py) through one simultaneous
    store: wait until both hold their writes (``OUT.holding``), let them go (``go``), wait until both
    stored (``OUT.stored``), let them read (``go + '.read'``); returns each child's JSON result. A
    child that dies or hangs fails the test; none is left running."""
    def drive() -> None:
        for out in outs:
            wait_for_file(out + ".holding", timeout, children)  # inside the store, nothing committed
        open(go, "w").close()
        for out in outs:
            wait_for_file(out + ".stored", timeout, children)
        open(go + ".read", "w").close()

    return run_children(children, outs, drive, timeout)


def run_children(children: Sequence[subprocess.Popen], outs: Sequence[str], drive, timeout: float) -> list[dict]:
    """``drive()`` the children, wait for each to exit 0, and return the JSON each wrote to its
    ``outs`` file. A child that dies or hangs fails the test; none is left running."""
    try:
        drive()
        for child in children:
            _, err = child.communicate(timeout=timeout)
            assert child.returncode == 0, err[-3000:]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def _twin(tiers: str, who: int, n: int, out: str, go: str) -> int:
    """Two-writer child: stores the same ``n`` keys as its twin, with its own bytes, at the same moment
    (writes held until ``go``: both puts looked the keys up and wrote their temporary files before
    either committed), then, once both stored (``go + '.read'``), reads every key back."""
    pages = PageSet(PAGE_BYTES, aligned=who == 0, salt="twin", data=lambda k: twin_content(k, who))
    keys = pages.keys(n)
    plan = HoldWrites(lambda: open(out + ".holding", "w").close())
    engine = make_engine(tiers.split(os.pathsep), fault_plan=plan)
    plan.armed = True
    release_on(plan, go)
    stored = pages.put(engine, keys)
    open(out + ".stored", "w").close()
    wait_for_file(go + ".read")
    found, got = pages.get(engine, keys)
    versions = [next((w for w in (who, 1 - who) if data == twin_content(k, w)), None) if ok else None
                for k, ok, data in zip(keys, found, got)]
    stats = engine.stats()
    problems = engine.check()
    engine.close()
    with open(out, "w") as f:
        json.dump({"stored": stored, "found": found, "versions": versions, "problems": [p._asdict() for p in problems],
                   "quarantined": sum(t["quarantined"] for t in stats["tiers"]),
                   "other_versions": sum(t.get("other_versions", 0) for t in stats["tiers"])}, f)
    return 0


def _startup(tiers: str, who: int, out: str, go: str) -> int:
    """Start-up child: opens an engine the moment ``go`` appears (its twin does too), reads the 40
    pages of PageSet() at once, stores 4 of its own, then waits for its background scan."""
    pages, own = PageSet(), PageSet(salt=f"own{who}")
    open(out + ".ready", "w").close()
    wait_for_file(go)
    engine = make_engine(tiers.split(os.pathsep), replicate="all")
    found = pages.checked_get(engine, pages.keys(40))
    stored = own.put(engine, own.keys(4))
    done = engine.wait_scan(120)
    scan = engine.scan
    engine.close()
    with open(out, "w") as f:
        json.dump({"found": found, "stored": stored, "scan_done": done, "damaged_removed": scan["damaged_removed"],
                   "tmp_removed": scan["tmp_removed"]}, f)
    return 0


class Node:
    """Another engine in a child process (``python SCRIPT``, default tests/node.py: its docstring has
    the commands), told one JSON list per line on its stdin, answering one JSON object per line: another
    node of a shared file system, or another server of the namespace on the same tiers. Calls from
    several threads take turns."""

    WAIT_S = 120.0  # a child's answer, its end (GlusterFS itself: a brick restart); never asserted on

    def __init__(self, script: str = "node.py", tree: str | None = None):
        """``tree``: the kvstream tree the child imports (another version's: test_versions.py), run
        there; default this checkout's."""
        env = dict(os.environ)
        path = [tree] if tree else [HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, script)], env=env, text=True, cwd=tree,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lock = threading.Lock()

    def call(self, *cmd) -> dict:
        """What the child answers to ``cmd``, an error it reports included."""
        with self.lock:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(self.WAIT_S)
            raise AssertionError(f"the child node died ({self.proc.returncode}): {self.proc.stderr.read()}")
        return json.loads(line)

    def __call__(self, *cmd) -> dict:
        """:meth:`call`, asserting the command did not raise in the child."""
        out = self.call(*cmd)
        assert "error" not in out, f"the child node: {cmd[0]} raised {out['error']}"
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(self.WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            pipe.close()


def main(argv: Sequence[str]) -> int:
    role, *args = argv
    if role == "writer":
        tiers, ack, start, batch, rounds, size, hold_after = args
        return _writer(tiers, ack, int(start), int(batch), int(rounds), int(size), int(hold_after))
    if role == "rank":
        tiers, rank, n, rounds, out = args
        return _rank(tiers, int(rank), int(n), int(rounds), out)
    if role == "mla":
        tiers, which, rounds, out, go, capacity = args
        return _mla(tiers, which, int(rounds), out, go, capacity)
    if role == "twin":
        tiers, who, n, out, go = args
        return _twin(tiers, int(who), int(n), out, go)
    if role == "startup":
        tiers, who, out, go = args
        return _startup(tiers, int(who), out, go)
    print(f"unknown role {role!r}", file=sys.stderr)
    return errno.EINVAL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def load_serve_swebench():
    """examples/serve_swebench.py as a module (its client, /metrics parser and counter deltas): one copy
    per process, shared by every test that uses it."""
    import importlib.util

    if "serve_swebench" in sys.modules:
        return sys.modules["serve_swebench"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("serve_swebench", os.path.join(root, "examples", "serve_swebench.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_swebench"] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def owner_mapping_tier(src: str, mnt: str, uid: int):
    """``<mnt>/tier``, a tier directory on a FUSE mount of ``src`` that maps every owner to ``uid`` (bindfs
    --force-user), as NFS root squash and some FUSE mounts do: a file the engine creates there comes out
    owned by ``uid``. Skips without bindfs; unmounts after."""
    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed (scripts/system-deps.sh installs it)")
    os.mkdir(src, 0o700)
    os.mkdir(mnt)
    subprocess.run(["bindfs", f"--force-user={uid}", f"--force-group={uid}", src, mnt], check=True)
    try:
        tier = os.path.join(mnt, "tier")
        os.mkdir(tier, 0o700)
        yield tier
    finally:
        subprocess.run(["fusermount", "-u", mnt], capture_output=True)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
