#!/usr/bin/env bash
# kvsim matrix for issue 15 item 3 (replicas within budget): every public trace, the SWE-bench generator and the
# paper's loss cases, both testbeds, four write models. One process at a time (2-core host). Output: OUT/<case>.json
set -euo pipefail
OUT=${OUT:-budget-out/matrix}
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
TR=${TR:-$(dirname "$0")/../data/traces/mooncake}
mkdir -p "$OUT"
POL=${POL:-tier0,kvstream,static-auto,static-0.9,replicate-share-0.4,replicate-after-slow,budget:h=window,budget:h=staging,budget:h=home,budget:h=home+quiet,budget:h=home+put,budget:h=0.1,budget:h=0.3,budget:h=1,budget:h=3,budget:h=10,budget:h=home+0.3,budget:h=home+1,budget:h=home+3}
declare -A W=(
  [conv]="--trace $TR/conversation_trace.jsonl"
  [synth]="--trace $TR/synthetic_trace.jsonl"
  [swe]="--workload swebench"
  [swe-r77]="--workload swebench --reuse 0.77"
  [swe-r04]="--workload swebench --reuse 0.04"
  [synth-M1280]="--trace $TR/synthetic_trace.jsonl --memory 1280G"
  [conv-M1280]="--trace $TR/conversation_trace.jsonl --memory 1280G"
)
declare -A M=(
  [legacy]="--write-model legacy --read-priority step"
  [deferred]="--write-model deferred --read-priority tier"
  [sync]="--write-model sync --read-priority tier"
  [deferred-if32M]="--write-model deferred --read-priority tier --write-inflight 32M"
)
for w in ${WORKLOADS:-conv synth swe swe-r77 swe-r04 synth-M1280 conv-M1280}; do
  for tb in 1 2; do
    for m in ${MODELS:-legacy deferred sync deferred-if32M}; do
      f="$OUT/$w.t$tb.$m.json"
      [ -s "$f" ] && continue
      PYTHONPATH=$(dirname "$0")/.. nice "$PY" -m kvstream_hicache.tools.sim.cli ${W[$w]} --testbed $tb ${M[$m]} \
        --policies "$POL" --capacities 80G --json "$f" > "${f%.json}.txt"
      echo "$w t$tb $m: $(tail -1 "${f%.json}.txt")"
    done
  done
done
