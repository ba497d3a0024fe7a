"""segments.py: the one walk over byte ranges of a page's (address, nbytes) segments."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream_hicache.segments import Payload, copy_payload, nbytes


def _segments(arrays) -> list[tuple[int, int]]:
    return [(a.ctypes.data, a.nbytes) for a in arrays]


def test_pieces_straddle_segments_and_skip_empty_ones():
    parts = [np.arange(5, dtype=np.uint8), np.zeros(0, np.uint8), np.arange(5, 12, dtype=np.uint8),
             np.zeros(0, np.uint8)]
    segs = _segments(parts)
    payload = Payload(segs)
    assert payload.nbytes == nbytes(segs) == 12 and payload.starts == [0, 5, 5, 12]
    assert list(payload.pieces(3, 4)) == [(segs[0][0] + 3, 2), (segs[2][0], 2)]
    assert list(payload.pieces(5, 7)) == [(segs[2][0], 7)]  # starts exactly on a segment
    assert list(payload.pieces(12, 0)) == [] and list(payload.pieces()) == [segs[0], segs[2]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.data())
def test_scatter_and_gather_match_the_concatenation(lengths, data):
    total = sum(lengths)
    start = data.draw(st.integers(0, total))
    n = data.draw(st.integers(0, total - start))
    src = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8)
    parts = [np.zeros(k, np.uint8) for k in lengths]
    payload = Payload(_segments(parts))
    payload.scatter(src.ctypes.data + start, start, n)  # lands at [start, start + n) of the concatenation
    flat = np.concatenate(parts)
    assert np.array_equal(flat[start:start + n], src[start:start + n])
    assert not flat[:start].any() and not flat[start + n:].any()
    out = np.zeros(total, np.uint8)
    payload.gather(out.ctypes.data, start, n)
    assert np.array_equal(out[:n], src[start:start + n])


def test_copy_payload_across_boundaries():
    buf = (ctypes.c_char * 16)()
    src = (ctypes.c_char * 16).from_buffer_copy(bytes(range(16)))
    assert copy_payload([(ctypes.addressof(src), 16)], [(ctypes.addressof(buf), 5), (ctypes.addressof(buf) + 5, 11)])
    assert bytes(buf) == bytes(range(16))
    assert not copy_payload([(ctypes.addressof(src), 16)], [(ctypes.addressof(buf), 8)])


@pytest.mark.parametrize("page", [None, []])
def test_nbytes_of_an_unmapped_page_is_zero(page):
    assert nbytes(page) == 0
