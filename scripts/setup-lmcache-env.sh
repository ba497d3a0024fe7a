#!/usr/bin/env bash
# Build the LMCache test environment: a SEPARATE venv (.venv-lmcache) with lmcache 0.5.6 on CPU torch,
# kept apart from .venv because lmcache pins numpy<=2.2.6 and prometheus_client<=0.24.1, which sglang's
# environment does not.
#
#   lmcache is installed --no-deps, then only what its storage layer, the MP storage manager, the L2
#   adapters and `lmcache server` import on a CPU host (the wheel's full dependency list drags in
#   cupy-cuda13x and cuda-python: ~1.9 GB for nothing on CPU). numba is required: without it lmcache
#   runs in "CLI-only mode" and lmcache.device_ops is missing.
#   scripts/constraints-lmcache.txt pins torch==2.13.0+cpu so nothing can pull a CUDA torch.
#   kvstream_hicache is then installed editable (--no-build-isolation --no-deps) into the same venv.
#
# Idempotent: a second run only re-checks the stamp and rebuilds the extension. Needs liburing-dev and
# pkg-config (scripts/system-deps.sh installs them as root, as in CI, or through sudo).
# Usage: bash scripts/setup-lmcache-env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVSTREAM_LMCACHE_VENV:-.venv-lmcache}
PY=${PYTHON:-python3}
TORCH_INDEX=${KVSTREAM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
CONSTRAINTS=scripts/constraints-lmcache.txt

bash scripts/system-deps.sh

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
stamp="$VENV/.kvstream-lmcache-deps-$(sha1sum scripts/setup-lmcache-env.sh "$CONSTRAINTS" | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
  echo "[setup-lmcache] installing lmcache 0.5.6 + CPU torch into $VENV"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" --upgrade pip "setuptools>=77" wheel
  # (torch 2.13.0+cpu: pip's own indexes first, then PyTorch's CPU index, as setup-env.sh)
  "${PIP[@]}" install -q -c "$CONSTRAINTS" torch==2.13.0 2>/dev/null || {
    echo "[setup-lmcache] torch 2.13.0+cpu is not on pip's indexes here: from PyTorch's CPU index $TORCH_INDEX"
    "${PIP[@]}" install -q -c "$CONSTRAINTS" --extra-index-url "$TORCH_INDEX" torch==2.13.0
  }
  "${PIP[@]}" install -q -c "$CONSTRAINTS" --no-deps lmcache==0.5.6
  # What lmcache 0.5.6 imports on CPU for: the storage managers, L2 adapters, `lmcache server`.
  "${PIP[@]}" install -q -c "$CONSTRAINTS" numba numpy pyyaml requests cachetools sortedcontainers \
    prometheus_client py-cpuinfo psutil aiohttp aiofile aiofiles msgspec pyzmq transformers cryptography \
    opentelemetry-api opentelemetry-sdk opentelemetry-exporter-prometheus fastapi uvicorn httptools httpx \
    safetensors blake3 \
    cython pytest pytest-timeout hypothesis \
    setuptools_scm  # tests/peers: pip prepares the LMCache sdist's metadata (its tests are not in the wheel)
  "$VENV/bin/python" - <<'PY'
import torch
assert torch.version.cuda is None, f"CUDA torch {torch.__version__} got in: check scripts/constraints-lmcache.txt"
PY
  touch "$stamp"
fi
# Rebuild only when needed: an editable install recompiles the extension and rewrites the shared .so
# in place, under any process of the other venv that has it loaded.
so=$(ls kvstream_hicache/_uring*.so 2>/dev/null | head -n 1 || true)
if "$VENV/bin/python" -m pip show kvstream-hicache >/dev/null 2>&1 && [ -n "$so" ] \
    && [ -z "$(find _uring setup.py pyproject.toml -newer "$so" -type f 2>/dev/null)" ]; then
  echo "[setup-lmcache] kvstream_hicache already installed in $VENV (editable), extension current"
else
  echo "[setup-lmcache] building kvstream_hicache (editable) into $VENV"
  # compat: see setup-env.sh (kvstream_hicache must not resolve to the tools' namespace portion)
  "${PIP[@]}" install -q --no-build-isolation --no-deps --config-settings editable_mode=compat -e . >/dev/null
fi
if ! "$VENV/bin/python" -m pip show kvstream-hicache-tools >/dev/null 2>&1; then  # kvstream, kvsim, bench
  "${PIP[@]}" install -q --no-build-isolation --no-deps -e ./kvstream-hicache-tools >/dev/null
fi
"$VENV/bin/python" -c "import lmcache.v1.distributed.l2_adapters.base, lmcache.lmcache_native, torch; \
print('[setup-lmcache] ready:', '$VENV', 'lmcache', __import__('importlib.metadata').metadata.version('lmcache'), 'torch', torch.__version__)"
