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


def test_cap_counts_whole_slabs_and_frees_returned_buffers_beyond_it():
    pool = BufferPool(max_bytes=2 * MIB)
    bufs = [pool.get(MIB) for _ in range(3)]
    if HUGE_PAGE_SIZE == 2 * MIB:
        # one slab (2 MiB held: both pieces), then a lone buffer, since a second slab would not fit
        assert bufs[0].address + MIB == bufs[1].address
        assert (pool.held_bytes, pool.peak_bytes, pool.idle_bytes) == (3 * MIB, 3 * MIB, 0)
        for b in bufs:
            pool.put(b)
        # over the cap: the slab's pieces are kept (freeing one alone would release nothing), the
        # lone buffer is freed, which brings the pool back to the cap
        assert [b.closed for b in bufs] == [False, False, True]
        assert (pool.held_bytes, pool.idle_bytes, pool.out_bytes) == (2 * MIB, 2 * MIB, 0)
        other = pool.get(512 << 10)
        # every piece of the slab was idle: shedding frees the whole slab to make room for it
        assert [b.closed for b in bufs] == [True, True, True]
        assert (pool.held_bytes, pool.idle_bytes) == (512 << 10, 0)
        again = pool.get(MIB)
        assert again not in bufs and pool.held_bytes == (512 << 10) + MIB  # lone: a slab would not fit
        pool.put(other)
        pool.put(again)
    else:  # no THP here: three lone buffers, the first returned one is already over the cap
        for b in bufs:
            pool.put(b)
        assert [b.closed for b in bufs] == [True, False, False] and pool.held_bytes == 2 * MIB
    assert pool.out == 0
    pool.close()
    assert all(b.closed for b in bufs)  # and the idle ones with the pool
    del bufs
    gc.collect()
