"""A copy that failed its check on a read: a transfer fault, a damaged copy, or another writer's version.

The read path verifies every block against the index's checksums. A block that fails is re-read from
the file outside the ring (buffered, once) to tell a fault of the transfer (the copy on disk is
intact: read from a replica) from a copy that differs on disk. That copy is checked against its own
header: intact, it is another writer's version of the page (two processes of the namespace stored
this key with other bytes), which leaves the index but stays on disk; so does a page of a later format
(a newer kvstream's renamed over it: integrity.NewerFormat, never served here); it is removed only when
it fails its own header or checksums (damaged). An I/O error on the way is the tier's health, never a
reason to remove a copy. Runs under the read path's lock (reads.py).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

from .fds import close_fd
from .index import Index, PageInfo
from .integrity import NotRegularFile, Reason, block_crc, open_regular, scan_file
from .layout import file_size
from .stats import Stats
from .tiers import Tier
from .trust import not_a_file

log = logging.getLogger("kvstream")


def block_failed(tier: Tier, index: Index, stats: Stats, digest: str, key: str, info: PageInfo, j: int,
                 why: str, in_transfer: Callable[[], None] = lambda: None) -> bool:
    """Block ``j`` of ``key`` from ``tier`` failed its ``why`` check ('checksum', 'truncated'). Returns
    True when the indexed copy is gone from the index (damaged and removed, vanished, or another
    writer's version): the page is worth looking up again on the tiers, where no indexed copy is left
    (a copy the index does not list: one the start-up scan has not reached yet, or another process's).
    ``in_transfer`` is called when the copy on disk is intact (the fault was the transfer's)."""
    fd = None  # the file read, held open to the end: only that very file may be removed (Problem.judged)
    other = False  # an intact page of another writer or format: no corruption (on an MLA reader rank, every
    # page the writer rank evicted and stored again from a new prefill: `corrupted` climbed on a healthy server)
    try:
        try:
            fd, st = open_regular(tier.layout.page_path(key), trust=tier.trust)
            # (a file cut inside its last block's padding: the block's bytes are all there, yet the file
            # is truncated, as the scan and check judge it, and an O_DIRECT read of it is short forever)
            differs = block_crc(fd, info.length, info.block, j) != info.crcs[j] or \
                st.st_size < file_size(info.length)
        except (FileNotFoundError, NotRegularFile):
            differs = True
        except OSError:
            return False  # the tier is failing: its health, not this page, is the problem
        if not differs:
            log.warning("kvstream: block %d of page %s from tier %d failed its %s check in transfer but is "
                        "intact on disk; read from a replica", j, key, tier.k, why)
            in_transfer()
            return False
        problem = scan_file(tier.layout, digest, key, payload=True, trust=tier.trust).problem
        other = problem is None or problem.reason is Reason.NEWER
        if problem is not None and problem.reason is Reason.UNREADABLE:
            return False  # an I/O error: the tier's health, not this copy, is the problem
        if problem is not None and problem.reason not in (Reason.VANISHED, Reason.NEWER):
            # only the very file judged goes: a writer may have renamed a valid page over it since
            remove_copy(tier, index, stats, key, f"{why}, block {j}", judged=problem.judged(fd) or not_a_file)
            return True
    finally:
        if fd is not None:
            close_fd(fd)
        if not other:  # (a transfer fault, a damaged or vanished copy, a tier failing under the look)
            stats.add(tier.k, "corrupted")
    index.remove(key, tier.k)  # kept (another writer's version, or another kvstream version's), or gone
    if problem is None:
        stats.add(tier.k, "other_versions")
        log.info("kvstream: page %s on tier %d is another writer's version (intact, other bytes); kept, "
                 "read from a copy of the indexed version or indexed in its place", key, tier.k)
    elif problem.reason is Reason.NEWER:
        stats.add(tier.k, "other_versions")
        log.info("kvstream: page %s on tier %d is a later format's now (%s); kept, read from a copy of the "
                 "indexed version if one is left", key, tier.k, problem.detail)
    return True


def remove_copy(tier: Tier, index: Index, stats: Stats, key: str, why: str, remove: bool = True,
                judged: Callable[[os.stat_result], bool] = not_a_file, theirs: bool = False) -> None:
    """A damaged copy (or a stray under a page's name): out of the index and off the tier (a
    directory, a link or another user's file stays: kvstream never removes one; ``check`` reports it).
    Only the entry ``judged`` matches goes (trust.remove: another writer may have renamed a valid page
    over the name since it was judged); the default, for a caller that holds no descriptor of it, is an
    entry that is not a regular file, as no page is. ``theirs``: another user's file under the name (the
    engine's copy replaced): nothing damaged, nothing to remove, not counted as quarantined."""
    index.remove(key, tier.k)
    if theirs:  # (before: "is damaged ... left in place", and quarantined counted for a file never judged)
        index.file_removed(key, tier.k)
        log.warning("kvstream: page %s on tier %d is %s now; not served, left in place", key, tier.k, why)
        return
    kept = tier.unlink_page(key, judged) if remove else "a directory"
    index.file_removed(key, tier.k)
    log.warning("kvstream: page %s on tier %d is damaged (%s); %s, served from a replica if one is valid",
                key, tier.k, why, "removed" if kept is None else f"left in place ({kept})")
    stats.add(tier.k, "quarantined")
