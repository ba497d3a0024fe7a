#!/bin/bash
# IN_PLACE_DEPTH (stop 47) through LMCache: fs_native O_DIRECT and kvstream's L2 adapter on one tier, this tree (new)
# against the tree before (base, /tmp/base47), alternating; this machine's disk and a RAM tier (testbed a47's tier0)
OUT=$1; N=${N:-3}; mkdir -p $OUT; cd /tmp
for t in ${TIERS:-disk ram}; do case $t in disk) D=/var/tmp/lm47/t0;; ram) D=/mnt/kvstream-a47/tier0/lm47;; esac
  mkdir -p $D
  for i in $(seq 1 $N); do for tree in base new; do
    case $tree in base) PP=/tmp/base47;; new) PP=/work/main;; esac
    PYTHONPATH=$PP timeout 900 /work/main/.venv-lmcache/bin/kvstream bench $D --fio none --write-baseline none --model llama3-8b \
      --page-size 256 --batch 16 --dataset-batches 1 --batches 9 --policies lmcache-fs-native-odirect,lmcache-kvstream-1tier \
      --json $OUT/$t-$tree-$i.json --no-progress > $OUT/$t-$tree-$i.txt 2>&1
  done; done
done
/work/main/.venv/bin/python - $OUT <<'PY'
import json, glob, sys, statistics, os
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/*.json")):
    p = json.load(open(f))["policies"]
    fs, kv = p["lmcache-fs-native-odirect"], p["lmcache-kvstream-1tier"]
    print(os.path.basename(f), "fs_native %.2f GB/s %.3f s/GB  kvstream %.2f GB/s %.3f s/GB  x %.2f" % (
        fs["median_gbps"], fs["cpu_s_per_gb"], kv["median_gbps"], kv["cpu_s_per_gb"], kv["median_gbps"] / fs["median_gbps"]))
PY
