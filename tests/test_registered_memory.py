"""Reads into registered memory: caller memory in 4 KiB pages (as SGLang allocates its host pool: a
shared anonymous mapping) that the engine registered with its read ring (io_uring fixed buffers) takes
reads in place, sent as READ_FIXED / READV_FIXED, pinning nothing per read; without registration it is
staged. Memory that was unmapped and mapped again after it was registered is never served from stale
pins: the check fails, the copy on disk is kept, registrations are dropped and the next read is staged.
Real io_uring, real files with O_DIRECT; no timing assertions.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
import threading
import time

import pytest

from kvstream_hicache._uring import OP_READ, Ring
from kvstream_hicache.faults import Fault, TierFaultPlan

from helpers import Pages, key, lockable, make_array_engine as make_engine, uring_available

pytestmark = pytest.mark.skipif(not uring_available(), reason="io_uring_setup refused on this host")


MIB = 1 << 20
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_FIXED = 0x10

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class SmallPages:
    """A shared anonymous mapping in 4 KiB pages, as sglang's host pool (``remap`` maps it again at the
    same address: new, zeroed memory where the old pages were)."""

    def __init__(self, nbytes: int, address: int | None = None):
        self.nbytes = nbytes
        flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | (MAP_FIXED if address else 0)
        self.address = libc.mmap(address, nbytes, PROT_RW, flags, -1, 0)
        assert self.address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        libc.madvise(self.address, nbytes, mmap.MADV_NOHUGEPAGE)
        ctypes.memset(self.address, 0, nbytes)  # (faulted in, as sglang's MAP_POPULATE)

    def bytes(self, offset: int = 0, n: int | None = None) -> bytes:
        return ctypes.string_at(self.address + offset, self.nbytes - offset if n is None else n)

    def remap(self) -> None:
        assert libc.munmap(self.address, self.nbytes) == 0
        again = SmallPages(self.nbytes, self.address)
        assert again.address == self.address

    def close(self) -> None:
        libc.munmap(self.address, self.nbytes)


def page_first(memory: SmallPages, sizes: list[int], n: int) -> list[list[tuple[int, int]]]:
    """``n`` pages of two pieces each (sglang's page_first K and V chunks) laid out in ``memory``."""
    offsets = [0, *itertools.accumulate(sizes)]
    return [[(memory.address + offsets[2 * i], sizes[2 * i]), (memory.address + offsets[2 * i + 1], sizes[2 * i + 1])]
            for i in range(n)]


def stored(dirs, n, **settings):
    pages = Pages(n, size=4 * MIB)  # two 2 MiB pieces a page
    keys = [key(i, "registered") for i in range(n)]
    engine = make_engine(dirs, "uring", **settings)
    assert engine.put(keys, pages.src_segments) == [True] * n
    sizes = [s for shape in pages.shapes for s in shape]
    return engine, pages, keys, sizes


def test_the_ring_sends_reads_into_registered_memory_as_fixed_and_others_as_before(tmp_path):
    data = os.urandom(4 * MIB)
    path = tmp_path / "f"
    path.write_bytes(data)
    lockable(16 * MIB)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    memory = SmallPages(16 * MIB)
    other = SmallPages(MIB)
    ring = Ring()
    try:
        a = memory.address
        assert ring.fixed(a, 4096) == -1 and ring.fixed_bytes == 0
        assert ring.register_memory(a, 16 * MIB) == 16 * MIB
        assert ring.register_memory(a + 4096, 4096) == 0  # (overlaps: nothing new pinned)
        assert ring.fixed(a, 16 * MIB) == 0 and ring.fixed(a, 16 * MIB + 1) == -1 and ring.fixed(a - 4096, 4096) == -1
        vector = [(a + 2 * MIB, MIB // 2), (a + 8 * MIB, MIB // 2)]  # one file range into two pieces of memory
        ring.submit([(OP_READ, fd, (a, MIB), 0, 1), (OP_READ, fd, vector, MIB, 2),
                     (OP_READ, fd, (other.address, MIB), 2 * MIB, 3)])
        assert sorted(ring.reap(3)) == [(1, MIB), (2, MIB), (3, MIB)]
        assert ring.fixed_ops == (2 if ring.readv_fixed else 1)  # not the read into unregistered memory
        assert memory.bytes(0, MIB) == data[:MIB]
        assert memory.bytes(2 * MIB, MIB // 2) + memory.bytes(8 * MIB, MIB // 2) == data[MIB:2 * MIB]
        assert other.bytes() == data[2 * MIB:3 * MIB]
        ring.unregister_memory()
        assert ring.fixed_bytes == 0 and ring.fixed(a, 4096) == -1
        ring.submit([(OP_READ, fd, (a + MIB, MIB), 3 * MIB, 4)])
        assert ring.reap(1) == [(4, MIB)] and ring.fixed_ops == (2 if ring.readv_fixed else 1)
        assert memory.bytes(MIB, MIB) == data[3 * MIB:]
        assert ring.register_memory(a, 16 * MIB) == 16 * MIB  # (again, after unregistering)
    finally:
        ring.close()
        os.close(fd)
        memory.close()
        other.close()


def test_more_than_a_gib_is_registered_in_pieces_and_a_read_across_two_goes_out_plain(tmp_path):
    """The kernel takes fixed buffers of at most 1 GiB: a larger range is several pieces. Reads within
    a piece go out fixed, a read across two pieces goes out as a plain read (correct, pinned per read)."""
    lockable(1 << 30)
    data = os.urandom(2 * MIB)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY | os.O_DIRECT)
    memory = SmallPages((1 << 30) + 4 * MIB)
    ring = Ring()
    try:
        a, cut = memory.address, memory.address + (1 << 30)
        assert ring.register_memory(a, memory.nbytes) == memory.nbytes
        assert ring.covers(a, memory.nbytes) and not ring.covers(a - 4096, 8192)
        assert ring.fixed(a, memory.nbytes) == -1 and ring.fixed(a, 1 << 30) == 0 and ring.fixed(cut, 4 * MIB) == 1
        ring.submit([(OP_READ, fd, (cut - MIB, 2 * MIB), 0, 1), (OP_READ, fd, (cut + MIB, MIB), 0, 2)])
        assert sorted(ring.reap(2)) == [(1, 2 * MIB), (2, MIB)] and ring.fixed_ops == 1  # (the second alone)
        assert memory.bytes(cut - MIB - a, 2 * MIB) == data and memory.bytes(cut + MIB - a, MIB) == data[:MIB]
    finally:
        ring.close()
        os.close(fd)
        memory.close()


def test_a_registration_the_kernel_takes_only_in_part_registers_nothing():
    """Registering stops part way at the first piece the kernel refuses (here: a 1 GiB piece, then
    memory not mapped): the pieces it took are cleared again and the whole call fails, so no read is
    ever sent as fixed into a slot that holds nothing."""
    lockable(1 << 30)
    memory = SmallPages((1 << 30) + 2 * MIB)
    libc.munmap(memory.address + (1 << 30), 2 * MIB)  # the second piece: not mapped
    ring = Ring()
    try:
        with pytest.raises(OSError):
            ring.register_memory(memory.address, memory.nbytes)
        assert ring.fixed_bytes == 0 and ring.fixed(memory.address, 4096) == -1
        assert ring.register_memory(memory.address, 1 << 30) == 1 << 30  # (the slots were cleared)
        assert ring.fixed(memory.address, 4096) == 0
    finally:
        ring.close()
        libc.munmap(memory.address, 1 << 30)


@pytest.mark.parametrize("register", [True, False])
def test_registered_memory_in_small_pages_takes_reads_in_place(tier_dirs, register):
    """sglang's host pool (4 KiB pages, pages of a K and a V piece) registered: every byte lands in
    place through the fixed buffers; with register_memory=off the same memory is staged."""
    lockable(16 * MIB)
    engine, pages, keys, sizes = stored(tier_dirs[:1], 4, register_memory=register)
    memory = SmallPages(sum(sizes))
    try:
        with engine:
            segments = page_first(memory, sizes, 4)
            assert engine.register_memory(memory.address, memory.nbytes) == register
            ring = engine._reads.io.ring
            before = ring.fixed_ops
            assert engine.get(keys, segments) == [True] * 4
            assert memory.bytes() == b"".join(a.tobytes() for page in pages.src for a in page)
            in_place = register and ring.readv_fixed  # (pages of two pieces: READV_FIXED, Linux 6.15)
            assert engine.last_batch["direct_bytes"] == (16 * MIB if in_place else 0)
            assert engine.stats()["tiers"][0]["bytes_in_place"] == (16 * MIB if in_place else 0)
            assert (ring.fixed_ops > before) == in_place
            assert ring.fixed_bytes == (memory.nbytes if register else 0)
    finally:
        memory.close()


def test_memory_mapped_again_after_registration_is_never_served_stale_pins(tier_dirs, caplog):
    """A read into registered memory lands in the pages pinned at registration. Memory unmapped and
    mapped again at the same address (a caller that broke the contract) then never receives it: the
    check of what the caller's memory holds fails, the copy on disk is intact and kept, every
    registration is dropped, and the next read is staged and served."""
    lockable(8 * MIB)
    engine, pages, keys, sizes = stored(tier_dirs[:1], 2)
    memory = SmallPages(sum(sizes))
    try:
        with engine:
            if not engine._reads.io.ring.readv_fixed:
                pytest.skip("the kernel lacks READV_FIXED (Linux 6.15): pages of two pieces are staged")
            segments = page_first(memory, sizes, 2)
            assert engine.register_memory(memory.address, memory.nbytes)
            memory.remap()
            with caplog.at_level(logging.WARNING, logger="kvstream"):
                found = engine.get(keys, segments)
            assert found.count(False) >= 1  # (the page that failed is a miss: nobody else holds it)
            assert "into registered memory failed its check" in caplog.text
            assert engine._reads.io.ring.fixed_bytes == 0
            assert all(engine.index.holders(k) == 1 for k in keys)  # intact copies stay indexed, on disk
            assert engine.get(keys, segments) == [True, True]
            assert engine.last_batch["direct_bytes"] == 0  # staged
            assert memory.bytes() == b"".join(a.tobytes() for page in pages.src for a in page)
    finally:
        memory.close()


def test_memory_the_kernel_refuses_to_register_is_staged_with_one_warning(tier_dirs, caplog):
    """A registration the kernel refuses (here: memory not mapped, EFAULT; for a user without
    CAP_IPC_LOCK, a memlock limit below the pool, ENOMEM) is one warning, and reads are staged: the
    attach goes on, nothing is pinned."""
    engine, pages, keys, sizes = stored(tier_dirs[:1], 2)
    memory = SmallPages(sum(sizes))
    gone = SmallPages(MIB)
    gone.close()  # (an address range with nothing mapped)
    try:
        with engine:
            with caplog.at_level(logging.WARNING, logger="kvstream"):
                assert engine.register_memory(gone.address, MIB) is False
            assert "could not register 1 MiB of caller memory with io_uring" in caplog.text
            assert engine._reads.io.ring.fixed_bytes == 0
            segments = page_first(memory, sizes, 2)
            assert engine.get(keys, segments) == [True, True]
            assert engine.last_batch["direct_bytes"] == 0  # (4 KiB pages, not registered: staged)
            assert memory.bytes() == b"".join(a.tobytes() for page in pages.src for a in page)
    finally:
        memory.close()


@pytest.mark.parametrize("fault", ["error", "hold", "corrupt"])
def test_faults_reach_reads_into_registered_memory(tier_dirs, caplog, fault):
    """The fault plan reaches the fixed reads (the wrapper passes the registration to the ring it
    wraps, which sends them fixed). A read that fails (EIO) costs its page at most, and the
    registration stays; a held read targets the caller's memory, so the call waits for it past
    read_timeout and it lands verified; a read corrupted in transfer fails its check while the copy
    on disk is intact: its page is a miss, the copy is kept, every registration is dropped (a check
    that fails in registered memory may be stale pins) and later reads are staged."""
    lockable(8 * MIB)
    plan = TierFaultPlan()
    hold = fault == "hold"  # (a short read_timeout only there: the other cases' last read may be staged)
    engine, pages, keys, sizes = stored(tier_dirs[:1], 2, fault_plan=plan, **({"read_timeout": 0.05} if hold else {}))
    memory = SmallPages(sum(sizes))
    want = [b"".join(a.tobytes() for a in page) for page in pages.src]
    try:
        with engine:
            ring = engine._reads.io.ring
            if not ring.readv_fixed:
                pytest.skip("the kernel lacks READV_FIXED (Linux 6.15): pages of two pieces are staged")
            segments = page_first(memory, sizes, 2)
            assert engine.register_memory(memory.address, memory.nbytes)
            before = ring.fixed_ops
            with caplog.at_level(logging.WARNING, logger="kvstream"):
                if hold:
                    plan.on(tier_dirs[0], Fault.hold(), opcode=OP_READ)
                    result: list = []
                    t = threading.Thread(target=lambda: result.append(engine.get(keys, segments)))
                    t.start()
                    deadline = time.monotonic() + 30
                    while len(plan.hits) < 2 and time.monotonic() < deadline:  # both pages' reads held
                        time.sleep(0.01)
                    t.join(0.5)  # ten times read_timeout: still waiting for the reads into the caller's memory
                    assert t.is_alive() and not result
                    plan.clear()
                    plan.release()
                    t.join(30)
                    (found,) = result
                    assert found == [True, True] and engine.stats()["read_timeouts"] == 1
                else:
                    plan.on(tier_dirs[0], Fault.error(errno.EIO) if fault == "error" else Fault.corrupt(),
                            opcode=OP_READ, times=1)
                    found = engine.get(keys, segments)
                    assert found.count(False) == 1  # the page whose read failed: nobody else holds it
                    assert engine.stats()["tiers"][0]["errors" if fault == "error" else "corrupted"] == 1
            assert plan.hits and ring.fixed_ops > before  # the faulted reads went out fixed
            tier = engine.stats()["tiers"][0]  # what was served was read in place; a failed block is neither
            assert tier["bytes_in_place"] == tier["bytes_served"] >= sum(found) * 4 * MIB
            for i, ok in enumerate(found):
                assert not ok or memory.bytes(sum(sizes[:2 * i]), len(want[i])) == want[i]
            stale = fault == "corrupt"
            assert ("into registered memory failed its check" in caplog.text) == stale
            assert ring.fixed_bytes == (0 if stale else memory.nbytes)
            assert all(engine.index.holders(k) == 1 for k in keys)  # no copy on disk was lost
            assert engine.get(keys, segments) == [True, True]
            assert engine.last_batch["direct_bytes"] == (0 if stale else 8 * MIB)
            assert memory.bytes() == b"".join(want)
    finally:
        memory.close()
