"""A real distributed file system as the shared tier: GlusterFS mounted twice, as two nodes mount one
PFS (the ``glusterfs`` session fixture). Node A is this process, node B a child process on the other
mount (tests/node.py); each node has a private tier 0 and the shared tier 1. What a network file
system does and ext4 never did is exercised for real: ESTALE from a descriptor or a cached name after
the other node unlinked or replaced a file (also from ``close``), ENOTCONN or ECONNABORTED from a dead
server or client, a remount under another device number.

Promises shown: no exception leaves an engine call; another node's eviction or replacement of a page
never fails the tier (it is that page's news) and a new version renamed in is served; a killed client
remounted, or a killed brick restarted, lets the tier rejoin. Time is an injected clock where a
back-off is involved; waiting for GlusterFS itself (a restarted brick) polls the mount.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
import uuid

import pytest

from kvstream_hicache import check_tiers, integrity
from kvstream_hicache import tiers as tiers_module
from kvstream_hicache.faults import Fault
from kvstream_hicache.io import OP_READ, OP_WRITE
from kvstream_hicache.layout import ALIGN, HEADER_SIZE
from kvstream_hicache.router import SingleTier

from helpers import (  # noqa: F401  (loop_fs, small_volume: fixtures)
    PAGE_BYTES, FakeClock, FaultPlan, Node, PageSet, TierFaultPlan, flip_byte, kvstream_cli, make_engine, messages,
    loop_fs, page_files, small_volume, tmp_files, twin_content, wait_for_fault, wait_until,
)

N = 8
MIB = 1 << 20
WAIT_S = 120.0  # GlusterFS itself (a brick restart) and a child's answer; never asserted on


@pytest.fixture
def dfs(glusterfs, tier_root):
    """Per test: a fresh shared directory on the volume, each node's view of the tiers, node B (not yet
    opened). Both mounts are healthy again at the end (a test may kill a client)."""
    share = f"share-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(glusterfs.mount("a"), share))
    a = [os.path.join(tier_root, "a0"), os.path.join(glusterfs.mount("a"), share)]
    b = [os.path.join(tier_root, "b0"), os.path.join(glusterfs.mount("b"), share)]
    for d in (a[0], b[0]):
        os.makedirs(d)
    node = Node()
    try:
        yield glusterfs, a, b, node
    finally:
        node.stop()
        if not glusterfs.brick_online():
            glusterfs.start_brick()
        for n in ("a", "b"):
            try:
                os.stat(glusterfs.mount(n))
            except OSError:
                glusterfs.remount(n)
        shutil.rmtree(os.path.join(glusterfs.mount("a"), share), ignore_errors=True)


def _healthy(engine, k: int = 1) -> tuple[bool, int]:
    row = engine.stats()["tiers"][k]
    return row["healthy"], row["failures"]


def _discover(engine, keys) -> None:
    """Index another node's pages now (contains looks them up), so this process's check is clean."""
    assert all(engine.contains(k) for k in keys)


def test_cross_node_reuse(dfs):
    """What one node stores on the shared tier the other finds and reads byte-exact, both ways."""
    fs, a, b, node = dfs
    node("open", b, {})
    mine, theirs = PageSet(salt="a-pages"), PageSet(salt="b-pages")
    with make_engine(a) as engine:
        assert mine.put(engine, mine.keys(N)) == [True] * N
        got = node("get", "a-pages", 0, N, 0)
        assert got["found"] == got["exact"] == [True] * N
        assert node("put", "b-pages", 0, N, 0)["stored"] == [True] * N
        assert engine.prefix_len(theirs.keys(N)) == N
        assert theirs.checked_get(engine, theirs.keys(N), SingleTier(1)) == [True] * N
        assert _healthy(engine) == (True, 0)
    assert [t["failures"] for t in node("stats")["tiers"]] == [0, 0]


def test_another_node_evicting_one_page_fails_nothing(dfs):
    """Node B, full on the shared tier, evicts one of A's pages there while A has just read them all
    from it (its client's cached names and handles of the file are stale now: ESTALE). A's next read
    finds every page (that one from tier 0), tier 1 stays healthy and the next put lands on it."""
    fs, a, b, node = dfs
    pages = PageSet()
    keys = pages.keys(N)
    with make_engine(a, replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * N
        file_bytes = engine.index.get(keys[0]).nbytes
        before = set(page_files(a[1]))
        assert node("open", b, {"capacity": os.pathsep.join(["", str(N * file_bytes)]),
                                "replicate": "all"})["pages"] == N
        assert pages.checked_get(engine, keys, SingleTier(1)) == [True] * N  # (A's client caches the names)
        assert node("put", "b-pages", 0, 1, 0)["stored"] == [True]
        gone = before - set(page_files(a[1]))
        assert len(gone) == 1, "node B was to evict exactly one of A's pages from the shared tier"

        assert pages.checked_get(engine, keys, SingleTier(1)) == [True] * N
        assert _healthy(engine) == (True, 0), "another node's eviction failed the shared tier"
        new = PageSet(salt="after").keys(2)
        assert PageSet(salt="after").put(engine, new) == [True, True]
        assert all(engine.index.holders(k) & 0b10 for k in new), "the next put skipped the shared tier"
        _discover(engine, PageSet(salt="b-pages").keys(1))
        assert _healthy(engine) == (True, 0)
        # A's client may have served the evicted file's bytes (valid, verified) from its cache with no
        # error at all, which leaves its copy indexed until a read or a check meets the name gone:
        # check(fix=True) reconciles, as guarantees.md says for pages another process evicted
        engine.check(fix=True)


def test_a_new_version_renamed_over_a_page_is_served(dfs):
    """Node B stores its own bytes under A's keys on the shared tier (opened before A stored, no
    lookups: it renames its version over A's files). A, which had just read its version, reads again:
    its client's entries are stale (ESTALE); the page is looked up again and B's version is served in
    the same call, verified against its own checksums; the tier stays healthy."""
    fs, a, b, node = dfs
    node("open", b[1:], {"discover": False})
    pages = PageSet()
    keys = pages.keys(N)
    theirs = PageSet(PAGE_BYTES, salt=pages.salt, data=lambda k: twin_content(k, 1))
    with make_engine(a[1:]) as engine:
        assert pages.put(engine, keys) == [True] * N
        assert pages.checked_get(engine, keys) == [True] * N
        assert node("put", pages.salt, 0, N, 1)["stored"] == [True] * N
        assert theirs.checked_get(engine, keys) == [True] * N, "the new version was not served"
        assert _healthy(engine, 0) == (True, 0), "another node's replacement failed the shared tier"
        assert engine.stats()["tiers"][0]["quarantined"] == 0


def test_stale_files_and_close_errors_never_leave_an_engine_call(dfs):
    """After node B unlinked half of A's pages on the shared tier and replaced the other half (A's
    descriptors and cached names of them answer ESTALE, close included), every engine call of A
    returns: contains, prefix_len, get, put, check, close."""
    fs, a, b, node = dfs
    node("open", b[1:], {"discover": False})
    pages = PageSet()
    keys = pages.keys(N)
    engine = make_engine(a[1:])
    try:
        assert pages.put(engine, keys) == [True] * N
        assert pages.checked_get(engine, keys) == [True] * N
        assert node("put", pages.salt, 0, N // 2, 1)["stored"] == [True] * (N // 2)  # replaced
        for k in keys[N // 2:]:  # unlinked by the other node
            os.unlink(next(p for p in page_files(b[1]) if os.path.basename(p).startswith(k)))
        assert [engine.contains(k) for k in keys[:N // 2]] == [True] * (N // 2)
        engine.prefix_len(keys)
        found = pages.get(engine, keys)[0]
        assert found[N // 2:] == [False] * (N // 2)
        assert pages.put(engine, keys[N // 2:]) == [True] * (N // 2)
        assert pages.checked_get(engine, keys[N // 2:]) == [True] * (N // 2)
        engine.check(fix=True)
        assert _healthy(engine, 0) == (True, 0)
    finally:
        engine.close()


@pytest.mark.parametrize("new_device", [False, True], ids=["remount", "remount-new-device"])
def test_a_killed_client_remounted_rejoins(dfs, new_device):
    """Node A's FUSE client dies (its mount answers ECONNABORTED/ENOTCONN): reads go on from tier 0,
    the shared tier fails once. The volume is mounted again (the kernel may give it the old device
    number or another; the second case makes sure it is another):
    at its next probe (after the back-off, injected clock) the tier rejoins and serves its pages again."""
    fs, a, b, node = dfs
    clock = FakeClock()
    pages = PageSet()
    keys = pages.keys(N)
    with make_engine(a, clock=clock, replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * N
        fs.kill_client("a")
        assert pages.checked_get(engine, keys, SingleTier(1)) == [True] * N
        assert _healthy(engine) == (False, 1)
        fs.remount("a", new_device=new_device)
        clock.advance(engine.config.tier_retry + 0.01)
        served = engine.stats()["tiers"][1]["bytes_served"]
        assert pages.checked_get(engine, keys, SingleTier(1)) == [True] * N
        assert _healthy(engine) == (True, 1), "the remounted tier did not rejoin"
        assert engine.stats()["tiers"][1]["bytes_served"] - served == N * PAGE_BYTES
        assert engine.stats()["tiers"][1]["pages"] == N


def _wait_readable(path: str) -> None:
    """Poll until an O_DIRECT read of ``path`` works (a restarted brick takes GlusterFS's clients a
    few seconds to reconnect): GlusterFS's own recovery, not the engine's, so not asserted on."""
    deadline = time.monotonic() + WAIT_S
    with mmap.mmap(-1, ALIGN) as buf:
        while True:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    os.preadv(fd, [buf], 0)
                    return
                finally:
                    os.close(fd)
            except OSError as exc:
                assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO, errno.ESTALE), exc
                assert time.monotonic() < deadline, f"{path} unreadable {WAIT_S:.0f} s after the brick restarted"
                time.sleep(0.1)


def test_brick_killed_and_restarted_mid_read(dfs):
    """The brick dies while a get reads the shared tier (its first read held in the ring, two in
    flight at a time): the get returns (no hang), its remaining pages misses, the tier failed once.
    The brick restarts: after the back-off every page is read again."""
    fs, a, b, node = dfs
    clock = FakeClock()
    plan = FaultPlan()
    pages = PageSet()
    keys = pages.keys(N)
    with make_engine(a[1:], clock=clock, fault_plan=plan) as engine:
        assert pages.put(engine, keys) == [True] * N
        a_page = page_files(a[1])[0]
        plan.add(Fault.hold(), opcode=OP_READ, times=1)
        result: list = []
        reader = threading.Thread(target=lambda: result.append(
            pages.checked_get(engine, keys, SingleTier(0, m=1, depth=2))))
        reader.start()
        wait_for_fault(plan)
        fs.kill_brick()
        plan.release()
        reader.join(WAIT_S)
        assert not reader.is_alive(), "a get hung on a dead brick"
        assert result and False in result[0], result
        assert _healthy(engine, 0) == (False, 1)
        fs.start_brick()
        _wait_readable(a_page)
        clock.advance(engine.config.tier_retry + 0.01)
        assert pages.checked_get(engine, keys) == [True] * N
        assert _healthy(engine, 0) == (True, 1)


def test_kvstream_check_on_the_dfs(dfs):
    """``kvstream check`` run on node B's view of what node A stored: clean; a byte flipped through B's
    mount is reported, ``--fix`` removes that copy, and A still reads every page (from tier 0)."""
    fs, a, b, node = dfs
    pages = PageSet()
    keys = pages.keys(N)
    with make_engine(a, replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * N
        proc = kvstream_cli("check", "--tiers", *b)
        assert proc.returncode == 0 and "no problems found" in proc.stdout, proc.stdout + proc.stderr
        victim = sorted(page_files(b[1]))[0]
        flip_byte(victim, HEADER_SIZE + 100)
        proc = kvstream_cli("check", "--tiers", *b)
        assert proc.returncode == 1 and victim in proc.stdout, proc.stdout + proc.stderr
        proc = kvstream_cli("check", "--fix", "--tiers", *b)
        assert proc.returncode == 0 and "repaired" in proc.stdout, proc.stdout + proc.stderr
        assert not os.path.exists(victim)
        assert pages.checked_get(engine, keys) == [True] * N
        assert _healthy(engine) == (True, 0)


def test_a_rejoin_whose_listing_fails_half_way_forgets_nothing(glusterfs, tier_dirs, caplog):
    """A tier rejoins; listing its pages fails half-way (a shard directory answers ENOTCONN: a dead
    FUSE client is mounted on it, the first shard the listing meets). The index is left alone (the
    listing runs behind the rejoin, engine._forget_lost), and the tier is out again as soon as a read
    meets the broken shard; once the directory answers again, the tier rejoins with every page it
    holds. (Before the listing ran behind the rejoin, the tier stayed out at the probe.)"""
    clock = FakeClock()
    pages = PageSet()
    keys = pages.keys(4 * N)
    tiers = tier_dirs[:2]
    with make_engine(tiers, clock=clock, replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * len(keys)
        base = os.path.join(tiers[1], "kvstream")
        os.rename(base, base + ".away")
        assert pages.checked_get(engine, keys, SingleTier(1)) == [True] * len(keys)
        assert _healthy(engine) == (False, 1)
        shards = os.path.join(base + ".away", engine.namespace.digest)
        bad = os.path.join(shards, os.listdir(shards)[0])  # (scandir lists in this order too)
        glusterfs.mount_at(bad)
        glusterfs.kill_client(bad)
        os.rename(base + ".away", base)
        bad = base + bad[len(base + ".away"):]  # (the mount moved with its directory)
        try:
            clock.advance(engine.config.tier_retry + 0.01)
            assert pages.checked_get(engine, keys, SingleTier(1)) == [True] * len(keys)  # (tier 0 serves)
            assert not _healthy(engine)[0], "a tier whose shard does not answer served"
            wait_until(lambda: messages(caplog, "listing its pages failed"), WAIT_S,
                       "the rejoin's listing never met the broken shard")
            assert engine.index.pages_on(1) == len(keys), "pages not listed yet were forgotten"
        finally:
            glusterfs.umount(bad)
        clock.advance(2 * engine.config.tier_retry + 0.01)
        served = engine.stats()["tiers"][1]["bytes_served"]
        assert pages.checked_get(engine, keys, SingleTier(1)) == [True] * len(keys)
        assert _healthy(engine)[0]
        assert engine.stats()["tiers"][1]["bytes_served"] - served == len(keys) * PAGE_BYTES


def _close_while_hung(engine) -> None:
    """close() returns although the brick is stopped (the ring is left to a background thread)."""
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "close() waited for a hung tier"


def _stop_brick(fs) -> subprocess.Popen:
    """SIGSTOP the brick, and a child that resumes it after WAIT_S (were this process to block in the
    kernel with the GIL held, no finally would run). The child is started first: a fork while the brick
    is stopped blocks, the child closing its inherited descriptors of the FUSE mount."""
    rescue = subprocess.Popen(["sh", "-c", f"sleep {WAIT_S:.0f}; kill -CONT {fs.brick_pid()}"])
    fs.pause_brick()
    return rescue


def _held_until_the_brick_stops(fs, plan, tier: str, opcode: int, call,
                                rescue: list) -> tuple[threading.Thread, list]:
    """``call()`` in a thread of its own whose first ``opcode`` on ``tier`` is held in the ring (its file
    open) until the brick stops (``rescue`` gets _stop_brick's child); the ops that follow hang in the
    kernel. Returns the thread and its result (a list: empty until ``call`` returns)."""
    plan.on(tier, Fault.hold(), opcode=opcode)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    wait_for_fault(plan)
    rescue.append(_stop_brick(fs))
    plan.clear()
    plan.release()
    return thread, result


def _resume(fs, engine, rescue: subprocess.Popen | None = None) -> None:
    """The brick resumes (the ping timeout back to its default); the background close then ends."""
    if rescue is not None:
        rescue.kill()
        rescue.wait()
    fs.pause_brick(False)
    fs.cli("volume", "reset", fs.volume, "network.ping-timeout")
    engine.close()
    deadline = time.monotonic() + WAIT_S
    while any(t.name == "kvstream-close" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the background close never ended after the tier came back"
        time.sleep(0.05)


@pytest.mark.leaves_problems("the tier is hung when the engine closes: check() would wait for it")
def test_close_returns_while_a_hung_tier_holds_reads(dfs):
    """The brick stops (SIGSTOP; the clients' ping timeout raised so that GlusterFS does not give up
    on its own) while a get reads a 4 MiB page from the shared tier, two 16 KiB reads at a time (the
    first held in the ring until the brick stopped, so the file is open): the next reads hang in the
    kernel. The get returns at read_timeout (a miss), and close() returns after its drain bound,
    leaving the read ring to a background thread (before: close() waited for the kernel as long as
    the tier hung). The brick resumes: that thread ends and nothing is left behind."""
    fs, a, b, node = dfs
    pages = PageSet(4 << 20, aligned=False)  # (staged: a get waits for reads into caller memory)
    keys = pages.keys(1)
    plan = FaultPlan()
    fs.cli("volume", "set", fs.volume, "network.ping-timeout", "600")
    engine = make_engine(a[1:], read_timeout=1.0, fault_plan=plan)
    try:
        assert pages.put(engine, keys) == [True]
        plan.add(Fault.hold(), opcode=OP_READ, times=1)
        result: list = []
        reader = threading.Thread(target=lambda: result.append(pages.get(engine, keys, SingleTier(0, m=1, depth=2))))
        reader.start()
        wait_for_fault(plan)
        fs.pause_brick()
        plan.release()
        reader.join(WAIT_S)
        assert not reader.is_alive() and result[0][0] == [False]
        assert engine.stats()["orphan_reads_in_flight"] > 0
        _close_while_hung(engine)
    finally:
        _resume(fs, engine)


@pytest.mark.leaves_problems("the tier is hung when the engine closes: check() would wait for it")
def test_a_put_answers_at_write_timeout_while_the_brick_hangs(dfs):
    """A put of a 16 MiB page (4096-aligned: zero-copy to the local tier 0) to both tiers. Its first
    writes to the shared tier are held in the ring (the file is open), the brick stops (SIGSTOP; the
    clients' ping timeout raised), and the writes that follow hang in the kernel. Past write_timeout
    tier 1 is failed and the put answers True from tier 0 (before: it blocked as long as the brick).
    The writes to the FUSE tier were staged copies, so nothing reads the caller's memory after the
    put returned; close() returns with them still hung. The brick resumes: the background close
    ends and the abandoned temporary file goes."""
    fs, a, b, node = dfs
    pages = PageSet(16 << 20)
    keys = pages.keys(1)
    plan = TierFaultPlan()
    fs.cli("volume", "set", fs.volume, "network.ping-timeout", "600")
    engine = make_engine(a, replicate="all", write_timeout=1.0, tier_retry=600, fault_plan=plan)
    rescue: list = []
    try:
        writer, result = _held_until_the_brick_stops(fs, plan, a[1], OP_WRITE, lambda: pages.put(engine, keys),
                                                     rescue)
        writer.join(WAIT_S)
        assert not writer.is_alive(), "the put waited for a hung tier"
        assert result == [[True]]
        row = engine.stats()["tiers"][1]
        assert not row["healthy"] and row["write_timeouts"] == 1 and row["writes_abandoned"] == 1
        left = list(engine._writes.io.requests())
        assert left and all(w.orphan and w.staging is not None for w in left)
        assert pages.checked_get(engine, keys, SingleTier(0)) == [True]
        _close_while_hung(engine)
    finally:
        _resume(fs, engine, *rescue)
    assert not tmp_files(a[1])


@pytest.mark.leaves_problems("the tier is hung when the engine closes: check() would wait for it")
@pytest.mark.parametrize("discover", [True, False], ids=["discovery", "create"])
def test_a_put_that_starts_while_the_brick_hangs_answers_at_write_timeout(dfs, discover):
    """The brick stops (SIGSTOP; the clients' ping timeout raised) before a put: the first call made on
    the shared tier hangs in the FUSE client: discovery's look for the new key (the put's own thread),
    or with discovery off the writer's create of the temporary file. Each runs on the tier's own thread
    (bounded.py): past write_timeout tier 1 fails and the put answers True from tier 0 (before: the
    put, or the writer thread and with it the writes of every tier and every put, waited as long as
    the brick). A second put answers at once (the tier is hung: no call waits behind the one still
    out). The brick resumes: the file a late create made goes."""
    fs, a, b, node = dfs
    pages = PageSet(1 << 20)
    keys = pages.keys(2)
    fs.cli("volume", "set", fs.volume, "network.ping-timeout", "600")
    engine = make_engine(a, replicate="all", write_timeout=1.0, tier_retry=600, discover=discover)
    rescue = _stop_brick(fs)
    try:
        for i in range(2):
            result: list = []
            writer = threading.Thread(target=lambda: result.append(pages.put(engine, keys[i:i + 1])))
            writer.start()
            writer.join(WAIT_S)
            assert not writer.is_alive(), "the put waited for a hung tier"
            assert result == [[True]]
        row = engine.stats()["tiers"][1]
        assert not row["healthy"] and "timed out" in row["last_error"].lower()
        assert row["write_timeouts"] == (0 if discover else 1)  # (the create: the writer's call timed out)
        assert engine.stats()["tiers"][0]["pages_written"] == 2
        assert pages.checked_get(engine, keys, SingleTier(0)) == [True, True]
        _close_while_hung(engine)
    finally:
        _resume(fs, engine, rescue)
    deadline = time.monotonic() + WAIT_S
    while tmp_files(a[1]):  # (the late create's file is removed by the tier's thread when it returns)
        assert time.monotonic() < deadline, f"the late create's file stays: {tmp_files(a[1])}"
        time.sleep(0.1)


@pytest.mark.leaves_problems("the tier is hung when the engine closes: check() would wait for it")
def test_a_get_that_opens_a_page_on_the_hung_brick_answers_from_the_other_tier(dfs):
    """Two pages on both tiers; the brick stops (SIGSTOP; the clients' ping timeout raised, GlusterFS's
    open-behind off so that an open asks the brick, as an NFS or Lustre open does) before a get: tier 1's
    claim opens the page's file, and the open hangs in the FUSE client. It runs on the tier's read
    thread (bounded.py), waited for at most write_timeout: then tier 1 fails and tier 0 reads what it
    had claimed; the get answers True (before: the get's own thread waited in the open as long as the
    brick, tier 0's reads with it). A second get answers without waiting for the tier. The brick
    resumes: the descriptor the late open returned is closed."""
    fs, a, b, node = dfs
    pages = PageSet(1 << 20)
    keys = pages.keys(2)
    fs.cli("volume", "set", fs.volume, "network.ping-timeout", "600")
    fs.cli("volume", "set", fs.volume, "performance.open-behind", "off")
    engine = make_engine(a, replicate="all", write_timeout=1.0, tier_retry=600)
    rescue = None
    try:
        assert pages.put(engine, keys) == [True, True]
        rescue = _stop_brick(fs)
        for i in range(2):
            result: list = []
            reader = threading.Thread(target=lambda: result.append(pages.checked_get(engine, keys[i:i + 1])))
            reader.start()
            reader.join(WAIT_S / 2)
            assert not reader.is_alive(), "the get waited for a hung tier's open"
            assert result == [[True]]
        row = engine.stats()["tiers"][1]
        assert not row["healthy"] and "timed out" in row["last_error"].lower()
        assert engine.stats()["tiers"][0]["blocks_read"] > 0
        _close_while_hung(engine)
    finally:
        _resume(fs, engine, rescue)
        fs.cli("volume", "reset", fs.volume, "performance.open-behind")


@pytest.mark.leaves_problems("the tier is hung when the engine closes: check() would wait for it")
def test_a_get_whose_reads_hang_on_the_brick_answers_from_the_other_tier(dfs):
    """A page on both tiers; a get's first read of it from the shared tier is held in the ring (its
    file open) until the brick stops, and the reads that follow hang in the kernel. They read into
    staging (another tier holds the page), so once tier 1 is overdue tier 0 reads its items and the get
    answers True, long before read_timeout."""
    fs, a, b, node = dfs
    pages = PageSet(1 << 20)
    keys = pages.keys(1)
    plan = TierFaultPlan()
    fs.cli("volume", "set", fs.volume, "network.ping-timeout", "600")
    engine = make_engine(a, replicate="all", write_timeout=1.0, tier_retry=600, fault_plan=plan)
    rescue: list = []
    try:
        assert pages.put(engine, keys) == [True]
        reader, result = _held_until_the_brick_stops(fs, plan, a[1], OP_READ, lambda: pages.checked_get(engine, keys),
                                                     rescue)
        reader.join(WAIT_S / 2)
        assert not reader.is_alive(), "the get waited for a hung tier's reads"
        assert result == [[True]]
        assert engine.stats()["read_timeouts"] == 0
        _close_while_hung(engine)
    finally:
        _resume(fs, engine, *rescue)


def _payload(path: str) -> bytes:
    """The payload bytes of the page file at ``path`` now (a client's stale entry of a file replaced by
    the other node answers ESTALE for about a second: GlusterFS's own caching, waited out)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            with open(path, "rb") as f:
                return f.read()[HEADER_SIZE:HEADER_SIZE + PAGE_BYTES]
        except OSError as exc:
            assert exc.errno == errno.ESTALE and time.monotonic() < deadline, exc
            time.sleep(0.1)


def _stale_on(path: str) -> bool:
    """This node's client still answers ``lstat`` of ``path`` from its cache (the file is gone on the
    server: the other node removed it): the window in which the race below is certain."""
    try:
        os.lstat(path)
        return True
    except OSError:
        return False


@pytest.mark.parametrize("how", ["delete", "clear", "evict"])
def test_a_put_after_another_node_removed_the_page_writes_it_again(dfs, how):
    """Node A holds page K on the shared tier alone (its tier 0 keeps one page). It reads K (its FUSE
    client now caches K's name), then node B removes K from the shared tier (delete, clear(), or an
    eviction under B's capacity of one page there), and A puts K again at once. The put answers True,
    so it must leave a copy (guarantees.md promise 2). Before, the put's look on disk (one ``stat``)
    was answered from A's client cache (GlusterFS keeps an unlinked file's entry ~1 s): True with no
    I/O and no copy anywhere. Found by a review."""
    fs, a, b, node = dfs
    pages = PageSet()
    engine = make_engine(a, replicate="all", catchup=False, capacity=f"{PAGE_BYTES}{os.pathsep}")
    try:
        node("open", b, {"capacity": f"{os.pathsep}{PAGE_BYTES}"} if how == "evict" else {})
        for attempt in range(5):  # (certain once A's stale entry is seen; a step slowed past ~1 s misses it)
            k, other = pages.keys(2, start=2 * attempt)
            assert pages.put(engine, [other, k]) == [True, True]  # tier 0 keeps `other` (the first): k on tier 1 alone
            assert engine.index.holders(k) == 0b10
            if how == "evict":  # B evicts k only as a page it found at its start: one A wrote since B began is
                node("close")  # A's, never B's victim (guarantees.md "Capacity is per process")
                node("open", b, {"capacity": f"{os.pathsep}{PAGE_BYTES}"})
            assert node("get", pages.salt, 2 * attempt, 1, 0)["exact"] == [True]  # B indexes k
            assert pages.checked_get(engine, [k], SingleTier(1)) == [True]  # A's client caches k's name
            if how == "delete":
                assert node("delete", pages.salt, 2 * attempt, 1)["held"] == 1
            elif how == "clear":
                node("clear")
            else:
                assert node("put", "b-pages", attempt, 1, 0)["stored"] == [True]  # evicts k from the shared tier
            gone = not os.path.exists(os.path.join(b[1], os.path.relpath(engine.tiers[1].layout.page_path(k), a[1])))
            if gone and _stale_on(engine.tiers[1].layout.page_path(k)):
                break
        else:
            pytest.skip("A's client never answered for the removed file from its cache")
        assert pages.put(engine, [k]) == [True]
        assert pages.checked_get(engine, [k]) == [True], "the put answered True and left no copy of the page"
    finally:
        engine.check(fix=True)  # (B's removals: A reconciles, as guarantees.md says)
        engine.close()


def test_a_page_another_node_stored_again_after_removing_ours_is_never_our_victim(dfs):
    """Node A stores K on the shared tier (room for two pages there); node B, opened after (its scan counts
    K), deletes K and stores it again: B's live page under the name, the same bytes. A's index still lists K
    as its own copy there; A's next puts evict it, and the file under K's name, B's, stays (Index.mine: its
    header's ``created`` is not one A wrote, its file written since A began). Before (review dfs, stop 49),
    A's eviction removed it: B's next get missed."""
    fs, a, b, node = dfs
    pages = PageSet()
    k0, k1, k2 = pages.keys(3)
    with make_engine(a, replicate="all", capacity=os.pathsep.join(["", str(PAGE_BYTES * 5 // 2)])) as engine:
        assert pages.put(engine, [k0]) == [True]
        assert engine.index.holders(k0) == 0b11
        assert node("open", b, {"replicate": "all"})["pages"] == 1
        assert node("delete", pages.salt, 0, 1)["held"] == 1
        assert node("put", pages.salt, 0, 1, 0)["stored"] == [True]  # B's page now, the same bytes
        path = engine.tiers[1].layout.page_path(k0)
        wait_until(lambda: os.path.exists(path), WAIT_S, "B's page never showed on A's mount")
        ino = os.stat(path).st_ino
        assert pages.put(engine, [k1, k2]) == [True, True]  # K's room: A's least recent there
        assert engine.stats()["tiers"][1]["evictions"] == 1 and engine.index.holders(k0) == 0b01
        assert os.path.exists(path) and os.stat(path).st_ino == ino, "A's eviction removed B's live page"
        assert node("get", pages.salt, 0, 1, 0)["exact"] == [True]
        assert [p.kind for p in engine.check(fix=True)] == ["index_missing"]  # B's page: A indexes it,
        assert engine.index.theirs(1) == 1  # as another's (not counted); its check at close is clean


def test_a_restart_counts_and_trims_the_shared_tier_as_found(dfs):
    """Node A (an earlier run) and node B each left two pages on the shared tier; A starts again with room
    for two there: its start-up scan counts the four (found at its start: none is another's written since)
    and trims them to two (guarantees.md "Capacity is per process")."""
    fs, a, b, node = dfs
    mine = PageSet(salt="a-old")
    with make_engine(a, replicate="all") as engine:
        assert mine.put(engine, mine.keys(2)) == [True, True]
        assert all(engine.index.holders(k) == 0b11 for k in mine.keys(2))
    node("open", b, {"replicate": "all"})
    assert node("put", "b-pages", 0, 2, 0)["stored"] == [True, True]
    wait_until(lambda: len(page_files(a[1])) == 4, WAIT_S, "B's pages never showed on A's mount")
    node("close")
    with make_engine(a, replicate="all", capacity=os.pathsep.join(["", str(PAGE_BYTES * 5 // 2)])) as engine:
        row = engine.stats()["tiers"][1]
        assert row["theirs_pages"] == 0 and row["used_bytes"] <= row["capacity_bytes"], row
        assert len(page_files(a[1])) == 2


def test_a_catchup_copy_never_replaces_the_version_another_node_renamed_in_before_its_commit(dfs, monkeypatch):
    """Node A's page K lacks the shared tier (its replica failed with the tier: EIO) and is owed there.
    When the tier is back, A's catch-up copy is written; node B stores its own version of K on the shared
    tier just before A's copy is moved into place (after the copy's last look that no file has the name,
    jobs.py _wanted_under_writer). guarantees.md: a file of the page's name the index does not list
    (another writer's version) is never replaced by a catch-up copy. Found by a review."""
    fs, a, b, node = dfs
    node("open", b, {"discover": False})
    pages = PageSet()
    k = pages.keys(1)
    clock = FakeClock()
    plan = TierFaultPlan()
    plan.on(a[1], Fault.error(errno.EIO), opcode=OP_WRITE, times=1)
    with make_engine(a, clock=clock, fault_plan=plan, replicate="all") as engine:
        assert pages.put(engine, k) == [True]
        assert engine.index.holders(k[0]) == 0b01 and not engine.tiers[1].healthy
        final = engine.tiers[1].layout.page_path(k[0])
        fired = threading.Event()

        def b_first(move):  # (os.rename, or os.link where a commit replaces nothing)
            def moved(src, dst, *args, **kwargs):
                if dst == final and not fired.is_set():
                    fired.set()
                    assert node("put", pages.salt, 0, 1, 1)["stored"] == [True]  # B's version lands first
                return move(src, dst, *args, **kwargs)
            return moved

        for name in ("rename", "link"):
            monkeypatch.setattr(os, name, b_first(getattr(os, name)))
        clock.advance(engine.config.tier_retry + 0.01)
        assert pages.checked_get(engine, k) == [True]  # (the call that finds tier 1 back)
        wait_until(lambda: engine.tiers[1].healthy and engine.stats()["tiers"][1]["replication_pending"] == 0,
                   what="the catch-up copy never ended")
        monkeypatch.undo()
        assert fired.is_set(), "A's catch-up copy never reached its commit"
        data = _payload(os.path.join(b[1], os.path.relpath(final, a[1])))
        assert data == twin_content(k[0], 1), "A's catch-up copy replaced node B's version on the shared tier"
        engine.check(fix=True)  # (B's version on the shared tier: A reconciles)


def test_delete_on_one_node_removes_the_copy_another_node_stored(dfs):
    """design.md: ``engine.delete(keys)`` takes every copy off the index and the tiers. Node A stores K on
    the shared tier; node B, which never looked K up, deletes it: the copy goes, and B's next lookup
    misses (before: B removed only what its index listed, nothing, and found K again at once)."""
    fs, a, b, node = dfs
    node("open", b, {})
    pages = PageSet()
    k = pages.keys(1)
    with make_engine(a, replicate="all") as engine:
        assert pages.put(engine, k) == [True]
        path = os.path.join(b[1], os.path.relpath(engine.tiers[1].layout.page_path(k[0]), a[1]))
        node("delete", pages.salt, 0, 1)
        assert not os.path.exists(path), "B's delete left A's copy of the key on the shared tier"
        assert node("get", pages.salt, 0, 1, 0)["found"] == [False], "B found the key it had just deleted"
        engine.check(fix=True)


@pytest.mark.leaves_problems("the tier is hung when the engine closes: check() would wait for it")
def test_a_get_whose_open_answers_estale_as_the_brick_hangs_answers_from_the_other_tier(dfs, monkeypatch):
    """A page on both tiers. A get's open of it on the shared tier answers ESTALE (what GlusterFS
    answers once node B renamed a new version over it, or removed it) and the brick stops (SIGSTOP,
    ping timeout raised) at that moment. guarantees.md: a get's calls on a tier that may hang are
    waited for at most write_timeout or what is left of its read_timeout; then the tier fails and its
    items go to the other holders (tier 0 here). So is the listing of the shard directory that tells a
    replaced file from a deleted one (delivery.failed_read_under_reads -> Tier.listed). Before, it ran in
    the get's own thread, holding the read lock, until the brick resumed, and a second get waited
    behind it (found by the review of two GlusterFS nodes under load)."""
    fs, a, b, node = dfs
    pages = PageSet(1 << 20)
    keys = pages.keys(2)
    fs.cli("volume", "set", fs.volume, "network.ping-timeout", "600")
    engine = make_engine(a, replicate="all", write_timeout=1.0, read_timeout=5.0, tier_retry=600)
    rescue = []
    real_open = tiers_module.open_direct
    target = engine.tiers[1].layout.page_path(keys[0])

    def open_direct(path, *args, **kwargs):
        if path == target and not rescue:
            rescue.append(_stop_brick(fs))  # the server hangs as the open answers ESTALE
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), path)
        return real_open(path, *args, **kwargs)

    try:
        assert pages.put(engine, keys) == [True, True]
        monkeypatch.setattr(tiers_module, "open_direct", open_direct)
        results: dict = {}
        first = threading.Thread(target=lambda: results.setdefault(0, pages.checked_get(engine, keys[:1])))
        first.start()
        wait_until(lambda: rescue, 30, "the open never ran")
        second = threading.Thread(target=lambda: results.setdefault(1, pages.checked_get(engine, keys[1:])))
        second.start()
        first.join(15)
        second.join(3)
        stack = "".join(traceback.format_stack(sys._current_frames()[first.ident])[-4:]) if first.is_alive() else ""
        assert not first.is_alive(), f"the get waited for the hung tier's listing after ESTALE:\n{stack}"
        assert not second.is_alive(), "a get waited behind the read lock a hung listing holds"
        assert results == {0: [True], 1: [True]}
    finally:
        _resume(fs, engine, *rescue)
        first.join(WAIT_S)
        second.join(WAIT_S)


@pytest.mark.parametrize("how", ["delete", "replace"])
def test_check_never_reports_a_page_another_node_removes_or_replaces_while_it_is_read(dfs, monkeypatch, how):
    """``kvstream check`` (check_tiers) on node A while node B serves: B deletes a page of the shared tier,
    or renames its own version over it, while A's check reads that page's payload through the descriptor
    it read the header from. guarantees.md "Several processes on the same tiers": a page removed or
    replaced while it is read is judged as the file it read, never ``corrupt`` (on GlusterFS the
    descriptor still reads the file another node removed: no ESTALE), and --fix removes nothing."""
    fs, a, b, node = dfs
    node("open", b[1:], {"discover": False})  # (no lookup: B's put renames its version over A's file)
    pages = PageSet()
    keys = pages.keys(N)
    real = integrity.verify_payload
    hit: list[str] = []  # (one page per check, never one hit before)
    armed = threading.Event()

    def verify_payload(fd, header):
        shared = os.readlink(f"/proc/self/fd/{fd}").startswith(a[1] + os.sep)
        if armed.is_set() and shared and header.key not in hit:
            armed.clear()
            hit.append(header.key)
            i = keys.index(header.key)
            if how == "delete":
                node("delete", pages.salt, i, 1)
            else:
                assert node("put", pages.salt, i, 1, 1)["stored"] == [True]
        return real(fd, header)

    with make_engine(a, replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * N
        monkeypatch.setattr(integrity, "verify_payload", verify_payload)
        for fix in (False, True):
            armed.set()
            problems = check_tiers(engine.config, fix=fix)
            assert not armed.is_set(), "the check never read a page of the shared tier"
            assert problems == [], f"a valid page another node {how}d mid-check was reported: {problems}"
        monkeypatch.undo()
        engine.check(fix=True)  # (B's removals and versions: A reconciles)


def test_check_fix_and_info_while_both_nodes_put_evict_and_replace_report_and_remove_nothing(dfs):
    """The operator runs ``kvstream check``, ``check --fix`` and ``info`` on node A while both nodes serve:
    each puts batches on the shared tier under a capacity there of 4 pages (evicting its own pages), B
    also replaces A's pages with its own version and deletes some. Nothing is reported, nothing of a
    live writer removed: every batch a node's put just acknowledged is read back whole by it."""
    fs, a, b, node = dfs
    cap = {"capacity": os.pathsep.join(["", str(PAGE_BYTES * 4)]), "replicate": "all"}
    node("open", b, cap)
    stop, errors = threading.Event(), []

    def b_serves():
        r = 0
        while not stop.is_set():
            try:
                assert node("put", "b-pages", r % 16, 3, 0)["stored"] == [True] * 3
                got = node("get", "b-pages", r % 16, 3, 0)
                assert got["found"] == got["exact"] == [True] * 3, got
                node("put", "a-pages", r % 8, 1, 1)  # B's version of one of A's pages
                node("delete", "a-pages", (r + 3) % 8, 1)
            except AssertionError as exc:
                errors.append(f"round {r}: {exc}")
            r += 1

    serving = threading.Thread(target=b_serves)
    mine = PageSet(salt="a-pages")
    with make_engine(a, **cap) as engine:
        serving.start()
        try:
            outs = []
            for r in range(3):
                keys = mine.keys(3, start=r * 3 % 8)
                assert mine.put(engine, keys) == [True] * 3
                for args in (("check",), ("check", "--fix"), ("info",)):
                    proc = kvstream_cli(*args, "--tiers", *a)
                    outs.append((args, proc.returncode, proc.stdout + proc.stderr))
        finally:
            stop.set()
            serving.join(WAIT_S)
        bad = [o for o in outs if o[1] != 0]
        assert not bad, "\n".join(f"{args}: exit {rc}\n{out}" for args, rc, out in bad)
        assert not errors, errors
        kinds = {p.kind for p in engine.check(fix=True)}
        assert kinds <= {"index_missing", "index_stale"}, kinds


def test_pages_another_node_put_since_a_node_began_are_never_its_victims_on_the_shared_tier(dfs):
    """guarantees.md promise 7 (lines 103-105): a page another process wrote since a process began is never
    evicted by it, even once it found and read it. Node B (room for 2 pages on the shared tier) starts; A
    stores 6 pages; B reads them all (discovered), then stores 8 of its own, evicting its own only."""
    fs, a, b, node = dfs
    node("open", b, {"capacity": os.pathsep.join(["", str(PAGE_BYTES * 5 // 2)]), "replicate": "all"})
    mine = PageSet(salt="a-pages")
    keys = mine.keys(6)
    with make_engine(a, replicate="all") as engine:
        assert mine.put(engine, keys) == [True] * 6
        got = node("get", "a-pages", 0, 6, 0)
        assert got["found"] == got["exact"] == [True] * 6
        for i in range(8):
            assert node("put", "b-pages", i, 1, 0)["stored"] == [True]
        assert mine.checked_get(engine, keys, SingleTier(1)) == [True] * 6, "B evicted A's pages"
        assert [t["pages"] for t in node("stats")["tiers"]][1] <= 8
        engine.check(fix=True)


def test_two_nodes_storing_one_key_with_other_bytes_keep_one_whole_version_and_delete_nothing(dfs):
    """guarantees.md promise 7 (lines 106-110): two nodes store the same keys at the same moment with other
    bytes; each tier keeps one writer's version, none is deleted for being the other's, and each node reads
    one whole version of every page, verified."""
    fs, a, b, node = dfs
    node("open", b, {"replicate": "all"})
    mine = PageSet(salt="both")
    theirs = PageSet(PAGE_BYTES, salt="both", data=lambda k: twin_content(k, 1))
    keys = mine.keys(N)
    with make_engine(a, replicate="all") as engine:
        for _ in range(3):
            other = threading.Thread(target=lambda: node("put", "both", 0, N, 1))
            other.start()
            assert mine.put(engine, keys) == [True] * N
            other.join(WAIT_S)
        found, got = mine.get(engine, keys)
        assert found == [True] * N
        assert all(d in (mine.data(k), theirs.data(k)) for k, d in zip(keys, got)), "a mix of two versions"
        v0, v1 = node("get", "both", 0, N, 0), node("get", "both", 0, N, 1)
        assert v0["found"] == [True] * N and all(x or y for x, y in zip(v0["exact"], v1["exact"]))
        for tier in (a[0], a[1], b[0]):
            assert len(page_files(tier)) == N, f"a version deleted on {tier}"
        engine.check(fix=True)


def test_one_nodes_clear_while_the_other_puts_leaves_every_page_put_after_it(dfs):
    """SGLang's /clear_hicache_storage_backend on node B while node A keeps putting on the shared tier: A's
    puts all answer True (B's clear never takes A's temporary files), every page A put after B's clear
    returned is found by both nodes, and B's index lists those alone."""
    fs, a, b, node = dfs
    node("open", b, {"replicate": "all"})
    mine = PageSet(salt="a-pages")
    stop, stored = threading.Event(), []
    with make_engine(a, replicate="all") as engine:
        def a_serves():
            i = 0
            while not stop.is_set() or i < 48:
                stored.append(mine.put(engine, mine.keys(2, start=i)))
                i += 2
        serving = threading.Thread(target=a_serves)
        serving.start()
        node("clear")
        after = len(stored) * 2 + 2  # (the batch in flight as the clear returned may be before it)
        stop.set()
        serving.join(WAIT_S)
        assert all(s == [True, True] for s in stored), stored
        keys = mine.keys(len(stored) * 2)[after:]
        assert keys, "A put nothing after the clear"
        assert mine.checked_get(engine, keys, SingleTier(1)) == [True] * len(keys)
        got = node("get", "a-pages", after, len(keys), 0)
        assert got["found"] == got["exact"] == [True] * len(keys)
        assert node("stats")["tiers"][1]["pages"] == len(keys)
        engine.check(fix=True)


def test_a_page_no_write_can_fit_on_a_glusterfs_volume_evicts_nothing(small_volume, tier_root, caplog):
    """A page smaller than the volume's size (statvfs f_blocks) but larger than what its brick lets be written
    (the blocks ext4 and GlusterFS's storage.reserve keep back: f_bfree - f_bavail) never fits. It was written:
    it filled the brick, its ENOSPC evicted every valid page of the tier and it failed all the same (a 96 MiB
    brick: a page of its size less 2 MiB evicted 16 pages of 1 MiB; here: its size less half the reserve). It is
    refused as a page larger than the file system is, with one warning; the pages stay, served byte for byte."""
    other = os.path.join(tier_root, "t0")
    os.makedirs(other)
    st = os.statvfs(small_volume)
    reserved = (st.f_bfree - st.f_bavail) * st.f_frsize
    assert reserved > 0, st  # (GlusterFS's storage.reserve, 1 % by default; loop_fs's ext4 reserves none)
    size = (st.f_blocks * st.f_frsize - reserved // 2) // 65536 * 65536  # (no ext4 holds it: f_bfree)
    assert st.f_bfree * st.f_frsize < size < st.f_blocks * st.f_frsize, st
    small, near = PageSet(MIB, salt="s"), PageSet(size, salt="n")
    with make_engine([other, small_volume]) as engine:
        assert small.put(engine, small.keys(16)) == [True] * 16
        assert near.put(engine, near.keys(1)) == [True]  # (tier 0 holds it)
        t1 = engine.stats()["tiers"][1]
        assert t1["evictions"] == 0, f"valid pages evicted for a page that can never fit: {t1}"
        assert t1["write_failures"] == 1 and tmp_files(small_volume) == [], t1
        assert all(engine.index.holders(k) & 2 for k in small.keys(16))
        assert small.checked_get(engine, small.keys(16), policy=SingleTier(1)) == [True] * 16
        assert near.checked_get(engine, near.keys(1)) == [True]
    said = [m for m in messages(caplog, "larger than") if "tier 1" in m]
    assert len(said) == 1 and "storage.reserve" in said[0], said


def test_a_node_restarts_on_a_full_glusterfs_volume(small_volume, tier_root, caplog):
    """Both nodes' pages fill the shared GlusterFS tier (its steady state: no capacity set, the volume's size). A
    full volume refuses a new file (storage.reserve), or takes the probe's write and reports its refusal at the
    read back: a node's LMCache server killed and started again was refused at every start ('is not writable (No
    space left on device): fix its permissions or mount', or 'test read failed'), a crash loop (trial lmgluster).
    Full is not failed: the engine starts with the tier healthy and says it is full."""
    t0 = os.path.join(tier_root, "t0")
    os.makedirs(t0)
    pages = PageSet(MIB)
    with make_engine([t0, small_volume]) as engine:  # (the node ran there before: its directories are made)
        assert pages.put(engine, pages.keys(2)) == [True] * 2
    with open(os.path.join(small_volume, "filler"), "wb") as f:  # (another node's pages: room it cannot make)
        block = b"\xa5" * MIB
        with pytest.raises(OSError) as full:
            while True:
                f.write(block)
                f.flush()
                os.fsync(f.fileno())
        assert full.value.errno == errno.ENOSPC

    def refuses_new_files() -> bool:
        try:
            os.close(os.open(os.path.join(small_volume, "x"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:
            return exc.errno == errno.ENOSPC
        os.unlink(os.path.join(small_volume, "x"))
        return False

    wait_until(refuses_new_files, WAIT_S, "the full volume still takes new files")  # (its reserve checked every
    # few seconds)
    caplog.set_level("WARNING", logger="kvstream")
    with make_engine([t0, small_volume]) as engine:
        assert [t["healthy"] for t in engine.stats()["tiers"]] == [True, True]
        assert pages.checked_get(engine, pages.keys(2), policy=SingleTier(1)) == [True] * 2
        assert pages.put(engine, pages.keys(2, 10)) == [True] * 2  # (tier 0 takes them)
    said = messages(caplog, "is full (its test write", small_volume)
    assert len(said) == 1 and "No space left on device" in said[0], caplog.text
    assert tmp_files(small_volume) == []


def test_sglang_s_launcher_names_a_dead_mount_never_a_missing_directory(dfs):
    """SGLang's launcher probes the tiers (plugin.check_extra_config, probe=True). A GlusterFS client killed,
    its mount answers ENOTCONN: the probe said the tier 'does not exist: create it (mkdir -p ...)', which fails
    there too and hides the cause; it names the error and the mount."""
    from kvstream_hicache.errors import ConfigError
    from kvstream_hicache.sglang.plugin import check_extra_config

    fs, _, b, _ = dfs
    fs.kill_client("b")
    with pytest.raises(ConfigError) as exc:
        check_extra_config("kvstream", json.dumps({"tiers": b}), environ={}, probe=True)
    said = str(exc.value)
    assert b[1] in said and os.strerror(errno.ENOTCONN) in said and "mkdir" not in said, said
    assert "mount" in said, said


@pytest.mark.leaves_problems("node B's index lists the shared tier's copies node A's clear removed")
@pytest.mark.xfail(strict=True, reason="a clear is one server's: another server's catch-up copies the pages it "
                   "holds back to the shared tier (nothing on the shared tier tells other servers of a clear: "
                   "docs/sglang.md, clear every server sharing a tier)")
def test_a_page_one_node_cleared_is_not_brought_back_to_the_shared_tier_by_another(dfs):
    """Node A clears (SGLang's clear route after a weight update) while node B runs; B had read A's pages (its
    tier 0 holds its own copies). B's next read of such a page from the shared tier (its router's choice; here
    forced) misses and its catch-up copies B's copy back there within a second: A then serves the pages it
    cleared (Engine.clear: 'never served again, nor found')."""
    _, a, b, _ = dfs
    pages = PageSet(salt="cleared")
    keys = pages.keys(4)
    with make_engine(a) as node_a, make_engine(b) as node_b:
        assert pages.put(node_a, keys) == [True] * 4
        wait_until(lambda: all(node_b.contains(k) for k in keys), WAIT_S, "B never saw A's pages")
        assert pages.checked_get(node_b, keys) == [True] * 4  # (B's tier 0 gets its own copies)
        wait_until(lambda: all(node_b.index.holders(k) == 0b11 for k in keys), WAIT_S, "no copy on B's tier 0")
        mine = PageSet(salt="b-own")  # (B's own pages on the shared tier, which A's clear removes too)
        assert mine.put(node_b, mine.keys(4)) == [True] * 4
        time.sleep(1)
        node_a.clear()
        assert pages.checked_get(node_b, keys, policy=SingleTier(1)) == [True] * 4  # (from its tier 0)
        time.sleep(2)  # (B's catch-up, if it copies them back)
        hits, _ = pages.get(node_a, keys)
        assert not any(hits), f"node A served {sum(hits)} of the {len(keys)} pages it cleared"


def test_a_full_glusterfs_volume_keeps_taking_a_node_s_new_pages(small_volume, tier_root):
    """The shared tier at its steady state: full of the node's pages (no capacity set: the volume's size). A full
    GlusterFS volume takes a page's writes and refuses them at the close (its write-behind): the engine evicted
    nothing there and failed the page, so every later page was refused the same way, for good (trial lmgluster:
    from the volume's first ENOSPC on, 0 of each 8 new pages reached it, and node B missed every chunk node A
    stored). As on ext4, each new page lands, the node's least recent pages evicted for it."""
    t0 = os.path.join(tier_root, "t0")
    os.makedirs(t0)
    pages = PageSet(256 << 10)
    landed = []
    with make_engine([t0, small_volume], replicate="all", capacity=[str(8 * MIB), ""]) as engine:
        for b in range(0, 640, 8):  # 160 MiB through a 96 MiB brick
            keys = pages.keys(8, b)
            assert pages.put(engine, keys) == [True] * 8
            landed.append(sum(bool(engine.index.holders(k) & 0b10) for k in keys))
        t1 = engine.stats()["tiers"][1]
        assert t1["evictions"] > 0, t1  # (it filled)
        assert landed == [8] * len(landed) and t1["write_failures"] == 0, (landed, t1)
        last = pages.keys(8, 632)
        assert pages.checked_get(engine, last, policy=SingleTier(1)) == [True] * 8
    assert tmp_files(small_volume) == []
