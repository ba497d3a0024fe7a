"""The benchmark's pages: keys, deterministic contents, and a cheap check of what was read back.

Page ``j`` of the data set holds ``base XOR j`` (64-bit words), with ``base`` one random page drawn
once from the seed: every page differs, filling one costs a memory pass (no RNG per page), and any
sampled 4 KiB block of a read-back page can be checked against its expected value.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .geometry import Geometry

CHECK_BLOCK = 4096  # bytes compared at each end of a sampled page
POISON = 0xA5  # byte written over the sampled blocks before a read, so stale data cannot pass


@dataclass(frozen=True)
class Batch:
    index: int  # data-set batch number
    pages: range  # data-set page numbers
    keys: tuple[str, ...]


class Dataset:
    """``n_batches`` batches of ``batch_pages`` pages of ``geometry``, keyed like sglang (64 hex chars)."""

    def __init__(self, geometry: Geometry, batch_pages: int, n_batches: int, seed: int = 0):
        self.geometry = geometry
        self.batch_pages = batch_pages
        self.n_batches = n_batches
        self.seed = seed
        words = geometry.page_bytes // 8
        self._base = np.random.default_rng(seed).integers(0, 1 << 63, size=words, dtype=np.uint64)
        self.batches = [
            Batch(b, range(b * batch_pages, (b + 1) * batch_pages),
                  tuple(self.key(j) for j in range(b * batch_pages, (b + 1) * batch_pages)))
            for b in range(n_batches)
        ]

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.batch_pages * self.n_batches

    def key(self, page: int) -> str:
        return hashlib.sha256(f"kvstream-bench:{self.seed}:{page}".encode()).hexdigest()

    def fill(self, page: int, out: np.ndarray) -> None:
        """Write page ``page``'s bytes into ``out`` (a uint8 view of ``page_bytes``)."""
        np.bitwise_xor(self._base, np.uint64(page), out=out.view(np.uint64))

    def expected_block(self, page: int, offset: int, nbytes: int = CHECK_BLOCK) -> bytes:
        w0, w1 = offset // 8, (offset + nbytes) // 8
        return (self._base[w0:w1] ^ np.uint64(page)).tobytes()

    def sample(self, batch: Batch, k: int) -> list[int]:
        """``k`` positions within the batch to check (first, last, and spread between)."""
        n = len(batch.pages)
        if k >= n:
            return list(range(n))
        return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def page_segments(address: int, geometry: Geometry, n: int) -> list[list[tuple[int, int]]]:
    """``n`` consecutive pages from ``address``: each a list of ``(address, nbytes)`` segments (K, V)."""
    out = []
    for i in range(n):
        off, segs = address + i * geometry.page_bytes, []
        for s in geometry.segments:
            segs.append((off, s))
            off += s
        out.append(segs)
    return out


def page_views(buf: memoryview | np.ndarray, page_bytes: int, n: int) -> list[np.ndarray]:
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    return [arr[i * page_bytes:(i + 1) * page_bytes] for i in range(n)]


def poison(views: Sequence[np.ndarray], positions: Sequence[int]) -> None:
    for i in positions:
        views[i][:CHECK_BLOCK] = POISON
        views[i][-CHECK_BLOCK:] = POISON


def check(ds: Dataset, batch: Batch, views: Sequence[np.ndarray], positions: Sequence[int],
          found: Sequence[bool]) -> list[int]:
    """Positions among ``positions`` (found pages only) whose first or last block is wrong."""
    bad = []
    pb = ds.page_bytes
    for i in positions:
        if not found[i]:
            continue
        page = batch.pages[i]
        v = views[i]
        if (v[:CHECK_BLOCK].tobytes() != ds.expected_block(page, 0)
                or v[-CHECK_BLOCK:].tobytes() != ds.expected_block(page, pb - CHECK_BLOCK)):
            bad.append(i)
    return bad
