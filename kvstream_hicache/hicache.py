"""The SGLang backend's module path before the package layout changed, kept for configurations that name it.

``--hicache-storage-backend dynamic`` configurations name
``{"module_path": "kvstream_hicache.hicache", "class_name": "KVStreamHiCacheStorage"}``; the class lives
in :mod:`kvstream_hicache.sglang.storage`. This module is that class under its old name, nothing else.
"""
from .sglang.storage import KVStreamHiCacheStorage

__all__ = ["KVStreamHiCacheStorage"]
