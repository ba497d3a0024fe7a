"""``kvstream bench`` in the LMCache venv: LMCache 0.5.6's own ``fs_native`` L2 adapter (O_DIRECT and
buffered) beside kvstream's L2 adapter, each built by LMCache's parser and factory and driven through
the L2 task interface with a real L1 arena, on temporary directories. It proves the contenders run
and read back the right bytes; the figures mean nothing here.

Run: ``.venv-lmcache/bin/python -m pytest -q -m lmcache tests/test_lmcache_bench.py``
"""
from __future__ import annotations

import json
import os

import pytest

from kvstream_hicache.tools import cli

pytestmark = [pytest.mark.lmcache, pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no telemetry from tests

POLICIES = "kvstream,lmcache-fs-native,lmcache-fs-native-odirect,lmcache-kvstream,lmcache-kvstream-1tier"


def test_bench_drives_lmcache_l2_adapters(tmp_path, tier_dirs):
    pytest.importorskip("lmcache", reason="needs the LMCache venv (scripts/setup-lmcache-env.sh)")
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", *tier_dirs[:2], "--page-bytes", "131072", "--batch", "16", "--batches", "2",
                   "--warmup", "1", "--verify", "-1", "--no-progress", "--write-baseline", "none",
                   "--policies", POLICIES, "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    pol = doc["policies"]
    assert doc["wrong_pages"] == {}
    for name in POLICIES.split(",")[1:]:
        p = pol[name]
        assert p["batches"] == 2 and p["missing_pages"] == 0, name
        assert p["throughput_gbps"] > 0 and p["cpu_s_per_gb"] > 0 and doc["write"][name]["seconds"] > 0, name
        assert p["speedup_vs_lmcache-fs-native-odirect"] > 0, name
    assert pol["lmcache-fs-native"]["page_cache_bytes"] > 0  # buffered: what it read stays cached
    assert "page_cache_bytes" not in pol["lmcache-fs-native-odirect"]
    assert pol["lmcache-kvstream-1tier"]["share"] == [1.0, 0.0]
    assert sum(pol["lmcache-kvstream"]["share"]) == pytest.approx(1.0)
    assert pol["lmcache-kvstream"]["memory_peak_bytes"] > 0
    assert pol["lmcache-fs-native-odirect"]["memory_peak_bytes"] is None
    assert not any(os.listdir(d) for d in tier_dirs[:2])
