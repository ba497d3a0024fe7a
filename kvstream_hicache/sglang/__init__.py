"""The SGLang HiCache integration: the L3 storage backend and what makes sglang use it.

  storage   KVStreamHiCacheStorage: sglang's HiCacheStorage over one engine (imports sglang and torch)
  plugin    the ``sglang.srt.plugins`` entry point: the ``kvstream`` backend name, zero-copy calls
  metrics   Prometheus export of the engine's stats (``--enable-metrics``)

This package's ``__init__`` imports nothing: the plugin runs in every sglang process and must stay light.
"""
