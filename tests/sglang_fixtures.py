"""Fixtures shared by the tests/test_sglang_*.py modules: the real sglang 0.5.23 on the CPU.

Importing this module installs the torchvision/triton stubs (kvstream_hicache.tools.cpu_sglang) before anything
imports sglang, and loads sglang's plugins through the installed entry point, exactly as a scheduler process
does. Without sglang installed the importing module is skipped (a failure under KVSTREAM_STRICT=1, i.e. CI).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

# find_spec, not importorskip: importing sglang before the stubs are in place fails on a CPU host.
for _pkg in ("sglang", "torch"):
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(f"{_pkg} is not installed: scripts/setup-env.sh installs the real sglang 0.5.23 and CPU torch",
                    allow_module_level=True)

from kvstream_hicache.tools import cpu_sglang  # noqa: E402

cpu_sglang.install_stubs()

PAGE = 16  # tokens per page: small pages keep the controller tests fast


@pytest.fixture(scope="session")
def plugin_loaded():
    """sglang's own ``load_plugins()``: runs kvstream's entry point (what every scheduler process does)."""
    cpu_sglang.load_kvstream_plugin()
    return True


@pytest.fixture
def drivers():
    """Factory of ControllerDrivers, closed (threads stopped, backend closed) at teardown in reverse order."""
    made: list[cpu_sglang.ControllerDriver] = []

    def make(pools, backend="kvstream", **kw):
        drv = cpu_sglang.ControllerDriver(pools, backend, **kw)
        made.append(drv)
        return drv

    yield make
    for drv in reversed(made):
        drv.close()


def tiers_config(dirs, **extra):
    """Extra config for a kvstream backend on ``dirs`` (as sglang passes it, parsed)."""
    return {"tiers": list(dirs), "tier_retry": 0.2, **extra}


def round_trip(drv, pools, n_pages: int, seed: int):
    """Back up ``n_pages`` fresh random pages, then prefetch them into new host slots.

    Returns (tokens, source host indices, prefetch result). The caller frees nothing: pools are per test.
    """
    tokens = cpu_sglang.random_tokens(n_pages * pools.page_size, seed=seed)
    src = cpu_sglang.fill_random(pools, len(tokens), seed=seed)
    stored = drv.backup(tokens, src)
    assert stored == len(tokens), f"backup stored {stored} of {len(tokens)} tokens"
    got = drv.prefetch(tokens)
    return tokens, src, got


def run_python(code: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this venv (the CPU stubs are the caller's business)."""
    full_env = dict(os.environ)
    full_env.pop("SGLANG_PLUGINS", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout)
