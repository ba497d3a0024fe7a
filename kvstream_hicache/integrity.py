"""Page header, checksums, start-up scan and the consistency check.

Header (one 4096-byte block at file offset 0, little endian)::

    off  size  field
      0     8  magic            b"KVSTPAGE"
      8     2  format version   1
     10     2  flags            0 (none this format knows of)
     12     4  block            bytes per block (multiple of 4096)
     16     8  length           payload bytes (before padding)
     24     8  created_ns       write time (orders LRU at start-up)
     32    16  namespace digest (the 32 hex characters as 16 bytes)
     48     2  key length
     64   200  key              ASCII, zero padded
    272  4*n   block CRCs       crc32c of each block's payload bytes, n = ceil(length / block)
   4092     4  header CRC       crc32c of bytes [0, 4092)

A page is served only when its header CRC, magic, version, namespace digest and key match what
the reader expects, and each block's crc32c matches the CRC the index holds for it. A valid header
of a later format (a version above this one's, or flags set) is another kvstream version's page on a
tier the two share during a rolling upgrade: never served here, and never removed (NewerFormat).
crc32c (Castagnoli) rather than xxh3: the ring module computes it with SSE4.2 and the GIL
released, so verifying costs a fraction of the memcpy that follows (figures in docs/design.md).
"""
from __future__ import annotations

import enum
import errno
import fcntl
import os
import stat
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from .fds import close_fd
from .io import crc32c, open_owned  # (crc32c: SSE4.2 or folded, the GIL released for large inputs)
from .config import setting_source
from .probe import Look, answering, check_overlap, let_go
from .layout import (
    ALIGN, HEADER_SIZE, KEY_MAX, MAX_BLOCKS, PAGE_SUFFIX, TierLayout, block_span, file_size, is_digest,
    is_valid_key, key_of_page_file, n_blocks,
)
from .segments import Payload, Segment
from .tmpfiles import REMOVING_PREFIX, Leftovers, is_engine_tmp, parse_mark, removal_live, tier_now
from .trust import (
    LOOK_FLAGS, NODE_ERRNOS, Trust, describe, dir_findings, dir_fix, holds, identity, learn, list_below, not_a_file,
    not_trusted, open_below, owner_problem, pin, put_back, remove, same_file,
)

if TYPE_CHECKING:
    from .config import Config
    from .layout import Namespace

MAGIC = b"KVSTPAGE"
VERSION = 1
_FIXED = struct.Struct("<8sHHIQQ16sH")  # magic .. key length (50 bytes)
_COPIED = struct.Struct("<Q")  # at 50: a catch-up copy's own write time (bytes 50..63 were zero in every writer of
# format 1 before it, and readers of format 1 skip them: a copy's header reads the same to them)
_KEY_OFF = 64
_CRC_OFF = 272
_HCRC_OFF = HEADER_SIZE - 4

assert _CRC_OFF + 4 * MAX_BLOCKS <= _HCRC_OFF and _KEY_OFF + KEY_MAX <= _CRC_OFF
assert _FIXED.size + _COPIED.size <= _KEY_OFF

class HeaderError(ValueError):
    """A page header that must not be trusted; ``str()`` says why."""


class NewerFormat(HeaderError):
    """A valid header (magic and header CRC) of a later format than this one: a format version above
    VERSION, or flags this format does not know (every writer of version 1 writes 0; a later one may
    mark a payload compressed, quantized or laid out otherwise). Another kvstream version's page, on a
    tier old and new nodes share while an upgrade rolls: this version cannot tell what its bytes mean,
    so it never serves nor indexes it, and it is a valid page of that version, so it never removes it
    either (Reason.NEWER). A later format keeps the magic, version, flags and header CRC where they are."""


class PageHeader(NamedTuple):
    key: str
    digest: str
    length: int
    block: int
    crcs: tuple[int, ...]
    created_ns: int = 0  # the page's version: its put's time (a catch-up copy keeps it)
    copied_ns: int = 0  # a catch-up copy's own time, by its copier's clock (0: the put's own file)

    @property
    def writer_ns(self) -> int:
        """This file's write stamp (write_stamp)."""
        return write_stamp(self.created_ns, self.copied_ns)


def write_stamp(created_ns: int, copied_ns: int) -> int:
    """A page file's write stamp, which its writer's filter knows (Index.wrote): a catch-up copy's own
    time, else the put's. Another process's copy of this process's page keeps the page's ``created``
    but carries its own stamp (review simp: before, it passed for this process's). The one rule for a
    header read back (PageHeader.writer_ns) and a page about to be written (WritePage.writer_ns)."""
    return copied_ns or created_ns


def pack_header(header: PageHeader, into) -> None:
    """Write ``header`` into the first HEADER_SIZE bytes of the writable buffer ``into``."""
    view = memoryview(into).cast("B")
    try:
        view[:HEADER_SIZE] = bytes(HEADER_SIZE)
        key = header.key.encode("ascii")
        _FIXED.pack_into(view, 0, MAGIC, VERSION, 0, header.block, header.length, header.created_ns,
                         bytes.fromhex(header.digest), len(key))
        _COPIED.pack_into(view, _FIXED.size, header.copied_ns)
        view[_KEY_OFF:_KEY_OFF + len(key)] = key
        struct.pack_into(f"<{len(header.crcs)}I", view, _CRC_OFF, *header.crcs)
        struct.pack_into("<I", view, _HCRC_OFF, crc32c(view[:_HCRC_OFF]))
    finally:
        view.release()


def unpack_header(data) -> PageHeader:
    """Parse and validate a header; raise :class:`HeaderError` for anything inconsistent."""
    if not isinstance(data, bytes):
        data = bytes(memoryview(data).cast("B")[:HEADER_SIZE])
    if len(data) < HEADER_SIZE:
        raise HeaderError(f"header truncated ({len(data)} of {HEADER_SIZE} bytes)")
    (stored_crc,) = struct.unpack_from("<I", data, _HCRC_OFF)
    if crc32c(data[:_HCRC_OFF]) != stored_crc:
        raise HeaderError("header checksum mismatch")
    magic, version, flags, block, length, created, digest, key_len = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise HeaderError("bad magic")
    if version > VERSION:
        raise NewerFormat(f"format version {version}, a later one than this kvstream's ({VERSION})")
    if version != VERSION:  # (0: no kvstream ever wrote it)
        raise HeaderError(f"unsupported format version {version}")
    if flags:
        raise NewerFormat(f"header flags {flags:#06x}, which format version {VERSION} does not know")
    if block <= 0 or block % ALIGN or key_len > KEY_MAX:
        raise HeaderError(f"bad geometry (block={block}, key length={key_len})")
    count = n_blocks(length, block)
    if count > MAX_BLOCKS:
        raise HeaderError(f"too many blocks ({count})")
    key = data[_KEY_OFF:_KEY_OFF + key_len].decode("ascii", "replace")
    if not is_valid_key(key):
        raise HeaderError(f"invalid key {key!r}")
    return PageHeader(key, digest.hex(), length, block, struct.unpack_from(f"<{count}I", data, _CRC_OFF), created,
                      _COPIED.unpack_from(data, _FIXED.size)[0])


def block_crcs(segments: Sequence[Segment], length: int, block: int) -> tuple[int, ...]:
    """crc32c of each block of the payload formed by concatenating raw ``(address, nbytes)``
    segments; a block may straddle segments (the CRC is chained across them)."""
    payload = Payload(segments)
    crcs = []
    for j in range(n_blocks(length, block)):
        span = block_span(length, block, j)
        crc = 0
        for piece in payload.pieces(span.start, span.nbytes):
            crc = crc32c(piece, crc)
        crcs.append(crc)
    return tuple(crcs)


# ------------------------------------------------------------------------------------ scanning
class Reason(str, enum.Enum):
    """Why a file is a problem, for code to act on (``Problem.detail`` says it for people). A str:
    ``check --json`` writes its value."""

    INVALID = "invalid"  # read, and not a valid page there (header, checksum, length, place, name, type)
    UNREADABLE = "unreadable"  # an I/O error kept it from being read: the file itself may be valid
    VANISHED = "vanished"  # removed while being looked at (another process, an operator): not a problem
    LEFTOVER = "leftover"  # a temporary file of a writer that is gone
    UNTRUSTED = "untrusted"  # a file or directory of an owner the engine does not trust (trust.py): left alone
    INDEX = "index"  # the index and the disk disagree
    RESTORE = "restore"  # a valid page a removal left under its private name (its process died): goes back
    NEWER = "newer"  # a later format's page (another kvstream version's, integrity.NewerFormat): left alone


class Problem(NamedTuple):
    """One finding of :func:`check_tiers` / ``Engine.check``.

    kind: 'damaged' (header unusable), 'corrupt' (a payload block fails its CRC), 'truncated',
    'misplaced' (header names another key or namespace than the file's place), 'newer_format' (a page of
    a later format, :class:`NewerFormat`: another kvstream version's, never served, never removed), 'orphan_tmp',
    'stray' (a file no engine writes, a link, a directory), 'untrusted' (a file or directory of an owner
    this engine does not trust: never read, never removed), 'index_missing' (valid on disk, not indexed),
    'index_stale' (indexed, and not on disk, or on disk with other content: another writer's version),
    'missing_tier' (a tier directory that does not exist or is none: nothing there was checked),
    'unreadable' (a tier directory, or one of kvstream's in it, this user cannot list, or a tier that did not
    answer in write_timeout, Engine.check's and check_tiers' first look: the rest of that tier was not checked).
    """

    kind: str
    tier: str
    path: str
    detail: str
    reason: Reason
    fixed: bool = False
    ident: tuple | None = None  # the file judged (trust.identity; NOT_A_FILE): a fix removes only that one

    def judged(self, held: int | None) -> Callable[[os.stat_result], bool] | None:
        """trust.remove's ``judged`` for the entry this problem was found in: only that very file, held
        open (``held``: trust.pin, or the descriptor read) from before it was judged to its removal, so
        that its inode cannot have gone to another file meanwhile (or, for an entry judged no regular
        file, only a non-file) goes; a file judged but not held goes not at all. None: nothing was judged
        (a name no page has, a temporary leftover), whatever is there goes."""
        if self.ident is None:
            return None
        if self.ident == NOT_A_FILE:
            return not_a_file
        return same_file(self.ident) if holds(held, self.ident) else lambda st: False


NOT_A_FILE = ()  # Problem.ident of an entry judged no regular file (a FIFO, a socket, ... under a page's name)


class ScannedPage(NamedTuple):
    path: str
    header: PageHeader | None  # None: see problem
    problem: Problem | None
    file_bytes: int
    # the file's write time (st_mtime_ns): a catch-up copy keeps its header's ``created`` (the page's first
    # write), its file is new (trust.written_ns: another process's since this one began, Index THEIRS)
    mtime_ns: int = 0


class NotRegularFile(OSError):
    """An entry under a page's name that is not a regular file (a FIFO, socket, device, directory or
    symbolic link): a stray, never read. ``errno`` is EISDIR for a directory, else EINVAL (neither
    fails a tier)."""


class UntrustedFile(NotRegularFile):
    """A regular file under a page's name whose owner the engine does not trust (trust.py): never read
    past its fstat, never indexed, never removed."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """'a directory', 'a FIFO (named pipe)', ... for an ``st_mode`` that is not a regular file's."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, flags: int | None = None, *, trust: Trust) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading, refusing anything but a regular file of an owner in ``trust`` (a
    link is refused by O_NOFOLLOW, never followed); returns (fd, its stat).

    The open itself is O_NONBLOCK: opening a FIFO for reading blocks until a writer appears, so a FIFO
    planted under a page's name would hang start-up, ``check`` or a read forever; O_NONBLOCK opens it
    at once and ``fstat`` tells it apart. With ``flags`` (reads through the ring: O_DIRECT), ``F_SETFL``
    then sets them and clears O_NONBLOCK, which io_uring would honour with EAGAIN instead of waiting;
    plain ``pread`` ignores O_NONBLOCK on a regular file, so without ``flags`` nothing more is done.
    :raises NotRegularFile: not a regular file (:class:`UntrustedFile`: not a trusted owner's).
    :raises OSError: the open failed."""
    try:
        fd = os.open(path, LOOK_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(errno.EINVAL, "a symbolic link", path) from None
        if exc.errno in NODE_ERRNOS:  # a socket, a device: the entry's, not the tier's (trust.NODE_ERRNOS)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(errno.EINVAL, file_kind(st.st_mode), path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL, file_kind(st.st_mode),
                                 path)
        if not trust.owns(st):
            raise UntrustedFile(errno.EINVAL, not_trusted(st), path)
        if flags is not None:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except BaseException:
        close_fd(fd)
        raise
    return fd, st


def open_direct(path: str, trust: Trust) -> int:
    """``open_regular(path, os.O_DIRECT, trust=trust)``'s descriptor: the read path's, one per page it
    reads. The checks run in one C call (``_uring.open_owned``); anything but a trusted regular file
    that opened, and any failed call, goes through ``open_regular`` again, which raises what was wrong.
    :raises NotRegularFile: :raises OSError: as ``open_regular``."""
    fd = open_owned(os.fsencode(path), os.O_DIRECT, trust.uids, -1 if trust.gid is None else trust.gid)
    return fd if fd >= 0 else open_regular(path, os.O_DIRECT, trust=trust)[0]


def open_with_header(path: str, trust: Trust) -> tuple[int, PageHeader, os.stat_result]:
    """Open one page file (of an owner in ``trust``) and read and validate its header: (the descriptor,
    the header, the file's stat); the descriptor is the caller's to close. Its payload is read through
    that descriptor (verify_payload), never through the name again: another process of the namespace
    may remove the page or rename its own version over the name at any moment, and a payload read
    through a second open would be judged against the first file's header (a valid page reported
    'corrupt', or 'unreadable' once it is gone).
    :raises HeaderError: unusable header (its ``stat``: the file's). :raises NotRegularFile: not a
    regular file (or not a trusted owner's). :raises OSError: the file cannot be read."""
    fd, st = open_regular(path, trust=trust)
    try:
        try:
            return fd, unpack_header(os.pread(fd, HEADER_SIZE, 0)), st
        except HeaderError as exc:
            exc.stat = st  # (the file judged: check --fix removes only that one)
            raise
    except BaseException:
        close_fd(fd)
        raise


def read_header(path: str, trust: Trust | None = None) -> tuple[PageHeader, os.stat_result]:
    """Read and validate the header of one page file (of an owner in ``trust``, default: this user);
    returns (header, the file's stat). :raises: as :func:`open_with_header`."""
    fd, header, st = open_with_header(path, trust or Trust.user())
    close_fd(fd)  # (a read: an error from close, e.g. ESTALE, changes nothing read)
    return header, st


VERIFY_PIECE = 4 << 20  # a block is read for its check at most this much at a time (a header's block size
# is another writer's word, up to 4 GiB: never the size of one allocation)


def block_crc(fd: int, length: int, block: int, j: int) -> int | None:
    """CRC32C of block ``j`` of the page file open on ``fd`` (buffered reads); None when the file ends
    before the block does."""
    span = block_span(length, block, j)
    crc, done = 0, 0
    while done < span.nbytes:
        data = os.pread(fd, min(VERIFY_PIECE, span.nbytes - done), HEADER_SIZE + span.start + done)
        if not data:
            return None
        crc, done = crc32c(data, crc), done + len(data)
    return crc


def verify_payload(fd: int, header: PageHeader) -> str | None:
    """Read the whole payload (buffered) of the page file open on ``fd``, the file ``header`` was read
    from (:func:`open_with_header`), and check every block CRC; None when intact."""
    for j, want in enumerate(header.crcs):
        crc = block_crc(fd, header.length, header.block, j)
        if crc is None:
            return f"block {j} truncated"
        if crc != want:
            return f"block {j} checksum mismatch"
    return None


LINKED = "a symbolic link (or a file) where kvstream keeps a directory: never followed"


def shards(layout: TierLayout) -> list[str]:
    """The ``<key[:2]>`` directories of one namespace on one tier (listed through a descriptor that
    followed no link). :raises OSError: ELOOP/ENOTDIR: the namespace directory is a link or a file."""
    try:
        return sorted(list_below(layout.root, layout.pages))
    except FileNotFoundError:
        return []


def shard_entries(layout: TierLayout, shard: str) -> list[tuple[str | None, str]]:
    """(name, path) of every entry of one shard directory, listed through a descriptor that followed
    no link; ``[(None, path)]`` when the shard is a link or a file (a stray: kvstream keeps only
    <key[:2]> directories there). :raises OSError: the shard cannot be listed."""
    path = os.path.join(layout.pages, shard)
    try:
        return [(name, f"{path}{os.sep}{name}") for name in list_below(layout.root, path)]
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        return [(None, path)]


def each_shard_entry(layout: TierLayout, shard: str) -> Iterator[tuple[str | None, str]]:
    """:func:`shard_entries` one at a time, no list of them (the background scan: another user may keep
    millions of files in one shard, ~260 B an entry as a list). Entries renamed or made in the shard
    while it is read may be named twice or not at all (a page written meanwhile is indexed by its put; one
    named twice is judged twice). :raises OSError: the shard cannot be listed (at its first entry, or
    while it is read)."""
    path = os.path.join(layout.pages, shard)
    try:
        fd = open_below(layout.root, path)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        yield None, path
        return
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                yield entry.name, f"{path}{os.sep}{entry.name}"
    finally:
        close_fd(fd)


def scan_entry(layout: TierLayout, digest: str, shard: str, name: str | None, path: str, *,
               trust: Trust | None = None, payload: bool = False) -> ScannedPage:
    """One entry of :func:`shard_entries`, validated (see :func:`scan_pages`): opened O_NOFOLLOW and
    read only when of an owner in ``trust`` (default: this user)."""
    if name is None:  # a link is never followed, a file where a shard belongs is a stray
        linked = os.path.islink(path)
        problem = Problem("stray", layout.root, path, LINKED if linked else "not a shard directory", Reason.INVALID)
        return ScannedPage(path, None, problem, 0)
    return _scan_one(layout, digest, shard, name, path, payload, trust or Trust.user())


def scan_shard(layout: TierLayout, digest: str, shard: str, *, trust: Trust | None = None,
               payload: bool = False) -> list[ScannedPage]:
    """Every file of one shard directory, validated (see :func:`scan_pages`)."""
    trust = trust or Trust.user()
    return [scan_entry(layout, digest, shard, name, path, trust=trust, payload=payload)
            for name, path in shard_entries(layout, shard)]


def scan_file(layout: TierLayout, digest: str, key: str, *, trust: Trust | None = None,
              payload: bool = False) -> ScannedPage:
    """The page file of ``key`` on one tier, validated (a missing file: a Reason.VANISHED 'stray'); with
    ``payload`` every block is checked against the file's own header too."""
    return _scan_one(layout, digest, key[:2], key + PAGE_SUFFIX, layout.page_path(key), payload, trust or Trust.user())


def scan_pages(layout: TierLayout, digest: str, *, trust: Trust | None = None,
               payload: bool = False) -> Iterator[ScannedPage]:
    """Every page file of one namespace on one tier, validated against its place (and, with
    ``payload=True``, its block CRCs). Files that vanish while scanning are skipped. A link where a
    directory belongs is a stray, never followed."""
    try:
        names = shards(layout)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        yield ScannedPage(layout.pages, None, Problem("stray", layout.root, layout.pages, LINKED, Reason.INVALID), 0)
        return
    for shard in names:
        yield from scan_shard(layout, digest, shard, payload=payload, trust=trust)


def _scan_one(layout: TierLayout, digest: str, shard: str, name: str, path: str, payload: bool,
              trust: Trust) -> ScannedPage:
    def bad(kind: str, detail: str, size: int = 0, reason: Reason = Reason.INVALID, st=None, ident=None
            ) -> ScannedPage:
        ident = identity(st) if st is not None else ident
        return ScannedPage(path, None, Problem(kind, layout.root, path, detail, reason, ident=ident), size)

    def unreadable(kind: str, exc: OSError, size: int = 0) -> ScannedPage:
        return bad(kind, f"unreadable: {os.strerror(exc.errno or errno.EIO)}", size, Reason.UNREADABLE)

    def gone() -> ScannedPage:  # (ESTALE: on a network tier another node replaced or deleted it since it was
        # opened or listed, as ENOENT on a local one; `kvstream check` on a node while another replaced its
        # pages reported 'unreadable: Stale file handle' and exited 1)
        return bad("stray", "vanished during the scan", reason=Reason.VANISHED)

    def newer(exc: NewerFormat) -> ScannedPage:
        return bad("newer_format", f"{exc}: a page of a later kvstream (nodes of two versions share the tier "
                                   "during an upgrade); never served by this one, never removed", reason=Reason.NEWER)

    if name.startswith(REMOVING_PREFIX):
        return _left_by_removal(layout, digest, shard, path, trust, bad, newer)
    key = key_of_page_file(name)
    if key is None or key[:2] != shard:
        return bad("stray", "not a page file name")
    for last in (False, True):  # ESTALE, read once more: on a network tier another node renamed a new version
        # over the name since it was looked up or opened, and the name's file now may be a valid page, which
        # the scan indexes (taken for a vanished page, it was never read again: with discover=0 a miss for good)
        try:
            fd, header, st = open_with_header(path, trust)
        except FileNotFoundError:
            return gone()
        except UntrustedFile as exc:
            return bad("untrusted", f"{exc.strerror}: never read, never removed", reason=Reason.UNTRUSTED)
        except NotRegularFile as exc:
            return bad("stray", f"{exc.strerror}, not a page file", ident=NOT_A_FILE)
        except NewerFormat as exc:
            return newer(exc)
        except HeaderError as exc:
            return bad("damaged", str(exc), st=getattr(exc, "stat", None))
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                return unreadable("damaged", exc)
            if last:
                return gone()
            continue
        try:  # (the header's file, whatever is under the name by now: open_with_header)
            size = st.st_size
            if header.digest != digest or header.key != key:
                return bad("misplaced", f"header names key {header.key} of namespace {header.digest}", size, st=st)
            if size < file_size(header.length):
                return bad("truncated", f"{size} bytes, expected {file_size(header.length)}", size, st=st)
            if payload:
                try:
                    why = verify_payload(fd, header)
                except OSError as exc:
                    if exc.errno != errno.ESTALE:
                        return unreadable("corrupt", exc, size)
                    if last:
                        return gone()
                    continue
                if why:
                    return bad("corrupt", why, size, st=st)
            return ScannedPage(path, header, None, size, st.st_mtime_ns)
        finally:
            close_fd(fd)
    raise AssertionError("unreachable")  # (the loop's last pass returns)


def _left_by_removal(layout: TierLayout, digest: str, shard: str, path: str, trust: Trust, bad, newer
                     ) -> ScannedPage:
    """An entry trust.remove renamed to its private name to judge it (tmpfiles.removing_name). Its
    process alive: left alone (it renames it back, or removes it, in microseconds). Its process died
    between the two renames: the entry may be a valid page another writer renamed over the name judged
    (an acknowledged put): a valid page of this place goes back under its name (Reason.RESTORE,
    fix_problem); a later format's page stays (``newer``: this version cannot tell its place; one of
    that version puts it back); anything else (the file judged) goes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return bad("stray", "vanished during the scan", reason=Reason.VANISHED)
    except OSError as exc:
        return bad("stray", f"unreadable: {os.strerror(exc.errno or errno.EIO)}", reason=Reason.UNREADABLE)
    if removal_live(os.path.basename(path), st.st_ctime, layout.tmp, lambda: tier_clock(layout)):
        return bad("stray", "judged by a removal in progress", reason=Reason.VANISHED)  # (not a problem)
    try:
        fd, header, st = open_with_header(path, trust)
        try:
            why = verify_payload(fd, header) if header.digest == digest and header.key[:2] == shard and \
                st.st_size >= file_size(header.length) else "not a page of this place"
        finally:
            close_fd(fd)
    except NewerFormat as exc:
        return newer(exc)
    except HeaderError as exc:
        return bad("stray", f"left by a removal cut short: {exc}", st=getattr(exc, "stat", None))
    except NotRegularFile as exc:
        return bad("stray", f"left by a removal cut short: {exc.strerror}", ident=NOT_A_FILE)
    except OSError as exc:
        return bad("stray", f"unreadable: {os.strerror(exc.errno or errno.EIO)}", reason=Reason.UNREADABLE)
    if why:
        return bad("stray", f"left by a removal cut short: {why}", st=st)
    if _holds_valid(os.path.join(os.path.dirname(path), header.key + PAGE_SUFFIX), header, trust):
        return bad("stray", f"a copy of page {header.key} left by a removal cut short; its name holds a valid "
                            "page written since", st=st)  # (this copy goes: one valid copy, under the name)
    return bad("stray", f"page {header.key} left under a removal's private name (its process died): "
                        "put back under its name", reason=Reason.RESTORE, st=st)._replace(header=header)


def tier_clock(layout: TierLayout) -> float | None:
    """The tier's clock (tmpfiles.tier_now) read in its tmp directory reached following no link: a member
    of a shared tier's group may make tmp/ a link to another directory at any moment (the clock's file
    was made and removed in the link's target, and told its file system's clock). None: not read."""
    try:
        fd = open_below(layout.root, layout.tmp)
    except OSError:
        return None
    try:
        return tier_now(layout.tmp, fd)
    finally:
        close_fd(fd)


def _holds_valid(path: str, like: PageHeader, trust: Trust) -> bool:
    """``path`` is a valid page of ``like``'s key and namespace. Anything else under the name (nothing, a
    link, a directory, another owner's file, a damaged page) never makes a valid copy elsewhere go."""
    try:
        fd, header, st = open_with_header(path, trust)
        try:
            return (header.key, header.digest) == (like.key, like.digest) and \
                st.st_size >= file_size(header.length) and verify_payload(fd, header) is None
        finally:
            close_fd(fd)
    except (HeaderError, OSError):
        return False


def restored(page: ScannedPage) -> ScannedPage | None:
    """The page a fixed Reason.RESTORE problem put back (``page`` as judged: its header read under the
    private name), at its own name: the listing that found the private name never lists it."""
    if page.problem is None or page.problem.reason is not Reason.RESTORE or not page.problem.fixed:
        return None
    path = os.path.join(os.path.dirname(page.path), page.header.key + PAGE_SUFFIX)
    return page._replace(path=path, problem=None)


# ------------------------------------------------------------------------------------ check
def check_tier(layout: TierLayout, digest: str, *, trust: Trust | None = None, fix: bool = False, payload: bool = True,
               live_tokens: frozenset[str] | set[str] | None = None, tmp: bool = True, valid: bool = True
               ) -> tuple[list[Problem], dict[str, ScannedPage]]:
    """Check one namespace on one tier: (problems, valid pages by key). With ``fix`` the files
    behind the problems are removed (only files of owners in ``trust``); ``tmp`` also reports (and
    fixes) temporary leftovers, those of no engine in ``live_tokens`` (None: every engine open in this
    process). ``valid=False``: the valid pages are not kept (an empty dict): ``kvstream check`` needs only the
    problems, and a ScannedPage per page of a namespace was ~850 B each (937 MB at 1M pages)."""
    trust = trust or Trust.user()
    problems = dir_problems(layout, trust, base=tmp, pages=True)
    problems += tmp_problems(layout.root, layout.tmp, live_tokens, fix, trust) if tmp else []
    keep, valid = valid, {}
    for page in scan_pages(layout, digest, payload=payload, trust=trust):
        problem = page.problem
        if problem is not None and problem.ident is not None and fix:  # a file judged: again, held (judge_and_fix)
            path, name = page.path, os.path.basename(page.path)
            shard = os.path.basename(os.path.dirname(path))
            page, problem = judge_and_fix(path, lambda: _scan_one(layout, digest, shard, name, path, payload, trust),
                                          trust)
        elif problem is not None and problem.reason is not Reason.VANISHED:
            problem = fix_problem(problem, fix, trust)
        if problem is not None:
            page = page._replace(problem=problem)  # (as fixed, or left)
        back = restored(page)
        if back is not None and keep:
            valid[back.header.key] = back
        if page.problem is None and keep:
            valid[page.header.key] = page
        elif problem is not None and problem.reason is not Reason.VANISHED:
            problems.append(problem)
    return problems, valid


def check_tiers(config: "Config", namespace: "Namespace | str | None" = None, *, fix: bool = False,
                payload: bool = True, live_tokens: frozenset[str] | set[str] | None = None,
                looks: "list[Look] | None" = None) -> list[Problem]:
    """Walk the tiers of ``config`` without an engine: verify every page header (and, with
    ``payload``, every block CRC), report temporary leftovers, stray files and links (never followed),
    and files of owners an engine would not trust (trust.py).

    :param namespace: check only this namespace (a Namespace or its digest); None = all.
    :param fix: remove damaged/corrupt/truncated/misplaced/stray page files and temp leftovers of
        trusted owners (``Problem.fixed`` tells which were removed).
    :param live_tokens: engines of this process whose temporary files are live; None = every
        engine open in this process (so a check beside a running engine never takes its writes).
    :param looks: the tiers' first looks (probe.answering; the caller lets them go), when the caller made
        them; None: made here.
        A tier that does not answer one in write_timeout (a hung network or FUSE file system) is reported
        ``unreadable`` and not walked (before, the check waited as long as the server).
    :returns: the problems found, empty when the store is consistent.
    :raises TierError: two tiers overlap (one inside another's ``kvstream`` tree, or one directory
        twice): walking both would take one tier's files for the other's strays.
    """
    if looks is None:
        looks = answering(config)
        try:
            return check_tiers(config, namespace, fix=fix, payload=payload, live_tokens=live_tokens, looks=looks)
        finally:
            let_go(looks)
    check_overlap(config, looks)
    digest = getattr(namespace, "digest", namespace)
    problems: list[Problem] = []
    source = setting_source(config.sources, "tiers")
    for tier, look in zip(config.tiers, looks):
        if look.real is None or look.calls is not None and look.calls.hung():  # (or it hung since: its stats)
            problems.append(Problem("unreadable", tier.path, tier.path, f"did not answer in {config.write_timeout:g} "
                                    "s (write_timeout): a hung file system; not checked", Reason.UNREADABLE))
            continue
        # A mistyped tier is a problem, never "no problems found": nothing was checked there.
        if not os.path.isdir(tier.path):
            what = "is not a directory" if os.path.lexists(tier.path) else "does not exist"
            problems.append(Problem("missing_tier", tier.path, tier.path, f"tier {what} (from {source}): nothing "
                                    "there was checked; correct the tier list, or create the directory",
                                    Reason.INVALID))
            continue
        try:
            _check_tier_tree(tier.path, config.file_mode == "shared", digest, fix, payload, live_tokens, problems)
        except OSError as exc:  # EACCES...: say which directory, and go on with the other tiers
            where = blocking_dir(tier.path, exc.filename or tier.path)
            why = os.strerror(exc.errno or errno.EIO)
            problems.append(Problem("unreadable", tier.path, where, f"not readable ({why}): the rest of this tier was "
                                    "not checked; run as the tier's owner, or give this user access (as its owner or "
                                    f"root: chmod -R u+rwX {where})", Reason.UNREADABLE))
    return problems


def blocking_dir(root: str, path: str) -> str:
    """The first directory from tier ``root`` down to ``path`` this user cannot list (``path`` failed to
    open: the one to fix is often a parent, e.g. ``kvstream/`` when opening ``kvstream/tmp``)."""
    chain = [path]
    while chain[-1] != root and chain[-1] != os.path.dirname(chain[-1]):
        chain.append(os.path.dirname(chain[-1]))
    return next((d for d in reversed(chain) if os.path.isdir(d) and not os.access(d, os.R_OK | os.X_OK)), path)


def _check_tier_tree(root: str, shared: bool, digest: str | None, fix: bool, payload: bool,
                     live_tokens: frozenset[str] | set[str] | None, problems: list[Problem]) -> None:
    """:func:`check_tiers` of one existing tier directory, its problems appended to ``problems`` as found
    (those found before an OSError stay reported). :raises OSError: a directory cannot be listed."""
    base = TierLayout(root, "")
    trust = learn(root, shared)
    why = owner_problem(root, trust)
    if why is not None:  # (as start-up refuses it; before, 'no problems found'. Nothing fixed through a path
        # another user may point elsewhere meanwhile: the rest is reported only)
        problems.append(Problem("untrusted", root, root, f"a tier an engine refuses: {why}", Reason.UNTRUSTED))
        fix = False
    problems += dir_problems(base, trust, base=True, pages=False)
    problems += tmp_problems(root, base.tmp, live_tokens, fix, trust)
    try:
        digests = [digest] if digest else _digests(base)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        problems.append(Problem("stray", root, base.base, f"{LINKED}; left in place", Reason.INVALID))
        return
    for d in digests:
        problems += check_tier(TierLayout(root, d), d, fix=fix, payload=payload, tmp=False, trust=trust,
                               valid=False)[0]


def dir_problems(layout: TierLayout, trust: Trust, *, base: bool, pages: bool) -> list[Problem]:
    """The directories an engine would refuse at start-up (trust.dir_findings) as 'untrusted' problems,
    never fixed (kvstream removes no directory); a link there is the scans' 'stray'."""
    return [Problem("untrusted", layout.root, path, f"a directory an engine refuses: it {why} ({describe(st)}); "
                                                    f"{dir_fix(path, st, trust)}", Reason.UNTRUSTED)
            for path, st, why in dir_findings(layout, trust, base, pages) if not stat.S_ISLNK(st.st_mode)]


def _digests(base: TierLayout) -> list[str]:
    """The namespaces on one tier (listed through a descriptor). :raises OSError: as :func:`shards`."""
    try:
        return sorted(n for n in list_below(base.root, base.base) if is_digest(n))
    except FileNotFoundError:
        return []


def tmp_problems(root: str, tmp_dir: str, live_tokens: frozenset[str] | set[str] | None, fix: bool,
                 trust: Trust) -> list[Problem]:
    """Temporary leftovers (``orphan_tmp``), directories and links (``stray``: kvstream never makes one
    there) in one tier's temporary directory, listed through a descriptor that followed no link; with
    ``fix`` the leftovers named as kvstream names them and of a trusted owner are removed, nothing else.
    The leftovers first, then the strays by name."""
    found = list(each_tmp_problem(root, tmp_dir, live_tokens, fix, trust))
    strays = sorted((p for p in found if p.kind == "stray"), key=lambda p: p.path)
    return [p for p in found if p.kind != "stray"] + strays


def each_tmp_problem(root: str, tmp_dir: str, live_tokens: frozenset[str] | set[str] | None, fix: bool,
                     trust: Trust, step: Callable[[], bool] = lambda: True) -> Iterator[Problem]:
    """:func:`tmp_problems` one entry at a time, in the directory's order: ``step()`` is called before
    each entry is judged (and fixed), and the walk ends when it returns False. The background scan
    paces it so and stops it at close: a tmp directory another user (or a crash loop) filled with a
    million names costs the scan's pace, no list of them, and no walk after close (before, the whole
    directory was listed and judged at once, unpaced, at every start).
    :raises OSError: ``tmp_dir`` cannot be opened or read (a link or a file there: a stray, yielded)."""
    try:
        fd = open_below(root, tmp_dir)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        yield Problem("stray", root, tmp_dir, f"{LINKED}; left in place", Reason.INVALID)
        return
    try:
        judge = Leftovers(tmp_dir, live_tokens, dir_fd=fd)  # (its clock read in the directory walked)
        with os.scandir(fd) as entries:
            for entry in entries:
                if not step():
                    return
                path = os.path.join(tmp_dir, entry.name)
                try:
                    link = entry.is_symlink()
                    folder = not link and entry.is_dir(follow_symlinks=False)
                except OSError:  # vanished meanwhile (or cannot be told): never a leftover on a guess
                    continue
                if link or folder:
                    why = ("a symbolic link in kvstream's temporary directory: never followed" if link
                           else "a directory in kvstream's temporary directory")
                    yield fix_problem(Problem("stray", root, path, why, Reason.INVALID), fix, trust)
                elif parse_mark(entry.name) is not None:  # an engine's mark (any other live.* is junk, reported
                    # below): no file of a write, nothing to report (a server stopped with SIGTERM leaves one)
                    if fix and judge(entry):  # removed quietly
                        fix_problem(Problem("orphan_tmp", root, path, "mark", Reason.LEFTOVER), fix, trust)
                elif judge(entry):
                    yield fix_problem(Problem("orphan_tmp", root, path, "temporary leftover", Reason.LEFTOVER),
                                      fix, trust)
    finally:
        close_fd(fd)


def fix_problem(problem: Problem, fix: bool = True, trust: Trust | None = None, held: int | None = None) -> Problem:
    """Remove the file behind ``problem`` when ``fix``; the returned copy says whether it went, and
    if not, why (its ``detail`` grows the reason). Only a file of an owner in ``trust`` (default: this
    user) goes, through the descriptor of its directory, never through a link (trust.remove); a
    temporary one only when named as kvstream names them; a page file only when ``held`` from before
    it was judged (Problem.judged: :func:`judge_and_fix` does both). Directories are never removed: one
    may be another tier's tree or anything else an operator keeps there."""
    if not fix or problem.reason is Reason.NEWER:  # (a later format's page: its detail says it stays)
        return problem
    if problem.reason is Reason.UNREADABLE:  # EMFILE, EIO, ESTALE...: the file itself may be valid
        return problem._replace(detail=f"{problem.detail}; left in place: an error kept it from being read, "
                                       f"not the file's content (check again once the tier reads)")
    # Only the file judged goes: another writer may have renamed a valid page over its name since
    # (trust.remove); an entry judged no regular file goes only while it is none.
    try:
        if problem.reason is Reason.RESTORE:  # (its page's name from its header, read again: checked then)
            header, _ = read_header(problem.path, trust)
            why = put_back(problem.tier, problem.path, header.key + PAGE_SUFFIX, trust or Trust.user())
        else:
            why = remove(problem.tier, problem.path, trust or Trust.user(),
                         is_engine_tmp if problem.reason is Reason.LEFTOVER else None, problem.judged(held))
    except HeaderError as exc:  # (changed since it was judged: left for the next look)
        return problem._replace(detail=f"{problem.detail}; left in place: {exc}")
    except OSError as exc:
        return problem._replace(detail=f"{problem.detail}; could not remove it "
                                       f"({os.strerror(exc.errno or errno.EIO)})")
    if why is not None:
        return problem._replace(detail=f"{problem.detail}; left in place: {why}")
    return problem._replace(fixed=True)


def judge_and_fix(path: str, judge: Callable[[], ScannedPage], trust: Trust) -> tuple[ScannedPage, Problem | None]:
    """Judge the entry at ``path`` (``judge()``) holding it (trust.pin) from before the judgment to the
    removal, and remove it when judged damaged, misplaced or a stray (fix_problem): (the page as judged,
    the problem as fixed or left; None when there is none). Another writer may rename a valid page over
    the name at any moment: only the very file judged goes."""
    held = pin(path)
    try:
        page = judge()
        if page.problem is None or page.problem.reason is Reason.VANISHED:
            return page, None
        return page, fix_problem(page.problem, trust=trust, held=held)
    finally:
        if held is not None:
            close_fd(held)
