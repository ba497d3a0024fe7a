"""The start-up scan in the background (scan.py): an engine serves at once, pages of before the restart
are found on first lookup, and the scan catches up with damage, leftovers, capacity and LRU order.
Real files, real io_uring; the scan is held back with its own rate limit (``scan_rate``), never mocked.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from array import array

import kvstream_hicache.integrity as integrity
import kvstream_hicache.scan as scan_module
import kvstream_hicache.trust as trust
from kvstream_hicache import Config, Engine, check_tiers
from kvstream_hicache.index import Index
from kvstream_hicache.integrity import scan_file
from kvstream_hicache.writes import WritePath
from kvstream_hicache.layout import HEADER_SIZE, TierLayout
from kvstream_hicache import tmpfiles
from kvstream_hicache.tmpfiles import tmp_name

from kvstream_hicache.tiers import LOOK_S

from helpers import (
    NS, PAGE_BYTES, VERSION_OFF, FakeClock, PageSet, as_user, flip_byte, kvstream_cli, make_engine, messages,
    page_files, run_child, run_children, set_header_field, spawn, wait_for_file, wait_until,
)

HELD = 0.001  # scan_rate: one file in 1000 s, the scan has not read a file while the test runs
WAIT_S = 60


def _stored(dirs, n: int) -> tuple[PageSet, list[str]]:
    """``n`` pages stored on ``dirs`` by an engine that is closed again (the restart's tiers)."""
    pages = PageSet()
    keys = pages.keys(n)
    with make_engine(dirs) as engine:
        assert pages.put(engine, keys) == [True] * n
    return pages, keys


def _release(engine) -> None:
    engine._scan.set_limits(0, 1)
    assert engine.wait_scan(WAIT_S)


def test_a_restart_serves_before_the_scan_ends(tier_dirs):
    pages, keys = _stored(tier_dirs[:2], 8)
    with make_engine(tier_dirs[:2], scan_rate=HELD) as engine:
        scan = engine.scan
        assert not scan["done"] and scan["files"] == 0 and "known so far" in scan["eviction"]
        assert engine.contains(keys[0]) and engine.prefix_len(keys) == 8  # discovery, header verified
        assert pages.checked_get(engine, keys) == [True] * 8
        assert engine.stats()["discovered"] == 8 and engine.index.holders(keys[3]) == 0b11
        assert not engine.scan["done"]
        _release(engine)
        assert engine.scan["indexed"] == 0, "every page was known: the scan indexed nothing twice"
        assert engine.check() == []


def test_kvstream_info_counts_a_scans_copies_as_copies(tier_dirs):
    """3 pages on 2 tiers: the scan indexes 6 copies of 3 pages. `kvstream info` said '6 pages indexed'
    (a TP or MLA server's ranks on 2 tiers each showed twice their pages)."""
    _stored(tier_dirs[:2], 3)
    with make_engine(tier_dirs[:2]) as engine:
        assert engine.wait_scan(WAIT_S)
        engine._scan._publish(force=True)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = kvstream_cli("info", "--tiers", os.pathsep.join(tier_dirs[:2]), env=env).stdout
        line = next(x for x in out.splitlines() if f"start-up scan of pid {os.getpid()} " in x)
        assert "6 files in " in line and "6 copies indexed (3 pages in its index)" in line, line


def test_kvstream_info_shows_a_running_scan(tier_dirs):
    _stored(tier_dirs[:1], 3)
    with make_engine(tier_dirs[:1], scan_rate=HELD) as engine:
        engine._scan._publish(force=True)  # else written once a shard is done (none is: the scan is held)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = kvstream_cli("info", "--tiers", tier_dirs[0], env=env).stdout
        assert f"start-up scan of pid {os.getpid()} (namespace {NS.digest}, {tier_dirs[0]}): running, 0/" in out, out
        _release(engine)
        assert "): done; 3 files in " in kvstream_cli("info", "--tiers", tier_dirs[0], env=env).stdout
    # closed: its line is gone (another test's engine, not yet collected, may still show its own)
    closed = kvstream_cli("info", "--tiers", tier_dirs[0], env=env).stdout
    assert f"pid {os.getpid()} (namespace {NS.digest}, {tier_dirs[0]})" not in closed, closed


def test_discover_off_still_finds_pages_until_the_scan_is_done(tier_dirs):
    pages, keys = _stored(tier_dirs[:1], 3)
    with make_engine(tier_dirs[:1], scan_rate=HELD, discover=False) as engine:
        assert pages.checked_get(engine, keys[:1]) == [True]
        _release(engine)
        assert pages.checked_get(engine, keys) == [True] * 3  # the scan indexed the other two


def test_the_background_scan_removes_damage_and_stray_temporaries(tier_dirs):
    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 4
        layout = engine.tiers[0].layout
    dead = os.path.join(layout.tmp, tmp_name(NS.digest, 2**22 + 7, "dead", 0))  # no such pid
    open(dead, "w").close()
    flip_byte(layout.page_path(keys[1]), 30)  # the header: the scan sees it
    with open(layout.page_path(keys[2]), "r+b") as f:  # truncated
        f.truncate(4096)
    with make_engine(tier_dirs[:1], scan_rate=HELD) as engine:
        assert pages.checked_get(engine, keys) == [True, False, False, True]  # never a damaged page
        _release(engine)
        scan = engine.scan
        assert scan["tmp_removed"] == 1 and scan["damaged_removed"] == 2 and scan["kept"] == 0
        assert not os.path.exists(dead) and not os.path.exists(layout.page_path(keys[1]))
        assert not os.path.exists(layout.page_path(keys[2]))
        assert sorted(page_files(tier_dirs[0])) == sorted(layout.page_path(k) for k in (keys[0], keys[3]))
        assert engine.check() == []


@pytest.mark.leaves_problems("pages of format version 2 left on the tier on purpose (check names them)")
def test_the_start_up_scan_keeps_the_pages_of_a_newer_format_version(tier_dirs, caplog):
    """Format version 2 pages (a node already upgraded to the next format wrote them) on a tier this
    version restarts on, as on a tier old and new nodes share while an upgrade rolls. This version cannot
    read them and never serves them (discovery before the scan reaches them, and after it), nor indexes
    them (nor counts them against its capacity, as any version its index does not hold); but they are
    valid pages of another writer, which the project never deletes: the scan counts them
    (``scan["newer_format"]``, one log line) and leaves them, and so does check --fix. Before, the scan
    called them 'damaged' ('unsupported format version 2') and removed them: every restart of an old
    node (and ``kvstream check --fix``) undid the upgraded nodes' work for as long as the upgrade took
    (review 'upgrade', stop 44)."""
    pages, keys = _stored(tier_dirs[:1], 3)
    for path in page_files(tier_dirs[0]):
        set_header_field(path, VERSION_OFF, 2)
    with make_engine(tier_dirs[:1], scan_rate=HELD) as engine:
        assert [engine.contains(k) for k in keys] == [False] * 3  # (discovery: read, never served)
        _release(engine)
        scan = engine.scan
        left = len(page_files(tier_dirs[0]))
        assert left == 3, f"the scan removed {3 - left} of 3 pages of format version 2 as damaged ({scan})"
        assert (scan["newer_format"], scan["damaged_removed"], scan["kept"], scan["indexed"]) == (3, 0, 0, 0)
        assert pages.checked_get(engine, keys) == [False] * 3
        assert len(engine.index) == 0 and engine.index.used[0] == 0
        assert messages(caplog, "left 3 pages of a later format")
        assert [p.kind for p in engine.check(fix=True)] == ["newer_format"] * 3
    assert len(page_files(tier_dirs[0])) == 3


def test_capacity_eviction_before_and_after_the_scan(tier_dirs):
    """Before the scan, eviction works from the pages known (written, read since start); once it is
    done the tier is trimmed to its capacity, oldest write first, and LRU goes on in that order."""
    pages = PageSet()
    old, new = pages.keys(8), pages.keys(6, start=100)
    cap = 8 * PAGE_BYTES  # capacity counts payload bytes
    with make_engine(tier_dirs[:1], capacity=str(cap)) as engine:
        for k in old:  # one put each: their write times order them
            assert pages.put(engine, [k]) == [True]
    with make_engine(tier_dirs[:1], capacity=str(cap), scan_rate=HELD) as engine:
        assert pages.checked_get(engine, old[7:]) == [True]  # discovered: used since start
        assert pages.put(engine, new[:4]) == [True] * 4
        assert engine.index.used[0] == 5 * PAGE_BYTES and engine.index.evictions == [0]
        assert len(page_files(tier_dirs[0])) == 12  # over capacity on disk until the scan is done
        _release(engine)
        assert engine.index.used[0] == cap and len(page_files(tier_dirs[0])) == 8
        assert engine.index.keys(0) == old[4:7] + old[7:] + new[3::-1]  # old by write time, then by use (a put's
        # pages in reverse batch order: PutCall.lru_order)
        assert pages.put(engine, new[4:]) == [True] * 2  # evicts the two oldest writes
        assert [engine.contains(k) for k in old] == [False] * 6 + [True] * 2
        assert pages.checked_get(engine, old[6:] + new) == [True] * 8
        assert engine.check() == []


def test_a_capacity_lowered_since_the_last_run_is_said_once_with_the_setting(tier_dirs, caplog):
    """An operator restarts with a capacity below what a tier holds: the scan's trim evicts the excess
    and says so in one line per tier naming the setting, its value and the pages evicted; a tier within
    its capacity says nothing. Before, the trim evicted 5 of 8 pages without a word (reviewer reconfig)."""
    pages, keys = PageSet(), PageSet().keys(8)
    with make_engine(tier_dirs[:2], replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * 8
    caplog.set_level("INFO", logger="kvstream")
    with make_engine(tier_dirs[:2], capacity=os.pathsep.join([str(3 * PAGE_BYTES), ""])) as engine:
        assert engine.wait_scan(WAIT_S)
        assert len(page_files(tier_dirs[0])) == 3 and len(page_files(tier_dirs[1])) == 8
        assert pages.checked_get(engine, keys) == [True] * 8  # (tier 1 holds every page still)
    said = messages(caplog, "capacity")
    assert len(said) == 1 and "tier 0" in said[0] and "KVSTREAM_CAPACITY" in said[0], said
    assert "evicted its 5 least recent pages" in said[0] and "144 KiB" in said[0], said


@pytest.mark.leaves_problems("two servers on one tier: each one's check finds the other's pages on disk and "
                             "not in its index (index_missing, harmless: docs/guarantees.md)")
def test_a_restart_on_a_tier_two_processes_filled_does_not_say_only_that_its_capacity_was_lowered(tier_dirs,
                                                                                                       caplog):
    """Two servers share a tier, each within its capacity of 3 pages (a rolling upgrade: one node upgraded, the
    other not). The upgraded one restarts at the same capacity: its scan counts the 6 pages it finds and trims 3,
    as docs/guarantees.md "Capacity is per process" says. Its warning said the capacity was "lowered since the
    last run", which it was not: the cause the operator must act on (the servers sharing the tier, each to be
    given its share of it) went unsaid (trial upgrade)."""
    pages, cap = PageSet(), str(3 * PAGE_BYTES)
    mine, theirs = pages.keys(3), pages.keys(3, start=100)
    with make_engine(tier_dirs[:1], capacity=cap) as a, make_engine(tier_dirs[:1], capacity=cap) as b:
        assert pages.put(a, mine) == [True] * 3 and pages.put(b, theirs) == [True] * 3
    caplog.set_level("INFO", logger="kvstream")
    with make_engine(tier_dirs[:1], capacity=cap) as engine:
        assert engine.wait_scan(WAIT_S) and len(page_files(tier_dirs[0])) == 3
    said = messages(caplog, "capacity")
    assert len(said) == 1 and "KVSTREAM_CAPACITY" in said[0], said
    assert "other processes" in said[0] and "Capacity is per process" in said[0], said


def test_the_trim_never_evicts_what_writes_made_room_for(tier_dirs, monkeypatch):
    """The scan ends over capacity, and writes evict the excess before its trim runs (the LMCache peer
    suite's FIFO test caught this under load): the trim measures the excess again, and evicts no page
    that fits (it evicted as much again, a page just stored among them)."""
    pages = PageSet()
    old, new = pages.keys(5), pages.keys(2, start=100)
    with make_engine(tier_dirs[:1]) as engine:
        for k in old:  # one put each: their write times order them
            assert pages.put(engine, [k]) == [True]
    trim, engines = WritePath.trim, []

    def writes_first(writes, *args):  # the scan found 5 pages against 3; two puts come before the trim
        assert pages.put(engines[0], new) == [True, True]  # evict old[0:4]: 3 pages held, the capacity
        trim(writes, *args)

    monkeypatch.setattr(WritePath, "trim", writes_first)
    with make_engine(tier_dirs[:1], capacity=str(3 * PAGE_BYTES), scan_rate=HELD) as engine:
        engines.append(engine)
        _release(engine)
        assert engine.index.keys(0) == old[4:] + new[::-1] and engine.index.used[0] == 3 * PAGE_BYTES
        assert pages.checked_get(engine, old[4:] + new) == [True] * 3
        assert len(page_files(tier_dirs[0])) == 3 and engine.check() == []


def test_the_scan_thread_never_holds_the_engine(tier_dirs, monkeypatch):
    """The scan's end (its trim) runs on the scan's thread with no reference to the engine: were the
    engine dropped meanwhile, its finalizer (close, which waits for the scan) would run on that thread
    and wait for itself (CI hung so, a test's dropped engine finalized there)."""
    seen, evict = [], Index.evict_excess

    def looking(index, *args):  # who calls, and whether any frame on the way holds an engine
        frame = sys._getframe(1)
        while frame is not None:
            seen.extend(name for name, v in frame.f_locals.items() if isinstance(v, Engine))
            frame = frame.f_back
        seen.append(threading.current_thread().name)
        return evict(index, *args)

    _stored(tier_dirs[:1], 2)
    monkeypatch.setattr(Index, "evict_excess", looking)
    with make_engine(tier_dirs[:1], scan_rate=HELD) as engine:
        _release(engine)
    assert seen == ["kvstream-scan-0"]


def test_two_processes_start_on_a_shared_tier_at_once(tier_dirs, tier_root):
    """Two engines open at the same moment on tiers holding pages, a damaged file and a dead writer's
    temporary file; each serves every page at once and stores its own; both scans run over the
    same files: the damage is removed once, no valid page is removed, nothing is left over."""
    tiers = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(40)
    with make_engine(tiers) as engine:
        assert pages.put(engine, keys) == [True] * 40
        layout = engine.tiers[1].layout
    flip_byte(layout.page_path(keys[5]), 30)
    dead = os.path.join(layout.tmp, tmp_name(NS.digest, 2**22 + 7, "dead", 0))
    open(dead, "w").close()
    go = os.path.join(tier_root, "go")
    outs = [os.path.join(tier_root, f"start{who}.json") for who in range(2)]
    children = [spawn("startup", os.pathsep.join(tiers), str(who), outs[who], go) for who in range(2)]

    def at_once() -> None:
        for out in outs:
            wait_for_file(out + ".ready", WAIT_S, children)
        open(go, "w").close()

    results = run_children(children, outs, at_once, WAIT_S * 4)
    for who, result in enumerate(results):
        assert result["found"] == [True] * 40, who  # keys[5] on tier 0 is intact
        assert result["stored"] == [True] * 4 and result["scan_done"]
    # either scan may remove it, or both (one finds it gone: removed all the same); the page may be
    # on tier 1 again since, a fresh copy from tier 0 (background replication), never the damaged one
    assert sum(r["damaged_removed"] for r in results) >= 1
    restored = os.path.exists(layout.page_path(keys[5]))
    assert not restored or scan_file(layout, NS.digest, keys[5], payload=True).problem is None
    assert sum(r["tmp_removed"] for r in results) >= 1 and not os.path.exists(dead)
    assert len(page_files(tiers[0])) == 48 and len(page_files(tiers[1])) == 47 + restored
    with make_engine(tiers) as engine:
        assert engine.wait_scan(WAIT_S)
        assert engine.check() == []
    assert check_tiers(engine.config) == []


def test_the_scan_of_a_tier_that_fails_stops_and_says_so(tier_dirs):
    pages, keys = _stored(tier_dirs[:2], 6)
    with make_engine(tier_dirs[:2], scan_rate=HELD) as engine:
        os.rename(tier_dirs[1], tier_dirs[1] + ".away")
        try:
            assert pages.put(engine, pages.keys(1, start=50)) == [True]  # tier 1 fails: its directory went
            assert not engine.tiers[1].healthy
            _release(engine)
            scan = engine.scan
            assert scan["tiers"][1]["stopped"].startswith("tier failed") and not scan["tiers"][0]["stopped"]
            assert "failed tier" in scan["eviction"] and engine.index.pages_on(0) == 7
        finally:
            os.rename(tier_dirs[1] + ".away", tier_dirs[1])
        assert pages.checked_get(engine, keys) == [True] * 6


def test_discover_off_finds_pages_of_a_tier_whose_scan_stopped_once_it_is_back(tier_dirs):
    """Promise 2 (while a present, working tier holds a valid copy, ``get`` finds it, after a tier failure
    and after a restart) with ``discover=0``, documented as "index only once the start-up scan is done".
    A tier that fails while its scan runs (a transient hiccup during the minutes a tier of a million pages
    takes to scan) ends its scan. Before, the scan then counted done, so the pages it never read were
    never found again for the engine's life, though the tier was back and held every one of them
    (served [False] * 4, ``check()`` found them ``index_missing``); with discovery on they were served
    but never counted against the capacity. Now the call that meets the tier back has its scan resumed,
    and discovery stays on until that ends."""
    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 4
    clock = FakeClock()
    away = tier_dirs[0] + ".away"
    with make_engine(tier_dirs[:1], scan_rate=HELD, discover=False, clock=clock) as engine:
        os.rename(tier_dirs[0], away)  # a transient outage while the scan has read nothing yet
        try:
            assert pages.put(engine, pages.keys(1, start=50)) == [False]  # the write notices: tier 0 fails
            assert not engine.tiers[0].healthy
            _release(engine)  # the scan sees the failed tier and stops
            assert engine.scan["tiers"][0]["stopped"]
        finally:
            os.rename(away, tier_dirs[0])
        clock.advance(LOOK_S)
        got = pages.checked_get(engine, keys)  # finds tier 0 back (one look), then reads
        assert engine.tiers[0].healthy, "tier 0 did not rejoin"
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "kvstream-rejoin"], 30,
                   "the rejoin thread did not end")
        assert engine.wait_scan(WAIT_S)
        got = pages.checked_get(engine, keys) if got != [True] * 4 else got
        assert got == [True] * 4, (
            f"tier 0 is back and holds all 4 pages stored before the restart; served: {got}; "
            f"indexed: {len(engine.index)}; scan: {engine.scan['tiers'][0]}")
        scan = engine.scan
        assert not scan["tiers"][0]["stopped"] and scan["eviction"] == "exact LRU"


def _failing_at_the_third_shard(monkeypatch) -> tuple[list[str], list]:
    """The scan's reads of shards, listed, the engine appended to the second list failed (EIO) as its
    scan reads the third one: (shards read, [the engine])."""
    read, engines, entries = [], [], scan_module.each_shard_entry

    def failing_at_the_third(layout, shard):
        read.append(shard)
        if len(read) == 3:
            engines[0].tiers[0].fail(errno.EIO, "a hiccup while the scan reads a shard")
        return entries(layout, shard)

    monkeypatch.setattr(scan_module, "each_shard_entry", failing_at_the_third)
    return read, engines


def test_a_tier_back_after_failing_during_its_scan_is_scanned_on_from_the_shard_it_was_reading(
        tier_dirs, monkeypatch):
    """The scan of a tier that failed while reading its third shard goes on, once the tier is back,
    from that shard (read again: it may have been read only in part), not from the first (a tier of a
    million pages is minutes of reads); every page is indexed then, counted against the capacity,
    without a lookup of its own (``discover=0``, a get of one page only). Before, the pages of the
    shards not read were never indexed (see the test above)."""
    pages, keys = _stored(tier_dirs[:1], 12)
    shards = sorted({k[:2] for k in keys})
    read, engines = _failing_at_the_third_shard(monkeypatch)
    clock = FakeClock()
    with make_engine(tier_dirs[:1], scan_rate=HELD, discover=False, clock=clock, tier_retry=1) as engine:
        engines.append(engine)
        _release(engine)
        assert engine.scan["tiers"][0]["stopped"].startswith("tier failed") and read == shards[:3]
        clock.advance(1)  # the back-off: the next call probes it, and it rejoins
        assert pages.checked_get(engine, keys[:1]) == [True]
        assert engine.tiers[0].healthy and engine.wait_scan(WAIT_S)
        assert read == shards[:3] + shards[2:]
        assert engine.index.pages_on(0) == 12 and engine.index.used[0] == 12 * PAGE_BYTES
        assert engine.scan["tiers"][0]["shards_done"] == len(shards) and not engine.scan["tiers"][0]["stopped"]
        assert pages.checked_get(engine, keys) == [True] * 12


def test_a_damaged_copy_the_scan_found_first_falls_back_to_a_copy_it_has_not_reached(tier_dirs):
    """While the scan runs the index may know one tier's copy of a page and not another's: when the
    known one is damaged, the page is looked up on the tiers again and served from the other."""
    pages, keys = _stored(tier_dirs[:2], 2)
    # (no catch-up: it writes the removed copy back in idle time, racing the look at tier 1's file)
    with make_engine(tier_dirs[:2], scan_rate=HELD, catchup=False) as engine:
        path = engine.tiers[1].layout.page_path(keys[0])
        flip_byte(path, HEADER_SIZE + 100)  # the payload: the header (all the scan reads) is intact
        engine._scan._visit(engine._scan.parts[1], keys[0][:2], os.path.basename(path), path, array("i"))
        assert engine.index.holders(keys[0]) == 0b10  # the scan reached tier 1's copy, not tier 0's yet
        assert pages.checked_get(engine, keys[:1]) == [True]
        assert not os.path.exists(path) and engine.index.holders(keys[0]) == 0b01
        _release(engine)


@pytest.mark.parametrize("scan_ends", ["before the unlink", "after it"])
def test_a_page_deleted_while_the_scan_reads_its_file_stays_deleted(tier_dirs, monkeypatch, scan_ends):
    """A removal drops a copy from the index, then removes its file. A start-up scan that reads the
    file between the two must not index it again: whether it indexes it before the unlink (its copy
    leaves again) or after (it reads the file again, and it is gone). Before, the scan indexed it:
    LMCache's own suite found a key its adapter had deleted (a lookup hit, the listener told of no
    delete) while the scan of a fresh adapter was still running."""
    pages = PageSet()
    with make_engine(tier_dirs[:1], scan_rate=HELD) as engine:
        keys = pages.keys(2)
        assert pages.put(engine, keys) == [True] * 2
        tier, scan = engine.tiers[0], engine._scan
        unlink = tier.unlink_page
        later = []

        def scan_in_between(key):
            path = tier.layout.page_path(key)
            visit = lambda: scan._visit(scan.parts[0], key[:2], os.path.basename(path), path, array("i"))
            if scan_ends == "before the unlink":
                visit()
                return unlink(key)
            # the scan reads the file now and indexes what it read once the file is gone
            real_add = engine.index.add_scanned
            monkeypatch.setattr(engine.index, "add_scanned", lambda *a: later.append(a) or -1)
            visit()
            monkeypatch.setattr(engine.index, "add_scanned", real_add)
            return unlink(key)

        monkeypatch.setattr(tier, "unlink_page", scan_in_between)
        assert engine.delete(keys[:1]) == 1
        for args in later:
            engine.index.add_scanned(*args)
        assert engine.index.holders(keys[0]) == 0 and not engine.contains(keys[0])
        assert engine.index.holders(keys[1]) == 0b1  # the other page stays
        _release(engine)
        assert engine.check() == []


def _loop_in_tmp(tier: str) -> str:
    """A link in ``kvstream/tmp`` named as a probe, pointing at itself: stat through it is ELOOP."""
    link = os.path.join(tier, "kvstream", "tmp", "probe.1.x.0.loop")
    os.symlink(os.path.basename(link), link)
    return link


def test_a_looping_link_in_tmp_stops_neither_the_scan_nor_check_tiers(tier_dirs):
    pages, keys = _stored(tier_dirs[:1], 3)
    link = _loop_in_tmp(tier_dirs[0])
    problems = check_tiers(Config.from_sources({"tiers": tier_dirs[:1]}, environ={}), NS)
    assert [(p.kind, p.path) for p in problems] == [("stray", link)], problems  # reported, never followed
    with make_engine(tier_dirs[:1]) as engine:
        assert len(engine.index) == 3 and engine.scan["kept"] == 1 and not engine.scan["tiers"][0]["stopped"]
        assert os.path.islink(link)  # left in place: kvstream removes no link
        os.unlink(link)


def test_an_error_listing_tmp_leaves_the_scan_of_the_pages_going(tier_dirs, monkeypatch, caplog):
    pages, keys = _stored(tier_dirs[:1], 3)

    def unreadable(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(scan_module, "each_tmp_problem", unreadable)
    with make_engine(tier_dirs[:1]) as engine:
        assert len(engine.index) == 3 and engine.scan["kept"] == 1
    assert messages(caplog, "tmp unreadable", "going on with the pages")


@pytest.mark.parametrize("damage", ["header", "payload"])
def test_check_fix_never_removes_a_valid_page_renamed_over_a_damaged_one(tier_dirs, monkeypatch, damage):
    """``kvstream check --fix`` (check_tiers) beside a running engine: a page it judged damaged is
    removed only if it is still the file it read; another writer's put that renamed a valid page over
    the name meanwhile keeps it (reported, left in place). Without the race the damaged file goes."""
    pages, keys = _stored(tier_dirs[:1], 2)
    layout = TierLayout(tier_dirs[0], NS.digest)
    paths = [layout.page_path(k) for k in keys]
    valid = [Path(p).read_bytes() for p in paths]
    for p in paths:
        flip_byte(p, 10 if damage == "header" else HEADER_SIZE + 100)
    real_remove = trust.remove

    def other_writer_then_remove(root, p, *args, **kw):
        if p == paths[0]:  # another server's put of the key commits now
            Path(layout.tmp, "other-writer").write_bytes(valid[0])
            os.rename(os.path.join(layout.tmp, "other-writer"), p)
        return real_remove(root, p, *args, **kw)

    monkeypatch.setattr(integrity, "remove", other_writer_then_remove)
    problems = check_tiers(Config.from_sources({"tiers": tier_dirs[:1]}, environ={}), NS, fix=True)
    assert sorted((p.path, p.fixed) for p in problems) == sorted([(paths[0], False), (paths[1], True)])
    assert "left in place" in next(p.detail for p in problems if p.path == paths[0])
    assert Path(paths[0]).read_bytes() == valid[0] and not os.path.exists(paths[1])
    assert not [n for n in os.listdir(os.path.dirname(paths[0])) if n.startswith(".")]  # (nothing left aside)


def test_the_scan_never_removes_a_valid_page_renamed_over_a_damaged_one(tier_dirs, monkeypatch):
    """The scan reads a damaged file twice, then removes it: another process's put of the key that
    renames a valid page over the name in between keeps it (trust.remove takes only the file judged)."""
    pages, keys = _stored(tier_dirs[:1], 1)
    layout = TierLayout(tier_dirs[0], NS.digest)
    path = layout.page_path(keys[0])
    valid = Path(path).read_bytes()
    Path(path).write_bytes(b"garbage" * 100)  # a damaged copy (a crash, a bit flip)
    real_remove = trust.remove

    def other_writer_then_remove(root, p, *args, **kw):
        if p == path:  # another server's put of the key commits now
            Path(layout.tmp, "other-writer").write_bytes(valid)
            os.rename(os.path.join(layout.tmp, "other-writer"), path)
        return real_remove(root, p, *args, **kw)

    monkeypatch.setattr(integrity, "remove", other_writer_then_remove)  # (the scan removes through fix_problem)
    with make_engine(tier_dirs[:1]) as engine:
        monkeypatch.undo()
        assert Path(path).read_bytes() == valid, "the scan deleted a valid page another writer had just committed"
        assert engine.scan["damaged_removed"] == 0 and engine.scan["kept"] == 1
        assert pages.checked_get(engine, keys) == [True]


def test_a_tier_that_fails_as_its_scan_lists_its_shards_is_scanned_once_it_is_back(tier_dirs, monkeypatch):
    """As test_scan.py::test_a_tier_back_after_failing_during_its_scan_is_scanned_on_from_the_shard_it_was_reading,
    but the tier fails (an EIO of its device) while the scan lists the namespace directory, the first
    thing it reads: the listing's error ends the scan as "namespace directory unusable" (scan.py
    _scan_tier), part.resume_at stayed None, so the tier was never in ``unfinished`` and its scan never
    resumed once it was back: with discover=0 its pages were never found (served [False] * n), never
    counted against the capacity, and check() found them index_missing (before this fix; found by the
    review of stop 42's changes). Now the listing's error is the tier's, and its scan goes on."""
    pages, keys = _stored(tier_dirs[:1], 6)
    listed, shards = [], scan_module.shards

    def failing(layout):
        listed.append(1)
        if len(listed) == 1:
            engine.tiers[0].fail(errno.EIO, "the device in trouble as the scan lists the namespace")
            raise OSError(errno.EIO, os.strerror(errno.EIO), layout.pages)
        return shards(layout)

    monkeypatch.setattr(scan_module, "shards", failing)
    clock = FakeClock()
    with make_engine(tier_dirs[:1], scan_rate=HELD, discover=False, clock=clock, tier_retry=1) as engine:
        _release(engine)
        assert engine.scan["tiers"][0]["stopped"] and not engine.tiers[0].healthy
        clock.advance(1)  # the back-off: the next call probes it, and it rejoins
        got = pages.checked_get(engine, keys)
        assert engine.tiers[0].healthy
        assert engine.wait_scan(WAIT_S)
        got = pages.checked_get(engine, keys) if got != [True] * 6 else got
        assert got == [True] * 6, (f"tier 0 is back and holds the 6 pages; served {got}; scan: "
                                   f"{engine.scan['tiers'][0]}")
        assert engine.index.used[0] == 6 * PAGE_BYTES


def test_check_after_a_tier_rejoined_in_a_gets_second_chance_reports_no_index_missing(tier_dirs, monkeypatch):
    """A tier fails while its start-up scan reads its third shard; it rejoins in a get's second chance
    (the page's only holder: probed then and there, Engine._recover), not in the _usable_mask that
    precedes _discover. check() "lets the scan finish" (Engine.check: set_limits, wait): the wait resumes
    the scan of a tier back first, and check() reports nothing (before: resume was called from
    Engine._discover only; check() found the scan done and reported every page of the shards not read
    as ``index_missing``; found by the review of stop 42's changes)."""
    pages, keys = _stored(tier_dirs[:1], 12)
    read, engines = _failing_at_the_third_shard(monkeypatch)
    clock = FakeClock()
    with make_engine(tier_dirs[:1], scan_rate=HELD, clock=clock, tier_retry=600) as engine:
        engines.append(engine)
        _release(engine)
        assert engine.scan["tiers"][0]["stopped"].startswith("tier failed")
        first = sorted(keys)[0]  # its shard was read whole: indexed, on the failed tier
        assert engine.index.holders(first) == 1
        assert pages.checked_get(engine, [first]) == [True]  # the second chance probes tier 0: it rejoins
        assert engine.tiers[0].healthy
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "kvstream-rejoin"], 30,
                   "the rejoin thread did not end")
        problems = engine.check()
        assert problems == [], [f"{p.kind} {os.path.basename(p.path)}" for p in problems]


def test_a_shard_whose_listing_fails_the_device_fails_the_tier_and_is_scanned_once_it_is_back(
        tier_dirs, monkeypatch):
    """The listing of the scan's second shard answers EIO (the device in trouble): the tier fails
    (logged once), its scan stops there and goes on from that shard once the tier is back, so with
    ``discover=0`` every page is found. Before, the scan warned and went on to the next shard, once per
    shard of a dead device, the tier healthy, and the pages of the shards it could not list were never
    indexed (found by the review of what an operator sees)."""
    pages, keys = _stored(tier_dirs[:1], 6)
    listed, entries = [], scan_module.each_shard_entry

    def failing_once(layout, shard):
        listed.append(shard)
        if len(listed) == 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO), shard)
        return entries(layout, shard)

    monkeypatch.setattr(scan_module, "each_shard_entry", failing_once)
    clock = FakeClock()
    with make_engine(tier_dirs[:1], scan_rate=HELD, discover=False, clock=clock, tier_retry=1) as engine:
        _release(engine)
        assert not engine.tiers[0].healthy and engine.scan["tiers"][0]["stopped"].startswith("tier failed")
        clock.advance(1)  # the back-off: the next call probes it, and it rejoins
        pages.checked_get(engine, keys[:1])
        assert engine.tiers[0].healthy and engine.wait_scan(WAIT_S)
        assert listed[2] == listed[1]  # (the shard that failed, listed again first)
        assert pages.checked_get(engine, keys) == [True] * 6


def test_a_scan_resumed_twice_never_reads_again_the_shards_read_whole_before(tier_dirs, monkeypatch):
    """design.md ("Index, capacity, eviction, start-up"): once a tier that failed during its scan is back,
    its scan is resumed "from the shard it was reading when it failed (every shard before it was read
    whole)"; guarantees.md: "from the shard it was reading ... (the shards read whole before are not read
    again)". Here the tier fails as the scan reads its third shard; once back, the resumed scan fails again
    as it lists the namespace (an EIO of the device, test_scan.py's own injection); once back again, the
    scan goes on from the third shard. Before, it went on from the first: the namespace-listing path of
    scan._scan_tier called ``self._failed(part)`` without ``at``, and every shard read whole before was
    read again, minutes of reads on a tier of a million pages (found by the review of this stop's docs)."""
    pages, keys = _stored(tier_dirs[:1], 12)
    shards = sorted({k[:2] for k in keys})
    assert len(shards) >= 4
    read, engines = _failing_at_the_third_shard(monkeypatch)
    listings, real_shards = [], scan_module.shards

    def failing_second_listing(layout):
        listings.append(1)
        if len(listings) == 2:  # the first resumed scan's listing of the namespace
            engines[0].tiers[0].fail(errno.EIO, "the device in trouble again as the resumed scan lists")
            raise OSError(errno.EIO, os.strerror(errno.EIO), layout.pages)
        return real_shards(layout)

    monkeypatch.setattr(scan_module, "shards", failing_second_listing)
    clock = FakeClock()
    with make_engine(tier_dirs[:1], scan_rate=HELD, discover=False, clock=clock, tier_retry=1) as engine:
        engines.append(engine)
        _release(engine)
        assert engine.scan["tiers"][0]["stopped"].startswith("tier failed") and read == shards[:3]
        clock.advance(1)
        pages.checked_get(engine, keys[:1])  # back: the scan resumes, and its listing fails the tier again
        wait_until(lambda: len(listings) == 2 and engine._scan.unfinished & 1,
                   what="the resumed scan never stopped on its failed listing")
        assert not engine.tiers[0].healthy and read == shards[:3]
        clock.advance(1)
        assert pages.checked_get(engine, keys[:1]) == [True]  # back again: the scan resumes once more
        assert engine.tiers[0].healthy and engine.wait_scan(WAIT_S)
        assert engine.index.pages_on(0) == 12
        again = read[3:]
        assert again == shards[2:], (
            f"the scan resumed after its second stop read {len(again)} shards where {len(shards) - 2} were left "
            f"(from {shards[2]!r}, the shard it was reading when it first failed): {again}")


def test_kvstream_info_lists_no_scan_of_a_process_that_is_gone(tmp_path, monkeypatch):
    """The progress files of scans (``kvstream info``'s "scans") of a process killed before it could
    remove its own, and of a pid another process has now (its start time differs), are not listed and
    are removed; a live engine's is listed (one of an earlier version, which kept no start time, too).
    Before, a killed engine's file stayed for good, and once its pid was reused its scan was shown as
    running (from the review of process lifecycles)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    where = scan_module.progress_dir()
    os.makedirs(where, mode=0o700)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me, started = os.getpid(), tmpfiles.started(os.getpid())
    docs = {"gone": {"pid": gone.pid, "started": 1}, "reused": {"pid": me, "started": started + 1},
            "live": {"pid": me, "started": started}, "earlier": {"pid": me}}
    for name, doc in docs.items():
        with open(os.path.join(where, f"scan-{name}.json"), "w") as f:
            json.dump(dict(doc, name=name), f)
    assert sorted(d["name"] for d in scan_module.running_scans()) == ["earlier", "live"]
    assert sorted(os.listdir(where)) == ["scan-earlier.json", "scan-live.json"]


def test_the_temporary_progress_file_of_a_process_killed_while_it_wrote_it_is_removed(tmp_path, monkeypatch):
    """A scan writes its progress file through a temporary one (``scan-<pid>-<digest>.json.<thread>.tmp``) and a
    rename, once a second. A process killed between the two (SGLang kills its schedulers; a rank that fails takes
    the server down) left that temporary file for good: `kvstream info` and every engine's start removed a gone
    process's ``.json`` only (one such file, of 0 bytes, was found in ``/tmp/kvstream-0`` on this machine by a
    TP trial). One of a process that is gone, and older than any write in flight, goes now; a fresh one stays."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    where = scan_module.progress_dir()
    os.makedirs(where, mode=0o700)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    old, fresh = (os.path.join(where, f"scan-{gone.pid}-{i:032x}.json.{140377382188736 + i}.tmp") for i in range(2))
    for path in (old, fresh):
        with open(path, "w"):
            pass
    then = time.time() - 3600
    os.utime(old, (then, then))
    assert scan_module.running_scans() == []
    assert sorted(os.listdir(where)) == [os.path.basename(fresh)]


def test_a_progress_file_of_an_earlier_version_whose_pid_another_process_has_now_is_removed(tmp_path, monkeypatch):
    """A version before 8ea3036 kept no start time in its scan's progress file. One killed (its file left) and
    upgraded: its pid is another process's now, a process begun long after the file was last written (pids
    wrap; a container's are small). ``kvstream info`` listed that file as a live scan of this user's, and no
    start or info ever removed it, for as long as the other process lived (trial upgrade). Judged as a
    temporary file's writer is (tmpfiles.PID_REUSE_S), it goes; one written since that process began stays."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    where = scan_module.progress_dir()
    os.makedirs(where, mode=0o700)
    me = os.getpid()
    began = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + tmpfiles.started(me) / os.sysconf("SC_CLK_TCK")
    for name, written in [("killed", began - 3600), ("live", time.time())]:  # (the fields 8c414b8 wrote)
        path = os.path.join(where, f"scan-{me}-{name}.json")
        with open(path, "w") as f:
            json.dump({"done": False, "files": 10, "pid": me, "namespace": name, "tier_dirs": ["/nvme/kv"]}, f)
        os.utime(path, (written, written))
    assert [d["namespace"] for d in scan_module.running_scans()] == ["live"]
    assert sorted(os.listdir(where)) == [f"scan-{me}-live.json"]


def test_an_engine_start_removes_the_progress_files_of_scans_whose_process_is_gone(tier_dirs, tmp_path, monkeypatch):
    """An SGLang server's engine is never closed (its scheduler is killed at shutdown: close_at_exit off), so
    each start of each rank left its scan's progress file in ``kvstream-<uid>`` for good, unless someone ran
    ``kvstream info``: a server restarted daily for a year left 365 files per rank (found by a trial of SGLang
    server options: every stop of a real server left one). A new engine's scan removes those of processes
    that are gone, as ``kvstream info`` does; a live process's stays."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    where = scan_module.progress_dir()
    os.makedirs(where, mode=0o700)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = [os.path.join(where, f"scan-{gone.pid}-{i:032x}.json") for i in range(3)]
    live = os.path.join(where, "scan-live.json")
    for path, pid, started in [(p, gone.pid, 1) for p in stale] + [(live, os.getpid(), tmpfiles.started(os.getpid()))]:
        with open(path, "w") as f:
            json.dump({"pid": pid, "started": started}, f)
    with make_engine(tier_dirs[:2]) as engine:
        assert engine.wait_scan(WAIT_S)
        assert [p for p in stale if os.path.exists(p)] == [] and os.path.exists(live)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")
@pytest.mark.parametrize("planted", ["directory", "link"])
def test_kvstream_info_reads_no_scan_file_in_a_directory_another_user_made(tier_root, monkeypatch, planted):
    """The progress files' directory is ``kvstream-<uid>`` in the temporary directory: a name anyone can take
    first in /tmp. Another user who made it (0777) and put a FIFO and a forged scan there hung ``kvstream info``
    (open() of the FIFO waited for a writer) and had their scan listed as this user's; a link there to a
    directory of this user's had its ``scan-*.json`` files of no live process removed (the owner was read with
    stat, through the link). Neither is read nor removed: only this user's own directory is. Found by an
    attacker's trial."""
    os.chmod(tier_root, 0o755)
    shared = os.path.join(tier_root, "tmp")  # (a TMPDIR every user writes, as /tmp)
    mine = os.path.join(tier_root, "mine")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    os.mkdir(mine, 0o755)
    with open(os.path.join(mine, "scan-kept.json"), "w") as f:
        json.dump({"pid": 1 << 30}, f)  # (a file of this user's named as a progress file, of no live process)
    monkeypatch.setenv("XDG_RUNTIME_DIR", shared)
    where = scan_module.progress_dir()
    me, started = os.getpid(), tmpfiles.started(os.getpid())

    def plant() -> None:
        if planted == "link":
            os.symlink(mine, where)
            return
        os.mkdir(where, 0o777)
        with open(os.path.join(where, "scan-forged.json"), "w") as f:
            json.dump({"pid": me, "started": started, "namespace": "forged"}, f)
        os.mkfifo(os.path.join(where, "scan-fifo.json"))

    as_user(54321, plant)
    assert run_child(lambda: 0 if scan_module.running_scans() == [] else 3, 30) == 0
    assert os.path.exists(os.path.join(mine, "scan-kept.json"))


def test_pages_of_before_the_restart_that_catch_up_learns_on_a_tier_back_before_its_scan_resumed_are_counted(
        tier_dirs, monkeypatch):
    """A capacity bounds "the tier as it found it at start" (index.py): pages of before the restart are
    counted, and evicted by this process. Tier 1 fails as its scan reads its third shard; tier 0's scan ends,
    so the scan is "done" with tier 1's other shards never listed. Tier 1 rejoins on its own (it owed a
    delete: Tier._settle), no call resumes its scan, and catch-up's look (replication._learn) finds the
    pages of before the restart in the shards not listed. Before, the look read the scan's one done flag,
    took them for another process's pages (found "since" the scan listed every tier: Index._theirs), and
    they were never counted nor evicted by anyone (the resumed scan finds them indexed): a single-node
    tier held more than its capacity for the process's life (here 20 page files on a tier of 12)."""
    pages = PageSet()
    keys = pages.keys(12)
    with make_engine(tier_dirs[:2], replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * 12
        assert engine.index.holders(keys[0]) == 0b11
    shards = sorted({k[:2] for k in keys})
    assert len(shards) >= 4
    engines, read, entries = [], [], scan_module.each_shard_entry

    def failing_at_the_third(layout, shard):
        if layout.pages == engines[0].tiers[1].layout.pages:
            read.append(shard)
            if len(read) == 3:
                engines[0].tiers[1].fail(errno.EIO, "a hiccup while the scan reads a shard")
        return entries(layout, shard)

    monkeypatch.setattr(scan_module, "each_shard_entry", failing_at_the_third)
    clock = FakeClock()
    cap = os.pathsep.join(["", str(12 * PAGE_BYTES)])
    with make_engine(tier_dirs[:2], scan_rate=HELD, clock=clock, tier_retry=1, replicate="all",
                     capacity=cap) as engine:
        engines.append(engine)
        _release(engine)
        assert engine.scan["tiers"][1]["stopped"].startswith("tier failed") and engine._scan.done
        assert engine.delete(keys[-1:]) == 1  # tier 1 owes it: once back, it rejoins from its own thread
        clock.advance(1)
        assert pages.checked_get(engine, keys[:1]) == [True]  # its probe starts the owed delete (Tier._settle)
        wait_until(lambda: engine.tiers[1].healthy and engine.index.pages_on(1) == 11, WAIT_S,
                   "tier 1 did not rejoin, or catch-up did not learn its pages")
        learned = engine.index.used[1] // PAGE_BYTES, engine.index.theirs(1)
        assert pages.checked_get(engine, keys[:1]) == [True]  # (the next call resumes tier 1's scan)
        assert engine.wait_scan(WAIT_S) and engine.scan["tiers"][1]["shards_done"] == len(shards)
        ended = engine.index.used[1] // PAGE_BYTES, engine.index.theirs(1)
        more = pages.keys(12, start=100)
        assert pages.put(engine, more) == [True] * 12
        wait_until(lambda: engine.index.holders(more[-1]) == 0b11, WAIT_S, "tier 1 did not take the new pages")
        files = len(page_files(tier_dirs[1]))
        assert (learned, ended, files) == ((11, 0), (11, 0), 12), (
            f"tier 1 holds 11 pages of this process's last run; (counted, taken for another process's): "
            f"{learned} once catch-up looked, {ended} once the resumed scan ended; after 12 puts, {files} "
            f"page files on a tier of 12")


def test_a_page_another_node_replaced_while_the_scan_read_it_is_indexed(tier_dirs, monkeypatch):
    """On a network tier a page another node renamed a new version over, since this node looked up (or
    opened) the file it replaced, answers ESTALE: the old file is gone on the server, and under the name is
    a valid page. The scan reads it again, as a page it judged is (judge_and_fix): before, taken for a page
    that vanished, it was never read again, and with ``discover=0`` it was a miss for good on this node."""
    pages, keys = _stored(tier_dirs[:1], 3)
    real, replaced = integrity.open_with_header, []

    def stale(path, trust):
        if keys[1] in path and not replaced:  # (the first read of it: renamed over since it was looked up)
            replaced.append(path)
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return real(path, trust)

    monkeypatch.setattr(integrity, "open_with_header", stale)
    with make_engine(tier_dirs[:1], discover=False) as engine:
        assert replaced and pages.checked_get(engine, keys) == [True] * 3



@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a pid namespace needs root and unshare")
def test_an_engine_started_in_another_pid_namespace_leaves_a_live_engine_s_progress_file(tier_dirs, tmp_path,
                                                                                          monkeypatch):
    """Containers that share a temporary directory (a pod's emptyDir, a host's /tmp mounted in), as one user, do
    not share their pids: an engine started in one judged the live engines of the other by pids it cannot see,
    and removed their progress files at its start (`kvstream info` there then showed no scan). Temporary files
    of tiers are told apart by pid namespace already (tmpfiles.HOST); a progress file of another pid namespace
    is neither listed nor removed."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    code = ("import sys; from kvstream_hicache import Config, Engine, Namespace; "
            "e = Engine(Config.from_sources({'tiers': sys.argv[1:]}, environ={}), Namespace({'model': 'other'})); "
            "e.wait_scan(60); e.close()")
    env = dict(os.environ, PYTHONPATH=str(Path(scan_module.__file__).parent.parent))
    with make_engine(tier_dirs[:1]) as engine:
        assert engine.wait_scan(WAIT_S)
        live = engine._scan.progress_path
        wait_until(lambda: os.path.exists(live), WAIT_S, "the scan's progress file was never written")
        proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code,
                               tier_dirs[1]], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert os.path.exists(live), "an engine in another pid namespace removed a live engine's progress file"
        assert [d["pid"] for d in scan_module.running_scans()] == [os.getpid()]


def test_a_restart_at_the_same_capacity_whose_puts_came_before_the_scan_says_no_capacity_was_lowered(tier_dirs,
                                                                                                      caplog):
    """A tier full to its capacity, restarted with the same capacity: the puts served before the scan indexed the
    tier's pages evicted none of them (unknown yet), so the scan ends over the capacity and its trim evicts the
    excess, as it should. Its warning said the capacity was "lowered since the last run", naming the setting for
    the operator to fix, on every restart of a busy server whose capacity never changed."""
    pages = PageSet()
    old, new = pages.keys(3), pages.keys(2, start=100)
    with make_engine(tier_dirs[:1], capacity=str(3 * PAGE_BYTES)) as engine:
        assert pages.put(engine, old) == [True] * 3
    caplog.set_level("INFO", logger="kvstream")
    with make_engine(tier_dirs[:1], capacity=str(3 * PAGE_BYTES), scan_rate=HELD) as engine:
        assert pages.put(engine, new) == [True] * 2  # (before the scan indexed the 3 pages there)
        _release(engine)
        assert engine.index.used[0] <= 3 * PAGE_BYTES
    said = messages(caplog, "lowered")
    assert said == [], said


def test_the_scan_s_trim_holds_the_writer_for_a_bounded_number_of_files(tier_dirs, monkeypatch):
    """The scan found a tier far over its capacity, in small pages: its trim evicted up to TRIM_BYTES (256
    MiB) per hold of the writer's lock, 65,536 files of 4 KiB, each an unlink and more, and every put waited
    behind the whole hold (trial 'scale': 100k pages of 4 KiB on GlusterFS, a capacity 24k pages below them,
    puts stalled 55 s at the scan's end). A hold removes at most 256 files: a put waits one such step."""
    pages = PageSet(size=4096)
    keys = pages.keys(700)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 700
    holds, evict = [], Index.evict_excess

    def counted(index, *args):
        victims = evict(index, *args)
        holds.append(len(victims))
        return victims

    monkeypatch.setattr(Index, "evict_excess", counted)
    with make_engine(tier_dirs[:1], capacity=str(100 * 4096), scan_rate=HELD) as engine:
        _release(engine)
        assert sum(holds) == 600 and engine.stats()["tiers"][0]["evictions"] == 600
        assert max(holds) <= 256, holds
        assert len(page_files(tier_dirs[0])) == 100 and engine.check() == []


def test_a_put_on_a_tier_over_its_capacity_evicts_a_bounded_number_of_files(tier_dirs, monkeypatch):
    """The pages indexed before the scan's end (discovered here; scanned alike) put a tier far over its
    capacity: the next put's reserve evicted the whole excess in the writer's step, a file removed for each,
    and every write waited (trial 'scale': 27,841 files of 4 KiB over GlusterFS, no put for 45 s). A put
    evicts its own room and at most EVICT_EXTRA pages more; the rest goes with the next puts and the trim."""
    from kvstream_hicache.index import EVICT_EXTRA

    pages = PageSet(size=4096)
    keys = pages.keys(700)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 700
    with make_engine(tier_dirs[:1], capacity=str(100 * 4096), scan_rate=HELD) as engine:
        assert engine.prefix_len(keys) == 700  # (discovery: each indexed, 700 pages against 100)
        new = pages.keys(3, start=1000)
        for n, k in enumerate(new, 1):
            assert pages.put(engine, [k]) == [True]
            assert engine.stats()["tiers"][0]["evictions"] == n * (1 + EVICT_EXTRA), n
        assert pages.checked_get(engine, new) == [True] * 3
        _release(engine)  # (the scan's trim takes the rest)
        assert engine.index.used[0] == 100 * 4096 and len(page_files(tier_dirs[0])) == 100
        assert pages.checked_get(engine, new) == [True] * 3 and engine.check() == []


def test_a_put_during_the_scan_s_trim_is_written_between_two_of_its_steps(tier_dirs, monkeypatch):
    """The trim re-entered the writer's exclusive section as soon as it left it: the writer, woken, found it
    taken again, and a put made during a trim of many steps waited for all of them (trial 'scale': 12,207
    pages of 4 KiB trimmed over GlusterFS, no put for 11 s). Between two steps the writer has its turn."""
    pages = PageSet(size=4096)
    keys = pages.keys(1500)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 1500
    steps, evict, put_done, threads, engines = [], Index.evict_excess, threading.Event(), [], []

    def step(index, *args):
        victims = evict(index, *args)
        steps.append((len(victims), put_done.is_set()))
        if len(steps) == 1:  # a put comes while the trim runs
            def put():
                assert pages.put(engines[0], pages.keys(1, start=5000)) == [True]
                put_done.set()
            threads.append(threading.Thread(target=put))
            threads[0].start()
        return victims

    monkeypatch.setattr(Index, "evict_excess", step)
    with make_engine(tier_dirs[:1], capacity=str(100 * 4096), scan_rate=HELD) as engine:
        engines.append(engine)
        _release(engine)
        threads[0].join(WAIT_S)
        assert put_done.is_set()
        assert any(n and done for n, done in steps), steps  # written before the trim's last step
        assert engine.index.used[0] == 100 * 4096 and engine.check() == []
