"""Benchmarks of kvstream against the aggregate-bandwidth bound and its peers (``kvstream bench``).

Modules:
  geometry   page geometry: model presets -> bytes per page and its K/V segments
  gap        pure arithmetic: per-tier rates, the per-batch bound, the gap, percentiles
  testbed    loop-device tiers (ext4, cgroup v1 blkio): throttled, RAM-backed or the machine's disk; fio on record
  fio        fio job files and their JSON results; each tier alone, then all at once
  drift      bandwidth-drift scenarios (periodic throttle, competing tenant, write interference)
  contenders the policies compared: engine-routed reads, kvstream on one tier, HiCacheFile, the SGLang
             and LMCache adapters
  nixl       sglang's NIXL backend (hicache-nixl, hicache-nixl-sharded)
  lmcache_l2 LMCache's L2 adapters through LMCache's factory and task interface (fs_native, kvstream's)
  peers      the contenders with their own copy: names, what each needs installed, how one is built
  runner     write once, read back batch by batch, policies interleaved
  report     terminal table, JSON, plots, the kvsim bandwidth series
  summary    medians over repeated runs as Markdown tables and figures (--device: device-speed tables)
"""
