"""Engine integration tests on real files with O_DIRECT, over io_uring and the thread engine.

Pages are given as ``(address, nbytes)`` segments of numpy arrays: aligned (AlignedBuffer-backed,
the zero-copy write path) and unaligned (odd addresses and lengths, the staging path; blocks
straddle segments). Every test that leaves a store ends with ``check()`` finding no problem.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time

import numpy as np
import pytest

from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.tmpfiles import tmp_name

from helpers import ARRAY_NS as NS, Pages, key, make_array_engine as make_engine, segments_of

# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tiers", [1, 2, 3])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_round_trip(tier_dirs, io_engine, n_tiers, aligned):
    pages = Pages(10, aligned=aligned)
    keys = [key(i) for i in range(10)]
    with make_engine(tier_dirs[:n_tiers], io_engine) as engine:
        assert engine.put(keys, pages.src_segments) == [True] * 10
        assert engine.prefix_len(keys) == 10 and all(engine.contains(k) for k in keys)
        assert engine.get(keys, pages.dst_segments) == [True] * 10
        assert all(pages.equal(i) for i in range(10))
        stats = engine.stats()
        assert stats["under_replicated"] == 0
        assert [t["pages_written"] for t in stats["tiers"]] == [10] * n_tiers
        assert sum(t["bytes_served"] for t in stats["tiers"]) == 10 * sum(pages.shapes[0])
        batch = engine.last_batch
        assert batch["found"] == 10 and batch["bytes"] == 10 * sum(pages.shapes[0]) and batch["bound_s"] > 0
        assert engine.check() == []
    for d in tier_dirs[:n_tiers]:  # every tier holds a full copy
        assert len(_page_files(d)) == 10


@pytest.mark.parametrize("policy", ["kvstream:m=1", "static-0.5", "tier1", "kvstream:m=4,depth=8"])
def test_policies_round_trip(tier_dirs, policy):
    from kvstream_hicache.router import parse_policy

    pages = Pages(6, aligned=False)
    keys = [key(i) for i in range(6)]
    with make_engine(tier_dirs[:2]) as engine:
        engine.put(keys, pages.src_segments)
        assert engine.get(keys, pages.dst_segments, policy=parse_policy(policy)) == [True] * 6
        assert all(pages.equal(i) for i in range(6))
        if policy == "tier1":
            assert engine.last_batch["tiers"][0]["bytes"] == 0


def test_large_page_gets_larger_blocks(tier_dirs):
    big = Pages(1, aligned=True, size=8 << 20)
    with make_engine(tier_dirs[:2], chunk=4096) as engine:  # 2048 blocks of 4 KiB would not fit a header
        assert engine.put([key(0)], big.src_segments) == [True]
        assert engine.index.get(key(0)).block > 4096
        assert engine.get([key(0)], big.dst_segments) == [True] and big.equal(0)


# -- replicas and misses -----------------------------------------------------------------------
def test_page_deleted_from_one_tier_is_read_from_another(tier_dirs, io_engine):
    pages = Pages(6)
    keys = [key(i) for i in range(6)]
    with make_engine(tier_dirs[:2], io_engine) as engine:
        engine.put(keys, pages.src_segments)
        for k in keys[:3]:  # behind the engine's back (an operator, another rank's clear)
            os.unlink(engine.tiers[0].layout.page_path(k))
        assert engine.get(keys, pages.dst_segments) == [True] * 6
        assert all(pages.equal(i) for i in range(6))
        from kvstream_hicache.router import SingleTier

        assert engine.get(keys, pages.dst_segments, policy=SingleTier(0)) == [True] * 6
        assert all(engine.index.holders(k) & 0b10 for k in keys[:3])  # served by tier 1, tier 0's copy forgotten
        # and written to tier 0 again from the read's own memory (background replication, promotion)
        deadline = time.monotonic() + 60
        while not all(engine.index.holders(k) == 0b11 for k in keys[:3]):
            assert time.monotonic() < deadline, "the deleted copies were never written again"
            time.sleep(0.005)
        assert all(os.path.exists(engine.tiers[0].layout.page_path(k)) for k in keys[:3])
        assert engine.stats()["tiers"][0]["healthy"]
        assert engine.check() == []


def test_page_evicted_from_fast_tier_is_read_from_slow(tier_dirs, io_engine):
    pages = Pages(8)
    keys = [key(i) for i in range(8)]
    page_file = sum(pages.shapes[0])  # capacity counts payload bytes (index.py)
    with make_engine(tier_dirs[:2], io_engine, capacity=[3 * page_file, ""]) as engine:
        assert engine.put(keys[:4], pages.src_segments[:4]) == [True] * 4
        assert engine.put(keys[4:], pages.src_segments[4:]) == [True] * 4
        stats = engine.stats()
        # a batch larger than the tier writes only its first pages there (its head, the most recent: reverse
        # batch order); the earlier batch's are evicted
        assert stats["tiers"][0]["pages"] == 3 and stats["tiers"][0]["evictions"] == 3
        assert stats["tiers"][0]["skipped_writes"] == 2 and stats["under_replicated"] == 0
        assert stats["tiers"][0]["used_bytes"] <= 3 * page_file
        assert [engine.index.holders(k) for k in keys] == [0b10] * 4 + [0b11] * 3 + [0b10]  # LRU: the oldest went
        assert engine.get(keys, pages.dst_segments) == [True] * 8
        assert all(pages.equal(i) for i in range(8))
        assert engine.check() == []




def test_a_put_whose_head_is_held_keeps_the_head_on_a_capacity_limited_tier(tier_dirs):
    """A prefix put again with its first pages held already on tier 0 (capacity: 4 pages) and new pages after
    them: fit_capacity counted the whole capacity as room for the new pages, so writing them evicted the held
    head, leaving tier 0 a tail that serves nothing (a prefix's leading run stops at its first missing page)."""
    pages = Pages(6)
    keys = [key(i) for i in range(6)]
    page_file = sum(pages.shapes[0])  # capacity counts payload bytes (index.py)
    with make_engine(tier_dirs[:2], capacity=[4 * page_file, ""]) as engine:
        assert engine.put(keys[:2], pages.src_segments[:2]) == [True] * 2
        assert engine.put(keys, pages.src_segments) == [True] * 6
        assert [engine.index.holders(k) & 1 for k in keys] == [1, 1, 1, 1, 0, 0], engine.stats()["tiers"][0]


def test_get_touches_lru(tier_dirs):
    pages = Pages(4)
    keys = [key(i) for i in range(4)]
    page_file = 4096 + sum(pages.shapes[0])
    with make_engine(tier_dirs[:1], capacity=3 * page_file) as engine:
        engine.put(keys[:3], pages.src_segments[:3])  # least recent first: 2, 1, 0 (PutCall.lru_order)
        engine.get(keys[2:3], pages.dst_segments[2:3])  # key 2 becomes the most recent
        engine.put(keys[3:], pages.src_segments[3:])
        assert not engine.contains(keys[1]) and engine.contains(keys[2])


def test_missing_invalid_and_mismatched_pages_are_misses(tier_dirs, io_engine):
    pages = Pages(3)
    keys = [key(i) for i in range(3)]
    with make_engine(tier_dirs[:2], io_engine) as engine:
        engine.put(keys[:2], pages.src_segments[:2])
        short = np.zeros(1000, dtype=np.uint8)
        asked = [keys[0], keys[2], "../../etc/passwd", keys[1], keys[1]]
        dst = pages.dst_segments
        segs = [dst[0], dst[2], dst[2], [(short.ctypes.data, short.nbytes)], dst[1]]
        assert engine.get(asked, segs) == [True, False, False, False, True]
        assert engine.prefix_len(asked) == 1 and not engine.contains("../x")
        stats = engine.stats()
        assert stats["invalid_keys"] == 1 and stats["size_mismatch"] == 1
        assert stats["pages_missing"] == 3


def test_invalid_keys_are_refused_on_put(tier_dirs):
    pages = Pages(3)
    with make_engine(tier_dirs[:1]) as engine:
        assert engine.put(["a/b", "..", key(0)], pages.src_segments) == [False, False, True]
        assert engine.stats()["invalid_keys"] == 2
        assert engine.check() == []


def test_other_namespace_never_sees_the_pages(tier_dirs):
    pages = Pages(2)
    keys = [key(i) for i in range(2)]
    with make_engine(tier_dirs[:2]) as engine:
        engine.put(keys, pages.src_segments)
    other = Namespace({**NS.fields, "dtype": "fp8"})
    with Engine(Config.from_sources({"tiers": tier_dirs[:2]}, environ={}), other) as engine:
        assert engine.prefix_len(keys) == 0
        assert engine.get(keys, pages.dst_segments) == [False, False]


# -- idempotence, restart ----------------------------------------------------------------------
def test_same_key_twice_is_idempotent_and_cheap(tier_dirs, io_engine):
    pages = Pages(4)
    keys = [key(i) for i in range(4)]
    with make_engine(tier_dirs[:2], io_engine) as engine:
        assert engine.put(keys[:2], pages.src_segments[:2]) == [True, True]
        written = [t["bytes_written"] for t in engine.stats()["tiers"]]
        # again, plus a key repeated inside one batch
        assert engine.put(keys + [keys[3]], pages.src_segments + pages.src_segments[3:]) == [True] * 5
        stats = engine.stats()
        assert stats["pages_existing"] == 2
        assert [t["pages_written"] for t in stats["tiers"]] == [4, 4]
        assert [t["bytes_written"] for t in stats["tiers"]] == [w * 2 for w in written]
        assert engine.get(keys, pages.dst_segments) == [True] * 4
        assert engine.check() == []


def test_restart_finds_every_committed_page(tier_dirs, io_engine):
    pages = Pages(12, aligned=False)
    keys = [key(i) for i in range(12)]
    with make_engine(tier_dirs, io_engine) as engine:
        assert engine.put(keys, pages.src_segments) == [True] * 12
    with make_engine(tier_dirs, io_engine) as engine:
        assert engine.wait_scan(30)
        assert engine.scan["files"] == 36 and engine.scan["pages"] == 12
        assert engine.prefix_len(keys) == 12
        assert [engine.index.holders(k) for k in keys] == [0b111] * 12
        assert engine.get(keys, pages.dst_segments) == [True] * 12
        assert all(pages.equal(i) for i in range(12))
        assert engine.check() == []


def test_restart_keeps_lru_order(tier_dirs):
    pages = Pages(4)
    keys = [key(i) for i in range(4)]
    page_file = 4096 + sum(pages.shapes[0])
    with make_engine(tier_dirs[:1]) as engine:
        for i in range(3):
            engine.put(keys[i:i + 1], pages.src_segments[i:i + 1])
    with make_engine(tier_dirs[:1], capacity=3 * page_file) as engine:
        assert engine.wait_scan(30)  # the order of before the restart holds once the scan has the pages
        engine.put(keys[3:], pages.src_segments[3:])
        assert [engine.contains(k) for k in keys] == [False, True, True, True]


def test_startup_cleans_temporary_leftovers_and_damaged_files(tier_dirs):
    pages = Pages(2)
    keys = [key(i) for i in range(2)]
    with make_engine(tier_dirs[:1]) as engine:
        engine.put(keys, pages.src_segments)
        layout = engine.tiers[0].layout
    dead = os.path.join(layout.tmp, tmp_name(NS.digest, 2**22 + 7, "dead", 0))  # no such pid
    open(dead, "w").close()
    with open(layout.page_path(keys[1]), "r+b") as f:  # damage the header
        f.seek(30)
        f.write(b"\xff")
    with make_engine(tier_dirs[:1]) as engine:
        assert engine.wait_scan(30)
        assert not os.path.exists(dead)
        assert engine.scan["tmp_removed"] == 1 and engine.scan["damaged_removed"] == 1
        assert engine.contains(keys[0]) and not engine.contains(keys[1])
        assert not os.path.exists(layout.page_path(keys[1]))
        assert engine.check() == []


def test_live_engines_temp_files_survive_another_engines_start(tier_dirs):
    with make_engine(tier_dirs[:1]) as first:
        live = os.path.join(first.tiers[0].layout.tmp, tmp_name(NS.digest, os.getpid(), first._token, 99))
        open(live, "w").close()
        with make_engine(tier_dirs[:1]):
            assert os.path.exists(live)
        os.unlink(live)


# -- concurrency -------------------------------------------------------------------------------
def test_concurrent_batches_from_three_threads(tier_dirs, io_engine):
    """SGLang's backup, prefetch-I/O and prefetch threads at once; the store stays consistent."""
    rounds, per = 12, 4
    pages = Pages(rounds * per, aligned=False, size=80 << 10)
    keys = [key(i, "conc") for i in range(rounds * per)]
    stored: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    with make_engine(tier_dirs[:2], io_engine) as engine:

        def writer():
            for r in range(rounds):
                idx = list(range(r * per, (r + 1) * per))
                segs = pages.src_segments
                ok = engine.put([keys[i] for i in idx] + [keys[idx[0]]], [segs[i] for i in idx] + [segs[idx[0]]])
                if not all(ok):
                    errors.append(f"put {r}: {ok}")
                with lock:
                    stored.extend(idx)

        def reader():
            for r in range(rounds * 2):
                with lock:
                    idx = stored[-per:] + stored[:2]
                if not idx:
                    continue
                dst = pages.fresh()
                sel = [dst[i] for i in idx]
                ok = engine.get([keys[i] for i in idx], segments_of(sel))
                if not all(ok) or not all(
                        all(np.array_equal(a, b) for a, b in zip(pages.src[i], sel[n])) for n, i in enumerate(idx)):
                    errors.append(f"get {r}: {ok}")

        def prober():
            for _ in range(rounds * 10):
                with lock:
                    n = len(stored)
                if engine.prefix_len(keys[:n]) < n - per:
                    errors.append("prefix_len went backwards")

        threads = [threading.Thread(target=f) for f in (writer, reader, prober)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert engine.prefix_len(keys) == rounds * per
        assert engine.check() == []


# -- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fsync", ["data", "full"])
def test_fsync_modes_round_trip(tier_dirs, fsync):
    pages = Pages(3, aligned=False)
    keys = [key(i) for i in range(3)]
    with make_engine(tier_dirs[:2], fsync=fsync) as engine:
        assert engine.put(keys, pages.src_segments) == [True] * 3
        assert engine.get(keys, pages.dst_segments) == [True] * 3 and pages.equal(2)


@pytest.mark.parametrize("mode,file_bits,dir_bits", [("private", 0o600, 0o700), ("shared", 0o660, 0o2770)])
def test_file_modes(tier_dirs, mode, file_bits, dir_bits):
    pages = Pages(1)
    with make_engine(tier_dirs[:1], file_mode=mode) as engine:
        engine.put([key(0)], pages.src_segments)
        path = engine.tiers[0].layout.page_path(key(0))
        assert stat.S_IMODE(os.stat(path).st_mode) == file_bits
        for d in (os.path.dirname(path), engine.tiers[0].layout.pages, engine.tiers[0].layout.tmp):
            assert stat.S_IMODE(os.stat(d).st_mode) == dir_bits


def test_clear_and_close_are_safe(tier_dirs):
    pages = Pages(3)
    keys = [key(i) for i in range(3)]
    engine = make_engine(tier_dirs[:2])
    engine.put(keys, pages.src_segments)
    engine.clear()
    assert engine.prefix_len(keys) == 0 and _page_files(tier_dirs[0]) == []
    assert engine.put(keys, pages.src_segments) == [True] * 3  # usable after clear
    assert engine.check() == []
    engine.close()
    engine.close()
    from kvstream_hicache.errors import EngineClosedError

    with pytest.raises(EngineClosedError):
        engine.get(keys, pages.dst_segments)


@pytest.mark.parametrize("announce,level", [(True, logging.INFO), (False, logging.DEBUG)])
def test_start_up_line_level(tier_dirs, caplog, announce, level):
    """One line at start-up; an adapter with a line of its own (the SGLang backend) turns it down to DEBUG."""
    caplog.set_level(logging.DEBUG, logger="kvstream")
    with Engine(Config.from_sources({"tiers": tier_dirs[:1]}, environ={}), NS, announce=announce) as engine:
        assert engine.wait_scan(30)
    lines = [r for r in caplog.records if "start-up scan in the background" in r.getMessage()]
    assert [r.levelno for r in lines] == [level]
    done = [r for r in caplog.records if "background scan of tier 0 done" in r.getMessage()]
    assert [r.levelno for r in done] == [level]


def _page_files(tier_dir: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(os.path.join(tier_dir, "kvstream")):
        out += [os.path.join(root, f) for f in files if f.endswith(".kvp")]
    return out



RANK_WRITER = r"""
import sys, hashlib, numpy as np
from kvstream_hicache import Config, Engine, Namespace
rank, dirs = sys.argv[1], sys.argv[2:]
ns = Namespace({"model": "shared", "tp_rank": int(rank) if rank != "mla" else "all"})
engine = Engine(Config.from_sources({"tiers": dirs, "chunk": "64K"}, environ={}), ns)
ok = True
for batch in range(6):
    keys = [hashlib.sha256(f"{batch}-{i}".encode()).hexdigest() for i in range(8)]
    data = [np.frombuffer(hashlib.shake_256(k.encode()).digest(96 << 10), dtype=np.uint8) for k in keys]
    ok &= all(engine.put(keys, [[(d.ctypes.data, d.nbytes)] for d in data]))
    dst = [np.zeros(96 << 10, dtype=np.uint8) for _ in keys]
    ok &= all(engine.get(keys, [[(d.ctypes.data, d.nbytes)] for d in dst]))
    ok &= all(np.array_equal(a, b) for a, b in zip(data, dst))
# with a shared namespace the other process's pages are valid files this index lacks: index_missing
ok &= all(p.kind == "index_missing" and rank == "mla" for p in engine.check())
engine.close()
print("ok" if ok else "FAILED")
"""


@pytest.mark.parametrize("ranks", [("0", "1"), ("mla", "mla")], ids=["two-namespaces", "one-shared-namespace"])
def test_two_processes_share_the_tiers(tier_dirs, ranks):
    """Two TP ranks on the same tier directories at once: their own namespaces, or one shared
    namespace (MLA) writing the same keys concurrently. Nothing collides; both stores stay valid."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_WRITER, r, *tier_dirs[:2]], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in ranks]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [o[0].strip() for o in outs] == ["ok", "ok"], [o[1][-2000:] for o in outs]
    from kvstream_hicache.integrity import check_tiers

    assert check_tiers(Config.from_sources({"tiers": tier_dirs[:2]}, environ={})) == []


def test_pages_written_by_another_engine_of_the_namespace_are_discovered(tier_dirs):
    """MLA: TP rank 0 writes, every rank reads; a reader started earlier finds the new pages."""
    pages = Pages(4)
    keys = [key(i, "mla") for i in range(4)]
    with make_engine(tier_dirs[:2]) as reader, make_engine(tier_dirs[:2]) as writer:
        assert reader.prefix_len(keys) == 0
        assert writer.put(keys[:3], pages.src_segments[:3]) == [True] * 3
        assert reader.prefix_len(keys) == 3 and reader.contains(keys[0]) and not reader.contains(keys[3])
        assert reader.get(keys, pages.dst_segments) == [True, True, True, False]
        assert all(pages.equal(i) for i in range(3))
        assert reader.stats()["discovered"] == 3
        assert reader.put(keys[:1], pages.src_segments[:1]) == [True]  # already there: no rewrite
        assert reader.stats()["tiers"][0]["pages_written"] == 0
        assert reader.check() == [] and writer.check() == []  # the reader's index caught up with the disk
    with make_engine(tier_dirs[:2], discover=False) as blind, make_engine(tier_dirs[:2]) as writer:
        writer.put(keys[3:], pages.src_segments[3:])
        assert not blind.contains(keys[3]) and blind.prefix_len(keys) == 3
        # index only: the blind engine's check sees the other engine's page on disk, unindexed
        found = {(p.kind, p.path) for p in blind.check(fix=True)}
        assert found == {("index_missing", t.layout.page_path(keys[3])) for t in blind.tiers}
