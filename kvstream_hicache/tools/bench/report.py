"""What a benchmark run shows: a terminal table, a PNG, the kvsim series."""
from __future__ import annotations

from typing import Callable

from .peers import REFERENCES


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _ref_label(name: str) -> str:
    return "x " + name.removeprefix("lmcache-").replace("-odirect", "-od")


def print_table(doc: dict, log: Callable[[str], None] = print) -> None:
    """The per-policy table, then the bound, fio's figures and the write ratio."""
    pol = doc["policies"]
    n = len(doc["tiers"])
    refs = [k for k in REFERENCES if k in pol and pol[k]]
    head = f"{'policy':<26s} {'GB/s':>6s} {'med':>6s} " + "".join(f"{_ref_label(r):>16s}" for r in refs) + \
        f" {'CPU s/GB':>8s} {'mem MiB':>7s} {'p50 s':>6s} {'p90 s':>6s} {'max s':>6s}  " \
        f"{'share ' + '/'.join(f't{k}' for k in range(n)):<14s} {'gap':>7s}  {'tier MB/s':<12s}"
    log("")
    log(f"scenario {doc['scenario']}, {doc['rounds']} rounds x {doc['batch_pages']} pages of "
        f"{doc['geometry']['label']}" + (f", testbed {doc['testbed']['profile']}" if doc.get("testbed") else "")
        + (f"; load average {doc['loadavg']['start']} -> {doc['loadavg']['end']}" if doc.get("loadavg") else ""))
    log(head)
    log("-" * len(head))
    for name, p in pol.items():
        if not p:
            continue
        share = "/".join(f"{s:.2f}" for s in p["share"])
        row = f"{name:<26s} {p['throughput_gbps']:6.3f} {p.get('median_gbps') or 0:6.3f} " + \
            "".join(f"{_x(p.get('speedup_vs_' + r)):>16s}" for r in refs)
        cpu = p.get("cpu_s_per_gb")
        mem = p.get("memory_peak_bytes")
        row += f" {'-' if cpu is None else f'{cpu:.3f}':>8s} {'-' if mem is None else f'{mem / 2**20:.0f}':>7s}"
        rates = "/".join("-" if r is None else f"{r:.0f}" for r in p.get("tier_rates_mbps", []))
        row += f" {p['p50_s']:6.3f} {p['p90_s']:6.3f} {p['max_s']:6.3f}  {share:<14s} {_pct(p['gap']):>7s}  {rates:<12s}"
        if p.get("page_cache_bytes") is not None:
            row += f"  page cache {p['page_cache_bytes'] / 2**20:.1f} MiB after a batch"
        if p.get("missing_pages"):
            row += f"  MISSING {p['missing_pages']} pages"
        log(row)
    bound = doc.get("bound_gbps")
    log(f"bound (same run, per-batch tier rates): {bound:.3f} GB/s" if bound else "bound: not measured")
    f = doc.get("fio")
    if f and f.get("read"):
        r = f["read"]
        alone = ", ".join(f"tier{k} {r[f'tier{k}']:.0f}" for k in range(n) if f"tier{k}" in r)
        each = "".join(f"; {when} {f[when]['read']['all']:.0f}" for when in ("before", "after") if when in f)
        log(f"fio read MB/s (bs {f['bs'] >> 10} KiB, iodepth {f['iodepth']}, {f.get('source', '')}): alone {alone}; "
            f"all at once {r.get('all', 0):.0f}{each}")
        frac = ", ".join(f"{k} {p['fraction_of_fio']:.1%}" for k, p in pol.items() if p and p.get("fraction_of_fio"))
        log(f"throughput as a share of fio's all-at-once figure: {frac}")
    w = doc.get("write", {})
    if w.get("ratio_to_slowest_alone"):
        log(f"replicated write: {w['replicated_s']:.2f} s = {w['ratio_to_slowest_alone']:.3f}x the slowest tier alone "
            f"({', '.join(f'{k} {v:.2f} s' for k, v in w['single_tier'].items())})")
    c = w.get("catch_up")
    if c:
        reads = "; ".join(f"{label}: kvstream {c[when]['gbps']:.3f} GB/s = {c[when]['ratio_to_tier0']:.2f}x tier0, "
                          f"gap {_pct(c[when]['gap'])}" for when, label in
                          (("after_put", "right after the put"), ("after_catch_up", "after the catch-up"))
                          if when in c)
        log(f"catch-up: {sum(c['pages'])} replicas in {c['s']:.2f} s after the put "
            f"({c['ratio_to_replicated_write']:.2f}x the put"
            + (f", {c['ratio_to_slowest_alone']:.2f}x the slowest tier alone" if c.get("ratio_to_slowest_alone")
               else "") + ")" + ("" if c["finished"] else f", NOT finished: {c['pending_pages']} pages owed")
            + (f"; {reads}" if reads else ""))
    if doc.get("wrong_pages"):
        log(f"WRONG DATA: {doc['wrong_pages']}")


def kvsim_series(doc: dict, *, relative: bool = True) -> dict:
    """Per-tier read bandwidth over time as measured by the run's batches, in kvsim's recorded format
    (``kvstream_hicache/tools/sim/bandwidth.py``): ``{"tiers": [{"name", "t": [s], "bps": [bytes/s]}]}``.

    One sample per batch that measured the tier itself, at the batch's midpoint; ``relative``: ``t``
    starts at 0 (kvsim holds each value until the next sample and repeats the record).
    """
    n = len(doc["tiers"])
    series = []
    for k in range(n):
        pts = sorted((b["t0"] + b["t_ret"] / 2, b["tier_bps"][k]) for b in doc["batches"]
                     if len(b.get("tier_bps_source", ())) > k and b["tier_bps_source"][k] == "batch")
        series.append(pts)
    origin = min((pts[0][0] for pts in series if pts), default=0.0) if relative else 0.0
    tiers = [{"name": f"tier{k}", "t": [round(t - origin, 4) for t, _ in pts], "bps": [round(v, 1) for _, v in pts]}
             for k, pts in enumerate(series)]
    meta = {"scenario": doc["scenario"], "testbed": (doc.get("testbed") or {}).get("profile"),
            "source": "kvstream bench: per batch, tier bytes / tier span (bench/instrument.py)",
            "t_origin_s": round(origin, 4)}
    return {"tiers": tiers, "meta": meta}


def plot(doc: dict, path: str) -> None:
    """Three panels: per-tier bandwidth over time (with drift events), tier-0 share over time, gap per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(doc["tiers"])
    batches = doc["batches"]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8.5), gridspec_kw={"height_ratios": [1.1, 1, 1]})
    title = f"{doc.get('testbed', {}) and doc['testbed']['profile'] or 'tiers'} - scenario {doc['scenario']}"
    fig.suptitle(f"kvstream bench: {title}", fontsize=11)

    t_lo = min((b["t0"] for b in batches), default=0.0) - 0.5
    t_hi = max((b["t0"] + b["t_ret"] for b in batches), default=1.0) + 0.5
    ax = axes[0]
    series = kvsim_series(doc, relative=False)["tiers"]
    for k, s in enumerate(series):
        ax.plot(s["t"], [b / 1e6 for b in s["bps"]], ".-", ms=3, lw=0.8, color=f"C{k}",
                label=f"tier{k} measured per batch")
    _drift_marks(ax, doc, t_lo, t_hi)
    ax.set_xlim(t_lo, t_hi)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("MB/s")
    ax.set_xlabel("time (s)")
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    ax.set_title("per-tier bandwidth (dashed: throttle limits; shaded: the scenario's fio job running)", fontsize=9)

    ax = axes[1]
    live = [(b["t0"] + b["t_ret"] / 2, b["tier_bps"][0] / sum(b["tier_bps"])) for b in batches
            if b.get("tier_bps") and sum(b["tier_bps"]) > 0]
    if n > 1 and live:
        live.sort()
        ax.plot([t for t, _ in live], [s for _, s in live], "--", color="0.5", lw=1, label="live b0/(b0+b1)")
    for name in doc["policies"]:
        pts = [(b["t0"] + b["t_ret"] / 2, _served_share(b)) for b in batches if b["policy"] == name]
        pts = [(t, s) for t, s in pts if s is not None]
        if pts and len({round(s, 3) for _, s in pts} | {1.0}) > 1:  # single-tier policies add nothing here
            ax.plot([t for t, _ in pts], [s for _, s in pts], "o-", ms=3, lw=0.8, label=name)
    ax.set_ylim(0, 1.05)
    ax.set_xlim(t_lo, t_hi)
    ax.set_ylabel("tier-0 share")
    ax.set_xlabel("time (s)")
    ax.legend(fontsize=7, ncol=3, loc="lower right")
    ax.set_title("share of each batch read from tier 0", fontsize=9)

    ax = axes[2]
    names = [k for k, p in doc["policies"].items() if p and p.get("gap") is not None]
    gaps = [doc["policies"][k]["gap"] * 100 for k in names]
    bars = ax.bar(range(len(names)), gaps, color=["C2" if k.startswith("kvstream") else "C0" for k in names])
    for rect, g in zip(bars, gaps):
        ax.annotate(f"{g:.1f}%", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    ax.axhline(5, color="C3", lw=0.8, ls=":")
    ax.set_ylabel("gap to bound (%)")
    ax.set_title("gap to the bound per policy (dotted: 5% target)", fontsize=9)
    save_figure(fig, path)


def save_figure(fig, path: str) -> str:
    """Lay out, write as a small PNG (80 dpi, palette) and close ``fig``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    shrink_png(path)
    return path


def shrink_png(path: str, colors: int = 64) -> None:
    """Re-save a PNG with an adaptive palette (a third of the size, no visible change); no-op without Pillow."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=colors)
    small.save(path, optimize=True)


def _drift_marks(ax, doc: dict, t_lo: float, t_hi: float) -> None:
    """Throttle steps (periodic) as dashed lines, tenant on-periods (competing, writes) as shaded spans."""
    events = doc.get("drift_events") or []
    limits = (doc.get("testbed") or {}).get("limits_mbps")
    steps: dict[int, list[tuple[float, float]]] = {}
    on: dict[int, float] = {}
    for e in events:
        k = e.get("tier", 0)
        if "read_bps" in e:
            steps.setdefault(k, []).append((e["t"], e["read_bps"] / 1e6))
        if e.get("tenant") == "on":
            on[k] = e["t"]
        elif e.get("tenant") == "off" and k in on:
            ax.axvspan(on.pop(k), e["t"], color=f"C{k}", alpha=0.12, lw=0)
    for k, t in on.items():
        ax.axvspan(t, t_hi, color=f"C{k}", alpha=0.12, lw=0)
    if limits:
        for k, (r, _w) in enumerate(limits):
            pts = [(t_lo, r)] + sorted(steps.get(k, []))
            xs = [t for t, _ in pts] + [t_hi]
            ys = [v for _, v in pts]
            ax.step(xs[:-1] + [xs[-1]], ys + [ys[-1]], where="post", ls="--", lw=0.8, color=f"C{k}", alpha=0.7)


def _served_share(b: dict) -> float | None:
    served = b.get("tier_served") or ()
    total = sum(served)
    if total:
        return served[0] / total
    tb = b.get("tier_bytes") or ()
    return tb[0] / sum(tb) if sum(tb) else None

