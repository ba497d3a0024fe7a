"""Tables from scripts/budget_matrix.sh's JSON: per-policy worst case against tier 0 alone and against
today's kvstream (full replication), and per-case detail for chosen policies.

    python scripts/budget_tables.py OUT_DIR [--detail POLICY,POLICY,...] [--models deferred,sync]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict

CASES = ["conv", "synth", "swe", "swe-r77", "swe-r04", "synth-M1280", "conv-M1280"]


def load(out: str) -> dict:
    runs = {}
    for f in sorted(glob.glob(os.path.join(out, "*.json"))):
        case, tb, model = os.path.basename(f)[:-5].split(".")
        with open(f) as fh:
            runs[(case, tb, model)] = json.load(fh)
    return runs


def best_static(pol: dict) -> dict:
    cands = [v for k, v in pol.items() if k.startswith("static-")]
    return min(cands, key=lambda r: r["ttft_mean_s"])


def worst_case(runs: dict, models: list[str]) -> str:
    """Per policy: the worst ratio tier0/policy (mean, p90) over all cases, and over the cases where today's
    kvstream beats tier 0 alone, the worst ratio kvstream/policy (mean)."""
    ratio_t0 = defaultdict(list)
    ratio_kv = defaultdict(list)
    names: list[str] = []
    for (case, tb, model), r in runs.items():
        if model not in models:
            continue
        pol = dict(r["policies"])
        pol["best-static"] = best_static(pol)
        t0, kv = pol["tier0"], pol["kvstream"]
        high = kv["ttft_mean_s"] < t0["ttft_mean_s"] * 0.95  # today's kvstream gains here
        for name, p in pol.items():
            if name.startswith("static-"):
                continue
            if name not in names:
                names.append(name)
            ratio_t0[name].append((t0["ttft_mean_s"] / p["ttft_mean_s"], t0["ttft_p90_s"] / p["ttft_p90_s"],
                                   f"{case}.t{tb[1:]}.{model}"))
            if high:
                ratio_kv[name].append((kv["ttft_mean_s"] / p["ttft_mean_s"], f"{case}.t{tb[1:]}.{model}"))
    rows = ["| policy | worst tier0/policy mean TTFT (case) | worst p90 ratio | cases < 1.0x (mean) | "
            "worst kvstream/policy where kvstream gains (case) |", "|---|---|---|---|---|"]
    for name in names:
        m = min(ratio_t0[name], key=lambda x: x[0])
        p9 = min(x[1] for x in ratio_t0[name])
        below = sum(1 for x in ratio_t0[name] if x[0] < 0.995)
        kvs = min(ratio_kv[name], key=lambda x: x[0]) if ratio_kv[name] else (float("nan"), "-")
        rows.append(f"| {name} | {m[0]:.2f}x ({m[2]}) | {p9:.2f}x | {below}/{len(ratio_t0[name])} | "
                    f"{kvs[0]:.2f}x ({kvs[1]}) |")
    return "\n".join(rows)


def detail(runs: dict, policies: list[str], models: list[str]) -> str:
    rows = ["| case | tb | write model | policy | TTFT mean | p50 | p90 | vs tier0 | gap | WA | stall s | "
            "t1 read share | t1 replicas skipped (pages, % bytes) |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case, tb, model, r in cells(runs, models):
        pol = dict(r["policies"])
        pol["best-static"] = best_static(pol)
        t0 = pol["tier0"]["ttft_mean_s"]
        for name in policies:
            p = pol[name]
            label = f"best static ({p['policy']})" if name == "best-static" else name
            sk = p.get("replica_skipped_bytes") or [0, 0]
            skp = p.get("replica_skipped_pages") or [0, 0]
            skip = (f"{skp[1]:,} ({100 * sk[1] / (sk[1] + p['write_bytes'][1]):.0f}%)"
                    if len(sk) > 1 and sk[1] else "-")
            rows.append(f"| {case} | {tb} | {model} | {label} | {p['ttft_mean_s']:.2f} | "
                        f"{p['ttft_p50_s']:.2f} | {p['ttft_p90_s']:.2f} | {t0 / p['ttft_mean_s']:.2f}x | "
                        f"{100 * p['gap']:+.1f}% | {p['write_amplification']:.2f} | "
                        f"{p['write_stall_s']:,.0f} | {p['read_share'][1]:.2f} | {skip} |")
    return "\n".join(rows)


def cells(runs: dict, models: list[str]):
    """(case, testbed, write model, result) in table order, for the runs present."""
    for case in CASES:
        for tb in ("t1", "t2"):
            for model in models:
                r = runs.get((case, tb, model))
                if r is not None:
                    yield case, tb, model, r


def compact(runs: dict, rule: str, models: list[str]) -> str:
    """One row per case: mean TTFT of the baselines and the rule, and the rule's other metrics."""
    rows = ["| case | tb | path | tier0 | today (kvstream) | best static | share-0.4 | after-slow | **budget** | "
            "budget vs tier0 | p50 / p90 (tier0 p50 / p90) | gap (today) | WA | stall s (tier0) | t1 read share | "
            "t1 replicas skipped: pages (bytes) |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---:|---:|"]
    for case, tb, model, r in cells(runs, models):
        pol = r["policies"]
        t0, kv, b = pol["tier0"], pol["kvstream"], pol[rule]
        st = best_static(pol)
        sk, skp = b["replica_skipped_bytes"], b["replica_skipped_pages"]
        skip = f"{skp[1]:,} ({100 * sk[1] / (sk[1] + b['write_bytes'][1]):.0f}%)" if sk[1] else "0"
        rows.append(
            f"| {case} | {tb} | {model} | {t0['ttft_mean_s']:.2f} | {kv['ttft_mean_s']:.2f} | "
            f"{st['ttft_mean_s']:.2f} ({st['policy'].replace('static-', '')}) | "
            f"{pol['replicate-share-0.4']['ttft_mean_s']:.2f} | "
            f"{pol['replicate-after-slow']['ttft_mean_s']:.2f} | "
            f"**{b['ttft_mean_s']:.2f}** | {t0['ttft_mean_s'] / b['ttft_mean_s']:.2f}x | "
            f"{b['ttft_p50_s']:.2f} / {b['ttft_p90_s']:.2f} ({t0['ttft_p50_s']:.2f} / {t0['ttft_p90_s']:.2f}) | "
            f"{100 * b['gap']:+.1f}% ({100 * kv['gap']:+.1f}%) | {b['write_amplification']:.2f} | "
            f"{b['write_stall_s']:,.0f} ({t0['write_stall_s']:,.0f}) | {b['read_share'][1]:.2f} | "
            f"{skip} |")
    return "\n".join(rows)


def demand(runs: dict) -> str:
    rows = ["| case | tb | D GB/rank | W GB/rank | D/W | rate factor |", "|---|---|---:|---:|---:|---:|"]
    for case in CASES:
        for tb in ("t1", "t2"):
            r = runs.get((case, tb, "legacy"))
            if r is None:
                continue
            d = r["demand"]
            rows.append(f"| {case} | {tb} | {d['storage_bytes'] / 1e9:,.0f} | "
                        f"{d['unique_write_bytes'] / 1e9:,.0f} | {d['storage_to_write']:.2f} | "
                        f"{r['config']['rate']:.3g} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--detail", default="")
    ap.add_argument("--models", default="legacy,deferred,sync,deferred-if32M")
    ap.add_argument("--worst", action="store_true")
    ap.add_argument("--demand", action="store_true")
    ap.add_argument("--compact", metavar="POLICY", help="one row per case for this budget policy")
    a = ap.parse_args()
    runs = load(a.out)
    models = a.models.split(",")
    if a.demand:
        print(demand(runs))
    if a.worst:
        for m in models:
            print(f"\n### write model {m}\n")
            print(worst_case(runs, [m]))
    if a.compact:
        print(compact(runs, a.compact, models))
    if a.detail:
        print(detail(runs, a.detail.split(","), models))


if __name__ == "__main__":
    main()
