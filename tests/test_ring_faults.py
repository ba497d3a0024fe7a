"""open_ring's engine choice and the FaultyRing fault hook (over both engines)."""
from __future__ import annotations

import errno
import logging
import os
import time

import pytest

from kvstream_hicache import io as kio
from kvstream_hicache.faults import Fault, FaultPlan, FaultyRing
from kvstream_hicache.io import ALIGN, OP_READ, OP_WRITE, AlignedBuffer, Ring, ThreadRing, open_ring

from helpers import ENGINES, make_file, make_ring, run  # tests/ is on sys.path (rootdir conftest)


# -- open_ring ------------------------------------------------------------------------------------
def test_open_ring_forced_threads():
    with open_ring(16, engine="threads") as ring:
        assert isinstance(ring, ThreadRing)


def test_open_ring_forced_uring():
    ring = None
    try:
        ring = open_ring(16, engine="uring")
    except OSError:
        make_ring("uring")  # fails under KVSTREAM_REQUIRE_URING=1, else skips
    assert isinstance(ring, Ring)
    ring.close()


def test_open_ring_reads_no_environment(monkeypatch):
    """The engine is the io_engine setting, decided once by Config: the variable means nothing here."""
    monkeypatch.setenv("KVSTREAM_IO_ENGINE", "spdk")  # refused, were it read
    with open_ring(16, engine="threads") as ring:
        assert isinstance(ring, ThreadRing)
    open_ring(16).close()  # 'auto'


def test_open_ring_rejects_unknown_engine():
    with pytest.raises(ValueError, match="'spdk'.*KVSTREAM_IO_ENGINE"):
        open_ring(engine="spdk")


def _refuse(entries=256):
    raise OSError(errno.EPERM, "io_uring_setup(entries=256) refused: Operation not permitted")


def test_open_ring_auto_falls_back_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(kio, "Ring", _refuse)
    with caplog.at_level(logging.INFO, logger="kvstream"):
        ring = open_ring(8)
    ring.close()
    assert isinstance(ring, ThreadRing)
    records = [r for r in caplog.records if r.name == "kvstream"]
    assert len(records) == 1
    assert "io_uring" in records[0].getMessage() and "Operation not permitted" in records[0].getMessage()


def test_open_ring_forced_uring_refused_raises(monkeypatch):
    monkeypatch.setattr(kio, "Ring", _refuse)
    with pytest.raises(OSError):
        open_ring(8, engine="uring")


# -- FaultyRing -----------------------------------------------------------------------------------
@pytest.fixture(params=ENGINES)
def setup(request, tier_root):
    """(ring wrapped by a FaultyRing, its plan, an fd on a 4-block file, the file's bytes, path)."""
    path = os.path.join(tier_root, "faults")
    data = os.urandom(4 * ALIGN)
    make_file(path, data)
    fd = os.open(path, os.O_RDWR)
    plan = FaultPlan()
    ring = FaultyRing(make_ring(request.param), plan)
    yield ring, plan, fd, data, path
    ring.close()
    os.close(fd)


def test_fault_error_does_no_io(setup):
    ring, plan, fd, data, path = setup
    plan.add(Fault.error(errno.EIO), opcode=OP_WRITE)
    src = b"\xee" * ALIGN
    dst = bytearray(ALIGN)
    assert run(ring, [(OP_WRITE, fd, src, 0, 1), (OP_READ, fd, dst, ALIGN, 2)]) == {1: -errno.EIO, 2: ALIGN}
    with open(path, "rb") as f:
        assert f.read() == data  # the failed write never happened
    assert bytes(dst) == data[ALIGN:2 * ALIGN]
    assert len(plan.hits) == 1


def test_fault_hold_until_release(setup):
    ring, plan, fd, data, _ = setup
    plan.add(Fault.hold(), offset=0, times=1)
    held, free = bytearray(ALIGN), bytearray(ALIGN)
    ring.submit([(OP_READ, fd, held, 0, 1), (OP_READ, fd, free, ALIGN, 2)])
    got = []
    while ring.in_flight > 1:
        got += ring.reap(1)
    assert got == [(2, ALIGN)]
    assert ring.reap(1, timeout=0.02) == []  # still held: no release yet
    plan.release()
    assert ring.reap(1) == [(1, ALIGN)]
    assert bytes(held) == data[:ALIGN]  # the I/O itself happened
    assert ring.in_flight == 0


def test_fault_hold_released_from_another_thread(setup):
    import threading

    ring, plan, fd, data, _ = setup
    plan.add(Fault.hold())
    ring.submit([(OP_READ, fd, bytearray(ALIGN), 0, 1)])
    releaser = threading.Timer(0.05, plan.release)
    releaser.start()
    assert ring.reap(1) == [(1, ALIGN)]  # blocks until the release
    releaser.join()


def test_fault_delay(setup):
    ring, plan, fd, _, _ = setup
    plan.add(Fault.delay(0.1))
    start = time.monotonic()
    assert run(ring, [(OP_READ, fd, bytearray(ALIGN), 0, 1)]) == {1: ALIGN}
    assert time.monotonic() - start >= 0.1  # a lower bound only: completions are never early


def test_fault_corrupt_read_flips_one_bit(setup):
    ring, plan, fd, data, _ = setup
    plan.add(Fault.corrupt(), offset=ALIGN)
    a, b = bytearray(ALIGN), bytearray(ALIGN)
    assert run(ring, [(OP_READ, fd, a, 0, 1), (OP_READ, fd, b, ALIGN, 2)]) == {1: ALIGN, 2: ALIGN}
    assert bytes(a) == data[:ALIGN]
    diff = [(i, x ^ y) for i, (x, y) in enumerate(zip(b, data[ALIGN:2 * ALIGN])) if x != y]
    assert len(diff) == 1 and bin(diff[0][1]).count("1") == 1


def test_fault_corrupt_write_reaches_the_medium_only(setup):
    ring, plan, fd, data, path = setup
    plan.add(Fault.corrupt(bit=9))
    src = AlignedBuffer(ALIGN)
    memoryview(src)[:] = b"\x00" * ALIGN
    assert run(ring, [(OP_WRITE, fd, src, 0, 1)]) == {1: ALIGN}
    assert bytes(src) == bytes(ALIGN)  # the caller's buffer is restored
    with open(path, "rb") as f:
        assert f.read(2) == b"\x00\x02"  # bit 9 = byte 1, bit 1


def test_fault_plan_rules_match_in_order_and_count(setup):
    ring, plan, fd, _, _ = setup
    plan.add(Fault.error(errno.ENOSPC), opcode=OP_WRITE, times=2).add(Fault.error(errno.EIO), fd=fd)
    res = run(ring, [(OP_WRITE, fd, b"x" * 10, i * 10, i) for i in range(3)])
    assert res == {0: -errno.ENOSPC, 1: -errno.ENOSPC, 2: -errno.EIO}


def test_faulty_ring_passes_clean_ops_untouched(setup):
    ring, _, fd, data, _ = setup
    bufs = [bytearray(ALIGN) for _ in range(4)]
    assert run(ring, [(OP_READ, fd, b, i * ALIGN, i) for i, b in enumerate(bufs)]) == {i: ALIGN for i in range(4)}
    assert b"".join(bufs) == data
