"""A page in caller memory: ``(address, nbytes)`` segments, and the one walk over byte ranges of them.

A page handed to ``put``/``get`` is a list of segments whose concatenation is its payload (sglang's
K and V halves, or its per-layer chunks). Reads copy a block into the segments it straddles, writes
checksum a page block by block and gather it into one staging buffer, the LMCache adapter copies one
page's segments into another's: each is a walk over ``[start, start + nbytes)`` of the concatenation,
which :meth:`Payload.pieces` does for all of them.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

from .io import copy

Segment = tuple[int, int]  # (address, nbytes) of caller memory; a page's payload is the concatenation


def nbytes(segments: Sequence[Segment] | None) -> int:
    """Payload bytes of a page (0 for None: a page that could not be mapped)."""
    return sum(n for _, n in segments) if segments else 0


class Payload:
    """The segments of one page with their offsets in the payload (built once, walked per block)."""

    __slots__ = ("segments", "starts", "nbytes")

    def __init__(self, segments: Sequence[Segment]):
        self.segments = segments
        self.starts = list(itertools.accumulate((n for _, n in segments), initial=0))
        self.nbytes = self.starts.pop()  # starts[i]: payload offset of segments[i]

    def pieces(self, start: int = 0, nbytes: int | None = None) -> Iterator[Segment]:
        """The memory of payload bytes ``[start, start + nbytes)`` as ``(address, n)`` pieces, in order
        (empty segments skipped; a range may straddle segments). Default: the whole payload."""
        if nbytes is None:
            nbytes = self.nbytes - start
        s = bisect.bisect_right(self.starts, start) - 1
        while nbytes > 0:
            address, length = self.segments[s]
            off = start - self.starts[s]
            n = min(nbytes, length - off)
            if n > 0:
                yield address + off, n
                start, nbytes = start + n, nbytes - n
            s += 1

    def scatter(self, src: int, start: int, nbytes: int) -> None:
        """Copy ``nbytes`` of contiguous memory at ``src`` into payload bytes ``[start, start + nbytes)``."""
        for address, n in self.pieces(start, nbytes):
            copy(address, src, n)
            src += n

    def gather(self, dst: int, start: int = 0, nbytes: int | None = None) -> None:
        """Copy payload bytes ``[start, start + nbytes)`` (default: all) into contiguous memory at ``dst``."""
        for address, n in self.pieces(start, nbytes):
            copy(dst, address, n)
            dst += n


def copy_payload(src: Sequence[Segment], dst: Sequence[Segment]) -> bool:
    """Copy the payload of ``src`` into ``dst`` (same total length; segment boundaries may differ).
    False, and nothing copied, when the lengths differ."""
    payload = Payload(src)
    if payload.nbytes != nbytes(dst):
        return False
    offset = 0
    for address, n in dst:
        payload.gather(address, offset, n)
        offset += n
    return True
