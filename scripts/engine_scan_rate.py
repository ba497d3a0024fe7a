"""Start-up index rebuild rate: write N small pages to one tier, then time Engine() on it.

    python scripts/engine_scan_rate.py [--pages 100000] [--dir /var/tmp] [--cold]

--cold drops the page cache before the timed start (needs root; affects the whole machine).
Prints pages/s for the rebuild (header read + validation of every page file, tmp cleanup), and
pages per CPU-second (the rate an idle core would reach with a warm cache; wall time on a shared
machine mostly measures the other tenants). Then the cost of one page open as the read path does it
(``integrity.open_regular`` as ``Tier.open_page`` calls it, and the close; every page once, warm cache), in microseconds of wall and CPU time.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time

import numpy as np

from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.integrity import open_regular
from kvstream_hicache.io import AlignedBuffer
from kvstream_hicache.layout import TierLayout
from kvstream_hicache.trust import Trust

NS = Namespace({"model": "scan-rate"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the tier directory (prints its path)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kvstream-scan-", dir=args.dir)
    config = Config.from_sources({"tiers": [root]}, environ={})
    try:
        buf = AlignedBuffer(4096)
        np.frombuffer(buf, dtype=np.uint8)[:] = 7
        t0 = time.perf_counter()
        with Engine(config, NS) as engine:
            for start in range(0, args.pages, 128):
                keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(start, min(start + 128, args.pages))]
                assert all(engine.put(keys, [[(buf.address, 4096)]] * len(keys)))
        print(f"wrote {args.pages} pages of 4 KiB in {time.perf_counter() - t0:.1f} s")
        for run in ("warm", "cold") if args.cold else ("warm",):
            if run == "cold":
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            t0, c0 = time.perf_counter(), time.process_time()
            with Engine(config, NS) as engine:
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                assert engine.scan["pages"] == args.pages, engine.scan
                print(f"{run}: Engine() indexed {engine.scan['pages']} pages in {elapsed:.2f} s "
                      f"({args.pages / elapsed:,.0f} pages/s; scan alone {engine.scan['rate']:,.0f} files/s); "
                      f"CPU {cpu:.2f} s = {args.pages / cpu:,.0f} pages per CPU-second")
            if run == "warm":  # a page open as the read path does it (Tier.open_page), every page once
                layout, trust = TierLayout(root, NS.digest), Trust.user()
                paths = [layout.page_path(hashlib.sha256(str(i).encode()).hexdigest()) for i in range(args.pages)]
                t0, c0 = time.perf_counter(), time.process_time()
                for path in paths:
                    os.close(open_regular(path, os.O_DIRECT, trust=trust)[0])
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                print(f"page open + close: {elapsed / len(paths) * 1e6:.2f} us wall, "
                      f"{cpu / len(paths) * 1e6:.2f} us CPU per page ({len(paths)} pages)")
    finally:
        if args.keep:
            print(root)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
