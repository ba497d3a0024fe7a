#!/bin/bash
# flow.SlowerTiers (open or held, a call after the other rule taken again) against each rule taken always, on dfs, A and B:
# [PAGES="2 8 64"] run.sh OUT TESTBEDS (dfs ramA diskB), after `kvstream testbed up --profile dfs|ram-0.7|disk+ram-0.7 --name o46|a46|b46 --no-fio`
cd /work/main
OUT=$1; shift; R=${R:-12}; mkdir -p $OUT
run() { # name dirs group P...
  local name=$1 dirs=$2 group=$3 P B; shift 3
  [ -n "$group" ] && echo $$ > /sys/fs/cgroup/blkio/kvstream-$group/cgroup.procs
  for P in "$@"; do case $P in 2) B=2048;; 8) B=512;; 64) B=64;; esac
    B=$((B / 8))  # 64 MiB a call: a request's prefix, and calls enough for the rule to learn from
    .venv/bin/python benchmarks/bench_hostpool.py $dirs $P $B $R nixl adapter-1tier adapter adapter-countall adapter-open adapter-held 2>/dev/null > $OUT/$name-P$P.txt
  done
}
for t in "$@"; do case $t in
  dfs) run dfs /var/lib/kvstream-testbed/o46-tier0,/var/lib/kvstream-testbed/o46-tier1-gluster/a "" ${PAGES:-2 8 64};;
  ramA) run ramA /mnt/kvstream-a46/tier0,/mnt/kvstream-a46/tier1 a46 ${PAGES:-2 8 64};;
  diskB) run diskB /var/lib/kvstream-testbed/b46-tier0,/mnt/kvstream-b46/tier1 b46 ${PAGES:-2 8 64};;
esac; done
