"""What the CRC32C check of a block costs, by where the block's bytes are when it runs (issue 27: the CPU per GB).

Every block the engine serves is checked (CRC32C) right after its read completes, and nixl checks nothing;
on a RAM tier the check is most of the engine's CPU per GB. How much it costs depends on whether the bytes
are still in a cache when it runs, so this reads ``--total`` bytes of FILE with O_DIRECT three ways, for each
request size, and times the check alone:

* ``sync``: ``preadv`` one request, check it, the next (the kernel copies on this CPU while the thread waits);
* ``cold``: every request first, then every check (what a check pays with the bytes in memory only);
* ``ring``: through the engine's io_uring binding, ``--depth`` requests in flight, each checked as it is
  reaped (what the read path does: ``delivery.py``).

Prints, per way and request size, the check's seconds per GB, the pass's rate (reads and checks), and the
process CPU s/GB.
FILE should be at least ``--total`` bytes on a tier's file system, not in the page cache (it is read with
O_DIRECT), e.g. on testbed A (docs/benchmarks.md, "Stop 52: what the check costs"):

    sudo .venv/bin/kvstream testbed up --profile ram-0.7 --name chk --no-fio
    dd if=/dev/urandom of=/mnt/kvstream-chk/tier0/big bs=1M count=2048
    .venv/bin/python benchmarks/bench_check.py /mnt/kvstream-chk/tier0/big --rounds 3
    sudo .venv/bin/kvstream testbed down --name chk
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

from kvstream_hicache.io import AlignedBuffer, Ring, OP_READ, crc32c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--total", type=int, default=512 << 20, help="bytes read per way and size (default 512 MiB)")
    ap.add_argument("--sizes", default="256K,1M,8M,64M", help="request sizes (K, M suffixes)")
    ap.add_argument("--depth", type=int, default=8, help="requests in flight for the ring way")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s[:-1]) << {"K": 10, "M": 20}[s[-1]] if s[-1] in "KM" else int(s) for s in args.sizes.split(",")]
    fd = os.open(args.file, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size // mmap.PAGESIZE * mmap.PAGESIZE
        total = args.total // max(sizes) * max(sizes)
        if not total or size < max(sizes):
            raise SystemExit(f"bench_check: {args.file} holds {size} bytes; --total and the file must hold at "
                             f"least one request of {max(sizes)} bytes")
        with AlignedBuffer(total, hugepages=False) as buf, Ring() as ring:
            rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
            offset = 0
            for _ in range(args.rounds):
                for req in sizes:
                    for way in ("sync", "cold", "ring"):
                        rows.setdefault((way, req), []).append(
                            run(way, fd, buf, ring, total, req, args.depth,
                            offset % max(size - total, 1) // mmap.PAGESIZE * mmap.PAGESIZE))
                        offset += total
            for (way, req), got in rows.items():
                check, rate, cpu = (statistics.median(col) for col in zip(*got))
                print(f"{way:4s} request {req >> 10:6d} KiB: check {check:.3f} s/GB (range "
                      f"{min(g[0] for g in got):.3f}-{max(g[0] for g in got):.3f})  pass {rate:5.2f} GB/s  "
                      f"CPU {cpu:.3f} s/GB", flush=True)
    finally:
        os.close(fd)


def run(way: str, fd: int, buf: AlignedBuffer, ring: Ring, total: int, req: int, depth: int,
        offset: int) -> tuple[float, float, float]:
    """One pass of ``total`` bytes in requests of ``req``: (check s/GB, the pass's GB/s, CPU s/GB)."""
    base, n, checked = buf.address, total // req, 0.0
    cpu0, t0 = time.process_time(), time.perf_counter()
    if way == "ring":
        def op(k: int):
            return OP_READ, fd, (base + k * req, req), offset + k * req, k
        sent = min(depth, n)
        ring.submit([op(k) for k in range(sent)])
        done = 0
        while done < n:
            for k, res in ring.reap(1):
                if res != req:
                    raise SystemExit(f"bench_check: a read returned {res}, not {req}")
                t = time.perf_counter()
                crc32c((base + k * req, req))
                checked += time.perf_counter() - t
                done += 1
                if sent < n:
                    ring.submit([op(sent)])
                    sent += 1
    else:
        view = memoryview(buf)
        try:
            for k in range(n):
                if os.preadv(fd, [view[k * req:(k + 1) * req]], offset + k * req) != req:
                    raise SystemExit("bench_check: a short read")
                if way == "sync":
                    t = time.perf_counter()
                    crc32c((base + k * req, req))
                    checked += time.perf_counter() - t
            if way == "cold":
                t = time.perf_counter()
                for k in range(n):
                    crc32c((base + k * req, req))
                checked += time.perf_counter() - t
        finally:
            view.release()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return checked / (total / 1e9), total / wall / 1e9, cpu / (total / 1e9)


if __name__ == "__main__":
    main()
