"""A tier fails while the store runs, for real: its directory is renamed away or removed, its loop
file system is unmounted or remounted read-only (root ignores permission bits, so chmod proves
nothing here). Reads go on from the other replica with no failed request, writes go on to the
healthy tier and count the missing replica, the failed tier is probed after its back-off (doubling
while it stays broken), or as soon as a look finds its vanished directory back, and rejoins when it
recovers; the stats and the log show each change of state once, never once per page. Time is an
injected clock: no sleeps, no timing assertions.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import threading
import time

import pytest

from kvstream_hicache import check_tiers, trust
from kvstream_hicache import tiers as tiers_module
from kvstream_hicache.errors import ConfigError
from kvstream_hicache.index import SETTLE_CHUNK, Index
from kvstream_hicache.layout import HEADER_SIZE
from kvstream_hicache.owed import recorded
from kvstream_hicache.router import SingleTier
from kvstream_hicache.tiers import LOOK_S
from kvstream_hicache.tmpfiles import TMP_SUFFIX

from helpers import (  # noqa: F401
    NS, VERSION_OFF, FakeClock, PageSet, as_user, flip_byte, loop_fs, make_engine, messages, page_files,
    set_header_field, tier_stats_once, wait_until,
)

RETRY_S = 5.0  # tier_retry of these tests: first back-off, s


class Rename:
    """The tier directory is moved away (a path that vanished), then moved back."""

    lossy = False
    vanishes = True  # <tier>/kvstream is gone while failed: looked for between batches, not only probed

    def __init__(self, tier_root, loop_fs):
        self.dir = os.path.join(tier_root, "tier0")
        os.makedirs(self.dir)

    def fail(self):
        os.rename(self.dir, self.dir + ".away")

    def recover(self):
        os.rename(self.dir + ".away", self.dir)


class Remove(Rename):
    """The tier's tree is deleted (an operator, a wiped scratch disk), then re-created empty."""

    lossy = True

    def fail(self):
        shutil.rmtree(os.path.join(self.dir, "kvstream"))

    def recover(self):
        os.makedirs(os.path.join(self.dir, "kvstream"))


class Unmount:
    """The tier's file system is unmounted (its empty mount point stays behind), then mounted again."""

    lossy = False
    vanishes = True

    def __init__(self, tier_root, loop_fs):
        self.fs = loop_fs(32 << 20, "tier0fs")
        self.dir = self.fs.mnt

    def fail(self):
        self.fs.umount()

    def recover(self):
        self.fs.mount()


class ReadOnly(Unmount):
    """The tier's file system is remounted read-only (what ext4 does itself on errors=remount-ro)."""

    vanishes = False

    def fail(self):
        self.fs.remount("ro")

    def recover(self):
        self.fs.remount("rw")


@pytest.mark.parametrize("fault", [Rename, Remove, Unmount, ReadOnly], ids=lambda f: f.__name__.lower())
def test_tier_fails_mid_run_and_rejoins(tier_root, loop_fs, caplog, fault):
    caplog.set_level(logging.INFO, logger="kvstream")
    tier = fault(tier_root, loop_fs)
    other = os.path.join(tier_root, "tier1")
    os.makedirs(other)
    clock = FakeClock()
    pages = PageSet()
    first, second, third, fourth = (pages.keys(6, 6 * i) for i in range(4))
    with make_engine([tier.dir, other], clock=clock, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, first) == [True] * 6
        assert [engine.index.holders(k) for k in first] == [0b11] * 6
        caplog.clear()

        tier.fail()
        # reads: no failed request, whatever tier 0 does
        for _ in range(2):
            assert pages.checked_get(engine, first) == [True] * 6
        # writes: the healthy tier takes every page, the missing replica is counted
        assert pages.put(engine, second) == [True] * 6
        stats = engine.stats()
        t0 = stats["tiers"][0]
        assert not t0["healthy"] and t0["failures"] == 1 and t0["last_error"]
        assert stats["under_replicated"] == 6
        assert [engine.index.holders(k) for k in second] == [0b10] * 6
        assert not engine.contains(first[0]) or engine.index.holders(first[0]) & 0b10  # served by tier 1
        assert pages.checked_get(engine, first + second) == [True] * 12

        # back-off: no probe before it expires; a probe of a still-broken tier doubles it
        clock.advance(RETRY_S - 1)
        assert pages.put(engine, third[:3]) == [True] * 3
        clock.advance(2)  # past the first back-off: probed, still broken
        assert pages.put(engine, third[3:]) == [True] * 3
        assert not engine.stats()["tiers"][0]["healthy"]
        assert engine.stats()["under_replicated"] == 12

        tier.recover()
        if tier.vanishes:
            # its directory is back: a look (one stat, at most every LOOK_S) finds it at the next call,
            # which probes it and rejoins it, long before the doubled back-off (10 s) expires
            clock.advance(LOOK_S)
            assert pages.checked_get(engine, third) == [True] * 6
            assert engine.stats()["tiers"][0]["healthy"]
        else:
            # a tier whose directory never went (read-only): the back-off alone decides
            clock.advance(RETRY_S)  # inside the doubled back-off (10 s from the failed probe)
            assert pages.checked_get(engine, third) == [True] * 6
            assert not engine.stats()["tiers"][0]["healthy"]
            clock.advance(RETRY_S + 1)  # past it: probed, works, rejoins
        assert pages.put(engine, fourth) == [True] * 6
        stats = engine.stats()
        assert stats["tiers"][0]["healthy"] and stats["tiers"][0]["failures"] == 1
        assert stats["under_replicated"] == 12  # the new pages have both replicas again
        assert [engine.index.holders(k) for k in fourth] == [0b11] * 6
        # What it missed while out (and, wiped, what it lost) background replication writes there again
        everything = first + second + third + fourth
        wait_until(lambda: [engine.index.holders(k) for k in everything] == [0b11] * 24,
                   what="the pages tier 0 missed were never written to it again")
        done = 12 + 6 * tier.lossy  # (counted by the catch-up's callback after the commit: helpers.py)
        assert tier_stats_once(engine, 0, "replication_done", done)["replication_done"] == done
        assert pages.checked_get(engine, everything) == [True] * 24
        assert pages.checked_get(engine, everything, policy=SingleTier(0)) == [True] * 24

        # the log: one line per change of state, none per page
        assert len(messages(caplog, "tier 0", "failed", level=logging.WARNING)) == 1
        assert len(messages(caplog, "tier 0", "recovered", level=logging.WARNING)) == 1
        warnings = messages(caplog, level=logging.WARNING)
        assert len(warnings) == 2 + tier.lossy, warnings  # + "rejoined without N pages" after a wipe

        assert engine.check() == []
    assert check_tiers(engine.config) == []


def test_tier_subdirectory_of_an_unmounted_fs_refuses_to_start(tier_root, loop_fs):
    """Tiers configured as a subdirectory of their mount: a file system not mounted at start-up is
    a missing directory, so the engine refuses to start and names it (a bare mount point cannot be
    told from an empty tier; see docs/guarantees.md)."""
    fs = loop_fs(32 << 20, "t0")
    tier = os.path.join(fs.mnt, "kv")
    os.mkdir(tier)
    other = os.path.join(tier_root, "t1")
    os.makedirs(other)
    pages = PageSet()
    with make_engine([tier, other]) as engine:
        assert pages.put(engine, pages.keys(3)) == [True] * 3
    fs.umount()
    from kvstream_hicache.errors import TierError

    with pytest.raises(TierError) as info:
        make_engine([tier, other])
    assert tier in str(info.value) and "does not exist" in str(info.value)
    assert os.listdir(fs.mnt) == [], "nothing written on the parent file system"
    fs.mount()
    with make_engine([tier, other]) as engine:  # mounted again: every page is back on both tiers
        assert engine.wait_scan(30)
        assert [engine.index.holders(k) for k in pages.keys(3)] == [0b11] * 3
        assert pages.checked_get(engine, pages.keys(3), policy=SingleTier(0)) == [True] * 3


def test_a_returned_tier_serves_what_its_replica_lost(tier_root, caplog):
    """Tier 0 vanished (failed: skipped for its back-off), then came back; meanwhile tier 1's copies
    of some pages were damaged and others' are gone from tier 1 altogether. A read of those pages
    finds tier 0 the only holder left: it is probed then and there (once per batch, whatever its
    back-off) and serves them, in the same call. The clock does not move: no back-off expires."""
    caplog.set_level(logging.INFO, logger="kvstream")
    dirs = [os.path.join(tier_root, f"tier{i}") for i in range(2)]
    for d in dirs:
        os.makedirs(d)
    clock = FakeClock()
    pages = PageSet()
    damaged, gone, fine = pages.keys(3), pages.keys(3, 3), pages.keys(3, 6)
    with make_engine(dirs, clock=clock, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, damaged + gone + fine) == [True] * 9
        os.rename(dirs[0], dirs[0] + ".away")
        assert pages.checked_get(engine, fine, policy=SingleTier(0)) == [True] * 3  # tier 0 fails here
        assert not engine.stats()["tiers"][0]["healthy"]
        os.rename(dirs[0] + ".away", dirs[0])
        for k in damaged:
            flip_byte(engine.tiers[1].layout.page_path(k), HEADER_SIZE + 100)
        for k in gone:  # tier 1 lost these before this process could read them: only tier 0 is indexed
            os.unlink(engine.tiers[1].layout.page_path(k))
            engine.index.remove(k, 1)
        assert pages.checked_get(engine, damaged + gone + fine) == [True] * 9
        stats = engine.stats()
        assert stats["tiers"][0]["healthy"] and stats["tiers"][0]["failures"] == 1
        assert stats["tiers"][1]["quarantined"] == 3
        assert engine.last_batch["second_chance"] == 1
        assert len(messages(caplog, "tier 0", "recovered")) == 1
        assert engine.check() == []


def test_a_failed_tier_that_stays_broken_is_probed_once_per_batch(tier_root):
    """The last holder of a page is probed at most once per read batch, and at most every LOOK_S: a
    tier that is still gone makes the page a miss (no wrong bytes), and a later batch probes it again."""
    dirs = [os.path.join(tier_root, f"tier{i}") for i in range(2)]
    for d in dirs:
        os.makedirs(d)
    clock = FakeClock()
    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(dirs, clock=clock, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, keys) == [True] * 4
        os.rename(dirs[0], dirs[0] + ".away")
        for k in keys:
            os.unlink(engine.tiers[1].layout.page_path(k))
        probes = []
        real_probe = engine.tiers[0]._probe
        engine.tiers[0]._probe = lambda: probes.append(1) or real_probe()
        # tier 0 fails in this batch: no probe of a tier that failed a moment ago
        assert pages.checked_get(engine, keys, policy=SingleTier(0)) == [False] * 4
        assert probes == [] and not engine.stats()["tiers"][0]["healthy"]
        for batch in (1, 2):  # the last holder, failed before the batch: one probe per batch
            assert pages.checked_get(engine, keys) == [False] * 4
            assert len(probes) == batch
            assert pages.checked_get(engine, keys) == [False] * 4  # again within LOOK_S: no probe
            assert len(probes) == batch
            clock.advance(LOOK_S)
        os.rename(dirs[0] + ".away", dirs[0])
        assert pages.checked_get(engine, keys) == [True] * 4  # back: probed, rejoined, served
        assert len(probes) == 3
        assert engine.check() == []


def _close_fails_on(monkeypatch, module, root: str, err: int) -> list[str]:
    """``close`` of descriptors of files under ``root`` reports ``err`` through ``module``'s close_fd (as
    a network file system's close does: the descriptor is freed all the same); returns the paths."""
    import kvstream_hicache.fds as fds

    seen: list[str] = []

    def close_fd(fd: int) -> int:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        done = fds.close_fd(fd)
        if path.startswith(root + os.sep):
            seen.append(path)
            return err
        return done

    monkeypatch.setattr(module, "close_fd", close_fd)
    return seen


def test_a_close_error_on_a_written_page_fails_that_write_only(tier_dirs, monkeypatch):
    """EIO from close on tier 1 (its server did not take the data): tier 1's copy is not committed
    (no page file there, its temporary file removed), the put answers True from tier 0, nothing raises."""
    import errno

    import kvstream_hicache.tiers as tiers_module

    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(tier_dirs[:2], replicate="all", tier_retry=600) as engine:
        seen = _close_fails_on(monkeypatch, tiers_module, tier_dirs[1], errno.EIO)
        assert pages.put(engine, keys) == [True] * 4
        assert seen, "no close on tier 1 went through the commit"
        monkeypatch.undo()
        stats = engine.stats()["tiers"]
        assert stats[1]["write_failures"] >= 1 and stats[0]["pages_written"] == 4
        assert page_files(tier_dirs[1]) == []
        assert not [f for _d, _s, fs in os.walk(tier_dirs[1]) for f in fs if f.endswith(TMP_SUFFIX)]
        assert pages.checked_get(engine, keys) == [True] * 4


def test_a_close_error_on_a_read_descriptor_never_leaves_get(tier_dirs, monkeypatch):
    """EIO from close of read descriptors (a read's clean-up): the get returns, every page verified."""
    import errno

    import kvstream_hicache.files as files_module

    pages = PageSet()
    keys = pages.keys(6)
    with make_engine(tier_dirs[:2]) as engine:
        assert pages.put(engine, keys) == [True] * 6
        seen = _close_fails_on(monkeypatch, files_module, tier_dirs[0], errno.EIO)
        assert pages.checked_get(engine, keys) == [True] * 6
        assert seen, "no read descriptor of tier 0 was closed"
        monkeypatch.undo()
        assert pages.checked_get(engine, keys) == [True] * 6


def test_a_rejoining_tier_serves_before_its_listing_ends(tier_root, monkeypatch):
    """The call that finds a failed tier back returns before the tier's pages are listed (on a network
    file system a tier of millions of files lists for minutes; that get or put waited for it): the
    listing runs on a thread of its own; when it ends, the pages the tier lost leave the index and
    are written there again. Meanwhile a read of a lost page fails over to the replica."""
    dirs = [os.path.join(tier_root, f"tier{i}") for i in range(2)]
    for d in dirs:
        os.makedirs(d)
    clock = FakeClock()
    pages = PageSet()
    lost, kept = pages.keys(2), pages.keys(2, 2)
    with make_engine(dirs, clock=clock, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, lost + kept) == [True] * 4
        pages_dir = engine.tiers[0].layout.pages
        os.rename(dirs[0], dirs[0] + ".away")
        assert pages.checked_get(engine, kept) == [True] * 2  # tier 0 fails here
        assert not engine.stats()["tiers"][0]["healthy"]
        for k in lost:  # lost while the tier was away
            os.unlink(engine.tiers[0].layout.page_path(k).replace(dirs[0], dirs[0] + ".away", 1))
        os.rename(dirs[0] + ".away", dirs[0])
        listing, release = threading.Event(), threading.Event()
        scandir = os.scandir

        def held_listing(path=".", *args):
            if path == pages_dir:  # the rejoin's listing of tier 0's pages waits for the test
                listing.set()
                release.wait(60)
            return scandir(path, *args)

        monkeypatch.setattr(os, "scandir", held_listing)
        clock.advance(LOOK_S)
        assert pages.checked_get(engine, kept) == [True] * 2  # finds tier 0 back: returns, the listing held
        assert listing.wait(30) and engine.stats()["tiers"][0]["healthy"]
        assert [engine.index.holders(k) for k in lost] == [0b11] * 2  # (not listed yet)
        release.set()
        wait_until(lambda: [engine.index.holders(k) for k in lost] == [0b11] * 2 and
                   engine.stats()["tiers"][0]["replication_done"] == 2, 30, "the lost pages were never written again")
        monkeypatch.undo()
        assert pages.checked_get(engine, lost + kept, policy=SingleTier(0)) == [True] * 4


class _HoldCounter:
    """Stands in for the index lock: counts, per hold on the thread named ``who``, the keys the index
    makes from its rows (``Index._key_of_under_index``) while the lock is held."""

    def __init__(self, lock, who: str):
        self.lock, self.who = lock, who
        self.local = threading.local()
        self.per_hold: list[int] = []

    def __enter__(self):
        self.lock.__enter__()
        self.local.n = 0
        self.local.held = True
        return self

    def __exit__(self, *exc):
        self.local.held = False
        if threading.current_thread().name == self.who and self.local.n:
            self.per_hold.append(self.local.n)
        return self.lock.__exit__(*exc)

    def count(self) -> None:
        if getattr(self.local, "held", False):
            self.local.n += 1


def test_a_rejoin_never_holds_the_index_lock_over_every_page_of_the_tier(tier_dirs, monkeypatch):
    """The rejoin's thread (engine._forget_lost) reads the keys the index holds on the tier a bounded
    step at a time (``Index.holding``, SETTLE_CHUNK keys per hold of the index lock). Before, it began
    with ``index.keys(tier)``, every page of the tier made a key under ONE hold of the lock every
    ``get`` (pin), ``put`` (reserve, commit) and touch takes: 0.28 s at 300k pages on ext4, 0.42 s at
    1M, every get and put waiting meanwhile. Shown by a count of the keys made under each hold the
    rejoin thread takes (no wall time); the rejoin still forgets nothing the tier holds."""
    n = 2 * SETTLE_CHUNK + 1
    dirs = tier_dirs[:2]
    pages = PageSet(size=4096)
    keys = pages.keys(n)
    clock = FakeClock()
    with make_engine(dirs, clock=clock, replicate="all", catchup=False) as engine:
        for i in range(0, n, 500):
            assert pages.put(engine, keys[i:i + 500]) == [True] * len(keys[i:i + 500])
        assert engine.index.pages_on(0) == n
        os.rename(dirs[0], dirs[0] + ".away")
        assert pages.checked_get(engine, keys[:2]) == [True] * 2  # tier 0 fails here (tier 1 serves)
        assert not engine.tiers[0].healthy
        os.rename(dirs[0] + ".away", dirs[0])
        counter = _HoldCounter(engine.index._lock, "kvstream-rejoin")
        key_of = Index._key_of_under_index

        def counted(index, slot):
            counter.count()
            return key_of(index, slot)

        monkeypatch.setattr(engine.index, "_lock", counter)
        monkeypatch.setattr(Index, "_key_of_under_index", counted)
        clock.advance(LOOK_S)
        assert pages.checked_get(engine, keys[:2]) == [True] * 2  # finds tier 0 back: the rejoin thread starts
        assert engine.tiers[0].healthy
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "kvstream-rejoin"], 60,
                   "the rejoin thread did not end")
        monkeypatch.undo()
        assert counter.per_hold, "the rejoin thread read no key from the index"
        assert max(counter.per_hold) <= SETTLE_CHUNK, (
            f"one hold of the index lock by the rejoin thread walked {max(counter.per_hold)} pages "
            f"(every page of the tier: {n}); holds: {counter.per_hold[:8]}")
        assert sum(counter.per_hold) == n and engine.index.pages_on(0) == n  # (every key read, none forgotten)


@pytest.mark.parametrize("out", ["back", "away"])
def test_pages_cleared_while_a_tier_was_failed_stay_cleared_when_it_rejoins(tier_dirs, out):
    """clear() (SGLang's /clear_hicache_storage_backend, e.g. after a weight update: stale KV must never
    be served) while tier 1 is failed. A tier that works again ('back': an EIO that passed) is probed
    by the clear and cleared then; one still out ('away': its directory moved away) removes its pages
    when it rejoins, before it serves: a get while that removal runs misses, and the get that found the
    tier back does not wait for it (a thread of its own; at a restart's first request 400k page files
    took 35 s, SGLang's prefetch thread waiting: found by the review of a real server's clear and
    restart). Before, clear() skipped a failed tier, and once it rejoined its pages were discovered and
    served again. Found by a review."""
    dirs = tier_dirs[:2]
    clock, pages = FakeClock(), PageSet()
    keys = pages.keys(3)
    with make_engine(dirs, clock=clock, tier_retry=RETRY_S) as engine:
        tier = engine.tiers[1]
        assert pages.put(engine, keys) == [True] * 3
        if out == "away":
            os.rename(dirs[1], dirs[1] + ".away")
        assert tier.fail(errno.EIO, "test: an I/O error")
        engine.clear()
        assert len(engine.index) == 0 and not any(engine.contains(k) for k in keys)
        if out == "away":
            assert not tier.healthy  # (probed by the clear: still away)
            os.rename(dirs[1] + ".away", dirs[1])
            removing, release = threading.Event(), threading.Event()
            unlink = tier._remove

            def held_unlink(path, judged=None):  # the rejoin's removal of the pages waits for the test
                removing.set()
                release.wait(60)
                return unlink(path, judged)

            tier._remove = held_unlink
            clock.advance(LOOK_S)  # a look finds the directory back: the next call probes it
            rejoined: list = []
            rejoin = threading.Thread(target=lambda: rejoined.append(pages.checked_get(engine, keys)))
            rejoin.start()
            assert removing.wait(30), "the rejoin never removed the pages cleared"
            rejoin.join(10)  # (the removal runs on a thread of its own: the get that found the tier back
            assert not rejoin.is_alive(), "the get that found the tier back waited for the removal of its pages"
            assert rejoined == [[False] * 3]
            assert pages.checked_get(engine, keys) == [False] * 3  # meanwhile tier 1 serves nothing
            assert not tier.healthy
            release.set()
        _rejoins_serving_none(engine, pages, keys, clock)
        assert page_files(dirs[1]) == []
        assert pages.put(engine, keys) == [True] * 3  # (stored again on both tiers)
        assert [engine.index.holders(k) for k in keys] == [0b11] * 3


def _rejoins_serving_none(engine, pages: PageSet, keys: list[str], clock: FakeClock | None = None) -> None:
    """Gets of ``keys`` until tier 1, which owes a clear, rejoins (a thread of its own removes its pages
    first: the call that found it back never waits for that); none of them serves a page of ``keys``."""
    def served_none() -> None:
        if clock is not None:
            clock.advance(RETRY_S * 4)  # (past any back-off)
        assert pages.checked_get(engine, keys) == [False] * len(keys), "pages cleared are served again"

    _until_back(engine, 1, served_none)


def _until_back(engine, k: int, call) -> None:
    """``call()`` (asserting what must hold meanwhile) until tier ``k`` rejoins: the first call that finds
    it back starts the removal of what it owes on a thread of its own (Tier._settle), a later one lets it in."""
    wait_until(lambda: (call(), engine.stats()["tiers"][k]["healthy"])[1], 30, f"tier {k} never rejoined")


def _cleared_while_tier_1_is_away(dirs, pages: PageSet, keys: list[str]) -> str:
    """``keys`` put on both tiers, tier 1's directory moved away, clear(), the engine closed: the path of
    the record of the clear tier 1 owes (on tier 0)."""
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, keys) == [True] * len(keys)
        os.rename(dirs[1], dirs[1] + ".away")
        engine.clear()
        assert not engine.tiers[1].healthy
        record = os.path.join(engine.tiers[0].layout.base, engine.namespace.digest + ".clears-owed")
    assert os.path.isfile(record)
    return record


def test_a_clear_owed_when_the_process_ends_is_done_at_the_next_start(tier_dirs):
    """clear() (after a weight update: the pages are stale KV) while tier 1's directory is away, then the
    process ends before it is back. The next engine of the namespace reads the record the clear left on
    tier 0 (``<digest>.clears-owed``): tier 1 starts failed, is probed by the first call, removes its
    pages before it serves (a thread of its own, which lets it rejoin once done, with no call coming: an
    idle server's tier is not left out until traffic comes), and the record goes. Before, a clear owed
    was kept in memory only: the next start's scan indexed the stale pages and served them."""
    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(3)
    record = _cleared_while_tier_1_is_away(dirs, pages, keys)
    os.rename(dirs[1] + ".away", dirs[1])
    assert len(page_files(dirs[1])) == 3  # (the stale pages, back with the tier)
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert not engine.tiers[1].healthy and engine.index.pages_on(1) == 0  # (its scan indexed nothing)
        assert not any(engine.contains(k) for k in keys), "pages cleared are found after a restart"
        assert pages.checked_get(engine, keys) == [False] * 3  # (it finds it due: a thread removes its pages)
        wait_until(lambda: engine.tiers[1].healthy, 30, "tier 1 never rejoined while the engine was idle")
        assert page_files(dirs[1]) == [] and not os.path.exists(record)
        assert engine.wait_scan(60) and engine.check() == []
        assert pages.put(engine, keys) == [True] * 3  # (stored again on both tiers)
        assert [engine.index.holders(k) for k in keys] == [0b11] * 3
    with make_engine(dirs, tier_retry=RETRY_S) as engine:  # (nothing owed any more: nothing cleared)
        assert engine.tiers[1].healthy and pages.checked_get(engine, keys) == [True] * 3


@pytest.mark.parametrize("group", ["the tiers'", "another"])
def test_a_clear_owed_survives_a_tree_made_shared_with_chmod_g_rwx(tier_dirs, group):
    """A clear() owed by tier 1 is recorded on tier 0 (0600), then the operator makes the tree shared as
    docs/guarantees.md says (``chmod -R g+rwX``, ``chmod g+s`` on its directories) and starts in shared mode: the
    record, this user's, is now 0660. It names tiers the tiers' group is trusted with (its members may remove
    their pages anyway): the clear is done, no stale page served (before, the record was ignored for its mode,
    and the pages of before the clear were served). A record another group may write names no tier of theirs
    (a member's edit naming a private tier): ignored, as before."""
    if group == "another" and os.geteuid() != 0:
        pytest.skip("giving a file a group of which this user is no member needs root (CI runs as root)")
    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(3)
    record = _cleared_while_tier_1_is_away(dirs, pages, keys)
    os.rename(dirs[1] + ".away", dirs[1])
    for root, subdirs, files in (*os.walk(dirs[0]), *os.walk(dirs[1])):
        os.chmod(root, 0o2770)
        for f in files:
            os.chmod(os.path.join(root, f), 0o660)
    if group == "another":
        os.chown(record, -1, os.stat(dirs[1]).st_gid + 4242)
    assert stat.S_IMODE(os.stat(record).st_mode) == 0o660
    assert recorded(dirs) == ([] if group == "another" else [(1, NS.digest, 0)])  # (kvstream info and check)
    with make_engine(dirs, tier_retry=RETRY_S, file_mode="shared") as engine:
        if group == "another":
            assert pages.checked_get(engine, keys) == [True] * 3  # (the record ignored: tier 1 serves)
            return
        assert pages.checked_get(engine, keys) == [False] * 3, "pages cleared are served after the restart"
        wait_until(lambda: engine.tiers[1].healthy, 30, "tier 1 never rejoined")
        assert page_files(dirs[1]) == [] and not os.path.exists(record)


def test_info_and_check_say_which_tier_owes_a_clear(tier_dirs, capsys):
    """What an operator sees between a clear() tier 1 missed and the next start: ``kvstream info`` and
    ``kvstream check`` name the tier that owes a clear (and where it is recorded), and count its stale
    pages as nothing a running engine would copy. Before, info said the other tier lacked them and that
    background replication would write them there, and nothing named the clear owed (found by the
    review of a real server's clear and restart)."""
    from kvstream_hicache.tools import cli

    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(3)
    _cleared_while_tier_1_is_away(dirs, pages, keys)
    os.rename(dirs[1] + ".away", dirs[1])
    capsys.readouterr()
    assert cli.main(["info", "--tiers", *dirs]) == 0
    out = capsys.readouterr().out
    assert "tier1 owes a clear() of namespace" in out and "(recorded on tier0)" in out
    assert "replicas: every page is on every tier" in out  # (tier 1's stale pages are no replicas owed)
    assert cli.main(["check", "--tiers", *dirs]) == 0
    out = capsys.readouterr().out
    assert "tier1 owes a clear() of namespace" in out and "no problems found" in out
    assert cli.main(["info", "--json", "--tiers", *dirs]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(c["tier"], c["recorded_on"]) for c in doc["clears_owed"]] == [(1, 0)]
    assert doc["under_replicated"] == {"pages": 0, "lacking_per_tier": [0, 0]}


def test_a_clear_owed_by_a_tier_left_out_of_one_start_is_not_forgotten(tier_dirs):
    """clear() (after a weight update) while tier 1 is away; the process ends with tier 1 still away. An
    engine naming tier 1 refuses to start while it is away, so the operator starts with tier 0 alone
    for a while, and clears again there (another weight update). Tier 1 is repaired and listed again:
    its pages, cleared twice, must not be served. Before, the engine with tier 0 alone recalled the
    record naming tier 1, owed nothing itself, and its clear() rewrote the record as 'nothing owed'
    (unlinked it): the debt of a tier not in that start's list was dropped. From the review of this
    stop's changes."""
    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(3)
    _cleared_while_tier_1_is_away(dirs, pages, keys)
    with pytest.raises(ConfigError):  # (tier 1 still away: an engine that lists it does not start)
        make_engine(dirs, tier_retry=RETRY_S).close()
    with make_engine(dirs[:1], tier_retry=RETRY_S) as engine:  # (tier 0 alone meanwhile)
        engine.clear()
    os.rename(dirs[1] + ".away", dirs[1])
    assert len(page_files(dirs[1])) == 3  # (the stale pages, back with the tier)
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert pages.checked_get(engine, keys) == [False] * 3, "pages cleared are served after a restart"


def test_a_clear_owed_is_kept_when_the_tier_is_listed_by_another_path_to_it(tier_dirs, tmp_path):
    """The same clear owed, tier 1 listed through a symbolic link to its directory at one start and by
    its real path at the next (a deployment's config changed; both name one directory, which config.py
    already tells by its real path for duplicates): the record names real paths. Before, it named the
    path as written, the next start matched paths as text, and the stale pages were served."""
    real = tier_dirs[1]
    link = str(tmp_path / "tier1-link")
    os.symlink(real, link)
    pages = PageSet()
    keys = pages.keys(3)
    with make_engine([tier_dirs[0], link], tier_retry=RETRY_S) as engine:
        assert pages.put(engine, keys) == [True] * 3
        os.rename(os.path.join(real, "kvstream"), os.path.join(real, "kvstream.away"))
        engine.clear()
        assert not engine.tiers[1].healthy
        record = os.path.join(engine.tiers[0].layout.base, engine.namespace.digest + ".clears-owed")
    assert os.path.isfile(record)
    os.rename(os.path.join(real, "kvstream.away"), os.path.join(real, "kvstream"))
    assert len(page_files(real)) == 3
    with make_engine([tier_dirs[0], real], tier_retry=RETRY_S) as engine:
        assert pages.checked_get(engine, keys) == [False] * 3, "pages cleared are served after a restart"


def test_a_clear_owed_is_recorded_when_the_holders_tmp_directory_was_emptied_away(tier_dirs):
    """``rm -rf <tier>/kvstream/*`` under a healthy tier while the engine serves is supported (the next
    puts make the tree again: test_a_page_tree_emptied_under_a_healthy_tier_is_made_again). Here it hits
    tier 0, the only local tier that can hold the record, just before a clear() that tier 1 (away)
    misses: the record's write makes ``tmp/`` again. Before, it failed there (ENOENT), was logged and
    never tried again (counted written), and at the next start tier 1's cleared pages were scanned and
    served."""
    holder, away = tier_dirs[0], tier_dirs[1]
    pages = PageSet()
    keys, more = pages.keys(3), pages.keys(2, 3)
    with make_engine([holder, away], tier_retry=RETRY_S) as engine:
        assert pages.put(engine, keys) == [True] * 3
        base = os.path.join(holder, "kvstream")
        for name in os.listdir(base):
            shutil.rmtree(os.path.join(base, name))
        os.rename(away, away + ".away")
        engine.clear()
        assert not engine.tiers[1].healthy
        assert pages.put(engine, more) == [True] * 2  # (tier 0 serves on: its tree, tmp/ too, made again)
        assert engine.tiers[0].healthy and os.path.isdir(os.path.join(base, "tmp"))
        engine.clear()  # (another clear: still nothing recorded)
    os.rename(away + ".away", away)
    assert len(page_files(away)) == 3  # (the stale pages, back with the tier)
    with make_engine([holder, away], tier_retry=RETRY_S) as engine:
        assert pages.checked_get(engine, keys) == [False] * 3, "pages cleared are served after a restart"


def _put_by_another_node(tier_dir: str, pages: PageSet, keys: list[str]) -> None:
    """``keys`` put on ``tier_dir`` alone by another engine of the namespace (another node of a shared
    tier, which writes there while this node has the tier failed, e.g. its mount down)."""
    with make_engine([tier_dir]) as other:
        assert pages.put(other, keys) == [True] * len(keys)


@pytest.mark.parametrize("restart", [False, True])
def test_a_clear_owed_keeps_the_pages_another_node_put_after_it(tier_dirs, restart, monkeypatch):
    """Tier 1 is shared: this node misses a clear() there (its mount away), and another node puts pages
    there after it. When tier 1 rejoins (this process, or the next start through the record of clears
    owed), the pages written before the clear go and the other node's later ones stay and are served:
    they are valid KV, acknowledged to that node. Before, the owed clear removed every page of the
    namespace, the other node's newer ones too. (The skew allowed between nodes' clocks, CLEAR_SKEW_NS,
    which a clear leans to removal by, is set to 0: the pages here are seconds apart, one clock.)"""
    monkeypatch.setattr(tiers_module, "CLEAR_SKEW_NS", 0)
    dirs = tier_dirs[:2]
    pages = PageSet()
    stale, fresh = pages.keys(3), pages.keys(2, 3)
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, stale) == [True] * 3
        os.rename(dirs[1], dirs[1] + ".away")
        engine.clear()
        assert not engine.tiers[1].healthy and engine.tiers[1].clear_owed
        _put_by_another_node(dirs[1] + ".away", pages, fresh)  # (after the clear, on the same tier)
        if restart:
            engine.close()
            os.rename(dirs[1] + ".away", dirs[1])
            engine = make_engine(dirs, tier_retry=RETRY_S)
            assert not engine.tiers[1].healthy  # (it owes the clear recorded on tier 0)
        else:
            os.rename(dirs[1] + ".away", dirs[1])
        with engine:
            _until_back(engine, 1, lambda: pages.checked_get(engine, stale[:1]))
            assert pages.checked_get(engine, stale) == [False] * 3, "pages cleared are served again"
            assert pages.checked_get(engine, fresh) == [True] * 2, "another node's pages put after the clear are gone"
            # (tier 1 holds them; tier 0 may too by now: the catch-up copies a page one tier holds in idle time)
            assert [engine.index.holders(k) & 0b10 for k in fresh] == [0b10] * 2
            assert len(page_files(dirs[1])) == 2


def test_an_owed_clear_reads_the_headers_of_recent_pages_only(tier_dirs, monkeypatch):
    """The owed clear tells a page modified well before it by its file's time alone (on the tier's
    clock), and reads the header only of a page modified about the clear's time: the stale pages of an
    hour ago go unread, those of the last seconds are judged by their headers (gone too), and another
    node's pages put after the clear stay. (Reading every header doubled the time it took on a disk tier.
    CLEAR_SKEW_NS set to 0: one clock here.)"""
    monkeypatch.setattr(tiers_module, "CLEAR_SKEW_NS", 0)
    dirs = tier_dirs[:2]
    pages = PageSet()
    old, recent, fresh = pages.keys(4), pages.keys(2, 4), pages.keys(2, 6)
    read: list[str] = []
    real = tiers_module.open_with_header
    monkeypatch.setattr(tiers_module, "open_with_header", lambda path, trust: (read.append(path), real(path, trust))[1])
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, old + recent) == [True] * 6
        hour_ago = time.time() - 3600
        for k in old:
            os.utime(engine.tiers[1].layout.page_path(k), (hour_ago, hour_ago))
        os.rename(dirs[1], dirs[1] + ".away")
        engine.clear()
        _put_by_another_node(dirs[1] + ".away", pages, fresh)
        os.rename(dirs[1] + ".away", dirs[1])
        _until_back(engine, 1, lambda: pages.checked_get(engine, old[:1]))
        assert pages.checked_get(engine, old + recent) == [False] * 6
        assert pages.checked_get(engine, fresh) == [True] * 2
        layout = engine.tiers[1].layout
        assert sorted(read) == sorted(layout.page_path(k) for k in recent + fresh)


def test_a_clear_owed_takes_the_pages_another_node_put_in_the_minutes_after_it_too(tier_dirs):
    """The clocks of two nodes may differ (by less than CLEAR_SKEW_NS, five minutes): a page another
    node put seconds after the clear, by its clock, may have been put before it, of the old weights. So
    a clear a tier missed takes those too, and the other node's pages put later than that stay (the test
    above): a stale page is never served, a cached page may be lost (from the review of the owed clear
    on GlusterFS: a node whose clock ran 5 s or 2 min ahead had its pages of before the clear served)."""
    dirs = tier_dirs[:2]
    pages = PageSet()
    stale, close_after = pages.keys(3), pages.keys(2, 3)
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, stale) == [True] * 3
        os.rename(dirs[1], dirs[1] + ".away")
        engine.clear()
        _put_by_another_node(dirs[1] + ".away", pages, close_after)
        os.rename(dirs[1] + ".away", dirs[1])
        _until_back(engine, 1, lambda: pages.checked_get(engine, stale[:1]))
        assert pages.checked_get(engine, stale + close_after) == [False] * 5 and page_files(dirs[1]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")
def test_an_owed_clear_rejoins_past_a_file_it_cannot_read(tier_root, tier_dirs):
    """The engine runs as a user of its own (a uid no account has, as root can); tier 1 misses a clear
    and the process ends. Between the two starts root leaves a 0600 file under a page name in tier 1's
    shard (an operator's copy with umask 077, a kvstream run once with sudo), modified after the clear.
    The owed clear cannot read its header: it leaves it (it is never served: it cannot be read) and the
    tier rejoins. Before, the look failed the tier at every probe, and it never rejoined (from the review
    of this stop's changes: before b2e98e7 the owed clear unlinked by name without reading)."""
    from kvstream_hicache.layout import TierLayout

    dirs, uid = tier_dirs[:2], 54331
    for root, names, files in os.walk(tier_root):
        for name in names + files:
            os.lchown(os.path.join(root, name), uid, uid)
    os.lchown(tier_root, uid, uid)
    pages = PageSet()
    stale = pages.keys(3)

    def first_run():  # pages on both tiers; tier 1's directory away at a clear()
        with make_engine(dirs, tier_retry=1.0) as engine:
            assert pages.put(engine, stale) == [True] * 3
            os.rename(dirs[1], dirs[1] + ".away")
            engine.clear()
            assert engine.tiers[1].clear_owed

    as_user(uid, first_run)
    os.rename(dirs[1] + ".away", dirs[1])
    planted = TierLayout(dirs[1], NS.digest).page_path(pages.keys(1, 50)[0])
    if not os.path.isdir(os.path.dirname(planted)):  # (a shard directory of the engine's user)
        os.makedirs(os.path.dirname(planted))
        os.lchown(os.path.dirname(planted), uid, uid)
    with open(planted, "wb") as f:
        f.write(b"\0" * 8192)
    os.chmod(planted, 0o600)
    later = time.time() + 3600  # (modified an hour after the clear)
    os.utime(planted, (later, later))

    def second_run():  # tier 1 owes the clear (the record on tier 0): it removes the stale pages, rejoins
        with make_engine(dirs, tier_retry=1.0) as engine:
            assert not engine.tiers[1].healthy
            _until_back(engine, 1, lambda: pages.checked_get(engine, stale) == [False] * 3)
            assert pages.checked_get(engine, stale) == [False] * 3

    as_user(uid, second_run)
    assert os.path.exists(planted)


def test_a_record_of_clears_owed_of_stop_43_clears_every_page(tier_dirs):
    """A record written by the version before this one (stop 43: the JSON list of the tiers' paths, no
    time) still has its tier cleared at the next start: every page of the namespace there goes (the time
    of the clear is not known), none is served."""
    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(3)
    record = _cleared_while_tier_1_is_away(dirs, pages, keys)
    os.rename(dirs[1] + ".away", dirs[1])
    _put_by_another_node(dirs[1], pages, pages.keys(2, 3))
    with open(record, "w") as f:
        f.write(json.dumps([os.path.realpath(dirs[1])]))
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert not engine.tiers[1].healthy
        _until_back(engine, 1, lambda: pages.checked_get(engine, keys[:1]))
        assert pages.checked_get(engine, keys) == [False] * 3 and page_files(dirs[1]) == []
        assert not os.path.exists(record)


def test_a_record_of_clears_owed_as_b2e98e7_wrote_it_is_honoured(tier_dirs, caplog):
    """b2e98e7 and 6af416a wrote the record as a JSON object, ``{"clears_owed": {real path: time}}`` (a094a1f
    went back to stop 43's list). A node upgraded from one of them, whose tier 1 owed a clear (a weight
    update's, while it was away), logged the record as "not kvstream's" and ignored it: tier 1's stale pages
    were served (trial upgrade, with b2e98e7's own engine). It is read as the list is: none is served."""
    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(3)
    record = _cleared_while_tier_1_is_away(dirs, pages, keys)
    os.rename(dirs[1] + ".away", dirs[1])
    with open(record) as f:
        when = {r[1:].partition(":")[2]: int(r[1:].partition(":")[0]) for r in json.load(f) if r.startswith("@")}
    with open(record, "w") as f:
        json.dump({"clears_owed": when}, f, sort_keys=True)  # (b2e98e7's owed.py: json.dumps({KEY: owed}))
    caplog.set_level(logging.WARNING, logger="kvstream")
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert not engine.tiers[1].healthy
        _until_back(engine, 1, lambda: pages.checked_get(engine, keys[:1]))
        assert pages.checked_get(engine, keys) == [False] * 3 and page_files(dirs[1]) == []
    assert messages(caplog, "not kvstream's") == []


@pytest.mark.parametrize("owing", ["network", "local"])
def test_a_clear_owed_is_recorded_on_a_local_tier_only(tier_dirs, fuse_tier, caplog, owing):
    """A local tier and a network one (FUSE: bindfs). The network tier away at a clear(): the local tier
    records the clear owed, and the next start clears the network tier before it serves. The local
    tier away: the network tier holds no record (other nodes read it, and their local tiers may have
    our paths): the debt stays in memory, and the log says a restart would forget it."""
    local, network = tier_dirs[0], fuse_tier[0]
    dirs = [local, network]
    away = dirs[0 if owing == "local" else 1]
    pages = PageSet()
    keys = pages.keys(3)
    caplog.set_level(logging.WARNING, logger="kvstream")
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert not engine.tiers[1].local
        assert pages.put(engine, keys) == [True] * 3
        os.rename(away, away + ".away")
        engine.clear()
        records = [os.path.join(t.layout.base, engine.namespace.digest + ".clears-owed") for t in engine.tiers]
    os.rename(away + ".away", away)
    if owing == "local":
        assert not any(map(os.path.lexists, records))
        assert "a restart before they rejoin forgets it" in caplog.text
        return
    assert os.path.isfile(records[0]) and not os.path.lexists(records[1])
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        _rejoins_serving_none(engine, pages, keys)
        assert page_files(network) == [] and not os.path.lexists(records[0])


@pytest.mark.parametrize("record", ["link", "garbage", "fifo"])
def test_a_record_of_clears_owed_that_is_not_kvstreams_is_ignored(tier_dirs, tmp_path, caplog, record):
    """What has the name of the record of clears owed but is no file kvstream wrote there (a link to a
    list naming tier 1, text that is no list of tiers, a FIFO that would block a plain open) clears
    nothing: it is logged and ignored, the start goes on and tier 1's pages are served."""
    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine(dirs) as engine:
        assert pages.put(engine, keys) == [True] * 2
        path = os.path.join(engine.tiers[0].layout.base, engine.namespace.digest + ".clears-owed")
    if record == "link":
        target = tmp_path / "list"
        target.write_text(json.dumps([dirs[0], dirs[1]]))
        os.symlink(target, path)
    elif record == "garbage":
        with open(path, "w") as f:
            f.write('{"tier": 1}')
    else:
        os.mkfifo(path)
    caplog.set_level(logging.WARNING, logger="kvstream")
    with make_engine(dirs) as engine:
        assert [t.healthy for t in engine.tiers] == [True, True]
        assert pages.checked_get(engine, keys) == [True] * 2
        assert [engine.index.holders(k) for k in keys] == [0b11] * 2
    assert "clears owed" in caplog.text


def _settle_threads(k: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"kvstream-settle-{k}"]


def _owing_a_clear(engine, dirs, pages, keys):
    """``keys`` on both tiers; tier 1's directory away at a clear(), then back: tier 1 owes the clear."""
    tier = engine.tiers[1]
    assert pages.put(engine, keys) == [True] * len(keys)
    os.rename(dirs[1], dirs[1] + ".away")
    assert tier.fail(errno.EIO, "test: an I/O error")
    engine.clear()
    assert not tier.healthy and tier.clear_owed
    os.rename(dirs[1] + ".away", dirs[1])


def _hold_unlinks(tier):
    """The settle thread waits for ``release`` after its first removal (as the suite's own clear test
    holds them)."""
    removing, release = threading.Event(), threading.Event()
    unlink = tier._remove

    def held_unlink(path, judged=None):  # (the first removal done, the thread waits)
        out = unlink(path, judged)
        if not removing.is_set():
            removing.set()
            release.wait(60)
        return out

    tier._remove = held_unlink
    return removing, release


def test_a_settle_that_ends_while_a_get_probes_still_lets_the_tier_rejoin(tier_dirs):
    """The settle thread ends while a get's scheduled probe of the tier is in flight (it read 'still
    settling' just before): the settle thread's own usable() finds that probe running and returns, and
    that probe then reschedules the next one a whole back-off away, overwriting the 'probe now' the settle
    thread set. The tier, its debt paid, stays out (with no traffic: until the back-off expires, up to
    300 s, its catch-up with it). Now that probe, finding the settle done meanwhile, probes again and
    the tier rejoins. From the review of this stop's latest changes."""
    dirs = tier_dirs[:2]
    clock, pages = FakeClock(), PageSet()
    keys = pages.keys(3)
    with make_engine(dirs, clock=clock, tier_retry=RETRY_S) as engine:
        tier = engine.tiers[1]
        _owing_a_clear(engine, dirs, pages, keys)
        removing, release = _hold_unlinks(tier)
        clock.advance(RETRY_S * 4)
        assert not tier.usable()  # a scheduled probe finds it back: the settle thread starts
        assert removing.wait(30), "the settle thread never removed the pages cleared"

        # a get's scheduled probe (the back-off expired during a long settle) is in flight as the settle ends
        clock.advance(RETRY_S * 100)
        probe = tier._probe
        probed, go = threading.Event(), threading.Event()

        def held_probe():
            out = probe()
            if threading.current_thread().name == "get-probe":
                probed.set()
                go.wait(60)
            return out

        tier._probe = held_probe
        getter = threading.Thread(target=tier.usable, name="get-probe")
        getter.start()
        assert probed.wait(30)
        release.set()  # the settle thread removes the pages and ends
        wait_until(lambda: not _settle_threads(1), 30, "the settle thread did not end")
        assert not tier.clear_owed and page_files(dirs[1]) == []
        go.set()
        getter.join(30)
        del tier._probe

        # its debt paid, the tier rejoins with no call coming (an idle server), and at the next get at the latest
        try:
            wait_until(lambda: tier.healthy, 5, "")
        except AssertionError:
            pass
        assert pages.checked_get(engine, keys) == [False] * 3
        assert tier.healthy, ("tier 1 removed what it owed but stays out: the next probe was rescheduled "
                              f"a back-off away ({tier._next_probe - clock():.0f} s of the injected clock): "
                              f"{tier.last_error}")


def test_an_engine_closed_while_its_tier_settles_removes_no_page_of_the_next_engine(tier_dirs):
    """SGLang's /detach_hicache_storage_backend then attach (or any close() and a new Engine in the same
    process) while a tier removes the pages of a clear() it owed (400k page files: 35 s). close() returns
    with the settle thread still running; the next engine reads the record, clears the tier itself, lets
    it rejoin and stores pages there again; the closed engine's settle thread then goes on removing every
    page file it lists: the new engine's pages. Its index says tier 1 holds them; the files are gone
    (a cached page lost, the index wrong). Now close() stops it: it removes nothing more, nor lets the
    tier rejoin. From the review of this stop's latest changes."""
    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(3)
    clock = FakeClock()
    engine = make_engine(dirs, clock=clock, tier_retry=RETRY_S)
    try:
        tier = engine.tiers[1]
        _owing_a_clear(engine, dirs, pages, keys)
        removing, release = _hold_unlinks(tier)
        clock.advance(RETRY_S * 4)
        assert not tier.usable()  # the settle thread starts (held at its first removal)
        assert removing.wait(30)
    finally:
        engine.close()
    try:
        with make_engine(dirs, tier_retry=RETRY_S) as successor:
            assert pages.checked_get(successor, keys) == [False] * 3  # (its tier 1 owes the clear: a settle)
            wait_until(lambda: successor.tiers[1].healthy, 30, "the next engine's tier 1 never rejoined")
            assert page_files(dirs[1]) == []  # (the pages the closed engine's thread had not removed yet)
            assert pages.put(successor, keys) == [True] * 3  # the same prefixes stored again, on both tiers
            assert [successor.index.holders(k) for k in keys] == [0b11] * 3
            assert len(page_files(dirs[1])) == 3
            release.set()  # the closed engine's settle thread goes on
            wait_until(lambda: not _settle_threads(1), 30, "the closed engine's settle thread did not end")
            left = page_files(dirs[1])
            assert len(left) == 3, (f"the closed engine's settle thread removed {3 - len(left)} page(s) the next "
                                    "engine stored on tier 1 (its index still lists them there)")
    finally:
        release.set()


def test_a_delete_that_comes_while_the_settle_thread_lets_the_tier_rejoin_does_not_leave_it_out(tier_dirs):
    """Tier 1 owes a clear (its directory was away at clear()); back, a get's probe starts the settle thread,
    which removes the pages and then probes the tier itself so that it rejoins with no call of the
    server's (503dd50). LMCache deletes as it evicts: one delete() comes while that probe's rejoin runs
    (Engine._reconcile: the record of clears owed rewritten and fsynced). The final check refuses the rejoin
    ("a delete() came while it rejoined") and, as in the case af58a78 fixed for a settle ending during a
    probe, pushes the next probe a whole (doubled) back-off away; no settle thread is started for the one
    delete owed. The tier, back and owing one page file, stays out: with no traffic, and at the next get.
    Now that probe turns again at once: it finds the delete owed, a settle removes it and the tier rejoins.
    From the review of this stop's last commits."""
    dirs = tier_dirs[:2]
    clock, pages = FakeClock(), PageSet()
    keys = pages.keys(4)
    with make_engine(dirs, clock=clock, tier_retry=RETRY_S) as engine:
        tier = engine.tiers[1]
        assert pages.put(engine, keys[:2]) == [True] * 2
        os.rename(dirs[1], dirs[1] + ".away")
        assert tier.fail(errno.EIO, "test: an I/O error")
        engine.clear()
        assert not tier.healthy and tier.clear_owed
        os.rename(dirs[1] + ".away", dirs[1])
        assert pages.put(engine, keys[2:]) == [True] * 2  # (tier 0 only: tier 1 is out)

        # the settle thread's own probe is held inside its rejoin while LMCache's thread deletes a key
        rejoin = tier.on_rejoin
        rejoining, go = threading.Event(), threading.Event()

        def held_rejoin(t):
            if threading.current_thread().name == "kvstream-settle-1":
                rejoining.set()
                go.wait(60)
            return rejoin(t)

        tier.on_rejoin = held_rejoin
        clock.advance(RETRY_S * 4)
        assert not tier.usable()  # found back: the settle thread starts (it owes the clear)
        try:
            assert rejoining.wait(30), "the settle thread never probed the tier to let it rejoin"
            assert engine.delete(keys[2:3]) == 1  # (tier 0's copy removed; tier 1, still out, owes it)
        finally:
            go.set()
        wait_until(lambda: not _settle_threads(1), 30, "the settle thread did not end")
        tier.on_rejoin = rejoin

        try:  # with no call coming (an idle server), and at the next get at the latest
            wait_until(lambda: tier.healthy, 5, "")
        except AssertionError:
            pass
        assert pages.checked_get(engine, keys[3:]) == [True]  # (tier 0 holds it: no forced probe)
        assert tier.healthy, (
            "tier 1 is back, its clear done, and owes one delete (no page of it even on tier 1), yet it stays "
            f"out: last_error {tier.last_error!r}, next probe {tier._next_probe - clock():.0f} s of the "
            "injected clock away, no settle thread running")


def test_a_clear_while_a_healthy_tiers_directory_is_away_is_owed_not_done(tier_dirs):
    """clear() while tier 1's directory is away and no I/O has noticed it yet (still healthy): nothing of it
    was reached, so the clear is owed as for a failed tier; when the directory comes back the pages
    cleared are never found nor served (before: counted done, and found again by discovery)."""
    clock, pages = FakeClock(), PageSet()
    keys = pages.keys(3)
    with make_engine(tier_dirs[:2], clock=clock, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, keys) == [True] * 3
        os.rename(tier_dirs[1], tier_dirs[1] + ".away")  # (an unmount does the same)
        assert engine.tiers[1].healthy  # nothing noticed yet
        engine.clear()
        os.rename(tier_dirs[1] + ".away", tier_dirs[1])
        clock.advance(RETRY_S * 4)
        assert pages.checked_get(engine, keys) == [False] * 3, "pages cleared are served again"
        assert not any(engine.contains(k) for k in keys)


def test_a_delete_while_a_healthy_tiers_directory_is_away_is_owed_not_done(tier_dirs):
    """delete() while tier 1's directory is away and no I/O has noticed it yet (still healthy): the
    removal reached nothing there (trust.remove answers "already gone" for a directory not found), so
    the tier fails and owes the delete, as for the clear() of this case; when the directory is back the
    deleted page is never found nor served. Before, the delete counted done, the tier stayed healthy,
    and discovery found the page and served it (from the review of this stop's docs)."""
    clock, pages = FakeClock(), PageSet()
    keys = pages.keys(2)
    with make_engine(tier_dirs[:2], clock=clock, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, keys) == [True] * 2
        os.rename(tier_dirs[1], tier_dirs[1] + ".away")
        assert engine.tiers[1].healthy  # nothing noticed yet
        assert engine.delete(keys[:1]) == 1
        assert not engine.tiers[1].healthy
        os.rename(tier_dirs[1] + ".away", tier_dirs[1])

        def never_found() -> None:
            clock.advance(RETRY_S * 4)  # (past any back-off)
            assert not engine.contains(keys[0]), "a page deleted while its tier's directory was away is found"
            assert pages.checked_get(engine, keys[:1]) == [False], "... and served"

        _until_back(engine, 1, never_found)
        never_found()
        assert pages.checked_get(engine, keys[1:]) == [True]


def test_a_page_tree_emptied_under_a_healthy_tier_is_made_again(tier_dirs, caplog):
    """Everything under ``<tier>/kvstream`` is deleted while the engine serves (``rm -rf
    <tier>/kvstream/*``: an operator, a cleaner), ``kvstream/`` itself left: the tier is not gone,
    and its next puts make the namespace and shard directories again and store their pages (found by
    a real sglang server with kvstream as L3: before, the namespace directory stayed in the tier's
    cache of directories made, every commit's shard mkdir failed with ENOENT, the tier stayed healthy
    and stored nothing until a restart, a warning per page)."""
    caplog.set_level(logging.WARNING, logger="kvstream")
    pages = PageSet()
    old, new = pages.keys(2), pages.keys(4, 2)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, old) == [True, True]
        base = os.path.join(tier_dirs[0], "kvstream")
        for name in os.listdir(base):
            shutil.rmtree(os.path.join(base, name))
        assert pages.checked_get(engine, old) == [False, False]  # (gone: forgotten by the read)
        assert pages.put(engine, new) == [True] * 4
        assert len(page_files(tier_dirs[0])) == 4
        assert pages.checked_get(engine, new) == [True] * 4
        assert engine.stats()["tiers"][0]["healthy"]
        assert not [m for m in messages(caplog) if "failed" in m]


def test_forced_probes_during_a_short_outage_do_not_push_the_back_off_to_its_maximum(tier_root, loop_fs):
    """guarantees.md: after ``tier_retry`` s (5 s, doubling up to 300 s while the tier stays broken) the
    next call probes a failed tier; a read whose page has no other holder probes it then and there, at
    most every 0.5 s. The tier's file system is read-only for 4 s (fake clock) while gets of its page
    miss, each forcing a probe that fails. The file system is writable again; 30 s later (six times
    tier_retry, past every scheduled probe of a 4 s outage) the tier is back: a forced probe that fails
    leaves the schedule alone (before: each doubled the back-off, 5 s -> 300 s, and the tier stayed out
    five minutes; found by the review of two GlusterFS nodes under load, where a 14 s brick stop kept
    the shared tier out for the rest of the run)."""
    fs = loop_fs(32 << 20)
    tier = os.path.join(fs.mnt, "t")
    os.makedirs(tier)
    clock = FakeClock()
    pages = PageSet()
    p, q, r = pages.keys(3)
    engine = make_engine([tier], clock=clock)
    try:
        assert pages.put(engine, [p]) == [True]
        fs.remount("ro")
        pages.put(engine, [q])  # the create fails (EROFS): the tier fails
        assert not engine.tiers[0].healthy
        for _ in range(8):  # 4 s of outage, a get every 0.5 s: each misses and forces a probe
            clock.advance(0.5)
            assert pages.checked_get(engine, [p]) == [False]
        fs.remount("rw")
        clock.advance(30.0)
        assert pages.put(engine, [r]) == [True], (
            f"tier still out 30 s after a 4 s outage: next probe in "
            f"{engine.tiers[0]._next_probe - clock():.0f} s (back-off {engine.tiers[0]._backoff:.0f} s)")
        assert pages.checked_get(engine, [p]) == [True]
    finally:
        engine.close()


def test_a_page_deleted_while_its_tier_is_read_only_is_not_served_again_after_the_tier_rejoins(loop_fs, tier_root):
    """delete() removes "every copy off the index and the tiers" (docs/design.md, Engine.delete; LMCache's
    delete: "removes every tier's copy"). Tier 0 is remounted read-only (a file system that went
    read-only after an error, as ext4's errors=remount-ro does): the delete's unlink there fails (EROFS),
    the tier fails, the key leaves the index but its file stays. Once the file system is writable again
    and the tier rejoins, the delete it missed is done before it serves (Tier.owe_delete, as a clear() it
    missed). Before, the next lookup discovered the file and the deleted page was found and served
    again (found by the review's randomized stress of local tiers under faults)."""
    fs = loop_fs(16 << 20, "ro")
    other = os.path.join(tier_root, "disk")
    os.makedirs(other)
    tier0 = os.path.join(fs.mnt, "tier")
    os.mkdir(tier0, 0o700)
    pages = PageSet(64 << 10, salt="deleted")
    k = pages.keys(1)
    clock = FakeClock()
    with make_engine([tier0, other], clock=clock, replicate="all") as engine:
        assert pages.put(engine, k) == [True] and engine.index.holders(k[0]) == 0b11
        fs.remount("ro")
        try:
            assert engine.delete(k) == 1  # never raises: tier 0 fails (EROFS), tier 1's copy goes
        finally:
            fs.remount("rw")
        clock.advance(1000)  # past the back-off: the next call finds the tier back, which does the delete first
        _until_back(engine, 0, lambda: engine.prefix_len(k) == 0 or pytest.fail("a deleted page is found again"))
        assert engine.prefix_len(k) == 0, "a deleted page is found again by prefix_len"
        assert pages.checked_get(engine, k) == [False], "a deleted page is served again"
        assert engine.check() == []


def test_an_owed_delete_never_removes_a_page_another_process_put_after_the_delete(tier_dirs):
    """guarantees.md 7: "Every page a process's put acknowledged stays findable by every process sharing
    the tier that holds it, until it is evicted". Process A's view of the shared tier fails (a client
    disconnected: EIO/ENOTCONN there); A deletes key K (the shared tier owes the delete: Tier.owe_delete).
    Process B then puts K again on the shared tier, acknowledged. When A's tier rejoins, the owed delete
    removes only a copy written before it (its header's time): B's page stays (before: the owed delete
    removed whatever the name held, B's acknowledged page, a miss in B which lists it; found by the
    review of this stop's later changes)."""
    local, shared = tier_dirs[0], tier_dirs[1]
    pages = PageSet(64 << 10, salt="owed-shared")
    k = pages.keys(1)
    other = pages.keys(1, start=1)
    clock = FakeClock()
    with make_engine([local, shared], clock=clock, replicate="all") as engine_a:
        assert pages.put(engine_a, k) == [True]
        assert engine_a.index.holders(k[0]) == 0b11
        assert engine_a.tiers[1].fail(errno.EIO, "the shared tier's client lost its server (test)")
        assert engine_a.delete(k) == 1  # the shared tier, failed: owes the delete
        with make_engine([shared], discover=False) as engine_b:
            assert pages.put(engine_b, k) == [True]  # acknowledged, after A's delete
            assert pages.checked_get(engine_b, k) == [True]
            clock.advance(1000)  # A's tier is due: the next call probes it, it rejoins
            _until_back(engine_a, 1, lambda: engine_a.prefix_len(other))  # (SGLang's hit query: probes the tier)
            assert pages.checked_get(engine_b, k) == [True], (
                "a page another process put after the delete was removed by the delete A's tier owed")
            assert engine_a.prefix_len(k) == 1  # and A finds B's page too (discovery indexes it)


@pytest.mark.parametrize("written", ["before", pytest.param("after", marks=pytest.mark.leaves_problems(
    "the newer node's page put after the delete stays: check() reports it newer_format"))])
def test_an_owed_delete_removes_a_later_formats_page_written_well_before_it(tier_dirs, written):
    """docs/design.md "On-disk format": a delete() of a key removes a later format's page (a newer kvstream's,
    on a tier shared during a rolling upgrade) as it removes this version's, and one a failed tier owes only one
    modified well before the delete (its write time is in a header this version cannot read). The shared tier's
    copy of K is replaced by a newer node's (format version 2), written an hour before A's delete, which A's
    failed tier owes: once it rejoins, that page must go, or the newer node serves the deleted key. Before, the
    owed delete read its header, could not, and left it. One written after the delete stays (trial upgrade)."""
    local, shared = tier_dirs[0], tier_dirs[1]
    pages = PageSet(64 << 10, salt="owed-newer")
    k, other = pages.keys(1), pages.keys(1, start=1)
    clock = FakeClock()
    with make_engine([local, shared], clock=clock, replicate="all") as engine:
        assert pages.put(engine, k) == [True] and engine.index.holders(k[0]) == 0b11
        path = engine.tiers[1].layout.page_path(k[0])
        os.rename(shared, shared + ".away")  # (the shared tier away: the delete finds it gone, and owes it)
        assert engine.delete(k) == 1 and not engine.tiers[1].healthy
        away = shared + ".away" + path[len(shared):]
        set_header_field(away, VERSION_OFF, 2)  # (the newer node's page, under the name)
        stamp = time.time() + (-3600 if written == "before" else 60)  # (an hour before the delete, or after it)
        os.utime(away, (stamp, stamp))
        os.rename(shared + ".away", shared)
        clock.advance(1000)  # the shared tier is due: the next call probes it, it rejoins
        _until_back(engine, 1, lambda: engine.prefix_len(other))
        assert os.path.exists(path) == (written == "after"), (
            f"a later format's page written {written} the delete: exists={os.path.exists(path)}")


@pytest.mark.leaves_problems("A's index never listed the page B put on the shared tier")
@pytest.mark.parametrize("failed", [True, False])
def test_an_eviction_a_failed_tier_owes_never_removes_another_process_s_page_under_the_name(tier_dirs, failed):
    """Engine.evict (LMCache's L2 eviction, through the adapter's delete) removes a tier's file "only while it
    is this process's copy": another process's page written under the name since stays. Process A puts K on
    both tiers; process B, sharing tier 1, deletes K and puts it again (its own page, acknowledged); A's view
    of tier 1 then fails and A evicts K: the failed tier owes the removal. When it rejoins, B's page must
    stay, as A's eviction leaves it on a healthy tier (Tier.evict_page; ``failed`` False: that case, where a
    delete, the adapter's before Engine.evict, removed it). Before, the eviction was owed as a delete, which
    removed any file written before it (Tier._remove_if_older): B's page, a miss in B, which lists it (found
    by the review of Engine.evict)."""
    local, shared = tier_dirs[0], tier_dirs[1]
    pages = PageSet(64 << 10, salt="owed-evict")
    k = pages.keys(1)
    other = pages.keys(1, start=1)
    own = pages.keys(1, start=2)  # A's alone: its copy goes when the tier rejoins
    clock = FakeClock()
    with make_engine([local, shared], clock=clock, replicate="all") as engine_a:
        assert pages.put(engine_a, k) == [True]
        assert engine_a.index.holders(k[0]) == 0b11
        with make_engine([shared], discover=False) as engine_b:
            assert pages.put(engine_a, own) == [True] and engine_a.index.holders(own[0]) == 0b11
            engine_b.delete(k)  # (A's file, found by B's start-up scan or not)
            assert pages.put(engine_b, k) == [True]  # B's own page under the name, acknowledged
            assert not failed or engine_a.tiers[1].fail(errno.EIO, "the shared tier's client lost its server (test)")
            assert engine_a.evict(k + own) == 2  # the shared tier, failed: owes the evictions
            clock.advance(1000)  # A's tier is due: the next call probes it, it rejoins
            _until_back(engine_a, 1, lambda: engine_a.prefix_len(other))
            assert pages.checked_get(engine_b, k) == [True], (
                "the eviction A's failed tier owed removed the page B put under the name")
            assert not os.path.exists(engine_a.tiers[1].layout.page_path(own[0])), "A's own copy stayed"


def _plant_socket(path: str) -> None:
    os.mknod(path, stat.S_IFSOCK | 0o600)  # (what bind() leaves: a socket inode; open() answers ENXIO)


def test_a_socket_under_a_page_name_whose_delete_is_owed_never_keeps_the_tier_out(tier_dirs):
    """guarantees.md (Hostile files): "A FIFO, socket or device under a page's name ... reads, start-up
    and check see a stray, remove it ..., and keep the tier healthy". Tier 1 fails; key K is deleted
    (the delete is owed there); a socket has K's page name on tier 1 (planted, or left by anything). When
    the tier rejoins, the owed delete opens the name to read its header (integrity.read_header): opening
    a socket answers ENXIO, which open_regular now tells apart as the entry's (a stray: removed, as the
    delete would); before, ENXIO reached Tier._deletes_owed as a tier errno, which failed the tier at
    every probe, for good (found by the review of this stop's last changes)."""
    pages = PageSet(64 << 10, salt="owed-socket")
    k = pages.keys(1)
    other = pages.keys(1, start=1)
    clock = FakeClock()
    with make_engine(tier_dirs[:2], clock=clock, replicate="all", catchup="off") as engine:
        assert pages.put(engine, k) == [True] and engine.index.holders(k[0]) == 0b11
        assert engine.tiers[1].fail(errno.EIO, "the tier's client lost its server (test)")
        assert engine.delete(k) == 1  # tier 1, failed: owes the delete
        path = engine.tiers[1].layout.page_path(k[0])
        if os.path.lexists(path):  # (the delete removed it: the tier answered, only marked failed)
            os.unlink(path)
        _plant_socket(path)  # a socket under the page's name
        try:
            clock.advance(1000)  # past every back-off: the next call probes the tier
            # (its owed delete runs on a thread of its own: waited for, not counted in calls; the landing
            # CI of stop 48 found three calls too few under load)
            _until_back(engine, 1, lambda: engine.prefix_len(other))
        finally:
            if os.path.lexists(path):
                os.unlink(path)


class _Shifted:
    """trust.py's ``time``: the wall clock ``by`` seconds off (time_ns: what trust.wall_ns reads for header
    stamps and the times of owed deletes); everything else as the time module."""

    def __init__(self, by: float):
        self.by = by

    def __getattr__(self, name):
        return getattr(time, name)

    def time_ns(self) -> int:
        return time.time_ns() + int(self.by * 10**9)


def test_the_deletes_a_failed_tier_owes_are_bounded(tier_dirs, monkeypatch, caplog):
    """Tier 1 away (its directory moved: its copies stay) while more keys are deleted than a failed tier
    remembers (tiers.MAX_OWED_DELETES, 4 here; LMCache deletes as it evicts, for as long as an outage
    lasts): the oldest deletes are forgotten, logged once, and the memory stays bounded; once back, the
    tier does the deletes it remembers before it serves, and a page whose delete was forgotten, if found
    again, is a valid page of its key. Before, one entry per key deleted for as long as the outage (and a
    header read each before the tier served again). Found by the review of resources over a long life."""
    monkeypatch.setattr(tiers_module, "MAX_OWED_DELETES", 4)
    caplog.set_level(logging.WARNING, logger="kvstream")
    pages = PageSet()
    keys = pages.keys(8)
    clock = FakeClock()
    with make_engine(tier_dirs[:2], clock=clock, tier_retry=RETRY_S, catchup="off") as engine:
        tier = engine.tiers[1]
        assert pages.put(engine, keys) == [True] * 8
        os.rename(tier_dirs[1], tier_dirs[1] + ".away")
        assert tier.fail(errno.EIO, "the tier's server is away (test)")
        for key in keys:
            assert engine.delete([key]) == 1
        assert list(tier._deletes) == keys[4:]
        assert caplog.text.count("has missed over 4 delete()s") == 1
        os.rename(tier_dirs[1] + ".away", tier_dirs[1])
        clock.advance(1000)
        wait_until(lambda: engine.get([], []) == [] and tier.healthy, what="tier 1 never rejoined")
        assert not tier._deletes
        assert not any(os.path.exists(tier.layout.page_path(key)) for key in keys[4:])
        assert pages.checked_get(engine, keys[4:]) == [False] * 4
        pages.checked_get(engine, keys[:4])  # (found again or not: never a wrong byte)


def _owe_the_delete_and_rejoin(engine, k: list[str], clock: FakeClock) -> None:
    """Tier 1 fails; ``k`` is deleted (owed there, its copy left as a failed tier keeps it); the tier
    rejoins, the delete done first."""
    path = engine.tiers[1].layout.page_path(k[0])
    with open(path, "rb") as f:
        saved = f.read()
    assert engine.tiers[1].fail(errno.EIO, "the tier's client lost its server (test)")
    assert engine.delete(k) == 1  # tier 1, failed: owes the delete
    if not os.path.exists(path):  # (the tier answered the unlink: its copy, as a failed tier keeps it)
        with open(path, "wb") as f:
            f.write(saved)
    clock.advance(1000)  # past the back-off: the tier rejoins once it has done the delete it owes
    _until_back(engine, 1, lambda: engine.get([], []))


def test_an_owed_delete_removes_a_page_whose_header_claims_a_time_in_the_future(tier_dirs, monkeypatch):
    """delete() removes every copy (Engine.delete: a failed tier's copy goes before the tier serves
    again), and a header's ``created`` more than CLOCK_SKEW_NS ahead is "a claim, not a time"
    (trust.age_key/honest_until; design.md: "a created more than 5 minutes in the future never wins").
    K is put with a header stamped a day ahead, as a process whose host clock was a day ahead (since
    stepped back) stamps it: another process, or this one before a restart (this process's own clock,
    trust.wall_ns, never goes back, so the test forgets the times it answered); tier 1 fails; K is
    deleted (owed there); the tier rejoins. The owed delete compares the header's claim with
    the delete's time and takes a claim beyond honest_until for no time: the page goes (before: it was
    kept, and the deleted page was found and served again; found by the review of this stop's last
    changes)."""
    pages = PageSet(64 << 10, salt="owed-future")
    k = pages.keys(1)
    clock = FakeClock()
    with make_engine(tier_dirs[:2], clock=clock, replicate="all", catchup="off") as engine:
        monkeypatch.setattr(trust, "_wall_last", trust._wall_last)
        monkeypatch.setattr(trust, "time", _Shifted(86400.0))
        assert pages.put(engine, k) == [True] and engine.index.holders(k[0]) == 0b11
        monkeypatch.undo()  # the clock is stepped back, the times of the day ahead forgotten
        _owe_the_delete_and_rejoin(engine, k, clock)
        assert engine.prefix_len(k) == 0, "a deleted page is found again (its header claims a future time)"


def test_an_owed_delete_is_done_after_the_wall_clock_was_stepped_back_a_minute(tier_dirs, monkeypatch):
    """design.md (tier rejoins): the keys of a delete() a failed tier missed go before it serves, "only a
    page written before the delete". One process, one host, no other writer: K is put, then NTP steps
    the host's clock back by 60 s (less than CLOCK_SKEW_NS, so the header's time is taken as a time),
    tier 1 fails, K is deleted (owed there), the tier rejoins. The page was written before the delete,
    by this very engine: it goes, since the header's stamp and the delete's time come from one wall
    clock of the process that never goes back (trust.wall_ns). Before, both read time.time_ns(): the
    owed delete found the page "newer" than the delete and kept it, and the deleted page was found and
    served again (found by the review of time and clocks)."""
    pages = PageSet(64 << 10, salt="owed-stepped-back")
    k = pages.keys(1)
    clock = FakeClock()
    monkeypatch.setattr(trust, "_wall_last", trust._wall_last)  # (the times answered here forgotten at the end)
    with make_engine(tier_dirs[:2], clock=clock, replicate="all", catchup="off") as engine:
        with monkeypatch.context() as before_the_step:
            before_the_step.setattr(trust, "time", _Shifted(60.0))  # the clock as it was before the step back
            assert pages.put(engine, k) == [True] and engine.index.holders(k[0]) == 0b11
        _owe_the_delete_and_rejoin(engine, k, clock)  # NTP stepped the clock back 60 s
        assert engine.prefix_len(k) == 0, (
            "a page deleted by this engine is found again after its tier rejoined: the wall clock was "
            "stepped back 60 s between its put and the delete, and the owed delete kept it as 'newer'")
        assert pages.checked_get(engine, k) == [False]


def test_temporary_files_a_failed_tier_kept_are_removed_when_it_rejoins(tier_dirs, monkeypatch):
    """A FUSE client killed mid-put (MooseFS's mfsmount, trial moosefs): the commits on tier 1 fail with
    ENOTCONN, and so does the removal of their temporary files. Before, they stayed in the shared tier's
    tmp/ after it was mounted again and rejoined, and after close(), until the next start (27 of 32 seen;
    another node's scan takes a live host's only after an hour). The tier removes them before it rejoins."""
    clock = FakeClock()
    pages = PageSet()
    dead = os.path.join(tier_dirs[1], "")
    real_remove = tiers_module.remove

    def remove(root, path, *args, **kwargs):
        if path.startswith(dead):
            raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), path)
        return real_remove(root, path, *args, **kwargs)

    def tmp_files() -> list[str]:
        return [f for f in os.listdir(os.path.join(tier_dirs[1], "kvstream", "tmp")) if f.endswith(TMP_SUFFIX)]

    # (catchup off: its copies of the pages tier 1 missed, written once it rejoins, pass through tmp/ too)
    with make_engine(tier_dirs[:2], replicate="all", tier_retry=RETRY_S, clock=clock, catchup="off") as engine:
        _close_fails_on(monkeypatch, tiers_module, tier_dirs[1], errno.ENOTCONN)
        monkeypatch.setattr(tiers_module, "remove", remove)
        assert pages.put(engine, pages.keys(4)) == [True] * 4
        assert not engine.stats()["tiers"][1]["healthy"]
        assert tmp_files(), "no temporary file was kept by the failed tier (the test's premise)"
        monkeypatch.undo()  # (mounted again)
        clock.advance(RETRY_S + 1)
        assert pages.put(engine, pages.keys(2, start=4)) == [True] * 2  # (its probe finds it back)
        assert engine.stats()["tiers"][1]["healthy"]
        assert tmp_files() == []
        assert pages.checked_get(engine, pages.keys(6)) == [True] * 6
