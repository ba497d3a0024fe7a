# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""io_uring for batches of file reads and writes, plus the byte helpers the engine needs.

One extension module, ``kvstream_hicache._uring``, built from this file and the four it includes
(one concept each; they share C-level helpers, so they are one module, not five)::

    bytes.pxi     raw ``(address, length)`` memory, ``crc32c`` (crc32c.h: VPCLMULQDQ folding with AVX-512
                  or AVX2, else SSE4.2), ``copy``, and ``PageMap``: a page's payload in caller
                  segments, its blocks checked (and copied in from staging) with the GIL released
    buffers.pxi   ``AlignedBuffer``: aligned memory, huge-page backed from 2 MiB up; ``ALIGN``
    ring.pxi      ``Ring``: one io_uring, batched submit/reap of ``(opcode, fd, buf, offset, tag)``
    keys.pxi      ``KeyTable``: the index's key -> slot map, existence queries at a dict's speed
    files.pxi     ``open_owned``: a page file opened for the ring's reads, its checks in one call

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
from cpython.array cimport array as carray
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject, PyObject_Hash, Py_SIZE
from cpython.unicode cimport PyUnicode_1BYTE_DATA, PyUnicode_1BYTE_KIND, PyUnicode_GET_LENGTH, PyUnicode_KIND
from libc.errno cimport EAGAIN, EBUSY, EINTR, EINVAL, ENOMEM, ENOSPC, ETIME, errno
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free
from libc.string cimport memcmp, memcpy, memset, strerror
from posix.unistd cimport usleep

from liburing cimport *

import os as _os
import time as _time
import warnings as _warnings

include "bytes.pxi"
include "buffers.pxi"
include "ring.pxi"
include "keys.pxi"
include "files.pxi"
