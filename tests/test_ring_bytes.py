"""crc32c, copy and AlignedBuffer from the _uring extension."""
from __future__ import annotations

import ctypes
import inspect
import json
import os
import platform
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream_hicache.io import ALIGN, CRC32C_IMPL, HUGE_PAGE_SIZE, AlignedBuffer, copy, crc32c

POLY = 0x82F63B78  # CRC-32C, reflected


def _table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        table.append(c)
    return table


TABLE = _table()


def crc32c_ref(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ TABLE[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


# RFC 3720 (iSCSI) appendix B.4, and the usual check value.
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("data,expected", VECTORS)
def test_crc32c_known_vectors(data, expected):
    assert crc32c(data) == expected
    assert crc32c_ref(data) == expected


def _cpu_flags() -> set[str]:
    """The flags an x86 CPU lists in /proc/cpuinfo (empty elsewhere: the table path is used)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_crc32c_backend_is_the_fastest_this_cpu_has():
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= flags:
        assert CRC32C_IMPL == "vpclmulqdq-fold"
    elif {"avx2", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= flags:  # AMD Zen 3, as on this project's CI
        assert CRC32C_IMPL == "vpclmulqdq-avx2-fold"
    elif "sse4_2" in flags:
        assert CRC32C_IMPL == "sse4.2-3way"
    else:
        assert CRC32C_IMPL == "table"


def crc_paths() -> list[int]:
    """The CRC32C implementations this CPU has (indices into CRC32C_IMPLS)."""
    from kvstream_hicache._uring import CRC32C_IMPLS, _crc32c_by

    return [impl for impl in range(len(CRC32C_IMPLS)) if _crc32c_by(impl, bytes(256)) is not None]


def test_the_crc32c_path_in_use_is_one_the_tests_check():
    from kvstream_hicache._uring import CRC32C_IMPLS

    assert CRC32C_IMPLS.index(CRC32C_IMPL) in crc_paths() and 0 in crc_paths()


@pytest.mark.parametrize("length", [256, 257, 287, 288, 300, 383, 384, 415, 511, 512, 4095, 65536 + 17,
                                    (1 << 20) + 100])
@pytest.mark.parametrize("offset", [0, 1, 7, 63])
def test_crc32c_every_path_agrees_with_the_reference(length, offset):
    """Every implementation the CPU has, at lengths around the folding loops' steps (AVX-512: 256 and
    64 bytes; AVX2: 128 and 32) and unaligned starts, continued from a non-zero CRC; and each one's
    copy (fused in the folds) leaves an exact copy with the same CRC, as PageMap's does."""
    from kvstream_hicache._uring import PageMap, _crc32c_by

    data = random.Random(length * 64 + offset).randbytes(length + offset)[offset:]
    want = crc32c_ref(data)
    assert crc32c(data, 0x1234) == crc32c_ref(data, 0x1234)
    src = AlignedBuffer(length + 64)
    dst = AlignedBuffer(length + 64)
    try:
        memoryview(src)[offset:offset + length] = data
        for impl in crc_paths():
            assert _crc32c_by(impl, data, 0x1234) == crc32c_ref(data, 0x1234), impl
            memoryview(dst)[:] = bytes(length + 64)
            assert _crc32c_by(impl, data, 0, dst.address + offset) == want, impl
            assert bytes(memoryview(dst)[offset:offset + length]) == data, impl
        memoryview(dst)[:] = bytes(length + 64)
        pm = PageMap([(dst.address + offset, length)], length, length, [want])
        assert pm.check(0, 1, [src.address + offset]) == 0
        assert bytes(memoryview(dst)[offset:offset + length]) == data
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("length", [(64 << 10) - 64, 64 << 10, (64 << 10) + 17, (1 << 20) + 100])
@pytest.mark.parametrize("src_offset", [0, 8, 63])
@pytest.mark.parametrize("dst_offset", [0, 64, 4])
def test_fused_copy_is_exact_whatever_the_alignments_and_writes_nothing_past_the_end(length, src_offset,
                                                                                      dst_offset):
    """A copy of 64 KiB or more into a 64-byte aligned destination streams (non-temporal stores,
    crc32c.h); shorter or unaligned ones store as before. Either way, in every copy the CPU has (the
    folds' and the 3-way loop's, which streams in chunks and checks each from the cache): an
    exact copy, the right CRC, and the bytes on both sides of the destination untouched."""
    from kvstream_hicache._uring import PageMap, _crc32c_by

    data = random.Random(length + src_offset).randbytes(length)
    src = AlignedBuffer(length + 128)
    dst = AlignedBuffer(length + 256)
    try:
        memoryview(src)[src_offset:src_offset + length] = data
        for impl in [None] + [impl for impl in crc_paths() if impl >= 1]:  # None: PageMap, the path in use
            memoryview(dst)[:] = b"\xa5" * (length + 256)
            if impl is None:
                pm = PageMap([(dst.address + dst_offset, length)], length, length, [crc32c_ref(data)])
                assert pm.check(0, 1, [src.address + src_offset]) == 0
            else:
                assert _crc32c_by(impl, data, 0, dst.address + dst_offset) == crc32c_ref(data), impl
            view = bytes(memoryview(dst))
            assert view[dst_offset:dst_offset + length] == data, impl
            assert view[:dst_offset] == b"\xa5" * dst_offset, impl
            assert view[dst_offset + length:] == b"\xa5" * (256 - dst_offset), impl
        wrong = PageMap([(dst.address + dst_offset, length)], length, length, [crc32c_ref(data) ^ 1])
        assert wrong.check(0, 1, [src.address + src_offset]) == 1  # a wrong CRC is still caught
    finally:
        src.close()
        dst.close()


# Lengths around the 3-way block sizes (3 x 256 and 3 x 8192 bytes) and the 8-byte word edges.
EDGE_LENGTHS = [1, 7, 8, 9, 63, 767, 768, 769, 1536 + 5, 24575, 24576, 24577, 3 * 24576 + 777, 200_000]


@pytest.mark.parametrize("length", EDGE_LENGTHS)
def test_crc32c_matches_reference_at_block_edges(length):
    data = np.random.default_rng(length).integers(0, 256, length + 8, dtype=np.uint8).tobytes()
    from kvstream_hicache._uring import _crc32c_by

    for start in (0, 1, 5):  # unaligned starts exercise the byte-wise prologue
        chunk = data[start:start + length]
        assert crc32c(chunk) == crc32c_ref(chunk)
        for impl in crc_paths():  # the table and the 3-way loop at every length, the folds from 256 bytes
            assert _crc32c_by(impl, chunk) in (crc32c_ref(chunk), None), impl


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=4096), st.binary(max_size=4096), st.integers(0, 0xFFFFFFFF))
def test_crc32c_random_and_chaining(a, b, seed):
    assert crc32c(a, seed) == crc32c_ref(a, seed)
    assert crc32c(b, crc32c(a)) == crc32c(a + b)


def test_crc32c_accepts_buffers_and_raw_memory():
    data = os.urandom(100_000)
    buf = AlignedBuffer(len(data))
    np.frombuffer(buf, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    expected = crc32c_ref(data)
    assert crc32c(buf) == expected
    assert crc32c(memoryview(buf)[10:]) == crc32c_ref(data[10:])
    assert crc32c((buf.address, len(data))) == expected
    assert crc32c((buf.address, 0)) == 0
    assert crc32c(np.frombuffer(data, dtype=np.uint32)) == expected
    with pytest.raises(ValueError):
        crc32c((0, 10))
    with pytest.raises(OverflowError):
        crc32c(b"x", 1 << 32)


def test_copy_between_raw_addresses():
    src = AlignedBuffer(1 << 20)
    dst = AlignedBuffer(1 << 20)
    np.frombuffer(src, dtype=np.uint8)[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    copy(dst.address + 3, src.address, (1 << 20) - 3)  # large: GIL released
    assert bytes(dst)[3:] == bytes(src)[:-3]
    copy(dst.address, src.address + 100, 10)  # small
    assert bytes(dst)[:10] == bytes(src)[100:110]
    copy(dst.address, 0, 0)  # zero bytes: nothing touched
    with pytest.raises(ValueError):
        copy(dst.address, src.address, -1)
    with pytest.raises(ValueError):
        copy(0, src.address, 1)


def test_aligned_buffer_basics():
    buf = AlignedBuffer(3 * ALIGN + 5)
    assert buf.address % ALIGN == 0
    assert buf.nbytes == len(buf) == 3 * ALIGN + 5
    assert bytes(buf) == bytes(3 * ALIGN + 5)  # zeroed
    arr = np.frombuffer(buf, dtype=np.uint8)
    assert arr.flags.writeable and arr.ctypes.data == buf.address
    arr[:4] = [1, 2, 3, 4]
    assert ctypes.string_at(buf.address, 4) == b"\x01\x02\x03\x04"
    view = memoryview(buf)
    assert (view.format, view.ndim, view.shape, view.readonly) == ("B", 1, (3 * ALIGN + 5,), False)
    assert buf.exports == 2
    with pytest.raises(BufferError, match="live view"):
        buf.close()
    del arr
    view.release()
    buf.close()
    buf.close()
    assert buf.closed
    with pytest.raises(ValueError, match="closed"):
        memoryview(buf)
    with pytest.raises(ValueError, match="closed"):
        buf.address


@pytest.mark.parametrize("align", [512, 4096, 2 << 20])
def test_aligned_buffer_alignment(align):
    with AlignedBuffer(align * 2, align) as buf:
        assert buf.address % align == 0


@pytest.mark.parametrize("nbytes,align", [(0, 4096), (-1, 4096), (4096, 3000), (4096, 2)])
def test_aligned_buffer_rejects_bad_arguments(nbytes, align):
    with pytest.raises(ValueError):
        AlignedBuffer(nbytes, align)


def test_aligned_buffer_as_torch_tensor():
    torch = pytest.importorskip("torch")
    buf = AlignedBuffer(4096)
    t = torch.frombuffer(buf, dtype=torch.float32)
    t[:] = 1.5
    assert np.frombuffer(buf, dtype=np.float32)[0] == 1.5
    assert t.data_ptr() == buf.address


# -- huge pages and views ---------------------------------------------------------------------------
def _vma(address: int) -> tuple[int, int, list[str]]:
    """(start, end, VmFlags) of the mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not line.startswith("VmFlags"):
                lo, _, hi = head.partition("-")
                try:
                    inside = (int(lo, 16), int(hi, 16)) if int(lo, 16) <= address < int(hi, 16) else None
                except ValueError:
                    pass
            elif inside and line.startswith("VmFlags:"):
                return inside[0], inside[1], line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vma_flags(address: int) -> list[str]:
    return _vma(address)[2]


def _thp_configured() -> bool:
    return os.path.exists("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


def test_huge_page_size_reflects_the_kernel():
    if _thp_configured():
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            assert HUGE_PAGE_SIZE == int(f.read())
    else:
        assert HUGE_PAGE_SIZE == 0


@pytest.mark.parametrize("nbytes", [2 << 20, 4 << 20, (5 << 20) + 4096 + 7])
def test_large_buffers_are_huge_page_aligned_and_advised(nbytes):
    with AlignedBuffer(nbytes) as buf:
        assert bytes(memoryview(buf)[-4096:]) == bytes(4096)  # zeroed to the last byte
        np.frombuffer(buf, dtype=np.uint8)[:] = 9  # the whole length is mapped and writable
        if HUGE_PAGE_SIZE:
            assert buf.hugepages and buf.align == HUGE_PAGE_SIZE
            assert buf.address % HUGE_PAGE_SIZE == 0
            assert "hg" in _vma_flags(buf.address)  # MADV_HUGEPAGE recorded on the mapping
        else:
            assert not buf.hugepages and buf.address % ALIGN == 0


NO_ADVICE_CHILD = """
import json
from kvstream_hicache._uring import AlignedBuffer
{vma}
out = []
for buf in (AlignedBuffer(1 << 20), AlignedBuffer(4 << 20, hugepages=False)):
    lo, hi, flags = _vma(buf.address)
    out.append(dict(hugepages=buf.hugepages, align=buf.align, address=buf.address, lo=lo, hi=hi, flags=flags))
print(json.dumps(out))
"""


def test_small_or_opted_out_buffers_take_no_huge_page_advice():
    # In a fresh interpreter: in this one numpy advises its large arrays MADV_HUGEPAGE (numpy >= 1.22,
    # from 4 MiB), malloc hands that memory out again when they are freed, and a buffer can then sit in a
    # mapping someone else advised (the check failed now and then in a full run). In the child nothing
    # else has allocated much: whatever mapping holds a buffer has only our advice, if any.
    code = NO_ADVICE_CHILD.format(vma=inspect.getsource(_vma))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for buf in json.loads(proc.stdout):
        assert not buf["hugepages"] and buf["align"] == ALIGN and buf["address"] % ALIGN == 0, buf
        assert "hg" not in buf["flags"], buf


def test_huge_buffers_are_unmapped_on_close():
    def mapped_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    AlignedBuffer(8 << 20).close()  # warm up allocator state
    before = mapped_kib()
    for _ in range(200):  # 1.6 GiB in all: a leak would show as address space, closed or collected
        AlignedBuffer(8 << 20).close()
        AlignedBuffer(8 << 20)
    assert mapped_kib() - before < 64 << 10


def test_views_share_and_pin_their_parent():
    slab = AlignedBuffer(2 << 20)
    views = [slab.view(i << 19, 1 << 19) for i in range(4)]
    assert [v.address - slab.address for v in views] == [0, 1 << 19, 2 << 19, 3 << 19]
    assert all(v.address % v.align == 0 and v.align >= min(slab.align, 1 << 19) for v in views)
    assert all(v.hugepages == slab.hugepages for v in views)
    np.frombuffer(views[2], dtype=np.uint8)[:] = 5
    assert bytes(memoryview(slab)[2 << 19:(2 << 19) + 3]) == b"\x05\x05\x05"
    assert slab.exports == 4
    with pytest.raises(BufferError, match="live view"):
        slab.close()  # its memory is still in use through the views
    address = views[3].address
    del slab  # the views keep the memory alive
    np.frombuffer(views[3], dtype=np.uint8)[:] = 6
    assert ctypes.string_at(address, 2) == b"\x06\x06"
    for v in views:
        v.close()
        v.close()
        assert v.closed


@pytest.mark.parametrize("offset,nbytes", [(100, 4096), (-4096, 4096), (0, 0), (4096, 8192), (0, 8193)])
def test_views_must_be_aligned_and_inside(offset, nbytes):
    with AlignedBuffer(8192) as buf:
        with pytest.raises(ValueError, match="view"):
            buf.view(offset, nbytes)
        assert buf.exports == 0
