"""CI smoke tests of the scripts under benchmarks/: each runs end to end on a few small pages in
temporary directories, as docs/benchmarks.md runs it, and prints a row for everything it measures.
The figures mean nothing here. What this catches is a script left behind by the code it drives: the
variants of bench_hostpool.py patch the read path's parts by name, and an earlier version reached
into the engine's internals until tests/test_facade.py caught it.
(bench_cross_node.py needs a throttled testbed, `kvstream testbed up`: not run here.)"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script(name: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_hostpool_one_tier_and_two_with_every_variant(tier_dirs):
    """nixl and the adapter into sglang's real host pool, on one tier and on two, with every variant
    the script applies in the same process."""
    modes = ["nixl", "adapter-1tier", "adapter", "adapter-claim=window", "adapter-deep", "adapter-fastdeep",
             "adapter-vegas", "adapter-1tier-single16M", "adapter-1tier-indepth64M", "adapter-inplace", "adapter-mem32M",
             "adapter-oldunit", "adapter-1tier-noreg", "adapter-slowcap", "adapter-nocoop", "adapter-fastinplace",
             "adapter-open", "adapter-held", "adapter-countall"]
    out = script("bench_hostpool.py", ",".join(tier_dirs[:2]), "2", "4", "2", *modes)
    for mode in modes:
        rows = [line for line in out.splitlines() if line.startswith(mode + " ")]
        row = next(line for line in rows if "MB/s med" in line)
        assert "xnixl med" in row and "xadapter-1tier med" in row
        assert any("machine CPU s/GB" in line and "busy CPUs" in line for line in rows)
        assert any("x best 1tier of the round med" in line for line in rows)  # (two 1tier modes)
    direct = {mode: line.split(" direct ")[1].split()[0] for line in out.splitlines() for mode in modes
              if line.startswith(mode + " ") and "MB/s med" in line}
    assert direct["adapter"] == "0"  # two tiers: every page staged
    assert (direct["adapter-fastinplace"] != "0") == (direct["adapter-1tier"] != "0")  # in place where one tier is
    for tier in tier_dirs[:2]:
        assert os.path.isdir(os.path.join(tier, "hostpool-adapter"))
    assert not os.path.exists(os.path.join(tier_dirs[1], "hostpool-adapter-1tier"))  # one tier: DIR0 alone


def test_ab_hostpool_interleaves_two_trees_and_tables_the_runs(tier_dirs, tmp_path):
    """Two trees (this one twice, under two names) through bench_hostpool.py in interleaved rounds: the
    order flips every round, each run is headed, and --table makes one row per geometry and tree."""
    out = tmp_path / "ab.txt"
    printed = script("ab_hostpool.py", "--tiers", ",".join(tier_dirs[:2]), "--trees", f"new={ROOT},old={ROOT}",
                     "--geos", "2 4", "--rounds", "2", "--reps", "1", "--out", str(out))
    heads = [line for line in out.read_text().splitlines() if line.startswith("=== ")]
    assert heads == ["=== round 1 tree new geo 2 4", "=== round 1 tree old geo 2 4",
                     "=== round 2 tree old geo 2 4", "=== round 2 tree new geo 2 4"]
    rows = [line for line in printed.splitlines() if line.startswith("256 KiB ")]
    assert [row.split()[2] for row in rows] == ["new", "old"]
    assert all("runs 2 | 1t x nixl" in row and "| 2t x 1t" in row and "CPU x nixl 1t" in row for row in rows)


def test_bench_fixed_reads_registered_memory_as_fixed_and_the_rest_not(tier_root):
    path = os.path.join(tier_root, "fixed.dat")
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
    out = script("bench_fixed.py", path, "1024", "2", "1")
    rows = {line.split()[0]: line for line in out.splitlines() if "MB/s med" in line}
    assert sorted(rows) == ["plain", "registered", "staged"]
    assert rows["registered"].endswith("fixed ops 8")  # 4 reads a round, a warm-up round and one timed
    assert rows["plain"].endswith("fixed ops 0") and rows["staged"].endswith("fixed ops 0")


def test_bench_put_compares_two_trees(tier_root):
    out = script("bench_put.py", "--trees", f"{ROOT},{ROOT}", "--pages", "2", "--page-mib", "1", "--rounds", "1",
                 "--dir", tier_root)
    assert "per-round ratios (candidate / reference)" in out


def test_bench_ring_against_fio(tier_root):
    out = script("bench_ring.py", "--dir", os.path.join(tier_root, "ring"), "--size-gib", "0.02", "--files", "2",
                 "--depths", "2", "--repeat", "1", "--chunk-mib", "1")
    for engine in ("fio io_uring", "Ring", "ThreadRing"):
        assert f"| 2 | {engine} |" in out


def test_bench_check_times_the_check_three_ways_per_request_size(tier_root):
    path = os.path.join(tier_root, "check.dat")
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
    out = script("bench_check.py", path, "--total", str(2 << 20), "--sizes", "256K,1M", "--depth", "2",
                 "--rounds", "1")
    rows = [line.split()[:4] for line in out.splitlines()]
    assert rows == [[way, "request", size, "KiB:"] for size in ("256", "1024") for way in ("sync", "cold", "ring")]
    assert all("check " in line and " s/GB" in line for line in out.splitlines())
