#!/usr/bin/env python3
"""Another node's pages on the shared tier, read twice: promotion gives the second read both tiers.

Two "nodes" share tier 1 of a testbed (``kvstream testbed up``) and each has a private tier 0 (a
directory of its own on the testbed's tier 0). Every round, in fresh processes inside the testbed's
throttled group:

  1. node A (a child process) stores ``--pages`` pages of ``--page-mib`` MiB on [A's tier 0, tier 1]
     with ``replicate=all``, so tier 1 holds every page;
  2. node B (another child, defaults: catch-up on) reads them all: its index is empty, it finds them
     on tier 1 by discovery and reads them from tier 1 alone ("first read"); catch-up promotes them to
     B's tier 0 in the background (from the read's own memory where it still holds it), and B waits
     until nothing is owed; then it reads them again ("second read"): both tiers;
  3. the shared tier alone: an engine on [tier 1] only reads the same pages (``tier1``);
  4. every page file of the round is removed.

Reports per round the GB/s of each read, the ratios second / first and second / tier1 alone, and the
catch-up time; then the medians and the spread. The issue's target: the second read >= 1.2x the
shared tier alone on testbed2-1:20 (the bound allows (b0 + b1) / b1).

    kvstream testbed up --profile testbed2-1:20 --name xnode
    python benchmarks/bench_cross_node.py --testbed xnode --rounds 3 --json docs/data/cross-node/tb2.json
    kvstream testbed down --name xnode
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NODE = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import numpy as np
from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.io import AlignedBuffer
role, tiers, page, n, seed = {role!r}, {tiers!r}, {page}, {n}, {seed}
keys = [f"{{seed:04d}}-{{i:06d}}" for i in range(n)]
settings = {{"tiers": tiers}}
if role == "writer":
    settings["replicate"] = "all"
engine = Engine(Config.from_sources(settings, environ={{}}), Namespace({{"model": "bench-cross-node"}}), announce=False)
buf = AlignedBuffer(page * n)
arr = np.frombuffer(buf, dtype=np.uint8)
pages = [[(arr.ctypes.data + i * page, page)] for i in range(n)]
out = {{}}
if role == "writer":
    arr[:] = np.random.default_rng(seed).integers(0, 255, size=arr.size, dtype=np.uint8)
    assert all(engine.put(keys, pages))
else:
    def read():
        t0 = time.perf_counter()
        ok = engine.get(keys, pages)
        t = time.perf_counter() - t0
        assert all(ok), f"{{ok.count(False)}} of {{n}} pages missed"
        return page * n / t / 1e9
    out["first_gbps"] = read()
    if role == "reader":
        t0 = time.perf_counter()
        while engine.stats()["replication_pending"] and time.perf_counter() - t0 < 600:
            time.sleep(0.05)
        out["catch_up_s"] = time.perf_counter() - t0
        out["promoted"] = engine.stats()["tiers"][0].get("replication_done", 0)
        before = [t["bytes_served"] for t in engine.stats()["tiers"]]
        out["second_gbps"] = read()
        served = [t["bytes_served"] - b for t, b in zip(engine.stats()["tiers"], before)]
        out["second_shares"] = [x / sum(served) for x in served]  # of the second read alone
engine.close()
print(json.dumps(out))
"""


def node(bed, role: str, tiers: list[str], args, seed: int) -> dict:
    code = NODE.format(root=HERE, role=role, tiers=tiers, page=args.page_mib << 20, n=args.pages, seed=seed)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=bed.joined_preexec())
    if done.returncode:
        raise SystemExit(f"node {role} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--testbed", required=True, help="a testbed that is up (kvstream testbed up --name ...)")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    from kvstream_hicache.tools.bench.testbed import Testbed

    bed = Testbed.load(args.testbed)
    if bed is None:
        raise SystemExit(f"no testbed named {args.testbed!r} is up: kvstream testbed up --name {args.testbed}")
    t0, t1 = bed.dirs[:2]
    rows = []
    for r in range(args.rounds):
        run = [os.path.join(t0, f"xnode-{r}-a"), os.path.join(t0, f"xnode-{r}-b"), os.path.join(t1, f"xnode-{r}")]
        for d in run:
            os.makedirs(d)
        try:
            node(bed, "writer", [run[0], run[2]], args, r)
            b = node(bed, "reader", [run[1], run[2]], args, r)
            alone = node(bed, "alone", [run[2]], args, r)
        finally:
            for d in run:
                shutil.rmtree(d, ignore_errors=True)
        row = dict(b, tier1_gbps=alone["first_gbps"], second_over_first=b["second_gbps"] / b["first_gbps"],
                   second_over_tier1=b["second_gbps"] / alone["first_gbps"])
        rows.append(row)
        print(f"round {r}: first read (tier 1 alone, discovery) {b['first_gbps']:.3f} GB/s; catch-up "
              f"{b['catch_up_s']:.1f} s ({b['promoted']} promoted); second read {b['second_gbps']:.3f} GB/s "
              f"(shares {'/'.join(f'{s:.2f}' for s in b['second_shares'])}); tier 1 alone {alone['first_gbps']:.3f} "
              f"GB/s; second / tier1 {row['second_over_tier1']:.2f}x", flush=True)
    ratios = [row["second_over_tier1"] for row in rows]
    print(f"median second / tier 1 alone: {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); "
          f"profile {bed.profile.name}: the bound allows "
          f"{sum(t.read_bps for t in bed.profile.tiers) / bed.profile.tiers[1].read_bps:.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"profile": bed.profile.name, "pages": args.pages, "page_mib": args.page_mib, "rounds": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
