"""The in-flight core (inflight.py) over a real io_uring ring, and the read descriptor cache (files.py)."""
from __future__ import annotations

import errno
import os

import pytest

from kvstream_hicache import files
from kvstream_hicache.files import ReadFile, ReadFiles, Shortage
from kvstream_hicache.inflight import InFlight
from kvstream_hicache.io import OP_READ, AlignedBuffer, open_ring

from helpers import io_uring_fds, messages


class Req:
    def __init__(self, tier: int, nbytes: int):
        self.tier, self.nbytes = tier, nbytes


@pytest.fixture
def data_file(tier_root):
    path = os.path.join(tier_root, "data")
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 16))
    fd = os.open(path, os.O_RDONLY)
    yield fd
    os.close(fd)


@pytest.fixture(params=["uring", "threads"])
def core(request):
    ring = open_ring(engine=request.param)
    core = InFlight(ring, 2, 4096, 1 << 20, lambda: open_ring(engine=request.param), "read")
    yield core
    core.ring.close()


def test_a_completion_leaves_the_accounting(core, data_file):
    buf = AlignedBuffer(8192)
    reqs = [Req(0, 4096), Req(1, 4096)]
    for i, req in enumerate(reqs):
        core.add(req, OP_READ, data_file, (buf.address + 4096 * i, 4096), 0, now=1.0)
    assert core.bytes == [4096, 4096] and reqs[1].ahead == 0 and len(core) == 2
    core.submit()
    done = []
    while len(done) < 2:
        done += core.reap(1, 5.0)
    assert sorted(res for _, res in done) == [4096, 4096] and {id(r) for r, _ in done} == {id(r) for r in reqs}
    assert core.bytes == [0, 0] and len(core) == 0 and core.busy.in_flight == [0, 0]
    buf.close()


def test_a_refused_batch_leaves_nothing_in_flight(core, data_file):
    """The ring validates a batch before queueing any of it: every request of the batch is undone."""
    buf = AlignedBuffer(4096)
    core.add(Req(0, 4096), OP_READ, data_file, (buf.address, 4096), 0, now=1.0)
    core.add(Req(1, 4096), OP_READ, data_file, [], 0, now=1.0)  # an empty vector: refused
    with pytest.raises(ValueError):
        core.submit()
    assert len(core) == 0 and core.bytes == [0, 0] and core.busy.in_flight == [0, 0]
    assert core.ring.in_flight == 0
    core.submit()  # nothing left over from the refused batch
    buf.close()


def test_orphans_count_against_their_tier_until_reaped(core, data_file):
    buf = AlignedBuffer(4096)
    req = Req(1, 4096)
    core.add(req, OP_READ, data_file, (buf.address, 4096), 0, now=1.0)
    core.submit()
    core.orphan([req])
    core.orphan([req])  # (once)
    assert core.orphans == 1 and core.orphaned == [0, 4096]
    done = []
    while not done:
        done = core.reap(1, 5.0)
    assert core.orphans == 0 and core.orphaned == [0, 0]
    buf.close()


@pytest.mark.parametrize("reopens", [True, False])
def test_a_failed_ring_is_replaced_and_its_requests_given_up(data_file, caplog, reopens):
    """A reap that fails (the ring's descriptor now /dev/null: EOPNOTSUPP) marks the core ``failed``;
    ``replace`` closes the ring, hands back every request (the accounting cleared) and goes on with
    a new ring, or, where none opens, keeps the closed one and says so."""
    def reopen():
        if not reopens:
            raise OSError(errno.EMFILE, "Too many open files")
        return open_ring(engine="uring")

    before = io_uring_fds()
    core = InFlight(open_ring(engine="uring"), 2, 4096, 1 << 20, reopen, "read")
    (fd,) = io_uring_fds() - before
    old = core.ring
    buf = AlignedBuffer(8192)
    reqs = [Req(0, 4096), Req(1, 4096)]
    for i, req in enumerate(reqs):
        core.add(req, OP_READ, data_file, (buf.address + 4096 * i, 4096), 0, now=1.0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, fd)
    os.close(null)
    core.submit()  # (accepted: the kernel's refusal surfaces at the reap)
    with pytest.raises(OSError):
        core.reap(1, 5.0)
    assert isinstance(core.failed, OSError)
    assert {id(r) for r in core.replace()} == {id(r) for r in reqs}
    assert core.failed is None and len(core) == 0 and core.bytes == [0, 0] and core.busy.in_flight == [0, 0]
    assert old.closed and core.ring.closed is not reopens
    assert messages(caplog, "the read ring failed", "go on on a new ring" if reopens else "no new one opens")
    if reopens:
        core.add(reqs[0], OP_READ, data_file, (buf.address, 4096), 0, now=2.0)
        core.submit()
        assert core.reap(1, 5.0) == [(reqs[0], 4096)]
        core.ring.close()
    buf.close()


def test_out_of_descriptors_a_read_closes_its_idle_ones_and_opens_again(tier_root):
    cache = ReadFiles()
    call = {(0, p): ReadFile(0, f"k{p}") for p in range(3)}
    path = os.path.join(tier_root, "page")
    open(path, "wb").close()
    for f in list(call.values())[:2]:
        cache.open_file(f, call, lambda: os.open(path, os.O_RDONLY))
    call[(0, 0)].refs = 1  # in use: stays open
    tries = []

    def opener() -> int:
        tries.append(1)
        if len(tries) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return os.open(path, os.O_RDONLY)

    cache.open_file(call[(0, 2)], call, opener)
    assert len(tries) == 2 and call[(0, 1)].fd is None and call[(0, 0)].fd is not None
    assert cache.open == 2 and cache.peak == 2
    with pytest.raises(OSError):  # nothing idle left to close: the open's error
        cache.open_file(ReadFile(0, "k"), {(0, 0): call[(0, 0)]}, lambda: (_ for _ in ()).throw(
            OSError(errno.EMFILE, "Too many open files")))
    cache.release(call)  # the call ended: idle ones close, the one in use when its request ends
    assert cache.open == 1
    cache.drop(call[(0, 0)])
    assert cache.open == 0


def test_an_idle_descriptor_closes_early_only_past_the_cap(tier_root, monkeypatch):
    monkeypatch.setattr(files, "READ_FILES_HELD", 1)
    cache = ReadFiles()
    path = os.path.join(tier_root, "page")
    open(path, "wb").close()
    a, b = ReadFile(0, "a"), ReadFile(0, "b")
    call = {(0, 0): a, (0, 1): b}
    for f in (a, b):
        cache.open_file(f, call, lambda: os.open(path, os.O_RDONLY))
        f.refs = 1
    cache.drop(a)  # 2 open > 1: closes
    assert a.fd is None and cache.open == 1
    cache.drop(b)  # 1 open: stays until the call ends
    assert b.fd is not None
    cache.release(call)
    assert cache.open == 0


def test_writes_wait_for_their_own_files_then_retry_then_give_up():
    fds = Shortage()
    assert fds.hit(ours_open=True, now=0.0) and fds.blocked(0.0)
    fds.closed()
    assert not fds.blocked(0.0)
    assert fds.hit(ours_open=False, now=1.0) and fds.blocked(1.0) and not fds.blocked(1.0 + files.FD_RETRY_S)
    assert not fds.hit(ours_open=False, now=1.0 + files.FD_GIVE_UP_S)  # given up
    assert not fds.hit(ours_open=False, now=2.0 + files.FD_GIVE_UP_S)  # ... and every next one at once
    fds.created()
    assert fds.hit(ours_open=False, now=3.0 + files.FD_GIVE_UP_S)
