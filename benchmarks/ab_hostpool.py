"""Trees of kvstream against each other through sglang's host pool, in interleaved rounds: what a change
costs on the read path, with nixl measured beside each run as the reference.

Each round runs ``benchmarks/bench_hostpool.py DIR0,DIR1 P B REPS nixl adapter-1tier adapter`` once per
tree (``PYTHONPATH=<tree>``: the tree's package, this script's bench) and per page geometry, the trees in
the order given in odd rounds and reversed in even ones (neither always runs first, on a warmer or a
colder machine); each run starts on empty contender directories. The runs' output is appended to
``--out``, each under a line ``=== round R tree NAME geo P B``. ``--table`` reads such files (those of
the stops' earlier ``ab.sh`` too: docs/data/device-speed-39..42) and prints per geometry and tree, over
the runs, the median and range of each run's ratios: one tier and two tiers to nixl, two tiers to one,
and CPU per GB to nixl's. A per-run ratio compares what one process measured in the same rounds, so the
machine's drift between runs cancels.

usage: python benchmarks/ab_hostpool.py --tiers DIR0,DIR1 --trees new=.,old=/tmp/old [--geos "8 512,2 2048"]
           [--rounds 8] [--first-round 1] [--reps 5] [--lock /var/tmp/kvstream-bench.lock] --out FILE
       python benchmarks/ab_hostpool.py --table FILE [FILE ...]
(run from the repository root; with a testbed's throttled tier, from a shell inside its blkio group:
echo $$ > /sys/fs/cgroup/blkio/kvstream-NAME/cgroup.procs, as bench_hostpool.py)
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("nixl", "adapter-1tier", "adapter")
GEO_NAMES = {"8": "1 MiB", "2": "256 KiB", "16": "2 MiB", "64": "8 MiB"}  # llama3-8b TP-8 tokens a page -> size
HEAD = re.compile(r"=== round (\d+) tree (\S+) geo (\d+) (\d+)")
ROW = re.compile(r"(nixl|adapter-1tier|adapter)\s+page \d+ KiB: MB/s med\s+(\d+).*CPU s/GB med ([\d.]+)")


def run(args: argparse.Namespace) -> None:
    trees = [tuple(t.split("=", 1)) for t in args.trees.split(",")]
    geos = [g.split() for g in args.geos.split(",")]
    for rnd in range(args.first_round, args.first_round + args.rounds):
        order = trees if rnd % 2 else trees[::-1]
        for name, tree in order:
            for tokens, batch in geos:
                for d in args.tiers.split(","):
                    for old in glob.glob(os.path.join(d, "hostpool-*")):
                        shutil.rmtree(old)
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                with _locked(args.lock), open(args.out, "a") as out:
                    out.write(f"=== round {rnd} tree {name} geo {tokens} {batch}\n")
                    out.flush()
                    subprocess.run([sys.executable, os.path.join(HERE, "bench_hostpool.py"), args.tiers, tokens, batch,
                                    str(args.reps), *MODES], env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
                    out.write("\n")  # (the run's last line may lack its end: nanobind's leak report)


@contextlib.contextmanager
def _locked(path: str | None):
    """The machine's bench lock, if given: other benches wait while a run reads."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def table(files: list[str]) -> list[str]:
    runs: dict[tuple[str, str, str], dict[str, tuple[int, float]]] = {}
    key = None
    for path in files:
        with open(path) as f:
            for line in f:
                m = HEAD.match(line)
                if m:
                    key = (m.group(1), m.group(2), GEO_NAMES.get(m.group(3), f"{m.group(3)} tokens"))
                    continue
                m = ROW.match(line)
                if m and key is not None:
                    runs.setdefault(key, {})[m.group(1)] = (int(m.group(2)), float(m.group(3)))
    lines = []
    for geo in dict.fromkeys(g for _, _, g in runs):
        for tree in dict.fromkeys(t for _, t, _ in runs):
            rs = [v for (_, t, g), v in runs.items() if t == tree and g == geo and len(v) == len(MODES)]
            if not rs:
                continue

            def spread(values: list[float]) -> str:
                return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

            lines.append(f"{geo} {tree} runs {len(rs)} | 1t x nixl {spread([v['adapter-1tier'][0] / v['nixl'][0] for v in rs])}"
                         f" | 2t x nixl {spread([v['adapter'][0] / v['nixl'][0] for v in rs])}"
                         f" | 2t x 1t {spread([v['adapter'][0] / v['adapter-1tier'][0] for v in rs])}"
                         f" | CPU x nixl 1t {spread([v['adapter-1tier'][1] / v['nixl'][1] for v in rs])}"
                         f" 2t {spread([v['adapter'][1] / v['nixl'][1] for v in rs])}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", nargs="+", metavar="FILE", help="print the per-run ratios of these files and stop")
    p.add_argument("--tiers", help="DIR0,DIR1: the two tier directories (one tier: DIR0)")
    p.add_argument("--trees", help="NAME=PATH,...: the trees under test, the order of odd rounds")
    p.add_argument("--geos", default="8 512,2 2048", help="'TOKENS PAGES,...' (llama3-8b: 8 tokens = 1 MiB pages)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--first-round", type=int, default=1, help="number of the first round (to go on in a file)")
    p.add_argument("--reps", type=int, default=5, help="rounds inside each bench_hostpool.py run")
    p.add_argument("--lock", help="a file to flock around each run (the machine's bench lock)")
    p.add_argument("--out", help="file the runs' output is appended to")
    args = p.parse_args()
    if args.table:
        print("\n".join(table(args.table)))
        return
    if not (args.tiers and args.trees and args.out):
        p.error("--tiers, --trees and --out are needed to run (or --table FILE to read runs)")
    run(args)
    print("\n".join(table([args.out])))


if __name__ == "__main__":
    main()
