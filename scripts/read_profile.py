"""Where a read's time goes at device speed: one tier against two, interleaved, and a profile.

    sudo .venv/bin/kvstream testbed up --profile ram-0.7 --name prof --no-fio
    sudo .venv/bin/python scripts/read_profile.py --tiers /mnt/kvstream-prof/tier0 /mnt/kvstream-prof/tier1 \\
        --cgroup /sys/fs/cgroup/blkio/kvstream-prof
    sudo .venv/bin/kvstream testbed down --name prof

Writes 512 MiB of 8 MiB pages (two 4 MiB segments each, in one huge-page buffer registered with the
engine) through a one-tier engine on the first directory and a two-tier engine on both, then reads
each batch ``--rounds`` times, the two engines alternating: MB/s, process CPU seconds per GB, bytes
served per tier, bytes read in place. Then profiles ten one-tier reads (cProfile): the time in
``_deliver_under_reads`` is the CRC32C check (and, for staged reads, the fused copy), the rest of
``_run_under_reads`` is mostly waiting for completions. Used for docs/benchmarks.md "Device speed".
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import statistics
import time

import numpy as np

from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.io import AlignedBuffer

PAGE = 8 << 20  # Llama-3-8B, 64 tokens
TOTAL = 512 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiers", nargs=2, required=True, help="tier 0 and tier 1 directories (fastest first)")
    ap.add_argument("--cgroup", help="blkio cgroup to join (the testbed's throttles apply to its members)")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    if args.cgroup:
        with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    n = TOTAL // PAGE
    buf = AlignedBuffer(TOTAL)
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(1).integers(0, 255, TOTAL, dtype=np.uint8)
    pages = [[(buf.address + i * PAGE, PAGE // 2), (buf.address + i * PAGE + PAGE // 2, PAGE // 2)] for i in range(n)]
    engines = {}
    for name, dirs in (("1 tier", args.tiers[:1]), ("2 tiers", args.tiers)):
        dirs = [os.path.join(d, "read-profile") for d in dirs]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        engine = Engine(Config.from_sources({"tiers": dirs, "replicate": "all"}, environ={}),
                        Namespace({"read-profile": name}))
        keys = [f"{name[0]}-{i:04d}" for i in range(n)]
        assert all(engine.put(keys, pages))
        engine.register_memory(buf.address, TOTAL)
        engines[name] = (engine, keys)
    rows: dict[str, list] = {name: [] for name in engines}
    try:
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 else list(engines)[::-1]):
                engine, keys = engines[name]
                cpu0, t0 = _cpu(), time.perf_counter()
                assert all(engine.get(keys, pages))
                dt, cpu = time.perf_counter() - t0, _cpu() - cpu0
                batch = engine.last_batch
                rows[name].append((TOTAL / dt / 1e6, cpu / (TOTAL / 1e9),
                                   [t["bytes_served"] >> 20 for t in batch["tiers"]], batch["direct_bytes"] >> 20))
        for name, rs in rows.items():
            print(f"{name}: median {statistics.median(r[0] for r in rs):.0f} MB/s, "
                  f"{statistics.median(r[1] for r in rs):.3f} CPU s/GB; served MiB per tier (first rounds) "
                  f"{[r[2] for r in rs[:3]]}, in place {[r[3] for r in rs[:3]]} MiB")
        engine, keys = engines["1 tier"]
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        for _ in range(10):
            engine.get(keys, pages)
        profile.disable()
        dt = time.perf_counter() - t0
        stats = pstats.Stats(profile).stats
        own = {f[2]: (v[2], v[3]) for f, v in stats.items() if f[0].endswith("reads.py")}
        deliver = own.get("_deliver_under_reads", (0, 0))[0]
        run = own.get("_run_under_reads", (0, 0))[0]
        gb = 10 * TOTAL / 1e9
        print(f"1 tier, profiled: {gb / dt:.2f} GB/s; verify (_deliver_under_reads) {deliver / gb:.3f} s/GB, "
              f"waiting for completions and routing (_run_under_reads itself) {run / gb:.3f} s/GB, "
              f"wall {dt / gb:.3f} s/GB")
    finally:
        for engine, _ in engines.values():
            engine.clear()
            engine.close()
        buf.close()


if __name__ == "__main__":
    main()
