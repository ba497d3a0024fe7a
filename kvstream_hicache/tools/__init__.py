"""What is built on the engine and its adapters, not part of them: commands, demo, benchmarks, simulator.

  cli          the ``kvstream`` command (bench, check, info, testbed)
  console      terminal helpers (progress line, help formatter)
  demo         ``python -m kvstream_hicache.tools.demo``: sglang's controller and kvstream on a CPU
  workload     SWE-bench-agentic workloads and Mooncake traces (demo, kvsim, examples)
  rates        tier rates over time: the interpolation bench and kvsim share
  cpu_sglang   the real sglang on a CPU-only host (stubs, pools, a controller driver)
  bench/       ``kvstream bench``: reads against the aggregate-bandwidth bound, the testbed
  sim/         ``kvsim``: the performance model and a trace-driven simulator

Nothing outside this package imports from it (tests/test_layout.py checks). It is a distribution of its
own, kvstream-hicache-tools (kvstream-hicache-tools/ packages this folder): the engine's wheel, which
SGLang's and LMCache's workers install, leaves it out (tests/test_packaging.py checks).
"""
