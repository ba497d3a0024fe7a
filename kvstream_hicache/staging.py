"""Engine-owned, 4096-aligned staging buffers, recycled by size.

Every routed read lands in one of these (never in caller memory directly), and unaligned pages
are written from one. A buffer handed to the ring stays out of the pool until its completion is
reaped, even when that happens in a later call: the ring may still DMA into it.
"""
from __future__ import annotations

import threading

from .io import AlignedBuffer
from .layout import round_up

MAX_IDLE_BYTES = 512 << 20  # idle buffers kept for reuse per pool; beyond this they are freed, bytes


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
            self.allocated += 1
        return AlignedBuffer(size)

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
