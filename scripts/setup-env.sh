#!/usr/bin/env bash
# Build the development/test environment from scratch on Debian/Ubuntu:
#   system packages (scripts/system-deps.sh: as root, or through sudo): liburing-dev, pkg-config, gcc, fio
#   .venv with CPU torch 2.13.0, the real sglang 0.5.23 (--no-deps) and the few
#   packages its import chain needs, the peers extra of pyproject.toml (nixl, for kvstream bench's
#   hicache-nixl contenders), then this package and its tools (kvstream-hicache-tools/) in editable mode.
# Idempotent: a second run only re-checks. Downloads are cached in ~/.cache/pip,
# never in the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVSTREAM_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_INDEX=${KVSTREAM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

bash scripts/system-deps.sh

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
CONSTRAINTS=scripts/constraints.txt   # keeps a CUDA torch from ever being pulled in
# The peers extra as pyproject.toml lists it (one place for its pins); the editable install below is
# --no-deps, so extras are installed here. nixl's wheels (~430 MB) bring libaio and liburing of their own.
PEERS=$("$PY" - <<'PY'
import re
text = open("pyproject.toml").read()
try:
    import tomllib
    print(" ".join(tomllib.loads(text)["project"]["optional-dependencies"]["peers"]))
except ImportError:  # Python 3.10 has no tomllib: the extra is one line
    print(" ".join(re.findall(r'"([^"]+)"', re.search(r"^peers = \[(.*)\]$", text, re.M).group(1))))
PY
)
stamp="$VENV/.kvstream-deps-$( (sha1sum scripts/setup-env.sh "$CONSTRAINTS"; echo "$PEERS") | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
  echo "[setup] installing Python packages into $VENV (torch CPU, sglang 0.5.23, test tools)"
  "$PIP" install -q --upgrade pip setuptools wheel
  # torch 2.13.0+cpu (the constraint) is on PyTorch's CPU index, not on PyPI: pip's own indexes first (a
  # mirror or wheel directory that has it), then that index (KVSTREAM_TORCH_INDEX)
  "$PIP" install -q -c "$CONSTRAINTS" torch==2.13.0 2>/dev/null || {
    echo "[setup] torch 2.13.0+cpu is not on pip's indexes here: from PyTorch's CPU index $TORCH_INDEX"
    "$PIP" install -q -c "$CONSTRAINTS" --extra-index-url "$TORCH_INDEX" torch==2.13.0
  }
  "$PIP" install -q --no-deps sglang==0.5.23
  "$PIP" install -q -c "$CONSTRAINTS" numpy orjson psutil pybase64 requests packaging pillow starlette \
    msgspec pydantic pyzmq tqdm IPython aiohttp transformers==5.19.0 dill apache-tvm-ffi==0.1.11 \
    sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf prometheus_client \
    cython pytest pytest-benchmark pytest-timeout hypothesis matplotlib
  # what a real `sglang.launch_server` imports (kvstream serve-cpu, tests/test_sglang_server.py); the same
  # list as kvstream_hicache/tools/serve_cpu.py SERVER_MODULES. xgrammar brings triton (harmless on a CPU).
  "$PIP" install -q -c "$CONSTRAINTS" fastapi "uvicorn>=0.51" uvloop setproctitle python-multipart \
    partial_json_parser zstandard einops watchfiles distro openai==2.8.0 tiktoken jsonschema xgrammar soundfile
  echo "[setup] installing the peers extra into $VENV: $PEERS"
  # shellcheck disable=SC2086  # one requirement per word
  "$PIP" install -q -c "$CONSTRAINTS" $PEERS
  touch "$stamp"
fi
echo "[setup] building kvstream_hicache (Cython io_uring extension)"
# compat: the checkout itself goes on sys.path, so kvstream_hicache is the regular package from any working
# directory; the default finder loses to the tools distribution's namespace portion of kvstream_hicache
# (child processes and servers started elsewhere imported an empty namespace package).
"$PIP" install -q --no-build-isolation --no-deps --config-settings editable_mode=compat -e . >/dev/null
# The commands (kvstream, kvsim), bench, simulator and demo: their own distribution, not in a worker's install
"$PIP" install -q --no-build-isolation --no-deps -e ./kvstream-hicache-tools >/dev/null
echo "[setup] ready: $VENV"
