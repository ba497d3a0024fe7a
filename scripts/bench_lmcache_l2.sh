#!/usr/bin/env bash
# LMCache 0.5.6's own L2 benchmark (`lmcache bench l2`, round-trip check on) against kvstream's adapter as
# a `plugin` and against LMCache's fs_native adapter (buffered, its default, and O_DIRECT), on the same
# disk, in one run (docs/benchmarks.md). Each contender runs twice, with 2 and with 30 measured rounds:
# throughput is the 30-round run's, and CPU s/GB is the difference in the process's CPU time (user+sys)
# over the difference in bytes moved (store + load), so start-up and imports cancel out.
# Prints one JSON line per contender. Usage: bash scripts/bench_lmcache_l2.sh [scratch dir] (default /var/tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv-lmcache/bin/python}
LMCACHE=${LMCACHE:-$(dirname "$PY")/lmcache}
root=$(mktemp -d "${1:-/var/tmp}/kvstream-bench-l2-XXXXXX")
trap 'rm -rf "$root"' EXIT
export LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
args=(--num-keys 32 --in-flight 4 --data-size-kb 256 --l1-align-bytes 4096 --warmup-rounds 1 --no-skip-verify
      --format json)
for name in kvstream fs_native fs_native_odirect; do
  for rounds in 2 30; do
    run="$root/$name-$rounds"
    rm -rf "$run.d" && mkdir -p "$run.d"
    case $name in
      kvstream) spec='{"type":"plugin","module_path":"kvstream_hicache.lmcache.adapter","class_name":"KVStreamL2Adapter","adapter_params":{"tiers":["'"$run.d"'"]}}' ;;
      fs_native) spec='{"type":"fs_native","base_path":"'"$run.d"'"}' ;;
      fs_native_odirect) spec='{"type":"fs_native","base_path":"'"$run.d"'","use_odirect":true}' ;;
    esac
    /usr/bin/time -f '%U %S' -o "$run.cpu" "$LMCACHE" bench l2 --l2-adapter "$spec" --rounds "$rounds" "${args[@]}" \
      --output "$run.json" > "$run.log" 2>&1 || { cat "$run.log"; exit 1; }
    grep -q "data verified OK" "$run.log" || { echo "$name: round-trip verification did not pass"; cat "$run.log"; exit 1; }
  done
  "$PY" - "$name" "$root/$name" <<'PY'
import json, sys
name, base = sys.argv[1:]
def run(rounds):
    m = json.load(open(f"{base}-{rounds}.json"))["metrics"]
    user, sys_s = map(float, open(f"{base}-{rounds}.cpu").read().split()[-2:])
    cfg = m["config"]
    moved = 2 * (cfg["measurement_rounds"] + cfg["warmup_rounds"]) * cfg["data_per_round_mb"] / 1024  # GB
    return {m[k]["operation"]: m[k] for k in m if k.startswith("op_")}, user + sys_s, moved
ops, cpu30, gb30 = run(30)
_, cpu2, gb2 = run(2)
print(json.dumps({"adapter": name, "store_MBps": ops["Store"]["throughput_avg_mbps"],
                  "load_MBps": ops["Load"]["throughput_avg_mbps"], "lookup_ms": ops["Lookup"]["duration_avg_ms"],
                  "cpu_s_per_GB": round((cpu30 - cpu2) / (gb30 - gb2), 2)}))
PY
done
