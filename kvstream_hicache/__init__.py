"""kvstream-hicache: multi-tier replicated KV-cache storage with io_uring and completion-driven routing.

The package import is light (the SGLang plugin imports it in every process): the public names
below load their modules on first use.

    from kvstream_hicache import Engine, Config, Namespace
    engine = Engine(Config.from_sources({"tiers": ["/nvme/kv", "/pfs/kv"]}), Namespace({...}))
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from .errors import LOGGERS, PrintableArgs

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "engine",
    "Segment": "segments",
    "Config": "config",
    "TierConfig": "config",
    "Capacity": "config",
    "Namespace": "layout",
    "validate_key": "layout",
    "KVStreamError": "errors",
    "ConfigError": "errors",
    "TierError": "errors",
    "InvalidKeyError": "errors",
    "EngineClosedError": "errors",
    "Problem": "integrity",
    "check_tiers": "integrity",
    "parse_policy": "router",
}
__all__ = sorted(_EXPORTS) + ["__version__"]

# a path found in a tier is another user's words: never a raw newline or escape in the log (errors.printable)
for _name in LOGGERS:
    logging.getLogger(_name).addFilter(PrintableArgs())
del _name

if TYPE_CHECKING:  # pragma: no cover
    from .config import Capacity, Config, TierConfig
    from .engine import Engine
    from .errors import ConfigError, EngineClosedError, InvalidKeyError, KVStreamError, TierError
    from .integrity import Problem, check_tiers
    from .layout import Namespace, validate_key
    from .router import parse_policy
    from .segments import Segment


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstream_hicache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
