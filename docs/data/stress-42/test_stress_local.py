"""Review chaos2: a seeded randomized stress of one engine on three ext4 loop-device tiers under faults.

Workers (SGLang-like batch put/get, contains/prefix_len, delete) run while a fault thread injects, at
seeded points: EIO on reads or writes of one tier, read corruption, a read-only remount, a full file
system, bytes flipped in page files, a truncated page file, a tier's tree removed and re-created; a
clear() between phases. Then the faults end, the clock passes every back-off, catch-up settles, and
the promises of docs/guarantees.md are checked.
"""
from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import time
import traceback

import pytest

from kvstream_hicache.errors import EngineClosedError
from kvstream_hicache.faults import Fault
from kvstream_hicache.integrity import scan_file
from kvstream_hicache.io import OP_READ, OP_WRITE

from helpers import FakeClock, PageSet, TierFaultPlan, content, key, loop_fs, make_engine, page_files, \
    put_items, get_items, tmp_files, flip_byte, wait_until  # noqa: F401

KIB, MIB = 1 << 10, 1 << 20
SIZES = [64 * KIB, 128 * KIB, 256 * KIB, 512 * KIB, 1 * MIB]
POOL = 160  # worker keys
PROTECTED = 12


def size_of(k: str) -> int:
    return SIZES[int(k[:4], 16) % len(SIZES)]


def items_put(keys):
    return [(k, content(k, size_of(k)), True) for k in keys]


def checked_get(engine, keys, errors):
    found, got = get_items(engine, [(k, size_of(k), True) for k in keys])
    for k, ok, data in zip(keys, found, got):
        if ok and data != content(k, size_of(k)):
            errors.append(f"wrong bytes for {k[:12]}")
    return found


def _free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def run_chaos(seed: int, replicate: str, loop_fs, ops_per_worker: int = 120, phases: int = 14):
    rng = random.Random(seed)
    fss = [loop_fs(48 * MIB, f"c{seed}t0"), loop_fs(64 * MIB, f"c{seed}t1"), loop_fs(256 * MIB, f"c{seed}t2")]
    dirs = []
    for fs in fss:
        d = os.path.join(fs.mnt, "tier")
        os.mkdir(d, 0o700)
        dirs.append(d)
    clock = FakeClock()
    plan = TierFaultPlan()
    pool = [key(i, f"chaos{seed}") for i in range(POOL)]
    protected = [key(i, f"prot{seed}") for i in range(PROTECTED)]
    errors: list[str] = []
    acked: dict[str, int] = {}  # key -> epoch of its last acknowledged put
    deleted: dict[str, int] = {}
    ever_deleted: set[str] = set()
    epoch = [0]
    state_lock = threading.Lock()
    damaged_on_disk: set[str] = set()
    engine = make_engine(dirs, clock=clock, fault_plan=plan, replicate=replicate, catchup=True,
                         capacity=os.pathsep.join(["", "40M", ""]), tier_retry=5, write_timeout=5, read_timeout=10)
    try:
        assert put_items(engine, items_put(protected)) == [True] * PROTECTED
        wait_until(lambda: engine.stats()["replication_pending"] == 0, 60, "protected never replicated")
        wait_until(lambda: all(engine.index.holders(k) >> 2 & 1 for k in protected), 60,
                   "protected keys never reached tier 2")
        stop = threading.Event()
        pause = threading.Event()  # set: workers idle (clear phase)
        idle = [threading.Event() for _ in range(3)]

        def worker(w):
            wr = random.Random(seed * 100 + w)
            for _ in range(ops_per_worker):
                while pause.is_set():
                    idle[w].set()
                    time.sleep(0.01)
                idle[w].clear()
                op = wr.random()
                n = wr.randint(8, 64)
                start = wr.randrange(POOL)
                keys = [pool[(start + i) % POOL] for i in range(n)]
                try:
                    if op < 0.4:
                        keys = keys[: wr.randint(8, 24)]  # puts of 8-24 pages: ~12 MiB at most
                        with state_lock:
                            e = epoch[0]
                        res = put_items(engine, items_put(keys))
                        with state_lock:
                            for k, ok in zip(keys, res):
                                if ok and epoch[0] == e:
                                    acked[k] = e
                                    deleted.pop(k, None)
                    elif op < 0.8:
                        checked_get(engine, keys, errors)
                    elif op < 0.9:
                        engine.contains(keys[0])
                        engine.prefix_len(keys)
                    else:
                        ks = keys[:2]
                        with state_lock:
                            engine.delete(ks)
                            for k in ks:
                                ever_deleted.add(k)
                                acked.pop(k, None)
                                deleted[k] = 1
                except Exception:
                    errors.append(f"worker {w}: {traceback.format_exc()}")
            idle[w].set()

        def damage_files(t, what):
            files = page_files(dirs[t])
            files = [f for f in files if not any(p in f for p in protected)]
            for f in rng.sample(files, min(3, len(files))):
                damaged_on_disk.add(f)
                try:
                    if what == "flip":
                        sz = os.path.getsize(f)
                        flip_byte(f, rng.randrange(sz), 0x10)
                    else:
                        os.truncate(f, os.path.getsize(f) // 2)
                except OSError:
                    pass

        def fault_thread():
            kinds = ["eio_read", "eio_write", "corrupt", "ro", "full", "flip", "truncate", "rmtree", "clear"]
            for ph in range(phases):
                kind = rng.choice(kinds)
                t = rng.randrange(3)
                if kind in ("full", "rmtree") and t == 2:
                    t = rng.randrange(2)  # tier 2 holds the protected keys: never made full or removed
                log.append((ph, kind, t))
                undo = None
                try:
                    if kind == "eio_read":
                        plan.on(dirs[t], Fault.error(errno.EIO), opcode=OP_READ)
                        undo = plan.clear
                    elif kind == "eio_write":
                        plan.on(dirs[t], Fault.error(errno.EIO), opcode=OP_WRITE)
                        undo = plan.clear
                    elif kind == "corrupt":
                        plan.on(dirs[t], Fault.corrupt(), opcode=OP_READ, times=20)
                        undo = plan.clear
                    elif kind == "ro":
                        for _ in range(20):
                            try:
                                fss[t].remount("ro")
                                undo = lambda t=t: fss[t].remount("rw")  # noqa: E731
                                break
                            except RuntimeError:
                                time.sleep(0.05)
                    elif kind == "full":
                        fd = os.open(os.path.join(fss[t].mnt, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
                        try:
                            os.posix_fallocate(fd, 0, max(_free(fss[t].mnt) - 2 * MIB, 4096))
                        except OSError:
                            pass
                        os.close(fd)
                        undo = lambda t=t: os.unlink(os.path.join(fss[t].mnt, "filler"))  # noqa: E731
                    elif kind in ("flip", "truncate"):
                        damage_files(t, kind)
                    elif kind == "rmtree":
                        shutil.rmtree(os.path.join(dirs[t], "kvstream"), ignore_errors=True)
                        undo = lambda t=t: os.makedirs(os.path.join(dirs[t], "kvstream"), 0o700, exist_ok=True)  # noqa: E731
                    elif kind == "clear":
                        pause.set()
                        for ev in idle:
                            ev.wait(120)
                        with state_lock:
                            engine.clear()
                            epoch[0] += 1
                            acked.clear()
                        ok = put_items(engine, items_put(protected))
                        if ok != [True] * PROTECTED:
                            errors.append(f"protected re-put after clear: {ok}")
                        wait_until(lambda: all(engine.index.holders(k) >> 2 & 1 for k in protected), 60,
                                   "protected keys never reached tier 2 after clear")
                        pause.clear()
                except Exception:
                    errors.append(f"fault {kind}: {traceback.format_exc()}")
                time.sleep(rng.uniform(0.5, 1.5))
                if undo is not None:
                    try:
                        undo()
                    except Exception:
                        errors.append(f"undo {kind}: {traceback.format_exc()}")
                clock.advance(400)  # past every back-off
                if stop.is_set():
                    break

        log: list = []
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
        ft = threading.Thread(target=fault_thread)
        for th in threads:
            th.start()
        ft.start()
        for th in threads:
            th.join(300)
        stop.set()
        pause.clear()
        ft.join(300)
        assert not errors, f"seed {seed} {log}:\n" + "\n".join(errors[:5])

        # faults over: every back-off passed, catch-up settles
        plan.clear()
        clock.advance(1000)
        checked_get(engine, pool, errors)
        checked_get(engine, protected, errors)
        settle(engine, log)
        stats = engine.stats()
        assert all(t["healthy"] for t in stats["tiers"]), (log, [(t["healthy"], t["last_error"]) for t in stats["tiers"]])
        # every protected key found
        found = checked_get(engine, protected, errors)
        assert found == [True] * PROTECTED, (seed, log, found)
        # a valid copy on a healthy tier is found
        for k in pool:
            on_disk = [t for t in range(3) if os.path.exists(engine.tiers[t].layout.page_path(k))
                       and scan_file(engine.tiers[t].layout, engine.namespace.digest, k, payload=True).problem is None]
            if on_disk:
                assert checked_get(engine, [k], errors) == [True], (seed, log, k, on_disk)
        assert not errors, f"seed {seed} {log}:\n" + "\n".join(errors[:5])
        stats = engine.stats()
        assert stats["pages_found"] + stats["pages_missing"] == stats["pages_requested"], stats
        for name, v in stats.items():
            if isinstance(v, (int, float)):
                assert v >= 0, (name, v)
        for k, row in enumerate(stats["tiers"]):
            for name, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    assert v >= 0, (k, name, v)
            expect = sum(engine.index.get(x).nbytes for x in engine.index.keys(k))
            assert row["used_bytes"] == expect, (k, row["used_bytes"], expect)
        problems = engine.check()
        # (known, reported: a delete whose unlink failed on a read-only tier leaves the file: index_missing)
        problems = [p for p in problems if not (p.kind == "index_missing" and os.path.basename(p.path)[:-4] in ever_deleted)]
        # a header the test flipped over an intact payload is found by check(), not by reads (guarantees.md,
        # Caveats): reported damaged, and its index entry 'indexed but not on disk'
        problems = [p for p in problems if p.path not in damaged_on_disk]
        assert problems == [], (seed, log, problems)
        print("tmp before close", [(d, tmp_files(d)) for d in dirs])
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < 30
        for d in dirs:
            assert tmp_files(d) == [], (d, tmp_files(d), log)
            left = [f for r, _, fs in os.walk(d) for f in fs if "removing" in f]
            assert left == [], left
    finally:
        plan.clear()
        for fs in fss:
            subprocess_rw(fs)
        engine.close()


def settle(engine, log, quiet=3.0, timeout=10.0):
    """Catch-up settled: replication_pending 0, or unchanged for ``quiet`` s (a full tier owes for ever)."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        st = engine.stats()
        pend = [t["replication_pending"] for t in st["tiers"]]
        if sum(pend) == 0:
            return
        if os.environ.get("CHAOS_DEBUG"):
            print(round(time.monotonic(), 1), pend, [(t["replication_done"], t["replication_dropped"], t["used_bytes"], t["pages"], t["evictions"], t["write_queued_bytes"]) for t in st["tiers"]], flush=True)
        if pend != last:
            last, since = pend, time.monotonic()
        elif time.monotonic() - since > quiet:
            print("settled with pending", pend, [(t["used_bytes"], t["capacity_bytes"]) for t in st["tiers"]], log)
            return
        if time.monotonic() > deadline:  # a full tier drains its owed copies one a second (dropped)
            return
        time.sleep(0.1)


def subprocess_rw(fs):
    try:
        fs.remount("rw")
    except Exception:
        pass


SEEDS = [int(x) for x in os.environ.get("CHAOS_SEEDS", "1,2").split(",")]


@pytest.mark.leaves_problems("a delete on a read-only tier leaves its file on disk, not indexed (the finding below); "
                             "the test's own check() allows exactly that")
@pytest.mark.parametrize("seed,replicate", [(s, ("budget", "all")[s % 2]) for s in SEEDS])
def test_chaos(seed, replicate, loop_fs):
    run_chaos(seed, replicate, loop_fs)
