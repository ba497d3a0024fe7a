"""First two-tier figure: kvstream routing vs the sum of the two tiers' bandwidths, same run.

    sudo python scripts/engine_two_tier.py [--mb 256] [--bps0 400e6] [--bps1 150e6] [--reps 3]

Builds two throttled tiers (sparse image -> losetup --direct-io=on -> ext4 -> mount; a cgroup v1
blkio group with read_bps_device per device), writes ``--mb`` MiB of 4 MiB pages replicated on
both, then reads everything back: tier 0 alone, tier 1 alone (their bandwidths b0, b1 measured
through the engine in this run), kvstream routing, and the static split at g = b0/(b0+b1).
Prints medians and the ratio kvstream / (b0 + b1). Everything it creates is removed at exit.
The benchmark issue's runner (kvstream bench) makes this thorough; this is the engine's smoke figure.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.io import AlignedBuffer
from kvstream_hicache.router import CompletionDriven, SingleTier, StaticSplit

CGROUP = "/sys/fs/cgroup/blkio/kvstream-engine-fig"
PAGE = 4 << 20  # bytes per page (Llama-3-8B, page 64: one K or V chunk)


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


class Tiers:
    def __init__(self, bps: list[int], image_bytes: int = 1 << 30):
        self.root = tempfile.mkdtemp(prefix="kvstream-fig-", dir="/var/tmp")
        self.devices: list[str] = []
        self.mounts: list[str] = []
        self.bps = bps
        self.image_bytes = image_bytes

    def __enter__(self) -> "Tiers":
        try:
            for k, bps in enumerate(self.bps):
                image = os.path.join(self.root, f"tier{k}.img")
                with open(image, "wb") as f:
                    f.truncate(self.image_bytes)
                dev = sh("losetup", "--direct-io=on", "--find", "--show", image)
                self.devices.append(dev)
                sh("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev)
                mnt = os.path.join(self.root, f"mnt{k}")
                os.mkdir(mnt)
                sh("mount", "-o", "noatime", dev, mnt)
                self.mounts.append(mnt)
            os.makedirs(CGROUP, exist_ok=True)
            for dev, bps in zip(self.devices, self.bps):
                rdev = os.stat(dev).st_rdev
                with open(os.path.join(CGROUP, "blkio.throttle.read_bps_device"), "w") as f:
                    f.write(f"{os.major(rdev)}:{os.minor(rdev)} {bps}\n")
            with open(os.path.join(CGROUP, "cgroup.procs"), "w") as f:
                f.write(f"{os.getpid()}\n")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if os.path.isdir(CGROUP):
            with open("/sys/fs/cgroup/blkio/cgroup.procs", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.rmdir(CGROUP)
        for mnt in self.mounts:
            subprocess.run(["umount", mnt], check=False)
        for dev in self.devices:
            subprocess.run(["losetup", "-d", dev], check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--bps0", type=float, default=400e6)
    ap.add_argument("--bps1", type=float, default=150e6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--io-engine", default="uring")
    args = ap.parse_args()
    n = args.mb * (1 << 20) // PAGE
    with Tiers([int(args.bps0), int(args.bps1)]) as tiers:
        config = Config.from_sources({"tiers": tiers.mounts, "io_engine": args.io_engine}, environ={})
        with Engine(config, Namespace({"model": "two-tier-figure"})) as engine:
            src = AlignedBuffer(PAGE)
            np.frombuffer(src, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 256, PAGE, dtype=np.uint8)
            keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]
            t0 = time.perf_counter()
            assert all(engine.put(keys, [[(src.address, PAGE)]] * n))
            print(f"put {n} x 4 MiB pages on 2 tiers in {time.perf_counter() - t0:.2f} s (writes not throttled)")
            dst = [AlignedBuffer(PAGE) for _ in range(n)]
            segs = [[(d.address, PAGE)] for d in dst]

            def run(policy) -> tuple[float, dict]:
                t = time.perf_counter()
                assert all(engine.get(keys, segs, policy=policy))
                return n * PAGE / (time.perf_counter() - t), engine.last_batch

            def median(policy) -> tuple[float, dict]:
                runs = sorted((run(policy) for _ in range(args.reps)), key=lambda r: r[0])
                return runs[len(runs) // 2]

            b0, _ = median(SingleTier(0))
            b1, _ = median(SingleTier(1))
            kv, batch = median(CompletionDriven())
            g = b0 / (b0 + b1)
            st, _ = median(StaticSplit(round(g, 3)))
            assert np.array_equal(np.frombuffer(dst[-1], dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
            mb = 1e6
            print(f"throttles: tier0 {args.bps0 / mb:.0f} MB/s, tier1 {args.bps1 / mb:.0f} MB/s; "
                  f"{n * PAGE >> 20} MiB per read batch, median of {args.reps}")
            print(f"tier0 alone  b0 = {b0 / mb:7.1f} MB/s")
            print(f"tier1 alone  b1 = {b1 / mb:7.1f} MB/s")
            print(f"b0 + b1         = {(b0 + b1) / mb:7.1f} MB/s")
            print(f"kvstream        = {kv / mb:7.1f} MB/s  ->  {kv / (b0 + b1):.3f} of b0+b1 "
                  f"(engine's own bound figure: gap {batch['gap']:.3f}; split "
                  f"{batch['tiers'][0]['bytes_served'] / batch['bytes']:.3f} vs b0/(b0+b1) = {g:.3f})")
            print(f"static-{g:.3f}    = {st / mb:7.1f} MB/s  ->  {st / (b0 + b1):.3f} of b0+b1")
            print(f"duplicates at the meeting point: {batch['duplicates']} blocks of {batch['items']}")
            for d in dst:
                d.close()


if __name__ == "__main__":
    main()
