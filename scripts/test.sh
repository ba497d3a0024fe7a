#!/usr/bin/env bash
# The test command: builds the environment from scratch if needed (system packages as root or via sudo,
# .venv with the real sglang 0.5.23 on CPU torch, .venv-lmcache with the real LMCache 0.5.6),
# then runs the whole suite. In CI (CI=true) a skipped test counts as a failure: the io_uring,
# sglang and LMCache tests must run, not skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
bash scripts/setup-lmcache-env.sh
export KVSTREAM_STRICT=${KVSTREAM_STRICT:-${CI:+1}}
export KVSTREAM_REQUIRE_URING=${KVSTREAM_REQUIRE_URING:-${CI:+1}}
status=0
echo "== kvstream-hicache: engine, io_uring, sglang, kvsim, bench, examples"
.venv/bin/python -m pytest -q --durations=10 -m "not lmcache" "$@" || status=$?
echo "== kvstream-hicache: LMCache adapter and LMCache's own L2-adapter suites (separate venv, real lmcache)"
.venv-lmcache/bin/python -m pytest -q -m lmcache tests/test_lmcache*.py tests/peers "$@" || status=$?
exit $status
