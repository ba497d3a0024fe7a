#!/usr/bin/env bash
# Sensitivity of the budget slack H (budget:h=home+H) across generator seeds: high reuse (SWE-bench default)
# and the 4%-reuse loss case, both write paths. Output: OUT/<case>.s<seed>.t<tb>.<model>.json
set -euo pipefail
OUT=${OUT:-budget-out/hsweep}
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
POL=tier0,kvstream,budget:h=home,budget:h=home+0.3,budget:h=home+0.5,budget:h=home+1,budget:h=home+1.5,budget:h=home+2,budget:h=home+3
mkdir -p "$OUT"
for case in swe swe-r04; do
  extra=""; [ $case = swe-r04 ] && extra="--reuse 0.04"
  for seed in 0 1 2 3; do for tb in 1 2; do for m in deferred sync; do
    f="$OUT/$case.s$seed.t$tb.$m.json"; [ -s "$f" ] && continue
    PYTHONPATH=$(dirname "$0")/.. nice "$PY" -m kvstream_hicache.tools.sim.cli --workload swebench $extra --seed $seed \
      --testbed $tb --write-model $m --read-priority tier --capacities 80G --policies $POL --json "$f" > /dev/null
  done; done; done
done
