"""The bytes of the tests' pages, a pure function of the key, and the namespace they are stored in;
nothing of kvstream is imported here, so a child process running another version's tree
(node.py, test_versions.py) computes the same bytes as the tests (helpers.py re-exports all of it)."""
from __future__ import annotations

import hashlib

import numpy as np

NS_FIELDS = {"model": "reliability-model", "layout": "page_first", "dtype": "bf16", "page": 16, "tp": [0, 1]}
CHUNK = 16 << 10  # small routing blocks: several blocks per page, blocks straddling segments
PAGE_BYTES = 48 << 10  # default payload, bytes (a multiple of 8192: two 4096-aligned halves)


def key(i: int, salt: str = "") -> str:
    """A 64-hex key, as sglang's page hashes."""
    return hashlib.sha256(f"{salt}/{i}".encode()).hexdigest()


def content(k: str, size: int = PAGE_BYTES) -> bytes:
    """The payload stored under ``k``: deterministic, different for every key."""
    seed = hashlib.sha256(repr(k).encode()).digest()[:8]
    rng = np.random.default_rng(int.from_bytes(seed, "little"))
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def twin_content(k: str, who: int) -> bytes:
    """Process ``who``'s bytes for key ``k``: two servers' KV of one prefix need not be bit-identical."""
    return content(f"{k}/twin{who}", PAGE_BYTES)
