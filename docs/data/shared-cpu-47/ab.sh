#!/bin/bash
# Interleaved put A/B on one tier: ab.sh DIR ROUNDS OUT REF_TREE CAND_TREE. Each round runs both trees
# (the order alternates), 3 puts of 256 x 256 KiB each (put_cpu.py: MB/s, process CPU s/GB), then
# write_threads.py DIR 4 (files written directly by 4 threads) for reference.
G=$1; R=$2; OUT=$3; REF=$4; CAND=$5; HERE=$(cd "$(dirname "$0")" && pwd); : > "$OUT"
for r in $(seq 1 "$R"); do
  if [ $((r % 2)) = 1 ]; then order="$REF $CAND"; else order="$CAND $REF"; fi
  for tree in $order; do
    (cd /tmp && PYTHONPATH=$tree python "$HERE/put_cpu.py" "$G" 256 256 3) | sed "s|^RESULT|$r $tree|" >> "$OUT"
  done
  (cd /tmp && python "$HERE/../shared-cpu-45/write_threads.py" "$G" 4) | sed "s|^|$r direct |" >> "$OUT"
done
