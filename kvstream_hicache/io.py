"""I/O engines: the io_uring ``Ring`` and its thread-pool fallback (fault injection: faults.py).

Every engine has the same batch interface (see ``kvstream_hicache._uring.Ring``)::

    ring.submit([(OP_READ, fd, buf, offset, tag), ...]) -> int     # ops accepted (raises: none was)
    ring.reap(min_complete=1, timeout=None) -> [(tag, res), ...]   # res: bytes done, or -errno
    ring.in_flight                                                 # submitted, not yet reaped
    ring.close()                                                   # idempotent; drains first

``buf`` is a buffer-protocol object (kept referenced until reaped), an ``(address, length)``
tuple of raw memory, or a list of up to ``MAX_VECTOR`` such tuples: one vectored op (readv/writev)
over several pieces of memory (the caller keeps raw memory alive until reaped). Short transfers are completed
internally; ``res`` is short only at end of file, or when an error followed partial progress
(``read(2)`` semantics: the partial count is reported, the error would surface on the next op).

``open_ring(engine=...)`` opens the engine the ``io_engine`` setting names (``Config`` decides it,
``KVSTREAM_IO_ENGINE`` among its sources): 'auto' is io_uring when the kernel allows it, else the
thread pool, with one log line saying why; 'uring' and 'threads' force the choice.
"""
from __future__ import annotations

import errno as _errno
import logging
import operator
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

# The extension is required: a missing build is an install error, not something to paper over.
from ._uring import (
    ALIGN, CRC32C_IMPL, HUGE_PAGE_SIZE, MAX_VECTOR, OP_READ, OP_WRITE, RING_ENTRIES, AlignedBuffer, PageMap, Ring,
    copy, crc32c, forks, open_owned,
)
from .locks import ranked_condition

__all__ = [
    "ALIGN", "HUGE_PAGE_SIZE", "MAX_VECTOR", "OP_READ", "OP_WRITE", "RING_ENTRIES", "AlignedBuffer", "Ring",
    "ThreadRing",
    "open_owned", "open_ring", "byte_view", "Vector", "crc32c", "copy", "CRC32C_IMPL", "ENGINES", "PageMap", "forks",
]

log = logging.getLogger("kvstream")

ENGINES = ("uring", "threads", "auto")
SETTING = "KVSTREAM_IO_ENGINE"  # the setting that picks the engine (config.py decides it; named in messages)
MAX_THREADS = 64  # ThreadRing worker cap: one blocked thread per op in flight; past this, deeper queues
# buy little on one device and each thread costs a stack


def memlock_hint(exc: OSError) -> str:
    """What to do when io_uring refuses for memory (a ring's queues, or memory registered with it, count
    against the locked-memory limit of a user without CAP_IPC_LOCK); empty for another refusal."""
    return (" (raise the memlock limit: ulimit -l, LimitMEMLOCK=, or run with CAP_IPC_LOCK)"
            if exc.errno == _errno.ENOMEM else "")


def open_ring(entries: int = RING_ENTRIES, engine: str = "auto"):
    """Open an I/O engine.

    :param entries: submission-queue size (io_uring) or worker count bound (threads).
    :param engine: 'uring', 'threads' or 'auto': the ``io_engine`` setting, which ``Config`` decides
        (explicit > ``KVSTREAM_IO_ENGINE`` > default); this function reads no environment.
    :returns: a ``Ring`` or a ``ThreadRing``.
    :raises ValueError: unknown engine name.
    :raises OSError: engine='uring' and the kernel refuses io_uring_setup.
    """
    choice = engine.strip().lower()
    if choice not in ENGINES:
        raise ValueError(f"unknown I/O engine {engine!r} (the io_engine setting, {SETTING}): choose one of {ENGINES}")
    if choice == "threads":
        return ThreadRing(entries)
    if choice == "uring":
        return Ring(entries)
    try:
        return Ring(entries)
    except OSError as exc:
        # Containers whose seccomp profile blocks io_uring (EPERM/ENOSYS), kernels without it, or
        # io_uring_disabled=2 all end up here; the thread pool gives the same results, slower.
        log.warning("kvstream: io_uring unavailable (%s%s); using the thread-pool I/O engine "
                    "(set %s=threads to silence this, or =uring to make it an error)", exc, memlock_hint(exc), SETTING)
        return ThreadRing(entries)


class Vector:
    """Byte views of a vectored op's ranges (a list of (address, length)): one file range, several
    pieces of memory. Stands in for the memoryview of a single-buffer op where ThreadRing and the
    fault hook need one."""

    __slots__ = ("views",)

    def __init__(self, views: list[memoryview]):
        self.views = views

    def __len__(self) -> int:
        return sum(len(v) for v in self.views)

    def after(self, done: int) -> list[memoryview]:
        """The views of what is left after the first ``done`` bytes."""
        out = []
        for v in self.views:
            if done >= len(v):
                done -= len(v)
                continue
            out.append(v[done:])
            done = 0
        return out

    def byte_at(self, index: int) -> tuple[memoryview, int]:
        """(view, index in it) of byte ``index`` of the concatenation."""
        for v in self.views:
            if index < len(v):
                return v, index
            index -= len(v)
        raise IndexError(index)

    def release(self) -> None:
        for v in self.views:
            v.release()


def byte_view(buf, opcode: int) -> "memoryview | Vector":
    """A flat byte view of ``buf`` (buffer object or (address, length) raw memory), or a Vector for
    a list of (address, length) ranges (a vectored op)."""
    if isinstance(buf, list):
        if not 0 < len(buf) <= MAX_VECTOR:  # as the Ring: the whole batch is refused, not one op
            raise ValueError(f"a vectored op takes 1..{MAX_VECTOR} (address, length) ranges, got {len(buf)}")
        views: list[memoryview] = []
        try:
            for pair in buf:
                if not isinstance(pair, tuple):
                    raise TypeError(f"a vectored op takes (address, length) ranges, got {pair!r}")
                views.append(byte_view(pair, opcode))
        except BaseException:
            for v in views:
                v.release()
            raise
        return Vector(views)
    if isinstance(buf, tuple):
        address, length = buf
        if length < 0 or (address == 0 and length):
            raise ValueError(f"bad raw buffer (address={address:#x}, length={length})")
        if length == 0:
            return memoryview(bytearray(0))
        import ctypes  # local: only raw-address callers pay for it

        return memoryview((ctypes.c_char * length).from_address(address)).cast("B")
    view = memoryview(buf)
    if not view.contiguous:
        view.release()
        raise BufferError("I/O buffers must be contiguous")
    if opcode == OP_READ and view.readonly:
        view.release()
        raise BufferError("read into a read-only buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _unpack(op) -> tuple:
    """Validate one op the way Ring does (same exception types and messages)."""
    try:
        opcode, fd, buf, offset, tag = op
    except (TypeError, ValueError):
        raise TypeError(f"an op is (opcode, fd, buf, offset, tag), got {op!r}") from None
    if opcode not in (OP_READ, OP_WRITE):
        raise ValueError(f"bad opcode {opcode!r}: use OP_READ or OP_WRITE")
    if offset < 0:
        raise ValueError(f"negative file offset {offset}")
    return opcode, operator.index(fd), buf, operator.index(offset), operator.index(tag)


class ThreadRing:
    """The ring interface over a thread pool doing ``os.preadv``/``os.pwritev``.

    For hosts where io_uring_setup is refused. Same semantics as ``Ring``: per-op ``-errno``,
    short transfers completed, buffers referenced until reaped, ``close()`` drains. Not
    thread-safe for concurrent submit/reap from several threads without a caller lock, except
    that one thread may submit while another waits in ``reap`` (as with ``Ring``). Like ``Ring``,
    it belongs to the process that opened it: a forked child has none of its threads, so there
    ``submit``/``reap`` raise RuntimeError and ``close`` only marks it closed.
    """

    def __init__(self, entries: int = RING_ENTRIES, threads: int | None = None):
        if entries < 1:
            raise ValueError(f"entries must be >= 1, got {entries}")
        self.entries = entries
        self._pool = ThreadPoolExecutor(max_workers=threads or min(entries, MAX_THREADS),
                                        thread_name_prefix="kvstream-io")
        self._cond = ranked_condition("ring")
        self._done: deque[tuple[int, int]] = deque()  # completed, not yet reaped
        self._views: dict[int, memoryview] = {}  # tag -> view pinning the caller's buffer until reaped
        self._closed = False
        self._forks_at_open = forks()
        self.owner_pid = os.getpid()

    # -- interface --------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._views)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, ops: Iterable[tuple]) -> int:
        """Queue a batch; the whole batch is validated before any op starts. Like ``Ring.submit``,
        raises only when it accepted nothing: an op the pool refuses (no thread could be started,
        the interpreter is shutting down; the op may be queued all the same) runs here, at once,
        and whichever of the two comes first does it (a caller told the batch failed would free
        memory an op still reads or fills)."""
        self._check_open()
        batch = []
        tags = set()
        try:
            for op in ops:
                opcode, fd, buf, offset, tag = _unpack(op)
                if tag in self._views or tag in tags:
                    raise ValueError(f"tag {tag} is already in flight on this ThreadRing")
                tags.add(tag)
                batch.append((opcode, fd, byte_view(buf, opcode), offset, tag))
        except BaseException:
            for _, _, view, _, _ in batch:
                view.release()
            raise
        with self._cond:
            for opcode, fd, view, offset, tag in batch:
                self._views[tag] = view
        for op in batch:
            once: list[bool] = []  # marked (under the ring's condition) by whichever runs the op
            try:
                self._pool.submit(self._run, once, *op)
            except Exception:
                self._run(once, *op)
        return len(batch)

    def reap(self, min_complete: int = 1, timeout: float | None = None) -> list[tuple[int, int]]:
        """Wait for >= min_complete completions (fewer on timeout); return all available."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            want = min(min_complete, len(self._views))
            while len(self._done) < want and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            out = list(self._done)
            self._done.clear()
            for tag, _ in out:
                self._views.pop(tag).release()
        return out

    def close(self) -> None:
        """Idempotent. Waits for in-flight ops (they touch caller memory), then stops the pool."""
        if self._closed:
            return
        if self._forks_at_open != forks():  # a forked child: the pool's threads are the parent's
            self._closed = True
            return
        self._pool.shutdown(wait=True)  # every queued op runs to completion first
        with self._cond:
            for view in self._views.values():
                view.release()
            self._views.clear()
            self._done.clear()
            self._closed = True
            self._cond.notify_all()  # a reap waiting in another thread returns (empty)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            if self._forks_at_open == forks():
                import warnings

                warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)
            self.close()

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("I/O engine is closed")
        if self._forks_at_open != forks():
            raise RuntimeError(f"this ThreadRing was opened in process {self.owner_pid}, of which this process is a "
                               "fork (its threads are not here): open a new one in this process")

    def _run(self, once: list[bool], opcode: int, fd: int, view: memoryview, offset: int, tag: int) -> None:
        with self._cond:
            if once:  # (run by submit already: the pool refused it, then ran it)
                return
            once.append(True)
        res = _transfer(opcode, fd, view, offset)
        with self._cond:
            self._done.append((tag, res))
            self._cond.notify_all()


def _transfer(opcode: int, fd: int, view: "memoryview | Vector", offset: int) -> int:
    """One op to completion: bytes done (short only at EOF or error after progress), or -errno."""
    total = len(view)
    done = 0
    io = os.preadv if opcode == OP_READ else os.pwritev
    while done < total:
        try:
            n = io(fd, view.after(done) if isinstance(view, Vector) else [view[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            return done if done else -(exc.errno or _errno.EIO)
        if n == 0:  # EOF (or a zero-byte write, which would otherwise loop forever)
            break
        done += n
    return done
