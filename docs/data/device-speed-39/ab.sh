#!/bin/bash
# Stop 39: the tree of this stop (new: /work/main) against 754414c (old: a worktree, first on PYTHONPATH),
# alternated, through sglang's host pool on RAM testbed A; nixl in every run as the reference.
# ROUNDS and GEOS were "1 2" / "8 512" "2 2048" (ramA-ab1), "3 4 5" / both (ramA-ab2), "6 7 8 9" / "2 2048" (ramA-ab3).
echo $$ > /sys/fs/cgroup/blkio/kvstream-A/cgroup.procs
cd /work/main
for round in $ROUNDS; do
  for tree in new old; do
    for geo in "${GEOS[@]}"; do
      rm -rf /mnt/kvstream-A/tier0/hostpool-* /mnt/kvstream-A/tier1/hostpool-*
      if [ $tree = old ]; then PP=/tmp/s39/head; else PP=/work/main; fi
      echo "=== round $round tree $tree geo $geo"
      PYTHONPATH=$PP flock /var/tmp/kvstream-bench.lock .venv/bin/python benchmarks/bench_hostpool.py \
        /mnt/kvstream-A/tier0,/mnt/kvstream-A/tier1 $geo 5 nixl adapter-1tier adapter
    done
  done
done
