"""The package layout: core, adapters (sglang/, lmcache/), tools/; the import paths users type keep working."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest


def _entry_point(group: str, name: str) -> importlib.metadata.EntryPoint:
    (ep,) = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
    return ep


# -- old import paths: thin re-exports of the very same objects ---------------------------------------
def test_old_sglang_backend_path_is_the_same_class():
    if importlib.util.find_spec("sglang") is None:  # the backend imports the real sglang and torch (.venv)
        pytest.skip("sglang is not installed: scripts/setup-env.sh installs it")
    from kvstream_hicache.tools import cpu_sglang

    cpu_sglang.install_stubs()
    from kvstream_hicache.hicache import KVStreamHiCacheStorage as old
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    assert old is KVStreamHiCacheStorage


def test_old_lmcache_adapter_path_names_the_same_attribute_without_lmcache():
    """The class itself needs LMCache (tests/test_lmcache_adapter.py loads it through LMCache from the old
    path); the old module imports without it, and forwards exactly that one name."""
    from kvstream_hicache import lmcache_adapter

    assert lmcache_adapter.__all__ == ["KVStreamL2Adapter"]
    with pytest.raises(AttributeError):
        lmcache_adapter.L2Core  # noqa: B018  (only the documented name is re-exported)


def test_old_plugin_path_is_the_same_function():
    from kvstream_hicache import plugin
    from kvstream_hicache.sglang import plugin as new

    assert plugin.register is new.register


def test_sglang_entry_point_loads_register():
    from kvstream_hicache.sglang.plugin import register

    assert _entry_point("sglang.srt.plugins", "kvstream").load() is register


@pytest.mark.parametrize("command,module", [("kvstream", "kvstream_hicache.tools.cli"),
                                            ("kvsim", "kvstream_hicache.tools.sim.cli")])
def test_commands_run(command, module):
    assert _entry_point("console_scripts", command).load() is importlib.import_module(module).main
    script = os.path.join(os.path.dirname(sys.executable), command)  # installed beside this interpreter
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {command}"), proc.stderr
