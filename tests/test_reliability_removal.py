"""Peers restarting beside live writers, and crashes in a removal's window: real child processes stopped
at a chosen point (a patched engine function that signals, then blocks), killed with SIGKILL or left
alive, and engines started on the same tier meanwhile or after.

A removal of a file judged damaged renames the name to a private one (trust.remove) for the moment it
checks that the entry is still the file judged: another writer may have renamed a valid page over the
name since. A crash there left that page under the private name, and the next start deleted it as a
stray; a peer starting meanwhile deleted it from under the live process. Two servers in containers
with the host's network (one hostname, two pid namespaces) judged each other's temporary files by
their own pids. The child runs ``CHILD`` below: it patches the point named by the scenario, then acts.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvstream_hicache import tmpfiles

from helpers import HERE, PageSet, flip_byte, make_engine, page_files, tmp_files, wait_for_file, wait_until

SIZE = 48 << 10

CHILD = textwrap.dedent(r'''
    import os, sys, time
    scenario, tiers, sig = sys.argv[1], sys.argv[2].split(os.pathsep), sys.argv[3]
    from helpers import PageSet, make_engine
    from kvstream_hicache import integrity

    def mark(name):
        open(os.path.join(sig, name), "w").close()

    def wait(name):
        while not os.path.exists(os.path.join(sig, name)):
            time.sleep(0.005)

    def block(name):
        mark(name)
        time.sleep(3600)

    if scenario in ("scan-remove-window", "scan-remove-window-live"):
        # the start-up scan judged a file damaged; another writer renames its valid page over the name
        # (the parent, between 'judged' and 'go'); the scan's removal then renames the name to its
        # private name and is killed before it can put the valid page back (trust.remove)
        fix_problem = integrity.fix_problem

        def fix(problem, fix=True, trust=None, held=None):
            if problem.kind == "damaged":
                mark("judged")
                wait("go")
            return fix_problem(problem, fix, trust, held)

        integrity.fix_problem = fix
        if scenario == "scan-remove-window":
            integrity.same_file = lambda ident: (lambda st: block("window"))
        else:  # the window, then the check as it goes on: not the file judged, so it goes back
            def same_file(ident):
                real = same_file_real(ident)

                def judged(st):
                    mark("window")
                    wait("end-window")
                    return real(st)
                return judged
            same_file_real = integrity.same_file
            integrity.same_file = same_file
        engine = make_engine(tiers, scan_rate=100000)
        engine.wait_scan(120)
        mark("scanned")
        time.sleep(3600)
    if scenario == "held-writer":
        # a live writer: its second put's writes are held in the ring (temporary files written, nothing
        # renamed) until the parent creates 'release'; the put's results go to 'result'
        import json, threading
        from helpers import HoldWrites
        plan = HoldWrites(lambda: mark("holding"))
        engine = make_engine(tiers, fault_plan=plan, catchup=False)
        pages = PageSet(48 << 10, salt="live")
        assert pages.put(engine, pages.keys(2)) == [True, True]

        def release():
            wait("release")
            plan.armed = False
            plan.release()

        threading.Thread(target=release, daemon=True).start()
        plan.armed = True
        ok = pages.put(engine, pages.keys(4, 2))
        found = pages.checked_get(engine, pages.keys(4, 2))
        with open(os.path.join(sig, "result"), "w") as f:
            json.dump({"put": ok, "get": found}, f)
        engine.close()
        raise SystemExit(0)
    if scenario == "peer":
        # a peer (re)starting on the same tiers: its start-up scan runs to its end
        import json
        engine = make_engine(tiers, catchup=False)
        with open(os.path.join(sig, "peer"), "w") as f:
            json.dump({"pid": os.getpid(), "scan": engine.scan}, f)
        engine.close()
        raise SystemExit(0)
    raise SystemExit(f"unknown scenario {scenario}")
''')


def _child(scenario: str, tiers: list[str], sig: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")]))
    with open(os.path.join(sig, f"{scenario}.stderr"), "w") as err:  # (read by hand when a child misbehaves)
        return subprocess.Popen([*prefix, sys.executable, "-c", CHILD, scenario, os.pathsep.join(tiers), sig],
                                env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)


def _kill(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL


def _damaged_under_a_serving_writer(tier: str, scratch: str, sig: str):
    """A damaged file under a key's name on ``tier`` (a valid page of other bytes, its header damaged)
    and the other writer W serving the tier: (W's pages, the key, W, the file's path)."""
    os.makedirs(sig)
    pages = PageSet(SIZE, salt="window")
    key = pages.keys(1)[0]
    old = PageSet(SIZE, salt="window", data=lambda k: b"\x01" * SIZE)
    with make_engine([scratch]) as e:
        assert old.put(e, [key]) == [True]
    [src] = page_files(scratch)
    flip_byte(src, 8)
    writer = make_engine([tier], catchup=False)
    dst = os.path.join(tier, os.path.relpath(src, scratch))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copyfile(src, dst)
    return pages, key, writer, dst


@pytest.mark.leaves_problems("W closes while the crash's private name holds its page (a stray to its check)")
def test_a_valid_page_caught_in_the_scans_removal_window_by_a_crash_is_not_lost(tier_dirs, tier_root):
    """Another writer's acknowledged page, renamed over a file the start-up scan of a restarting peer
    judged damaged, sits under the scan's private name ``.kvstream-removing.<host>.<pid>.<hex>`` for the
    moment the removal checks it (trust.remove) before putting it back. A SIGKILL there leaves the only
    copy under that name: the next start must put it back under its key (its header names the key),
    not delete it as a stray."""
    tier, sig = tier_dirs[0], os.path.join(tier_root, "sig")
    pages, key, writer, dst = _damaged_under_a_serving_writer(tier, tier_dirs[1], sig)
    child = _child("scan-remove-window", [tier], sig)  # a peer restarting on the tier (B)
    try:
        wait_for_file(os.path.join(sig, "judged"), children=[child])
        assert pages.put(writer, [key]) == [True]  # W's version, acknowledged, renamed over the name
        open(os.path.join(sig, "go"), "w").close()
        wait_for_file(os.path.join(sig, "window"), children=[child])
    finally:
        _kill(child)
    held = [n for d, _, fs in os.walk(tier) for n in fs if n.startswith(".kvstream-removing.")]
    assert held, "the crash left W's page under the scan's private name"
    # W serves on meanwhile; its copy is gone from the name (its read forgets it)
    pages.checked_get(writer, [key])
    writer.close()

    with make_engine([tier]) as engine:  # the next start
        found = pages.checked_get(engine, [key])
        left = [n for d, _, fs in os.walk(tier) for n in fs if n.startswith(".kvstream-removing.")]
        assert found == [True], f"W's acknowledged page lost (private names left: {left})"
        assert engine.check() == []


@pytest.mark.leaves_problems("W's engine sees its page vanish under the peer's private name meanwhile")
def test_a_restarting_peer_never_deletes_the_file_a_live_scan_holds_under_its_private_name(tier_dirs, tier_root):
    """The same window without a crash: B (alive) holds W's valid page under its private name for the
    moment its check takes; a peer C starting meanwhile must leave that file alone (it is B's, B is
    alive: as a live writer's temporary file), so that B puts it back under its key."""
    tier, sig = tier_dirs[0], os.path.join(tier_root, "sig")
    pages, key, writer, dst = _damaged_under_a_serving_writer(tier, tier_dirs[1], sig)
    child = _child("scan-remove-window-live", [tier], sig)  # B
    try:
        _live_window(writer, child, pages, key, sig, tier, dst)
    finally:
        writer.close()


def _live_window(writer, child, pages, key, sig, tier, dst) -> None:
    try:
        wait_for_file(os.path.join(sig, "judged"), children=[child])
        assert pages.put(writer, [key]) == [True]  # W's version, acknowledged
        open(os.path.join(sig, "go"), "w").close()
        wait_for_file(os.path.join(sig, "window"), children=[child])
        with make_engine([tier], catchup=False) as peer:  # C starts, its scan runs to its end
            removed = peer.scan["damaged_removed"]
        open(os.path.join(sig, "end-window"), "w").close()
        wait_for_file(os.path.join(sig, "scanned"), 120, children=[child])  # B put it back (or found it gone)
    finally:
        _kill(child)
    assert os.path.exists(dst) and removed == 0, f"the peer removed {removed} file(s): W's page with them"
    assert pages.checked_get(writer, [key]) == [True]


def test_a_peer_in_another_pid_namespace_never_deletes_a_live_writers_temporary_files(tier_dirs, tier_root):
    """Two servers of one model on one node, each in its own container with the host's network (docker
    ``--network host``, Kubernetes ``hostNetwork``): one hostname, two pid namespaces. One restarts while
    the other is inside a put (its temporary files written, not renamed yet). The restarting peer's
    start-up scan must not take the live writer's temporary files (guarantees.md: "start-up cleaning
    never takes a live process's temporary or probe files"); the writer's put then commits."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root (a new pid namespace)")
    tier, sig = tier_dirs[0], os.path.join(tier_root, "sig")
    os.makedirs(sig)
    writer = _child("held-writer", [tier], sig)
    try:
        wait_for_file(os.path.join(sig, "holding"), children=[writer])
        live = tmp_files(tier)
        assert len(live) == 4, live
        # the peer restarts in a pid namespace of its own (a container), the hostname shared
        peer = _child("peer", [tier], sig, prefix=("unshare", "--pid", "--fork", "--mount-proc"))
        peer.communicate(timeout=120)
        assert peer.returncode == 0
        with open(os.path.join(sig, "peer")) as f:
            scan = json.load(f)["scan"]
        left = tmp_files(tier)
        open(os.path.join(sig, "release"), "w").close()
        writer.communicate(timeout=120)
        assert writer.returncode == 0
        with open(os.path.join(sig, "result")) as f:
            result = json.load(f)
    finally:
        if writer.poll() is None:
            _kill(writer)
    assert scan["tmp_removed"] == 0 and left == live, f"the peer removed {scan['tmp_removed']} live temporary files; the writer's put then: {result}"
    assert result == {"put": [True] * 4, "get": [True] * 4}, result


def _host_clock_ahead(monkeypatch, by_s: float) -> None:
    """This host's wall clock (``time.time``) ``by_s`` seconds ahead of the clock that stamps the tier's
    files: the file server's on NFS or GlusterFS (no NTP on one of them, or an operator set it). Here the
    tier is local, its stamps the kernel's, so this host's clock is the one moved."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + by_s)


def test_a_peer_whose_clock_is_ahead_of_the_file_server_never_removes_a_live_writers_temporary_files(
        tier_dirs, monkeypatch):
    """guarantees.md ("A crash mid-write"): temporary files of dead writers are removed at the next
    start, other hosts' "older than one hour"; tmpfiles.stale_tmp: "Never a file another live engine may
    still be writing". Host X (a live writer) is inside a put on a shared tier: its temporary files are
    written (the file server stamped their times a moment ago), nothing renamed yet. Host Y, whose wall
    clock runs 2 hours ahead of the file server's, starts on the tier; its start-up cleaning leaves X's
    files, since their age is measured on the tier's clock (tmpfiles.tier_now: the time of a file it
    just made there). Before, it subtracted the server's stamps from its own clock, found X's files
    "older than one hour" and removed them from under the live writer (found by the review of time and
    clocks)."""
    from helpers import HoldWrites

    tier = tier_dirs[0]
    held = []
    plan = HoldWrites(lambda: held.append(True))
    pages = PageSet(SIZE, salt="other-host-live")
    keys = pages.keys(4)
    writer = make_engine([tier], fault_plan=plan, catchup=False)
    result: list = []
    t = None
    try:
        with monkeypatch.context() as host_x:
            host_x.setattr(tmpfiles, "HOST", "hostx-4026531836")  # the writer's temporary names: host X's
            plan.armed = True
            t = threading.Thread(target=lambda: result.append(pages.put(writer, keys)), daemon=True)
            t.start()
            wait_until(lambda: held and len(tmp_files(tier)) == len(keys), what="the writer never held its writes")
        live = tmp_files(tier)
        with monkeypatch.context() as host_y:  # this process is host Y now
            _host_clock_ahead(host_y, 2 * 3600.0)
            with make_engine([tier], catchup=False) as peer:  # Y starts; its start-up scan runs to its end
                removed = peer.scan["tmp_removed"]
        left = tmp_files(tier)
    finally:
        plan.armed = False
        plan.release()
        if t is not None:
            t.join(60)
        writer.close()
    assert removed == 0 and left == live, (
        f"a peer whose clock is 2 h ahead of the file server removed {removed} temporary files of a live "
        f"writer on another host (left: {left}); the writer's put then answered {result}")
    assert result == [[True] * len(keys)]


def test_a_peer_whose_clock_is_ahead_of_the_file_server_leaves_another_hosts_removal_in_progress(
        tier_dirs, monkeypatch):
    """A removal of another host holds a page under its private name (trust.remove, for microseconds;
    integrity._left_by_removal: "its process alive: left alone"; another host's is taken for alive
    within an hour of the rename, on the tier's clock). A peer whose clock runs 2 hours ahead of the
    file server's starts meanwhile: its scan leaves the entry to the removal (before: it took the rename
    for two hours old, its process for dead, and put the page back under its name from under the
    removal; found by the review of time and clocks)."""
    tier = tier_dirs[0]
    pages = PageSet(SIZE, salt="other-host-removal")
    keys = pages.keys(2)
    with make_engine([tier], discover=False) as first:
        assert pages.put(first, keys) == [True, True]
    [path] = [p for p in page_files(tier) if os.path.basename(p).startswith(keys[0])]
    private = os.path.join(os.path.dirname(path), f"{tmpfiles.REMOVING_PREFIX}hostx-4026531836.123.0a1b2c3d")
    os.rename(path, private)  # host X's removal, this moment
    with monkeypatch.context() as host_y:
        _host_clock_ahead(host_y, 2 * 3600.0)
        with make_engine([tier], discover=False):  # (its start-up scan is over when it returns)
            pass
    assert os.path.exists(private) and not os.path.exists(path), (
        "a peer whose clock is 2 h ahead of the file server took another host's removal in progress for a "
        "dead one's and put its entry back")


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _left_by_dead_removal(tier: str, pages: PageSet, keys: list[str]) -> tuple[str, str]:
    """``keys`` stored on ``tier``; the first page's file under a private name of a removal whose process
    died between its two renames (trust.remove): (the page's path, the private path)."""
    with make_engine([tier], discover=False) as first:
        assert pages.put(first, keys) == [True] * len(keys)
    [path] = [p for p in page_files(tier) if os.path.basename(p).startswith(keys[0])]
    private = os.path.join(os.path.dirname(path), _private_name(_dead_pid()))
    os.rename(path, private)
    return path, private


def test_a_page_the_scan_puts_back_from_a_dead_removals_private_name_is_served(tier_dirs):
    """guarantees/dc8d5fc: a valid page left under ``.kvstream-removing.<host>.<pid>.<random>`` by a
    process that died between its renames is put back under its name by the start-up scan. The scan
    indexes every valid page it finds; the one it put back is left out of the index, so with
    ``discover`` off (index only once the scan is done) it is never served, nor counted in the tier's
    capacity, for the whole run."""
    tier = tier_dirs[0]
    pages = PageSet(48 << 10, salt="restore")
    keys = pages.keys(2)
    path, private = _left_by_dead_removal(tier, pages, keys)
    with make_engine([tier], discover=False) as engine:  # (make_engine waits for the scan)
        assert os.path.exists(path) and not os.path.exists(private), "the scan did not put the page back"
        held = engine.stats()["tiers"][0]
        assert engine.held(keys[0]), f"the page put back is on disk but not in the index ({held})"
        assert pages.checked_get(engine, keys) == [True, True]


def _private_name(pid: int) -> str:
    return f"{tmpfiles.REMOVING_PREFIX}{tmpfiles.HOST}.{pid}.{secrets.token_hex(4)}"


def _listed_after(directory: str, private: str, name: str) -> str:
    """Rename ``private`` (in ``directory``) to other private names of the same dead pid until a
    listing of the directory names it after ``name`` (the order the scans visit entries in: the
    file system's, here made the one that shows the defect); returns its path."""
    pid = os.path.basename(private).split(".")[-2]
    for _ in range(200):
        order = os.listdir(directory)
        if order.index(os.path.basename(private)) > order.index(name):
            return private
        again = os.path.join(directory, _private_name(int(pid)))
        os.rename(private, again)
        private = again
    raise AssertionError("no private name listed after the page's name")


@pytest.mark.leaves_problems("a link or a directory stays under the page's name (a stray check reports)")
@pytest.mark.parametrize("occupant", ["symlink", "directory"])
def test_a_dead_removals_valid_page_is_not_deleted_when_a_stray_holds_its_name(tier_dirs, occupant):
    """A process died between trust.remove's renames: the only copy of an acknowledged page (key K)
    is under its private name. Meanwhile K's name holds a stray the engine never removes (a link, a
    directory: "never followed and never removed", check reports it). The next start-up scan keeps the
    valid page under its private name (before: the hard link failed with EEXIST and put_back took it
    for a page written since and unlinked the private name: the last copy of K was gone)."""
    tier = tier_dirs[0]
    pages = PageSet(48 << 10, salt="stray-at-name")
    keys = pages.keys(2)
    path, private = _left_by_dead_removal(tier, pages, keys)
    data = Path(private).read_bytes()
    if occupant == "symlink":
        os.symlink(os.path.join(tier_dirs[1], "elsewhere.kvp"), path)
    else:
        os.mkdir(path)
    with make_engine([tier], discover=False):  # (its start-up scan is over when it returns)
        pass
    survivors = [p for p in page_files(tier) + [os.path.join(os.path.dirname(path), n)
                                                 for n in os.listdir(os.path.dirname(path))]
                 if os.path.isfile(p) and not os.path.islink(p) and Path(p).read_bytes() == data]
    assert survivors, (f"the only copy of {keys[0][:12]} (a valid page under a dead removal's private name) was "
                       f"deleted because a {occupant} had its name: {sorted(os.listdir(os.path.dirname(path)))}")


def test_check_fix_never_indexes_the_copy_put_back_dropped(tier_dirs):
    """A peer died between its renames leaving an older version V1 of key K under its private name,
    while K's name holds V2, the version this engine stored and indexed. ``check(fix=True)`` drops V1
    (its name holds a valid page written since: a stray) and the index keeps V2 (before: put_back's
    link failed, the fix was counted done, and integrity.restored indexed V1's header for K's name:
    checksums the file does not hold, check() not clean after the fix)."""
    tier = tier_dirs[0]
    v1 = PageSet(48 << 10, salt="v", data=lambda k: b"\x01" * (48 << 10))
    v2 = PageSet(48 << 10, salt="v", data=lambda k: b"\x02" * (48 << 10))
    [k] = v1.keys(1)
    scratch = os.path.join(os.path.dirname(tier), "scratch")
    os.makedirs(scratch)
    with make_engine([scratch]) as other:  # V1's file, as another writer made it
        assert v1.put(other, [k]) == [True]
        [old] = page_files(scratch)
        old_bytes = Path(old).read_bytes()
        other.clear()
    with make_engine([tier]) as engine:
        assert v2.put(engine, [k]) == [True]
        [path] = page_files(tier)
        shard = os.path.dirname(path)
        private = os.path.join(shard, _private_name(_dead_pid()))
        with open(private, "wb") as f:  # the dead peer's removal left V1 under its private name
            f.write(old_bytes)
        _listed_after(shard, private, os.path.basename(path))
        fixed = engine.check(fix=True)
        assert Path(path).read_bytes() != old_bytes  # V2 kept under the name (V1 dropped): as designed
        stale = [p for p in fixed if p.kind == "index_stale"]
        after = engine.check()
        assert not stale and after == [], (f"check(fix=True) took the dropped copy for the page at {path}: "
                                           f"{[(p.kind, p.detail) for p in fixed]}; check() after the fix: "
                                           f"{[(p.kind, p.detail) for p in after]}")
        assert v2.checked_get(engine, [k]) == [True]
