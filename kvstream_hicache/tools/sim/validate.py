"""The model against real ``kvstream bench`` runs (docs/kvsim.md, "Validation against kvstream bench runs").

A bench run (``kvstream bench --json``) times batches of ``D_i`` bytes per policy and records, per
batch, the bandwidth ``b_k(i)`` each tier delivered in that batch (``tier_bps``: tier bytes / tier
span, or interpolated from the neighbouring batches for a tier the policy left idle) and the bound
``T^_i = D_i / sum_k b_k(i)`` (Eq. 3). Its gap is ``sum_i T_ret(i) / sum_i T^_i - 1``.

The model predicts each batch's retrieval time from bandwidths alone:

    static-G            Eq. 5: ``max(G D / b_0, (1 - G) D / b_1)`` (penalty Eq. 6 at phi_i = b_0 / (b_0 + b_1))
    tierK, hicache-file ``D / b_K`` (hicache-file: SGLang's HiCacheFile reads tier 0 only)
    kvstream, sglang-adapter
                        ``batch.simulate`` of completion-driven routing, claim by claim over the
                        batch's pages (Eq. 4's bound plus the claim-granular tail)

and the predicted gap is ``sum_i T_pred(i) / sum_i T^_i - 1``, with two choices of ``b_k(i)``:

    own       the bandwidths measured in the batch itself (what the bench's bound uses): tests the
              equations and how much of the measured time they leave unexplained (start-up, tail,
              CPU), not the bandwidth forecast;
    others    leave-one-out: each tier's rate interpolated at the batch's midpoint from the *other*
              batches of the run that measured it (the kvsim series of the run without this batch),
              i.e. the model fed a recording instead of the batch's own measurement.

Pure functions over the parsed JSON; ``kvsim --validate-bench RUN.json ...`` prints the table.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Sequence

from ...router import CompletionDriven
from ..rates import interpolate
from . import model
from .batch import simulate

__all__ = ["SOURCES", "predict_batch", "validate_run", "validate_files", "summary", "table"]

SOURCES = ("own", "others")
_STATIC = re.compile(r"^static-(?P<g>[0-9.]+(?:/[0-9.]+)*)$")
_TIER = re.compile(r"^tier(?P<k>\d+)$")
COMPLETION_DRIVEN = ("kvstream", "sglang-adapter")  # both route through the engine's completion-driven router
SINGLE_TIER0 = ("hicache-file",)


def _kind(policy: str) -> tuple[str, object] | None:
    """``("static", g)``, ``("tier", k)``, ``("kvstream", None)`` or None (a policy the model does not cover)."""
    name = policy.split(":", 1)[0].strip().lower()
    if name in COMPLETION_DRIVEN:
        return "kvstream", None
    if name in SINGLE_TIER0:
        return "tier", 0
    if m := _STATIC.match(name):
        parts = [float(x) for x in m["g"].split("/")]
        return "static", parts[0] if len(parts) == 1 else parts
    if m := _TIER.match(name):
        return "tier", int(m["k"])
    return None


def predict_batch(policy: str, nbytes: float, pages: int, bandwidths: Sequence[float], *, m: int = 2,
                  depth: int | None = None) -> float | None:
    """The model's retrieval time (s) of one batch of ``nbytes`` in ``pages`` equal pages read through
    ``policy`` at constant per-tier ``bandwidths`` (bytes/s); None for a policy it does not cover."""
    kind = _kind(policy)
    if kind is None or nbytes <= 0:
        return None if kind is None else 0.0
    what, arg = kind
    if what == "static":
        return model.static_time(nbytes, arg, bandwidths)  # Eq. 5
    if what == "tier":
        b = bandwidths[arg]
        return nbytes / b if b > 0 else float("inf")
    pages = max(int(pages), 1)
    res = simulate(CompletionDriven(m=m, depth=depth), pages, [float(b) for b in bandwidths], item_bytes=nbytes / pages)
    return res.finish


def _others(batches: list[dict], n_tiers: int) -> list[list[tuple[float, float, int]]]:
    """Per tier: (midpoint, bps, batch index) of the batches that measured the tier themselves."""
    out = []
    for k in range(n_tiers):
        pts = sorted((b["t0"] + b["t_ret"] / 2, float(b["tier_bps"][k]), i) for i, b in enumerate(batches)
                     if len(b.get("tier_bps_source") or ()) > k and b["tier_bps_source"][k] == "batch")
        out.append(pts)
    return out


def _interp(pts: list[tuple[float, float, int]], t: float, skip: int) -> float | None:
    """Interpolation at ``t`` over ``pts`` without the batch ``skip`` (leave-one-out)."""
    return interpolate([(pt, v) for pt, v, batch in pts if batch != skip], t)


def validate_run(doc: dict, *, m: int = 2, depth: int | None = None, name: str = "") -> dict:
    """Measured against predicted gap per policy of one bench run (the parsed ``--json``).

    Returns ``{"run", "scenario", "testbed", "policies": {policy: {"batches", "measured_gap",
    "reported_gap", "predicted_gap": {"own", "others"}, "mean_phi"}}}``; policies the model does not
    cover are left out.
    """
    batches = [b for b in doc.get("batches", []) if b.get("bound_s") and b.get("tier_bps")]
    n_tiers = len(doc.get("tiers") or batches[0]["tier_bps"]) if batches else 0
    others = _others(batches, n_tiers)
    acc: dict[str, dict] = {}
    for i, b in enumerate(batches):
        pol = b["policy"]
        if _kind(pol) is None:
            continue
        nbytes = float(b["nbytes"])
        pages = int(b.get("found") or b.get("pages") or 1)
        own = [float(x) for x in b["tier_bps"]]
        oth = [_interp(others[k], b["t0"] + b["t_ret"] / 2, i) for k in range(n_tiers)]
        oth = [o if o is not None else own[k] for k, o in enumerate(oth)]
        a = acc.setdefault(pol, {"n": 0, "t_ret": 0.0, "bound": 0.0, "phi_w": 0.0,
                                 "pred": {s: 0.0 for s in SOURCES}, "pred_bound": {s: 0.0 for s in SOURCES}})
        a["n"] += 1
        a["t_ret"] += float(b["t_ret"])
        a["bound"] += float(b["bound_s"])
        a["phi_w"] += model.share(own)[0] * nbytes
        a.setdefault("bytes", 0.0)
        a["bytes"] += nbytes
        for src, bw in (("own", own), ("others", oth)):
            a["pred"][src] += predict_batch(pol, nbytes, pages, bw, m=m, depth=depth)
            a["pred_bound"][src] += model.bound(nbytes, bw)  # Eq. 3 with the same bandwidths
    policies = {}
    for pol, a in acc.items():
        reported = (doc.get("policies") or {}).get(pol, {}).get("gap")
        policies[pol] = {
            "batches": a["n"],
            "measured_gap": a["t_ret"] / a["bound"] - 1.0,
            "reported_gap": reported,
            "predicted_gap": {s: a["pred"][s] / a["pred_bound"][s] - 1.0 for s in SOURCES},
            "mean_phi": a["phi_w"] / a["bytes"] if a["bytes"] else None,
        }
    return {
        "run": name,
        "scenario": doc.get("scenario"),
        "testbed": (doc.get("testbed") or {}).get("profile"),
        "policies": policies,
    }


def validate_files(paths: Iterable[str | os.PathLike], *, m: int = 2, depth: int | None = None) -> list[dict]:
    """``validate_run`` over bench JSON files (a ``...-series.json`` holds no batches: skip it)."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        if "batches" not in doc:
            raise ValueError(f"{path}: not a kvstream bench --json result (no 'batches'; a -series.json?)")
        name = os.path.basename(str(path))
        out.append(validate_run(doc, m=m, depth=depth, name=name[:-5] if name.endswith(".json") else name))
    return out


def _class(policy: str) -> str:
    name = policy.split(":", 1)[0].strip().lower()
    if name in SINGLE_TIER0:
        return name  # another engine (SGLang's HiCacheFile): its own overheads, kept apart
    return {"static": "static", "tier": "single tier", "kvstream": "completion-driven"}[_kind(policy)[0]]


def summary(runs: list[dict]) -> dict:
    """Mean and max |predicted - measured| (gap points) per policy class and bandwidth source."""
    groups: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        for pol, p in r["policies"].items():
            cls = _class(pol)
            g = groups.setdefault(cls, {s: [] for s in SOURCES})
            for s in SOURCES:
                g[s].append(p["predicted_gap"][s] - p["measured_gap"])
    return {cls: {s: {"n": len(v), "mean_abs": sum(map(abs, v)) / len(v), "max_abs": max(map(abs, v)),
                      "mean": sum(v) / len(v)} for s, v in g.items() if v}
            for cls, g in groups.items()}


def table(runs: list[dict]) -> str:
    """One row per run and policy: measured gap, predicted gaps, differences (gap points)."""
    rows = [("run", "policy", "phi", "measured", "pred own", "diff", "pred others", "diff")]
    for r in runs:
        for pol, p in r["policies"].items():
            meas, pr = p["measured_gap"], p["predicted_gap"]
            rows.append((r["run"], pol, f"{p['mean_phi']:.2f}", f"{100 * meas:+.1f}%",
                         f"{100 * pr['own']:+.1f}%", f"{100 * (pr['own'] - meas):+.1f}",
                         f"{100 * pr['others']:+.1f}%", f"{100 * (pr['others'] - meas):+.1f}"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if c > 1 else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
