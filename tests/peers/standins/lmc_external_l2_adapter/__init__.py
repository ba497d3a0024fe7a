"""The name LMCache's external-adapter example tests import, bound to kvstream's adapter and its
config class (the tests load it through LMCache's plugin factory by this module path)."""
from kvstream_hicache.lmcache.adapter import KVStreamL2Adapter as InMemoryL2Adapter
from kvstream_hicache.lmcache.adapter import KVStreamL2AdapterConfig as InMemoryL2AdapterConfig

__all__ = ["InMemoryL2Adapter", "InMemoryL2AdapterConfig"]
