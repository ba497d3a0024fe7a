"""How long a tier takes to remove the pages of a clear() it missed while failed (Tier._settle), on
this machine's disk: N pages put on two tiers, tier 1's directory moved away, clear(), moved back, the
page cache dropped (as root), then timed from the probe that finds it back to its rejoin (wall, and
this process's CPU). Compares trees: run it alternately with TREE=<a worktree> (docs/benchmarks.md,
"What a clear a tier missed costs"):

    for r in 1 2 3; do for t in /tmp/old .; do TREE=$t .venv/bin/python scripts/settle_bench.py 30000; done; done
"""
import os
import shutil
import sys
import tempfile
import time

TREE = os.path.abspath(os.environ.get("TREE", "."))
sys.path[:0] = [TREE, os.path.join(TREE, "tests")]
from helpers import PageSet, make_engine, wait_until  # noqa: E402

n = int(sys.argv[1])
root = tempfile.mkdtemp(dir=os.environ.get("SETTLE_DIR", "/var/tmp"))
dirs = [os.path.join(root, "t0"), os.path.join(root, "t1")]
for d in dirs:
    os.makedirs(d)
pages = PageSet()
keys = pages.keys(n)
with make_engine(dirs, tier_retry=0.1) as e:
    for i in range(0, n, 512):
        assert all(pages.put(e, keys[i:i + 512]))
    os.rename(dirs[1], dirs[1] + ".away")
    e.clear()
    os.rename(dirs[1] + ".away", dirs[1])
    os.sync(); open("/proc/sys/vm/drop_caches", "w").write("3\n")
    c0 = time.process_time(); t0 = time.monotonic()
    e.tiers[1].usable()
    wait_until(lambda: e.tiers[1].healthy, 3600)
    print(f"{TREE}: {n} pages settled in {time.monotonic() - t0:.2f} s, cpu {time.process_time() - c0:.2f} s")
shutil.rmtree(root)
