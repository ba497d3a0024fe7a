"""``kvsim``: will a second tier pay for this workload? (see docs/kvsim.md)

    kvsim --trace data/traces/mooncake/conversation_trace.jsonl
    kvsim --workload swebench --order round-robin --model 70b --memory 40G --json out.json --plot out.png
    kvsim --validate-bench RUN.json [RUN.json ...]      # the model against kvstream bench runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from . import model
from .bandwidth import Constant, load_recorded, parse_series
from .simulator import (
    DEFAULT_POLICIES,
    rate_for_load,
    SimConfig,
    capacity_sweep,
    mean_share,
    parse_sim_policy,
    prepare,
    run_policy,
    static_sweep,
)
from .trace import build_stream, load_requests

DEFAULT_TIERS = ("periodic:mean=3G,amp=1G,period=30", "bursty:high=1.2G,low=0.3G,on=30,off=15,seed=1")
DEFAULT_WRITE = ("1.3G", "0.7G")  # Testbed-2 per rank: NVMe 5.1 GB/s and Lustre 2.8 GB/s over 4 ranks
# The paper's Table 2 per rank (4 ranks): read tiers and write bandwidths. Testbed-2 is the default above;
# Testbed-1's NVMe reads 13.7/4 GB/s and writes 4.6/4, its VAST PFS reads up to 6.2/4 and writes 7.1/4.
TESTBEDS = {
    "2": (DEFAULT_TIERS, DEFAULT_WRITE),
    "1": (("periodic:mean=3.4G,amp=1G,period=30", "bursty:high=1.55G,low=0.4G,on=30,off=15,seed=1"),
          ("1.15G", "1.78G")),
}
DEFAULT_CAPACITIES = "10G,20G,40G,80G,160G,320G,640G,1280G"
SWEEP = [round(x, 2) for x in np.arange(0.0, 1.0001, 0.05)]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvsim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    src.add_argument("--workload", choices=["swebench"], help="a generated workload (kvstream_hicache.tools.workload)")
    src.add_argument("--validate-bench", nargs="+", metavar="RUN_JSON",
                     help="predict each policy's gap from the bandwidths measured in these `kvstream bench --json` "
                          "runs and compare with the measured gap (uses --m, --depth, --json)")
    ap.add_argument("--limit", type=int, help="first N requests only")
    ap.add_argument("--order", default="recorded",
                    help="recorded | random (alias shuffled) | round-robin | cache-friendly (default recorded)")
    ap.add_argument("--rate", type=float,
                    help="arrival rate factor (2 = twice as fast); default: the factor that gives --load")
    ap.add_argument("--load", type=float, default=0.8,
                    help="without --rate: scale arrivals so that tier 0 alone would be this busy (default 0.8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="32b", help="14b | 32b | 70b | 110b | kv=<bytes/token total>[,tp=N,prefill=..,decode=..]")
    ap.add_argument("--memory", default="80G", help="GPU+host KV capacity M per rank (default 80G)")
    ap.add_argument("--tier", action="append", metavar="SPEC",
                    help="read bandwidth of the next tier, fastest first: 3G | periodic:mean=..,amp=..,period=.. | "
                         "bursty:high=..,low=..,on=..,off=..[,seed=] | recorded:FILE[#K] "
                         f"(default: {' and '.join(DEFAULT_TIERS)})")
    ap.add_argument("--bandwidth-json", metavar="FILE", help="recorded per-tier bandwidth (replaces --tier)")
    ap.add_argument("--testbed", choices=sorted(TESTBEDS),
                    help="the paper's Testbed-1 or -2 per-rank bandwidths for --tier and --write-bw (default 2)")
    ap.add_argument("--reuse", type=float, help="--workload swebench: target prefix reuse share (paper Fig. 15)")
    ap.add_argument("--write-model", default="legacy", choices=["legacy", "deferred", "sync"],
                    help="legacy (per-tier backlogs) | deferred (engine M2 queue, shared staging) | sync (SGLang)")
    ap.add_argument("--read-priority", default="step", choices=["step", "tier"],
                    help="step: no tier writes while a step retrieves | tier: a tier writes when it has no read")
    ap.add_argument("--write-inflight", default="0",
                    help="write bytes in flight per tier that a read batch cannot hold back (default 0)")
    ap.add_argument("--write-bw", action="append", metavar="SPEC",
                    help=f"write bandwidth per tier (default {', '.join(DEFAULT_WRITE)})")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated (default: %(default)s)")
    ap.add_argument("--m", type=int, default=2, help="claim size of completion-driven routing (default 2)")
    ap.add_argument("--depth", type=int, help="reads in flight per tier (default 2*m)")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="routing chunk (default 256, LMCache's)")
    ap.add_argument("--max-batch", type=int, default=16, help="requests per step (default 16)")
    ap.add_argument("--prefill-tps", type=float, help="prefill tokens/s (default: the model preset's)")
    ap.add_argument("--decode-tps", type=float, help="batched decode tokens/s (default: the model preset's)")
    ap.add_argument("--latency", default="0", help="per-request latency per tier, s (comma list; default 0)")
    ap.add_argument("--d2h", default="25G", help="host-to-device bandwidth, Eq. 3's cap (default 25G)")
    ap.add_argument("--staging", default="8G", help="deferred-write staging buffer per rank (default 8G)")
    ap.add_argument("--capacities", default=DEFAULT_CAPACITIES, help="Eq. 2 sweep capacities")
    ap.add_argument("--validate-lru", action="store_true", help="check Eq. 2 against an explicit LRU per capacity")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PNG", help="write a figure (needs matplotlib)")
    return ap


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def table(results: dict) -> str:
    """The per-policy table."""
    rows = [("policy", "gap", "retr s", "bound s", "share t0", "dup GB", "write GB", "WA", "skip/caught t1", "off-path",
             "stall s", "util", "TTFT mean", "p50", "p90")]
    for name, r in results["policies"].items():
        rows.append((
            name, f"{100 * r['gap']:+.1f}%", f"{r['retrieval_s']:,.0f}", f"{r['bound_s']:,.0f}",
            f"{r['read_share'][0]:.2f}", _gb(r["duplicate_bytes"]), _gb(r["write_volume"]),
            f"{r['write_amplification']:.2f}", _skip(r), f"{100 * r['writes_off_path']:.0f}%",
            f"{r['write_stall_s']:,.0f}", f"{r['utilization']:.2f}",
            f"{r['ttft_mean_s']:.2f}", f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p90_s']:.2f}",
        ))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _skip(r: dict) -> str:
    """Share of tier 1's replicas skipped at put time (budget policies), else '-'; with catch-up, the
    share of those written later after a '/'."""
    sk = r.get("replica_skipped_bytes") or []
    if len(sk) < 2 or not sk[1]:
        return "-"
    caught = (r.get("replica_caught_up_bytes") or [0.0, 0.0])[1]
    text = f"{100 * sk[1] / (sk[1] + r['write_bytes'][1] - caught):.0f}%"
    return text + (f"/{100 * caught / sk[1]:.0f}%" if r.get("catchup_done_s") is not None else "")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = results["policies"]
    names = list(pol)
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    ax[0, 0].bar(names, [100 * pol[n]["gap"] for n in names], color="tab:blue")
    ax[0, 0].set_ylabel("gap to the aggregate-bandwidth bound (%)")
    ax[0, 0].set_yscale("symlog", linthresh=1)
    ax[0, 0].set_ylim(bottom=0)
    x = np.arange(len(names))
    ax[0, 1].bar(x - 0.2, [pol[n]["ttft_mean_s"] for n in names], 0.4, label="mean")
    ax[0, 1].bar(x + 0.2, [pol[n]["ttft_p90_s"] for n in names], 0.4, label="p90")
    ax[0, 1].set_xticks(x, names)
    ax[0, 1].set_ylabel("TTFT (s)")
    ax[0, 1].set_yscale("log")
    ax[0, 1].legend()
    for a in (ax[0, 0], ax[0, 1]):
        a.tick_params(axis="x", rotation=30, labelsize=8)
    sweep = results.get("static_sweep")
    if sweep:
        ax[1, 0].plot(sweep["g"], [100 * v for v in sweep["gap"]], marker="o", ms=3, label="static g (Eq. 5)")
        ax[1, 0].axvline(sweep["mean_share"], ls="--", color="gray", label=f"mean share {sweep['mean_share']:.2f}")
        if "kvstream" in pol:
            ax[1, 0].axhline(100 * pol["kvstream"]["gap"], color="tab:green", label="kvstream (simulated)")
        ax[1, 0].set_xlabel("share g of tier 0")
        ax[1, 0].set_ylabel("gap (%)")
        ax[1, 0].set_yscale("symlog", linthresh=1)
        ax[1, 0].set_ylim(bottom=0)
        ax[1, 0].legend()
    cap = results["capacity_sweep"]
    mem = np.asarray(cap["memory_bytes"]) / 1e9
    ax[1, 1].plot(mem, np.asarray(cap["eq2_bytes"]) / 1e12, marker="o", label="Eq. 2: V Pr[d > M]")
    if "lru_bytes" in cap:
        ax[1, 1].plot(mem, np.asarray(cap["lru_bytes"]) / 1e12, "x", ms=10, label="LRU cache misses")
    ax[1, 1].axvline(results["config"]["memory_bytes"] / 1e9, ls="--", color="gray", label="M of this run")
    ax[1, 1].set_xscale("log")
    ax[1, 1].set_xlabel("GPU+host capacity M per rank (GB)")
    ax[1, 1].set_ylabel("storage reads D per rank (TB)")
    ax[1, 1].legend()
    fig.suptitle(results["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _setting(flag: str, text: str, parse):
    """``parse(text)``; a ValueError names the flag and the value as written (the parsers' own
    messages name neither: 'could not convert string to float')."""
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"{flag} {text!r}: {e}") from None


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse the numeric settings that cannot be: before, a 0 was replaced by a default (`or`), ran
    as another value (--max-batch 0 as 1, --load 0 as rate 1.0), dropped every storage read
    (--chunk-tokens 0) or came out as an error about something else ('rate factor')."""
    rules = [  # (flag, value, holds, what to give instead)
        ("--limit", args.limit, args.limit is None or args.limit >= 1, "give N >= 1, or leave it out for every request"),
        ("--rate", args.rate, args.rate is None or args.rate > 0, "give a factor > 0 (2 = twice as fast)"),
        ("--load", args.load, args.rate is not None or args.load > 0, "give a utilization > 0 (default 0.8)"),
        ("--m", args.m, args.m >= 1, "give a claim size >= 1 (default 2)"),
        ("--depth", args.depth, args.depth is None or args.depth >= args.m, f"give at least --m ({args.m})"),
        ("--chunk-tokens", args.chunk_tokens, args.chunk_tokens >= 1, "a routing chunk holds >= 1 token (default 256)"),
        ("--max-batch", args.max_batch, args.max_batch >= 1, "give >= 1 request per step (default 16)"),
        ("--prefill-tps", args.prefill_tps, args.prefill_tps is None or args.prefill_tps > 0,
         "give tokens/s > 0, or leave it out for the model preset's"),
        ("--decode-tps", args.decode_tps, args.decode_tps is None or args.decode_tps > 0,
         "give tokens/s > 0, or leave it out for the model preset's"),
        ("--reuse", args.reuse, args.reuse is None or 0 <= args.reuse <= 1, "give a share within [0, 1]"),
    ]
    for flag, value, holds, fix in rules:
        if not holds:
            raise ValueError(f"{flag} {value:g}: {fix}")


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    _check_numbers(args)
    preset = _setting("--model", args.model, model.preset)
    bed_tiers, bed_writes = TESTBEDS[args.testbed or "2"]
    if args.bandwidth_json:
        tiers, recorded_writes = _setting("--bandwidth-json", args.bandwidth_json, load_recorded)
    else:
        tiers, recorded_writes = [_setting("--tier", s, parse_series) for s in (args.tier or bed_tiers)], []
    n_tiers = len(tiers)
    if args.write_bw:
        writes = [_setting("--write-bw", s, parse_series) for s in args.write_bw]
    elif recorded_writes and all(w is not None for w in recorded_writes):
        writes = list(recorded_writes)
    else:
        writes = [parse_series(s) for s in bed_writes[:n_tiers]]
    while len(writes) < n_tiers:
        writes.append(writes[-1] if writes else Constant(1e9))
    latency = _setting("--latency", args.latency, _floats)
    if not all(x >= 0 for x in latency):
        raise ValueError(f"--latency {args.latency!r}: give seconds >= 0 per tier")
    latency = (latency * n_tiers)[:n_tiers] if len(latency) == 1 else latency + [0.0] * (n_tiers - len(latency))
    d2h = _setting("--d2h", args.d2h, model.parse_bytes)
    if not d2h > 0:  # (every step's time is at least its demand over it)
        raise ValueError(f"--d2h {args.d2h!r}: give a host-to-device bandwidth > 0 (default 25G)")
    cfg = SimConfig(
        bytes_per_token=preset.bytes_per_token,
        memory_bytes=_setting("--memory", args.memory, model.parse_bytes),
        tiers=tiers,
        write_tiers=writes[:n_tiers],
        chunk_tokens=args.chunk_tokens,
        max_batch=args.max_batch,
        # (not `or`: a 0 given would have become the preset's rate; _check_numbers refuses it)
        prefill_tps=preset.prefill_tps if args.prefill_tps is None else args.prefill_tps,
        decode_tps=preset.decode_tps if args.decode_tps is None else args.decode_tps,
        d2h_bps=d2h,
        latency_s=latency,
        staging_bytes=_setting("--staging", args.staging, model.parse_bytes),
        m=args.m,
        depth=args.depth,
        write_model=args.write_model,
        read_priority=args.read_priority,
        write_inflight_bytes=_setting("--write-inflight", args.write_inflight, model.parse_bytes),
    )
    policies = [_setting("--policies", s, parse_sim_policy) for s in args.policies.split(",") if s.strip()]
    if args.reuse is not None and args.workload != "swebench":
        raise ValueError("--reuse applies to --workload swebench")
    requests = load_requests(args.trace, workload=args.workload, order=args.order, seed=args.seed, limit=args.limit,
                             reuse=args.reuse)
    t_load = time.perf_counter()
    stream = build_stream(requests)
    prep = prepare(stream, cfg)
    rate = args.rate if args.rate is not None else rate_for_load(prep, cfg, args.load)
    if not rate > 0:
        raise ValueError(f"rate factor must be > 0, got {rate}")
    prep.arrival_s = prep.arrival_s / rate  # same order, faster or slower arrivals (the paper's rate factor)
    t_stream = time.perf_counter()

    results: dict = {
        "title": (f"{os.path.basename(args.trace) if args.trace else args.workload}: {len(requests)} requests, order {args.order}, rate x{rate:.3g}, "
                  f"model {preset.name}, M {args.memory}/rank"),
        "source": args.trace or args.workload,
        "requests": len(requests),
        "config": {
            "model": preset.name, "bytes_per_token": cfg.bytes_per_token, "memory_bytes": cfg.memory_bytes,
            "tiers": [str(s) for s in tiers], "write_tiers": [str(s) for s in cfg.write_tiers],
            "order": args.order, "rate": rate, "load": None if args.rate is not None else args.load, "seed": args.seed, "chunk_tokens": cfg.chunk_tokens,
            "max_batch": cfg.max_batch, "prefill_tps": cfg.prefill_tps, "decode_tps": cfg.decode_tps,
            "latency_s": list(cfg.latency_s), "d2h_bps": cfg.d2h_bps, "staging_bytes": cfg.staging_bytes,
            "m": cfg.m, "depth": cfg.depth or 2 * cfg.m, "testbed": args.testbed, "reuse": args.reuse,
            "write_model": cfg.write_model, "read_priority": cfg.read_priority,
            "write_inflight_bytes": cfg.write_inflight_bytes,
        },
        "demand": {
            "reuse_bytes": prep.reuse_bytes,
            "storage_bytes": prep.storage_bytes,
            "miss_probability": prep.storage_bytes / prep.reuse_bytes if prep.reuse_bytes else 0.0,
            "unique_write_bytes": float(prep.write_bytes.sum()),
            "storage_to_write": prep.storage_bytes / float(prep.write_bytes.sum()) if prep.write_bytes.sum() else None,
        },
        "policies": {},
    }
    # kvstream first: its steps give the mean share that static-auto and the placements use.
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        raise ValueError(f"a policy is listed twice: {args.policies}")
    share_auto = None
    logs: dict = {}
    runs: dict = {}
    for p in sorted(policies, key=lambda p: _base(p) != "kvstream"):
        if p.auto_g and share_auto is None:
            share_auto = _auto_share(logs, tiers, prep)
        runs[p.name], log = run_policy(p, prep, cfg, mean_share=share_auto)
        logs.setdefault(_base(p), log)
    results["policies"] = {name: runs[name] for name in names}  # in the order asked for
    base = logs.get("kvstream")
    if base is not None and n_tiers == 2:
        results["static_sweep"] = {"g": SWEEP, "gap": static_sweep(base, SWEEP), "mean_share": mean_share(base)}
        sw = results["static_sweep"]
        sw["best_g"] = sw["g"][int(np.argmin(sw["gap"]))]
    caps = [_setting("--capacities", c, model.parse_bytes) for c in args.capacities.split(",") if c.strip()]
    results["capacity_sweep"] = capacity_sweep(stream, cfg.bytes_per_token, caps, lru=args.validate_lru)
    results["runtime_s"] = {"load": t_load - t0, "stream": t_stream - t_load, "total": time.perf_counter() - t0}
    return results


def _base(p) -> str:
    """A policy's name without its options ('kvstream:m=4' -> 'kvstream')."""
    return p.name.split(":")[0]


def _auto_share(logs: dict, tiers, prep) -> float:
    if "kvstream" in logs:
        return round(mean_share(logs["kvstream"]), 2)
    horizon = float(prep.arrival_s[-1]) if len(prep.arrival_s) else 1.0
    means = [s.mean(max(horizon, 1.0)) for s in tiers]
    return round(means[0] / sum(means), 2)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.validate_bench:
        return _validate(args)
    try:
        results = run(args)
    except (ValueError, OSError) as e:
        print(f"kvsim: {e}", file=sys.stderr)
        return 2
    d = results["demand"]
    print(results["title"])
    print(f"reused V {_gb(d['reuse_bytes'])} GB/rank, storage reads D {_gb(d['storage_bytes'])} GB/rank "
          f"(Pr[d > M] = {d['miss_probability']:.3f}), new KV {_gb(d['unique_write_bytes'])} GB/rank")
    print("tiers: " + "; ".join(results["config"]["tiers"]))
    print(table(results))
    if "static_sweep" in results:
        sw = results["static_sweep"]
        print(f"static split: best g {sw['best_g']:.2f} (gap {100 * min(sw['gap']):+.1f}%), "
              f"demand-weighted mean share {sw['mean_share']:.3f}")
    print(f"ran in {results['runtime_s']['total']:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1, default=_json_default)
    if args.plot:
        plot(results, args.plot)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from . import validate

    try:
        runs = validate.validate_files(args.validate_bench, m=args.m, depth=args.depth)
    except (ValueError, OSError, KeyError) as e:
        print(f"kvsim: {e}", file=sys.stderr)
        return 2
    print(validate.table(runs))
    summ = validate.summary(runs)
    for cls, by_src in summ.items():
        print(f"{cls}: " + "; ".join(f"{src} bandwidths |diff| mean {100 * v['mean_abs']:.1f}, max {100 * v['max_abs']:.1f} "
                                     f"gap points over {v['n']}" for src, v in by_src.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"runs": runs, "summary": summ}, fh, indent=1, default=_json_default)
    return 0


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and math.isinf(x):
        return None
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
