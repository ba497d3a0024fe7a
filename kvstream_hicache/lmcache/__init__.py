"""The vLLM path: kvstream_hicache as ONE LMCache L2 adapter (LMCache 0.5.6 multiprocess mode).

LMCache's ``lmcache server`` keeps L1 (a shared-memory arena) and hands L2 adapters store, lookup-and-lock
and load tasks; vLLM talks to that server through ``LMCacheMPConnector``. This package plugs the engine
in as one ``{"type": "plugin", ...}`` adapter, so LMCache's inter-adapter policies never see the tiers:
replication and completion-driven routing stay inside :class:`~kvstream_hicache.engine.Engine`, the same
engine and router the SGLang adapter drives (docs/lmcache.md)::

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "kvstream_hicache.lmcache.adapter",
                                     "class_name": "KVStreamL2Adapter",
                                     "adapter_params": {"tiers": ["/nvme/kv", "/pfs/kv"]}}'

(``kvstream_hicache.lmcache_adapter``, the module path of earlier configurations, names the same class.)

  keys      ObjectKey + layout -> engine key, the namespace, adapter_params vs engine settings
  core      L2Core: the task machinery over one engine (plain keys and segments, no LMCache)
  adapter   KVStreamL2Adapter: LMCache's interface over L2Core, built on first access

Only ``adapter`` needs LMCache, and only when ``KVStreamL2Adapter`` is first used: ``keys`` and ``core``
import without LMCache or torch.
"""
