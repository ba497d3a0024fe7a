# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""io_uring for batches of file reads and writes, plus the byte helpers the engine needs.

``Ring`` takes a batch of ``(opcode, fd, buf, offset, tag)`` per ``submit`` (one io_uring_submit
per batch) and hands back ``(tag, res)`` pairs from ``reap``, waiting with the GIL released.
Each op lives in a ``Req`` slot until reaped: the slot holds the ``Py_buffer`` that pins the
caller's buffer, and the byte count done so far so a short transfer can be resubmitted for the
remainder. The slot index is the SQE's user_data, so a completion finds its request without a
dict lookup.

Lifecycle of an op:  submit -> backlog -> SQE -> CQE -+-> done (reap returns it, slot freed)
                                   ^                   |
                                   +--- short: remainder

``AlignedBuffer`` is aligned memory (huge-page backed from 2 MiB up) behind the buffer protocol (O_DIRECT bounce
buffers, usable as numpy arrays / torch tensors). ``crc32c`` and ``copy`` work on buffers or raw
``(address, length)`` memory with the GIL released for large inputs.
"""
cimport cython
from cpython.buffer cimport (PyBUF_FORMAT, PyBUF_ND, PyBUF_SIMPLE, PyBUF_STRIDES, PyBUF_WRITABLE,
                             PyBuffer_Release, PyObject_GetBuffer)
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.errno cimport EAGAIN, EBUSY, EINTR, EINVAL, ETIME, errno
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset, strerror

from liburing cimport *

import time as _time
import warnings as _warnings

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

cdef extern from "<sys/mman.h>" nogil:
    enum: PROT_READ
    enum: PROT_WRITE
    enum: MAP_PRIVATE
    enum: MAP_ANONYMOUS
    enum: MADV_HUGEPAGE
    void *MAP_FAILED
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)

cdef extern from "crc32c.h" nogil:
    void kv_crc32c_init()
    uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n)
    uint32_t kv_crc32c_sw(uint32_t crc, const void *buf, size_t n)
    int kv_crc32c_hardware()

kv_crc32c_init()  # tables and the CPU check, once, under the import lock

ALIGN = 4096  # O_DIRECT block, bytes: every offset, length and address of an O_DIRECT op is a multiple
OP_READ = 0
OP_WRITE = 1
CRC32C_IMPL = "sse4.2-3way" if kv_crc32c_hardware() else "table"

cdef enum:
    SLOT_SHIFT = 8                  # slots come in blocks of 2**SLOT_SHIFT; blocks never move, so the
    SLOT_BLOCK = 1 << SLOT_SHIFT    # Py_buffer inside a slot keeps its address while pinned
    CQE_BATCH = 64                  # completions taken per io_uring_peek_batch_cqe call
    CQ_PER_SQ = 4                   # CQ slots per SQ slot: callers may keep several batches in flight
    MAX_ENTRIES = 32768             # kernel limit on SQ entries

cdef size_t MAX_SQE_BYTES = 1 << 30  # largest transfer per SQE (length field is 32-bit, kernel caps ~2 GiB)
cdef size_t NOGIL_MIN_BYTES = 1 << 16  # crc32c/copy release the GIL only above this, bytes: below it the
                                       # GIL hand-off costs more than the work
cdef const char *BYTE_FORMAT = "B"  # struct-module format of one unsigned byte
cdef uint64_t CANCEL_UDATA = <uint64_t>-2  # user_data of close()'s cancel-everything SQE


def _huge_page_size() -> int:
    """The PMD huge page size the kernel backs MADV_HUGEPAGE memory with; 0 without THP."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


cdef size_t HUGE_PAGE = _huge_page_size()  # transparent huge page size, bytes; 0 where THP is absent
HUGE_PAGE_SIZE = HUGE_PAGE


cdef inline object _oserror(int err, str what):
    """The one place a C error code becomes a Python exception."""
    return OSError(err, f"{what}: {strerror(err).decode()}")


# -- AlignedBuffer --------------------------------------------------------------------------------
@cython.final
cdef class AlignedBuffer:
    """Zeroed memory aligned to ``align`` bytes, exported as a writable 1-D unsigned-byte buffer.

    Buffers of a huge page or more (2 MiB on x86-64) are mmap'd huge-page aligned and advised
    MADV_HUGEPAGE (``hugepages`` says the advice was accepted: the kernel then backs the memory
    with huge pages when THP is not set to ``never`` and it can find free ones; ``hugepages=False``
    opts out), so O_DIRECT transfers into them are not split at every 4 KiB page.

    ``close()`` frees it; it refuses (BufferError) while any view is alive, including a ring's
    in-flight op, because freeing memory the kernel may still DMA into would corrupt the heap.
    """
    cdef char *_data
    cdef Py_ssize_t _nbytes
    cdef size_t _maplen        # > 0: the memory is an mmap of this many bytes (munmap), else free()
    cdef bint _is_view         # the memory belongs to another AlignedBuffer, pinned by _parent_view
    cdef Py_buffer _parent_view
    cdef Py_ssize_t _exports
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]
    cdef readonly Py_ssize_t align
    cdef readonly bint hugepages

    def __cinit__(self, Py_ssize_t nbytes, Py_ssize_t align=4096, bint hugepages=True, *,
                  AlignedBuffer _parent=None, Py_ssize_t _offset=0):
        cdef void *p = NULL
        cdef int rc
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        if align < <Py_ssize_t>sizeof(void *) or align & (align - 1):
            raise ValueError(f"align must be a power of two >= {sizeof(void *)}, got {align}")
        if _parent is not None:  # a view(): borrow the parent's memory through a buffer export
            PyObject_GetBuffer(_parent, &self._parent_view, PyBUF_WRITABLE)
            self._is_view = True
            p = <char *>self._parent_view.buf + _offset
            self.hugepages = _parent.hugepages
        elif hugepages and HUGE_PAGE and <size_t>nbytes >= HUGE_PAGE:
            align = max(align, <Py_ssize_t>HUGE_PAGE)
            p = self._map_huge(<size_t>nbytes, <size_t>align)
        else:
            rc = posix_memalign(&p, <size_t>align, <size_t>nbytes)
            if rc:
                raise MemoryError(f"posix_memalign({align}, {nbytes}) failed: {strerror(rc).decode()}")
        if not self._is_view:  # a view's bytes are its parent's: already zeroed, maybe in use
            with nogil:  # zeroing faults every page in now rather than mid-I/O, and leaks no old heap data
                memset(p, 0, <size_t>nbytes)
        self._data = <char *>p
        self._nbytes = nbytes
        self._shape[0] = nbytes
        self._strides[0] = 1
        self.align = align

    cdef void *_map_huge(self, size_t nbytes, size_t align) except NULL:
        """Anonymous memory aligned to ``align`` (a huge-page multiple), advised MADV_HUGEPAGE.

        Why: an O_DIRECT transfer becomes one block-layer segment per physically contiguous run
        of the buffer. Scattered 4 KiB pages cap a request at max_segments pages (254 on
        virtio-blk: ~1 MiB), so a 4 MiB read went out as 2-7 requests; a 2 MiB huge page is one
        segment, and the 4 MiB read one request (measured: docs/benchmarks.md "Ring vs fio").
        Where the kernel has no THP (or it is set to ``never``) this is plain page-aligned memory.
        """
        cdef size_t length = (nbytes + ALIGN - 1) & ~(<size_t>ALIGN - 1)
        cdef size_t total = length + align
        cdef char *base = <char *>mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if <void *>base == MAP_FAILED:
            raise MemoryError(f"mmap({total}) failed: {strerror(errno).decode()}")
        cdef char *start = <char *>((<uintptr_t>base + align - 1) & ~(<uintptr_t>align - 1))
        if start > base:  # hand back the unaligned head and the tail beyond the buffer
            munmap(base, <size_t>(start - base))
        if base + total > start + length:
            munmap(start + length, <size_t>(base + total - (start + length)))
        self._maplen = length
        self.hugepages = madvise(start, length, MADV_HUGEPAGE) == 0
        return start

    def __dealloc__(self):
        self._free()  # exporters hold a reference, so none is alive here

    cdef void _free(self) noexcept:
        if self._data == NULL:
            return
        if self._is_view:
            PyBuffer_Release(&self._parent_view)  # the parent frees its memory once unexported
        elif self._maplen:
            munmap(self._data, self._maplen)
        else:
            free(self._data)
        self._data = NULL

    def view(self, Py_ssize_t offset, Py_ssize_t nbytes):
        """An AlignedBuffer over ``nbytes`` of this one's memory from ``offset`` (a multiple of 4096).

        The view pins this buffer as one of its exports (so ``close()`` here refuses until every
        view is closed) and keeps it alive; closing the view only drops that pin. Used to carve
        several O_DIRECT buffers out of one huge-page slab.
        """
        self._check_open()
        if offset < 0 or offset % ALIGN or nbytes <= 0 or offset + nbytes > self._nbytes:
            raise ValueError(f"view({offset}, {nbytes}) of a {self._nbytes}-byte buffer: the offset must be "
                             f"a multiple of {ALIGN} and the view inside the buffer")
        cdef Py_ssize_t align = self.align
        while offset % align:
            align >>= 1
        return AlignedBuffer(nbytes, align, _parent=self, _offset=offset)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def address(self) -> int:
        self._check_open()
        return <uintptr_t>self._data

    @property
    def closed(self) -> bool:
        return self._data == NULL

    @property
    def exports(self) -> int:
        """Live buffer views (memoryviews, arrays, tensors, in-flight ring ops)."""
        return self._exports

    def close(self):
        """Free the memory. Idempotent. BufferError while views are alive."""
        if self._data == NULL:
            return
        if self._exports:
            raise BufferError(f"AlignedBuffer({self._nbytes}) still has {self._exports} live view(s) "
                              "(memoryview/numpy/torch, or an op in flight on a ring): release them first")
        self._free()

    def __len__(self):
        return self._nbytes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._data == NULL else f"address={<uintptr_t>self._data:#x}"
        return f"AlignedBuffer(nbytes={self._nbytes}, align={self.align}, {state})"

    def __getbuffer__(self, Py_buffer *view, int flags):
        self._check_open()
        view.buf = self._data
        view.obj = self
        view.len = self._nbytes
        view.readonly = 0
        view.itemsize = 1
        view.format = <char *>BYTE_FORMAT if flags & PyBUF_FORMAT else NULL
        view.ndim = 1
        view.shape = self._shape if flags & PyBUF_ND else NULL
        view.strides = self._strides if flags & PyBUF_STRIDES else NULL
        view.suboffsets = NULL
        view.internal = NULL
        self._exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self._exports -= 1

    cdef int _check_open(self) except -1:
        if self._data == NULL:
            raise ValueError("AlignedBuffer is closed")
        return 0


# -- raw memory helpers ---------------------------------------------------------------------------
cdef int _raw(object pair, char **base, size_t *length) except -1:
    """Unpack an (address, length) tuple of caller-owned memory."""
    address, n = pair
    if n < 0:
        raise ValueError(f"negative length in raw buffer {pair!r}")
    if n and not address:
        raise ValueError(f"null address in raw buffer {pair!r}")
    base[0] = <char *><uintptr_t>address
    length[0] = <size_t>n
    return 0


def crc32c(buf, uint32_t crc=0):
    """CRC-32C of ``buf`` (buffer object or (address, length)), continuing from ``crc``.

    ``crc32c(b, crc32c(a)) == crc32c(a + b)``; ``crc32c(b"123456789") == 0xE3069283``.
    """
    cdef Py_buffer view
    cdef char *p
    cdef size_t n
    if type(buf) is tuple:
        _raw(buf, &p, &n)
        if n >= NOGIL_MIN_BYTES:
            with nogil:
                crc = kv_crc32c(crc, p, n)
            return crc
        return kv_crc32c(crc, p, n)
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        n = <size_t>view.len
        if n >= NOGIL_MIN_BYTES:
            with nogil:
                crc = kv_crc32c(crc, view.buf, n)
        else:
            crc = kv_crc32c(crc, view.buf, n)
    finally:
        PyBuffer_Release(&view)
    return crc


def _crc32c_software(const unsigned char[::1] data, uint32_t crc=0):
    """The byte-table path that non-x86 hosts use, exposed so x86 tests can check it too."""
    return kv_crc32c_sw(crc, &data[0] if data.shape[0] else NULL, <size_t>data.shape[0])


def copy(uintptr_t dst_address, uintptr_t src_address, Py_ssize_t n):
    """memcpy ``n`` bytes between raw addresses (caller guarantees both ranges are valid)."""
    if n < 0:
        raise ValueError(f"negative copy length {n}")
    if n == 0:
        return
    if not dst_address or not src_address:
        raise ValueError("copy: null address")
    if <size_t>n >= NOGIL_MIN_BYTES:
        with nogil:
            memcpy(<void *>dst_address, <const void *>src_address, <size_t>n)
    else:
        memcpy(<void *>dst_address, <const void *>src_address, <size_t>n)


# -- Ring -----------------------------------------------------------------------------------------
ctypedef struct Req:
    char *base            # first byte of the caller's memory
    size_t length         # bytes requested
    size_t done           # bytes transferred so far (short transfers resubmit from here)
    unsigned long long offset
    long long tag
    int fd
    int opcode
    int has_view          # view pins a buffer object; 0 for raw (address, length) memory
    int next_free         # free-list link while the slot is unused
    Py_buffer view


@cython.final
@cython.no_gc_clear  # close() in __dealloc__ needs _tags/_done still set
cdef class Ring:
    """An io_uring instance for batched file I/O. Not thread-safe: callers serialize calls, except
    that ``submit`` may run while another thread is blocked in ``reap`` (the wait touches no state
    on Linux 5.11+). Nothing is shared between Ring objects: a read ring and a write ring never
    wait on each other.

    No IORING_SETUP_SINGLE_ISSUER/DEFER_TASKRUN (fio sets them): they tie the ring to the thread
    that first submits, and callers may share a ring between threads under a lock.
    """
    cdef io_uring _ring
    cdef bint _open
    cdef bint _closing         # completions are final (no resubmission) while close() drains
    cdef bint _waiting         # a reap is blocked in the kernel with the GIL released
    cdef Req **_blocks
    cdef int _nblocks
    cdef int _nslots
    cdef int _free             # head of the free-slot list, -1 when empty
    cdef int *_backlog         # FIFO of slots waiting for an SQE (new ops and short-transfer remainders)
    cdef int _bl_head
    cdef int _bl_len
    cdef int _bl_cap
    cdef Py_ssize_t _in_flight # submitted and not yet returned by reap
    cdef Py_ssize_t _in_kernel # SQEs prepared whose CQE has not been seen
    cdef set _tags             # tags in flight (duplicates are refused)
    cdef list _done            # completions not yet returned: survive an exception inside reap
    cdef readonly unsigned entries
    cdef readonly unsigned cq_entries
    cdef readonly unsigned features

    def __cinit__(self):
        self._free = -1
        self._tags = set()
        self._done = []

    def __init__(self, unsigned entries=256):
        cdef io_uring_params params
        cdef int ret
        if entries < 1 or entries > MAX_ENTRIES:
            raise ValueError(f"entries must be in 1..{MAX_ENTRIES}, got {entries}")
        if self._open:
            raise RuntimeError("Ring already initialized")
        memset(&params, 0, sizeof(params))
        params.flags = IORING_SETUP_CQSIZE | IORING_SETUP_CLAMP
        params.cq_entries = entries * CQ_PER_SQ
        ret = io_uring_queue_init_params(entries, &self._ring, &params)
        if ret == -EINVAL:  # kernels before 5.6 lack CQSIZE/CLAMP: take the default 2x CQ
            memset(&params, 0, sizeof(params))
            ret = io_uring_queue_init_params(entries, &self._ring, &params)
        if ret < 0:
            raise _oserror(-ret, f"io_uring_setup(entries={entries}) refused")
        self._open = True  # set only once the ring exists
        self.entries = params.sq_entries
        self.cq_entries = params.cq_entries
        self.features = params.features

    def __dealloc__(self):
        if self._open:
            try:
                _warnings.warn(f"unclosed kvstream Ring with {self._in_flight} op(s) in flight",
                               ResourceWarning)
            finally:
                self._close()
        self._free_memory()

    @property
    def in_flight(self) -> int:
        """Ops submitted and not yet returned by ``reap`` (completed-but-unreaped ones included)."""
        return self._in_flight

    @property
    def closed(self) -> bool:
        return not self._open

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if not self._open else f"entries={self.entries}, in_flight={self._in_flight}"
        return f"<kvstream Ring {state}>"

    # -- public API ---------------------------------------------------------------------------
    def submit(self, ops):
        """Submit a batch of ``(opcode, fd, buf, offset, tag)``; returns the number of ops accepted.

        ``buf`` is a buffer object (pinned until reaped; writable for reads) or ``(address, length)``.
        The batch is validated first: on ValueError/TypeError/BufferError nothing is submitted.
        One io_uring_submit per call, more only when the batch outgrows the submission queue.
        """
        self._check_open()
        if self._waiting and not self.features & IORING_FEAT_EXT_ARG:
            # Without EXT_ARG liburing implements the wait timeout with an SQE of its own, so the
            # waiting thread touches the SQ too (kernels before 5.11).
            raise RuntimeError("submit during another thread's reap needs Linux 5.11+ (IORING_FEAT_EXT_ARG)")
        cdef Py_ssize_t accepted = 0
        try:
            for op in ops:
                self._backlog_push(self._prepare(op))
                accepted += 1
        except BaseException:
            while accepted:  # roll the batch back, newest first
                self._release(self._backlog_pop_tail())
                accepted -= 1
            raise
        self._in_flight += accepted
        self._flush()
        return accepted

    def reap(self, Py_ssize_t min_complete=1, timeout=None):
        """Wait until >= ``min_complete`` ops completed (capped at ``in_flight``) or ``timeout``
        seconds passed; return every completion available as ``[(tag, res), ...]``.

        ``res`` >= 0: bytes transferred (short only at end of file, or when an error followed
        partial progress); ``res`` < 0: ``-errno`` for that op alone.
        """
        self._check_open()
        if self._waiting:
            raise RuntimeError("another thread is already reaping this Ring")
        cdef double deadline = 0.0
        cdef double left
        cdef Py_ssize_t want = min(min_complete, self._in_flight)
        cdef unsigned need
        cdef Py_ssize_t held
        cdef int ret
        cdef io_uring_cqe *cqe = NULL
        cdef __kernel_timespec ts
        cdef __kernel_timespec *tsp = NULL
        if timeout is not None:
            deadline = _time.monotonic() + timeout
            tsp = &ts
        self._drain()
        while len(self._done) < want:
            self._flush()  # remainders of short transfers go out before we sleep on them
            # Only SQEs the kernel has consumed can complete; ones it refused (EAGAIN/EBUSY) still
            # sit in the SQ, and waiting on them would never return.
            held = self._in_kernel - <Py_ssize_t>io_uring_sq_ready(&self._ring)
            if held <= 0:
                raise _oserror(EAGAIN, "io_uring_submit made no progress")
            need = <unsigned>min(want - len(self._done), held)
            if tsp != NULL:
                left = deadline - _time.monotonic()
                if left <= 0:
                    break
                ts.tv_sec = <long long>left
                ts.tv_nsec = <long long>((left - ts.tv_sec) * 1e9)
            self._waiting = True
            with nogil:
                ret = io_uring_wait_cqes(&self._ring, &cqe, need, tsp, <void *>NULL)
            self._waiting = False
            if ret == -EINTR:
                PyErr_CheckSignals()  # Ctrl-C ends the wait; finished completions stay queued
            elif ret < 0 and ret != -ETIME:
                raise _oserror(-ret, "io_uring_wait_cqes")
            self._drain()
            if ret == -ETIME:
                break
        self._flush()
        out = self._done
        self._done = []
        self._in_flight -= len(out)
        return out

    def close(self):
        """Cancel what has not started, wait for everything in flight, free the ring. Idempotent."""
        if not self._open:
            return
        if self._waiting:
            raise RuntimeError("close() while another thread is reaping this Ring")
        self._close()

    # -- internals ----------------------------------------------------------------------------
    cdef int _check_open(self) except -1:
        if not self._open:
            raise ValueError("Ring is closed")
        return 0

    cdef inline Req *_req(self, int slot) noexcept:
        return &self._blocks[slot >> SLOT_SHIFT][slot & (SLOT_BLOCK - 1)]

    cdef int _take_slot(self) except -1:
        cdef Req **blocks
        cdef Req *block
        cdef int i, slot
        if self._free < 0:
            blocks = <Req **>PyMem_Realloc(self._blocks, (self._nblocks + 1) * sizeof(Req *))
            if blocks == NULL:
                raise MemoryError()
            self._blocks = blocks
            block = <Req *>PyMem_Malloc(SLOT_BLOCK * sizeof(Req))
            if block == NULL:
                raise MemoryError()
            memset(block, 0, SLOT_BLOCK * sizeof(Req))
            self._blocks[self._nblocks] = block
            self._nblocks += 1
            for i in range(SLOT_BLOCK - 1, -1, -1):
                block[i].next_free = self._free
                self._free = self._nslots + i
            self._nslots += SLOT_BLOCK
        slot = self._free
        self._free = self._req(slot).next_free
        return slot

    cdef int _prepare(self, object op) except -1:
        """Validate one op and fill a slot for it; returns the slot. Nothing is left behind on error."""
        try:
            opcode, fd, buf, offset, tag = op
        except (TypeError, ValueError):
            raise TypeError(f"an op is (opcode, fd, buf, offset, tag), got {op!r}") from None
        if opcode != OP_READ and opcode != OP_WRITE:
            raise ValueError(f"bad opcode {opcode!r}: use OP_READ or OP_WRITE")
        if offset < 0:
            raise ValueError(f"negative file offset {offset}")
        # Convert everything before taking a slot or pinning a buffer, so a bad value leaks nothing.
        cdef long long ctag = tag
        cdef int cfd = fd
        cdef unsigned long long coffset = offset
        cdef int copcode = opcode
        if ctag in self._tags:
            raise ValueError(f"tag {tag} is already in flight on this Ring")
        cdef int slot = self._take_slot()
        cdef Req *req = self._req(slot)
        try:
            if type(buf) is tuple:
                _raw(buf, &req.base, &req.length)
                req.has_view = 0
            else:
                # SIMPLE implies C-contiguous; reads need a writable buffer
                PyObject_GetBuffer(buf, &req.view,
                                   PyBUF_WRITABLE if copcode == OP_READ else PyBUF_SIMPLE)
                req.has_view = 1
                req.base = <char *>req.view.buf
                req.length = <size_t>req.view.len
        except BaseException:
            req.next_free = self._free
            self._free = slot
            raise
        req.done = 0
        req.offset = coffset
        req.tag = ctag
        req.fd = cfd
        req.opcode = copcode
        self._tags.add(ctag)
        return slot

    cdef void _release(self, int slot) noexcept:
        """Unpin the op's buffer and return its slot (and tag) to the free pool."""
        cdef Req *req = self._req(slot)
        if req.has_view:
            PyBuffer_Release(&req.view)
            req.has_view = 0
        self._tags.discard(req.tag)
        req.next_free = self._free
        self._free = slot

    cdef int _backlog_push(self, int slot) except -1:
        cdef int *grown
        cdef int cap
        if self._bl_head + self._bl_len == self._bl_cap:
            if self._bl_head:  # reuse the consumed front before growing
                memcpy(self._backlog, self._backlog + self._bl_head, self._bl_len * sizeof(int))
                self._bl_head = 0
            else:
                cap = self._bl_cap * 2 if self._bl_cap else 256
                grown = <int *>PyMem_Realloc(self._backlog, cap * sizeof(int))
                if grown == NULL:
                    raise MemoryError()
                self._backlog = grown
                self._bl_cap = cap
        self._backlog[self._bl_head + self._bl_len] = slot
        self._bl_len += 1
        return 0

    cdef inline int _backlog_pop_tail(self) noexcept:
        self._bl_len -= 1
        return self._backlog[self._bl_head + self._bl_len]

    cdef int _submit_sq(self) except -2:
        """io_uring_submit; 0 when the kernel is busy (we retry after reaping), raise otherwise."""
        cdef int ret = io_uring_submit(&self._ring)
        if ret >= 0:
            return ret
        if ret == -EAGAIN or ret == -EBUSY or ret == -EINTR:
            return 0
        raise _oserror(-ret, "io_uring_submit")

    cdef int _flush(self) except -1:
        """Turn backlog slots into SQEs; submit when the SQ fills and once at the end."""
        cdef io_uring_sqe *sqe
        cdef Req *req
        cdef int slot
        cdef size_t nbytes
        while self._bl_len:
            sqe = io_uring_get_sqe(&self._ring)
            if sqe == NULL:  # SQ full: submit and continue
                if self._submit_sq() == 0:
                    return 0  # kernel busy: the rest stays in the backlog until the next reap
                continue
            slot = self._backlog[self._bl_head]
            self._bl_head += 1
            self._bl_len -= 1
            if self._bl_len == 0:
                self._bl_head = 0
            req = self._req(slot)
            nbytes = req.length - req.done
            if nbytes > MAX_SQE_BYTES:
                nbytes = MAX_SQE_BYTES  # the rest follows as a "short transfer"
            if req.opcode == OP_READ:
                io_uring_prep_read(sqe, req.fd, req.base + req.done, <unsigned>nbytes, req.offset + req.done)
            else:
                io_uring_prep_write(sqe, req.fd, req.base + req.done, <unsigned>nbytes, req.offset + req.done)
            io_uring_sqe_set_data64(sqe, <uint64_t>slot)
            self._in_kernel += 1
        if io_uring_sq_ready(&self._ring):
            self._submit_sq()
        return 0

    cdef int _drain(self) except -1:
        """Consume every CQE in the completion queue (no waiting)."""
        cdef io_uring_cqe *cqes[CQE_BATCH]
        cdef unsigned n, i
        while True:
            n = io_uring_peek_batch_cqe(&self._ring, cqes, CQE_BATCH)
            if n == 0:
                return 0
            try:
                for i in range(n):
                    self._complete(io_uring_cqe_get_data64(cqes[i]), cqes[i].res)
            finally:
                io_uring_cq_advance(&self._ring, n)

    cdef int _complete(self, uint64_t udata, int res) except -1:
        cdef Req *req
        cdef long long final
        if udata >= <uint64_t>self._nslots:
            return 0  # close()'s cancel SQE, or liburing's own timeout SQE on old kernels
        self._in_kernel -= 1
        req = self._req(<int>udata)
        if res > 0:
            req.done += res
            if req.done < req.length and not self._closing:
                self._backlog_push(<int>udata)  # short transfer: resubmit the remainder
                return 0
            final = req.done
        elif res == 0:
            final = req.done  # end of file: report the short total
        else:
            # An error after partial progress reports the partial count, like read(2)/write(2);
            # the caller sees a short result. An error on the first attempt is -errno.
            final = req.done if req.done else res
        tag = req.tag
        self._release(<int>udata)
        if not self._closing:
            self._done.append((tag, final))
        return 0

    cdef void _close(self) noexcept:
        """Cancel, drain, exit. The kernel may write into pinned buffers until their CQE arrives,
        so no buffer is released before that; ops never handed to the kernel are just dropped."""
        cdef io_uring_sqe *sqe
        cdef io_uring_cqe *cqe = NULL
        cdef int ret
        self._closing = True
        while self._bl_len:
            self._release(self._backlog_pop_tail())
        self._bl_head = 0
        if self._in_kernel:
            # Ops that have not started are cancelled (-ECANCELED); started file I/O finishes.
            sqe = io_uring_get_sqe(&self._ring)
            if sqe == NULL:
                io_uring_submit(&self._ring)
                sqe = io_uring_get_sqe(&self._ring)
            if sqe != NULL:
                io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY)
                io_uring_sqe_set_data64(sqe, CANCEL_UDATA)
            while self._in_kernel:
                io_uring_submit(&self._ring)  # also retries SQEs a busy kernel refused earlier
                with nogil:
                    ret = io_uring_wait_cqes(&self._ring, &cqe, 1, <__kernel_timespec *>NULL, <void *>NULL)
                if ret < 0 and ret != -EINTR and ret != -ETIME:
                    # The ring is broken; buffers the kernel may still hold stay pinned (leaked)
                    # rather than freed under a DMA.
                    break
                try:
                    self._drain()
                except BaseException:
                    break
        io_uring_queue_exit(&self._ring)
        self._open = False
        self._done = []
        self._in_flight = 0

    cdef void _free_memory(self) noexcept:
        cdef int i
        for i in range(self._nblocks):
            PyMem_Free(self._blocks[i])
        PyMem_Free(self._blocks)
        self._blocks = NULL
        self._nblocks = 0
        PyMem_Free(self._backlog)
        self._backlog = NULL
