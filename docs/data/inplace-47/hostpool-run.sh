#!/bin/bash
# IN_PLACE_DEPTH (stop 47, not taken): the SGLang adapter on one tier, in place, 128 MiB in flight (indepth128M) against main (the ceiling) and nixl
# run.sh OUT: this machine's disk (/var/tmp/hp47) and a RAM tier (testbed a47's tier0), 8 MiB / 1 MiB / 256 KiB pages,
# 256 MiB and 64 MiB calls
cd /work/main; OUT=$1; R=${R:-7}; mkdir -p $OUT
for t in disk ram; do case $t in disk) D=/var/tmp/hp47;; ram) D=/mnt/kvstream-a47/tier0;; esac
  for P in 64 8 2; do for MB in 256 64; do
    case $P in 64) B=$((MB / 8));; 8) B=$MB;; 2) B=$((MB * 4));; esac
    .venv/bin/python benchmarks/bench_hostpool.py $D $P $B $R nixl adapter-1tier-indepth128M adapter-1tier 2>/dev/null > $OUT/$t-P$P-$MB.txt
  done; done
done
echo done > $OUT/DONE
