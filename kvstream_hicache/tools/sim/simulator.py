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
``kvstream[:m=2,depth=4,h=H]``  the engine's default: replicas within budget (``budget:h=home+1``) with
                            catch-up (background replication: a skipped replica is written later, in the
                            tier's read-free time once its foreground writes drained, at the engine's
                            ``catchup_share`` of its write bandwidth; ``writeq.CatchUpQueue``);
                            completion-driven routing among the holders (the router's CompletionDriven)
``replicate-all[:m=2,depth=4]``  full replication (``replicate=all``), completion-driven routing
``budget-no-catch-up``      ``budget:h=home+1`` without catch-up (``catchup=off``)
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
``budget[:h=H]``            replicas within budget: every new page goes to tier 0 (the home tier); its
                            replica on tier k >= 1 is written only when tier k's pending writes plus
                            the page drain, at tier k's write bandwidth, within the horizon H; else it
                            is skipped (counted). Reads are completion-driven among the holders.
                            H is the largest of its '+'-joined parts: ``home`` the time tier 0 needs
                            for its own pending writes, this page included (a replica never outlasts
                            its home copy); ``quiet`` how long the write path had been idle (no write
                            pending on any tier) when the put came; ``put`` the time since the previous
                            put; ``fwd`` the forward pass that produced the put (section 5.3: writes
                            that drain within a forward pass stay off the read path); ``window`` the
                            tier's last read-free window (end of its previous read batch to the start
                            of its latest); a number of seconds. ``staging`` instead
                            caps tier k's pending bytes at the staging bound. ``spill``: the mandatory
                            copy goes to the tier whose queue would finish the page first (ties: the
                            lowest tier), replicas to the others by the same horizon. On the sync path the
                            pending writes are the call's own (the engine sees one call at a time).

Write model (``SimConfig.write_model``, see ``writeq``): ``legacy`` (the original per-tier backlogs),
``deferred`` (the engine's M2 queue: shared staging pool, per-tier FIFOs) or ``sync`` (SGLang: one
call per step, calls one at a time). ``read_priority``: ``step`` (no tier writes while the step
retrieves: the original model) or ``tier`` (a tier writes whenever it has no read in flight).
``write_inflight_bytes``: writes already submitted to a tier when a read batch arrives cannot be held
back; the tier's reads start after min(pending, this)/write bandwidth (0: no such interference).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...config import SETTINGS
from ...router import CompletionDriven, Policy, SingleTier, StaticSplit
from . import model
from .bandwidth import Series
from .batch import simulate
from .trace import BlockStream
from .writeq import CatchUpQueue, WriteQueue

__all__ = ["SimConfig", "Prepared", "prepare", "SimPolicy", "parse_sim_policy", "run_policy", "static_sweep",
           "capacity_sweep", "mean_share", "rate_for_load", "service_estimate", "placement_key", "DEFAULT_POLICIES"]

MIN_BPS = 1e6  # a stalled tier still trickles 1 MB/s: keeps static times finite (and very long)
DEFAULT_POLICIES = ("kvstream", "replicate-all", "budget-no-catch-up", "tier0", "tier1", "static-auto", "static-0.5",
                    "replicate-share-0.4", "replicate-after-slow")  # kvstream: the engine's defaults
ENGINE_HORIZON = "home+1"  # replicate=budget with replicate_slack 1 s (the engine's default rule)
CATCHUP_SHARE = float(SETTINGS["catchup_share"].default)  # the engine's catch-up pacing


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
    write_model: str = "legacy"  # legacy | deferred | sync (writeq)
    read_priority: str = "step"  # step | tier
    write_inflight_bytes: float = 0.0  # writes a read batch cannot hold back, per tier

    def __post_init__(self):
        # Values the loop would otherwise turn silently into something else: a 0-token chunk drops
        # every storage read (prepare), a batch of 0 runs as 1, a rate of 0 divides by zero.
        if self.chunk_tokens < 1 or self.max_batch < 1:
            raise ValueError(f"chunk_tokens and max_batch must be >= 1, got {self.chunk_tokens}, {self.max_batch}")
        if not (self.prefill_tps > 0 and self.decode_tps > 0 and self.d2h_bps > 0):
            raise ValueError(f"prefill_tps, decode_tps and d2h_bps must be > 0, got {self.prefill_tps:g}, "
                             f"{self.decode_tps:g}, {self.d2h_bps:g}")


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
    kind: str  # "all" | "static" | "single" | "share" | "after-slow" | "budget"
    g: float = 0.75  # tier-0 share (static) or placement split (share, after-slow)
    f: float = 0.0  # replicated share (share)
    slow: float = 0.7  # slow threshold (after-slow)
    tier: int = 0
    m: int | None = None
    depth: int | None = None
    auto_g: bool = False
    horizon: str = "window"  # budget: window | home | max | staging | seconds
    catchup: bool = False  # budget: skipped replicas are written later (the engine's background replication)


BUDGET_HORIZONS = ("window", "home", "staging", "put", "tier-idle", "quiet", "fwd", "spill")
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


def _claim(o: dict[str, str]) -> dict[str, int | None]:
    """A policy's own claim size and depth (``:m=..,depth=..``); None: the run's ``--m`` / ``--depth``."""
    return {k: int(o[k]) if k in o else None for k in ("m", "depth")}


def parse_sim_policy(spec: str) -> SimPolicy:
    """A kvsim policy from its name (see the module docstring). Raises ValueError naming the forms."""
    match = _SIM_SPEC.match(spec.strip().lower())
    if not match:
        raise ValueError(f"bad policy {spec!r}")
    base, opts = match["base"], match["opts"]
    suffix = f":{opts}" if opts else ""  # (a claim size of its own is another simulation: named apart)
    if base in ("kvstream", "replicate-all"):
        o = _opts(opts, spec, {"m", "depth", "h"} if base == "kvstream" else {"m", "depth"})
        return SimPolicy(spec, "budget" if base == "kvstream" else "all", **_claim(o),
                         horizon=_horizon(o.get("h", ENGINE_HORIZON)), catchup=base == "kvstream")
    if base == "budget-no-catch-up":
        _opts(opts, spec, set())
        return SimPolicy(spec, "budget", horizon=ENGINE_HORIZON)
    if base.startswith("static-"):
        o = _opts(opts, spec, {"m", "depth"})
        value = base[len("static-"):]
        if value == "auto":
            return SimPolicy("static-auto" + suffix, "static", auto_g=True, **_claim(o))
        g = float(value)
        if not 0 <= g <= 1:
            raise ValueError(f"static share must be within [0, 1], got {g}")
        return SimPolicy(f"static-{g:g}{suffix}", "static", g=g, **_claim(o))
    if re.fullmatch(r"tier\d+", base):
        o = _opts(opts, spec, {"m", "depth"})
        return SimPolicy(base + suffix, "single", tier=int(base[4:]), **_claim(o))
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
    if base == "budget":
        o = _opts(opts, spec, {"h"})
        return SimPolicy(spec, "budget", horizon=_horizon(o.get("h", "window")))
    raise ValueError(
        f"unknown policy {spec!r}: use kvstream[:m=M], replicate-all[:m=M], budget-no-catch-up, static-G, static-auto, tierK, replicate-share-F[:g=G], "
        f"replicate-after-slow[:g=G,slow=S], budget[:h=window|home|max|staging|SECONDS]"
    )


def _horizon(h: str) -> str:
    """A budget horizon as written ('home+1'), checked."""
    for part in h.split("+"):
        if part not in BUDGET_HORIZONS:
            try:
                if float(part) < 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"budget horizon: '+'-joined parts among {', '.join(BUDGET_HORIZONS)} or "
                                 f"seconds >= 0, got {h!r}") from None
    return h


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

    d2h_bps: float = np.inf  # the run's host-to-device cap (Eq. 3), which the sweeps apply as its rows do

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


def _budget_masks(p: SimPolicy, sizes: np.ndarray, wq: WriteQueue, wbw: list[float], window: list[float],
                  staging: float, put_gap: float, quiet: float, fwd: float, skipped: list[float],
                  skipped_pages: list[int]) -> np.ndarray:
    """Replicas within budget, decided per page per tier at put time: tier 0 takes every page; tier
    k >= 1 takes it when its pending bytes plus the page drain at its write bandwidth within the
    horizon (see the module docstring). Skipped replicas are counted in ``skipped``."""
    n_tiers = len(wbw)
    masks = np.ones(len(sizes), dtype=np.int64)
    # SGLang's path (sync): the engine sees one batch_set at a time; the caller's backlog is invisible to it,
    # so the queues are the call's own (a queued call starts when the previous returned: quiet is 0 then)
    q = [0.0] * n_tiers if wq.mode == "sync" else [wq.pending(k) for k in range(n_tiers)]
    parts = p.horizon.split("+")
    fixed = max([float(x) for x in parts if x not in BUDGET_HORIZONS], default=0.0)
    base = max(fixed, quiet if "quiet" in parts else 0.0, put_gap if "put" in parts else 0.0,
               fwd if "fwd" in parts else 0.0)
    spill = "spill" in parts
    for j, s in enumerate(sizes.tolist()):
        # the mandatory copy: tier 0, or (spill) the tier whose queue would finish this page first
        h0 = min(range(n_tiers), key=lambda k: ((q[k] + s) / wbw[k], k)) if spill else 0
        masks[j] = 1 << h0
        q[h0] += s
        home = q[h0] / wbw[h0] if "home" in parts else 0.0
        for k in range(n_tiers):
            if k == h0:
                continue
            if "staging" in parts:
                ok = q[k] + s <= staging
            elif "tier-idle" in parts and q[k] == 0:
                ok = True
            else:
                horizon = max(base, home, window[k] if "window" in parts else 0.0)
                ok = (q[k] + s) / wbw[k] <= horizon
            if ok:
                masks[j] |= 1 << k
                q[k] += s
            else:
                skipped[k] += s
                skipped_pages[k] += 1
    return masks


def run_policy(p: SimPolicy, prep: Prepared, cfg: SimConfig, mean_share: float | None = None) -> tuple[dict, StepLog]:
    """Serve the whole trace under policy ``p``; returns (results dict, per-step log)."""
    n_tiers = len(cfg.tiers)
    if p.kind in ("share", "after-slow") and n_tiers != 2:
        raise ValueError(f"{p.name}: placement policies are defined for two tiers")
    if p.kind == "single" and not 0 <= p.tier < n_tiers:
        raise ValueError(f"{p.name}: no tier {p.tier} among {n_tiers}")
    if cfg.read_priority not in ("step", "tier"):
        raise ValueError(f"read priority is 'step' or 'tier', got {cfg.read_priority!r}")
    g = mean_share if (p.auto_g and mean_share is not None) else p.g
    router_policy = _router_policy(p, cfg, g)
    full = (1 << n_tiers) - 1
    lat = list(cfg.latency_s) + [0.0] * (n_tiers - len(cfg.latency_s))
    mask = (np.zeros(prep.max_block + 1, dtype=np.int8) if p.kind in ("share", "after-slow", "budget") else None)
    nominal = None
    if p.kind == "after-slow":
        horizon = float(prep.arrival_s[-1]) if len(prep.arrival_s) else 0.0
        nominal = [max(s.mean(max(horizon, 1.0)), MIN_BPS) for s in cfg.tiers]
    slow_now = [False] * n_tiers

    n = len(prep.arrival_s)
    ttft = np.zeros(n)
    wq = (CatchUpQueue(n_tiers, cfg.write_model, cfg.staging_bytes, CATCHUP_SHARE, mask) if p.catchup
          else WriteQueue(n_tiers, cfg.write_model, cfg.staging_bytes))
    delivered = [0.0] * n_tiers
    moved = [0.0] * n_tiers
    written = [0.0] * n_tiers
    skipped = [0.0] * n_tiers
    skipped_pages = [0] * n_tiers
    read_end: list[float | None] = [None] * n_tiers  # end of the tier's latest read batch
    window = [np.inf] * n_tiers  # the tier's latest read-free window (budget)
    last_put = None  # time of the previous put (budget)
    dup_bytes = 0.0
    t_ret_sum = bound_sum = t_wr_sum = busy = inflight_sum = 0.0
    fwd_times: list[float] = []
    off_path_ok = off_path_n = 0
    prev_flush = None  # write time of the previous step's writes
    log = StepLog(d2h_bps=cfg.d2h_bps)
    t = 0.0
    i = 0

    def wrates(now: float) -> list[float]:
        return [max(s.rate(now), MIN_BPS) for s in cfg.write_tiers]

    def drain(seconds: float, now: float, at: float | None = None) -> None:
        """Every tier writes for ``seconds`` from time ``at`` (default ``now``) at the rates of ``now``."""
        if seconds > 0:
            wq.advance(wrates(now), [(0.0, seconds)] * n_tiers, now if at is None else at)

    while i < n:
        if prep.arrival_s[i] > t:
            drain(prep.arrival_s[i] - t, t)
            t = float(prep.arrival_s[i])
        j = i + 1
        while j < n and j - i < cfg.max_batch and prep.arrival_s[j] <= t:
            j += 1
        a, b = int(prep.chunk_start[i]), int(prep.chunk_start[j])
        bw = [max(s.rate(t), MIN_BPS) for s in cfg.tiers]
        wbw = wrates(t)
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
            # writes already in flight on a tier finish before its reads start (they cannot be held back)
            delay = [min(wq.pending(k), cfg.write_inflight_bytes) / wbw[k] for k in range(n_tiers)]
            blocked = [d for d in delay if d > 0]
            if blocked:  # a tier's speed is 0 until its in-flight writes are done (resampled every d/4)
                speeds = [(lambda tt, v=bw[k], d=delay[k]: v if tt >= d else 0.0) if delay[k] > 0 else bw[k]
                          for k in range(n_tiers)]
                res = simulate(router_policy, b - a, speeds, holders=holders, item_bytes=sizes.tolist(),
                               latency=lat, max_dt=min(blocked) / 4)
                inflight_sum += max(delay)
                wq.advance(wbw, [(0.0, d) for d in delay], t)
            else:
                res = simulate(router_policy, b - a, bw, holders=holders, item_bytes=sizes.tolist(), latency=lat)
            t_ret = max(res.finish, demand_bytes / cfg.d2h_bps)
            bound_i = model.bound(demand_bytes, bw, cfg.d2h_bps)
            # each tier reads from its delay for bytes_read / bw; read priority decides when it may write
            reads = [(delay[k], delay[k] + res.bytes_read[k] / bw[k]) if res.bytes_read[k] > 0 else None
                     for k in range(n_tiers)]
            if cfg.read_priority == "tier":
                wq.advance(wbw, [(r[1] if r else 0.0, t_ret) for r in reads], t)
            for k in range(n_tiers):
                r = (0.0, t_ret) if cfg.read_priority == "step" else reads[k]
                if r is None:
                    continue
                if read_end[k] is not None:
                    window[k] = t + r[0] - read_end[k]
                read_end[k] = t + r[1]
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
                            per = wq.add([extra], [full & ~(1 << k)])  # queued at the step start
                            for other in range(n_tiers):
                                written[other] += per[other]
        t_fwd = cfg.fwd_overhead_s + float(prep.prefill_tokens[i:j].sum()) / cfg.prefill_tps
        fwd_times.append(t_fwd)
        if prev_flush is not None:
            off_path_n += 1
            off_path_ok += prev_flush <= t_fwd
        drain(t_fwd, t, t + t_ret)
        new_bytes = float(prep.write_bytes[i:j].sum())
        t_wr = wq.room(new_bytes, wbw, t + t_ret + t_fwd)
        end = t + t_ret + t_fwd + t_wr
        ttft[i:j] = end - prep.arrival_s[i:j]
        # this step's new KV, by placement
        wa, wb = int(prep.write_start[i]), int(prep.write_start[j])
        blocks = prep.write_block[wa:wb]
        wbytes = prep.write_block_bytes[wa:wb]
        if p.kind == "all":
            place = np.full(len(blocks), full, dtype=np.int64)
        elif p.kind == "single":
            place = np.full(len(blocks), 1 << p.tier, dtype=np.int64)
        elif p.kind == "static":
            place = None
        elif p.kind == "budget":
            put_at = end
            place = _budget_masks(p, wbytes, wq, wbw, window, cfg.staging_bytes,
                                  put_at - last_put if last_put is not None else np.inf, wq.quiet_for(put_at),
                                  t_fwd, skipped, skipped_pages)
            last_put = put_at
            if p.catchup:
                wq.owe(blocks, wbytes, place)
        else:
            place = _placement(prep.write_u[wa:wb], g, p.f if p.kind == "share" else 0.0)
            if p.kind == "after-slow" and any(slow_now):
                place[:] = full
        if mask is not None:
            mask[blocks] = place
        if place is None:  # static: a share of the bytes on each tier (Eq. 5's split)
            shares = router_policy.shares(n_tiers)
            step_w = wq.add([s * new_bytes for s in shares], [1 << k for k in range(n_tiers)])
        else:
            step_w = wq.add(wbytes, place)
        for k in range(n_tiers):
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

    caught = getattr(wq, "caught_up", [0.0] * n_tiers)
    written = [w + c for w, c in zip(written, caught)]
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
        "replica_skipped_bytes": skipped,
        "replica_skipped_pages": skipped_pages,
        "replica_caught_up_bytes": caught,  # skipped replicas written later (catch-up), included in write_bytes
        "replica_owed_bytes": [wq.owed(k) for k in range(n_tiers)] if p.catchup else [0.0] * n_tiers,
        "catchup_done_s": wq.done_at if p.catchup else None,
        "writes_off_path": off_path_ok / off_path_n if off_path_n else 1.0,
        "write_stall_s": t_wr_sum,
        "inflight_delay_s": inflight_sum,  # sum over steps of the longest in-flight write wait
        "ttft_mean_s": float(ttft.mean()) if n else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if n else 0.0,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if n else 0.0,
        "steps": len(log.start),
        "fwd_p50_s": float(np.percentile(fwd_times, 50)) if fwd_times else 0.0,
        "fwd_p90_s": float(np.percentile(fwd_times, 90)) if fwd_times else 0.0,
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
    if not load > 0:  # (it used to give 1.0, the recorded arrivals, whatever the load asked for)
        raise ValueError(f"load must be > 0, got {load:g}")
    if span <= 0:
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
    """Eq. 5 summed over a run's steps for each static share ``g`` (two tiers): the gap per ``g``.

    Time and bound are the policy rows': a step takes at least ``D_i / b_D2H`` and its bound is Eq. 3
    with that cap (the run's ``log.bound``), so the sweep at ``g`` matches the ``static-g`` row."""
    d = np.asarray(log.demand)
    bw = np.asarray(log.bandwidth)
    if not len(d) or d.sum() <= 0:
        return [0.0 for _ in grid]
    bound = np.asarray(log.bound)
    out = []
    for g in grid:
        t = np.maximum(np.maximum(g * d / bw[:, 0], (1.0 - g) * d / bw[:, 1]), d / log.d2h_bps)
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
