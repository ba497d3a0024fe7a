# Included by _uring.pyx: raw caller memory, crc32c and copy.
#
# ``crc32c`` and ``copy`` take buffer objects or raw ``(address, length)`` memory (the engine hands
# them caller segments and staging buffers by address) and release the GIL for large inputs.

cdef extern from "crc32c.h" nogil:
    void kv_crc32c_init()
    uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n)
    uint32_t kv_crc32c_sw(uint32_t crc, const void *buf, size_t n)
    int kv_crc32c_hardware()

kv_crc32c_init()  # tables and the CPU check, once, under the import lock

CRC32C_IMPL = "sse4.2-3way" if kv_crc32c_hardware() else "table"

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
