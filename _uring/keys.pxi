# Included by _uring.pyx: KeyTable, the index's key -> slot map (kvstream_hicache/index.py), in C.
#
# SGLang's prefetch thread asks contains/prefix_len of every request on its critical path; a probe
# of the packed index written in Python cost several times a dict lookup. Here a lookup costs about
# what a dict's does (docs/benchmarks.md "Scale"): the key's cached str hash picks one of the
# sub-tables (open addressing, linear probing, entries slot + 1, 0 never used, -1 deleted), and an
# entry whose hash matches is checked against the key itself, a 64-hex key as its 32 bytes. The
# columns stay the index's (its ``array``s and ``bytearray``, grown in place); only the sub-tables
# live here. Every method holds the GIL and, once it has the key's hash, runs no Python code, so a
# lookup without the index lock sees one moment of the table: never a sub-table half rebuilt, never
# a row freed between finding it and reading its tiers.

cdef enum:
    _KEY_BYTES = 32
    _ENTRY_EMPTY = 0
    _ENTRY_GONE = -1


# A character's hex value, or _NOT_HEX: decoded by table, not by branches (random digits mispredict
# every other branch, which cost several times the decode itself).
cdef enum:
    _NOT_HEX = 0x10
cdef unsigned char _HEX[256]


cdef void _init_hex() noexcept:
    cdef int c
    memset(_HEX, _NOT_HEX, sizeof(_HEX))
    for c in range(10):
        _HEX[48 + c] = c  # 0-9
    for c in range(6):
        _HEX[97 + c] = 10 + c  # a-f: lowercase only, the form SGLang and LMCache write


_init_hex()


cdef bint _unhex(object key, unsigned char *raw) noexcept:
    """Decode a str of 64 lowercase hex digits into raw[32]; False for any other key."""
    cdef unsigned char *text
    cdef unsigned char hi, lo, bad = 0
    cdef int i
    if not isinstance(key, str) or PyUnicode_GET_LENGTH(key) != 2 * _KEY_BYTES \
            or PyUnicode_KIND(key) != PyUnicode_1BYTE_KIND:
        return False
    text = PyUnicode_1BYTE_DATA(key)
    for i in range(_KEY_BYTES):
        hi = _HEX[text[2 * i]]
        lo = _HEX[text[2 * i + 1]]
        bad |= hi | lo
        raw[i] = <unsigned char>(hi << 4 | (lo & 0xF))
    return not bad & _NOT_HEX


def unhex(key):
    """The 32 bytes of a key of 64 lowercase hex digits, or None (the index keeps such a key as a str)."""
    cdef unsigned char raw[_KEY_BYTES]
    return (<char *>raw)[:_KEY_BYTES] if _unhex(key, raw) else None


cdef class KeyTable:
    """key -> slot over the index's columns: ``hashes`` (array 'q', hash(key) per slot), ``keys``
    (bytearray, 32 bytes per slot), ``odd`` (dict slot -> a key that is not 64-hex) and ``tiers``
    (array 'I', the holders bitmask per slot). The index writes a row's hash and key, then calls
    :meth:`insert`; :meth:`delete` before the row is reused. 2**sub_bits sub-tables: a resize
    re-hashes one of them."""

    cdef carray hashes
    cdef bytearray keys
    cdef dict odd
    cdef carray tiers
    cdef int **subs
    cdef Py_ssize_t *size
    cdef Py_ssize_t *filled  # used + deleted entries
    cdef int sub_bits
    cdef Py_ssize_t nsubs

    def __cinit__(self, carray hashes, bytearray keys, dict odd, carray tiers, int sub_bits=10, int start=8):
        if hashes.ob_descr.typecode != b"q" or tiers.ob_descr.typecode != b"I":
            raise TypeError("KeyTable: hashes must be an array('q'), tiers an array('I')")
        if not 0 <= sub_bits <= 20 or start < 2 or start & (start - 1):
            raise ValueError("KeyTable: sub_bits in 0..20, start a power of two >= 2")
        self.hashes, self.keys, self.odd, self.tiers = hashes, keys, odd, tiers
        self.sub_bits = sub_bits
        self.nsubs = 1 << sub_bits
        self.subs = <int **>PyMem_Calloc(self.nsubs, sizeof(int *))
        self.size = <Py_ssize_t *>PyMem_Calloc(self.nsubs, sizeof(Py_ssize_t))
        self.filled = <Py_ssize_t *>PyMem_Calloc(self.nsubs, sizeof(Py_ssize_t))
        if self.subs is NULL or self.size is NULL or self.filled is NULL:
            raise MemoryError()
        for s in range(self.nsubs):
            self.subs[s] = <int *>PyMem_Calloc(start, sizeof(int))
            if self.subs[s] is NULL:
                raise MemoryError()
            self.size[s] = start

    def __dealloc__(self):
        if self.subs is not NULL:
            for s in range(self.nsubs):
                PyMem_Free(self.subs[s])
        PyMem_Free(self.subs)
        PyMem_Free(self.size)
        PyMem_Free(self.filled)

    @property
    def nbytes(self) -> int:
        """Bytes of the sub-tables (the columns are the index's)."""
        cdef Py_ssize_t total = 0
        for s in range(self.nsubs):
            total += self.size[s]
        return total * sizeof(int) + self.nsubs * (sizeof(int *) + 2 * sizeof(Py_ssize_t))

    cdef Py_ssize_t _find(self, object key) except -2:
        cdef unsigned char raw[_KEY_BYTES]
        cdef Py_hash_t h
        cdef Py_ssize_t s, i, mask, slot, rows
        cdef int e
        cdef int *sub
        cdef long long *hashes
        cdef int hexkey
        if not isinstance(key, str):
            return -1  # the index holds str keys only
        h = PyObject_Hash(key)
        hexkey = -1  # not decoded yet: only a row whose hash matches needs it
        s = h & (self.nsubs - 1)
        sub = self.subs[s]
        mask = self.size[s] - 1
        i = (<uint64_t>h >> self.sub_bits) & mask
        hashes = self.hashes.data.as_longlongs
        rows = Py_SIZE(self.hashes)
        while True:
            e = sub[i]
            if e == _ENTRY_EMPTY:
                return -1
            slot = e - 1
            if e > 0 and slot < rows and hashes[slot] == h:
                if hexkey < 0:
                    hexkey = _unhex(key, raw)
                if self._is(slot, key, raw, hexkey):
                    return slot
            i = (i + 1) & mask

    cdef bint _is(self, Py_ssize_t slot, object key, unsigned char *raw, bint hexkey) except -1:
        cdef PyObject *name
        if self.odd:
            name = PyDict_GetItem(self.odd, slot)
            if name is not NULL:
                return <str>key == <str><object>name
        return hexkey and (slot + 1) * _KEY_BYTES <= PyByteArray_GET_SIZE(self.keys) and \
            memcmp(PyByteArray_AS_STRING(self.keys) + slot * _KEY_BYTES, raw, _KEY_BYTES) == 0

    cdef Py_hash_t _hash_of(self, Py_ssize_t slot) except? -1:
        if not 0 <= slot < Py_SIZE(self.hashes):
            raise IndexError(f"KeyTable: no row {slot}")
        return self.hashes.data.as_longlongs[slot]

    cdef inline unsigned int _tiers_of(self, Py_ssize_t slot) noexcept:
        return self.tiers.data.as_uints[slot] if 0 <= slot < Py_SIZE(self.tiers) else 0

    def find(self, key) -> int:
        """The slot of ``key``, or -1."""
        return self._find(key)

    def holders(self, key) -> int:
        """The tiers holding ``key`` (bitmask; 0: none), read in the same moment as the lookup."""
        return self._tiers_of(self._find(key))

    def contains(self, key, long long mask=-1) -> bool:
        """True when some tier in ``mask`` holds ``key``."""
        return self._tiers_of(self._find(key)) & mask != 0

    def prefix_len(self, keys, long long mask=-1) -> int:
        """Length of the leading run of ``keys`` held by some tier in ``mask``."""
        cdef Py_ssize_t n = 0
        for key in keys:
            if not self._tiers_of(self._find(key)) & mask:
                break
            n += 1
        return n

    def insert(self, Py_ssize_t slot) -> None:
        """Enter ``slot``, whose hash the index has written (a key not in the table)."""
        cdef Py_hash_t h = self._hash_of(slot)
        cdef Py_ssize_t s = h & (self.nsubs - 1)
        cdef Py_ssize_t mask, i
        cdef int *sub
        if 2 * (self.filled[s] + 1) > self.size[s]:
            self._rehash(s)
        sub = self.subs[s]
        mask = self.size[s] - 1
        i = (<uint64_t>h >> self.sub_bits) & mask
        while sub[i] > 0:  # a deleted entry is reused
            i = (i + 1) & mask
        if sub[i] == _ENTRY_EMPTY:
            self.filled[s] += 1
        sub[i] = <int>(slot + 1)

    def delete(self, Py_ssize_t slot) -> None:
        """Take ``slot`` out (its hash still in the column); nothing if it is not in."""
        cdef Py_hash_t h = self._hash_of(slot)
        cdef Py_ssize_t s = h & (self.nsubs - 1)
        cdef int *sub = self.subs[s]
        cdef Py_ssize_t mask = self.size[s] - 1
        cdef Py_ssize_t i = (<uint64_t>h >> self.sub_bits) & mask
        while sub[i] != _ENTRY_EMPTY:
            if sub[i] == slot + 1:
                sub[i] = _ENTRY_GONE
                return
            i = (i + 1) & mask

    cdef int _rehash(self, Py_ssize_t s) except -1:
        """Rebuild sub-table ``s`` without its deleted entries, doubled while more than a quarter full."""
        cdef int *old = self.subs[s]
        cdef Py_ssize_t live = 0, size = self.size[s], j, i, mask
        cdef int *sub
        cdef long long *hashes = self.hashes.data.as_longlongs
        for j in range(self.size[s]):
            live += old[j] > 0
        while 4 * (live + 1) > size:
            size *= 2
        sub = <int *>PyMem_Calloc(size, sizeof(int))
        if sub is NULL:
            raise MemoryError()
        mask = size - 1
        for j in range(self.size[s]):
            if old[j] > 0:
                i = (<uint64_t>hashes[old[j] - 1] >> self.sub_bits) & mask
                while sub[i]:
                    i = (i + 1) & mask
                sub[i] = old[j]
        self.subs[s], self.size[s], self.filled[s] = sub, size, live
        PyMem_Free(old)
        return 0
