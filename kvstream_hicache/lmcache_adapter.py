"""The LMCache adapter's module path before the package layout changed, kept for configurations that name it.

LMCache server configurations name ``{"type": "plugin", "module_path": "kvstream_hicache.lmcache_adapter",
"class_name": "KVStreamL2Adapter", ...}``; the class lives in :mod:`kvstream_hicache.lmcache.adapter`, which
builds it on first access, so importing this module needs no LMCache either.
"""
from __future__ import annotations

from typing import Any

from .lmcache import adapter as _adapter

__all__ = ["KVStreamL2Adapter", "KVStreamL2AdapterConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(_adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
