#!/bin/bash
# Stop 41: this stop's tree (new: /work/main) against 8101dc5 (old: stop 40's main, a worktree at
# /tmp/old41 first on PYTHONPATH), through sglang's host pool on RAM testbed A; nixl in every run as the
# reference. ROUNDS: round numbers; TREES: the order within a round (default "new old"; rounds 7-10 and
# 15, 17 ran "old new"; rounds 11-14 "nogate new old", nogate = /tmp/nogate, this tree with the gate's
# leave/back around the reaps removed); GEOS: "8 512" and/or "2 2048" (rounds 7-14: 1 MiB only).
echo $$ > /sys/fs/cgroup/blkio/kvstream-A/cgroup.procs
cd /work/main
IFS=, read -r -a GEO_LIST <<< "${GEOS:-8 512,2 2048}"
for round in $ROUNDS; do
  for tree in ${TREES:-new old}; do
    for geo in "${GEO_LIST[@]}"; do
      rm -rf /mnt/kvstream-A/tier0/hostpool-* /mnt/kvstream-A/tier1/hostpool-*
      case $tree in old) PP=/tmp/old41;; nogate) PP=/tmp/nogate;; *) PP=/work/main;; esac
      echo "=== round $round tree $tree geo $geo"
      PYTHONPATH=$PP flock /var/tmp/kvstream-bench.lock .venv/bin/python benchmarks/bench_hostpool.py \
        /mnt/kvstream-A/tier0,/mnt/kvstream-A/tier1 $geo 5 nixl adapter-1tier adapter
    done
  done
done
