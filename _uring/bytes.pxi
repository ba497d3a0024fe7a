# Included by _uring.pyx: raw caller memory, crc32c and copy, and PageMap (a page in caller memory).
#
# ``crc32c`` and ``copy`` take buffer objects or raw ``(address, length)`` memory (the engine hands
# them caller segments and staging buffers by address) and release the GIL for large inputs.

cdef extern from "crc32c.h" nogil:
    void kv_crc32c_init()
    uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n)
    int64_t kv_crc32c_by(int impl, uint32_t crc, void *dst, const void *src, size_t n)
    uint32_t kv_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n)
    int kv_crc32c_hardware()

kv_crc32c_init()  # tables and the CPU check, once, under the import lock

CRC32C_IMPLS = ("table", "sse4.2-3way", "vpclmulqdq-fold", "vpclmulqdq-avx2-fold")  # kv_crc32c_hardware()'s order
CRC32C_IMPL = CRC32C_IMPLS[kv_crc32c_hardware()]

cdef size_t NOGIL_MIN_BYTES = 1 << 16  # crc32c/copy release the GIL only above this, bytes: below it the
                                       # GIL hand-off costs more than the work


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


def _crc32c_by(int impl, const unsigned char[::1] data, uint32_t crc=0, uintptr_t dst=0):
    """CRC-32C of ``data`` through one implementation (its index in CRC32C_IMPLS: 0 the table
    that non-x86 hosts use, 1 the 3-way loop, 2 and 3 the folds), copying ``data`` to the address
    ``dst`` too if not 0; None where this CPU lacks it (or a fold is given under 256 bytes). For the
    tests: every path the CPU has is checked, not only the one in use."""
    cdef int64_t r = kv_crc32c_by(impl, crc, <void *>dst, &data[0] if data.shape[0] else NULL,
                                  <size_t>data.shape[0])
    return None if r < 0 else r


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


# -- PageMap --------------------------------------------------------------------------------------
@cython.final
cdef class PageMap:
    """One page of a read batch: where its payload lives in caller memory (the concatenation of
    ``segments``, ``(address, nbytes)`` pairs) and the CRC-32C each ``block`` must have.

    ``ranges`` maps payload bytes to caller memory, for a read straight into it (one vectored
    request). ``check`` verifies blocks that arrived: from staging buffers it copies them into the
    caller's segments in the same pass as the checksum (one read of the data, not two), read
    straight in it checksums them in place. Both run without the GIL; a block that fails may have
    left its bytes in caller memory, which only matters for a page reported missing.
    """
    cdef size_t *_addr
    cdef size_t *_len
    cdef size_t *_start     # payload offset of each segment
    cdef int _nseg
    cdef uint32_t *_crcs
    cdef int _nblocks
    cdef readonly size_t length
    cdef readonly size_t block

    def __cinit__(self, segments, size_t length, size_t block, crcs):
        cdef Py_ssize_t i, n = len(segments)
        cdef size_t total = 0
        cdef char *base
        cdef size_t nbytes
        if block == 0:
            raise ValueError("block must be > 0")
        self._nblocks = <int>max(1, (length + block - 1) // block)
        if len(crcs) != self._nblocks:
            raise ValueError(f"{len(crcs)} checksums for {self._nblocks} blocks")
        self._addr = <size_t *>PyMem_Malloc(max(n, 1) * sizeof(size_t))
        self._len = <size_t *>PyMem_Malloc(max(n, 1) * sizeof(size_t))
        self._start = <size_t *>PyMem_Malloc(max(n, 1) * sizeof(size_t))
        self._crcs = <uint32_t *>PyMem_Malloc(self._nblocks * sizeof(uint32_t))
        if self._addr == NULL or self._len == NULL or self._start == NULL or self._crcs == NULL:
            raise MemoryError()
        for i in range(n):
            _raw(segments[i], &base, &nbytes)
            self._addr[i] = <size_t>base
            self._len[i] = nbytes
            self._start[i] = total
            total += nbytes
        if total != length:
            raise ValueError(f"segments hold {total} bytes, the page {length}")
        for i in range(self._nblocks):
            self._crcs[i] = crcs[i]
        self._nseg = <int>n
        self.length = length
        self.block = block

    def __dealloc__(self):
        PyMem_Free(self._addr)
        PyMem_Free(self._len)
        PyMem_Free(self._start)
        PyMem_Free(self._crcs)

    @property
    def nblocks(self) -> int:
        return self._nblocks

    cdef int _seg_of(self, size_t offset) noexcept nogil:
        """The segment holding payload byte ``offset`` (binary search; segments are few)."""
        cdef int lo = 0, hi = self._nseg - 1, mid
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if self._start[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def ranges(self, size_t start, size_t nbytes):
        """Caller memory covering payload bytes ``[start, start + nbytes)``, as a list of
        ``(address, length)``, adjacent segments merged."""
        if nbytes == 0 or start + nbytes > self.length:
            raise ValueError(f"payload range [{start}, {start + nbytes}) outside a {self.length}-byte page")
        out = []
        cdef int s = self._seg_of(start)
        cdef size_t off, n, addr
        cdef size_t last_end = 0
        while nbytes:
            off = start - self._start[s]
            n = min(nbytes, self._len[s] - off)
            if n:
                addr = self._addr[s] + off
                if out and addr == last_end:  # (no negative indexing: the module turns wraparound off)
                    prev = out[len(out) - 1]
                    out[len(out) - 1] = (prev[0], prev[1] + n)
                else:
                    out.append((addr, n))
                last_end = addr + n
                start += n
                nbytes -= n
            s += 1
        return out

    def check(self, int j0, int j1, staging=None, skip=0):
        """Verify blocks ``j0 .. j1-1``; returns a bitmask of those that failed (bit ``j - j0``).

        :param staging: None (the blocks were read straight into caller memory), or one buffer
            address per block: the block's bytes are copied from there into the caller's segments
            while their checksum is taken.
        :param skip: bitmask (bit ``j - j0``) of blocks to leave alone (already delivered).
        """
        if j0 < 0 or j1 > self._nblocks or j0 >= j1:
            raise ValueError(f"blocks [{j0}, {j1}) outside a page of {self._nblocks}")
        cdef int n = j1 - j0
        cdef int i
        cdef size_t *src = NULL
        cdef unsigned char *flags = <unsigned char *>PyMem_Malloc(n)
        if flags == NULL:
            raise MemoryError()
        try:
            if staging is not None:
                if len(staging) != n:
                    raise ValueError(f"{len(staging)} staging buffers for {n} blocks")
                src = <size_t *>PyMem_Malloc(n * sizeof(size_t))
                if src == NULL:
                    raise MemoryError()
                for i in range(n):
                    src[i] = staging[i]
            for i in range(n):
                flags[i] = (skip >> i) & 1  # 1: skip
            with nogil:
                self._check(j0, n, src, flags)
            bad = 0
            for i in range(n):
                if flags[i] == 2:
                    bad |= (<object>1) << i  # a Python int: pages have up to 900 blocks
            return bad
        finally:
            PyMem_Free(src)
            PyMem_Free(flags)

    cdef void _check(self, int j0, int n, size_t *src, unsigned char *flags) noexcept nogil:
        """flags[i]: 1 = skip; 0 -> 2 when block j0+i fails its checksum."""
        cdef int i, s
        cdef size_t start, left, off, piece
        cdef uint32_t crc
        cdef const char *from_
        for i in range(n):
            if flags[i]:
                continue
            start = <size_t>(j0 + i) * self.block
            left = min(self.block, self.length - start)
            from_ = <const char *>src[i] if src != NULL else NULL
            crc = 0
            s = self._seg_of(start)
            while left:
                off = start - self._start[s]
                piece = min(left, self._len[s] - off)
                if piece:
                    if from_ != NULL:
                        crc = kv_crc32c_copy(crc, <void *>(self._addr[s] + off), from_, piece)
                        from_ += piece
                    else:
                        crc = kv_crc32c(crc, <const void *>(self._addr[s] + off), piece)
                    start += piece
                    left -= piece
                s += 1
            if crc != self._crcs[j0 + i]:
                flags[i] = 2
