"""The descriptors the paths hold, their caps and the one policy for running out of them.

Caps, named for what they bound:

- ``READ_FILES_HELD``: read descriptors the read path keeps open at once, every call's and orphans'
  together; past it, a descriptor closes as soon as no request uses it (a get of 10,000 pages on two
  tiers must not hold 20,000; a page's file is reopened if needed again).
- ``TMP_FILES_PER_TIER``: temporary files the write path has open at once on one tier (a job each);
  32 pages per tier keep any device busy (the window bounds the bytes).

Out of descriptors (EMFILE, ENFILE: the process's or the system's limit) is never a failure while a
descriptor of ours can free one: the read path closes its idle ones and opens once more; the write
path waits for one of its jobs to close its file (``Shortage``). With none of ours to free, a read's
open fails for that tier (its blocks go to another holder, or the page is a miss), and writes retry
every FD_RETRY_S for FD_GIVE_UP_S, then that (page, tier) fails.
"""
from __future__ import annotations

import errno
import logging
from collections.abc import Callable

from .fds import close_fd

log = logging.getLogger("kvstream")

READ_FILES_HELD = 256
TMP_FILES_PER_TIER = 32
FD_RETRY_S = 0.05  # out of descriptors with none of ours open: writes try again after this, s
FD_GIVE_UP_S = 30.0  # ... for this long, then the (page, tier) fails (nothing of ours to wait for), s
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


class ReadFile:
    """A read descriptor shared by the requests of one (tier, page) in one call."""

    __slots__ = ("fd", "refs", "release", "failed", "tier", "key")

    def __init__(self, tier: int, key: str):
        self.tier, self.key = tier, key
        self.fd: int | None = None
        self.refs = 0  # requests in flight on it
        self.release = False  # the call ended: close when the last request is reaped
        self.failed = False  # the open failed: this (tier, page) is not read in this call


class ReadFiles:
    """Every read descriptor the read path holds: opened per (tier, page) of a call, closed when the
    call ends and no request uses it, or earlier when idle while more than READ_FILES_HELD are open.
    ``files`` arguments are one call's ``{(tier, page): ReadFile}``.

    :param stale: ``stale(tier, key)``, called when closing a descriptor answered ESTALE: another node
        of a shared file system replaced or deleted the file since it was opened."""

    def __init__(self, stale: Callable[[int, str], None] = lambda tier, key: None):
        self.open = 0
        self.peak = 0
        self.stale = stale

    def open_file(self, f: ReadFile, files: dict, opener: Callable[[], int]) -> None:
        """``f.fd = opener()``; out of descriptors, the call's idle ones close and it tries once more.
        :raises OSError: the open's error."""
        try:
            fd = opener()
        except OSError as exc:
            if exc.errno not in OUT_OF_DESCRIPTORS or not self.close_idle(files):
                raise
            fd = opener()
        f.fd = fd
        self.open += 1
        self.peak = max(self.peak, self.open)

    def drop(self, f: ReadFile) -> None:
        """A request on ``f`` ended: close it once idle if its call ended or too many are open."""
        f.refs = max(f.refs - 1, 0)
        if not f.refs and f.fd is not None and (f.release or self.open > READ_FILES_HELD):
            self._close(f)

    def close_idle(self, files: dict) -> int:
        """Close the call's descriptors no request is using (reopened if needed); how many closed."""
        idle = [f for f in files.values() if not f.refs and f.fd is not None]
        for f in idle:
            self._close(f)
        return len(idle)

    def release(self, files: dict) -> None:
        """The call ended: its idle descriptors close now, the others when their last request ends."""
        for f in files.values():
            f.release = True
        self.close_idle(files)

    def _close(self, f: ReadFile) -> None:
        fd, f.fd = f.fd, None
        self.open -= 1
        if close_fd(fd) == errno.ESTALE:  # (a read descriptor: what was read is verified all the same)
            self.stale(f.tier, f.key)


class Shortage:
    """The write path out of descriptors: whether new temporary files may be tried now."""

    def __init__(self):
        self.short = False  # waiting for one of our files to close
        self.retry_at = 0.0  # none of ours open: next try
        self.since: float | None = None  # first failure of the current shortage

    def blocked(self, now: float) -> bool:
        return self.short or now < self.retry_at

    def hit(self, ours_open: bool, now: float) -> bool:
        """A create failed with EMFILE/ENFILE: True to wait and try again, False to give this (page,
        tier) up (none of ours open for FD_GIVE_UP_S). Once given up, every next one fails at once
        until a create succeeds (``created``), instead of each waiting FD_GIVE_UP_S again."""
        if ours_open:
            self.short = True  # cleared when one of our files closes
            return True
        if self.since is None:
            self.since = now
            log.warning("kvstream: out of file descriptors (the process's limit); writes wait for one")
        if now - self.since < FD_GIVE_UP_S:
            self.retry_at = now + FD_RETRY_S
            return True
        return False

    def created(self) -> None:
        self.since = None

    def closed(self) -> None:
        self.short = False
