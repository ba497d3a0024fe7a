"""A crash mid-write: a child process streams batch puts and is killed with SIGKILL, at an arbitrary
moment and with a batch's writes deliberately in flight (held in the ring: temp files created,
data partly written, nothing renamed). The child appends each acknowledged key to a log, fsynced,
only after ``put`` returned True for it. After a restart on the same tiers: every acknowledged
page is found byte-exact, every page the rebuilt index holds is intact (nothing torn is served),
temporary leftovers are cleaned and counted, and the store's own check finds no problem.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvstream_hicache import check_tiers
from kvstream_hicache.tmpfiles import MARK_PREFIX, parse_tmp_name

from helpers import PageSet, Pages, key, make_array_engine, make_engine, spawn, tmp_files

SIZE = 256 << 10  # payload per page, bytes: a put spends its time writing
BATCH = 8
WAIT_S = 120.0  # the longest the test waits for the child to make progress (a stuck child fails it)
KEY_LINE = re.compile(r"[0-9a-f]{64}")


def _acked(path: str) -> list[str]:
    try:
        with open(path) as f:
            return [line.strip() for line in f if KEY_LINE.fullmatch(line.strip())]
    except FileNotFoundError:  # the child has not opened its log yet
        return []


def _run_and_kill(tiers: list[str], ack: str, start: int, *, acks: int = 0, hold_after: int = -1,
                  wrap: tuple[str, ...] = ()) -> subprocess.Popen | None:
    """Start a writer, wait until ``acks`` new keys are acknowledged (or, with ``hold_after``, until
    its writes are held in flight), then SIGKILL it and reap it. ``wrap``: the command the writer runs under
    (a pid namespace of its own); with ``hold_after`` and ``wrap``, the writer is left running and returned."""
    before = len(_acked(ack))
    child = spawn("writer", os.pathsep.join(tiers), ack, str(start), str(BATCH), "1000", str(SIZE),
                  str(hold_after), wrap=wrap)
    keep = bool(wrap) and hold_after >= 0
    deadline = time.monotonic() + WAIT_S
    try:
        while True:
            text = Path(ack).read_text() if os.path.exists(ack) else ""
            if hold_after >= 0 and "HOLDING" in text.split("START")[-1]:
                break
            if hold_after < 0 and len(_acked(ack)) - before >= acks:
                break
            if child.poll() is not None:
                pytest.fail(f"writer exited early ({child.returncode}): {child.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("writer made no progress")
            time.sleep(0.005)  # polling the child's progress, not a timing assertion
    except BaseException:
        keep = False
        raise
    finally:
        if not keep:
            _kill(child)
    return child if keep else None


def _kill(child: subprocess.Popen) -> None:
    child.kill()  # SIGKILL (of unshare --kill-child: its writer gets SIGKILL too)
    child.communicate()
    assert child.returncode == -signal.SIGKILL


def _verify_restart(tiers: list[str], ack: str, *, leftovers: int) -> dict:
    acked = _acked(ack)
    assert acked, "the writer acknowledged nothing"
    pages = PageSet(SIZE, salt="crash")
    with make_engine(tiers) as engine:
        assert engine.wait_scan(30)
        scan = engine.scan
        assert scan["tmp_removed"] == leftovers
        assert all(tmp_files(d) == [] for d in tiers), "temporary leftovers cleaned"
        # every acknowledged page: found, both replicas, byte-exact
        assert engine.prefix_len(acked) == len(acked)
        assert pages.checked_get(engine, acked) == [True] * len(acked)
        assert all(engine.index.holders(k) == 0b11 for k in acked)
        # every page the rebuilt index holds (acknowledged or committed just before the kill): intact
        indexed = engine.index.keys()
        assert set(acked) <= set(indexed) and len(indexed) <= len(acked) + BATCH
        assert pages.checked_get(engine, indexed) == [True] * len(indexed)
        assert engine.check() == []
    assert check_tiers(engine.config) == []
    return scan


def test_sigkill_while_streaming_puts(tier_dirs, tier_root):
    """Killed at arbitrary moments, twice, on the same tiers (the second run after a restart)."""
    tiers, ack = tier_dirs[:2], os.path.join(tier_root, "acks")
    _run_and_kill(tiers, ack, start=0, acks=3 * BATCH)
    _run_and_kill(tiers, ack, start=10_000, acks=2 * BATCH)
    leftovers = sum(len(tmp_files(d)) for d in tiers)  # whatever the kills left (often a batch's worth)
    _verify_restart(tiers, ack, leftovers=leftovers)


def test_sigkill_with_writes_in_flight(tier_dirs, tier_root):
    """Killed while a batch's writes are held in the ring: its temp files exist, none is renamed;
    none of its pages is acknowledged or served, and a restart removes every leftover."""
    tiers, ack = tier_dirs[:2], os.path.join(tier_root, "acks")
    _run_and_kill(tiers, ack, start=0, hold_after=2)
    leftovers = [f for d in tiers for f in tmp_files(d)]
    assert len(leftovers) == 2 * BATCH, leftovers  # one per page and tier of the held batch
    scan = _verify_restart(tiers, ack, leftovers=2 * BATCH)
    assert scan["pages"] == 2 * BATCH  # exactly the two acknowledged batches
    held = PageSet(SIZE, salt="crash").keys(BATCH, 2 * BATCH)
    with make_engine(tiers) as engine:
        assert engine.prefix_len(held) == 0


def _own_pid_namespace() -> tuple[str, ...]:
    """The command that runs a writer in a pid namespace of its own, as a container does (a restart, after
    the OOM killer took the server, gets a new one: same hostname, other pids); skipped where it cannot."""
    wrap = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1): a pid namespace of the writer's own")
    if subprocess.run([*wrap, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid refused here (a container without CAP_SYS_ADMIN)")
    return wrap


def test_sigkill_of_a_writer_in_a_pid_namespace_of_its_own_leaves_nothing_after_the_next_start(tier_dirs, tier_root):
    """A server in a container, killed with a batch's writes in flight; its restart runs in a new pid
    namespace (here: this process's): its temporary files are named by a host (hostname, pid namespace) that
    is not the restarted engine's. Alive, they are left (its mark held: a live writer's); once it is killed,
    the next start removes and counts them, and check finds nothing (before: kept for an hour as another
    host's, check silent meanwhile: tmpfiles.Leftovers had only the name to judge by)."""
    tiers, ack = tier_dirs[:2], os.path.join(tier_root, "acks")
    wrap = _own_pid_namespace()
    child = _run_and_kill(tiers, ack, start=0, hold_after=2, wrap=wrap)
    try:
        held = [f for d in tiers for f in tmp_files(d)]
        assert len(held) == 2 * BATCH, held
        assert parse_tmp_name(os.path.basename(held[0])).pid < 100  # (named by the pid inside its namespace)
        with make_engine(tiers) as engine:  # while the writer lives: its files are a live writer's
            assert engine.scan["tmp_removed"] == 0 and engine.check() == []
        assert sorted(f for d in tiers for f in tmp_files(d)) == sorted(held)
    finally:
        _kill(child)
    _verify_restart(tiers, ack, leftovers=2 * BATCH)


def _marks_left(tier_dir: str) -> list[str]:
    """The engine marks in ``tier_dir``'s tmp/ once its writer has settled (polled: no timing asserted)."""
    tmp = os.path.join(tier_dir, "kvstream", "tmp")
    for _ in range(200):
        marks = sorted(n for n in os.listdir(tmp) if n.startswith(MARK_PREFIX))
        if not marks:
            break
        time.sleep(0.01)  # polling the writer's idle state, not a timing assertion
    return marks


def test_a_put_refused_for_room_leaves_no_mark_held(tier_dirs):
    """A page whose temporary file was made, then refused (no room: the tier's one page pinned), and no job
    left on the tier: the writer is idle, its mark goes (else it stayed held, an open file on the tier, for
    good: an unmount failed with EBUSY). Its file is discarded on the tier's calls thread, after the writer
    looked: the last file's removal drops the mark (Tier._untrack)."""
    pages = Pages(2)
    keys = [key(i) for i in range(2)]
    with make_array_engine(tier_dirs[:1], capacity=sum(pages.shapes[0])) as engine:
        assert engine.put(keys[:1], pages.src_segments[:1]) == [True]
        assert _marks_left(tier_dirs[0]) == []
        handles = engine.pin(keys[:1])
        assert engine.put(keys[1:], pages.src_segments[1:]) == [False]
        engine.unpin(handles)
        assert _marks_left(tier_dirs[0]) == [], engine.stats()["tiers"][0]
