"""Stand-ins that put kvstream's LMCache adapter where LMCache's own tests build theirs.

Imported by the peer suites as rewritten by tests/peers/suites.py (in place of LMCache's
``MockL2Adapter``/``MockL2AdapterConfig`` and ``NativeConnectorL2Adapter``): each call opens a real
:class:`KVStreamL2Adapter` over a fresh tier directory with O_DIRECT support, with the capacity the
peer's fixture asked for. Nothing here changes what a test checks.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

# Disk-backed scratch (O_DIRECT: /tmp may be tmpfs), removed when the suite's process ends.
ROOT = tempfile.mkdtemp(prefix="kvstream-peers-", dir=os.environ.get("KVSTREAM_TEST_DIR", "/var/tmp"))
atexit.register(shutil.rmtree, ROOT, True)
GIB = 1 << 30


def scratch_tier() -> str:
    """A new empty tier directory."""
    return tempfile.mkdtemp(dir=ROOT)


def plugin_config(capacity_bytes: int | None) -> Any:
    """LMCache's own plugin config for kvstream's adapter over a fresh tier (``type: plugin``)."""
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

    params: dict[str, Any] = {"tiers": [scratch_tier()]}
    if capacity_bytes:
        params["capacity"] = capacity_bytes
    return PluginL2AdapterConfig.from_dict({"type": "plugin", "module_path": "kvstream_hicache.lmcache.adapter",
                                            "class_name": "KVStreamL2Adapter", "adapter_params": params})


def MockL2AdapterConfig(max_size_gb: float, mock_bandwidth_gb: float = 0.0) -> Any:  # noqa: N802 (the peer's name)
    """The mock's capacity carries over; its simulated bandwidth has no meaning for real tiers."""
    return plugin_config(int(max_size_gb * GIB))


def MockL2Adapter(config: Any) -> Any:  # noqa: N802
    """Built by LMCache's factory, as the storage manager builds its adapters."""
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    return create_l2_adapter_from_registry(config)


def NativeConnectorL2Adapter(connector: Any, max_capacity_gb: float | None = None, **_: Any) -> Any:  # noqa: N802
    """The peer wraps a connector object; kvstream is a whole adapter, so the connector is unused
    (closed here: its eventfd is the only thing it holds)."""
    connector.close()
    return MockL2Adapter(plugin_config(int(max_capacity_gb * GIB) if max_capacity_gb else None))
