"""kvstream bench: write a set of KV pages once (replicated), read them back batch by batch under each
policy, and report each policy's throughput, batch-time percentiles, per-tier read share and gap
to the aggregate-bandwidth bound measured in the same run.

Tiers: directories (fastest first; default $KVSTREAM_TIERS), or --testbed PROFILE (throttled
loop-device tiers built by `kvstream testbed up`; brought up here if needed, root only).
Policies (comma list): kvstream[:m=N], static-<g>, tier<k>, hicache-file (sglang's HiCacheFile on
tier 0, buffered, page cache dropped before each of its batches), sglang-adapter (kvstream through
the SGLang adapter into a real host pool). Each round reads one batch under every policy, in an
order rotated every round, so drift hits all policies alike.

The bound of a batch is D / sum_k b_k with b_k tier k's bandwidth in that batch (bytes / busy time
from the engine's per-batch stats), or, for a tier the policy left idle, interpolated between the
neighbouring batches that measured it. gap = sum T_ret / sum T_bound - 1 (see bench/gap.py).

Example (the paper's Testbed-2 at 1/20, Llama-3-8B pages of 64 tokens = 8 MiB):
  kvstream bench --testbed testbed2-1:20 --model llama3-8b --page-size 64 --batches 12 \\
      --scenario periodic --json out.json --plot out.png
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict

from ..console import Progress
from . import drift, gap, geometry, report
from .contenders import SGLANG_ADAPTER, HICACHE_FILE, LMCACHE_ADAPTER, SGLANG_CONTENDERS, AdapterReads, \
    EngineReads, HiCacheFileReads, LMCacheReads, SglangHost
from .instrument import SpanRecorder, instrumented_engines, ring_factory
from .dataset import Dataset, check, page_segments, page_views, poison

DEFAULT_POLICIES = "kvstream,static-0.5,static-0.75,tier0,hicache-file,sglang-adapter"
WORK_DIR = "kvstream-bench"  # per-tier subdirectory the bench owns (and removes)
BATCH_PAGES = 128  # sglang's STORAGE_BATCH_SIZE: pages per storage call
DEFAULT_DATA_BATCHES = 4  # distinct batches written; rounds cycle over them


class UsageError(ValueError):
    """Bad arguments or an unusable setup; ``kvstream bench`` prints the message and exits with 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("tiers")
    t.add_argument("tiers", nargs="*", metavar="DIR", help="tier directories, fastest first (default $KVSTREAM_TIERS)")
    t.add_argument("--testbed", metavar="PROFILE", help="use the throttled testbed: testbed2-1:20 | testbed1-1:20")
    t.add_argument("--testbed-name", default=None, help="testbed name (default kvstream)")
    t.add_argument("--testbed-size", default="16G", help="image size per tier when the bench builds the testbed")
    t.add_argument("--keep-testbed", action="store_true", help="leave a testbed this run built up afterwards")
    t.add_argument("--engine-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="engine settings (claim=2, chunk=1M, io_engine=uring, ...)")
    g = p.add_argument_group("pages")
    g.add_argument("--model", default="llama3-8b", help=f"page geometry preset: {', '.join(geometry.MODELS)}")
    g.add_argument("--page-size", type=int, default=64, help="tokens per page (default %(default)s)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (KV heads per rank)")
    g.add_argument("--page-bytes", type=int, default=None, help="explicit bytes per page (overrides --model)")
    g.add_argument("--batch", type=int, default=BATCH_PAGES, help="pages per batch (default %(default)s)")
    g.add_argument("--batches", type=int, default=8, help="timed rounds: one batch per policy each (default %(default)s)")
    g.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default %(default)s)")
    g.add_argument("--dataset-batches", type=int, default=None,
                   help=f"distinct batches written (default min(batches, {DEFAULT_DATA_BATCHES}))")
    g.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("policies and scenario")
    r.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma list (default %(default)s); also lmcache-adapter (the LMCache/vLLM path)")
    r.add_argument("--scenario", default="quiet", choices=(*drift.SCENARIOS, "mixed"),
                   help="a drift scenario of the reads, or mixed: a backup stream and a prefetch stream at once "
                        "under each write policy (bench/mixed.py)")
    r.add_argument("--drift-period", type=float, default=drift.DRIFT_PERIOD_S, help="seconds per drift phase")
    r.add_argument("--drift-tier", type=int, default=None, help="tier the drift hits (default: periodic/competing 1, "
                                                                  "write-interference 0)")
    r.add_argument("--drift-factor", type=float, default=drift.DRIFT_FACTOR,
                   help="periodic / emulated interference: read-limit multiplier while on (default %(default)s)")
    r.add_argument("--interference", default="emulated", choices=("emulated", "physical"),
                   help="write-interference on the testbed: also lower tier 0's read limit while writing "
                        "(emulated, default) or only run the writer (physical)")
    r.add_argument("--write-baseline", default="auto",
                   help="time single-tier writes: auto (testbed: slowest tier; dirs: every tier), all, none, or k")
    r.add_argument("--drop-caches", default="fadvise", choices=("fadvise", "global", "none"),
                   help="how hicache-file's page cache is dropped before each of its batches")
    r.add_argument("--verify", type=int, default=2, help="pages checked per batch (-1: all)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the results as JSON")
    o.add_argument("--plot", metavar="PATH", help="write a PNG: per-tier bandwidth and share over time, gap per policy")
    o.add_argument("--series", metavar="PATH", help="write per-tier bandwidth series for kvsim ({'tiers':[{t,bps}]})")
    o.add_argument("--keep-data", action="store_true", help="leave the written pages in the tiers")
    o.add_argument("--no-progress", action="store_true")


def run_cli(args: argparse.Namespace) -> int:
    doc = run(args)
    return 1 if doc.get("wrong_pages") else 0


# ----------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace, log=print) -> dict:
    from ...config import Config
    from ...layout import Namespace
    from ...router import parse_policy

    geom = page_geometry(args)
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    if not specs:
        raise UsageError("--policies is empty")
    if args.batch < 1 or args.batches < 1:
        raise UsageError("--batch and --batches must be >= 1")
    n_data = args.dataset_batches or min(max(args.batches, 1), DEFAULT_DATA_BATCHES)
    ds = Dataset(geom, args.batch, n_data, args.seed)
    engine_extra = _key_values(args.engine_config)

    with ExitStack() as stack:
        bed, roots = _tiers(args, geom, stack, log)
        dirs = [os.path.join(r, WORK_DIR) for r in roots]
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)  # a previous run's pages would make the writes free
            os.makedirs(d)
        if not args.keep_data:
            stack.callback(lambda: [shutil.rmtree(d, ignore_errors=True) for d in dirs])
        _check_space(dirs, ds, specs, _baseline_tiers(args.write_baseline, bed, len(dirs)))
        try:
            scenario = drift.make(args.scenario, testbed=bed, dirs=dirs, bs=geom.page_bytes, tier=args.drift_tier,
                                  factor=args.drift_factor, period=args.drift_period, seed=args.seed,
                                  interference=args.interference)
            # lmcache-adapter reads with the engine's configured (kvstream) policy, through the adapter
            policies = {spec: parse_policy(spec) for spec in specs
                        if spec not in SGLANG_CONTENDERS and spec != LMCACHE_ADAPTER}
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        n_tiers = len(dirs)
        log(f"kvstream bench: {geom.describe()}; {args.batch} pages per batch "
            f"({args.batch * geom.page_bytes / 2**30:.2f} GiB), {n_data} distinct batches, {args.batches} rounds; "
            f"tiers {', '.join(roots)}" + (f" (testbed {bed.profile.name})" if bed else ""))

        from ...engine import Engine
        from ...io import AlignedBuffer

        namespace = Namespace({"bench": "kvstream-bench", "geometry": geom.label, "segments": list(geom.segments),
                               "seed": args.seed})
        config = Config.from_sources({"tiers": dirs, **engine_extra})
        recorder = SpanRecorder(dirs)
        if not recorder.usable:
            log("  note: tiers share a file system: tier rates come from the engine's busy time (see bench/instrument.py)")
        engine = Engine(config, namespace, ring_factory=ring_factory(recorder))
        stack.callback(engine.close)

        # -- writes ------------------------------------------------------------------------------
        src = AlignedBuffer(args.batch * geom.page_bytes)
        stack.callback(src.close)
        writes = _write_phase(engine, ds, src, log)
        writes["single_tier"] = _write_baselines(args, bed, dirs, namespace, engine_extra, ds, src, log)
        src.close()  # a batch of memory back before the reads
        slowest = max(writes["single_tier"].values(), default=None)
        writes["ratio_to_slowest_alone"] = writes["replicated_s"] / slowest if slowest else None
        if slowest:
            log(f"  replicated write {writes['replicated_s']:.2f} s = {writes['ratio_to_slowest_alone']:.3f}x "
                f"the slowest tier alone ({slowest:.2f} s)")

        # -- contenders --------------------------------------------------------------------------
        dest = AlignedBuffer(args.batch * geom.page_bytes)
        stack.callback(dest.close)
        dest_views = page_views(dest, geom.page_bytes, args.batch)
        stack.callback(dest_views.clear)  # numpy views pin the buffer: released before dest.close()
        contenders = []
        host = None
        for spec in specs:
            if spec in SGLANG_CONTENDERS:
                if host is None:
                    host = SglangHost(geom, args.batch)
                with instrumented_engines(recorder):
                    c = _sglang_contender(spec, host, dirs, ds, geom, args, engine_extra, writes, log)
                stack.callback(c.close)
            elif spec == LMCACHE_ADAPTER:
                c = LMCacheReads(spec, engine, None, dest, dest_views, geom, args.batch)
            else:
                c = EngineReads(spec, engine, policies[spec], dest, dest_views, geom, args.batch)
            contenders.append(c)

        # -- reads -------------------------------------------------------------------------------
        scenario.prepare()
        records, wrong = _read_phase(args, ds, contenders, scenario, recorder, log)

    # -- figures ---------------------------------------------------------------------------------
    gap.assign_bounds(records, n_tiers, gap.MIN_TIER_PAGES * geom.page_bytes)
    doc = _document(args, geom, ds, bed, roots, specs, records, writes, scenario, contenders, wrong, recorder.usable)
    report.print_table(doc, log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"results: {args.json}")
    if args.plot:
        report.plot(doc, args.plot)
        log(f"plot: {args.plot}")
    if args.series:
        with open(args.series, "w") as f:
            json.dump(report.kvsim_series(doc), f)
        log(f"kvsim bandwidth series: {args.series}")
    return doc


def page_geometry(args) -> geometry.Geometry:
    """The pages of the run (``--page-bytes``, else ``--model``, ``--page-size``, ``--tp``)."""
    try:
        return (geometry.from_bytes(args.page_bytes) if args.page_bytes is not None
                else geometry.from_model(args.model, args.page_size, args.tp))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _tiers(args, geom, stack: ExitStack, log):
    """(testbed or None, tier root directories). Joins the testbed's blkio group for the run."""
    if not args.testbed:
        roots = list(args.tiers) or [d for d in os.environ.get("KVSTREAM_TIERS", "").split(os.pathsep) if d]
        if len(roots) < 1:
            raise UsageError("no tiers: give tier directories, set KVSTREAM_TIERS, or use --testbed PROFILE")
        return None, [os.path.abspath(r) for r in roots]
    from . import testbed as tb

    if args.tiers:
        raise UsageError("give tier directories or --testbed, not both")
    name = args.testbed_name or tb.DEFAULT_NAME
    profile = tb.parse_profile(args.testbed)
    bed = tb.Testbed.load(name)
    built = bed is None or bool(bed.problems())
    if built or bed.profile != profile or bed.fio.get("bs") != geom.page_bytes:
        sizes = [tb.parse_size(args.testbed_size)] * len(profile.tiers)
        bed = tb.up(profile, name=name, sizes=sizes, fio_bs=geom.page_bytes, log=log)
    if built and not args.keep_testbed:
        stack.callback(tb.down, name, log=log)
    bed.join()
    stack.callback(tb.leave)
    return bed, bed.dirs


def _check_space(dirs, ds: Dataset, specs, baseline: list[int]) -> None:
    """Refuse early when a tier cannot hold what the run writes there at its peak: the engine's copy
    plus the larger of the single-tier write baseline (removed before the peers write) and the peers'
    own copies (hicache-file on tier 0, the SGLang adapter on every tier)."""
    for k, d in enumerate(dirs):
        peers = (HICACHE_FILE in specs and k == 0) + (SGLANG_ADAPTER in specs)
        copies = 1 + max(int(k in baseline), peers)
        need, free = copies * ds.total_bytes, shutil.disk_usage(d).free
        if need > free:
            raise UsageError(f"{d}: the run needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free: "
                             "lower --dataset-batches or use larger tiers (--testbed-size)")


def _write_phase(engine, ds: Dataset, src, log) -> dict:
    import numpy as np

    buf = np.frombuffer(src, dtype=np.uint8)
    segs = page_segments(src.address, ds.geometry, ds.batch_pages)
    total, times, failed = 0.0, [], 0
    stats0 = engine.stats()
    for b in ds.batches:
        for i, j in enumerate(b.pages):
            ds.fill(j, buf[i * ds.page_bytes:(i + 1) * ds.page_bytes])
        t0 = time.perf_counter()
        ok = engine.put(list(b.keys), segs[: len(b.keys)])
        dt = time.perf_counter() - t0
        failed += sum(1 for x in ok if not x)
        times.append(dt)
        total += dt
    stats1 = engine.stats()
    d = ds.total_bytes
    busy = [t1.get("write_busy_s", 0) - t0.get("write_busy_s", 0) for t0, t1 in zip(stats0["tiers"], stats1["tiers"])]
    written = [t1.get("bytes_written", 0) - t0.get("bytes_written", 0) for t0, t1 in zip(stats0["tiers"], stats1["tiers"])]
    log(f"  replicated write: {d / 2**30:.2f} GiB to {len(busy)} tiers in {total:.2f} s "
        f"({d / total / 1e9:.3f} GB/s per tier); per tier busy " + ", ".join(f"{b:.2f} s" for b in busy))
    return {"replicated_s": total, "bytes": d, "batch_s": times, "failed_pages": failed,
            "tier_busy_s": busy, "tier_bytes_written": written,
            "per_tier_gbps": d / total / 1e9 if total else None}


def _baseline_tiers(spec: str, bed, n_tiers: int) -> list[int]:
    """Tiers whose single-tier write time is measured (``--write-baseline``)."""
    if spec == "none":
        return []
    if spec == "auto":
        return [bed.profile.slowest_write_tier] if bed else list(range(n_tiers))
    if spec == "all":
        return list(range(n_tiers))
    try:
        k = int(spec)
    except ValueError:
        raise UsageError(f"--write-baseline {spec!r}: use auto, all, none or a tier number") from None
    if not 0 <= k < n_tiers:
        raise UsageError(f"--write-baseline {k}: there are {n_tiers} tiers")
    return [k]


def _write_baselines(args, bed, dirs, namespace, engine_extra, ds: Dataset, src, log) -> dict[str, float]:
    """Seconds to write the data set to each baseline tier alone (a one-tier engine, same pages)."""
    from ...config import Config
    from ...engine import Engine

    out = {}
    for k in _baseline_tiers(args.write_baseline, bed, len(dirs)):
        d = os.path.join(dirs[k], "write-baseline")
        os.makedirs(d, exist_ok=True)
        eng = Engine(Config.from_sources({"tiers": [d], **engine_extra}), namespace)
        try:
            w = _write_phase(eng, ds, src, lambda msg: None)
        finally:
            eng.close()
            shutil.rmtree(d, ignore_errors=True)
        out[f"tier{k}"] = w["replicated_s"]
        log(f"  tier{k} alone: {w['replicated_s']:.2f} s ({ds.total_bytes / w['replicated_s'] / 1e9:.3f} GB/s)")
    return out


def _sglang_contender(spec, host, dirs, ds, geom, args, engine_extra, writes, log):
    model_name = f"kvstream-bench/{geom.label.replace(' ', '_')}"
    if spec == HICACHE_FILE:
        c = HiCacheFileReads(host, os.path.join(dirs[0], "hicache-file"), model_name, drop=args.drop_caches)
    else:
        c = AdapterReads(host, dirs, model_name, engine_extra)
    secs = sum(c.write(ds, b) for b in ds.batches)
    writes[spec] = {"seconds": secs, "gbps": ds.total_bytes / secs / 1e9 if secs else None}
    note = " (buffered, then fsynced)" if spec == HICACHE_FILE else ""
    log(f"  {spec} write{note}: {secs:.2f} s ({ds.total_bytes / secs / 1e9:.3f} GB/s)")
    return c


def _read_phase(args, ds: Dataset, contenders, scenario, recorder: SpanRecorder, log):
    records: list[gap.BatchRecord] = []
    wrong: dict[str, int] = {}
    n = len(contenders)
    rounds = args.warmup + args.batches
    progress = Progress(args.batches * n, enabled=not args.no_progress)
    shown = 0
    clock0 = time.perf_counter()
    clock = lambda: time.perf_counter() - clock0  # noqa: E731
    scenario.start(clock)
    try:
        for r in range(rounds):
            timed = r >= args.warmup
            batch = ds.batches[r % ds.n_batches]
            positions = list(range(len(batch.pages))) if args.verify < 0 else ds.sample(batch, args.verify)
            for j in range(n):
                c = contenders[(r + j) % n]  # rotate the order every round
                c.before_phase()
                poison(c.views, positions)
                recorder.reset()
                cpu0 = os.times()
                t0 = clock()
                out = c.read(batch)
                t_ret = clock() - t0
                cpu1 = os.times()
                out.extra["cpu_s"] = round((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system), 4)
                _use_spans(out, recorder, clock0 + t0)
                c.after_phase(out)
                bad = check(ds, batch, c.views, positions, out.found)
                if bad:
                    wrong[c.name] = wrong.get(c.name, 0) + len(bad)
                if not timed:
                    continue
                found = sum(out.found)
                records.append(gap.BatchRecord(
                    policy=c.name, round=r - args.warmup, t0=t0, t_ret=t_ret, nbytes=found * ds.page_bytes,
                    pages=len(batch.pages), found=found, tier_bytes=out.tier_bytes, tier_busy=out.tier_busy,
                    tier_served=out.tier_served, extra=out.extra))
                shown += 1
                progress.show(shown, f"{shown}/{progress.total} batches  {c.name} {t_ret:.2f}s, "
                                     f"eta {progress.eta(shown):.0f} s")
            if scenario.error is not None:
                raise RuntimeError(f"scenario {scenario.name} failed: {scenario.error}") from scenario.error
    finally:
        scenario.stop()
        progress.close()
    for r in records:  # share of each batch spent with the drift on: the same for every policy, on average
        r.extra["drift_on"] = round(drift.exposure(scenario.events, r.t0, r.t0 + r.t_ret), 3)
    if wrong:
        log("WRONG DATA read back: " + ", ".join(f"{k}: {v} page(s)" for k, v in wrong.items()))
    return records, wrong


def _use_spans(out, recorder: SpanRecorder, t0: float) -> None:
    """Replace the engine's per-tier busy time by the instrument's span where it measured the tier;
    keep the engine's figure and each tier's (first submission, last completion) for diagnostics."""
    if not recorder.usable:
        return
    spans, _ = recorder.spans()
    if all(sp is None for sp in spans):
        return  # not an engine read (hicache-file)
    out.extra["engine_busy_s"] = list(out.tier_busy)
    out.extra["tier_window_s"] = [None if e is None else [round(e[0], 4), round(e[1], 4)] for e in recorder.edges(t0)]
    out.tier_busy = tuple(sp if sp is not None else busy for sp, busy in zip(spans, out.tier_busy))


def _document(args, geom, ds, bed, roots, specs, records, writes, scenario, contenders, wrong,
              recorder_usable: bool) -> dict:
    n_tiers = len(roots)
    policies = {}
    for spec in specs:
        recs = [r for r in records if r.policy == spec]
        policies[spec] = gap.summarize(recs, n_tiers)
    for c in contenders:
        fps = getattr(c, "footprints", None)
        if fps:
            policies[c.name]["page_cache_bytes"] = max(fps)
            policies[c.name]["drop_caches"] = args.drop_caches
    ref = {}
    for name in ("tier0", HICACHE_FILE):
        if name in policies and policies[name].get("throughput_gbps"):
            ref[name] = policies[name]["throughput_gbps"]
    fio_all = ((bed.fio or {}).get("read") or {}).get("all") if bed else None  # MB/s, all tiers at once
    for p in policies.values():
        for name, thr in ref.items():
            p[f"speedup_vs_{name}"] = p["throughput_gbps"] / thr if p.get("throughput_gbps") else None
        if fio_all and p.get("throughput_gbps"):
            p["fraction_of_fio"] = p["throughput_gbps"] * 1e3 / fio_all
    doc = {
        "version": 1,
        "command": "kvstream bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"node": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "geometry": {"label": geom.label, "page_bytes": geom.page_bytes, "segments": list(geom.segments)},
        "batch_pages": args.batch, "rounds": args.batches, "warmup": args.warmup, "dataset_batches": ds.n_batches,
        "tiers": list(roots), "scenario": scenario.name, "drift_events": scenario.events,
        "testbed": ({"profile": bed.profile.name,
                     "limits_mbps": [[t.read_bps / 1e6, t.write_bps / 1e6] for t in bed.profile.tiers],
                     "fio": bed.fio} if bed else None),
        "bound_method": ("per batch: D / sum_k b_k, b_k = tier k's bytes / its span in that batch (first read "
                         "submitted to last read completed, ring instrument)" if recorder_usable else
                         "per batch: D / sum_k b_k, b_k = tier k's bytes / its busy time in that batch (engine stats)")
                        + "; interpolated between neighbouring batches for a tier the policy left idle",
        "bound_gbps": gap.overall_bound_gbps(records),
        "write": writes,
        "policies": policies,
        "wrong_pages": wrong,
        "batches": [_record_dict(r) for r in records],
    }
    return doc


def _record_dict(r: gap.BatchRecord) -> dict:
    d = asdict(r)
    d["t0"] = round(d["t0"], 4)
    return d


def _key_values(items) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--engine-config {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out
