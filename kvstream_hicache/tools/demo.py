"""kvstream in a few minutes, without a GPU: ``python -m kvstream_hicache.tools.demo``.

What runs is sglang's own HiCache storage path, on the CPU: a real host KV pool shaped like a model's
(Llama-3-8B's KV geometry with fewer layers, so it fits in memory) and a real ``HybridCacheController``
whose backup thread stores pages (``batch_set_v1``) and whose prefetch and IO threads find and read
them back (``batch_exists``, ``batch_get_v1``) -- driven by ``cpu_sglang.ControllerDriver`` the way the
scheduler drives it. Only the GPU<->host copies are missing (they need CUDA kernels).

The workload is a small generated coding-agent workload (``workload.generate_swebench``): each
request first prefetches its prefix from storage (every later turn of a session re-reads the whole
previous prompt), then "computes" its new pages and backs them up. The host pool keeps one request
at a time, as when the working set is larger than host memory, so every reused prefix comes back
from storage. Every page read back is checked against the bytes that were written.

Tiers: with root and cgroup v1 blkio, two throttled loop-device tiers from the benchmark testbed
(profile ``testbed2-1:20``: the paper's NVMe + Lustre scaled by 1/20), removed afterwards; otherwise
two plain temporary directories on one disk (said clearly: no throttling, both share one device, so
no aggregate-bandwidth gain is expected). ``--tiers DIR1:DIR2`` uses your directories instead.

Then the same workload runs on sglang's own ``file`` backend (one directory on tier 0, its page cache
dropped before each read so that it reads from the device like a working set larger than RAM), and
the demo prints per-tier read shares, kvstream's retrieval time against the aggregate-bandwidth bound,
the comparison, and writes a PNG plot.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import KVStreamError
from . import workload as wl
from .console import HelpFormatter, Progress, missing_tiers

# Llama-3-8B's KV geometry: 32 layers x 8 KV heads x 128 dims, bf16 -> 128 KiB per token. The demo keeps
# the per-layer shape and fewer layers, so a page has the real K/V chunk structure at a size that fits.
MODEL = "Llama-3-8B"
MODEL_LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2
PAGE_TOKENS = 64  # sglang --page-size for storage
DEMO_LAYERS, SMALL_LAYERS = 4, 2
PROFILE = "testbed2-1:20"
TESTBED_NAME = "demo"
TESTBED_TIER_BYTES = 2 << 30  # sparse loop images: far more than the demo writes
RUN_PREFIX = "kvstream-demo-"  # the only directories the demo creates (and removes) in --tiers
TILE = 4096  # bytes of random content repeated through a page (fast to make, unique per page)

WORKLOADS = {  # generate_swebench parameters: the default and --small
    "default": dict(sessions=4, requests=24, mean_input=4096, mean_output=64, rate=1.25, cv=1.0),
    "small": dict(sessions=2, requests=6, mean_input=1536, mean_output=32, rate=1.25, cv=1.0),
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------ tiers
@dataclass
class Tiers:
    """Where the two backends store pages, what those directories are, and how to undo them."""

    kind: str  # "testbed" | "given" | "temporary"
    roots: list[str]
    note: str
    read_bps: list[float] | None = None  # known read bandwidth per tier (the testbed's throttles)
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def run_dirs(self, backend: str) -> list[str]:
        """Fresh directories for one backend's run: kvstream on every tier, file on tier 0 only."""
        roots = self.roots if backend == "kvstream" else self.roots[:1]
        dirs = [os.path.join(r, f"{RUN_PREFIX}{os.getpid()}", backend) for r in roots]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        return dirs

    def close(self) -> None:
        while self.cleanup:
            fn = self.cleanup.pop()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - best effort, keep undoing the rest; say what was left
                log(f"  cleanup step failed: {e}")


def prepare_tiers(args) -> Tiers:
    if args.tiers:
        roots = [d for d in args.tiers.split(os.pathsep) if d]
        if len(roots) < 2:
            raise SystemExit("--tiers needs at least two directories, fastest first: --tiers DIR1:DIR2")
        missing = missing_tiers(roots, "--tiers")
        if missing:
            raise SystemExit(missing)
        t = Tiers("given", roots, "your directories (" + ", ".join(roots) + ")")
        if not args.keep:
            t.cleanup.append(lambda: [shutil.rmtree(os.path.join(r, f"{RUN_PREFIX}{os.getpid()}"), ignore_errors=True)
                                      for r in roots])
        return t
    if not args.no_testbed:
        t = _testbed_tiers(args)
        if t is not None:
            return t
    base = tempfile.mkdtemp(prefix=RUN_PREFIX, dir=_scratch())
    roots = [os.path.join(base, f"tier{i}") for i in range(2)]
    for r in roots:
        os.makedirs(r)
    how = "run as root" if os.geteuid() else "drop --no-testbed" if args.no_testbed else "fix the testbed (above)"
    t = Tiers("temporary", roots,
              f"plain temporary directories on one disk ({base}): NOT throttled and sharing one device, so no "
              f"aggregate-bandwidth gain is expected; {how} for throttled loop-device tiers, or pass "
              "--tiers DIR1:DIR2 on two real devices")
    if not args.keep:
        t.cleanup.append(lambda: shutil.rmtree(base, ignore_errors=True))
    return t


def _scratch() -> str:
    # /var/tmp is disk-backed on Debian/Ubuntu even where /tmp is tmpfs (older tmpfs lacks O_DIRECT)
    return os.environ.get("KVSTREAM_DEMO_DIR") or ("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())


def _testbed_tiers(args) -> Tiers | None:
    """Throttled loop-device tiers, or None (with the reason) when this host cannot build them."""
    from .bench import testbed

    problems = testbed.preflight(need_fio=False)
    if problems:
        log("  (no throttled tiers: " + "; ".join(p.split(". Fix:")[0] for p in problems) + ")")
        return None
    profile = testbed.parse_profile(args.profile)
    if len(profile.tiers) != 2:
        raise SystemExit(f"the demo uses two tiers; profile {args.profile} has {len(profile.tiers)}")
    t = Tiers("testbed", [], "", [lim.read_bps for lim in profile.tiers])
    t.cleanup.append(lambda: testbed.down(TESTBED_NAME, log=lambda m: None))
    try:
        bed = testbed.up(profile, name=TESTBED_NAME, sizes=[TESTBED_TIER_BYTES] * 2, fio_bs=None,
                         log=lambda m: log("  " + m))
        bed.join()  # this process (all its threads: the controller's too) now reads through the throttles
        t.cleanup.append(testbed.leave)
    except Exception as e:  # noqa: BLE001 - any failure here means "use plain directories", said below
        t.close()
        log(f"  (no throttled tiers: building them failed: {e})")
        return None
    t.roots = bed.dirs
    t.note = ("throttled loop-device tiers (ext4 on loop devices with direct I/O, cgroup v1 blkio limits, "
              f"profile {profile.name}: {profile.note}): "
              + ", ".join(f"tier{i} {d} reads {lim.read_bps / 1e6:.0f} MB/s, writes {lim.write_bps / 1e6:.0f} MB/s"
                          for i, (d, lim) in enumerate(zip(bed.dirs, profile.tiers))))
    return t


# --------------------------------------------------------------------------------------------- the run
@dataclass
class Run:
    """One backend's figures over the workload."""

    backend: str
    dirs: list[str]
    zero_copy: bool = False
    retrieval_s: list[float] = field(default_factory=list)  # per request: prefetch (hit query + read)
    bound_s: list[float] = field(default_factory=list)  # per request: its batches' bound D / sum(b_k)
    read_bytes: list[int] = field(default_factory=list)  # per request
    backup_s: float = 0.0
    written_bytes: int = 0  # payload bytes handed to the backend (before replication)
    pages_checked: int = 0
    pages_bad: int = 0
    tier_served: list[int] = field(default_factory=list)  # kvstream: bytes each tier delivered first
    engine_time_s: float = 0.0  # kvstream: read batches' time inside the engine
    engine_bound_s: float = 0.0  # kvstream: those batches' aggregate-bandwidth bound D / sum(b_k)
    engine_batches: int = 0
    tier_bytes: list[float] = field(default_factory=list)  # kvstream: per tier bytes read in those batches
    tier_busy_s: list[float] = field(default_factory=list)  # ... and seconds with reads in flight

    @property
    def total_retrieval_s(self) -> float:
        return float(sum(self.retrieval_s))

    @property
    def total_read_bytes(self) -> int:
        return int(sum(self.read_bytes))


class _BatchWatch:
    """New read-batch records in the engine's bounded history since the previous call."""

    def __init__(self, engine):
        self.engine = engine
        hist = engine.stats().get("history") or [] if engine is not None else []
        self.last = hist[-1] if hist else None

    def new(self) -> list[dict]:
        if self.engine is None:
            return []
        hist = self.engine.stats().get("history") or []
        idx = next((i for i in range(len(hist) - 1, -1, -1) if hist[i] is self.last), None)
        fresh = hist if idx is None else hist[idx + 1:]
        if hist:
            self.last = hist[-1]
        return fresh


def page_content(key: str, nbytes: int) -> np.ndarray:
    """Deterministic page bytes for a key (a random 4 KiB tile repeated): same key, same bytes."""
    tile = np.random.default_rng(int(key[:16], 16)).integers(0, 256, TILE, dtype=np.uint8)
    return np.tile(tile, -(-nbytes // TILE))[:nbytes]


def _drop_file_cache(directory: str) -> None:
    """Write back and evict the file backend's pages from the page cache: its next reads hit the device."""
    from .bench.contenders import drop_page_cache

    paths = [e.path for e in os.scandir(directory) if e.is_file()]
    for p in paths:  # dirty pages cannot be evicted: write them back first (this file only)
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    drop_page_cache(paths, "fadvise")


def run_backend(backend: str, pools, requests: Sequence[wl.Request], dirs: list[str], expected: dict,
                verbose: bool = True) -> Run:
    """Serve ``requests`` through a real controller with ``backend`` storing pages in ``dirs``."""
    run = Run(backend, dirs)
    env_var = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # wins over the extra config in sglang
    saved = os.environ.pop(env_var, None)
    extra = {"tiers": list(dirs)} if backend == "kvstream" else {"file_storage_path": dirs[0]}
    try:
        return _serve(run, pools, requests, expected, extra, verbose)
    finally:
        if saved is not None:
            os.environ[env_var] = saved


def _serve(run: Run, pools, requests: Sequence[wl.Request], expected: dict, extra: dict, verbose: bool) -> Run:
    """The request loop: prefetch (and check) each prefix, "compute" the new pages, back them up."""
    import torch

    from . import cpu_sglang

    P = pools.page_size
    page_nbytes = pools.flat_page_nbytes()
    backend, dirs = run.backend, run.dirs
    with cpu_sglang.ControllerDriver(pools, backend, model_name=f"demo/{MODEL}", extra_config=extra) as drv:
        run.zero_copy = drv.zero_copy
        engine = getattr(drv.backend, "engine", None)
        watch = _BatchWatch(engine)
        before = engine.stats()["tiers"] if engine is not None else []
        progress = Progress(len(requests), f"  {backend:8s}", enabled=verbose, stream=sys.stdout, lines=1)
        for i, req in enumerate(requests):
            tokens = wl.to_token_ids(req)
            n_pages = len(tokens) // P
            tokens = tokens[: n_pages * P]  # a partial last page is never stored (sglang does the same)
            keys = cpu_sglang.page_keys(tokens, P)
            if backend == "file":
                _drop_file_cache(dirs[0])
            t = time.perf_counter()
            got = drv.prefetch(tokens)  # prefetch thread: batch_exists; IO thread: batch_get(_v1)
            run.retrieval_s.append(time.perf_counter() - t)
            hit_pages = got.tokens // P
            run.read_bytes.append(hit_pages * page_nbytes)
            if hit_pages:
                for key, data in zip(keys, pools.page_bytes(got.host_indices)):
                    run.pages_checked += 1
                    run.pages_bad += zlib.crc32(data) != expected[key]
            pools.free(got.host_indices)
            new_pages = n_pages - hit_pages
            if new_pages:
                idx = pools.alloc(new_pages * P)
                for j, key in enumerate(keys[hit_pages:]):  # "compute" the new pages
                    data = page_content(key, page_nbytes)
                    expected.setdefault(key, zlib.crc32(data))
                    pools.host.set_from_flat_data_page(int(idx[j * P]), torch.from_numpy(data).view(pools.host.dtype))
                t = time.perf_counter()
                done = drv.backup(tokens[hit_pages * P:], idx, keys=keys[hit_pages:])  # backup thread
                run.backup_s += time.perf_counter() - t
                run.written_bytes += done // P * page_nbytes
                pools.free(idx)
            run.bound_s.append(0.0)
            for b in watch.new():
                run.bound_s[-1] += b.get("bound_s") or 0.0
                run.engine_batches += 1
                run.engine_time_s += b.get("time_s") or 0.0
                run.engine_bound_s += b.get("bound_s") or 0.0
                for k, t in enumerate(b.get("tiers") or ()):
                    if k >= len(run.tier_bytes):
                        run.tier_bytes.append(0.0)
                        run.tier_busy_s.append(0.0)
                    run.tier_bytes[k] += t.get("bytes") or 0
                    run.tier_busy_s[k] += t.get("busy_s") or 0.0
            progress.show(i + 1, f"{i + 1}/{len(requests)} requests, {run.total_read_bytes / 1e9:.2f} GB read back")
        progress.close()
        if engine is not None:
            after = engine.stats()["tiers"]
            run.tier_served = [a.get("bytes_served", 0) - (before[k].get("bytes_served", 0) if k < len(before) else 0)
                               for k, a in enumerate(after)]
    return run


# ---------------------------------------------------------------------------------------------- report
def _gbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


def report(kv: Run, fb: Run | None, tiers: Tiers) -> dict:
    """Print the results; return them as a dict (``--json``)."""
    out: dict = {"tiers": {"kind": tiers.kind, "dirs": tiers.roots, "note": tiers.note}, "runs": {}}
    for run in (kv, fb):
        if run is None:
            continue
        out["runs"][run.backend] = {
            "zero_copy": run.zero_copy, "retrieval_s": run.total_retrieval_s, "read_bytes": run.total_read_bytes,
            "backup_s": run.backup_s, "written_bytes": run.written_bytes, "pages_checked": run.pages_checked,
            "pages_bad": run.pages_bad, "per_request_retrieval_s": run.retrieval_s,
        }
    log("\nresults")
    served = sum(kv.tier_served)
    shares = [s / served if served else 0.0 for s in kv.tier_served]
    log(f"  kvstream  retrieved {kv.total_read_bytes / 1e9:.2f} GB in {kv.total_retrieval_s:.2f} s "
        f"({_gbps(kv.total_read_bytes, kv.total_retrieval_s)}; sglang prefetch: hit query + read), "
        f"{'zero-copy batch_get_v1/batch_set_v1' if kv.zero_copy else 'legacy batch_get/batch_set'}")
    log("            reads by tier: " + ", ".join(f"tier{k} {100 * s:.0f}% ({b / 1e9:.2f} GB)"
                                                for k, (s, b) in enumerate(zip(shares, kv.tier_served))))
    kvr = out["runs"]["kvstream"]
    kvr["tier_read_share"] = shares
    kvr["per_request_bound_s"] = kv.bound_s  # what the plot draws as the bound
    if kv.engine_batches and kv.engine_bound_s > 0:
        gap = kv.engine_time_s / kv.engine_bound_s - 1
        log(f"            engine read time {kv.engine_time_s:.2f} s over {kv.engine_batches} batches vs the "
            f"aggregate-bandwidth bound {kv.engine_bound_s:.2f} s (from each batch's per-tier bandwidths): "
            f"{100 * gap:+.1f}%")
        kvr.update(engine_time_s=kv.engine_time_s, engine_bound_s=kv.engine_bound_s, engine_gap=gap)
    rates = [b / t if t > 0 else 0.0 for b, t in zip(kv.tier_bytes, kv.tier_busy_s)]
    if rates:
        log("            tiers delivered " + ", ".join(f"tier{k} {r / 1e6:.0f} MB/s" for k, r in enumerate(rates))
            + " while reading" + (" (throttles: " + ", ".join(f"{b / 1e6:.0f}" for b in tiers.read_bps) + " MB/s)"
                                  if tiers.read_bps else ""))
        kvr["tier_read_bps"] = rates
    if tiers.read_bps:
        bound = kv.total_read_bytes / sum(tiers.read_bps)
        log(f"            at the throttles' rates the bound is {bound:.2f} s and tier0 alone would need "
            f"{kv.total_read_bytes / tiers.read_bps[0]:.2f} s (devices that deliver less, e.g. a busy backing "
            "disk, lower both)")
        if any(r > 1.1 * b for r, b in zip(rates, tiers.read_bps) if b):
            # blk-throttle meters in 100 ms slices and lets a slice through at device speed: a prefetch
            # of a few tens of MB reads above the limit, and the per-batch bound above counts that
            log("            (a throttle lets each 100 ms slice through at device speed, so these short batches read "
                "above the limits and the per-batch bound above is tighter than a steady device's: "
                "docs/benchmarks.md, small batches)")
        kvr["throttle_bound_s"] = bound
    log(f"            backups: {kv.written_bytes / 1e9:.2f} GB replicated to {len(kv.dirs)} tiers in {kv.backup_s:.2f} s")
    log(f"            pages read back and checked: {kv.pages_checked}, wrong: {kv.pages_bad}")
    if fb is not None:
        log(f"  file      retrieved {fb.total_read_bytes / 1e9:.2f} GB in {fb.total_retrieval_s:.2f} s "
            f"({_gbps(fb.total_read_bytes, fb.total_retrieval_s)}) from tier0 only, through sglang's HiCacheFile "
            "(copying legacy path, page cache dropped before each read)")
        log(f"            backups: {fb.written_bytes / 1e9:.2f} GB in {fb.backup_s:.2f} s (buffered, one copy)")
        log(f"            pages read back and checked: {fb.pages_checked}, wrong: {fb.pages_bad}")
        if kv.total_retrieval_s > 0 and fb.total_retrieval_s > 0:
            speedup = fb.total_retrieval_s / kv.total_retrieval_s
            out["speedup_retrieval"] = speedup
            log(f"  kvstream retrieves {speedup:.2f}x as fast as sglang's file backend on this workload")
    log(f"  tiers: {tiers.note}")
    return out


def plot(kv: Run, fb: Run | None, tiers: Tiers, path: str) -> None:
    """Cumulative retrieval time per request (with the bound when known) and kvstream's per-tier shares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    x = np.arange(1, len(kv.retrieval_s) + 1)
    ax.plot(x, np.cumsum(kv.retrieval_s), label="kvstream (2 tiers)", linewidth=2)
    if fb is not None:
        ax.plot(x, np.cumsum(fb.retrieval_s), label="sglang file (tier0)", linewidth=2)
    if kv.engine_batches:
        # The bound the text reports: each batch's D / (b0 + b1) at the rates its tiers actually delivered.
        # At the throttles' nominal rates it would be no bound: blkio lets short bursts through faster.
        ax.plot(x, np.cumsum(kv.bound_s), "k--", label="bound D / (b0 + b1), each batch's rates", linewidth=1)
    ax.set_xlabel("request (arrival order)")
    ax.set_ylabel("cumulative retrieval time (s)")
    ax.set_title("prefix retrieval from storage", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    served = sum(kv.tier_served) or 1
    bottom = 0.0
    for k, b in enumerate(kv.tier_served):
        bx.bar(["kvstream"], [100 * b / served], bottom=bottom, label=f"tier{k}")
        bottom += 100 * b / served
    if fb is not None:
        bx.bar(["file"], [100], color="C0", hatch="//", edgecolor="white")  # tier0 only
    bx.set_ylabel("share of bytes read (%)")
    bx.set_title("reads per tier", fontsize=10)
    bx.legend()
    fig.suptitle(f"kvstream demo: real sglang HiCache controller on CPU; tiers: {tiers.kind}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvstream_hicache.tools.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--tiers", help="two (or more) directories, fastest first, separated by ':' "
                                   "(default: throttled loop devices as root, else temporary directories)")
    p.add_argument("--small", action="store_true", help="a tiny workload and 2 layers (CI)")
    p.add_argument("--no-testbed", action="store_true", help="never build loop-device tiers, even as root")
    p.add_argument("--profile", default=PROFILE, help="testbed throttle profile (see `kvstream testbed`)")
    p.add_argument("--no-file", action="store_true", help="skip the comparison with sglang's file backend")
    p.add_argument("--sessions", type=int)
    p.add_argument("--requests", type=int)
    p.add_argument("--mean-input", type=int)
    p.add_argument("--layers", type=int, help=f"layers of the host pool (of {MODEL}'s {MODEL_LAYERS})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="kvstream-demo.png", help="PNG to write ('' to skip)")
    p.add_argument("--json", help="write the figures as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the pages (and temporary directories)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--server", action="store_true",
                   help="serve through a real sglang server instead (kvstream serve-cpu's tiny model): "
                        "examples/serve_swebench.py --cpu, kvstream against file, on these tiers")
    return p.parse_args(argv)


# 32 unique 512-token blocks (16K tokens): twice what the servers' L1 (3584 tokens) and L2 (1.2x) hold,
# so reused prefixes come back from L3
SERVER_WORKLOAD = ("--sessions", "10", "--requests", "20", "--mean-input", "2048", "--mean-output", "16",
                   "--rate", "0.5", "--max-input", "3000", "--hicache-ratio", "1.2",
                   "--server-args", "--max-total-tokens 3584")
SERVE_SWEBENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "serve_swebench.py")


def serve(args) -> int:
    """``--server``: the same A/B through real servers, run by the serve_swebench example on the tiers here
    (a child process: in the testbed's throttle group when root, as this process is)."""
    if not os.path.exists(SERVE_SWEBENCH):
        log(f"--server needs a checkout: {os.path.abspath(SERVE_SWEBENCH)} is missing")
        return 2
    log("kvstream demo (--server): real sglang servers on the CPU, a tiny model, kvstream against file")
    tiers = prepare_tiers(args)
    log(f"  tiers      {tiers.note}")
    cmd = [sys.executable, os.path.abspath(SERVE_SWEBENCH), "--cpu", "--compare", "file,kvstream", "--tiers",
           os.pathsep.join(tiers.run_dirs("kvstream")), "--seed", str(args.seed), *SERVER_WORKLOAD]
    if args.plot:
        cmd += ["--plot", args.plot]
    if args.json:
        cmd += ["--json", args.json]
    if args.quiet:
        cmd += ["--no-progress"]
    log("  " + " ".join(cmd))
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except BaseException:  # SIGTERM or Ctrl-C here: the example stops its server (its process group) itself
        proc.terminate()
        proc.wait()
        raise
    finally:
        tiers.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM -> SystemExit, so the finally below still takes the testbed down
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.server:
        return serve(args)
    params = dict(WORKLOADS["small" if args.small else "default"], seed=args.seed, order="random")
    for name in ("sessions", "requests", "mean_input"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    layers = args.layers or (SMALL_LAYERS if args.small else DEMO_LAYERS)
    requests = wl.generate_swebench(**params)
    max_pages = max(r.input_length for r in requests) // PAGE_TOKENS + 1
    token_bytes = 2 * layers * KV_HEADS * HEAD_DIM * DTYPE_BYTES

    log("kvstream demo: the real sglang HiCache controller (backup, prefetch and IO threads) on the CPU")
    log(f"  host pool  {MODEL}-like KV geometry with {layers} of its {MODEL_LAYERS} layers: {KV_HEADS} KV heads x "
        f"{HEAD_DIM} dims, bf16, {PAGE_TOKENS}-token pages, page_first -> {token_bytes // 1024} KiB per token, "
        f"{token_bytes * PAGE_TOKENS / 2**20:.1f} MiB per page (the full model: "
        f"{2 * MODEL_LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES // 1024} KiB per token)")
    log("  workload   generated SWE-bench-agentic sessions (kvstream_hicache.tools.workload), in arrival order:")
    log("\n".join("           " + line for line in wl.format_summary(wl.summarize(requests)).splitlines()))
    log("  importing sglang (stubbing torchvision/triton for a CPU host) ...")
    t0 = time.perf_counter()
    from . import cpu_sglang

    cpu_sglang.install_stubs()
    from sglang.srt.plugins import load_plugins

    load_plugins()  # registers --hicache-storage-backend kvstream, as in every sglang process
    device_tokens = 2 * PAGE_TOKENS  # the device pool is never used on a CPU: keep it tiny
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE_TOKENS, layers=layers, heads=KV_HEADS,
                                  head_dim=HEAD_DIM, device_tokens=device_tokens,
                                  host_ratio=(max_pages + 4) * PAGE_TOKENS / device_tokens)
    log(f"  ready in {time.perf_counter() - t0:.1f} s; host pool {pools.host.size // PAGE_TOKENS} pages "
        f"({pools.host.size * token_bytes / 2**30:.2f} GiB)")
    log("  tiers ...")
    tiers = prepare_tiers(args)
    log(f"  tiers      {tiers.note}")
    try:
        expected: dict[str, int] = {}
        kv = run_backend("kvstream", pools, requests, tiers.run_dirs("kvstream"), expected, not args.quiet)
        fb = None if args.no_file else run_backend("file", pools, requests, tiers.run_dirs("file"), expected,
                                                   not args.quiet)
    except KVStreamError as e:  # a tier kvstream cannot use: the message names it and the fix
        log(f"kvstream refused the tiers: {e}")
        return 2
    finally:
        tiers.close()
    out = report(kv, fb, tiers)
    out["workload"] = {"params": params, "summary": wl.summarize(requests)}
    out["host_pool"] = {"model": MODEL, "layers": layers, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "page_tokens": PAGE_TOKENS, "page_bytes": pools.flat_page_nbytes()}
    if args.plot:
        plot(kv, fb, tiers, args.plot)
        log(f"plot: {os.path.abspath(args.plot)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        log(f"json: {os.path.abspath(args.json)}")
    bad = kv.pages_bad + (fb.pages_bad if fb else 0)
    if bad:
        log(f"ERROR: {bad} pages read back differ from what was written")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
