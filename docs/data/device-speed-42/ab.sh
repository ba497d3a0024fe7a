#!/bin/bash
# Stop 42: this stop's tree (new: /work/main) against 32de312 (old: stop 41's main, a worktree at
# /tmp/old42 first on PYTHONPATH), through sglang's host pool on RAM testbed A; nixl in every run as the
# reference. ROUNDS: round numbers; TREES: the order within a round (default "new old"; the even rounds
# ran "old new"); GEOS: "8 512" (1 MiB pages) and/or "2 2048" (256 KiB pages).
echo $$ > /sys/fs/cgroup/blkio/kvstream-A/cgroup.procs
cd /work/main
IFS=, read -r -a GEO_LIST <<< "${GEOS:-8 512,2 2048}"
for round in $ROUNDS; do
  for tree in ${TREES:-new old}; do
    for geo in "${GEO_LIST[@]}"; do
      rm -rf /mnt/kvstream-A/tier0/hostpool-* /mnt/kvstream-A/tier1/hostpool-*
      case $tree in old) PP=/tmp/old42;; *) PP=/work/main;; esac
      echo "=== round $round tree $tree geo $geo"
      PYTHONPATH=$PP flock /var/tmp/kvstream-bench.lock .venv/bin/python benchmarks/bench_hostpool.py \
        /mnt/kvstream-A/tier0,/mnt/kvstream-A/tier1 $geo 5 nixl adapter-1tier adapter
    done
  done
done
