"""Benchmarks of kvstream against the aggregate-bandwidth bound and its peers (``kvstream bench``).

Modules:
  geometry   page geometry: model presets -> bytes per page and its K/V segments
  gap        pure arithmetic: per-tier rates, the per-batch bound, the gap, percentiles
  testbed    throttled two-tier testbed (loop devices + ext4 + cgroup v1 blkio), fio on record
  fio        fio job files and their JSON results
  drift      bandwidth-drift scenarios (periodic throttle, competing tenant, write interference)
  contenders the policies compared: engine-routed reads, HiCacheFile, the SGLang and LMCache adapters
  runner     write once, read back batch by batch, policies interleaved
  report     terminal table, JSON, plots, the kvsim bandwidth series
"""
