"""``kvstream bench --scenario mixed``: a backup stream and a prefetch stream through the same engine.

Do writes cost reads? Each write policy has its own engine over the same tiers (one shared
data set, one namespace):

  today      replicate=all, read_priority=off: every write in flight at once, whatever is read
  priority   replicate=all, read_priority=on: writes to a tier wait while a get reads it
  budget     replicate=budget, read_priority=on, catchup=off: and a slower tier skips replicas it
             cannot drain, for good
  kvstream   the defaults: budget, and background replication writes the skipped replicas later
             (replication.py), competing with the mixed reads as the engine schedules it
  lmcache    as kvstream, through the LMCache adapter's machinery (L2Core): the backup stream is store
             tasks (deferred writes, M2: queued in the engine, completed when committed), the
             prefetch stream load tasks (8 per batch, pooled)

Every round, for each policy in turn (the order shuffled every round: drift.round_order):

  1. a quiet read: one batch of the data set, nothing else running; it measures each tier's read
     bandwidth b_k when nothing competes, which bounds the mixed reads below;
  2. a mixed phase: the backup stream (``engine.put`` of ``--write-batch`` new pages at a time, as
     SGLang's backup thread does, paced at ``--write-rate``) runs while the prefetch stream reads
     ``--mixed-reads`` batches, each followed by ``--mixed-gap`` seconds without reads (the forward
     pass of a serving step); the phase ends with the last read's gap, then the backup stream stops
     after the put in progress;
  3. the phase's new pages are removed (index and files), so every phase starts from the same tiers.

Per policy: the mixed reads' gap to the quiet bound (sum T_mixed / sum D / sum_k b_k(quiet) - 1: what
the writes cost the reads), their in-batch gap (routing against the bandwidth the tiers had), read
p50/p90 (mixed and quiet), the backup stream's throughput and its ratio to ``today``'s, the pages
in flight of a put (``write_queued_bytes`` sampled at each read: the backlog), time writes were held,
replica skips and the replicas catch-up wrote during the phases (``catch_up``). ``--write-rate auto`` (default) paces the backup stream at half the slowest tier's
write bandwidth, measured when the data set is written: a rate the tiers can sustain, so that the
comparison is of what writes cost reads, not of which policy writes more.
"""
from __future__ import annotations

import itertools
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from contextlib import ExitStack

from ...config import Config
from ...layout import Namespace
from ..console import Progress
from . import drift
from .dataset import Dataset, check, page_segments, page_views, poison

POLICIES = {  # name: (engine settings, path)
    "today": ({"replicate": "all", "read_priority": "off"}, "sglang"),
    "priority": ({"replicate": "all", "read_priority": "on"}, "sglang"),
    "budget": ({"replicate": "budget", "read_priority": "on", "catchup": "off"}, "sglang"),
    "kvstream": ({"replicate": "budget", "read_priority": "on", "catchup": "on"}, "sglang"),
    "lmcache": ({"replicate": "budget", "read_priority": "on", "catchup": "on"}, "lmcache"),
}
SETTLE_S = 120.0  # the data set's catch-up (a first engine with catch-up on) is waited for at most this long
LOAD_TASKS = 8  # lmcache path: load tasks per prefetch batch (LMCache keeps up to 8 requests in flight)
DEFAULT_WRITE_BATCH = 16  # pages per backup put
AUTO_RATE_SHARE = 0.5  # --write-rate auto: this share of the slowest tier's write bandwidth


def add_arguments(p) -> None:
    m = p.add_argument_group("mixed scenario (--scenario mixed)")
    m.add_argument("--mixed-policies", default=",".join(POLICIES), help="write policies (default %(default)s)")
    m.add_argument("--write-rate", default="auto",
                   help="backup stream, MB/s: a number, 'max' (unpaced) or 'auto' (half the slowest tier's write "
                        "bandwidth; default)")
    m.add_argument("--write-batch", type=int, default=DEFAULT_WRITE_BATCH, help="pages per backup put (default %(default)s)")
    m.add_argument("--mixed-reads", type=int, default=2, help="prefetch batches per mixed phase (default %(default)s)")
    m.add_argument("--mixed-gap", type=float, default=1.0,
                   help="seconds without reads after each prefetch batch: the forward pass (default %(default)s)")


class Path:
    """How a policy reads and writes: the SGLang way (engine.get, engine.put: a put returns when its
    pages are committed) or the LMCache way (load tasks, store tasks: deferred writes)."""

    def __init__(self, engine, kind: str):
        self.engine, self.kind = engine, kind
        self.core = None
        if kind == "lmcache":
            from ...lmcache.core import L2Core

            self.core = L2Core(engine)

    def get(self, keys: list[str], segs) -> list[bool]:
        if self.core is None:
            return self.engine.get(keys, segs)
        n = len(keys)  # LOAD_TASKS load tasks queued together, as LMCache's prefetch controller does
        bounds = [round(t * n / LOAD_TASKS) for t in range(LOAD_TASKS + 1)]
        ids = self.core.submit_loads([(keys[a:b], list(segs[a:b])) for a, b in zip(bounds, bounds[1:])])
        return [ok for task_id in ids for ok in self.core.wait_load(task_id)]

    def put(self, keys: list[str], segs) -> None:
        """The sync path waits for the commit; a store task only for room in the backlog."""
        if self.core is None:
            self.engine.put(keys, segs)
        else:
            self.core.submit_store(keys, segs)

    def settle(self, puts: int) -> None:
        """Wait until the ``puts`` store tasks submitted so far are committed (lmcache path)."""
        if self.core is not None:
            self.core.wait_completed("store", puts)

    def close(self) -> None:
        if self.core is not None:
            self.core.close()


class Backup:
    """The backup stream: puts of new pages, paced, in a thread, until stopped."""

    def __init__(self, path: Path, ds: Dataset, src, pages: int, rate_bps: float | None, prefix: str):
        self.path, self.ds, self.pages, self.rate = path, ds, pages, rate_bps
        self.segments = page_segments(src.address, ds.geometry, pages)
        self.prefix = prefix
        self.keys: list[str] = []
        self.put_s: list[float] = []
        self.submitted = 0  # bytes handed to the engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-backup", daemon=True)
        self.t0 = self.t1 = 0.0
        self.error: BaseException | None = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        """Stop submitting; returns when every page submitted is committed (or failed)."""
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"backup stream failed: {self.error}") from self.error
        self.path.settle(len(self.put_s))
        self.t1 = time.perf_counter()

    def _run(self) -> None:
        try:
            for n in itertools.count():
                if self._stop.is_set():
                    break
                keys = [f"{self.prefix}{n * self.pages + i:016x}".ljust(64, "0") for i in range(self.pages)]
                t = time.perf_counter()
                self.path.put(keys, self.segments)
                self.put_s.append(time.perf_counter() - t)
                self.keys += keys
                self.submitted += len(keys) * self.ds.page_bytes
                if self.rate:  # paced: the next put starts when the stream is back on its rate
                    self._stop.wait(max(0.0, self.t0 + self.submitted / self.rate - time.perf_counter()))
        except BaseException as exc:  # reported by stop()
            self.error = exc


def drop(engine, keys: list[str]) -> None:
    """Remove the backup pages of a phase, so phases start alike."""
    engine.delete(keys)


def run(args, log=print) -> dict:
    from ...engine import Engine
    from ...io import AlignedBuffer
    from .runner import UsageError, _check_space, _key_values, _tiers, page_geometry

    geom = page_geometry(args)
    names = [s.strip() for s in args.mixed_policies.split(",") if s.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise UsageError(f"--mixed-policies {args.mixed_policies!r}: choose from {', '.join(POLICIES)}")
    n_data = args.dataset_batches or 2
    ds = Dataset(geom, args.batch, n_data, args.seed)
    extra = _key_values(args.engine_config)
    with ExitStack() as stack:
        bed, roots = _tiers(args, geom, stack, log)
        dirs = [os.path.join(r, "kvstream-bench") for r in roots]
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        if not args.keep_data:
            stack.callback(lambda: [shutil.rmtree(d, ignore_errors=True) for d in dirs])
        _check_space(dirs, ds, [], [])
        namespace = Namespace({"bench": "kvstream-bench-mixed", "geometry": geom.label, "seed": args.seed})
        log(f"kvstream bench --scenario mixed: {geom.describe()}; {args.batch} pages per read batch, "
            f"{args.write_batch} per backup put; tiers {', '.join(roots)}" + (f" (testbed {bed.profile.name})" if bed else ""))
        src = AlignedBuffer(max(args.batch, args.write_batch) * geom.page_bytes)
        stack.callback(src.close)
        engines, paths = {}, {}
        for name in names:
            settings, kind = POLICIES[name]
            eng = Engine(Config.from_sources({"tiers": dirs, **extra, **settings}), namespace, announce=False)
            stack.callback(eng.close)
            engines[name] = eng
            paths[name] = Path(eng, kind)
            stack.callback(paths[name].close)
        # the data set, once (every engine's index learns it by discovery: same namespace). Written after
        # every engine's start-up scan: a scan that ran beside it indexed a page on the tiers it had not
        # passed yet, and a lookup looks only for pages the index lacks everywhere; that engine read the
        # page from one tier alone until its catch-up found the other file (never, with catchup=off)
        for eng in engines.values():
            eng.wait_scan()
        first = engines[names[0]]
        s0 = first.stats()
        t0 = time.perf_counter()
        pages = page_views(src, geom.page_bytes, len(ds.batches[0].keys))
        for b in ds.batches:
            for i, j in enumerate(b.pages):
                ds.fill(j, pages[i])
            if not all(first.put(list(b.keys), page_segments(src.address, geom, len(b.keys)))):
                raise RuntimeError("writing the data set failed")
        pages.clear()  # numpy views pin the buffer: gone before it closes
        t_write = time.perf_counter() - t0
        # Every phase starts from the data set on every tier: the replicas a budget skipped are written
        # now (else that engine's catch-up would write while another policy's phase reads)
        while first.stats()["replication_pending"] and time.perf_counter() - t0 < t_write + SETTLE_S:
            time.sleep(0.05)
        s1 = first.stats()
        write_bps = [(b["bytes_written"] - a["bytes_written"]) / (b["write_busy_s"] - a["write_busy_s"])
                     if b["write_busy_s"] > a["write_busy_s"] else 0.0 for a, b in zip(s0["tiers"], s1["tiers"])]
        for eng in engines.values():
            for b in ds.batches:
                if eng.prefix_len(list(b.keys)) != len(b.keys):
                    raise RuntimeError("an engine does not see the data set")
        rate = _rate(args.write_rate, write_bps)
        log(f"  data set {ds.total_bytes / 2**30:.2f} GiB written in {t_write:.2f} s; tier write bandwidth "
            + ", ".join(f"{w / 1e6:.0f}" for w in write_bps) + " MB/s; backup stream "
            + ("unpaced" if rate is None else f"{rate / 1e6:.0f} MB/s"))

        dest = AlignedBuffer(args.batch * geom.page_bytes)
        stack.callback(dest.close)
        views = page_views(dest, geom.page_bytes, args.batch)
        stack.callback(views.clear)
        read_segs = page_segments(dest.address, geom, args.batch)
        records: dict[str, list[dict]] = {n: [] for n in names}
        rounds = args.warmup + args.batches
        progress = Progress(args.batches * len(names), enabled=not args.no_progress)
        shown = 0
        try:
            for r in range(rounds):
                for name in drift.round_order(names, r, args.seed):
                    rec = _phase(paths[name], name, r, ds, read_segs, views, src, rate, args)
                    if r >= args.warmup:
                        records[name].append(rec)
                        shown += 1
                        progress.show(shown, f"{shown}/{progress.total} phases  {name}, eta {progress.eta(shown):.0f} s")
        finally:
            progress.close()
        b_quiet = quiet_bandwidth(records)
        doc = {
            "version": 1, "scenario": "mixed",
            "command": "kvstream bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": {"node": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
                     "load": os.getloadavg()},
            "geometry": {"label": geom.label, "page_bytes": geom.page_bytes},
            "tiers": list(roots), "testbed": bed.profile.name if bed else None,
            "batch_pages": args.batch, "write_batch": args.write_batch, "rounds": args.batches,
            "mixed_reads": args.mixed_reads, "mixed_gap_s": args.mixed_gap,
            "write_rate_bps": rate, "tier_write_bps": write_bps,
            "quiet_tier_bps": b_quiet,
            "policies": {n: summarize(records[n], b_quiet) for n in names},
            "phases": records,
        }
    today = doc["policies"].get("today", {}).get("write_bps")
    for p in doc["policies"].values():
        p["write_vs_today"] = p["write_bps"] / today if today else None
    print_table(doc, log)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"results: {args.json}")
    return doc


def _rate(spec: str, write_bps: list[float]) -> float | None:
    from .runner import UsageError

    if spec == "max":
        return None
    if spec == "auto":
        measured = [w for w in write_bps if w > 0]
        return AUTO_RATE_SHARE * min(measured) if measured else None
    try:
        return float(spec) * 1e6
    except ValueError:
        raise UsageError(f"--write-rate {spec!r}: a number of MB/s, 'max' or 'auto'") from None


def _read(path: Path, ds: Dataset, batch, segs, views) -> tuple[float, dict]:
    positions = ds.sample(batch, 2)
    poison(views, positions)
    t = time.perf_counter()
    found = path.get(list(batch.keys), segs[: len(batch.keys)])
    elapsed = time.perf_counter() - t
    if not all(found) or check(ds, batch, views, positions, found):
        raise RuntimeError(f"read back wrong or missing pages ({found.count(False)} missing)")
    return elapsed, path.engine.last_batch


def _phase(path: Path, name: str, r: int, ds: Dataset, segs, views, src, rate, args) -> dict:
    engine = path.engine
    n_tiers = len(engine.config.tiers)
    batch = ds.batches[r % ds.n_batches]
    quiet_s, quiet = _read(path, ds, batch, segs, views)
    b_quiet = [t["bandwidth"] for t in quiet["tiers"]]
    s0 = engine.stats()
    backup = Backup(path, ds, src, args.write_batch, rate, f"{name[:2]}{r:04x}")
    backup.start()
    reads, queued = [], []
    try:
        for i in range(args.mixed_reads):
            batch = ds.batches[(r + 1 + i) % ds.n_batches]
            queued.append(sum(t["write_queued_bytes"] for t in engine.stats()["tiers"]))
            elapsed, last = _read(path, ds, batch, segs, views)
            reads.append({"t_s": elapsed, "bytes": len(batch.keys) * ds.page_bytes, "in_batch_gap": last["gap"],
                          "tier_bps": [t["bandwidth"] for t in last["tiers"]]})
            time.sleep(args.mixed_gap)  # the forward pass: no reads
    finally:
        backup.stop()
    s1 = engine.stats()
    drop(engine, backup.keys)
    stored = s1["pages_stored"] - s0["pages_stored"]
    skipped = [b["replica_skipped_pages"] - a["replica_skipped_pages"] for a, b in zip(s0["tiers"], s1["tiers"])]
    caught_up = [b["replication_done"] - a["replication_done"] for a, b in zip(s0["tiers"], s1["tiers"])]
    return {
        "round": r - args.warmup, "quiet_s": quiet_s, "quiet_bytes": len(batch.keys) * ds.page_bytes,
        "quiet_tier_bps": b_quiet, "reads": reads,
        "write_bytes": stored * ds.page_bytes, "write_s": backup.t1 - backup.t0,
        "write_bps": stored * ds.page_bytes / (backup.t1 - backup.t0),
        "write_failed_pages": s1["pages_failed"] - s0["pages_failed"], "put_s": backup.put_s,
        "queued_bytes": queued, "new_pages": len(backup.keys), "replica_skips": skipped, "catch_up": caught_up,
        "backpressure_s": s1["backpressure_s"] - s0["backpressure_s"],
        "held_s": [b["write_held_s"] - a["write_held_s"] for a, b in zip(s0["tiers"], s1["tiers"])],
        "n_tiers": n_tiers,
    }


def quiet_bandwidth(records: dict[str, list[dict]]) -> list[float]:
    """Each tier's read bandwidth when nothing competes: the median over every quiet read of the run
    (all policies read the same tiers; one batch's figure on a loaded 2-core host scatters by +-30%)."""
    rows = [r["quiet_tier_bps"] for recs in records.values() for r in recs]
    return [statistics.median(row[k] for row in rows) for k in range(len(rows[0]))] if rows else []


def summarize(recs: list[dict], b_quiet: list[float]) -> dict:
    """A policy's phases; gaps against D / sum_k b_quiet[k]."""
    if not recs:
        return {}
    rate = sum(b_quiet)
    reads = [x for r in recs for x in r["reads"]]
    times = sorted(x["t_s"] for x in reads)
    n_tiers = recs[0]["n_tiers"]
    new = sum(r["new_pages"] for r in recs)
    skips = [sum(r["replica_skips"][k] for r in recs) for k in range(n_tiers)]
    phase_gaps = [sum(x["t_s"] for x in r["reads"]) * rate / sum(x["bytes"] for x in r["reads"]) - 1 for r in recs]
    return {
        "gap": sum(x["t_s"] for x in reads) * rate / sum(x["bytes"] for x in reads) - 1,
        "gap_median": statistics.median(phase_gaps),
        "quiet_gap": sum(r["quiet_s"] for r in recs) * rate / sum(r["quiet_bytes"] for r in recs) - 1,
        "in_batch_gap": statistics.median(x["in_batch_gap"] for x in reads if x["in_batch_gap"] is not None),
        "read_p50_s": _pct(times, 50), "read_p90_s": _pct(times, 90),
        "quiet_p50_s": statistics.median(r["quiet_s"] for r in recs),
        "p50_vs_quiet": _pct(times, 50) / statistics.median(r["quiet_s"] for r in recs),
        "write_bps": sum(r["write_bytes"] for r in recs) / sum(r["write_s"] for r in recs),
        "write_failed_pages": sum(r["write_failed_pages"] for r in recs),
        "backpressure_s": sum(r["backpressure_s"] for r in recs),
        "put_p50_s": statistics.median(s for r in recs for s in r["put_s"]),
        "queued_max_bytes": max(q for r in recs for q in r["queued_bytes"]),
        "held_s": [sum(r["held_s"][k] for r in recs) for k in range(n_tiers)],
        "replica_skips": skips,
        "catch_up": [sum(r["catch_up"][k] for r in recs) for k in range(n_tiers)],
        "replica_skip_share": sum(skips) / (new * (n_tiers - 1)) if new and n_tiers > 1 else 0.0,
    }


def _pct(sorted_values: list[float], p: float) -> float:
    i = (len(sorted_values) - 1) * p / 100
    lo = int(i)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (i - lo)


def print_table(doc: dict, log=print) -> None:
    log("")
    rate = doc["write_rate_bps"]
    log(f"mixed: {doc['rounds']} rounds x {doc['mixed_reads']} reads of {doc['batch_pages']} pages of "
        f"{doc['geometry']['label']}, {doc['mixed_gap_s']:g} s between reads; backup "
        + ("unpaced" if rate is None else f"{rate / 1e6:.0f} MB/s") + f" in puts of {doc['write_batch']} pages")
    head = (f"{'policy':<10s} {'gap':>7s} {'median':>7s} {'quiet':>7s} {'in-batch':>8s} {'p50 s':>6s} {'p90 s':>6s} "
            f"{'quiet p50':>9s} {'x quiet':>7s} "
            f"{'write MB/s':>10s} {'x today':>7s} {'put p50':>7s} {'queued MiB':>10s} {'held s':>12s} {'skips':>12s} "
            f"{'catch-up':>9s}")
    log(head)
    log("-" * len(head))
    for name, p in doc["policies"].items():
        if not p:
            continue
        x = p.get("write_vs_today")
        log(f"{name:<10s} {p['gap']:+7.1%} {p['gap_median']:+7.1%} {p['quiet_gap']:+7.1%} {p['in_batch_gap']:+8.1%} "
            f"{p['read_p50_s']:6.3f} {p['read_p90_s']:6.3f} {p['quiet_p50_s']:9.3f} {p['p50_vs_quiet']:7.2f} "
            f"{p['write_bps'] / 1e6:10.0f} {'-' if x is None else f'{x:.2f}':>7s} "
            f"{p['put_p50_s']:7.3f} {p['queued_max_bytes'] / 2**20:10.0f} "
            f"{'/'.join(f'{h:.1f}' for h in p['held_s']):>12s} "
            f"{'/'.join(str(s) for s in p['replica_skips'])} ({p['replica_skip_share']:.0%}) "
            f"{'/'.join(str(c) for c in p['catch_up']):>9s}")
    bound = " + ".join(f"{b / 1e9:.2f}" for b in doc["quiet_tier_bps"])
    log(f"gap: mixed reads against D / sum_k b_k, b_k the median of every quiet read ({bound} GB/s; all phases, "
        f"median of the phases); quiet: the quiet reads against the same bound; in-batch: mixed reads against "
        f"their own b_k (median); catch-up: replicas background replication wrote per tier during the "
        f"phases; load {doc['host']['load'][0]:.1f}")
