#!/bin/bash
# Stop 41: this stop's tree (new: /work/main) against 8101dc5 (old: stop 40's main, a worktree first on
# PYTHONPATH), alternated, through sglang's host pool on RAM testbed A; nixl in every run as the reference.
echo $$ > /sys/fs/cgroup/blkio/kvstream-A/cgroup.procs
cd /work/main
GEOS=("8 512" "2 2048")
for round in $ROUNDS; do
  for tree in new old; do
    for geo in "${GEOS[@]}"; do
      rm -rf /mnt/kvstream-A/tier0/hostpool-* /mnt/kvstream-A/tier1/hostpool-*
      if [ $tree = old ]; then PP=/tmp/old41; else PP=/work/main; fi
      echo "=== round $round tree $tree geo $geo"
      PYTHONPATH=$PP flock /var/tmp/kvstream-bench.lock .venv/bin/python benchmarks/bench_hostpool.py \
        /mnt/kvstream-A/tier0,/mnt/kvstream-A/tier1 $geo 5 nixl adapter-1tier adapter
    done
  done
done
