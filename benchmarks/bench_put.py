#!/usr/bin/env python3
"""Put throughput and CPU of one source tree against another, in the same run (issue 22 item 4).

Each round runs one child process per tree (interleaved: drift on a shared machine hits both alike):
an engine on two tiers under ``--dir`` (replicate=all), one put of ``--pages`` pages of
``--page-mib`` MiB from one buffer, 4096-aligned or 1 byte off (``--unaligned``: the staged path).
With ``--capacity-pages N`` each tier holds N pages: the puts (``--batch`` pages each) evict the rest as
they go (one eviction per page and tier, the steady state of a full tier). Reports per tree the median GB/s, CPU s/GB (the whole process: the writer thread and io_uring's
workers included) and the write pool's peak (``stats()["memory"]["write_peak_bytes"]``), and the
per-round ratios of the second tree to the first.

    python benchmarks/bench_put.py --trees /work/main,. --unaligned --page-mib 4 --pages 64
    python benchmarks/bench_put.py --trees /work/main,. --unaligned --page-mib 384 --pages 1 --rounds 1
    python benchmarks/bench_put.py --trees /work/main,. --page-mib 0.25 --pages 2048 --capacity-pages 256 --batch 64
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def child(tree: str, args) -> dict:
    """One put in a fresh process importing ``tree``'s kvstream_hicache."""
    code = f"""
import json, os, resource, sys, time
sys.path.insert(0, {os.path.abspath(tree)!r})
import numpy as np
from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.io import AlignedBuffer
page, n, root = {int(args.page_mib * (1 << 20))}, {args.pages}, {args.root!r}
dirs = [os.path.join(root, f"t{{k}}") for k in range(2)]
for d in dirs:
    os.makedirs(d)
settings = {{"tiers": dirs, "replicate": "all", "memory": {args.memory!r}}}
if {args.capacity_pages}:  # (the file's bytes: the page and its 4 KiB header)
    settings["capacity"] = os.pathsep.join([str({args.capacity_pages} * (page + 4096))] * 2)
engine = Engine(Config.from_sources(settings, environ={{}}),
                Namespace({{"model": "bench-put", "page": 1}}))
buf = AlignedBuffer(page * n + 4096)
arr = np.frombuffer(buf, dtype=np.uint8)
arr[:] = 7
base = arr.ctypes.data + {1 if args.unaligned else 0}
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
ok, batch = [], {args.batch} or n
for s in range(0, n, batch):  # (a batch larger than a tier's capacity writes only its newest pages there)
    ok += engine.put([f"k{{i:06d}}" for i in range(s, min(n, s + batch))],
                     [[(base + i * page, page)] for i in range(s, min(n, s + batch))])
t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
assert all(ok), ok
gb = page * n / 1e9
peak = engine.stats()["memory"]["write_peak_bytes"]
evictions = sum(row["evictions"] for row in engine.stats()["tiers"])
engine.close()
print(json.dumps({{"gbps": gb / (t1 - t0), "cpu_s_per_gb": (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / gb,
                  "write_peak_mib": peak / 2**20, "evictions": evictions}}))
"""
    try:
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="two source trees, comma-separated: reference,candidate")
    ap.add_argument("--unaligned", action="store_true", help="pages 1 byte off 4096 alignment (staged writes)")
    ap.add_argument("--page-mib", type=float, default=4, help="page size, MiB (0.25: 256 KiB)")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--memory", default="64M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm", help="where the two tiers go (O_DIRECT-capable)")
    ap.add_argument("--capacity-pages", type=int, default=0, help="each tier's capacity, in pages (0: unbounded)")
    ap.add_argument("--batch", type=int, default=0, help="pages per put call (0: all in one)")
    args = ap.parse_args()
    trees = args.trees.split(",")
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            args.root = tempfile.mkdtemp(prefix="bench-put-", dir=args.dir)
            runs[tree].append(child(tree, args))
    for tree in trees:
        rows = runs[tree]
        print(f"{tree}: {statistics.median(r['gbps'] for r in rows):.3f} GB/s, "
              f"{statistics.median(r['cpu_s_per_gb'] for r in rows):.2f} CPU s/GB, "
              f"write staging peak {max(r['write_peak_mib'] for r in rows):.0f} MiB, "
              f"evictions {max(r['evictions'] for r in rows)}")
    ref, new = runs[trees[0]], runs[trees[1]]
    print("per-round ratios (candidate / reference): GB/s", [round(b["gbps"] / a["gbps"], 2) for a, b in zip(ref, new)],
          "CPU s/GB", [round(b["cpu_s_per_gb"] / a["cpu_s_per_gb"], 2) for a, b in zip(ref, new)])


if __name__ == "__main__":
    main()
