"""The staging BufferPool: recycling by size, huge-page slabs for routing blocks, the idle cap."""
from __future__ import annotations

import gc

import numpy as np

from kvstream_hicache.io import ALIGN, HUGE_PAGE_SIZE
from kvstream_hicache.staging import SLAB_MIN, BufferPool

MIB = 1 << 20


def test_blocks_are_carved_from_one_huge_page_slab():
    pool = BufferPool()
    bufs = [pool.get(MIB - 100) for _ in range(4)]  # rounded up to 1 MiB
    assert all(b.nbytes == MIB and b.address % ALIGN == 0 for b in bufs)
    assert len({b.address for b in bufs}) == 4
    if HUGE_PAGE_SIZE:
        per_slab = HUGE_PAGE_SIZE // MIB
        slabs = {b.address // HUGE_PAGE_SIZE for b in bufs}
        assert len(slabs) == -(-4 // per_slab)  # whole slabs, each one huge page
        assert all(b.hugepages for b in bufs)
        assert pool.allocated == len(slabs) * per_slab
    for i, b in enumerate(bufs):  # pieces do not overlap
        np.frombuffer(b, dtype=np.uint8)[:] = i
    assert [int(np.frombuffer(b, dtype=np.uint8).max()) for b in bufs] == [0, 1, 2, 3]
    for b in bufs:
        pool.put(b)
    assert pool.out == 0
    again = pool.get(MIB)
    assert again.address in {b.address for b in bufs}  # recycled, not allocated
    pool.put(again)
    pool.close()
    assert all(b.closed for b in bufs)


def test_small_and_large_sizes_are_allocated_alone():
    pool = BufferPool()
    small = pool.get(ALIGN)
    large = pool.get(4 * MIB)
    assert small.nbytes == ALIGN and small.nbytes < SLAB_MIN
    assert pool.allocated == 2  # no slab was carved for either
    assert large.hugepages == bool(HUGE_PAGE_SIZE)
    pool.put(small)
    pool.put(large)
    pool.close()


def test_idle_cap_frees_returned_buffers_and_slabs_go_with_their_last_piece():
    pool = BufferPool(max_idle_bytes=MIB)
    bufs = [pool.get(MIB) for _ in range(3)]
    if HUGE_PAGE_SIZE > MIB:
        # carved from slabs: the spare pieces of the last slab already fill the 1 MiB idle cap, so
        # every buffer given back is freed (2 MiB pages: slab A -> bufs 0, 1; slab B -> buf 2, spare)
        expected = [True, True, True]
        assert pool.allocated == -(-3 // (HUGE_PAGE_SIZE // MIB)) * (HUGE_PAGE_SIZE // MIB)
    else:
        expected = [False, True, True]  # allocated one by one: the first fills the cap, the rest are freed
        assert pool.allocated == 3
    for b in bufs:
        pool.put(b)
    assert [b.closed for b in bufs] == expected
    assert pool.out == 0
    pool.close()
    assert all(b.closed for b in bufs)  # and the idle ones with the pool
    del bufs
    gc.collect()
