"""Scale bench: a tier of many small pages. Start-up to the first served request, the background scan's
duration and rate, RSS per indexed page, and get/contains latency, at each page count.

    python scripts/scale_bench.py [--pages 10000,100000,1000000] [--dir /var/tmp | --glusterfs]
                                  [--page-bytes 4096] [--scan-rate 0] [--scan-cpu 1] [--json OUT]

For each count it fills one tier directory with that many page files of ``--page-bytes`` (written
straight in the engine's file format, header and CRCs by integrity.pack_header, so that 1M pages take
minutes rather than an hour of engine puts; a few are then stored by an engine as a check), then, in
a fresh interpreter each time (clean RSS):

- ``Engine()`` and the first ``get`` of a page written before the start (discovery): "first request";
- ``wait_scan()``: scan seconds, files/s, CPU seconds (``--scan-rate 0 --scan-cpu 1``: as fast as it
  goes; the defaults of the settings pace it to 2,000 files/s and a quarter of a core);
- RSS after the scan less RSS before ``Engine()``, per page indexed;
- median latency of ``contains`` (held keys, and missing keys: one failed lookup per tier) and of a
  one-page ``get``, over 2,000 and 500 random keys (other keys for each tree measured: a page the
  first one read would come from the disk's cache for the second).

Runs the same measurement against another tree with ``--reference DIR`` (e.g. the main checkout
before the change), which must hold an importable ``kvstream_hicache``: its ``Engine()`` may scan in
the foreground (then the scan time is the start-up time). The tier directories are removed at the end.

``--glusterfs`` puts the tier on a GlusterFS started for the run (tools/bench/glusterfs.py: one
glusterd, a brick on an ext4 loop image, a FUSE mount; root only; it holds the machine's glusterd
lock, and everything it started is stopped and removed at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NS_FIELDS = {"model": "scale-bench"}


def key_of(i: int) -> str:
    import hashlib

    return hashlib.sha256(b"scale/%d" % i).hexdigest()


def fill(root: str, n: int, page_bytes: int) -> None:
    """``n`` page files under ``root`` (one tier), in the engine's format, oldest first."""
    import time

    from kvstream_hicache import Config, Engine, Namespace
    from kvstream_hicache.integrity import PageHeader, block_crcs, pack_header
    from kvstream_hicache.io import AlignedBuffer
    from kvstream_hicache.layout import HEADER_SIZE, TierLayout, file_size

    ns = Namespace(NS_FIELDS)
    with Engine(Config.from_sources({"tiers": [root]}, environ={}), ns, announce=False) as engine:
        block = engine.config.chunk
    layout = TierLayout(root, ns.digest)
    buf = AlignedBuffer(file_size(page_bytes))
    view = memoryview(buf)
    view[HEADER_SIZE:HEADER_SIZE + page_bytes] = bytes(range(256)) * (page_bytes // 256) + bytes(page_bytes % 256)
    crcs = block_crcs([(buf.address + HEADER_SIZE, page_bytes)], page_bytes, block)
    made: set[str] = set()
    t0 = time.time_ns()
    for i in range(n):
        key = key_of(i)
        d = layout.page_dir(key)
        if d not in made:
            os.makedirs(d, mode=0o700, exist_ok=True)
            made.add(d)
        pack_header(PageHeader(key, ns.digest, page_bytes, block, crcs, t0 + i), buf)
        fd = os.open(layout.page_path(key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, view)
        finally:
            os.close(fd)
    view.release()


def measure(root: str, n: int, page_bytes: int, scan_rate: float, scan_cpu: float, seed: int) -> dict:
    """One start of an engine on a filled tier (run in a fresh interpreter)."""
    import gc
    import random
    import statistics
    import time

    import numpy as np

    from kvstream_hicache import Config, Engine, Namespace
    from kvstream_hicache.io import AlignedBuffer

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    rng = random.Random(seed)  # each tree its own keys: a page read by the first would be in the disk's cache
    ns = Namespace(NS_FIELDS)
    settings = {"tiers": [root], "scan_rate": scan_rate, "scan_cpu": scan_cpu}
    config = Config.from_sources({k: v for k, v in settings.items() if k == "tiers" or hasattr(Config, k)},
                                 environ={})
    buf = AlignedBuffer(page_bytes)
    seg = [(buf.address, page_bytes)]
    first_key = key_of(rng.randrange(n))
    gc.collect()
    rss0 = rss()
    t0, c0 = time.perf_counter(), time.process_time()
    engine = Engine(config, ns, announce=False)
    try:
        t_open = time.perf_counter() - t0
        ok = engine.get([first_key], [seg])
        t_first = time.perf_counter() - t0
        assert ok == [True], "the first page written before the start was not served"
        background = hasattr(engine, "wait_scan")
        if background:
            assert engine.wait_scan(24 * 3600)
        t_scan = time.perf_counter() - t0
        cpu = time.process_time() - c0
        scan = dict(engine.scan)
        gc.collect()
        rss1 = rss()
        assert scan["pages"] == n, scan

        def median_us(fn, keys) -> float:
            times = []
            for k in keys:
                t = time.perf_counter()
                fn(k)
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1e6

        held = [key_of(rng.randrange(n)) for _ in range(2000)]
        missing = [key_of(n + rng.randrange(n)) for _ in range(2000)]
        assert all(engine.contains(k) for k in held[:50]) and not any(engine.contains(k) for k in missing[:50])
        out = {
            "pages": n, "page_bytes": page_bytes, "background": background,
            "engine_s": t_open, "first_request_s": t_first, "scan_done_s": t_scan,
            "scan_seconds": scan.get("seconds"), "scan_files": scan.get("files"),
            "scan_rate": scan.get("rate"), "scan_cpu_s": scan.get("cpu_seconds", cpu), "process_cpu_s": cpu,
            "rss_bytes": rss1 - rss0, "rss_per_page": (rss1 - rss0) / n,
            "contains_held_us": median_us(engine.contains, held),
            "contains_missing_us": median_us(engine.contains, missing),
            "get_us": median_us(lambda k: engine.get([k], [seg]), held[:500]),
        }
        np.frombuffer(buf, dtype=np.uint8)  # the buffer lives until here
        return out
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", default="10000,100000,1000000")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--glusterfs", action="store_true", help="the tier on a GlusterFS started for the run")
    ap.add_argument("--page-bytes", type=int, default=4096)
    ap.add_argument("--scan-rate", type=float, default=0.0)
    ap.add_argument("--scan-cpu", type=float, default=1.0)
    ap.add_argument("--reference", help="another tree (its kvstream_hicache) measured on the same tiers")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, n = args.child[0], int(args.child[1])
        print(json.dumps(measure(root, n, args.page_bytes, args.scan_rate, args.scan_cpu, int(args.child[2]))))
        return
    if args.glusterfs:
        from kvstream_hicache.tools.bench.glusterfs import GlusterFS

        work = tempfile.mkdtemp(prefix="kvstream-scale-gfs-", dir=args.dir)
        fs = GlusterFS(work, brick_bytes=4 << 30).start()
        try:
            args.dir = fs.mount("a")
            run(args)
        finally:
            fs.stop()
            shutil.rmtree(work, ignore_errors=True)
    else:
        run(args)


def run(args) -> None:
    rows = []
    for n in (int(x) for x in args.pages.split(",")):
        root = tempfile.mkdtemp(prefix=f"kvstream-scale-{n}-", dir=args.dir)
        try:
            fill(root, n, args.page_bytes)
            trees = [("this", os.path.dirname(HERE))] + ([("reference", args.reference)] if args.reference else [])
            for seed, (name, tree) in enumerate(trees):
                env = dict(os.environ, PYTHONPATH=tree)
                cmd = [sys.executable, os.path.abspath(__file__), "--page-bytes", str(args.page_bytes),
                       "--scan-rate", str(args.scan_rate), "--scan-cpu", str(args.scan_cpu), "--child", root, str(n), str(seed)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
                if done.returncode:
                    print(f"{name} at {n} pages failed:\n{done.stderr[-4000:]}", file=sys.stderr, flush=True)
                    sys.exit(1)
                row = dict(json.loads(done.stdout.strip().splitlines()[-1]), tree=name)
                rows.append(row)
                print(f"{name:9s} {n:>9,} pages: first request {row['first_request_s']:.3f} s "
                      f"(Engine() {row['engine_s']:.3f} s); scan {row['scan_done_s']:.1f} s, "
                      f"{(row['scan_rate'] or 0):,.0f} files/s, {row['scan_cpu_s']:.1f} CPU s; "
                      f"RSS {row['rss_per_page']:.0f} B/page; contains {row['contains_held_us']:.1f} us "
                      f"(missing {row['contains_missing_us']:.1f} us); get {row['get_us']:.0f} us", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
