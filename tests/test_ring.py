"""Ring (io_uring) and ThreadRing (fallback): the same integration tests against both engines.

Real files under a disk-backed temporary directory, opened with O_DIRECT. io_uring tests never
skip when io_uring works; with KVSTREAM_REQUIRE_URING=1 (CI) a refused io_uring_setup fails them.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import threading
import time
import weakref

import numpy as np
import pytest

from kvstream_hicache import io as kio
from kvstream_hicache.io import (
    ALIGN, MAX_VECTOR, OP_READ, OP_WRITE, RING_ENTRIES, AlignedBuffer, Ring, ThreadRing, open_ring,
)

from helpers import ENGINES, REQUIRE_URING, io_uring_fds, make_file, make_ring, open_fds, run

KIB = 1024
MIB = 1024 * KIB
@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


@pytest.fixture
def ring(engine):
    r = make_ring(engine)
    yield r
    r.close()


def random_buffer(nbytes: int, seed: int) -> AlignedBuffer:
    buf = AlignedBuffer(nbytes)
    np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


def open_direct(path: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    return os.open(path, flags | os.O_DIRECT, 0o600)


def file_with(directory: str, name: str, data: bytes, flags: int = os.O_RDONLY | os.O_DIRECT) -> int:
    """A new file holding ``data``, opened with ``flags`` (read-only with O_DIRECT by default)."""
    path = os.path.join(directory, name)
    make_file(path, data)
    return os.open(path, flags)


@pytest.fixture
def direct_dir(tier_root):
    """The scratch dir, after checking O_DIRECT works there (it does on ext4/xfs, not older tmpfs)."""
    probe = os.path.join(tier_root, "probe")
    try:
        os.close(open_direct(probe))
    except OSError as exc:
        pytest.fail(f"O_DIRECT unsupported under {tier_root} ({exc}); set KVSTREAM_TEST_DIR to a disk-backed dir")
    return tier_root


def test_uring_available_when_required():
    if not REQUIRE_URING:
        pytest.skip("set KVSTREAM_REQUIRE_URING=1 to demand io_uring")
    with Ring(8) as r:
        assert r.entries == 8  # a power of two: the kernel keeps it


# -- round trips ----------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [4 * KIB, 64 * KIB, 1 * MIB, 8 * MIB])
@pytest.mark.parametrize("offset", [0, 4 * KIB, 1 * MIB + 12 * KIB])
def test_round_trip_sizes_and_offsets(ring, direct_dir, size, offset):
    fd = open_direct(os.path.join(direct_dir, "f"))
    try:
        src = random_buffer(size, seed=size + offset)
        dst = AlignedBuffer(size)
        assert run(ring, [(OP_WRITE, fd, src, offset, 1)]) == {1: size}
        assert run(ring, [(OP_READ, fd, dst, offset, 2)]) == {2: size}
        assert bytes(dst) == bytes(src)
    finally:
        os.close(fd)


def test_queue_depth_beyond_submission_queue(engine, direct_dir):
    """256 ops in one batch on a 64-entry ring: submit-and-continue, every op lands once."""
    depth, chunk = 256, 16 * KIB
    data = os.urandom(depth * chunk)
    fd = file_with(direct_dir, "deep", data)
    with make_ring(engine, entries=64) as ring:
        bufs = [AlignedBuffer(chunk) for _ in range(depth)]
        # reverse file order so completions cannot come back sorted by accident
        res = run(ring, [(OP_READ, fd, bufs[i], i * chunk, 1000 + i) for i in reversed(range(depth))])
    os.close(fd)
    assert res == {1000 + i: chunk for i in range(depth)}
    assert b"".join(bytes(b) for b in bufs) == data


def test_more_ops_in_flight_than_the_completion_queue_holds(engine, tier_root):
    """1000 ops on an 8-entry ring (32 CQ slots): the kernel keeps the overflow, nothing is lost."""
    n, size = 1000, 512
    data = os.urandom(n * size)
    fd = file_with(tier_root, "overflow", data, os.O_RDONLY)
    bufs = [bytearray(size) for _ in range(n)]
    try:
        with make_ring(engine, entries=8) as ring:
            assert run(ring, [(OP_READ, fd, b, i * size, i) for i, b in enumerate(bufs)]) == {i: size for i in range(n)}
    finally:
        os.close(fd)
    assert b"".join(bufs) == data


def test_many_files_at_once(ring, direct_dir):
    nfiles, chunk = 48, 8 * KIB
    fds = [open_direct(os.path.join(direct_dir, f"f{i}")) for i in range(nfiles)]
    try:
        srcs = [random_buffer(2 * chunk, seed=i) for i in range(nfiles)]
        writes = [(OP_WRITE, fd, srcs[i], 0, i) for i, fd in enumerate(fds)]
        assert run(ring, writes) == {i: 2 * chunk for i in range(nfiles)}
        dsts = [AlignedBuffer(chunk) for _ in range(2 * nfiles)]
        reads = [(OP_READ, fds[i // 2], dsts[i], (i % 2) * chunk, i) for i in range(2 * nfiles)]
        assert run(ring, reads) == {i: chunk for i in range(2 * nfiles)}
        for i, dst in enumerate(dsts):
            half = (i % 2) * chunk
            assert bytes(dst) == bytes(srcs[i // 2])[half:half + chunk]
    finally:
        for fd in fds:
            os.close(fd)


def test_raw_address_buffers(ring, direct_dir):
    data = os.urandom(64 * KIB)
    fd = file_with(direct_dir, "raw", data)
    dst = AlignedBuffer(64 * KIB)
    try:
        assert run(ring, [(OP_READ, fd, (dst.address, 32 * KIB), 32 * KIB, 7)]) == {7: 32 * KIB}
        assert bytes(dst)[:32 * KIB] == data[32 * KIB:]
        assert run(ring, [(OP_READ, fd, (dst.address, 0), 0, 8)]) == {8: 0}
    finally:
        os.close(fd)
    dst.close()  # nothing pinned it: raw memory is the caller's business


def test_numpy_buffers(ring, tier_root):
    fd = os.open(os.path.join(tier_root, "np"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        src = np.arange(1000, dtype=np.float32)
        dst = np.zeros(1000, dtype=np.float32)
        assert run(ring, [(OP_WRITE, fd, src, 0, 1)]) == {1: 4000}
        assert run(ring, [(OP_READ, fd, dst, 0, 2)]) == {2: 4000}
        np.testing.assert_array_equal(src, dst)
    finally:
        os.close(fd)


# -- errors, one op at a time ---------------------------------------------------------------------
def test_bad_fd_is_ebadf_for_that_op_only(ring, direct_dir):
    path = os.path.join(direct_dir, "ok")
    make_file(path, b"x" * ALIGN)
    fd = open_direct(path, os.O_RDONLY)
    bad_fd = os.open(path, os.O_RDONLY)
    os.close(bad_fd)  # a number that is certainly not open now
    a, b = AlignedBuffer(ALIGN), AlignedBuffer(ALIGN)
    try:
        assert run(ring, [(OP_READ, bad_fd, a, 0, 1), (OP_READ, fd, b, 0, 2)]) == {1: -errno.EBADF, 2: ALIGN}
        assert bytes(b) == b"x" * ALIGN
    finally:
        os.close(fd)


def test_write_to_read_only_fd_is_ebadf(ring, direct_dir):
    fd = file_with(direct_dir, "ro", b"\0" * ALIGN)
    try:
        assert run(ring, [(OP_WRITE, fd, AlignedBuffer(ALIGN), 0, 1)]) == {1: -errno.EBADF}
    finally:
        os.close(fd)


def test_read_past_end_of_file(ring, direct_dir):
    data = os.urandom(3 * ALIGN)
    fd = file_with(direct_dir, "short", data)
    bufs = [AlignedBuffer(4 * ALIGN) for _ in range(3)]
    try:
        res = run(ring, [(OP_READ, fd, bufs[0], 0, 1),            # straddles EOF: short total
                         (OP_READ, fd, bufs[1], 3 * ALIGN, 2),    # starts at EOF: 0
                         (OP_READ, fd, bufs[2], 64 * ALIGN, 3)])  # far beyond: 0
    finally:
        os.close(fd)
    assert res == {1: 3 * ALIGN, 2: 0, 3: 0}
    assert bytes(bufs[0])[:3 * ALIGN] == data


def test_short_read_at_unaligned_end_of_file(ring, tier_root):
    """A file whose size is not a block multiple: the short total is exact (resubmission finds EOF)."""
    path = os.path.join(tier_root, "odd")
    data = os.urandom(5000)
    make_file(path, data)
    for flags in (os.O_RDONLY, os.O_RDONLY | os.O_DIRECT):
        fd = os.open(path, flags)
        buf = AlignedBuffer(2 * ALIGN)
        try:
            assert run(ring, [(OP_READ, fd, buf, 0, 1)]) == {1: 5000}
        finally:
            os.close(fd)
        assert bytes(buf)[:5000] == data


@pytest.mark.parametrize("case", ["address", "offset", "length"])
def test_unaligned_o_direct_is_einval(ring, direct_dir, case):
    fd = file_with(direct_dir, "al", os.urandom(4 * ALIGN))
    buf = AlignedBuffer(4 * ALIGN)
    view = memoryview(buf)
    target, offset = {
        "address": (view[1:ALIGN + 1], 0),
        "offset": (view[:ALIGN], 1),
        "length": (view[:ALIGN - 1], 0),
    }[case]
    try:
        assert run(ring, [(OP_READ, fd, target, offset, 1)]) == {1: -errno.EINVAL}
    finally:
        os.close(fd)
        target.release()
        view.release()


def test_invalid_batches_are_refused_whole(ring, tier_root):
    fd = file_with(tier_root, "v", b"v" * ALIGN, os.O_RDONLY)
    good = (OP_READ, fd, bytearray(ALIGN), 0, 1)
    many = AlignedBuffer((MAX_VECTOR + 1) * ALIGN)
    ranges = [(many.address + i * ALIGN, ALIGN) for i in range(MAX_VECTOR + 1)]
    try:
        with pytest.raises(ValueError, match="opcode"):
            ring.submit([good, (99, fd, bytearray(8), 0, 2)])
        with pytest.raises(ValueError, match="already in flight"):
            ring.submit([good, (OP_READ, fd, bytearray(8), 0, 1)])
        with pytest.raises(BufferError):
            ring.submit([good, (OP_READ, fd, b"read-only bytes", 0, 2)])
        with pytest.raises(TypeError):
            ring.submit([good, (OP_READ, fd, bytearray(8), 0)])
        with pytest.raises(ValueError, match="offset"):
            ring.submit([good, (OP_READ, fd, bytearray(8), -4096, 2)])
        with pytest.raises(TypeError):
            ring.submit([good, (OP_READ, "not an fd", bytearray(8), 0, 2)])
        with pytest.raises((BufferError, ValueError)):  # non-contiguous (numpy says ValueError)
            ring.submit([good, (OP_READ, fd, np.zeros((4, 4), dtype=np.uint8)[:, 0], 0, 2)])
        for bad in ([], ranges):  # the kernel's UIO_MAXIOV, refused alike by both engines
            with pytest.raises(ValueError, match=f"1..{MAX_VECTOR} "):
                ring.submit([good, (OP_READ, fd, bad, 0, 2)])
        assert ring.in_flight == 0
        assert run(ring, [good]) == {1: ALIGN}  # the rejected batches left nothing behind (tag 1 is free)
        assert run(ring, [(OP_WRITE, fd, b"bytes are fine for writes", 0, 2)]) == {2: -errno.EBADF}
        assert run(ring, [(OP_READ, fd, ranges[:MAX_VECTOR], 0, 3)]) == {3: ALIGN}  # (the file's one block)
    finally:
        many.close()
        os.close(fd)


def test_short_transfers_are_completed(engine, ring, monkeypatch, tier_root):
    """Short transfers are resubmitted for the remainder until the op is whole."""
    payload = os.urandom(200)
    if engine == "uring":
        # A pipe read returns what is there: the read is armed before any data arrives, so the first
        # completion covers the first write only and the ring must resubmit for the rest.
        r, w = os.pipe()
        try:
            buf = bytearray(200)
            ring.submit([(OP_READ, r, buf, 0, 1)])
            os.write(w, payload[:100])
            assert ring.reap(1, timeout=0) in ([], [(1, 200)])  # nothing can be complete with half the data
            os.write(w, payload[100:])
            assert ring.reap(1) == [(1, 200)]
            assert bytes(buf) == payload
        finally:
            os.close(r)
            os.close(w)
    else:
        path = os.path.join(tier_root, "chunks")
        make_file(path, payload)
        real = os.preadv
        calls = []

        def at_most_30_bytes(fd, bufs, offset):
            calls.append(offset)
            return real(fd, [memoryview(bufs[0])[:30]], offset)

        monkeypatch.setattr(os, "preadv", at_most_30_bytes)
        fd = os.open(path, os.O_RDONLY)
        buf = bytearray(200)
        try:
            assert run(ring, [(OP_READ, fd, buf, 0, 1)]) == {1: 200}
        finally:
            os.close(fd)
        assert bytes(buf) == payload
        assert calls == list(range(0, 200, 30))


# -- lifetime -------------------------------------------------------------------------------------
class Tracked(bytearray):
    """A bytearray that supports weak references, to see when the ring lets go of it."""


def test_buffers_stay_alive_until_reaped(ring, tier_root):
    data = os.urandom(64 * KIB)
    path = os.path.join(tier_root, "alive")
    make_file(path, data)
    fd = os.open(path, os.O_RDWR)
    try:
        buf = Tracked(64 * KIB)
        ref = weakref.ref(buf)
        ring.submit([(OP_READ, fd, buf, 0, 1)])
        del buf  # the ring holds the only reference now
        gc.collect()
        garbage = [bytearray(64 * KIB) for _ in range(16)]  # reuse freed memory if it had been freed
        assert ref() is not None
        assert ring.reap(1) == [(1, 64 * KIB)]
        assert ref() is None  # released on reap
        del garbage

        src = Tracked(data[::-1])
        ring.submit([(OP_WRITE, fd, src, 0, 2)])
        del src
        gc.collect()
        garbage = [bytearray(64 * KIB) for _ in range(16)]
        assert ring.reap(1) == [(2, 64 * KIB)]
        with open(path, "rb") as f:
            assert f.read() == data[::-1]
    finally:
        os.close(fd)


def test_round_trip_through_views_of_one_slab(ring, direct_dir):
    """Staging carves 1 MiB blocks out of one huge-page slab: each view is its own O_DIRECT buffer."""
    data = os.urandom(4 * MIB)
    fd = file_with(direct_dir, "slab", data)
    slab = AlignedBuffer(2 * MIB)
    views = [slab.view(i * 512 * KIB, 512 * KIB) for i in range(4)]
    try:
        # scattered file offsets, so a view that aliased its neighbour would show
        offsets = [3 * MIB, 0, 2 * MIB + 512 * KIB, 1 * MIB]
        out = run(ring, [(OP_READ, fd, v, off, i) for i, (v, off) in enumerate(zip(views, offsets))])
        assert out == {i: 512 * KIB for i in range(4)}
        for v, off in zip(views, offsets):
            assert bytes(v) == data[off:off + 512 * KIB]
        with pytest.raises(BufferError):
            slab.close()
    finally:
        os.close(fd)
        for v in views:
            v.close()
        slab.close()


def test_aligned_buffer_pinned_while_in_flight(engine, tier_root):
    fd = file_with(tier_root, "pin", b"p" * ALIGN, os.O_RDONLY)
    buf = AlignedBuffer(ALIGN)
    with make_ring(engine) as ring:
        ring.submit([(OP_READ, fd, buf, 0, 1)])
        with pytest.raises(BufferError):
            buf.close()
        ring.reap(1)
    os.close(fd)
    buf.close()
    buf.close()


def test_close_drains_idempotent_and_refuses_use(engine, tier_root):
    fd = file_with(tier_root, "drain", os.urandom(256 * KIB), os.O_RDONLY)
    ring = make_ring(engine)
    bufs = [AlignedBuffer(ALIGN) for _ in range(64)]
    ring.submit([(OP_READ, fd, b, i * ALIGN, i) for i, b in enumerate(bufs)])
    ring.close()  # without reaping: waits for the kernel to finish with every buffer
    ring.close()
    assert ring.closed
    for b in bufs:
        b.close()  # nothing is pinned any more
    with pytest.raises(ValueError, match="closed"):
        ring.submit([(OP_READ, fd, bytearray(8), 0, 1)])
    with pytest.raises(ValueError, match="closed"):
        ring.reap()
    os.close(fd)


def test_reap_with_nothing_in_flight_returns_at_once(ring):
    assert ring.reap() == []
    assert ring.reap(100, timeout=None) == []


def test_unclosed_ring_warns(engine):
    ring = make_ring(engine)
    with pytest.warns(ResourceWarning):
        del ring
        gc.collect()


# -- io_uring specifics ---------------------------------------------------------------------------
@pytest.fixture
def uring():
    r = make_ring("uring")
    yield r
    r.close()


def test_reap_timeout_returns_fewer(uring, tier_root):
    r, w = os.pipe()
    fd = file_with(tier_root, "t", b"t" * ALIGN, os.O_RDONLY)
    try:
        uring.submit([(OP_READ, r, bytearray(10), 0, 1), (OP_READ, fd, bytearray(ALIGN), 0, 2)])
        got = uring.reap(2, timeout=0.05)  # the pipe read cannot finish: we get the file read only
        while not got:
            got = uring.reap(1, timeout=0.05)
        assert got == [(2, ALIGN)]
        assert uring.reap(1, timeout=0) == []
        assert uring.in_flight == 1
        os.write(w, b"0123456789")
        assert uring.reap(1) == [(1, 10)]
    finally:
        os.close(fd)
        os.close(r)
        os.close(w)


def test_close_cancels_an_op_that_would_never_complete():
    r, w = os.pipe()
    ring = make_ring("uring")
    buf = Tracked(10)
    ref = weakref.ref(buf)
    ring.submit([(OP_READ, r, buf, 0, 1)])
    del buf
    ring.close()  # cancels the pipe read, then drains: returns
    gc.collect()
    assert ref() is None
    os.close(r)
    os.close(w)


def test_separate_rings_do_not_block_each_other(tier_root):
    """A read ring stuck on a slow op never stalls a write ring: nothing is shared between rings."""
    r, w = os.pipe()
    path = os.path.join(tier_root, "sep")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    reads, writes = make_ring("uring"), make_ring("uring")
    try:
        reads.submit([(OP_READ, r, bytearray(4), 0, 1)])
        for i in range(10):
            assert run(writes, [(OP_WRITE, fd, b"w" * ALIGN, i * ALIGN, 1)]) == {1: ALIGN}
        assert reads.reap(1, timeout=0) == []
        os.write(w, b"done")
        assert reads.reap(1) == [(1, 4)]
    finally:
        reads.close()
        writes.close()
        os.close(fd)
        os.close(r)
        os.close(w)


def test_submit_while_another_thread_waits_in_reap(uring, tier_root):
    import threading

    r, w = os.pipe()
    fd = file_with(tier_root, "conc", b"c" * ALIGN, os.O_RDONLY)
    got = []
    try:
        uring.submit([(OP_READ, r, bytearray(4), 0, 1)])  # cannot complete until we write the pipe
        reaper = threading.Thread(target=lambda: got.extend(uring.reap(1)))
        reaper.start()
        uring.submit([(OP_READ, fd, bytearray(ALIGN), 0, 2)])  # wakes the reaper
        reaper.join()
        assert got == [(2, ALIGN)]
        os.write(w, b"done")
        assert uring.reap(1) == [(1, 4)]
    finally:
        os.close(fd)
        os.close(r)
        os.close(w)


def test_completions_are_cooperative_where_the_kernel_has_it():
    """The default ring takes COOP_TASKRUN (Linux 5.19+: every kernel CI runs on); it can be refused."""
    with make_ring("uring") as ring, make_ring("uring", cooperative=False) as plain:
        major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
        if (major, minor) >= (5, 19):  # (an older version string may carry it backported)
            assert ring.cooperative
        assert not plain.cooperative


def test_a_batch_io_uring_submit_refused_stays_in_flight(direct_dir):
    """io_uring_submit failing hard once submit has accepted a batch (here the ring's descriptor is
    closed under it, as a library closing descriptors it does not own would: EBADF) does not make
    submit raise: a caller told the batch failed frees its memory, and the ops, still queued on the
    ring, would reach the kernel at the next io_uring_enter and land in it (the old behaviour: the
    submit raised and the op completed later anyway). The op stays in flight, the error surfaces at
    reap while it lasts, and once the ring works again the op lands in the caller's buffer."""
    before = io_uring_fds()
    ring = make_ring("uring")
    (ring_fd,) = io_uring_fds() - before
    data = np.random.default_rng(3).integers(0, 256, 4 * ALIGN, dtype=np.uint8).tobytes()
    fd = file_with(direct_dir, "page", data)
    buf = AlignedBuffer(len(data))
    saved = os.dup(ring_fd)
    try:
        os.close(ring_fd)
        assert ring.submit([(OP_READ, fd, buf, 0, 7)]) == 1
        assert ring.in_flight == 1 and ring.submit_error.errno == errno.EBADF
        with pytest.raises(OSError) as refused:
            ring.reap(1, 1.0)
        assert refused.value.errno == errno.EBADF and ring.in_flight == 1
        os.dup2(saved, ring_fd)  # the ring works again: the queued op goes out at the next flush
        assert ring.reap(1, 10.0) == [(7, len(data))]
        assert bytes(buf) == data
    finally:
        os.dup2(saved, ring_fd)
        os.close(saved)
        ring.close()
        os.close(fd)


@contextlib.contextmanager
def _reaching_another_ring():
    """A ring whose descriptor reaches another ring (dup2 over it): its io_uring_submit takes nothing
    (the other ring's queue is empty), as with a kernel that refuses every submit. Yields (ring, the
    other ring, a function that points the descriptor back at the ring's own, a pipe's read and write
    ends); all closed at the end."""
    before = io_uring_fds()
    ring = make_ring("uring")
    (ring_fd,) = io_uring_fds() - before
    other = make_ring("uring")
    (other_fd,) = io_uring_fds() - before - {ring_fd}
    r, w = os.pipe()
    saved = os.dup(ring_fd)
    try:
        os.dup2(other_fd, ring_fd)
        yield ring, other, lambda: os.dup2(saved, ring_fd), r, w
    finally:
        ring.close()
        other.close()
        os.close(saved)
        os.close(r)
        os.close(w)


def test_close_does_not_wait_for_what_the_kernel_never_took():
    """A ring whose descriptor now reaches another ring: a wait there never ends. close() waited for
    the queued op for ever; it waits only for what the kernel took, and returns (the op, never taken,
    never runs)."""
    buf = AlignedBuffer(ALIGN)
    with _reaching_another_ring() as (ring, other, _restore, r, w):
        assert ring.submit([(OP_READ, r, buf, 0, 1)]) == 1  # taken by no ring
        closer = threading.Thread(target=ring.close, daemon=True)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close() waited for an op the kernel never took"
        os.write(w, b"x" * 16)
        assert other.reap(0, 0) == [] and bytes(buf) == bytes(ALIGN)  # nobody ran it


@pytest.mark.parametrize("passing", [True, False], ids=["passing", "lasting"])
def test_a_kernel_that_takes_nothing_for_a_moment_is_offered_the_ops_again(passing):
    """The kernel takes none of the queued SQEs (here the ring's descriptor reaches another ring; a
    memory-pressured kernel answers EAGAIN): reap offers them again after growing pauses. A passing
    refusal costs that pause, and the op lands (before: reap raised EAGAIN at once, and the engine
    gave up the call and replaced the ring, pinning a registered host pool again); a lasting one
    raises EAGAIN after NO_PROGRESS_S (0.1 s), for the owner to replace the ring."""
    buf = AlignedBuffer(ALIGN)
    with _reaching_another_ring() as (ring, other, restore, r, w):
        os.write(w, b"x" * 16)
        assert ring.submit([(OP_READ, r, (buf.address, 16), 0, 1)]) == 1  # taken by no ring
        if passing:
            timer = threading.Timer(0.02, restore)
            timer.start()
            assert ring.reap(1, 10.0) == [(1, 16)] and bytes(buf)[:16] == b"x" * 16
            timer.join()
        else:
            with pytest.raises(BlockingIOError):
                ring.reap(1, 10.0)
            restore()  # (back: close() cancels and ends the op)


@pytest.mark.parametrize("queued", [True, False], ids=["queued then refused", "refused"])
def test_a_batch_the_thread_pool_refuses_still_runs_each_op_once(direct_dir, monkeypatch, queued):
    """ThreadRing, the same contract: the pool refusing an op after submit accepted the batch (no
    thread could be started, when the work item is queued all the same; the interpreter shutting
    down, when it is not) does not make submit raise. The op runs on the submitting thread, and
    once only. (Before: submit raised, and the queued op ran later into freed memory.)"""
    ring = make_ring("threads")
    data = np.random.default_rng(4).integers(0, 256, 2 * ALIGN, dtype=np.uint8).tobytes()
    fd = file_with(direct_dir, "page", data)
    bufs = [AlignedBuffer(len(data)) for _ in range(3)]
    pool_submit = ring._pool.submit
    calls = []

    def refusing(fn, *args):
        calls.append(args)
        if len(calls) == 2:  # the batch's second op
            if queued:
                pool_submit(fn, *args)
            raise RuntimeError("can't start new thread")
        return pool_submit(fn, *args)

    monkeypatch.setattr(ring._pool, "submit", refusing)
    try:
        assert ring.submit([(OP_READ, fd, buf, 0, tag) for tag, buf in enumerate(bufs)]) == 3
        done = []
        while len(done) < 3:
            done += ring.reap(1, 10.0)
        assert sorted(done) == [(tag, len(data)) for tag in range(3)] and ring.in_flight == 0
        assert all(bytes(buf) == data for buf in bufs)
        time.sleep(0.05)
        assert ring.reap(0, 0) == []  # the queued copy of the refused op did not run a second time
    finally:
        ring.close()
        os.close(fd)


@pytest.mark.parametrize("cooperative", [True, False], ids=["cooperative", "interrupting"])
@pytest.mark.parametrize("submitter", ["asleep", "computing"])
def test_a_thread_reaps_what_another_submitted(cooperative, submitter):
    """One thread submits, another reaps (the read path's orphans, reaped by the next get of whatever
    thread). A cooperative ring posts a completion when its submitter next enters the kernel: one
    asleep in an interruptible wait (a lock, an event) is woken for it, one computing in Python
    enters at its next interrupt or GIL hand-off. The completion must arrive either way (30 s is
    not a bound on the time, only a limit on a hang)."""
    import threading

    r, w = os.pipe()  # a pipe read completes later, through the submitter's task work
    stop = threading.Event()
    submitted = threading.Event()
    ring = make_ring("uring", cooperative=cooperative)

    def submit_then(work):
        ring.submit([(OP_READ, r, bytearray(4), 0, 1)])
        submitted.set()
        work()

    def compute():
        n = 0
        while not stop.is_set():
            n += sum(range(100))

    thread = threading.Thread(target=submit_then, args=(stop.wait if submitter == "asleep" else compute,))
    try:
        thread.start()
        assert submitted.wait(30)
        os.write(w, b"done")
        got = ring.reap(1, timeout=30)
        assert got == [(1, 4)]
    finally:
        stop.set()
        thread.join()
        ring.close()
        os.close(r)
        os.close(w)


def test_signal_interrupts_reap_and_loses_nothing(uring, tier_root):
    import signal

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    r, w = os.pipe()
    old = signal.signal(signal.SIGALRM, handler)
    try:
        uring.submit([(OP_READ, r, bytearray(4), 0, 1)])
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted):
            uring.reap(1)  # blocks (GIL released) until the signal: EINTR -> handler runs -> raises
        assert uring.in_flight == 1
        os.write(w, b"late")
        assert uring.reap(1) == [(1, 4)]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(r)
        os.close(w)


# -- leaks ----------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_fd_or_memory_leaks_across_thousands_of_batches(engine, direct_dir):
    batches, per_batch = 2000, 8
    fd = file_with(direct_dir, "leak", os.urandom(per_batch * ALIGN), os.O_RDWR | os.O_DIRECT)
    bufs = [AlignedBuffer(ALIGN) for _ in range(per_batch)]
    ops = [(OP_READ, fd, b, i * ALIGN, i) for i, b in enumerate(bufs)]
    bad = [(OP_READ, -1, bytearray(8), 0, 100)]  # error completions must free their slots too

    def cycle(n):
        with make_ring(engine, entries=16) as ring:
            for _ in range(n):
                ring.submit(ops + bad)
                got = 0
                while got < per_batch + 1:
                    got += len(ring.reap(per_batch + 1 - got))

    cycle(100)  # warm-up: allocator pools, thread stacks, slot blocks
    for _ in range(20):
        with make_ring(engine, entries=8):
            pass
    gc.collect()
    fds, rss = open_fds(), _rss_bytes()
    cycle(batches)
    for _ in range(200):  # ring setup/teardown: ring fds and mmaps must go too
        with make_ring(engine, entries=8):
            pass
    gc.collect()
    os.close(fd)
    assert open_fds() == fds - 1
    growth = _rss_bytes() - rss
    assert growth < 8 * MIB, f"RSS grew {growth / MIB:.1f} MiB over {batches} batches"
    assert all(b.exports == 0 for b in bufs)
