#!/usr/bin/env bash
# The main job on an embedded default: the real SGLang HiCache controller on the CPU, two tiers
# (throttled loop-device tiers when run as root, plain temporary directories otherwise), an agentic
# workload, kvstream against sglang's own file backend. Extra arguments go to the demo
# (e.g. --tiers /mnt/nvme/kv:/mnt/pfs/kv). Runs as root (containers: no sudo needed) or as a user;
# the system packages come through sudo then (scripts/system-deps.sh).
# --server: the same A/B through real sglang servers on the CPU (kvstream serve-cpu's tiny model, served by
# examples/serve_swebench.py --cpu), a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python -m kvstream_hicache.tools.demo "$@"
