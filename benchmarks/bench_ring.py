#!/usr/bin/env python3
"""Ring vs fio: O_DIRECT sequential reads of 4 MiB chunks over a 2 GiB file set.

For each queue depth, in the same run and over the same files: fio (io_uring engine), the
kvstream Ring, the Ring with buffers of scattered 4 KiB pages (AlignedBuffer(hugepages=False):
what the Ring's buffers were before they were huge-page backed), the ThreadRing fallback, and
fio again with registered buffers and files (to see whether registration would pay off). Runs
are interleaved (repeat x depth x engine) so drift in a shared machine hits every engine alike. Page cache is dropped before each
run (root only; O_DIRECT bypasses it anyway).

Reports GB/s (median and range over repeats), the ratio to plain fio at the same depth (median of
the per-repeat ratios: each run against the fio run next to it), per-op completion latency
percentiles (p50/p99: submit to reap for the rings, fio's clat), and the average size of the
read requests the block device completed (from /sys/dev/block/<dev>/stat): a 4 MiB read whose
buffer is scattered 4 KiB pages is split at the device's segment limit into several requests.

    python benchmarks/bench_ring.py                        # defaults: 2 GiB, depths 1,16,64, 3 repeats
    python benchmarks/bench_ring.py --depths 16 --repeat 1 --size-gib 0.5
    python benchmarks/bench_ring.py --chunk-mib 1 --depths 4,16   # the engine's 1 MiB blocks
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

from kvstream_hicache.io import OP_READ, AlignedBuffer, Ring, ThreadRing
from kvstream_hicache.staging import BufferPool

GIB = 1 << 30
MIB = 1 << 20
CHUNK = 4 * MIB  # bytes per read, the KV page-group size this benchmark stands for (--chunk-mib)
FILL = 64 * MIB  # bytes per write while laying out the files


class Run(NamedTuple):
    gbps: float
    lat: list[float]  # per-op latencies, s (fio: its p50 and p99)
    req_kib: float  # average size of the device's read requests during the run


def layout(directory: str, total: int, nfiles: int) -> list[str]:
    """Create (once) nfiles files of total/nfiles bytes each, with non-zero data."""
    os.makedirs(directory, exist_ok=True)
    per_file = total // nfiles // CHUNK * CHUNK
    paths = [os.path.join(directory, f"ring-{i}.dat") for i in range(nfiles)]
    block = os.urandom(FILL)
    for path in paths:
        if os.path.exists(path) and os.path.getsize(path) == per_file:
            continue
        with open(path, "wb") as f:
            for off in range(0, per_file, FILL):
                f.write(block[: min(FILL, per_file - off)])
            f.flush()
            os.fsync(f.fileno())
    return paths


def drop_caches() -> None:
    if os.geteuid() != 0:
        return
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def device_reads(path: str) -> tuple[int, int]:
    """(read requests completed, bytes read) so far by the block device holding ``path``."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            fields = f.read().split()
    except OSError:  # not a block device (tmpfs, overlay): no request sizes
        return 0, 0
    return int(fields[0]), int(fields[2]) * 512


def run_engine(make, paths: list[str], depth: int, hugepages: bool = True) -> tuple[float, list[float]]:
    """Read every file once, round-robin over files like fio; returns (GB/s, per-op latencies s).

    Buffers come from the engine's staging pool (huge-page backed: whole AlignedBuffers from
    2 MiB up, pieces of a huge-page slab below), or with ``hugepages=False`` are AlignedBuffers of
    scattered 4 KiB pages."""
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    per_file = os.path.getsize(paths[0]) // CHUNK
    chunks = [(fds[k % len(fds)], (k // len(fds)) * CHUNK) for k in range(per_file * len(fds))]
    pool = BufferPool()
    bufs = [pool.get(CHUNK) if hugepages else AlignedBuffer(CHUNK, hugepages=False) for _ in range(depth)]
    free = list(range(depth))
    started: dict[int, tuple[int, float]] = {}  # tag -> (buffer index, submit time)
    lat: list[float] = []
    nxt = 0
    ring = make(depth)
    try:
        t0 = time.perf_counter()
        while nxt < len(chunks) or started:
            batch = []
            now = time.perf_counter()
            while free and nxt < len(chunks):
                b = free.pop()
                fd, off = chunks[nxt]
                batch.append((OP_READ, fd, bufs[b], off, nxt))
                started[nxt] = (b, now)
                nxt += 1
            if batch:
                ring.submit(batch)
            for tag, res in ring.reap(1):
                if res != CHUNK:
                    raise RuntimeError(f"chunk {tag}: read returned {res}")
                b, t = started.pop(tag)
                lat.append(time.perf_counter() - t)
                free.append(b)
        elapsed = time.perf_counter() - t0
    finally:
        ring.close()
        for fd in fds:
            os.close(fd)
        for b in bufs:
            b.close()
        pool.close()
    return len(chunks) * CHUNK / elapsed / 1e9, lat


def run_fio(paths: list[str], depth: int, registered: bool) -> tuple[float, list[float]]:
    cmd = ["fio", "--name=ring", "--ioengine=io_uring", "--direct=1", f"--bs={CHUNK // MIB}m",
           f"--iodepth={depth}", "--rw=read", "--filename=" + ":".join(paths), "--output-format=json"]
    if registered:
        cmd += ["--fixedbufs", "--registerfiles"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    pct = job["clat_ns"]["percentile"]
    # fio reports bytes/s in bw_bytes; clat percentiles in ns (we keep p50 and p99)
    return job["bw_bytes"] / 1e9, [pct["50.000000"] / 1e9, pct["99.000000"] / 1e9]


def fio_command(paths: list[str], depth: int) -> str:
    return (f"fio --name=ring --ioengine=io_uring --direct=1 --bs={CHUNK // MIB}m --iodepth={depth} --rw=read "
            f"--filename={':'.join(paths)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/kvstream-bench-ring", help="file set location (O_DIRECT-capable fs)")
    ap.add_argument("--size-gib", type=float, default=2.0, help="file set size, GiB")
    ap.add_argument("--files", type=int, default=8, help="files in the set")
    ap.add_argument("--depths", default="1,16,64", help="queue depths, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="runs per (depth, engine)")
    ap.add_argument("--chunk-mib", type=int, default=4, help="bytes per read, MiB (the engine's blocks are 1)")
    ap.add_argument("--keep", action="store_true", help="keep the file set afterwards")
    args = ap.parse_args(argv)
    global CHUNK
    CHUNK = args.chunk_mib * MIB
    if shutil.which("fio") is None:
        sys.exit("fio not found: apt-get install fio")
    depths = [int(d) for d in args.depths.split(",")]
    paths = layout(args.dir, int(args.size_gib * GIB), args.files)
    engines = {
        "fio io_uring": lambda d: run_fio(paths, d, registered=False),
        "Ring": lambda d: run_engine(lambda n: Ring(max(n, 8)), paths, d),
        "Ring, 4 KiB-page buffers": lambda d: run_engine(lambda n: Ring(max(n, 8)), paths, d, hugepages=False),
        "ThreadRing": lambda d: run_engine(lambda n: ThreadRing(n), paths, d),
        "fio +fixedbufs+registerfiles": lambda d: run_fio(paths, d, registered=True),
    }
    results: dict[tuple[int, str], list[Run]] = {}
    load_before = f"{os.getloadavg()[0]:.2f}"
    try:
        for rep in range(args.repeat):
            for depth in depths:
                for name, fn in engines.items():
                    drop_caches()
                    reqs0, bytes0 = device_reads(paths[0])
                    gbps, lat = fn(depth)
                    reqs1, bytes1 = device_reads(paths[0])
                    req_kib = (bytes1 - bytes0) / max(reqs1 - reqs0, 1) / 1024
                    results.setdefault((depth, name), []).append(Run(gbps, lat, req_kib))
                    print(f"# rep {rep} depth {depth:3d} {name:30s} {gbps:6.2f} GB/s  "
                          f"{req_kib:6.0f} KiB/request", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)

    total = sum(os.path.getsize(p) for p in paths) if args.keep else int(args.size_gib * GIB) // CHUNK * CHUNK
    print(f"O_DIRECT reads, {CHUNK // MIB} MiB chunks, {total / GIB:.1f} GiB over {args.files} files, "
          f"{args.repeat} run(s) each; kernel {os.uname().release}; load average before/after "
          f"{load_before} / {os.getloadavg()[0]:.2f}")
    print()
    print("| depth | engine | GB/s median | GB/s min-max | vs fio (paired median) | p50 ms | p99 ms "
          "| KiB/request |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for depth in depths:
        fio_rates = [r.gbps for r in results[(depth, "fio io_uring")]]
        for name in engines:
            runs = results[(depth, name)]
            rates = [r.gbps for r in runs]
            # Each run is paired with the fio run of the same repeat (minutes apart at most), so a
            # neighbour's burst of I/O moves both sides of the ratio; the median of the pairs is shown.
            ratio = statistics.median(g / f for g, f in zip(rates, fio_rates))
            if name.startswith("fio"):  # fio gives percentiles per run: report the median run's
                p50 = statistics.median(r.lat[0] for r in runs)
                p99 = statistics.median(r.lat[1] for r in runs)
            else:
                lat = [x for r in runs for x in r.lat]
                p50, p99 = percentile(lat, 50), percentile(lat, 99)
            med = statistics.median(rates)
            req_kib = statistics.median(r.req_kib for r in runs)
            print(f"| {depth} | {name} | {med:.2f} | {min(rates):.2f}-{max(rates):.2f} | "
                  f"{ratio:.2f} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} | {req_kib:.0f} |")
    print()
    print("fio reference command (per depth N):", fio_command(["<files>"], 0).replace("iodepth=0", "iodepth=N"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
