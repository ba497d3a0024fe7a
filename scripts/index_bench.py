"""Lookup micro-bench of the index: ``contains`` (a held key, a missing key) and a 1,000-key
``prefix_len``, the existence queries SGLang's prefetch thread makes, at each index size.

    python scripts/index_bench.py [--pages 10000,100000,1000000] [--reference DIR] [--rounds 5] [--json OUT]

Each tree measured (this one, and ``--reference DIR``: another checkout, e.g. the tree before a
change) runs in its own fresh interpreter per size, with ``DIR`` first on ``sys.path``; the sizes
and trees are interleaved round by round, so drift on a shared machine hits both alike. An index of
``n`` 64-hex keys (SGLang's and LMCache's form) on one tier is filled through ``Index.commit``; each
figure is the median over ``--rounds`` rounds of the mean CPU time (the thread's: a machine shared
with other work preempts a wall clock) per call over a few thousand calls, on keys drawn at random
(so the probes do not walk memory in order), each a fresh ``str`` (as a caller's key: not the
object the index was filled with, whose identity a dict compares first). RSS per page is the
process's growth while the index is filled (the keys themselves made before), over the pages. Prints one line per size and
tree, and the per-round ratios (tree / reference).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import hashlib, json, random, sys, time
from kvstream_hicache.index import Index
n, rounds = int(sys.argv[1]), int(sys.argv[2])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
keys = [hashlib.sha256(b"idx/%d" % i).hexdigest() for i in range(n)]
rss0 = rss()
index = Index([None])
t0 = time.perf_counter()
for k in keys:
    index.commit(k, 0, 4096, 4096, (1,), 4096, reserved=False)
fill = time.perf_counter() - t0
rss1 = rss()
rng = random.Random(1)
missing = [hashlib.sha256(b"missing/%d" % i).hexdigest() for i in range(5000)]
out = {"fill_us": fill / n * 1e6, "rss_per_page": (rss1 - rss0) / n, "contains_held_us": [], "contains_missing_us": [], "prefix_1000_us": []}
for _ in range(rounds):
    held = [k.encode().decode() for k in rng.choices(keys, k=20000)]  # fresh str objects, as a caller's
    t = time.thread_time()
    for k in held:
        index.contains(k, 1)
    out["contains_held_us"].append((time.thread_time() - t) / len(held) * 1e6)
    t = time.thread_time()
    for k in missing:
        index.contains(k, 1)
    out["contains_missing_us"].append((time.thread_time() - t) / len(missing) * 1e6)
    runs = [[k.encode().decode() for k in rng.sample(keys, 1000)] for _ in range(20)]
    t = time.thread_time()
    for run in runs:
        assert index.prefix_len(run, 1) == 1000
    out["prefix_1000_us"].append((time.thread_time() - t) / len(runs) * 1e6)
print(json.dumps(out))
"""

FIGURES = ("contains_held_us", "contains_missing_us", "prefix_1000_us")


def measure(tree: str, n: int, rounds: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(rounds)], env=env, cwd=tree,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", default="10000,100000,1000000")
    ap.add_argument("--reference", help="another tree to measure the same way (e.g. before a change)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    trees = {"this": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    if args.reference:
        trees["reference"] = os.path.abspath(args.reference)
    results: dict = {}
    for i, n in enumerate(int(p) for p in args.pages.split(",")):
        order = list(trees.items())
        for name, tree in (order if i % 2 == 0 else order[::-1]):  # who goes first alternates
            results.setdefault(n, {})[name] = r = measure(tree, n, args.rounds)
            print(f"{n:>9,} {name:<9} fill {r['fill_us']:6.2f} us/page, RSS {r['rss_per_page']:5.0f} B/page  " + "  ".join(
                f"{f} {statistics.median(r[f]):7.3f} (spread {min(r[f]):.3f}-{max(r[f]):.3f})" for f in FIGURES),
                flush=True)
        if "reference" in results[n]:
            this, ref = results[n]["this"], results[n]["reference"]
            print(f"{'':>9} ratio this/reference per round: " + "  ".join(
                f"{f} " + "/".join(f"{a / b:.2f}" for a, b in zip(this[f], ref[f])) for f in FIGURES), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
