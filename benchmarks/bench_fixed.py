"""O_DIRECT reads through kvstream's Ring into memory in 4 KiB pages, three ways (docs/benchmarks.md,
"Reads into registered memory"):

  plain       READ into the memory as it is: the kernel pins its 4 KiB pages for every request
  registered  the memory registered once (Ring.register_memory): READ_FIXED, nothing pinned per request
  staged      READ into a huge-page staging buffer, then copied over (kvstream's copy, no checksum)

The memory is a shared anonymous mapping kept in 4 KiB pages, as sglang allocates its host pool. Each
round reads the whole FILE once per way, in an order rotated every round, REQ_KIB per request and
DEPTH requests in flight; prints MB/s and process CPU s/GB (user, system) per way: medians over the
rounds and their range. Run it on a file written beforehand (e.g. dd of random data), on each tier
under test, as root where the memlock limit would refuse registering.

usage: python benchmarks/bench_fixed.py FILE REQ_KIB DEPTH ROUNDS
"""
import ctypes
import mmap
import os
import resource
import statistics
import sys
import time

from kvstream_hicache._uring import OP_READ, AlignedBuffer, Ring, copy

path, req, depth, rounds = sys.argv[1], int(sys.argv[2]) << 10, int(sys.argv[3]), int(sys.argv[4])
size = os.path.getsize(path) // req * req
if not size:
    sys.exit(f"{path} is smaller than one request of {req >> 10} KiB")
pool = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
pool.madvise(mmap.MADV_NOHUGEPAGE)
pool.write(b"\0" * size)  # faulted in, as sglang's MAP_POPULATE
address = ctypes.addressof(ctypes.c_char.from_buffer(pool))
staging = AlignedBuffer(depth * req)  # huge-page backed from 2 MiB up
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
rings = {"plain": Ring(), "registered": Ring(), "staged": Ring()}
t0 = time.perf_counter()
rings["registered"].register_memory(address, size)
print(f"registered {size >> 20} MiB in {time.perf_counter() - t0:.3f} s; READV_FIXED: {rings['registered'].readv_fixed}")


def read_all(way: str) -> None:
    ring = rings[way]
    n = size // req
    sent = done = 0
    while done < n:
        ops = []
        while sent < n and sent - done < depth:
            dst = staging.address + (sent % depth) * req if way == "staged" else address + sent * req
            ops.append((OP_READ, fd, (dst, req), sent * req, sent))
            sent += 1
        if ops:
            ring.submit(ops)
        for tag, res in ring.reap(1):
            if res != req:
                sys.exit(f"{way}: read {tag} returned {res}")
            if way == "staged":
                copy(address + tag * req, staging.address + (tag % depth) * req, req)
            done += 1


ways = list(rings)
rows = {w: [] for w in ways}
for r in range(rounds + 1):  # round 0 warms up
    for w in ways[r % len(ways):] + ways[:r % len(ways)]:
        c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        read_all(w)
        c1, dt = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
        if r:
            gb = size / 1e9
            rows[w].append((size / dt / 1e6, (c1.ru_utime - c0.ru_utime) / gb, (c1.ru_stime - c0.ru_stime) / gb))
for w in ways:
    rate, user, system = (sorted(x[i] for x in rows[w]) for i in range(3))
    print(f"{w:10s} {req >> 10} KiB x {depth}: MB/s med {statistics.median(rate):6.0f} [{rate[0]:.0f}-{rate[-1]:.0f}]"
          f"  CPU s/GB user {statistics.median(user):.3f} system {statistics.median(system):.3f}"
          f"  fixed ops {rings[w].fixed_ops}")
for ring in rings.values():
    ring.close()
os.close(fd)
staging.close()
