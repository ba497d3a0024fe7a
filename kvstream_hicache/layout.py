"""Where pages live and how they are cut: namespace digest, key validation, paths, alignment. No I/O.

Tree of one tier (``root`` is a configured tier directory)::

    <root>/kvstream/                     created at engine start (mode 0700, or 0770 when shared)
        tmp/<digest>.<host>.<pid>.<token>.<seq>.tmp    pages being written, never read (tmpfiles.py)
        <digest>/<key[:2]>/<key>.kvp                  committed pages of one namespace

A page file is a 4096-byte header followed by the payload padded to a multiple of 4096, so every
read and write of a page is O_DIRECT-aligned. The payload is cut into *blocks* (the routing and
checksum unit, ``Config.chunk`` bytes, 1 MiB by default): block ``j`` starts at file offset
``HEADER_SIZE + j * block``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

# ALIGN, the O_DIRECT block (4096 bytes: file offsets, lengths and buffer addresses), is defined once, by
# the I/O layer that needs it; the format below is built on it (header size, padding, block sizes).
from ._uring import ALIGN
from .errors import InvalidKeyError

HEADER_SIZE = ALIGN  # page header, bytes: one O_DIRECT block, so the payload starts aligned
DEFAULT_BLOCK = 1 << 20  # routing / checksum block, bytes
MAX_BLOCKS = 900  # block CRCs that fit in one header (see integrity.py); larger pages get larger blocks
KEY_MAX = 200  # characters; keeps "<key>.kvp" under NAME_MAX (255)
DIGEST_CHARS = 32  # hex characters of the namespace digest (128 bits)

ROOT_DIR = "kvstream"
TMP_DIR = "tmp"
PAGE_SUFFIX = ".kvp"

_KEY_RE = re.compile(r"[0-9A-Za-z_-]{1,%d}" % KEY_MAX)
_DIGEST_RE = re.compile(r"[0-9a-f]{%d}" % DIGEST_CHARS)


def round_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align


def is_aligned(address: int, nbytes: int, align: int = ALIGN) -> bool:
    """True when a memory range can be handed to O_DIRECT as is (address and length aligned)."""
    return address % align == 0 and nbytes % align == 0


# --------------------------------------------------------------------------------------- keys
def is_valid_key(key: object) -> bool:
    """Keys are ``[0-9A-Za-z_-]{1,200}``: sglang's 64-hex page hashes fit; nothing can contain
    ``/``, ``.`` or NUL, so no key can name a path outside its tier directory."""
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def validate_key(key: object) -> str:
    """Return ``key`` or raise :class:`InvalidKeyError` naming the rule."""
    if not is_valid_key(key):
        raise InvalidKeyError(
            f"invalid page key {key!r}: keys must be 1-{KEY_MAX} characters of [0-9A-Za-z_-] "
            "(sglang page hashes are 64 lowercase hex; hash other keys first)"
        )
    return key  # type: ignore[return-value]


# --------------------------------------------------------------------------------- namespace
class Namespace:
    """What makes two pages with the same key interchangeable: model, KV layout, dtype, page
    geometry and, where a page is rank-specific, the tensor/pipeline-parallel rank and size.

    ``digest`` is the first 32 hex characters of the SHA-256 of the canonical JSON of ``fields``
    (sorted keys, no whitespace): a page written under one namespace is never found by another.
    """

    __slots__ = ("fields", "canonical", "digest")

    def __init__(self, fields: Mapping[str, Any]):
        canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        self.fields = json.loads(canonical)  # a private, JSON-clean copy
        self.canonical = canonical
        self.digest = hashlib.sha256(canonical.encode()).hexdigest()[:DIGEST_CHARS]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Namespace({self.canonical}) -> {self.digest}"


def is_digest(name: str) -> bool:
    return _DIGEST_RE.fullmatch(name) is not None


# ---------------------------------------------------------------------------------- geometry
class BlockSpan(NamedTuple):
    """Block ``j`` of a page: payload bytes ``[start, start + nbytes)``, read as ``padded`` bytes
    at file offset ``HEADER_SIZE + start``."""

    start: int
    nbytes: int
    padded: int


def block_size_for(length: int, chunk: int) -> int:
    """Block size of a page of ``length`` payload bytes: ``chunk``, grown (in ALIGN steps) only
    when the page would need more than MAX_BLOCKS checksums in its header."""
    block = chunk
    if -(-length // block) > MAX_BLOCKS:
        block = round_up(-(-length // MAX_BLOCKS))
    return block


def n_blocks(length: int, block: int) -> int:
    return max(1, -(-length // block))


def block_span(length: int, block: int, j: int) -> BlockSpan:
    start = j * block
    nbytes = min(block, length - start)
    return BlockSpan(start, nbytes, round_up(nbytes))


def file_size(length: int) -> int:
    """Bytes a page of ``length`` payload bytes occupies on a tier (header + padded payload)."""
    return HEADER_SIZE + round_up(length)


# ------------------------------------------------------------------------------------- paths
class TierLayout:
    """Paths of one tier for one namespace. Pure string work."""

    __slots__ = ("root", "base", "tmp", "pages")

    def __init__(self, root: str, digest: str):
        self.root = root
        self.base = os.path.join(root, ROOT_DIR)
        self.tmp = os.path.join(self.base, TMP_DIR)
        self.pages = os.path.join(self.base, digest)

    def page_dir(self, key: str) -> str:
        return os.path.join(self.pages, key[:2])

    def page_path(self, key: str) -> str:
        # (one per page read: a format string costs a fifth of os.path.join, and a valid key holds no '/')
        return f"{self.pages}/{key[:2]}/{key}{PAGE_SUFFIX}"


def key_of_page_file(name: str) -> str | None:
    """The key a page file name claims, or None for a name no engine writes."""
    if not name.endswith(PAGE_SUFFIX):
        return None
    key = name[: -len(PAGE_SUFFIX)]
    return key if is_valid_key(key) else None
