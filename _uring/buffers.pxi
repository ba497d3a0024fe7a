# Included by _uring.pyx: AlignedBuffer, the memory every O_DIRECT transfer of the engine goes through.

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

# O_DIRECT block, bytes: every offset, length and address of an O_DIRECT op is a multiple. Defined
# here once; kvstream_hicache.layout (the on-disk format: header and padding) takes it from here.
cdef enum:
    C_ALIGN = 4096
ALIGN = C_ALIGN

cdef const char *BYTE_FORMAT = "B"  # struct-module format of one unsigned byte


def _huge_page_size() -> int:
    """The PMD huge page size the kernel backs MADV_HUGEPAGE memory with; 0 without THP."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


cdef size_t HUGE_PAGE = _huge_page_size()  # transparent huge page size, bytes; 0 where THP is absent
HUGE_PAGE_SIZE = HUGE_PAGE


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

    def __cinit__(self, Py_ssize_t nbytes, Py_ssize_t align=C_ALIGN, bint hugepages=True, *,
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
        cdef size_t length = (nbytes + C_ALIGN - 1) & ~(<size_t>C_ALIGN - 1)
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
        """An AlignedBuffer over ``nbytes`` of this one's memory from ``offset`` (a multiple of ALIGN).

        The view pins this buffer as one of its exports (so ``close()`` here refuses until every
        view is closed) and keeps it alive; closing the view only drops that pin. Used to carve
        several O_DIRECT buffers out of one huge-page slab.
        """
        self._check_open()
        if offset < 0 or offset % C_ALIGN or nbytes <= 0 or offset + nbytes > self._nbytes:
            raise ValueError(f"view({offset}, {nbytes}) of a {self._nbytes}-byte buffer: the offset must be "
                             f"a multiple of {C_ALIGN} and the view inside the buffer")
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
