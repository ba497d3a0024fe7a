"""A clear() the shared tier 1 missed, done as it rejoins (Tier._remove_pages(owed=True)), on a real
GlusterFS volume mounted by two "nodes" (from the review of the owed clear on GlusterFS, stop 44). Node A is this process (tier 0 local, tier 1 the volume
through mount a); node B is a child engine (tests/node.py) on another mount of the volume.

A node whose clock differs from A's is a child with libfaketime (FAKETIME) whose own GlusterFS client runs
under the same offset (mount.glusterfs started with the same environment): with features.ctime on, GlusterFS's
default, a file's times are stamped by the writing client, so that node's pages carry its clock both in their
headers and in their files' times, as on a real node.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import uuid

import pytest

from kvstream_hicache import tiers as tiers_module
from kvstream_hicache import trust as trust_module

from kvstream_hicache.router import SingleTier

from helpers import PAGE_BYTES, Node, PageSet, make_engine, page_files, twin_content, wait_until

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
N = 4


def _faked_env(offset: str) -> dict:
    return {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_DONT_RESET": "1"}


@pytest.fixture
def share(glusterfs, tier_root):
    """A fresh shared directory on the volume; A's tiers (local a0, the share through mount a); a factory
    of another node's view: ``node_b(offset)`` -> (its tiers, a Node child) where offset ('+30s', '-2m', None)
    is its clock against A's (its own GlusterFS client mounted with it too)."""
    if not os.path.exists(LIBFAKETIME):
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    name = f"share-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(glusterfs.mount("a"), name))
    a = [os.path.join(tier_root, "a0"), os.path.join(glusterfs.mount("a"), name)]
    os.makedirs(a[0])
    made: list = []

    def node_b(offset: str | None, discover: bool = True):
        b0 = os.path.join(tier_root, f"b0-{len(made)}")
        os.makedirs(b0)
        if offset is None:
            mnt = glusterfs.mount("b")
        else:
            mnt = os.path.join(tier_root, f"mnt-b{len(made)}")
            os.makedirs(mnt)
            env = dict(os.environ, **_faked_env(offset))
            subprocess.run(["/sbin/mount.glusterfs", f"{glusterfs.host}:/{glusterfs.volume}", mnt, "-o",
                            f"log-file={glusterfs.root}/client-rev-{len(made)}.log"], env=env, check=True)
        saved = {k: os.environ.get(k) for k in _faked_env("+0")}
        if offset is not None:
            os.environ.update(_faked_env(offset))
        try:
            node = Node()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        made.append((node, mnt if offset is not None else None))
        return [b0, os.path.join(mnt, name)], node

    try:
        yield glusterfs, a, node_b
    finally:
        for node, mnt in made:
            node.stop()
            if mnt is not None:
                glusterfs.umount(mnt)  # (also stops that client by its path)
        try:
            os.stat(glusterfs.mount("a"))
            mounted = os.path.ismount(glusterfs.mount("a"))
        except OSError:
            mounted = False
        if not mounted:
            glusterfs.remount("a")
        shutil.rmtree(os.path.join(glusterfs.mount("a"), name), ignore_errors=True)


def _while_held(monkeypatch, k: str, action) -> tuple[threading.Event, list]:
    """Once ``armed`` is set: ``action()`` (asserted true) runs at the moment a removal (trust.remove,
    judging) holds the file of key ``k`` under its private name, once; ``fired`` says it ran. Only the
    moment is chosen here: every file operation is real."""
    armed, fired = threading.Event(), []
    state = threading.local()
    real_remove, real_not_removable = trust_module.remove, trust_module._not_removable

    def remove(root, path, trust, name_ok=None, judged=None):
        state.looks = 0 if (judged is not None and os.path.basename(path).startswith(k)) else None
        try:
            return real_remove(root, path, trust, name_ok, judged)
        finally:
            state.looks = None

    def not_removable(st, trust):
        looks = getattr(state, "looks", None)
        if looks is not None:
            state.looks = looks + 1
            if state.looks == 2 and armed.is_set() and not fired:  # (the held file's look)
                fired.append(True)
                assert action()
        return real_not_removable(st, trust)

    monkeypatch.setattr(tiers_module, "remove", remove)
    monkeypatch.setattr(trust_module, "_not_removable", not_removable)
    return armed, fired


def _miss_a_clear(fs, engine) -> None:
    """A's mount of the volume goes away (its tier 1 vanishes), and A clears: tier 1 owes the clear."""
    fs.umount("a")
    engine.clear()
    assert not engine.tiers[1].healthy and engine.tiers[1].clear_owed


def _rejoin(fs, engine, probe=None) -> None:
    """A's mount is back: puts (of other keys) until tier 1 has done what it owes and rejoined."""
    fs.remount("a")
    probes = PageSet(salt="probe")
    tries = iter(range(1 << 20))
    wait_until(lambda: (probes.put(engine, probes.keys(1, next(tries))), engine.stats()["tiers"][1]["healthy"])[1],
               60, "tier 1 never rejoined")


@pytest.mark.parametrize("offset", ["+0s", "+5s", "+2m"], ids=["same-clock", "seconds-ahead", "minutes-ahead"])
def test_a_page_another_node_put_before_the_clear_is_not_served_when_its_clock_runs_ahead(share, offset):
    """Node B (clock ahead of A's by seconds, or by 2 minutes: less than CLOCK_SKEW_NS) puts pages on the
    shared tier; then A, its mount away, clears (a weight update): those pages are stale. A's mount comes
    back and tier 1 does the clear it owes. Expected: none of the pages put before the clear is served
    by A. Before: they are kept (their headers' and files' times, on B's clock, are 'after' the clear)
    and A serves them."""
    fs, a, node_b = share
    b, node = node_b(offset)
    node("open", b, {})
    stale = PageSet(salt="stale-b")
    with make_engine(a, tier_retry=1.0) as engine:
        assert node("put", "stale-b", 0, N, 0)["stored"] == [True] * N  # before A's clear
        _miss_a_clear(fs, engine)
        _rejoin(fs, engine)
        assert stale.checked_get(engine, stale.keys(N)) == [False] * N, \
            "pages another node put before the clear are served after it"
        engine.check(fix=True)


def test_a_page_another_node_put_after_the_clear_stays(share, monkeypatch):
    """Node B puts pages on the shared tier after A, its mount away, cleared. When A's tier 1 does the
    clear it owes, B's pages are valid KV acknowledged to B, and stay. (CLEAR_SKEW_NS, the minutes after
    the clear whose pages go too, as far as the nodes' clocks may differ, is 0 here: one clock. A node
    whose clock runs behind A's loses its pages of that long after the clear: cached pages, never a
    stale one served.)"""
    monkeypatch.setattr(tiers_module, "CLEAR_SKEW_NS", 0)
    offset = None
    fs, a, node_b = share
    b, node = node_b(offset)
    node("open", b, {})
    fresh = PageSet(salt="fresh-b")
    with make_engine(a, tier_retry=1.0) as engine:
        _miss_a_clear(fs, engine)
        assert node("put", "fresh-b", 0, N, 0)["stored"] == [True] * N  # after A's clear
        _rejoin(fs, engine)
        got = fresh.checked_get(engine, fresh.keys(N))
        left = sum(os.path.basename(f).startswith(tuple(fresh.keys(N))) for f in page_files(a[1]))
        assert got == [True] * N and left == N, \
            f"another node's pages put after the clear were removed: A found {got}, {left} page files left"
        engine.check(fix=True)


def test_a_new_version_another_node_renames_in_while_the_settle_judges_the_page_stays(share, monkeypatch):
    """A puts key K on the shared tier and, a moment later (its mount away), clears. When tier 1 does the
    clear it owes, it moves K's file to a private name to judge it (trust.remove: only the file judged
    goes). Node B (same clock) puts K (its own version, after the clear: valid KV acknowledged to B) just
    while A holds the old file under its private name. Expected: B's version stays (the newer; A's stale
    one goes). Before: the owed clear moved every page, a recent one too, and renamed it back over B's
    file, which the header read then removed: K was gone from the shared tier, B's acknowledged put lost
    (trust.remove now puts a file back only where nothing took its name)."""
    fs, a, node_b = share
    b, node = node_b(None)
    node("open", b[1:], {"discover": False})
    mine = PageSet(salt="race")
    k = mine.keys(1)[0]
    theirs = PageSet(salt="race", data=lambda key: twin_content(key, 1))
    armed, fired = _while_held(monkeypatch, k, lambda: node("put", "race", 0, 1, 1)["stored"] == [True])
    # (B's new version of K, after the clear, renamed in while A holds K's file under its private name)
    with make_engine(a, tier_retry=1.0) as engine:
        assert mine.put(engine, [k]) == [True]
        _miss_a_clear(fs, engine)  # (within MTIME_SLACK_NS of the put)
        armed.set()
        _rejoin(fs, engine)
        assert fired, "the owed clear never held K's file under a private name"
        got = node("get", "race", 0, 1, 1)
        assert got["found"] == got["exact"] == [True], \
            f"node B's version of K, put after the clear, is gone from the shared tier: {got}"
        assert theirs.checked_get(engine, [k]) == [True]
        engine.check(fix=True)


CRASH_IN_A_REMOVAL = r'''
import os, signal, sys, time
from kvstream_hicache import tiers, trust
from helpers import PageSet, make_engine

real_remove, real_not_removable = trust.remove, trust._not_removable
state = {"looks": None}


def remove(root, path, t, name_ok=None, judged=None):
    state["looks"] = 0 if judged is not None else None
    return real_remove(root, path, t, name_ok, judged)


def not_removable(st, t):
    if state["looks"] is not None:
        state["looks"] += 1
        if state["looks"] == 2:  # the file is under the removal's private name: the process dies (SIGKILL, OOM)
            os.kill(os.getpid(), signal.SIGKILL)
    return real_not_removable(st, t)


tiers.remove, trust._not_removable = remove, not_removable
engine = make_engine(sys.argv[1:], tier_retry=1.0)
probes = PageSet(salt="probe-crash")
for i in range(600):  # (the first put probes tier 1, which owes a clear: its settle starts)
    probes.put(engine, probes.keys(1, i))
    time.sleep(0.05)
sys.exit(3)  # (never reached: the settle renames a page away within seconds)
'''


def test_a_page_of_a_settle_cut_short_by_a_crash_is_not_served_after_the_restart(share):
    """A's tier 1 (the volume) owes a clear recorded on tier 0 (its mount was away at the clear, then the
    process ended). The next start (a child process) begins the owed clear: since 6af416a it renames each
    page to a private name to judge it by its file's time (trust.remove); the process is killed (SIGKILL)
    right then, one stale page under that name. The start after it does the owed clear again (the record
    still names tier 1). Expected: no page put before the clear is served. Before: the owed clear
    passes the private name by (not a page file name), then the scan finds a valid page under a dead
    process's removal name and puts it back under its name (integrity._left_by_removal, Reason.RESTORE):
    the stale page is indexed and served after the clear."""
    fs, a, _ = share
    stale = PageSet(salt="stale-a")
    keys = stale.keys(N)
    with make_engine(a, tier_retry=1.0) as engine:
        assert stale.put(engine, keys) == [True] * N
        _miss_a_clear(fs, engine)
    fs.remount("a")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        os.environ.get("PYTHONPATH", "")])))
    child = subprocess.run([sys.executable, "-c", CRASH_IN_A_REMOVAL, *a], env=env, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == -9, f"the child was to die in the owed clear's removal: {child.stderr[-3000:]}"
    held = [f for _, _, files in os.walk(os.path.join(a[1], "kvstream")) for f in files
            if f.startswith(".kvstream-removing.")]
    with make_engine(a, tier_retry=1.0) as engine:
        assert not engine.tiers[1].healthy  # (it owes the clear still)
        _rejoin(fs, engine)
        assert engine.wait_scan(60.0)
        served = stale.checked_get(engine, keys)
        engine.check(fix=True)
        served_after_check = stale.checked_get(engine, keys)
        assert served == served_after_check == [False] * N, \
            f"pages put before the clear are served after it: {served} (after check(fix=True): " \
            f"{served_after_check}); left under a private name by the crash: {held}"


def test_a_clear_owed_because_the_brick_hung_is_done_once_it_answers(share, monkeypatch):
    """The brick stops (SIGSTOP; ping timeout raised so GlusterFS does not give up itself) and A clears:
    tier 1's listing is given up at write_timeout, the tier fails and owes the clear. The brick resumes;
    node B (same clock) puts pages after the clear; A's tier 1 does what it owes and rejoins: A's pages of
    before the clear are not served, B's of after it are (CLEAR_SKEW_NS 0: one clock)."""
    monkeypatch.setattr(tiers_module, "CLEAR_SKEW_NS", 0)
    fs, a, node_b = share
    b, node = node_b(None)
    node("open", b, {})
    stale, fresh = PageSet(salt="stale-h"), PageSet(salt="fresh-h")
    fs.cli("volume", "set", fs.volume, "network.ping-timeout", "600")
    rescue = None
    try:
        with make_engine(a, tier_retry=1.0, write_timeout=1.0) as engine:
            assert stale.put(engine, stale.keys(N)) == [True] * N
            rescue = subprocess.Popen(["sh", "-c", f"sleep 60; kill -CONT {fs.brick_pid()}"])
            fs.pause_brick()
            engine.clear()
            assert not engine.tiers[1].healthy and engine.tiers[1].clear_owed
            fs.pause_brick(False)
            assert node("put", "fresh-h", 0, N, 0)["stored"] == [True] * N
            probes = PageSet(salt="probe-h")
            tries = iter(range(1 << 20))
            wait_until(lambda: (probes.put(engine, probes.keys(1, next(tries))),
                                engine.stats()["tiers"][1]["healthy"])[1], 90, "tier 1 never rejoined")
            assert stale.checked_get(engine, stale.keys(N)) == [False] * N
            assert fresh.checked_get(engine, fresh.keys(N)) == [True] * N
            engine.check(fix=True)
    finally:
        fs.pause_brick(False)
        if rescue is not None:
            rescue.kill()
            rescue.wait()
        fs.cli("volume", "reset", fs.volume, "network.ping-timeout")


def test_a_clear_of_another_node_during_the_settle_removes_the_page_the_settle_judges(share, monkeypatch):
    """A misses a clear (its mount away); node B (same clock, healthy) puts K after it: valid for now. A's
    mount comes back and its owed clear judges K: modified after the clear, it is moved to a private name
    (trust.remove), found recent, and renamed back. Just while K is under that name, B clears (the next
    weight update): every page of the namespace goes. Expected: K is gone after B's clear and is served by
    neither node (it was written before B's clear). Before: B's clear passes the private name by (not a
    page file name), A renames K back, and both A and B serve K after B's clear."""
    fs, a, node_b = share
    b, node = node_b(None)
    node("open", b, {})
    k = PageSet(salt="cleared-by-b").keys(1)[0]
    pages = PageSet(salt="cleared-by-b")
    armed, fired = _while_held(monkeypatch, k, lambda: node("clear") == {})  # (B, healthy, clears the tier
    # while K is under A's private name)
    with make_engine(a, tier_retry=1.0) as engine:
        _miss_a_clear(fs, engine)
        assert node("put", "cleared-by-b", 0, 1, 0)["stored"] == [True]  # after A's clear, before B's
        armed.set()
        _rejoin(fs, engine)
        assert fired, "the owed clear never held K under a private name"
        by_a = pages.checked_get(engine, [k])
        by_b = node("get", "cleared-by-b", 0, 1, 0)["found"]
        assert by_a == by_b == [False], f"a page put before node B's clear is served after it: by A {by_a}, by B {by_b}"
        engine.check(fix=True)


def test_pages_a_node_whose_clock_runs_behind_put_since_another_began_are_never_its_victims(share):
    """guarantees.md promise 7 (lines 103-105): a page another process wrote since a process began is never
    evicted by it. Node B's clock runs a minute behind A's (within the 300 s of skew the project calls
    honest, trust.CLOCK_SKEW_NS); A starts with room for 2 pages on the shared tier, then B puts 2 pages
    there, A reads them (found by discovery) and puts 4 of its own."""
    fs, a, node_b = share
    b, node = node_b("-60s")
    node("open", b, {"replicate": "all"})
    mine, theirs = PageSet(salt="a-pages"), PageSet(salt="b-pages")
    cap = os.pathsep.join(["", str(PAGE_BYTES * 5 // 2)])
    with make_engine(a, replicate="all", capacity=cap) as engine:
        assert node("put", "b-pages", 0, 2, 0)["stored"] == [True, True]  # (after A began)
        assert theirs.checked_get(engine, theirs.keys(2), SingleTier(1)) == [True, True]
        assert mine.put(engine, mine.keys(4)) == [True] * 4
        assert theirs.checked_get(engine, theirs.keys(2), SingleTier(1)) == [True, True], \
            "A evicted pages node B put on the shared tier after A began"
        engine.check(fix=True)
