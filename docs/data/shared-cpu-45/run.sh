#!/bin/bash
# The held rule (flow.SlowerTiers) against the open rule and the slower tier always held, on A, B and dfs
cd /work/main
OUT=$1; R=${R:-16}; mkdir -p $OUT
run() { # name dirs group P...
  local name=$1 dirs=$2 group=$3; shift 3
  [ -n "$group" ] && echo $$ > /sys/fs/cgroup/blkio/kvstream-$group/cgroup.procs
  for P in "$@"; do case $P in 2) B=2048;; 8) B=512;; 64) B=64;; esac
    [ $name = dfs ] && B=$((B / 8))
    .venv/bin/python benchmarks/bench_hostpool.py $dirs $P $B $R nixl adapter-1tier adapter adapter-open adapter-slowcap 2>/dev/null > $OUT/$name-P$P.txt
  done
}
run dfs /var/lib/kvstream-testbed/o45-tier0,/var/lib/kvstream-testbed/o45-tier1-gluster/a "" 2 8 64
run ramA /mnt/kvstream-a45/tier0,/mnt/kvstream-a45/tier1 a45 2 8 64
run diskB /var/lib/kvstream-testbed/b45-tier0,/mnt/kvstream-b45/tier1 b45 2 8 64
