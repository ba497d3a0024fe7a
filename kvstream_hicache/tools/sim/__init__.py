"""kvsim: the paper's performance model and a trace-driven simulator of multi-tier KV retrieval.

``model``      the equations (Eq. 1-6, the write-path condition, queueing), one function each
``bandwidth``  per-tier bandwidth series: constant, periodic, bursty, recorded
``batch``      one batch read through the engine's router, tiers simulated (processor sharing)
``trace``      workloads (Mooncake traces, generated), arrival order, block stream, reuse distances
``simulator``  the serving queue; every step's reads go through the real router, claim by claim
``cli``        the ``kvsim`` command

See docs/kvsim.md.
"""

from . import model
from .model import PRESETS, ModelPreset, parse_bytes, preset

__all__ = ["model", "PRESETS", "ModelPreset", "parse_bytes", "preset"]
