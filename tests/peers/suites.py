"""The peers' own test suites, taken from their released packages and pointed at kvstream's classes.

* LMCache 0.5.6: its sdist on PyPI (the wheel carries no tests), fetched once with pip into
  ``~/.cache/kvstream-peers`` and checked against its sha256.
* SGLang 0.5.23: the Mooncake-store test its wheel ships (the installed package).

Each suite is rewritten by :data:`REWRITES`: a few literal replacements of import lines and fixture
lines, each of which must occur in the file exactly as many times as listed (an upstream change fails
loudly instead of silently running something else). No assertion is touched; the stand-ins the
rewritten imports name are in ``tests/peers/standins``. Tests that kvstream deliberately answers
differently are listed in :data:`NOT_APPLICABLE` with the reason (docs/lmcache.md, docs/sglang.md).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

LMCACHE_VERSION = "0.5.6"
LMCACHE_SDIST = f"lmcache-{LMCACHE_VERSION}.tar.gz"
LMCACHE_SHA256 = "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e"
SGLANG_VERSION = "0.5.23"
CACHE = Path(os.environ.get("KVSTREAM_PEERS_CACHE", Path.home() / ".cache" / "kvstream-peers"))
STANDINS = Path(__file__).with_name("standins")
ROOT = Path(__file__).resolve().parents[2]  # the tree under test

# What the LMCache suites need from the sdist besides themselves: the peer's own pytest.ini,
# conftests and helpers, at their paths.
LMCACHE_HARNESS = ("pytest.ini", "tests/__init__.py", "tests/v1/__init__.py", "tests/v1/distributed/__init__.py",
                   "tests/v1/distributed/conftest.py", "tests/v1/distributed/utils.py")

_MOCK_IMPORT = ("from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import (\n"
                "    MockL2Adapter,\n    MockL2AdapterConfig,\n)")
_STANDIN_IMPORT = "from kvstream_peer_lmcache import MockL2Adapter, MockL2AdapterConfig"
_PLUGIN_PARAMS = ('            "max_size_gb": 10240 / (1024**3),\n            "mock_bandwidth_gb": 10.0,\n',
                  '            "tiers": [scratch_tier()],\n            "capacity": 10240,  # ~10 KB, as the peer\'s\n')


@dataclass(frozen=True)
class Suite:
    name: str
    path: str  # inside the package (LMCache: the sdist; SGLang: site-packages)
    rewrites: tuple[tuple[str, str, int], ...]  # (old, new, occurrences)
    lmcache: bool = True
    not_applicable: dict[str, str] = field(default_factory=dict)  # test id -> reason (docs)


SUITES = (
    Suite("mock_l2_adapter", "tests/v1/distributed/test_mock_l2_adapter.py",
          ((_MOCK_IMPORT, _STANDIN_IMPORT, 1),),
          not_applicable={
              "TestBandwidthSimulation::test_store_completion_is_delayed_by_bandwidth":
                  "checks the mock's simulated bandwidth (a store of 40 KB must take > 0.1 s); real tiers "
                  "have no bandwidth setting, and kvstream's store completes when its pages are committed",
          }),
    Suite("native_connector_l2_adapter", "tests/v1/distributed/test_native_connector_l2_adapter.py",
          (("from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (\n"
            "    NativeConnectorL2Adapter,\n    _obj_to_memoryview,\n",
            "from kvstream_peer_lmcache import NativeConnectorL2Adapter\n"
            "from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (\n"
            "    _obj_to_memoryview,\n", 1),),
          not_applicable={
              "TestUsageTracking::test_get_usage_without_capacity":
                  "a native connector without max_capacity_gb reports capacity 0 (usage -1: no eviction "
                  "signal); kvstream always knows its tiers' capacity (the setting, else the file system's "
                  "size) and reports it (tests/test_lmcache_peers_contract.py)",
              **{f"TestPadBuffersToAlignment::{t}":
                 "checks which buffer views NativeConnectorL2Adapter hands its connector (logical or padded "
                 "to the physical size), recorded by a mock connector; kvstream is a whole adapter with no "
                 "connector, stages O_DIRECT itself and never touches the padding (docs/lmcache.md, Alignment)"
                 for t in ("test_store_default_uses_logical_size", "test_store_padded_submits_physical_size",
                           "test_load_padded_submits_physical_size", "test_aligned_object_not_padded",
                           "test_non_tensor_object_falls_back_to_byte_array", "test_set_used_size_interplay",
                           "test_usage_reflects_submitted_bytes")},
          }),
    Suite("fault_inject_l2_adapter", "tests/v1/distributed/test_fault_inject_l2_adapter.py",
          ((_MOCK_IMPORT, _STANDIN_IMPORT, 1),)),
    Suite("external_plugin", "examples/lmc_external_l2_adapter/tests/test_plugin.py",
          (("from lmcache.v1.platform import consume_fd\n",
            "from lmcache.v1.platform import consume_fd\nfrom kvstream_peer_lmcache import scratch_tier\n", 1),
           (*_PLUGIN_PARAMS, 2))),
    Suite("distributed_storage_manager", "tests/v1/distributed/test_distributed_storage_manager.py",
          (("from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2AdapterConfig",
            "from kvstream_peer_lmcache import MockL2AdapterConfig", 1),
           # The module skips itself unless an accelerator runtime is up; LMCache's CPU stub reports
           # none, yet its MP storage manager runs on the CPU (as our own tests drive it): run it here.
           ("if not torch_dev.is_available():", "if not torch_dev.is_available() and False:  # kvstream: CPU", 1))),
    Suite("sglang_mooncake_store", "sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py",
          (("from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore",
            "from kvstream_peer_sglang import MooncakeStore, config  # noqa: F401 (config: a fixture)", 1),),
          lmcache=False),
)


def lmcache_sdist() -> Path:
    """The LMCache sdist, fetched with pip on first use (a failure to fetch raises: no skip)."""
    target = CACHE / LMCACHE_SDIST
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        # pip prepares an sdist's metadata even with --no-deps: without CUDA (NO_CUDA_EXT) and without
        # build isolation (which would fetch a CUDA torch); setuptools_scm reads the pretend version.
        env = dict(os.environ, NO_CUDA_EXT="1", NO_NATIVE_EXT="1", SETUPTOOLS_SCM_PRETEND_VERSION=LMCACHE_VERSION)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", f"lmcache=={LMCACHE_VERSION}", "-d", str(CACHE)],
                       env=env, check=True)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != LMCACHE_SHA256:
        raise RuntimeError(f"{target}: sha256 {digest}, expected {LMCACHE_SHA256} (lmcache {LMCACHE_VERSION} "
                           "on PyPI); remove the file to fetch it again")
    return target


def sglang_file(path: str) -> Path:
    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise RuntimeError(f"sglang {version} is installed; the project pins {SGLANG_VERSION}")
    return Path(importlib.metadata.distribution("sglang").locate_file(path))


def rewrite(text: str, suite: Suite) -> str:
    for old, new, times in suite.rewrites:
        found = text.count(old)
        if found != times:
            raise RuntimeError(f"{suite.path}: expected {times} occurrence(s) of {old!r}, found {found}: the "
                               "peer's file changed; review tests/peers/suites.py")
        text = text.replace(old, new)
    return text


def materialize(suite: Suite, work: Path) -> Path:
    """Write the rewritten suite (and, for LMCache, the peer's harness) under ``work``; returns the file."""
    if suite.lmcache:
        prefix = f"lmcache-{LMCACHE_VERSION}/"
        with tarfile.open(lmcache_sdist()) as tar:
            for name in (*LMCACHE_HARNESS, suite.path):
                member = tar.getmember(prefix + name)
                dest = work / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tar.extractfile(member).read())
        target = work / suite.path
        target.write_text(rewrite(target.read_text(), suite))
        return target
    target = work / Path(suite.path).name
    target.write_text(rewrite(sglang_file(suite.path).read_text(), suite))
    (work / "pytest.ini").write_text("[pytest]\n")
    return target


def run(suite: Suite, work: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the rewritten suite in its own process (a crash there is a failed suite, not ours), with
    the tree under test and the stand-ins first on the path; junit results in ``work/results.xml``."""
    target = materialize(suite, work)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(STANDINS), str(work)]),
               LMCACHE_TRACK_USAGE="false")
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "log_cli=false",
           f"--junitxml={work / 'results.xml'}", "--rootdir", str(work), str(target.relative_to(work))]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def outcomes(xml: Path) -> dict[str, str]:
    """``{Class::test[param]: passed|failed|error|skipped}`` from pytest's junit file."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.parse(xml).iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "")
        test_id = name if cls.startswith("test_") else f"{cls}::{name}"
        kinds = {child.tag for child in case}
        out[test_id] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed").replace(
            "failure", "failed")
    return out


def clean(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
