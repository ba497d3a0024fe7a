"""The paper's performance model (sections 5.1 to 5.3), one function per equation.

Units everywhere: bytes, seconds, bytes per second. Bandwidths are what a tier delivers to one
tensor-parallel rank during a step (under that step's contention), not an idle tier's datasheet
figure; volumes are per rank.

    Eq. 1  step time          T_i = T_ret + T_fwd + T_wr                         step_time
    Eq. 2  storage demand     D = V * Pr[d > M]                                  demand, miss_probability
    Eq. 3  aggregate bound    T^_i = D_i / min(b_0 + b_1 + ..., b_D2H)           bound
    Eq. 4  share              phi_i = b_0 / (b_0 + b_1)                          share
    Eq. 5  static time        T_stat = max(g D / b_0, (1 - g) D / b_1)           static_time
    Eq. 6  static penalty     T_stat / T^ = max(g / phi, (1 - g) / (1 - phi))    static_penalty
    5.3    write path         W_i / min_k w_k <= T_fwd(i+1): writes off the path writes_off_path
    5.3    queueing           waiting grows as rho / (1 - rho)                   queue_growth, queue_wait
           gap of a policy    sum T_ret / sum T^ - 1                             gap
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "ModelPreset",
    "PRESETS",
    "preset",
    "parse_bytes",
    "step_time",
    "miss_probability",
    "demand",
    "bound",
    "share",
    "static_time",
    "static_penalty",
    "gap",
    "write_time",
    "writes_off_path",
    "queue_growth",
    "queue_wait",
]


# -- model presets (Table 3 of the paper) ------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    """KV geometry and compute speed of a served model.

    ``kv_bytes_per_token`` is the BF16 total over all tensor-parallel ranks (Table 3); the storage
    model works per rank. ``prefill_tps`` and ``decode_tps`` are the node's prefill and batched
    decode rates in tokens/s; they are assumptions for the queue model (override them with the
    numbers of your own deployment), not figures from the paper.
    """

    name: str
    kv_bytes_per_token: float
    tp: int = 4
    prefill_tps: float = 20_000.0
    decode_tps: float = 2_500.0

    @property
    def bytes_per_token(self) -> float:
        """KV bytes per token per rank."""
        return self.kv_bytes_per_token / self.tp


KB = 1000  # the paper's Table 3 uses decimal units (256 tokens x 160 KB = 40 MB)
PRESETS = {
    "14b": ModelPreset("14b", 160 * KB, 4, prefill_tps=40_000, decode_tps=4_000),
    "32b": ModelPreset("32b", 256 * KB, 4, prefill_tps=20_000, decode_tps=2_500),
    "70b": ModelPreset("70b", 320 * KB, 4, prefill_tps=10_000, decode_tps=1_500),
    "110b": ModelPreset("110b", 320 * KB, 4, prefill_tps=6_000, decode_tps=1_000),
}


def preset(spec: str) -> ModelPreset:
    """A preset by name (``14b``, ``32b``, ``70b``, ``110b``) or explicit ``kv=<bytes/token total>[,tp=..,
    prefill=..,decode=..]`` (sizes accept units: ``kv=256K``)."""
    key = spec.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if key.startswith("kv="):
        fields = dict(part.split("=", 1) for part in key.split(",") if "=" in part)
        unknown = set(fields) - {"kv", "tp", "prefill", "decode"}
        if unknown:
            raise ValueError(f"unknown model field(s) {sorted(unknown)} in {spec!r}: kv, tp, prefill, decode")
        return ModelPreset(
            "custom",
            parse_bytes(fields["kv"]),
            int(fields.get("tp", 1)),
            prefill_tps=float(fields.get("prefill", 20_000)),
            decode_tps=float(fields.get("decode", 2_500)),
        )
    raise ValueError(f"unknown model {spec!r}: use one of {', '.join(PRESETS)} or kv=<bytes per token>[,tp=N]")


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]i?)?b?(?:/s)?\s*$", re.IGNORECASE)


def parse_bytes(text: str | float) -> float:
    """``"3G"``, ``"3GB/s"``, ``"2.5e9"``, ``"80GiB"`` -> bytes (or bytes/s). K, M, G, T are decimal
    (the paper's GB/s), Ki, Mi, Gi, Ti binary."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _QUANTITY.match(text)
    if not match:
        raise ValueError(f"not a size or bandwidth: {text!r} (examples: 3G, 3GB/s, 80GiB, 2.5e9)")
    return float(match[1]) * _UNITS[(match[2] or "").lower()]


# -- Eq. 1 --------------------------------------------------------------------------------------------


def step_time(t_ret: float, t_fwd: float, t_wr: float = 0.0) -> float:
    """Eq. 1: ``T_i = T_ret + T_fwd + T_wr`` (retrieval, forward pass, the write time the step waits for)."""
    return t_ret + t_fwd + t_wr


# -- Eq. 2 --------------------------------------------------------------------------------------------


def miss_probability(distances: Sequence[float], capacity: float, weights: Sequence[float] | None = None) -> float:
    """``Pr[d > M]`` over all reuses: the (byte-weighted when ``weights`` are given) share of reuses whose
    reuse distance ``d`` (bytes of distinct KV touched between two uses, the reused block included)
    exceeds the GPU+host capacity ``M``. Under LRU a reuse hits memory exactly when ``d <= M``."""
    d = np.asarray(distances, dtype=float)
    if d.size == 0:
        return 0.0
    w = np.ones_like(d) if weights is None else np.asarray(weights, dtype=float)
    total = w.sum()
    return float(w[d > capacity].sum() / total) if total > 0 else 0.0


def demand(volume: float, miss_prob: float) -> float:
    """Eq. 2: storage demand ``D = V * Pr[d > M]`` (``V``: reused prefix volume, bytes per rank)."""
    return volume * miss_prob


# -- Eqs. 3 to 6 ---------------------------------------------------------------------------------------


def bound(demand_bytes: float, bandwidths: Sequence[float], d2h: float = math.inf) -> float:
    """Eq. 3: the aggregate-bandwidth bound ``D / min(sum_k b_k, b_D2H)`` (seconds)."""
    rate = min(float(sum(bandwidths)), d2h)
    if demand_bytes == 0:
        return 0.0
    return demand_bytes / rate if rate > 0 else math.inf


def share(bandwidths: Sequence[float]) -> list[float]:
    """Eq. 4: the completion-driven share of each tier, ``phi_k = b_k / sum_j b_j``
    (two tiers: ``phi = b_0 / (b_0 + b_1)``)."""
    total = float(sum(bandwidths))
    if total <= 0:
        raise ValueError("share: every tier has zero bandwidth")
    return [b / total for b in bandwidths]


def _shares(g: float | Sequence[float], n: int) -> list[float]:
    if isinstance(g, (int, float)):
        if n == 1:
            return [1.0]
        return [float(g)] + [(1.0 - g) / (n - 1)] * (n - 1)
    if len(g) != n:
        raise ValueError(f"{len(g)} shares for {n} tiers")
    return [float(x) for x in g]


def static_time(demand_bytes: float, g: float | Sequence[float], bandwidths: Sequence[float]) -> float:
    """Eq. 5: ``T_stat = max(g D / b_0, (1 - g) D / b_1)``: the tiers read fixed shares and the step ends
    when the slower one does. ``g`` may be a list of per-tier shares for N tiers."""
    out = 0.0
    for s, b in zip(_shares(g, len(bandwidths)), bandwidths):
        if s > 0:
            out = max(out, s * demand_bytes / b if b > 0 else math.inf)
    return out


def static_penalty(g: float, phi: float) -> float:
    """Eq. 6: ``T_stat / T^ = max(g / phi, (1 - g) / (1 - phi)) >= 1``, equality only at ``g = phi``."""
    a = g / phi if phi > 0 else (math.inf if g > 0 else 0.0)
    b = (1.0 - g) / (1.0 - phi) if phi < 1 else (math.inf if g < 1 else 0.0)
    return max(a, b)


def gap(retrieval_times: Sequence[float], bounds: Sequence[float]) -> float:
    """A policy's gap to the bound over a session: ``sum_i T_ret_i / sum_i T^_i - 1``."""
    total_bound = float(sum(bounds))
    return float(sum(retrieval_times)) / total_bound - 1.0 if total_bound > 0 else 0.0


# -- section 5.3: write path and queueing ----------------------------------------------------------------


def write_time(write_bytes: float | Sequence[float], write_bandwidths: Sequence[float]) -> float:
    """Time to flush a step's new KV: ``W / min_k w_k`` when every tier gets all of ``W`` (replication);
    with per-tier volumes ``W_k`` the slowest flush ``max_k W_k / w_k``."""
    if isinstance(write_bytes, (int, float)):
        volumes = [float(write_bytes)] * len(write_bandwidths)
    else:
        volumes = [float(w) for w in write_bytes]
    out = 0.0
    for w, bw in zip(volumes, write_bandwidths):
        if w > 0:
            out = max(out, w / bw if bw > 0 else math.inf)
    return out


def writes_off_path(write_bytes: float | Sequence[float], write_bandwidths: Sequence[float], t_fwd_next: float) -> bool:
    """Section 5.3: deferred writes stay off the critical path when ``W_i / min_k w_k <= T_fwd(i+1)``."""
    return write_time(write_bytes, write_bandwidths) <= t_fwd_next


def queue_growth(rho: float) -> float:
    """Section 5.3: queueing grows as ``rho / (1 - rho)`` with the utilization ``rho`` (M/M/1 mean
    number waiting per server busy; inf at or above saturation)."""
    if rho < 0:
        raise ValueError(f"utilization must be >= 0, got {rho}")
    return rho / (1.0 - rho) if rho < 1 else math.inf


def queue_wait(rho: float, service_time: float) -> float:
    """Mean wait in the scheduling queue, ``rho / (1 - rho) * S`` (M/M/1): why faster retrieval helps
    twice in online serving (the batch that retrieves finishes sooner, and the queue drains faster)."""
    return queue_growth(rho) * service_time
