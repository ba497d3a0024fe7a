"""Engine-owned, 4096-aligned staging buffers, recycled by size.

Every routed read lands in one of these (never in caller memory directly), and unaligned pages
are written from one. A buffer handed to the ring stays out of the pool until its completion is
reaped, even when that happens in a later call: the ring may still DMA into it.

Buffers from SLAB_MIN up to a huge page (the 1 MiB routing blocks) are carved out of huge-page
slabs rather than allocated one by one: a block in one physically contiguous huge page goes to
the device as one request, where a 1 MiB buffer of scattered 4 KiB pages is split at the
device's segment limit (827-845 KiB per request on virtio-blk, and 1.6-1.7x slower reads in
benchmarks/bench_ring.py --chunk-mib 1: docs/benchmarks.md "Ring vs fio"). Larger buffers are huge-page backed by AlignedBuffer itself.
"""
from __future__ import annotations

import threading

from .io import HUGE_PAGE_SIZE, AlignedBuffer
from .layout import round_up

MAX_IDLE_BYTES = 512 << 20  # idle buffers kept for reuse per pool; beyond this they are freed, bytes
SLAB_MIN = 64 << 10  # smallest buffer carved from a huge-page slab, bytes; below it a request has
                     # few enough pages to fit the device's segment limit anyway


class BufferPool:
    """Free lists of AlignedBuffers keyed by exact (4096-rounded) size. Thread-safe."""

    def __init__(self, max_idle_bytes: int = MAX_IDLE_BYTES):
        self.max_idle_bytes = max_idle_bytes
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._idle = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers created over the pool's life
        self.out = 0  # buffers handed out and not returned

    def get(self, nbytes: int) -> AlignedBuffer:
        size = round_up(max(nbytes, 1))
        with self._lock:
            self.out += 1
            free = self._free.get(size)
            if free:
                self._idle -= size
                return free.pop()
        pieces = _allocate(size)  # outside the lock: zeroing a slab faults its memory in
        with self._lock:
            self.allocated += len(pieces)
            if len(pieces) > 1:
                self._free.setdefault(size, []).extend(pieces[1:])
                self._idle += size * (len(pieces) - 1)
        return pieces[0]

    def put(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self.out -= 1
            if self._idle + buf.nbytes <= self.max_idle_bytes:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._idle += buf.nbytes
                return
        buf.close()

    def close(self) -> None:
        """Free idle buffers (buffers still out belong to in-flight ops and are freed by GC)."""
        with self._lock:
            free, self._free, self._idle = self._free, {}, 0
        for bufs in free.values():
            for buf in bufs:
                buf.close()


def _allocate(size: int) -> list[AlignedBuffer]:
    """New buffers of ``size`` bytes: one, or every piece of a huge-page slab. Each piece pins
    its slab, which is freed when the last piece is closed."""
    if not SLAB_MIN <= size < HUGE_PAGE_SIZE:
        return [AlignedBuffer(size)]
    slab = AlignedBuffer(HUGE_PAGE_SIZE)
    return [slab.view(offset, size) for offset in range(0, HUGE_PAGE_SIZE - size + 1, size)]
