# Included by _uring.pyx (after bytes.pxi, whose _raw unpacks raw memory): Ring, one io_uring.

OP_READ = 0
OP_WRITE = 1
cdef enum:
    C_RING_ENTRIES = 256            # submission-queue entries of a Ring by default (the engine's two rings)
    SLOT_SHIFT = 8                  # slots come in blocks of 2**SLOT_SHIFT; blocks never move, so the
    SLOT_BLOCK = 1 << SLOT_SHIFT    # Py_buffer inside a slot keeps its address while pinned
    CQE_BATCH = 64                  # completions taken per io_uring_peek_batch_cqe call
    CQ_PER_SQ = 4                   # CQ slots per SQ slot: callers may keep several batches in flight
    MAX_ENTRIES = 32768             # kernel limit on SQ entries
    IOV_MAX_VECS = 1024             # UIO_MAXIOV: ranges per vectored op
    MAX_FIXED = 4096                # registered-memory slots per ring (the kernel allows 16384), each
                                    # at most FIXED_PIECE: 4 TiB of host pool in all
    OP_READV_FIXED = 60             # IORING_OP_READV_FIXED (Linux 6.15; liburing 2.3 predates it)
RING_ENTRIES = C_RING_ENTRIES
MAX_VECTOR = IOV_MAX_VECS  # most (address, length) ranges in one vectored op (both I/O engines)

cdef size_t MAX_SQE_BYTES = 1 << 30  # largest transfer per SQE (length field is 32-bit, kernel caps ~2 GiB)
cdef size_t FIXED_PIECE = 1 << 30  # largest registered buffer the kernel takes (io_buffer_validate), bytes
cdef uint64_t CANCEL_UDATA = <uint64_t>-2  # user_data of close()'s cancel-everything SQE
# A kernel that takes none of the queued SQEs (EAGAIN, EBUSY: a passing shortage of memory or
# completion room) is offered them again after growing pauses for this long before reap gives up:
# a blip passes, and a ring that stays refused is the owner's to replace (inflight.py).
cdef double NO_PROGRESS_S = 0.1


cdef int _forks = 0  # fork()s between this process and the one that loaded the module (0: that one)


def _forked_child():
    global _forks
    _forks += 1


def forks():
    """fork()s between this process and the one that loaded the module (0: that one). The one fork
    detector: Ring, ThreadRing (io.py) and Engine (engine.py) each note it when opened, and another
    value means they are in a forked child."""
    return _forks


# A ring's queues are memory shared with the kernel, and after fork() with the parent too: a child that
# submitted, reaped or even closed (io_uring_queue_exit cancels first) would corrupt the parent's ring.
_os.register_at_fork(after_in_child=_forked_child)


cdef inline object _oserror(int err, str what):
    """The one place a C error code becomes a Python exception."""
    return OSError(err, f"{what}: {strerror(err).decode(errors='replace')}")  # (any locale's text)


ctypedef struct Req:
    char *base            # first byte of the caller's memory (single-buffer ops)
    size_t length         # bytes requested
    iovec *iov            # vectored ops: iovcnt caller ranges, then iovcnt entries of scratch for remainders
    int iovcnt            # 0 for single-buffer ops
    size_t done           # bytes transferred so far (short transfers resubmit from here)
    unsigned long long offset
    long long tag
    int fd
    int opcode
    int has_view          # view pins a buffer object; 0 for raw (address, length) memory
    int next_free         # free-list link while the slot is unused
    Py_buffer view


cdef int _raw_vector(list ranges, Req *req) except -1:
    """Fill a vectored op from a list of (address, length) ranges of caller memory (readv/writev:
    one request over several buffers, e.g. a page's segments or a run of staging blocks)."""
    cdef Py_ssize_t n = len(ranges)
    cdef Py_ssize_t i
    cdef char *base
    cdef size_t length
    cdef size_t total = 0
    if n == 0 or n > IOV_MAX_VECS:
        raise ValueError(f"a vectored op takes 1..{IOV_MAX_VECS} (address, length) ranges, got {n}")
    cdef iovec *iov = <iovec *>PyMem_Malloc(2 * n * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            _raw(ranges[i], &base, &length)
            iov[i].iov_base = base
            iov[i].iov_len = length
            total += length
    except BaseException:
        PyMem_Free(iov)
        raise
    req.iov = iov
    req.iovcnt = <int>n
    req.base = NULL
    req.length = total
    return 0


cdef unsigned _iov_remainder(Req *req) noexcept:
    """Copy the part of the op's ranges not yet transferred (req.done bytes in) into its scratch
    entries; returns how many. The original ranges stay intact for the next remainder."""
    cdef iovec *out = req.iov + req.iovcnt
    cdef size_t skip = req.done
    cdef unsigned n = 0
    cdef int i
    for i in range(req.iovcnt):
        if skip >= req.iov[i].iov_len:
            skip -= req.iov[i].iov_len
            continue
        out[n].iov_base = <char *>req.iov[i].iov_base + skip
        out[n].iov_len = req.iov[i].iov_len - skip
        skip = 0
        n += 1
    return n


@cython.final
@cython.no_gc_clear  # close() in __dealloc__ needs _tags/_done still set
cdef class Ring:
    """An io_uring instance for batched file I/O. Not thread-safe: callers serialize calls, except
    that ``submit`` may run while another thread is blocked in ``reap`` (the wait touches no state
    on Linux 5.11+). Nothing is shared between Ring objects: a read ring and a write ring never
    wait on each other.

    Cooperative completions (``cooperative``, the default; Linux 5.19+, else none): the kernel posts
    a completion when the submitting thread next enters the kernel (a submit, a reap, any system
    call or interrupt; a thread asleep in an interruptible wait is woken for it) instead of
    interrupting that thread with an IPI for every completion. A loop that submits and reaps enters
    the kernel anyway; on this VM the interrupts cost the read path 8-12% of its CPU per GB and
    7-15% of its speed at 256 KiB pages (docs/benchmarks.md, "Cooperative completions"). A thread
    reaping what another submitted waits until that one next enters the kernel (a timer tick while
    it computes; until its system call returns while one blocks uninterruptibly, as without the
    flag; on a nohz_full CPU, where a thread spinning in user space gets no tick, until its next
    system call: there, open rings with ``cooperative=False``, e.g. through Engine's ``ring_factory``).
    IORING_SETUP_TASKRUN_FLAG lets a reap that does not wait see the completions the kernel holds
    back for the calling thread. No IORING_SETUP_SINGLE_ISSUER/DEFER_TASKRUN (fio sets them): they
    tie the ring to the thread that first submits, and callers may share a ring between threads
    under a lock.

    A Ring belongs to the process that opened it: in a forked child ``submit``/``reap`` raise
    RuntimeError and ``close`` (or garbage collection) drops the object without a system call on the
    ring, which the parent still uses.

    Registered memory (``register_memory``): the kernel pins it once, for the ring's life, as fixed
    buffers; a read whose memory lies in one of them is sent as READ_FIXED (READV_FIXED for a
    vectored one, where the kernel has it: ``readv_fixed``) and skips pinning its pages, which for
    memory in 4 KiB pages costs more than the read itself (docs/benchmarks.md). Any other read is
    sent as before. The memory must stay mapped while registered: a read lands in the pages pinned
    at registration, whatever the address maps to later.
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
    cdef int _forks_at_open    # _forks when opened: another value means this is a forked child
    cdef readonly long owner_pid
    cdef uintptr_t *_fixed_lo  # registered pieces [lo, hi), piece i in kernel slot i
    cdef uintptr_t *_fixed_hi
    cdef int _nfixed           # pieces registered (0 with no table)
    cdef int _fixed_last       # the piece the last lookup found (reads of one pool hit the same one)
    cdef readonly size_t fixed_bytes   # bytes registered
    cdef readonly unsigned long long fixed_ops  # ops sent as READ_FIXED / READV_FIXED
    cdef readonly bint readv_fixed     # the kernel has READV_FIXED
    cdef readonly bint cooperative  # set up with IORING_SETUP_COOP_TASKRUN (the kernel took it)
    cdef readonly object submit_error  # the last io_uring_submit error a submit left to a later flush, or None
    cdef public bint punt      # every op straight to the kernel's async workers (IOSQE_ASYNC): submit never
    # waits inside a file system (a FUSE or NFS write issued inline blocks there while its server hangs)

    def __cinit__(self):
        self._free = -1
        self._tags = set()
        self._done = []

    def __init__(self, unsigned entries=C_RING_ENTRIES, bint cooperative=True):
        cdef io_uring_params params
        cdef int ret = -EINVAL
        cdef unsigned flags = 0
        cdef unsigned sized = IORING_SETUP_CQSIZE | IORING_SETUP_CLAMP
        cdef unsigned coop = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG
        if entries < 1 or entries > MAX_ENTRIES:
            raise ValueError(f"entries must be in 1..{MAX_ENTRIES}, got {entries}")
        if self._open:
            raise RuntimeError("Ring already initialized")
        # The newest setup the kernel takes: COOP_TASKRUN from 5.19 (before, completions interrupt),
        # CQSIZE/CLAMP from 5.6 (before, the default 2x CQ).
        for flags in ((sized | coop) if cooperative else sized, sized, 0):
            memset(&params, 0, sizeof(params))
            params.flags = flags
            if flags & IORING_SETUP_CQSIZE:
                params.cq_entries = entries * CQ_PER_SQ
            ret = io_uring_queue_init_params(entries, &self._ring, &params)
            if ret != -EINVAL:
                break
        if ret < 0:
            raise _oserror(-ret, f"io_uring_setup(entries={entries}) refused")
        self._open = True  # set only once the ring exists
        self.cooperative = flags & IORING_SETUP_COOP_TASKRUN != 0
        self._forks_at_open = _forks
        self.owner_pid = _os.getpid()
        self.entries = params.sq_entries
        self.cq_entries = params.cq_entries
        self.features = params.features
        cdef io_uring_probe *probe = io_uring_get_probe_ring(&self._ring)
        if probe != NULL:
            self.readv_fixed = io_uring_opcode_supported(probe, OP_READV_FIXED)
            io_uring_free_probe(probe)

    def __dealloc__(self):
        if self._open and self._forks_at_open != _forks:
            self._open = False  # a forked child's copy: the parent's queues are not ours to cancel
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

        ``buf`` is a buffer object (pinned until reaped; writable for reads), ``(address, length)``, or a
        list of ``(address, length)`` ranges read or written as one vectored request (readv/writev:
        the file range is contiguous, the memory need not be).
        The batch is validated first: on ValueError/TypeError/BufferError nothing is submitted.
        One io_uring_submit per call, more only when the batch outgrows the submission queue.
        Once accepted, the ops are in flight whatever io_uring_submit answers: one it refused stays in
        the submission queue (or the backlog) and goes to the kernel at the next flush, which every
        ``reap`` does first, so a lasting error surfaces there (``submit_error`` keeps the last one).
        Raising here instead would tell the caller the batch is not in flight, and it would free or
        reuse memory that a later io_uring_enter still hands the kernel.
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
        try:
            self._flush()
        except Exception as exc:  # (a hard error, or building its exception: EAGAIN, EBUSY, EINTR never raise)
            self.submit_error = exc
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
        cdef double now
        cdef double refused = 0.0  # since when the kernel takes none of what is queued (0: it takes)
        cdef unsigned pause = 500  # microseconds, doubling
        if timeout is not None:
            deadline = _time.monotonic() + timeout
            tsp = &ts
        self._drain()
        while len(self._done) < want:
            self._flush()  # remainders of short transfers go out before we sleep on them
            # Only SQEs the kernel has consumed can complete; ones it refused (EAGAIN/EBUSY) still
            # sit in the SQ, and waiting on them would never return.
            held = self._in_kernel - <Py_ssize_t>io_uring_sq_ready(&self._ring)
            if held <= 0:  # (NO_PROGRESS_S)
                now = _time.monotonic()
                if refused == 0.0:
                    refused = now
                elif now - refused >= NO_PROGRESS_S:
                    raise _oserror(EAGAIN, "io_uring_submit made no progress")
                if tsp != NULL and now >= deadline:
                    break
                with nogil:
                    usleep(pause)
                pause = min(2 * pause, 20000)
                continue
            refused = 0.0
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

    def register_memory(self, uintptr_t address, size_t nbytes):
        """Register ``[address, address + nbytes)`` as fixed buffers (pieces of up to 1 GiB, the
        kernel's limit), pinned until ``unregister_memory`` or ``close``; returns the bytes registered:
        0 when the range overlaps memory registered before (nothing new is pinned).
        :raises OSError: the kernel refused (ENOMEM: the RLIMIT_MEMLOCK of a user without
            CAP_IPC_LOCK; EINVAL: a kernel before 5.19, without sparse tables; EFAULT: not mapped),
            or ENOSPC: the ring's MAX_FIXED pieces are used. Nothing is registered then."""
        self._check_open()
        cdef int i, ret
        cdef int pieces = <int>((nbytes + FIXED_PIECE - 1) // FIXED_PIECE)
        cdef uintptr_t end = address + nbytes
        if nbytes == 0:
            return 0
        if nbytes > <size_t>MAX_FIXED * FIXED_PIECE or end < address:
            raise _oserror(EINVAL, f"register {nbytes} bytes at {address:#x}: more than a ring registers")
        for i in range(self._nfixed):
            if self._fixed_lo[i] < end and address < self._fixed_hi[i]:
                return 0
        if self._nfixed + pieces > MAX_FIXED:
            raise _oserror(ENOSPC, f"register {nbytes} bytes: the ring's {MAX_FIXED} registered pieces are used")
        if self._fixed_lo == NULL:
            ret = io_uring_register_buffers_sparse(&self._ring, MAX_FIXED)
            if ret < 0:
                raise _oserror(-ret, "io_uring_register_buffers_sparse")
            self._fixed_lo = <uintptr_t *>PyMem_Malloc(MAX_FIXED * sizeof(uintptr_t))
            self._fixed_hi = <uintptr_t *>PyMem_Malloc(MAX_FIXED * sizeof(uintptr_t))
            if self._fixed_lo == NULL or self._fixed_hi == NULL:
                io_uring_unregister_buffers(&self._ring)
                PyMem_Free(self._fixed_lo)
                PyMem_Free(self._fixed_hi)
                self._fixed_lo = self._fixed_hi = NULL
                raise MemoryError()
        cdef iovec *iov = <iovec *>PyMem_Malloc(pieces * sizeof(iovec))
        if iov == NULL:
            raise MemoryError()
        for i in range(pieces):
            iov[i].iov_base = <void *>(address + i * FIXED_PIECE)
            iov[i].iov_len = min(FIXED_PIECE, nbytes - i * FIXED_PIECE)
        try:
            with nogil:  # pins every page: a second per 30 GB or so
                ret = io_uring_register_buffers_update_tag(&self._ring, <unsigned>self._nfixed, iov,
                                                           <const unsigned long long *>NULL, <unsigned>pieces)
            if 0 <= ret < pieces:  # the kernel stopped part way (the memlock limit, memory not mapped)
                for i in range(pieces):
                    iov[i].iov_base = NULL  # (an empty entry clears its slot)
                    iov[i].iov_len = 0
                io_uring_register_buffers_update_tag(&self._ring, <unsigned>self._nfixed, iov,
                                                     <const unsigned long long *>NULL, <unsigned>ret)
                ret = -ENOMEM  # what a memlock limit answers
            if ret < 0:
                raise _oserror(-ret, f"register {nbytes} bytes at {address:#x} with io_uring")
            for i in range(pieces):
                self._fixed_lo[self._nfixed + i] = <uintptr_t>iov[i].iov_base
                self._fixed_hi[self._nfixed + i] = <uintptr_t>iov[i].iov_base + iov[i].iov_len
        finally:
            PyMem_Free(iov)
        self._nfixed += pieces
        self.fixed_bytes += nbytes
        return nbytes

    def unregister_memory(self):
        """No read goes out as fixed from now on, and every registered range is unpinned (reads in
        flight keep what they use until they complete; a kernel before 6.13 waits for them, with
        the GIL released). :raises OSError: the kernel refused to unpin (e.g. EINTR): nothing is
        sent as fixed all the same, and a later ``register_memory`` may fail with EBUSY."""
        self._check_open()
        cdef int ret = 0
        cdef bint table = self._fixed_lo != NULL
        self._forget_fixed()
        if table:
            with nogil:
                ret = io_uring_unregister_buffers(&self._ring)
        if ret < 0:
            raise _oserror(-ret, "io_uring_unregister_buffers")

    def fixed(self, uintptr_t address, size_t nbytes) -> int:
        """The registered piece that holds all of ``[address, address + nbytes)``, or -1."""
        return self._fixed(address, nbytes)

    def covers(self, uintptr_t address, size_t nbytes) -> bool:
        """Whether registered pieces hold every byte of ``[address, address + nbytes)`` (one piece or
        several: a registration of more than 1 GiB is several)."""
        cdef uintptr_t end = address + nbytes
        cdef int i
        while address < end:
            i = self._fixed(address, 1)  # the piece holding the next byte
            if i < 0:
                return False
            address = self._fixed_hi[i]
        return True

    def close(self):
        """Cancel what has not started, wait for everything in flight, free the ring. Idempotent."""
        if not self._open:
            return
        if self._forks_at_open != _forks:
            self._open = False  # a forked child's copy: dropped without a syscall on the parent's ring
            return
        if self._waiting:
            raise RuntimeError("close() while another thread is reaping this Ring")
        self._close()

    # -- internals ----------------------------------------------------------------------------
    cdef int _check_open(self) except -1:
        if not self._open:
            raise ValueError("Ring is closed")
        if self._forks_at_open != _forks:
            raise RuntimeError(f"this Ring was opened in process {self.owner_pid}, of which this process is a "
                               "fork: a ring cannot be shared across fork(); open a new Ring in this process")
        return 0

    cdef int _fixed(self, uintptr_t address, size_t nbytes) noexcept:
        cdef int i = self._fixed_last
        cdef uintptr_t end = address + nbytes
        if i < self._nfixed and self._fixed_lo[i] <= address and end <= self._fixed_hi[i]:
            return i
        for i in range(self._nfixed):
            if self._fixed_lo[i] <= address and end <= self._fixed_hi[i]:
                self._fixed_last = i
                return i
        return -1

    cdef int _fixed_vec(self, iovec *iov, unsigned n) noexcept:
        """The registered piece that holds every range of a vectored op, or -1."""
        if n == 0:
            return -1
        cdef int k = self._fixed(<uintptr_t>iov[0].iov_base, iov[0].iov_len)
        cdef unsigned i
        for i in range(1, n):
            if k < 0 or self._fixed(<uintptr_t>iov[i].iov_base, iov[i].iov_len) != k:
                return -1
        return k

    cdef void _forget_fixed(self) noexcept:
        PyMem_Free(self._fixed_lo)
        PyMem_Free(self._fixed_hi)
        self._fixed_lo = self._fixed_hi = NULL
        self._nfixed = self._fixed_last = 0
        self.fixed_bytes = 0

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
        req.iovcnt = 0
        try:
            if type(buf) is tuple:
                _raw(buf, &req.base, &req.length)
                req.has_view = 0
            elif type(buf) is list:
                _raw_vector(buf, req)
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
        if req.iovcnt:
            PyMem_Free(req.iov)
            req.iov = NULL
            req.iovcnt = 0
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
        cdef unsigned nvec
        cdef size_t nbytes
        cdef int fixed
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
            if req.iovcnt:
                nvec = _iov_remainder(req)
                if req.opcode == OP_READ:
                    io_uring_prep_readv(sqe, req.fd, req.iov + req.iovcnt, nvec, req.offset + req.done)
                    fixed = self._fixed_vec(req.iov + req.iovcnt, nvec) if self.readv_fixed and self._nfixed else -1
                    if fixed >= 0:
                        sqe.opcode = OP_READV_FIXED
                        sqe.buf_index = <uint16_t>fixed
                        self.fixed_ops += 1
                else:
                    io_uring_prep_writev(sqe, req.fd, req.iov + req.iovcnt, nvec, req.offset + req.done)
            elif req.opcode == OP_READ:
                fixed = self._fixed(<uintptr_t>(req.base + req.done), nbytes) if self._nfixed else -1
                if fixed >= 0:
                    io_uring_prep_read_fixed(sqe, req.fd, req.base + req.done, <unsigned>nbytes, req.offset + req.done,
                                             fixed)
                    self.fixed_ops += 1
                else:
                    io_uring_prep_read(sqe, req.fd, req.base + req.done, <unsigned>nbytes, req.offset + req.done)
            else:
                io_uring_prep_write(sqe, req.fd, req.base + req.done, <unsigned>nbytes, req.offset + req.done)
            io_uring_sqe_set_data64(sqe, <uint64_t>slot)
            if self.punt:
                io_uring_sqe_set_flags(sqe, IOSQE_ASYNC)
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
        so no buffer is released before that; ops never handed to the kernel (the backlog, and SQEs
        it did not take) are just dropped."""
        cdef io_uring_sqe *sqe
        cdef io_uring_cqe *cqe = NULL
        cdef int ret
        cdef unsigned unsent
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
                # Wait only for what the kernel took: an SQE it never took (refused, or the ring's
                # descriptor reaches another ring now) never runs once the ring exits, and no CQE
                # would come for it. The SQ is consumed in order, and the cancel SQE is its last.
                unsent = io_uring_sq_ready(&self._ring)
                if unsent and sqe != NULL:
                    unsent -= 1
                if self._in_kernel <= <Py_ssize_t>unsent:
                    break
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
        io_uring_queue_exit(&self._ring)  # (unpins the registered memory)
        self._forget_fixed()
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
        self._forget_fixed()  # (the kernel unpinned them when the ring closed)
