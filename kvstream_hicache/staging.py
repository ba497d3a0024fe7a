"""Engine-owned, 4096-aligned staging buffers, recycled by size.

A routed read lands in one of these unless it may land in caller memory directly (reads.py: one
tier alone holds the page, and the memory is aligned and huge-page backed); unaligned pages are
written from one. A buffer handed to the ring stays out of the pool until its completion is
reaped, even when that happens in a later call: the ring may still DMA into it.

Buffers from SLAB_MIN up to a huge page (the 1 MiB routing blocks) are carved out of huge-page
slabs rather than allocated one by one: a block in one physically contiguous huge page goes to
the device as one request, where a 1 MiB buffer of scattered 4 KiB pages is split at the
device's segment limit (827-845 KiB per request on virtio-blk, and 1.6-1.7x slower reads in
benchmarks/bench_ring.py --chunk-mib 1: docs/benchmarks.md "Ring vs fio"). Larger buffers are huge-page backed by AlignedBuffer itself.
"""
from __future__ import annotations


from .io import HUGE_PAGE_SIZE, AlignedBuffer
from .layout import round_up
from .locks import ranked_lock

MAX_BYTES = 512 << 20  # default cap on the memory a pool holds, bytes
SLAB_MIN = 64 << 10  # smallest buffer carved from a huge-page slab, bytes; below it a request has
                     # few enough pages to fit the device's segment limit anyway


class BufferPool:
    """Free lists of AlignedBuffers keyed by exact (4096-rounded) size. Thread-safe.

    Memory is counted as it is really held: a buffer carved from a slab keeps the whole slab until
    its last piece is freed, so ``held_bytes`` counts slabs, not pieces. The pool keeps a returned
    buffer for reuse only while ``held_bytes`` stays within ``max_bytes``, and carves a slab only
    when the whole slab fits; the caller bounds what it keeps out (the read path's windows, the
    write path's windows), so ``peak_bytes`` stays within the cap plus at most one buffer.

    :param max_bytes: the cap on held memory, bytes.
    """

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._idle = 0
        self._lock = ranked_lock("staging")
        self._slab_of: dict[int, AlignedBuffer] = {}  # id(piece) -> its slab
        self._pieces: dict[int, int] = {}  # id(slab) -> pieces not yet freed
        self.allocated = 0  # buffers created over the pool's life
        self.out = 0  # buffers handed out and not returned
        self.out_bytes = 0
        self.held_bytes = 0  # memory allocated and not yet freed (whole slabs), bytes
        self.peak_bytes = 0  # the most held at once, bytes

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def get(self, nbytes: int) -> AlignedBuffer:
        size = round_up(max(nbytes, 1))
        with self._lock:
            self.out += 1
            self.out_bytes += size
            free = self._free.get(size)
            if free:
                self._idle -= size
                return free.pop()
            slab = SLAB_MIN <= size < HUGE_PAGE_SIZE and self.held_bytes + HUGE_PAGE_SIZE <= self.max_bytes
            if self.held_bytes + (HUGE_PAGE_SIZE if slab else size) > self.max_bytes:
                self._shed_under_pool(self.held_bytes + size - self.max_bytes)
            self.held_bytes += HUGE_PAGE_SIZE if slab else size  # counted now: another thread sees it
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        # Outside the lock: zeroing new memory faults it in.
        if not slab:
            buf = AlignedBuffer(size)
            with self._lock:
                self.allocated += 1
            return buf
        parent = AlignedBuffer(HUGE_PAGE_SIZE)
        pieces = [parent.view(offset, size) for offset in range(0, HUGE_PAGE_SIZE - size + 1, size)]
        with self._lock:
            self.allocated += len(pieces)
            self._pieces[id(parent)] = len(pieces)
            for piece in pieces:
                self._slab_of[id(piece)] = parent
            if len(pieces) > 1:
                self._free.setdefault(size, []).extend(pieces[1:])
                self._idle += size * (len(pieces) - 1)
        return pieces[0]

    def put(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self.out -= 1
            self.out_bytes -= buf.nbytes
            slab = self._slab_of.get(id(buf))
            # Kept for reuse within the cap, and always while its slab has other live pieces:
            # freeing it would release no memory.
            if self.held_bytes <= self.max_bytes or (slab is not None and self._pieces[id(slab)] > 1):
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._idle += buf.nbytes
                return
            self._free_under_pool(buf)

    def close(self) -> None:
        """Free idle buffers (buffers still out belong to in-flight ops and are freed by GC)."""
        with self._lock:
            free, self._free, self._idle = self._free, {}, 0
            for bufs in free.values():
                for buf in bufs:
                    self._free_under_pool(buf)

    def _shed_under_pool(self, nbytes: int) -> None:
        """Free idle buffers until ``nbytes`` of held memory went (or nothing more can go): lone
        buffers, and slabs whose every live piece is idle (a piece alone frees nothing)."""
        idle_pieces: dict[int, int] = {}
        for bufs in self._free.values():
            for b in bufs:
                slab = self._slab_of.get(id(b))
                if slab is not None:
                    idle_pieces[id(slab)] = idle_pieces.get(id(slab), 0) + 1
        for size in list(self._free):
            keep = []
            for b in self._free[size]:
                slab = self._slab_of.get(id(b))
                if nbytes > 0 and (slab is None or idle_pieces[id(slab)] == self._pieces[id(slab)]):
                    before = self.held_bytes
                    self._free_under_pool(b)
                    self._idle -= size
                    nbytes -= before - self.held_bytes
                    if slab is not None:  # the slab's other idle pieces follow it (it frees with the last)
                        idle_pieces[id(slab)] -= 1
                else:
                    keep.append(b)
            if keep:
                self._free[size] = keep
            else:
                del self._free[size]

    def _free_under_pool(self, buf: AlignedBuffer) -> None:
        buf.close()
        slab = self._slab_of.pop(id(buf), None)
        if slab is None:
            self.held_bytes -= buf.nbytes
            return
        left = self._pieces[id(slab)] - 1
        if left:
            self._pieces[id(slab)] = left
        else:  # the slab's memory goes with its last piece
            del self._pieces[id(slab)]
            self.held_bytes -= slab.nbytes
