"""The trace-driven simulator: a serving queue whose every step reads its storage demand through the
real router (:func:`.batch.simulate`), claim by claim.

Serving model (one tensor-parallel rank stands for all: the ranks step in lockstep)
-----------------------------------------------------------------------------------
* Requests are served first come, first served, in the order of the (re-ordered) trace. A step
  starts when the server is free and a request is waiting, and takes every waiting request, up to
  ``max_batch``.
* Each request's prompt blocks are classified by the block stream (``trace.build_stream``): reused
  tokens that hit the GPU+host LRU memory of capacity ``M`` (reuse distance ``d <= M``) cost nothing,
  reused tokens that miss are the step's storage demand ``D_i`` (Eq. 2), and the rest is prefilled
  (``T_fwd``) and written (``W_i``).
* ``D_i`` is cut into routing chunks of ``chunk_tokens`` (LMCache's 256 by default) and read
  through the policy with every tier's bandwidth sampled at the step start (the paper's ``b_k(i)``),
  giving ``T_ret``; the bound is ``D_i / min(sum_k b_k(i), b_D2H)`` (Eq. 3).
* ``T_fwd = overhead + prefill tokens / prefill_tps``. Decode is modelled as server time after the
  step, ``output tokens / decode_tps`` (it delays the next step, not this request's first token).
* Writes are deferred (M2): a step's new KV joins a per-tier backlog that drains at the tier's write
  bandwidth while the devices do not read (forward pass, decode, idle gaps). When a backlog exceeds
  the staging buffer the next step waits for it (``T_wr``, backpressure). Replicating policies put
  ``W_i`` on every tier (write amplification = number of tiers).
* TTFT = end of the request's step (``T_ret + T_fwd + T_wr``) minus its arrival; queueing is what
  the FCFS queue produces, no formula.

Policies (``parse_sim_policy``)
-------------------------------
``kvstream[:m=2,depth=4]``  full replication, completion-driven routing (the router's CompletionDriven)
``static-G`` / ``static-auto``  a fixed share G of each step's demand from tier 0 (Eq. 5 exactly);
                            ``auto`` = the demand-weighted mean share ``phi`` of the bandwidth series.
                            Writes: each chunk on one tier (amplification 1).
``tierK``                   single tier K (amplification 1)
``replicate-share-F[:g=G]`` each block placed when written by a hash of its id: a share G on tier 0,
                            the rest on tier 1, and a share F around the split on both; reads
                            completion-driven among the holders (amplification 1 + F)
``replicate-after-slow[:g=G,slow=S]``  placed as above without replicas; once a tier delivers less than
                            S (default 0.7) of its mean bandwidth, the chunks it just served are
                            copied to the other tier and new writes are replicated while it stays slow
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...router import CompletionDriven, Policy, SingleTier, StaticSplit
from . import model
from .bandwidth import Series
from .batch import simulate
from .trace import BlockStream

__all__ = ["SimConfig", "Prepared", "prepare", "SimPolicy", "parse_sim_policy", "run_policy", "static_sweep",
           "capacity_sweep", "mean_share", "rate_for_load", "service_estimate", "placement_key", "DEFAULT_POLICIES"]

MIN_BPS = 1e6  # a stalled tier still trickles 1 MB/s: keeps static times finite (and very long)
DEFAULT_POLICIES = ("kvstream", "tier0", "tier1", "static-auto", "static-0.5", "replicate-share-0.4",
                    "replicate-after-slow")


@dataclass
class SimConfig:
    """Deployment and model parameters of one simulation (bytes, seconds, bytes/s)."""

    bytes_per_token: float  # KV bytes per token per rank
    memory_bytes: float  # GPU+host capacity M per rank
    tiers: Sequence[Series]  # read bandwidth per tier
    write_tiers: Sequence[Series]  # write bandwidth per tier
    chunk_tokens: int = 256  # routing unit (LMCache chunk)
    max_batch: int = 16  # requests per step
    prefill_tps: float = 20_000.0
    decode_tps: float = 2_500.0
    fwd_overhead_s: float = 0.02  # per-step fixed cost (scheduling, launch)
    d2h_bps: float = 25e9  # host-to-device bandwidth (Eq. 3 cap); Testbed-2's 25 GB/s
    latency_s: Sequence[float] = (0.0, 0.0)  # per-request time to first byte, per tier
    staging_bytes: float = 8e9  # deferred-write staging buffer per rank
    m: int = 2  # claim size of completion-driven routing
    depth: int | None = None


@dataclass
class Prepared:
    """Per-request and per-chunk arrays for one (stream, bytes/token, M, chunk size): policy-independent."""

    arrival_s: np.ndarray
    output_tokens: np.ndarray
    prefill_tokens: np.ndarray  # tokens computed (not reused)
    write_bytes: np.ndarray  # new KV per request
    chunk_start: np.ndarray  # per request: first chunk index (len n+1)
    chunk_bytes: np.ndarray  # per chunk
    chunk_block: np.ndarray  # per chunk: block id
    write_start: np.ndarray  # per request: first written-block index (len n+1)
    write_block: np.ndarray  # per written block: id
    write_block_bytes: np.ndarray
    write_u: np.ndarray  # per written block: its placement key, uniform in [0, 1) (a hash of the id)
    block_bytes: np.ndarray  # per block id: stored KV bytes
    reuse_bytes: float  # V
    storage_bytes: float  # D by Eq. 2 (distances)
    max_block: int


def prepare(stream: BlockStream, cfg: SimConfig) -> Prepared:
    """Classify every access of ``stream`` for ``cfg`` (memory hits, storage chunks, writes)."""
    bpt = cfg.bytes_per_token
    n = len(stream.arrival_s)
    cap_tokens = cfg.memory_bytes / bpt
    miss = stream.miss_tokens(cap_tokens)
    # storage chunks: each missed block cut into ceil(miss / chunk_tokens) chunks
    acc = np.flatnonzero(miss > 0)
    per = -(-miss[acc] // cfg.chunk_tokens)
    rep = np.repeat(acc, per)
    first = np.repeat(np.cumsum(per) - per, per)
    k = np.arange(len(rep)) - first  # chunk index within its block
    tokens = np.minimum(cfg.chunk_tokens, miss[rep] - k * cfg.chunk_tokens)
    chunk_req = stream.request[rep]
    chunk_start = np.searchsorted(chunk_req, np.arange(n + 1), side="left")
    # writes
    wacc = np.flatnonzero(stream.written > 0)
    w_req = stream.request[wacc]
    write_start = np.searchsorted(w_req, np.arange(n + 1), side="left")
    write_bytes = np.bincount(stream.request, weights=stream.written, minlength=n) * bpt
    reused_per_req = np.bincount(stream.request, weights=stream.reused, minlength=n)
    return Prepared(
        arrival_s=stream.arrival_s,
        output_tokens=stream.output_length,
        prefill_tokens=stream.input_length - reused_per_req,
        write_bytes=write_bytes,
        chunk_start=chunk_start,
        chunk_bytes=tokens * bpt,
        chunk_block=stream.block_id[rep],
        write_start=write_start,
        write_block=stream.block_id[wacc],
        write_block_bytes=stream.written[wacc] * bpt,
        write_u=placement_key(stream.block_id[wacc]),
        block_bytes=np.bincount(stream.block_id, weights=stream.written) * bpt if len(stream.block_id)
        else np.zeros(1),
        reuse_bytes=float(stream.reused.sum() * bpt),
        storage_bytes=float(miss.sum() * bpt),
        max_block=int(stream.block_id.max()) if len(stream.block_id) else 0,
    )


# -- policies -----------------------------------------------------------------------------------------


@dataclass
class SimPolicy:
    """A kvsim policy: how a step is routed and where writes go."""

    name: str
    kind: str  # "kvstream" | "static" | "single" | "share" | "after-slow"
    g: float = 0.75  # tier-0 share (static) or placement split (share, after-slow)
    f: float = 0.0  # replicated share (share)
    slow: float = 0.7  # slow threshold (after-slow)
    tier: int = 0
    m: int | None = None
    depth: int | None = None
    auto_g: bool = False


_SIM_SPEC = re.compile(r"^(?P<base>[a-z0-9.\-/]+)(?::(?P<opts>.*))?$")


def _opts(text: str | None, spec: str, allowed: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in allowed:
            raise ValueError(f"bad option {part!r} in policy {spec!r}: options are {', '.join(sorted(allowed))}")
        out[key.strip()] = value.strip()
    return out


def parse_sim_policy(spec: str) -> SimPolicy:
    """A kvsim policy from its name (see the module docstring). Raises ValueError naming the forms."""
    match = _SIM_SPEC.match(spec.strip().lower())
    if not match:
        raise ValueError(f"bad policy {spec!r}")
    base, opts = match["base"], match["opts"]
    if base == "kvstream":
        o = _opts(opts, spec, {"m", "depth"})
        return SimPolicy(spec, "kvstream", m=int(o["m"]) if "m" in o else None,
                         depth=int(o["depth"]) if "depth" in o else None)
    if base.startswith("static-"):
        o = _opts(opts, spec, {"m", "depth"})
        value = base[len("static-"):]
        if value == "auto":
            return SimPolicy("static-auto", "static", auto_g=True)
        g = float(value)
        if not 0 <= g <= 1:
            raise ValueError(f"static share must be within [0, 1], got {g}")
        return SimPolicy(f"static-{g:g}", "static", g=g)
    if re.fullmatch(r"tier\d+", base):
        _opts(opts, spec, {"m", "depth"})
        return SimPolicy(base, "single", tier=int(base[4:]))
    if base.startswith("replicate-share-"):
        o = _opts(opts, spec, {"g"})
        f = float(base[len("replicate-share-"):])
        if not 0 <= f <= 1:
            raise ValueError(f"replicated share must be within [0, 1], got {f}")
        g = o.get("g", "auto")
        return SimPolicy(spec, "share", f=f, g=0.75 if g == "auto" else float(g), auto_g=g == "auto")
    if base == "replicate-after-slow":
        o = _opts(opts, spec, {"g", "slow"})
        g = o.get("g", "auto")
        return SimPolicy(spec, "after-slow", slow=float(o.get("slow", 0.7)),
                         g=0.75 if g == "auto" else float(g), auto_g=g == "auto")
    raise ValueError(
        f"unknown policy {spec!r}: use kvstream[:m=M], static-G, static-auto, tierK, replicate-share-F[:g=G], "
        f"replicate-after-slow[:g=G,slow=S]"
    )


def placement_key(block_ids: np.ndarray) -> np.ndarray:
    """A uniform key in [0, 1) per block id (Fibonacci hashing), so placement is a fixed function of
    the block, decided when it is written."""
    with np.errstate(over="ignore"):
        h = block_ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _placement(u: np.ndarray, g: float, f: float) -> np.ndarray:
    """Holders mask (2 tiers) by placement key: tier 0 holds keys in [0, g + f(1-g)), tier 1 keys in
    [g - f g, 1), so a share g is on tier 0 only, and a share f (around the split) on both.

    Rejected: placing by position in the prompt ("the first g of each prefix on tier 0"). In a
    multi-turn trace each turn writes only its new tail, so nearly every block would land on the
    last tier and the policy would measure the placement, not the replication."""
    lo, hi = g - f * g, g + f * (1.0 - g)
    return np.where(u < lo, 1, 0) | np.where(u >= hi, 2, 0) | np.where((u >= lo) & (u < hi), 3, 0)


# -- the serving loop -----------------------------------------------------------------------------------


@dataclass
class StepLog:
    """Per step: start time, demand, bandwidths, retrieval time and bound (for sweeps and plots)."""

    start: list[float] = field(default_factory=list)
    demand: list[float] = field(default_factory=list)
    bandwidth: list[list[float]] = field(default_factory=list)
    t_ret: list[float] = field(default_factory=list)
    bound: list[float] = field(default_factory=list)


def _router_policy(p: SimPolicy, cfg: SimConfig, g: float) -> Policy:
    m = p.m or cfg.m
    depth = p.depth or cfg.depth
    if p.kind == "static":
        return StaticSplit(g, m, depth)
    if p.kind == "single":
        return SingleTier(p.tier, m, depth)
    return CompletionDriven(m, depth)


def run_policy(p: SimPolicy, prep: Prepared, cfg: SimConfig, mean_share: float | None = None) -> tuple[dict, StepLog]:
    """Serve the whole trace under policy ``p``; returns (results dict, per-step log)."""
    n_tiers = len(cfg.tiers)
    if p.kind in ("share", "after-slow") and n_tiers != 2:
        raise ValueError(f"{p.name}: placement policies are defined for two tiers")
    if p.kind == "single" and not 0 <= p.tier < n_tiers:
        raise ValueError(f"{p.name}: no tier {p.tier} among {n_tiers}")
    g = mean_share if (p.auto_g and mean_share is not None) else p.g
    router_policy = _router_policy(p, cfg, g)
    full = (1 << n_tiers) - 1
    lat = list(cfg.latency_s) + [0.0] * (n_tiers - len(cfg.latency_s))
    mask = np.zeros(prep.max_block + 1, dtype=np.int8) if p.kind in ("share", "after-slow") else None
    nominal = None
    if p.kind == "after-slow":
        horizon = float(prep.arrival_s[-1]) if len(prep.arrival_s) else 0.0
        nominal = [max(s.mean(max(horizon, 1.0)), MIN_BPS) for s in cfg.tiers]
    slow_now = [False] * n_tiers

    n = len(prep.arrival_s)
    ttft = np.zeros(n)
    backlog = [0.0] * n_tiers
    delivered = [0.0] * n_tiers
    moved = [0.0] * n_tiers
    written = [0.0] * n_tiers
    dup_bytes = 0.0
    t_ret_sum = bound_sum = t_wr_sum = busy = 0.0
    off_path_ok = off_path_n = 0
    prev_flush = None  # write time of the previous step's writes
    log = StepLog()
    t = 0.0
    i = 0

    def drain(seconds: float, now: float) -> None:
        if seconds <= 0:
            return
        for k in range(n_tiers):
            if backlog[k] > 0:
                backlog[k] = max(0.0, backlog[k] - seconds * max(cfg.write_tiers[k].rate(now), MIN_BPS))

    while i < n:
        if prep.arrival_s[i] > t:
            drain(prep.arrival_s[i] - t, t)
            t = float(prep.arrival_s[i])
        j = i + 1
        while j < n and j - i < cfg.max_batch and prep.arrival_s[j] <= t:
            j += 1
        a, b = int(prep.chunk_start[i]), int(prep.chunk_start[j])
        bw = [max(s.rate(t), MIN_BPS) for s in cfg.tiers]
        wbw = [max(s.rate(t), MIN_BPS) for s in cfg.write_tiers]
        sizes = prep.chunk_bytes[a:b]
        demand_bytes = float(sizes.sum())
        t_ret = bound_i = 0.0
        if b > a:
            if mask is not None:
                holders = mask[prep.chunk_block[a:b]].astype(int)
                holders[holders == 0] = full  # written in this very step: being computed, any tier
                holders = holders.tolist()
            else:
                holders = None
            res = simulate(router_policy, b - a, bw, holders=holders, item_bytes=sizes.tolist(), latency=lat)
            t_ret = max(res.finish, demand_bytes / cfg.d2h_bps)
            bound_i = model.bound(demand_bytes, bw, cfg.d2h_bps)
            src = np.asarray(res.source)
            for k in range(n_tiers):
                delivered[k] += float(sizes[src == k].sum())
                moved[k] += res.bytes_read[k]
            dup_bytes += max(0.0, sum(res.bytes_read) - demand_bytes)
            if p.kind == "after-slow":
                for k in range(n_tiers):
                    slow_now[k] = bw[k] < p.slow * nominal[k]
                    if slow_now[k]:  # repair: copy what this slow tier just served to the other tier(s)
                        blocks = np.unique(prep.chunk_block[a:b][(src == k)])
                        lacking = blocks[mask[blocks] == (1 << k)]
                        if len(lacking):
                            mask[lacking] = full
                            extra = float(prep.block_bytes[lacking].sum())
                            for other in range(n_tiers):
                                if other != k:
                                    backlog[other] += extra
                                    written[other] += extra
        t_fwd = cfg.fwd_overhead_s + float(prep.prefill_tokens[i:j].sum()) / cfg.prefill_tps
        if prev_flush is not None:
            off_path_n += 1
            off_path_ok += prev_flush <= t_fwd
        drain(t_fwd, t)
        t_wr = 0.0
        for k in range(n_tiers):
            over = backlog[k] - cfg.staging_bytes
            if over > 0:
                t_wr = max(t_wr, over / wbw[k])
        drain(t_wr, t)
        end = t + t_ret + t_fwd + t_wr
        ttft[i:j] = end - prep.arrival_s[i:j]
        # this step's new KV, by placement
        wa, wb = int(prep.write_start[i]), int(prep.write_start[j])
        step_w = [0.0] * n_tiers
        if p.kind == "kvstream":
            step_w = [float(prep.write_bytes[i:j].sum())] * n_tiers
        elif p.kind == "single":
            step_w[p.tier] = float(prep.write_bytes[i:j].sum())
        elif p.kind == "static":
            shares = router_policy.shares(n_tiers)
            step_w = [s * float(prep.write_bytes[i:j].sum()) for s in shares]
        else:
            blocks = prep.write_block[wa:wb]
            place = _placement(prep.write_u[wa:wb], g, p.f if p.kind == "share" else 0.0)
            if p.kind == "after-slow" and any(slow_now):
                place[:] = full
            mask[blocks] = place
            wbytes = prep.write_block_bytes[wa:wb]
            step_w = [float(wbytes[(place >> k) & 1 == 1].sum()) for k in range(n_tiers)]
        for k in range(n_tiers):
            backlog[k] += step_w[k]
            written[k] += step_w[k]
        prev_flush = model.write_time(step_w, wbw)
        decode = float(prep.output_tokens[i:j].sum()) / cfg.decode_tps
        drain(decode, end)
        busy += end - t + decode
        t_ret_sum += t_ret
        bound_sum += bound_i
        t_wr_sum += t_wr
        log.start.append(t)
        log.demand.append(demand_bytes)
        log.bandwidth.append(bw)
        log.t_ret.append(t_ret)
        log.bound.append(bound_i)
        t = end + decode
        i = j

    unique_w = float(prep.write_bytes.sum())
    total_delivered = sum(delivered)
    span = t - (float(prep.arrival_s[0]) if n else 0.0)
    result = {
        "policy": p.name,
        "g": g if p.kind in ("static", "share", "after-slow") else None,
        "retrieval_s": t_ret_sum,
        "bound_s": bound_sum,
        "gap": model.gap([t_ret_sum], [bound_sum]),
        "read_bytes": delivered,
        "read_share": [d / total_delivered if total_delivered else 0.0 for d in delivered],
        "moved_bytes": moved,
        "duplicate_bytes": dup_bytes,
        "write_bytes": written,
        "write_volume": sum(written),
        "write_amplification": sum(written) / unique_w if unique_w else 0.0,
        "writes_off_path": off_path_ok / off_path_n if off_path_n else 1.0,
        "write_stall_s": t_wr_sum,
        "ttft_mean_s": float(ttft.mean()) if n else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if n else 0.0,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if n else 0.0,
        "steps": len(log.start),
        "makespan_s": t,
        "utilization": busy / span if span > 0 else 0.0,
    }
    return result, log


def service_estimate(prep: Prepared, cfg: SimConfig) -> float:
    """Server time the whole trace needs with tier 0 alone at its mean bandwidth, one request per step
    (seconds): prefill + decode + storage reads + per-step overhead. Used to pick a rate factor that
    puts the single-tier baseline at a target utilization."""
    horizon = max(float(prep.arrival_s[-1] - prep.arrival_s[0]) if len(prep.arrival_s) else 0.0, 1.0)
    b0 = max(cfg.tiers[0].mean(horizon), MIN_BPS)
    return (float(prep.prefill_tokens.sum()) / cfg.prefill_tps + float(prep.output_tokens.sum()) / cfg.decode_tps
            + float(prep.chunk_bytes.sum()) / b0 + len(prep.arrival_s) * cfg.fwd_overhead_s)


def rate_for_load(prep: Prepared, cfg: SimConfig, load: float) -> float:
    """The arrival rate factor at which ``service_estimate`` fills ``load`` of the trace's span (1.0 for
    a trace whose requests all arrive at once: an offline batch)."""
    span = float(prep.arrival_s[-1] - prep.arrival_s[0]) if len(prep.arrival_s) > 1 else 0.0
    if span <= 0 or load <= 0:
        return 1.0
    return load * span / service_estimate(prep, cfg)


def mean_share(log: StepLog) -> float:
    """Demand-weighted mean of ``phi_i`` (Eq. 4) over the steps of a run (two tiers: tier 0's share)."""
    d = np.asarray(log.demand)
    if not len(d) or d.sum() <= 0:
        return 0.5
    bw = np.asarray(log.bandwidth)
    phi = bw[:, 0] / bw.sum(axis=1)
    return float((phi * d).sum() / d.sum())


def static_sweep(log: StepLog, grid: Sequence[float]) -> list[float]:
    """Eq. 5 summed over a run's steps for each static share ``g`` (two tiers): the gap per ``g``."""
    d = np.asarray(log.demand)
    bw = np.asarray(log.bandwidth)
    if not len(d) or d.sum() <= 0:
        return [0.0 for _ in grid]
    bound = d / bw.sum(axis=1)
    out = []
    for g in grid:
        t = np.maximum(g * d / bw[:, 0], (1.0 - g) * d / bw[:, 1])
        out.append(float(t.sum() / bound.sum() - 1.0))
    return out


def capacity_sweep(stream: BlockStream, bytes_per_token: float, capacities: Sequence[float],
                   lru: bool = False) -> dict:
    """Eq. 2 across memory capacities: predicted storage bytes from the distances (and, with ``lru``,
    the bytes an explicit LRU cache misses)."""
    from .trace import lru_misses

    v = float(stream.reused.sum() * bytes_per_token)
    reused = stream.reused > 0
    out = {"memory_bytes": list(capacities), "reuse_bytes": v, "miss_probability": [], "eq2_bytes": []}
    if lru:
        out["lru_bytes"] = []
    for cap in capacities:
        p = model.miss_probability(stream.distance[reused] * bytes_per_token, cap, stream.reused[reused])
        out["miss_probability"].append(p)
        out["eq2_bytes"].append(model.demand(v, p))
        if lru:
            out["lru_bytes"].append(float(lru_misses(stream, cap / bytes_per_token).sum() * bytes_per_token))
    return out
