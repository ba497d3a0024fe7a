"""The consistency check: ``kvstream check [--fix] [--json]`` (the CLI, run as a subprocess) and the
library call ``check_tiers(config)`` walk every tier and namespace, verify headers and block
checksums, and report temporary leftovers, stray files and damaged pages; ``--fix`` repairs (the
files behind the problems are removed; every valid page stays). ``Engine.check(fix)`` also
reconciles the index with the disk. A live writer's temporary file is never an orphan.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from kvstream_hicache import Config, Namespace, check_tiers
from kvstream_hicache.faults import Fault
from kvstream_hicache.io import OP_WRITE
from kvstream_hicache.layout import HEADER_SIZE
from kvstream_hicache.tmpfiles import tmp_name

from helpers import (
    NS, PAGE_BYTES, Node, PageSet, TierFaultPlan, flip_byte, kvstream_cli, make_engine, twin_content, wait_for_fault,
    wait_until,
)

DEAD_PID = 2**22 + 7  # above the largest pid_max: never a live process


def _damage_store(tier_dirs, tier_root):
    """A two-tier store with one of every problem kind; returns (keys, {kind: path}, live tmp, sleeper)."""
    pages = PageSet()
    keys = pages.keys(8)
    other_ns = Namespace({**NS.fields, "model": "second-model"})
    with make_engine(tier_dirs[:2]) as engine:
        assert pages.put(engine, keys) == [True] * 8
        lay0, lay1 = engine.tiers[0].layout, engine.tiers[1].layout
    with make_engine(tier_dirs[:2], namespace=other_ns) as engine:  # a second namespace on the same tiers
        assert pages.put(engine, keys[:2]) == [True] * 2
        other_page = engine.tiers[1].layout.page_path(keys[1])
    bad = {
        "orphan_tmp": os.path.join(lay0.tmp, tmp_name(NS.digest, DEAD_PID, "dead", 3)),
        "damaged": lay0.page_path(keys[0]),
        "corrupt": lay1.page_path(keys[1]),
        "truncated": lay0.page_path(keys[2]),
        "misplaced": lay1.page_path(keys[3]),
        "stray": os.path.join(os.path.dirname(lay0.page_path(keys[4])), "notes.txt"),
    }
    open(bad["orphan_tmp"], "wb").close()
    flip_byte(bad["damaged"], 40, 0x80)
    flip_byte(bad["corrupt"], HEADER_SIZE + 1000, 0x80)
    os.truncate(bad["truncated"], HEADER_SIZE + 4096)
    shutil.copyfile(lay1.page_path(keys[5]), bad["misplaced"])  # another key's page under this name
    open(bad["stray"], "w").close()
    flip_byte(other_page, HEADER_SIZE + 7, 0x80)  # and one corrupt page in the other namespace
    sleeper = subprocess.Popen(["sleep", "600"])
    live = os.path.join(lay1.tmp, tmp_name(NS.digest, sleeper.pid, "live", 0))  # another live process's
    open(live, "wb").close()
    return keys, bad, other_page, live, sleeper


def _kinds(problems) -> set[tuple[str, str]]:
    return {(p.kind, p.path) for p in problems}


def test_check_cli_and_library_report_and_fix(tier_dirs, tier_root):
    keys, bad, other_page, live, sleeper = _damage_store(tier_dirs, tier_root)
    try:
        want = {(kind, path) for kind, path in bad.items()} | {("corrupt", other_page)}
        config = Config.from_sources({"tiers": tier_dirs[:2]}, environ={})
        assert _kinds(check_tiers(config)) == want
        assert _kinds(check_tiers(config, NS)) == want - {("corrupt", other_page)}  # one namespace
        assert _kinds(check_tiers(config, payload=False)) == want - {("corrupt", other_page), ("corrupt", bad["corrupt"])}

        proc = kvstream_cli("check", "--tiers", *tier_dirs[:2])
        assert proc.returncode == 1, proc.stderr
        for kind, path in want:
            assert any(kind in line and path in line for line in proc.stdout.splitlines()), (kind, proc.stdout)
        assert f"{len(want)} problem(s) found" in proc.stdout

        env = {**os.environ, "KVSTREAM_TIERS": os.pathsep.join(tier_dirs[:2])}
        proc = kvstream_cli("check", "--json", env=env)
        assert proc.returncode == 1
        assert {(p["kind"], p["path"]) for p in json.loads(proc.stdout)} == want

        proc = kvstream_cli("check", "--fix", "--tiers", *tier_dirs[:2])
        assert proc.returncode == 0, proc.stderr
        assert "repaired" in proc.stdout
        assert not any(os.path.lexists(p) for p in [*bad.values(), other_page])
        assert os.path.exists(live), "a live writer's temporary file is never removed"

        proc = kvstream_cli("check", "--tiers", *tier_dirs[:2])
        assert proc.returncode == 0 and "no problems found" in proc.stdout
        assert check_tiers(config) == []
    finally:
        sleeper.kill()
        sleeper.wait()
    # every valid page survived the repair; a page damaged on one tier is served from the other
    pages = PageSet()
    with make_engine(tier_dirs[:2]) as engine:
        assert pages.checked_get(engine, keys) == [True] * 8
        assert engine.wait_scan(30)
        # the copies --fix removed are written again from the other tier (background replication)
        wait_until(lambda: [engine.index.holders(k) for k in keys] == [0b11] * 8,
                   what="the removed copies never came back")
        assert pages.checked_get(engine, keys) == [True] * 8
        assert engine.scan["tmp_removed"] == 1  # the sleeper is gone now: its file is a leftover
        assert engine.check() == []


def test_engine_check_reconciles_index_and_disk(tier_dirs):
    """Files removed or added behind a running engine's back: index_stale / index_missing, fixed."""
    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(tier_dirs[:2]) as engine:
        assert pages.put(engine, keys) == [True] * 4
        os.unlink(engine.tiers[0].layout.page_path(keys[0]))
        engine.index.remove(keys[1], 1)  # the index forgot a copy that is on disk
        problems = engine.check()
        assert {(p.kind, p.tier) for p in problems} == {("index_stale", tier_dirs[0]), ("index_missing", tier_dirs[1])}
        assert all(p.fixed for p in engine.check(fix=True))
        assert engine.index.holders(keys[0]) == 0b10 and engine.index.holders(keys[1]) == 0b11
        assert engine.check() == []
        assert pages.checked_get(engine, keys) == [True] * 4


def test_library_check_beside_a_running_engine_keeps_its_writes(tier_dirs):
    """check_tiers(fix=True) in the process of a running engine never takes its temporary files."""
    plan = TierFaultPlan()
    pages = PageSet()
    with make_engine(tier_dirs[:2], fault_plan=plan) as engine:
        plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
        result: list = []
        writer = threading.Thread(target=lambda: result.append(pages.put(engine, pages.keys(2))))
        writer.start()
        try:
            wait_for_fault(plan)
            assert check_tiers(engine.config, fix=True) == []
        finally:  # never leave the writer held: close() would wait for it
            plan.clear()
            plan.release()
            writer.join(60)
        assert not writer.is_alive(), "the released writer did not finish"
        assert result == [[True, True]]
        assert [engine.index.holders(k) for k in pages.keys(2)] == [0b11] * 2
        assert engine.check() == []


def test_start_up_cleaning_spares_probes_in_use_and_removes_old_ones(tier_dirs):
    """A tier probe of another process (a few ms long, any host) is not a leftover while fresh; an
    old one is."""
    with make_engine(tier_dirs[:1]) as engine:
        tmp = engine.tiers[0].layout.tmp
    fresh, old = os.path.join(tmp, "probe.4242.cafe"), os.path.join(tmp, "probe.4343.beef")
    for path in (fresh, old):
        open(path, "wb").close()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    with make_engine(tier_dirs[:1]) as engine:
        assert engine.wait_scan(30)
        assert os.path.exists(fresh) and not os.path.exists(old)
        assert engine.wait_scan(30)
        assert engine.scan["tmp_removed"] == 1
    os.unlink(fresh)



def test_a_page_unreadable_for_an_error_of_the_moment_is_reported_not_removed(tier_root, monkeypatch):
    """check --fix where reading a page fails with EMFILE or EIO (an error of the moment or of the
    device, not of the file's content): the page is reported and stays (before: it was removed as
    damaged). The error is injected where the header is read; the file itself is a valid page."""
    import errno

    from kvstream_hicache import integrity
    from helpers import PageSet, make_engine

    pages = PageSet()
    keys = pages.keys(1)
    with make_engine([tier_root]) as engine:
        assert pages.put(engine, keys) == [True]
        path = engine.tiers[0].layout.page_path(keys[0])
        config = engine.config
    real = integrity.open_with_header
    for err in (errno.EMFILE, errno.EIO):
        def failing(p, *args, **kwargs):
            if p == path:
                raise OSError(err, os.strerror(err), p)
            return real(p, *args, **kwargs)

        monkeypatch.setattr(integrity, "open_with_header", failing)
        problems = check_tiers(config, fix=True, payload=True)
        assert [(p.kind, p.fixed) for p in problems] == [("damaged", False)]
        assert os.strerror(err) in problems[0].detail and "left in place" in problems[0].detail
        assert os.path.exists(path)
    monkeypatch.setattr(integrity, "open_with_header", real)
    with make_engine([tier_root]) as engine:  # it was a valid page all along
        assert pages.checked_get(engine, keys) == [True]


@pytest.fixture
def beside_a_peer(tier_dirs, monkeypatch):
    """One tier holding 4 pages of this process's version (twin_content 0), a peer process on it (another
    server of the namespace: helpers.Node, its own engine), and ``at_payload(key, what)``: the peer does
    ``what`` to ``key`` at the moment a check has read that page's header and is about to read its payload
    (integrity.verify_payload, wrapped: deterministic): 'delete' (its delete or eviction: the page's file
    goes) or 'put' (it evicts the page and stores it again, with its own valid bytes: twin_content 1).
    Yields (tiers, keys, at_payload, planned: what is planned and not done yet)."""
    from kvstream_hicache import integrity

    tiers = tier_dirs[:1]
    mine = PageSet(PAGE_BYTES, data=lambda k: twin_content(k, 0))
    keys = mine.keys(4)
    with make_engine(tiers) as engine:
        assert mine.put(engine, keys) == [True] * 4
    peer = Node()
    peer("open", tiers, {})
    planned: dict[str, str] = {}
    verify = integrity.verify_payload

    def after_the_peer(fd, header):
        if header.key in planned:
            what, i = planned.pop(header.key), keys.index(header.key)
            peer("delete", mine.salt, i, 1)
            if what == "put":
                assert peer("put", mine.salt, i, 1, 1)["stored"] == [True]
        return verify(fd, header)

    monkeypatch.setattr(integrity, "verify_payload", after_the_peer)
    try:
        yield tiers, keys, planned.__setitem__, planned
    finally:
        peer("close")
        peer.stop()


@pytest.mark.parametrize("fix", [False, True], ids=["check", "check-fix"])
def test_a_check_beside_a_process_that_deletes_a_page_reports_nothing(beside_a_peer, fix):
    """Another server of the namespace deletes (or evicts) a page while ``kvstream check`` reads the tier:
    the page is gone, nothing on disk is wrong. Before (0b634d5) the payload was read through a second
    open of the name: 'corrupt: unreadable: No such file or directory', and with --fix 'left in place'
    (not repaired: the CLI exited 1). Now the header and the payload are read through one descriptor
    (integrity.open_with_header): the file judged is the one read, a valid page."""
    tiers, keys, at_payload, planned = beside_a_peer
    config = Config.from_sources({"tiers": tiers}, environ={})
    at_payload(keys[1], "delete")
    problems = check_tiers(config, fix=fix)
    assert not planned, "the check never read that page's payload"
    assert problems == [], [f"{p.kind}: {p.detail}" for p in problems]


def test_a_check_beside_a_process_that_stores_its_own_version_of_a_page_reports_nothing(beside_a_peer):
    """Another server evicts a page and stores it again with its own valid bytes while ``kvstream check``
    reads the tier: every file on disk is a valid page at every moment. Before (0b634d5): 'corrupt: block
    0 checksum mismatch' (the header read from the old file, the payload from the new one)."""
    tiers, keys, at_payload, planned = beside_a_peer
    config = Config.from_sources({"tiers": tiers}, environ={})
    at_payload(keys[2], "put")
    problems = check_tiers(config)
    assert not planned, "the check never read that page's payload"
    assert problems == [], [f"{p.kind}: {p.detail}" for p in problems]
    assert check_tiers(config) == []  # (and the disk is indeed clean)


def test_an_engine_check_beside_a_process_that_evicts_its_page_reports_only_the_index(beside_a_peer):
    """A running engine's ``check(fix=True)`` while another process evicts one of its pages: such a check
    may report ``index_stale`` / ``index_missing`` (docs/guarantees.md), nothing else. Before (0b634d5):
    also 'corrupt ... unreadable: No such file or directory', left in place. Now the check judged the file
    it read, valid then; the next check finds it gone: 'index_stale', fixed."""
    tiers, keys, at_payload, planned = beside_a_peer
    with make_engine(tiers) as engine:
        assert engine.prefix_len(keys) == 4
        at_payload(keys[0], "delete")
        problems = engine.check(fix=True)
        assert not planned, "the check never read that page's payload"
        assert {p.kind for p in problems} <= {"index_stale", "index_missing"}, \
            [f"{p.kind}: {p.detail}" for p in problems]
        both = problems + engine.check(fix=True)
        assert [(p.kind, p.path, p.fixed) for p in both] == \
            [("index_stale", engine.tiers[0].layout.page_path(keys[0]), True)], both
        assert engine.prefix_len(keys) == 0  # (the page is gone: no prefix)
