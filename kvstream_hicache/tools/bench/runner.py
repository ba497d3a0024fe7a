"""kvstream bench: write a set of KV pages once (replicated), read them back batch by batch under each
policy, and report each policy's throughput, batch-time percentiles, per-tier read share and gap
to the aggregate-bandwidth bound measured in the same run.

Tiers: directories (fastest first; default $KVSTREAM_TIERS), or --testbed PROFILE (loop-device
tiers built by `kvstream testbed up`: throttled, RAM-backed or the machine's disk; brought up here
if needed, root only).
Policies (comma list): the bench engine's routing policies kvstream[:m=N], static-<g>, tier<k>;
kvstream-1tier (a one-tier engine on tier 0 with its own copy); lmcache-adapter (the engine through
the LMCache adapter's task machinery); and peers with their own copy: in the sglang venv
hicache-file (sglang's HiCacheFile on tier 0, buffered, page cache dropped before each of its
batches), sglang-adapter (kvstream through the SGLang adapter into a real host pool; -1tier: on
tier 0 alone, with its own copy), hicache-nixl
and hicache-nixl-sharded (sglang's NIXL backend on tier 0 / hash-sharded over all tiers; pip
install .[peers]); in the LMCache venv (.venv-lmcache/bin/kvstream bench) lmcache-fs-native,
lmcache-fs-native-odirect (LMCache's fs_native L2 adapter on tier 0), lmcache-kvstream and
lmcache-kvstream-1tier (kvstream's L2 adapter built by LMCache's factory, all tiers / tier 0).
Each round reads one batch under every policy, in an order shuffled every round (drift.round_order),
so drift hits all policies alike. Every policy's row has its CPU seconds per GB read (getrusage of the process around
each read) and the staging memory peak of the engine it reads through.

The bound of a batch is D / sum_k b_k with b_k tier k's bandwidth in that batch (bytes / busy time
from the engine's per-batch stats), or, for a tier the policy left idle, interpolated between the
neighbouring batches that measured it. gap = sum T_ret / sum T_bound - 1 (see bench/gap.py).

Example (the paper's Testbed-2 at 1/20, Llama-3-8B pages of 64 tokens = 8 MiB):
  kvstream bench --testbed testbed2-1:20 --model llama3-8b --page-size 64 --batches 12 \\
      --scenario periodic --json out.json --plot out.png
Device speed (RAM-backed tier 0 unthrottled, tier 1 at 0.7 GB/s; fio before and after the reads):
  kvstream bench --testbed ram-0.7 --batch 64 --dataset-batches 1 --batches 9 --fio run \\
      --policies hicache-nixl,hicache-nixl-sharded,kvstream-1tier,kvstream --json out.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import asdict

from ..console import Progress, missing_tiers
from . import drift, fio, gap, geometry, peers, report
from .contenders import LMCACHE_ADAPTER, EngineReads, LMCacheReads
from .instrument import SpanRecorder, instrumented_engines, ring_factory
from .dataset import Dataset, check, page_segments, page_views, poison

DEFAULT_POLICIES = "kvstream,static-0.5,static-0.75,tier0,hicache-file,sglang-adapter"
WORK_DIR = "kvstream-bench"  # per-tier subdirectory the bench owns (and removes)
BATCH_PAGES = 128  # sglang's STORAGE_BATCH_SIZE: pages per storage call
DEFAULT_DATA_BATCHES = 4  # distinct batches written; rounds cycle over them
DEVICE_FIO_IODEPTH = 32  # --fio run on plain directories: enough requests in flight for a real device
AFTER_PUT = "@put"  # suffix of the rows read right after the put, while the catch-up runs
AFTER_PUT_POLICIES = ("kvstream", "tier0")  # read once over the data set then (tier0: the ratio's reference)
CATCH_UP_WAIT_S = 120.0  # the catch-up is waited for at least this long (or 20x the put's time), s
CATCH_UP_POLL_S = 0.01


class UsageError(ValueError):
    """Bad arguments or an unusable setup; ``kvstream bench`` prints the message and exits with 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("tiers")
    t.add_argument("tiers", nargs="*", metavar="DIR", help="tier directories, fastest first (default $KVSTREAM_TIERS)")
    t.add_argument("--testbed", metavar="PROFILE",
                   help="use the testbed: throttled testbed2-1:20 | testbed1-1:20; device speed ram-0.7 | "
                        "testbed2-1:7 | disk+ram-0.7 (see kvstream testbed up --help)")
    t.add_argument("--testbed-name", default=None, help="testbed name (default kvstream)")
    t.add_argument("--testbed-size", default=None,
                   help="image size per tier when the bench builds the testbed (default 16G on disk, 6G in RAM)")
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
    r.add_argument("--fio", default="testbed", choices=("testbed", "run", "none"),
                   help="fio's read figures the policies are compared with: testbed (recorded when the testbed "
                        "came up, default), run (measured by this run, each tier alone and all at once, right "
                        "before and after the reads; also on plain directories), none")
    r.add_argument("--fio-iodepth", type=int, default=None,
                   help=f"fio requests in flight per tier for --fio run (default: the testbed profile's; "
                        f"{DEVICE_FIO_IODEPTH} on plain directories)")
    r.add_argument("--fio-runtime", type=float, default=fio.FIO_RUNTIME_S, help="seconds per fio measurement")
    r.add_argument("--fio-size", default=None,
                   help="fio's probe file per tier for --fio run (default: the testbed profile's; 1G on plain directories)")
    r.add_argument("--no-instrument", action="store_true",
                   help="open engines without the ring instrument (it costs a few us of Python per request): "
                        "tier rates then come from the engine's busy time")
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
    from ...config import Config, check_policy
    from ...layout import Namespace
    from ...router import parse_policy

    geom = page_geometry(args)
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    if not specs:
        raise UsageError("--policies is empty")
    if args.batch < 1 or args.batches < 1:
        raise UsageError("--batch and --batches must be >= 1")
    if args.fio_size:
        _bytes(args.fio_size, "--fio-size")  # refused now, not after the writes
    if args.fio == "run" and not fio.available():
        raise UsageError("--fio run needs fio, not found. Fix: apt-get install fio, or --fio none")
    if args.fio_iodepth is not None and args.fio_iodepth < 1:
        raise UsageError(f"--fio-iodepth {args.fio_iodepth}: must be >= 1")
    missing = peers.missing(specs)
    if missing:
        raise UsageError("\n  ".join(["cannot run the chosen policies here:", *missing]))
    n_data = args.dataset_batches or min(max(args.batches, 1), DEFAULT_DATA_BATCHES)
    ds = Dataset(geom, args.batch, n_data, args.seed)
    engine_extra = _key_values(args.engine_config)
    load = {"start": _loadavg()}

    with ExitStack() as stack:
        bed, roots = _tiers(args, geom, stack, log)
        dirs = [os.path.join(r, WORK_DIR) for r in roots]
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)  # a previous run's pages would make the writes free
            os.makedirs(d)
        if not args.keep_data:
            stack.callback(lambda: [shutil.rmtree(d, ignore_errors=True) for d in dirs])
        for spec in specs:  # checked as the engine's policy setting is, for these tiers, before anything is
            if spec not in peers.NOT_POLICIES:  # written (a 'tier2' for two tiers failed the first read)
                check_policy(spec, "--policies", len(dirs))
        _check_space(dirs, ds, specs, _baseline_tiers(args.write_baseline, bed, len(dirs)))
        try:
            scenario = drift.make(args.scenario, testbed=bed, dirs=dirs, bs=geom.page_bytes, tier=args.drift_tier,
                                  factor=args.drift_factor, period=args.drift_period, seed=args.seed,
                                  interference=args.interference)
            # lmcache-adapter reads with the engine's configured (kvstream) policy, through the adapter
            policies = {spec: parse_policy(spec) for spec in specs if spec not in peers.NOT_POLICIES}
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
        if args.no_instrument:
            recorder.usable = False  # engines open plain rings: nothing to record
        elif not recorder.usable:
            log("  note: tiers share a file system: tier rates come from the engine's busy time (see bench/instrument.py)")
        instrumented = not args.no_instrument
        engine = Engine(config, namespace, **({"ring_factory": ring_factory(recorder)} if instrumented else {}))
        stack.callback(engine.close)

        # -- writes ------------------------------------------------------------------------------
        src = AlignedBuffer(args.batch * geom.page_bytes)
        stack.callback(src.close)
        writes = _write_phase(engine, ds, src, log)
        watch = _CatchUpWatch(engine, max(CATCH_UP_WAIT_S, 20 * writes["replicated_s"])) if config.catchup else None
        dest = AlignedBuffer(args.batch * geom.page_bytes)
        stack.callback(dest.close)
        dest_views = page_views(dest, geom.page_bytes, args.batch)
        stack.callback(dest_views.clear)  # numpy views pin the buffer: released before dest.close()
        after_put: list[gap.BatchRecord] = []
        clock0 = time.perf_counter()  # one timeline for both read phases (t0, the series, kvsim's input)
        if config.catchup:  # reads while the catch-up runs, then the catch-up's own time (before the baselines
            # write: they would compete with it)
            after_put, _ = _read_phase(_once(args, ds), ds, [
                EngineReads(f"{spec}{AFTER_PUT}", engine, parse_policy(spec), dest, dest_views, geom, args.batch)
                for spec in AFTER_PUT_POLICIES], drift.make("quiet", testbed=bed, dirs=dirs, bs=geom.page_bytes),
                recorder, log, clock0)
            writes["catch_up"] = watch.result(writes["replicated_s"], log)
        writes["single_tier"] = _write_baselines(args, bed, dirs, namespace, engine_extra, ds, src, log)
        src.close()  # a batch of memory back before the reads
        slowest = max(writes["single_tier"].values(), default=None)
        writes["ratio_to_slowest_alone"] = writes["replicated_s"] / slowest if slowest else None
        if slowest:
            log(f"  replicated write {writes['replicated_s']:.2f} s = {writes['ratio_to_slowest_alone']:.3f}x "
                f"the slowest tier alone ({slowest:.2f} s)")
            if "catch_up" in writes:
                writes["catch_up"]["ratio_to_slowest_alone"] = writes["catch_up"]["s"] / slowest

        # -- contenders --------------------------------------------------------------------------
        contenders = []
        ctx = peers.Context(dirs, geom, args.batch, engine_extra, namespace, dest, dest_views, args.drop_caches)
        stack.callback(ctx.close)  # after every contender (closed before it: the stack unwinds in reverse)
        for spec in specs:
            if spec in peers.OWN_COPY:
                with instrumented_engines(recorder) if instrumented else nullcontext():
                    c = peers.build(spec, ctx)
                stack.callback(c.close)
                _peer_write(c, ds, writes, log)
            elif spec == LMCACHE_ADAPTER:
                c = LMCacheReads(spec, engine, None, dest, dest_views, geom, args.batch)
            else:
                c = EngineReads(spec, engine, policies[spec], dest, dest_views, geom, args.batch)
            contenders.append(c)

        # -- reads (fio right before and after them, with --fio run) ------------------------------
        fio_run = {}
        if args.fio == "run":
            fio_run["before"] = _fio_reads(args, bed, dirs, geom, log)
        scenario.prepare()
        records, wrong = _read_phase(args, ds, contenders, scenario, recorder, log, clock0)
        if args.fio == "run":
            fio_run["after"] = _fio_reads(args, bed, dirs, geom, log)
    load["end"] = _loadavg()

    # -- figures ---------------------------------------------------------------------------------
    for phase in (after_put, records):  # (a tier's rate while the catch-up wrote never stands in for a later one)
        gap.assign_bounds(phase, n_tiers, gap.MIN_TIER_PAGES * geom.page_bytes)
    records = after_put + records
    doc = _document(args, geom, ds, bed, roots, specs, records, writes, scenario, contenders, wrong, recorder.usable,
                    fio_run, load)
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
        missing = missing_tiers(roots, "tier directories" if args.tiers else "KVSTREAM_TIERS")
        if missing:
            raise UsageError(missing)
        return None, [os.path.abspath(r) for r in roots]
    from . import testbed as tb

    if args.tiers:
        raise UsageError("give tier directories or --testbed, not both")
    name = args.testbed_name or tb.DEFAULT_NAME
    profile = tb.parse_profile(args.testbed)
    bed = tb.Testbed.load(name)
    built = bed is None or bool(bed.problems())
    if built or bed.profile != profile or (args.fio == "testbed" and bed.fio.get("bs") != geom.page_bytes):
        sizes = [tb.parse_size(args.testbed_size)] * len(profile.tiers) if args.testbed_size else None
        # --fio run measures in the run itself; none wants no figures at all
        bed = tb.up(profile, name=name, sizes=sizes, fio_bs=geom.page_bytes if args.fio == "testbed" else None,
                    log=log)
    if built and not args.keep_testbed:
        stack.callback(tb.down, name, log=log)
    bed.join()
    stack.callback(tb.leave)
    return bed, bed.dirs


def _check_space(dirs, ds: Dataset, specs, baseline: list[int]) -> None:
    """Refuse early when a tier cannot hold what the run writes there at its peak: the engine's copy
    plus the larger of the single-tier write baseline (removed before the peers write) and the peers'
    own copies (peers.copies)."""
    own = [sum(c) for c in zip(*(peers.copies(spec, len(dirs)) for spec in specs))] if specs else []
    for k, d in enumerate(dirs):
        copies = 1 + max(int(k in baseline), own[k] if own else 0)
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


def _once(args, ds: Dataset) -> argparse.Namespace:
    """The read phase's settings for one untimed-warm-up-free pass over the data set."""
    return argparse.Namespace(**{**vars(args), "warmup": 0, "batches": ds.n_batches})


class _CatchUpWatch:
    """From the end of the put: when background replication first owes nothing (polled every
    CATCH_UP_POLL_S in a thread, so the reads right after the put do not hide the moment)."""

    def __init__(self, engine, limit: float):
        import threading

        self.engine, self.limit, self.t0, self.took = engine, limit, time.perf_counter(), None
        self._thread = threading.Thread(target=self._watch, name="bench-catch-up", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while time.perf_counter() - self.t0 < self.limit:
            if not self.engine.stats()["replication_pending"]:
                self.took = time.perf_counter() - self.t0
                return
            time.sleep(CATCH_UP_POLL_S)

    def result(self, write_s: float, log) -> dict:
        self._thread.join()
        stats = self.engine.stats()
        took = self.took if self.took is not None else time.perf_counter() - self.t0
        out = {"s": took, "finished": self.took is not None, "pending_pages": stats["replication_pending"],
               "pages": [t["replication_done"] for t in stats["tiers"]],
               "bytes": [t["replication_bytes"] for t in stats["tiers"]],
               "skipped_pages": [t["replica_skipped_pages"] for t in stats["tiers"]],
               "ratio_to_replicated_write": took / write_s if write_s else None}
        log(f"  catch-up: {sum(out['pages'])} replicas ({sum(out['bytes']) / 2**30:.2f} GiB) written in {took:.2f} s "
            f"after the put ({out['ratio_to_replicated_write']:.2f}x the put's time)"
            + ("" if out["finished"] else f"; NOT finished after {self.limit:.0f} s: {out['pending_pages']} owed"))
        return out


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


def _peer_write(c, ds: Dataset, writes: dict, log) -> None:
    """A contender with its own copy writes the data set through its own write path."""
    secs = sum(c.write(ds, b) for b in ds.batches)
    writes[c.name] = {"seconds": secs, "gbps": ds.total_bytes / secs / 1e9 if secs else None}
    note = " (buffered, then fsynced)" if c.buffered else ""
    log(f"  {c.name} write{note}: {secs:.2f} s ({ds.total_bytes / secs / 1e9:.3f} GB/s)")


def _fio_reads(args, bed, dirs, geom, log) -> dict:
    """fio reads of each tier alone, then all at once (one probe file per tier, one page per request)."""
    files = bed.probe_files() if bed else [os.path.join(d, ".fio-probe") for d in dirs]
    pre = bed.joined_preexec() if bed else None
    iodepth = args.fio_iodepth or (bed.profile.fio_iodepth if bed else DEVICE_FIO_IODEPTH)
    size = _bytes(args.fio_size, "--fio-size") if args.fio_size else (
        bed.profile.fio_file_bytes if bed else fio.FIO_FILE_BYTES)
    fio.fill(files, geom.page_bytes, size, iodepth, preexec_fn=pre)
    out = fio.alone_and_together(files, "randread", geom.page_bytes, size=size, iodepth=iodepth,
                                 runtime_s=args.fio_runtime, preexec_fn=pre, log=log)
    return {"bs": geom.page_bytes, "iodepth": iodepth, "runtime_s": args.fio_runtime, "read": out}


def _bytes(text: str, what: str) -> int:
    from .testbed import TestbedError, parse_size

    try:
        return parse_size(text)
    except TestbedError as exc:
        raise UsageError(f"{what}: {exc}") from None


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_s() -> float:
    """Process CPU seconds so far, every thread (getrusage: microseconds, where times(2) counts 10 ms ticks)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _read_phase(args, ds: Dataset, contenders, scenario, recorder: SpanRecorder, log, clock0: float):
    records: list[gap.BatchRecord] = []
    wrong: dict[str, int] = {}
    n = len(contenders)
    rounds = args.warmup + args.batches
    progress = Progress(args.batches * n, enabled=not args.no_progress)
    shown = 0
    clock = lambda: time.perf_counter() - clock0  # noqa: E731
    # As a serving process does once warmed up (sglang's freeze_gc): the objects of start-up leave the
    # collector's view. Without it a full collection over everything sglang and torch allocated (0.1-0.3 s
    # here, measured with gc.callbacks) lands inside whichever contender's read happens to trigger it.
    gc.collect()
    gc.freeze()
    scenario.start(clock)
    try:
        for r in range(rounds):
            timed = r >= args.warmup
            batch = ds.batches[r % ds.n_batches]
            positions = list(range(len(batch.pages))) if args.verify < 0 else ds.sample(batch, args.verify)
            for c in drift.round_order(contenders, r, args.seed):
                c.before_phase()
                poison(c.views, positions)
                recorder.reset()
                cpu0 = _cpu_s()
                t0 = clock()
                out = c.read(batch)
                t_ret = clock() - t0
                recorder.returned()
                out.extra["cpu_s"] = round(_cpu_s() - cpu0, 5)
                memory = c.memory()
                if memory is not None:
                    out.extra["memory_peak_bytes"] = memory["read_peak_bytes"] + memory["write_peak_bytes"]
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
        gc.unfreeze()
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
              recorder_usable: bool, fio_run: dict, load: dict) -> dict:
    n_tiers = len(roots)
    policies = {}
    after_put = [f"{spec}{AFTER_PUT}" for spec in AFTER_PUT_POLICIES if any(r.policy == spec + AFTER_PUT
                                                                          for r in records)]
    for spec in after_put + specs:
        recs = [r for r in records if r.policy == spec]
        policies[spec] = gap.summarize(recs, n_tiers)
    for c in contenders:
        fps = getattr(c, "footprints", None)
        if fps:
            policies[c.name]["page_cache_bytes"] = max(fps)
            policies[c.name]["drop_caches"] = args.drop_caches
    ref = {}
    for name in peers.REFERENCES:
        if name in policies and policies[name].get("throughput_gbps"):
            ref[name] = policies[name]
    fio_doc = _fio_doc(args, bed, fio_run)
    fio_all = ((fio_doc or {}).get("read") or {}).get("all")  # MB/s, all tiers at once
    for row, p in policies.items():
        for name, r in ref.items():
            if row.endswith(AFTER_PUT):  # read while the catch-up wrote: against the reference read then too
                r = policies.get(name + AFTER_PUT) or {}
            p[f"speedup_vs_{name}"] = (p["throughput_gbps"] / r["throughput_gbps"]
                                       if p.get("throughput_gbps") and r.get("throughput_gbps") else None)
            if p.get("median_gbps") and r.get("median_gbps"):
                p[f"median_speedup_vs_{name}"] = p["median_gbps"] / r["median_gbps"]
        if fio_all and p.get("throughput_gbps"):
            p["fraction_of_fio"] = p["throughput_gbps"] * 1e3 / fio_all
    catch_up = writes.get("catch_up")
    if catch_up is not None:  # the default engine's reads right after the put and after its catch-up
        for when, kv, t0 in (("after_put", "kvstream" + AFTER_PUT, "tier0" + AFTER_PUT),
                             ("after_catch_up", "kvstream", "tier0")):
            a, b = policies.get(kv) or {}, policies.get(t0) or {}
            if a.get("throughput_gbps") and b.get("throughput_gbps"):
                catch_up[when] = {"gbps": a["throughput_gbps"], "gap": a["gap"],
                                  "ratio_to_tier0": a["throughput_gbps"] / b["throughput_gbps"]}
    doc = {
        "version": 1,
        "command": "kvstream bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"node": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "geometry": {"label": geom.label, "page_bytes": geom.page_bytes, "segments": list(geom.segments)},
        "batch_pages": args.batch, "rounds": args.batches, "warmup": args.warmup, "dataset_batches": ds.n_batches,
        "tiers": list(roots), "scenario": scenario.name, "drift_events": scenario.events,
        "loadavg": load,
        "testbed": ({"profile": bed.profile.name,
                     "limits_mbps": [[t.read_bps / 1e6, t.write_bps / 1e6] for t in bed.profile.tiers],
                     "backing": [t.backing for t in bed.profile.tiers],
                     "fio": bed.fio} if bed else None),
        "fio": fio_doc,
        "bound_method": ("per batch: D / sum_k b_k, b_k = tier k's bytes / its span in that batch (first read "
                         "submitted to last read completed, ring instrument)" if recorder_usable else
                         "per batch: D / sum_k b_k, b_k = tier k's bytes / its busy time in that batch (engine stats)")
                        + "; interpolated between neighbouring batches for a tier the policy left idle",
        # the timed rounds' (those of every reference row), not the reads while the catch-up wrote
        "bound_gbps": gap.overall_bound_gbps([r for r in records if not r.policy.endswith(AFTER_PUT)]),
        "write": writes,
        "policies": policies,
        "wrong_pages": wrong,
        "batches": [_record_dict(r) for r in records],
    }
    return doc


def _fio_doc(args, bed, fio_run: dict) -> dict | None:
    """fio's read figures the policies are compared with: this run's (the mean of before and after the
    reads, both kept), or the testbed's record."""
    if fio_run:
        runs = [fio_run[k] for k in ("before", "after") if k in fio_run]
        keys = runs[0]["read"].keys()
        mean = {k: round(sum(r["read"][k] for r in runs) / len(runs), 1) for k in keys}
        return {**{k: v for k, v in runs[0].items() if k != "read"}, "source": "this run, before and after the reads",
                **fio_run, "read": mean}
    if bed and args.fio == "testbed" and bed.fio:
        return {**bed.fio, "source": "the testbed's record"}
    return None


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
