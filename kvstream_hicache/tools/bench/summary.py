"""Summarize repeated ``kvstream bench --json`` runs: medians per (testbed, scenario, policy), as
Markdown tables and two figures per testbed (gap per policy and scenario; gap against the static
share g, the V of the paper's Figure 21). ``--headline``: the SGLang adapter's device-speed table (per
testbed, a row per page geometry, per-round spreads). ``--device``: the device-speed tables instead (per testbed
and page size: MB/s, ratios to the peers and to fio's both-tiers-at-once read measured in the same
runs, CPU seconds per GB, engine memory), and one overview per page size, testbeds as rows.

    python -m kvstream_hicache.tools.bench.summary out/*.json --md out/summary.md --img-dir docs/img
    python -m kvstream_hicache.tools.bench.summary --device docs/data/device-speed/*.json
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from typing import Iterable, Sequence

from .lmcache_l2 import L2_CONTENDERS
from .report import save_figure

SCENARIO_ORDER = ("quiet", "periodic", "competing", "write-interference")


def load(paths: Iterable[str]) -> list[dict]:
    docs = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        doc["_path"] = p
        docs.append(doc)
    return docs


def _profile(doc: dict) -> str:
    return (doc.get("testbed") or {}).get("profile") or "tiers"


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def group(docs: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for d in docs:
        out[(_profile(d), d["scenario"])].append(d)
    return out


def medians(runs: Sequence[dict]) -> dict[str, dict]:
    """Per policy: the median over runs of each figure (ratios are taken per run, then the median)."""
    names: list[str] = []
    for r in runs:
        names += [n for n in r["policies"] if n not in names]
    out = {}
    for n in names:
        ps = [r["policies"][n] for r in runs if r["policies"].get(n)]
        if not ps:
            continue
        n_tiers = len(ps[0]["share"])
        out[n] = {
            "runs": len(ps),
            "throughput_gbps": _median([p["throughput_gbps"] for p in ps]),
            "gap": _median([p["gap"] for p in ps]),
            "gap_min": min((p["gap"] for p in ps if p["gap"] is not None), default=None),
            "gap_max": max((p["gap"] for p in ps if p["gap"] is not None), default=None),
            "p50_s": _median([p["p50_s"] for p in ps]),
            "p90_s": _median([p["p90_s"] for p in ps]),
            "max_s": _median([p["max_s"] for p in ps]),
            "share": [_median([p["share"][k] for p in ps]) for k in range(n_tiers)],
            "speedup_vs_tier0": _median([p.get("speedup_vs_tier0") for p in ps]),
            "speedup_vs_hicache-file": _median([p.get("speedup_vs_hicache-file") for p in ps]),
            "page_cache_bytes": _median([p.get("page_cache_bytes") for p in ps]),
            "fraction_of_fio": _median([p.get("fraction_of_fio") for p in ps]),
            "startup_s": _median([p.get("startup_s") for p in ps]),
            "drift_on_frac": _median([p.get("drift_on_frac") for p in ps]),
            "tail_s": _median([p.get("tail_s") for p in ps]),
            "cpu_s_per_batch": _median([p.get("cpu_s_per_batch") for p in ps]),
            "engine_busy_frac": [_median([(p.get("engine_busy_frac") or [None] * n_tiers)[k] for p in ps])
                                 for k in range(n_tiers)],
            "tier_rates_mbps": [_median([(p.get("tier_rates_mbps") or [None] * n_tiers)[k] for p in ps])
                                for k in range(n_tiers)],
        }
    return out


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def markdown(docs: Sequence[dict]) -> str:
    lines = []
    for (profile, scenario), runs in sorted(group(docs).items(), key=lambda kv: (kv[0][0], _order(kv[0][1]))):
        med = medians(runs)
        bound = _median([r.get("bound_gbps") for r in runs])
        lines.append(f"#### {profile}, {scenario} ({len(runs)} run{'s' if len(runs) > 1 else ''}, medians)")
        lines.append("")
        lines.append("| policy | GB/s | of fio | x tier0 | x hicache-file | p50 s | p90 s | max s | share t0/t1 | "
                     "tier MB/s | drift on | gap (min..max) |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
        for name, m in med.items():
            share = "/".join(_f(s, ".2f") for s in m["share"])
            rates = "/".join(_f(r, ".0f") for r in m["tier_rates_mbps"])
            g = m["gap"]
            gap = "-" if g is None else f"{g * 100:+.1f}% ({m['gap_min'] * 100:+.1f}..{m['gap_max'] * 100:+.1f})"
            extra = ""
            if m.get("page_cache_bytes"):
                extra = f" (page cache {m['page_cache_bytes'] / 2**20:.0f} MiB)"
            fio = "-" if m["fraction_of_fio"] is None else f"{m['fraction_of_fio']:.1%}"
            lines.append(f"| {name}{extra} | {_f(m['throughput_gbps'], '.3f')} | {fio} | {_f(m['speedup_vs_tier0'], '.2f')} | "
                         f"{_f(m['speedup_vs_hicache-file'], '.2f')} | {_f(m['p50_s'], '.2f')} | "
                         f"{_f(m['p90_s'], '.2f')} | {_f(m['max_s'], '.2f')} | {share} | {rates} | "
                         f"{'-' if scenario == 'quiet' else _f(m['drift_on_frac'], '.0%')} | {gap} |")
        lines.append("")
        for name in ("kvstream", "sglang-adapter"):
            m = med.get(name)
            if m and m.get("cpu_s_per_batch") is not None:
                busy = "/".join(_f(b, ".0%") for b in m["engine_busy_frac"])
                lines.append(f"{name} diagnostics: engine busy time t0/t1 {busy} of the batch; call to first read "
                             f"{_f(m['startup_s'], '.3f')} s; first tier done to batch done {_f(m['tail_s'], '.3f')} s; "
                             f"CPU {_f(m['cpu_s_per_batch'], '.2f')} s per batch.")
        allows = _median([r["bound_gbps"] / r["policies"]["tier0"]["throughput_gbps"] for r in runs
                          if r.get("bound_gbps") and (r["policies"].get("tier0") or {}).get("throughput_gbps")])
        lines.append(f"Bound (median over runs): {_f(bound, '.3f')} GB/s"
                     + (f", {allows:.2f}x tier0's throughput." if allows else "."))
        w = [r["write"].get("ratio_to_slowest_alone") for r in runs]
        if any(x is not None for x in w):
            lines.append(f"Replicated write / slowest tier alone: median {_median(w):.3f}x "
                         f"(runs: {', '.join(_f(x, '.3f') for x in w)}).")
        lines.append("")
    return "\n".join(lines)


def _order(scenario: str) -> int:
    return SCENARIO_ORDER.index(scenario) if scenario in SCENARIO_ORDER else len(SCENARIO_ORDER)


def _static_g(name: str) -> float | None:
    m = re.fullmatch(r"static-([0-9.]+)", name)
    return float(m[1]) if m else None


def plots(docs: Sequence[dict], img_dir: str, prefix: str = "bench") -> list[str]:
    """Per testbed: gap per policy and scenario (grouped bars) and gap against g (V shape)."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    by_profile: dict[str, dict[str, dict]] = defaultdict(dict)
    for (profile, scenario), runs in group(docs).items():
        by_profile[profile][scenario] = medians(runs)
    for profile, scen in by_profile.items():
        scenarios = sorted(scen, key=_order)
        names: list[str] = []
        for s in scenarios:
            names += [n for n in scen[s] if n not in names]
        fig, ax = plt.subplots(figsize=(8, 3.6))
        width = 0.8 / max(len(scenarios), 1)
        for j, s in enumerate(scenarios):
            vals = [(scen[s].get(n) or {}).get("gap") for n in names]
            xs = [i + (j - (len(scenarios) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [0 if v is None else v * 100 for v in vals], width, label=s)
        ax.axhline(5, color="C3", lw=0.8, ls=":")
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=12)
        ax.set_ylabel("gap to bound (%)")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_title(f"{profile}: gap to the aggregate-bandwidth bound (median of runs; dotted: 5%)", fontsize=9)
        ax.legend(fontsize=7)
        written.append(save_figure(fig, os.path.join(img_dir, f"{prefix}-{profile.replace(':', '_')}-gap.png")))

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for j, s in enumerate(scenarios):
            pts = sorted((_static_g(n), m["gap"]) for n, m in scen[s].items() if _static_g(n) is not None and m["gap"] is not None)
            if len(pts) < 2:
                continue
            ax.plot([g for g, _ in pts], [v * 100 for _, v in pts], "o-", color=f"C{j}", label=f"static-g, {s}")
            kv = scen[s].get("kvstream") or {}
            if kv.get("gap") is not None:
                ax.axhline(kv["gap"] * 100, color=f"C{j}", ls="--", lw=0.8)
            if kv.get("share"):  # where kvstream's completion order put the split: the live share
                ax.axvline(kv["share"][0], color=f"C{j}", ls=":", lw=0.8)
        ax.set_xlabel("static share g of tier 0")
        ax.set_ylabel("gap to bound (%)")
        ax.set_title(f"{profile}: static split g vs kvstream (dashed: its gap; dotted: its share)", fontsize=9)
        ax.legend(fontsize=7)
        written.append(save_figure(fig, os.path.join(img_dir, f"{prefix}-{profile.replace(':', '_')}-vshape.png")))
    return written


# ------------------------------------------------------------------------------------- device speed
DEVICE_COLUMNS = {  # overview columns per environment: (policy, heading)
    "sglang": (("hicache-nixl", "nixl (1 dir)"), ("hicache-nixl-sharded", "nixl sharded"),
               ("hicache-file", "sglang file"), ("kvstream-1tier", "kvstream 1 tier"), ("kvstream", "kvstream 2 tiers"),
               ("sglang-adapter-1tier", "kvstream adapter 1 tier"),
               ("sglang-adapter-1tier-staged", "kvstream adapter 1 tier, staged"),
               ("sglang-adapter", "kvstream adapter 2 tiers")),
    "lmcache": (("lmcache-fs-native-odirect", "fs_native O_DIRECT"), ("lmcache-fs-native", "fs_native buffered"),
                ("lmcache-kvstream-1tier", "kvstream adapter 1 tier"), ("lmcache-kvstream", "kvstream adapter 2 tiers")),
}
DEVICE_REFS = {"sglang": "hicache-nixl", "lmcache": "lmcache-fs-native-odirect"}
DEVICE_ORDER = ("ram-0.7", "disk+ram-0.7", "testbed2-1:7")  # the issue's rows A, B, C; others after them


def _device_order(profile: str) -> tuple[int, str]:
    return (DEVICE_ORDER.index(profile) if profile in DEVICE_ORDER else len(DEVICE_ORDER), profile)


def _env(doc: dict) -> str:
    # (lmcache-adapter is kvstream's own task machinery, run in .venv beside the sglang contenders)
    return "lmcache" if any(n in L2_CONTENDERS for n in doc["policies"]) else "sglang"


def _fio_all(doc: dict) -> float | None:
    return ((doc.get("fio") or {}).get("read") or {}).get("all")


def device_groups(docs: Sequence[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """Runs by (environment, page geometry, testbed)."""
    out: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for d in docs:
        out[(_env(d), d["geometry"]["label"], _profile(d))].append(d)
    return out


def paired_ratios(runs: Sequence[dict], name: str, ref: str) -> list[float]:
    """Per round of every run, ``name``'s batch rate over ``ref``'s in the same round: the two read
    one after the other (in an order shuffled every round), so machine load that drifts over minutes hits both."""
    out = []
    for r in runs:
        rates: dict[tuple[str, int], float] = {}
        for b in r.get("batches", ()):
            if b["t_ret"] > 0 and b["nbytes"]:
                rates[(b["policy"], b["round"])] = b["nbytes"] / b["t_ret"]
        out += [v / rates[(ref, k)] for (p, k), v in rates.items() if p == name and (ref, k) in rates]
    return out


def device_row(runs: Sequence[dict], name: str, ref: str) -> dict | None:
    """A policy's figures over runs: medians of per-run MB/s (payload / read time over the run's rounds),
    ratios to ``ref`` (per run, and per round: :func:`paired_ratios`) and to fio both-at-once, CPU s/GB,
    memory peak, duplicate bytes, gap to the per-batch bound."""
    ps = [(r, r["policies"].get(name)) for r in runs]
    ps = [(r, p) for r, p in ps if p]
    if not ps:
        return None
    mbps = [p["throughput_gbps"] * 1e3 for _, p in ps]
    return {
        "runs": len(ps), "mbps": _median(mbps), "mbps_min": min(mbps), "mbps_max": max(mbps),
        "x_ref": _median([p.get(f"speedup_vs_{ref}") for _, p in ps]),
        "x_ref_runs": [p.get(f"speedup_vs_{ref}") for _, p in ps],
        "x_ref_paired": _median(paired_ratios(runs, name, ref)),
        "gap": _median([p.get("gap") for _, p in ps]),
        "x_fio": _median([p["throughput_gbps"] * 1e3 / _fio_all(r) if _fio_all(r) else None for r, p in ps]),
        "cpu_s_per_gb": _median([p.get("cpu_s_per_gb") for _, p in ps]),
        "memory_mib": _median([p["memory_peak_bytes"] / 2**20 if p.get("memory_peak_bytes") is not None else None
                               for _, p in ps]),
        "share": [_median([p["share"][k] for _, p in ps]) for k in range(len(ps[0][1]["share"]))],
        "duplicate": _median([p.get("read_amplification") for _, p in ps]),
        "page_cache_mib": _median([p["page_cache_bytes"] / 2**20 if p.get("page_cache_bytes") else None
                                   for _, p in ps]),
    }


def device_markdown(docs: Sequence[dict]) -> str:
    """Per page geometry: an overview (testbeds as rows, contenders as columns), then per testbed
    the full table with every policy."""
    groups = device_groups(docs)
    lines: list[str] = []
    for env, label in sorted({(e, g) for e, g, _ in groups}):
        ref = DEVICE_REFS[env]
        cols = DEVICE_COLUMNS[env]
        profiles = sorted((p for e, g, p in groups if (e, g) == (env, label)), key=_device_order)
        lines += [f"#### {label}: {env} path, medians of runs", "",
                  "| testbed | " + " | ".join(h for _, h in cols) + " | fio, both tiers at once |",
                  "|---|" + "---:|" * (len(cols) + 1)]
        for prof in profiles:
            runs = groups[(env, label, prof)]
            cells = []
            for name, _ in cols:
                row = device_row(runs, name, ref)
                if row is None:
                    cells.append("-")
                    continue
                ratio = f" ({row['x_ref_paired']:.2f}x)" if name != ref and row["x_ref_paired"] is not None else ""
                two_tier = name in ("kvstream", "sglang-adapter", "lmcache-kvstream")
                of_fio = f", {row['x_fio']:.2f}x fio" if two_tier and row["x_fio"] else ""
                cells.append(f"{row['mbps']:.0f}{ratio}{of_fio}, {_f(row['cpu_s_per_gb'], '.3f')} s/GB")
            fio = [((r.get("fio") or {}).get("read") or {}) for r in runs]
            both = " + ".join(_f(_median([f.get(f"tier{k}+") for f in fio]), ".0f")
                              for k in range(len(runs[0]["tiers"])))
            fio_cell = f"{both} = {_f(_median([f.get('all') for f in fio]), '.0f')}" if any(fio) else "-"
            lines.append(f"| {prof} ({len(runs)} runs) | " + " | ".join(cells) + f" | {fio_cell} |")
        lines += ["", f"MB/s = 10^6 B/s, median of the runs' rates; (Nx) = median over every round of the runs of the "
                      f"ratio to {ref}'s batch in the same round; s/GB = process CPU seconds per GB read (getrusage "
                      "around each read); two tiers: also the ratio to fio's both-at-once read in the same run.", ""]
        for prof in profiles:
            runs = groups[(env, label, prof)]
            loads = [x for r in runs for x in (r.get("loadavg") or {}).values()]
            names: list[str] = []
            for r in runs:
                names += [n for n in r["policies"] if n not in names]
            lines += [f"##### {prof}, {label} ({len(runs)} runs; load average "
                      f"{min((x[0] for x in loads), default=0):.1f}-{max((x[0] for x in loads), default=0):.1f})", "",
                      f"| policy | MB/s (min..max) | x {ref}: per round (per run) | of fio both | gap | CPU s/GB | "
                      "engine memory MiB | share t0/t1 | duplicate bytes |",
                      "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
            for name in names:
                row = device_row(runs, name, ref)
                if row is None:
                    continue
                extra = f" (page cache {row['page_cache_mib']:.0f} MiB)" if row["page_cache_mib"] else ""
                per_run = ", ".join(_f(x, ".2f") for x in row["x_ref_runs"])
                gap = "-" if row["gap"] is None else f"{row['gap'] * 100:+.1f}%"
                lines.append(f"| {name}{extra} | {row['mbps']:.0f} ({row['mbps_min']:.0f}..{row['mbps_max']:.0f}) | "
                             f"{_f(row['x_ref_paired'], '.2f')} ({per_run}) | {_f(row['x_fio'], '.0%')} | {gap} | "
                             f"{_f(row['cpu_s_per_gb'], '.3f')} | "
                             f"{_f(row['memory_mib'], '.0f')} | {'/'.join(_f(x, '.2f') for x in row['share'])} | "
                             f"{_f(row['duplicate'], '.1%')} |")
            fio = [((r.get("fio") or {}).get("read") or {}) for r in runs]
            alone = ", ".join(f"tier{k} {_f(_median([f.get(f'tier{k}') for f in fio]), '.0f')}"
                              for k in range(len(runs[0]["tiers"])))
            lines += ["", f"fio alone: {alone} MB/s; both at once "
                          f"{_f(_median([f.get('all') for f in fio]), '.0f')} MB/s (medians of the runs, each the mean "
                          "of fio right before and right after the reads).", ""]
    return "\n".join(lines)


# (policy, its one-tier twin or None, heading): the SGLang adapter first (what a SGLang user runs, into
# sglang's own host pool), then the bare engine into the bench's huge-page buffer
HEADLINE_COLUMNS = (("sglang-adapter-1tier", None, "adapter 1 tier"),
                    ("sglang-adapter-1tier-staged", None, "adapter 1 tier, staged"),
                    ("sglang-adapter", "sglang-adapter-1tier",
                    "adapter 2 tiers"), ("kvstream-1tier", None, "engine 1 tier"), ("kvstream", "kvstream-1tier",
                    "engine 2 tiers"))


def spread(xs: Sequence[float], fmt: str = ".2f") -> str:
    """``median (min..max)`` of per-round figures, or ``-``."""
    if not xs:
        return "-"
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def round_rates(runs: Sequence[dict], name: str) -> list[float]:
    """MB/s of each of ``name``'s batches over the runs."""
    return [b["nbytes"] / b["t_ret"] / 1e6 for r in runs for b in r.get("batches", ())
            if b["policy"] == name and b["t_ret"] > 0 and b["nbytes"]]


def headline_markdown(docs: Sequence[dict]) -> str:
    """The SGLang path's headline: per testbed, one row per page geometry, the adapter (sglang's host
    pool) before the bare engine. Every figure is over interleaved rounds: the median and, in
    brackets, the smallest and largest round; ratios are per round (against nixl's batch, or the
    two-tier contender's one-tier twin, of the same round)."""
    groups = {k: v for k, v in device_groups(docs).items() if k[0] == "sglang"}
    ref = DEVICE_REFS["sglang"]
    lines: list[str] = []
    for prof in sorted({p for _, _, p in groups}, key=_device_order):
        labels = sorted((g for _, g, p in groups if p == prof),
                        key=lambda g: -groups[("sglang", g, prof)][0]["geometry"].get("page_bytes", 0))
        lines += [f"#### {prof}: the SGLang adapter through sglang's host pool, beside the bare engine", "",
                  "| pages | nixl: MB/s; s/GB | " + " | ".join(f"{h}: MB/s; x nixl; s/GB" if twin is None else
                                                       f"{h}: MB/s; x nixl; x 1 tier; s/GB"
                                                       for _, twin, h in HEADLINE_COLUMNS) + " | fio both, MB/s |",
                  "|---|" + "---|" * (len(HEADLINE_COLUMNS) + 2)]
        for label in labels:
            runs = groups[("sglang", label, prof)]
            nixl = device_row(runs, ref, ref)
            cells = [spread(round_rates(runs, ref), ".0f") + ("; " + _f(nixl["cpu_s_per_gb"], ".3f") if nixl else "")]
            for name, twin, _ in HEADLINE_COLUMNS:
                row = device_row(runs, name, ref)
                if row is None:
                    cells.append("-")
                    continue
                parts = [spread(round_rates(runs, name), ".0f"), spread(paired_ratios(runs, name, ref))]
                if twin is not None:
                    parts.append(spread(paired_ratios(runs, name, twin)))
                cells.append("; ".join(parts + [_f(row["cpu_s_per_gb"], ".3f")]))
            cells.append(_f(_median([_fio_all(r) for r in runs]), ".0f"))
            rounds = sum(len({b["round"] for b in r.get("batches", ())}) for r in runs)
            lines.append(f"| {label} ({rounds} rounds) | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="kvstream bench --json outputs")
    p.add_argument("--device", action="store_true", help="device-speed tables (ratios to peers and fio, CPU s/GB)")
    p.add_argument("--headline", action="store_true",
                   help="the SGLang path's headline: per testbed and page geometry, the adapter beside the engine")
    p.add_argument("--md", help="write the Markdown tables here (default: stdout)")
    p.add_argument("--img-dir", help="write the summary figures here")
    p.add_argument("--prefix", default="bench")
    args = p.parse_args(argv)
    docs = load(args.json)
    text = headline_markdown(docs) if args.headline else device_markdown(docs) if args.device else markdown(docs)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    else:
        print(text)
    if args.img_dir:
        for path in plots(docs, args.img_dir, args.prefix):
            print(f"figure: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
