"""Closing a descriptor where ``close`` can fail: one helper for every close in the core.

On a network or distributed file system ``close(2)`` reports what the server said about the file:
ESTALE when another node replaced or unlinked it, ENOTCONN when the server is gone, EIO when written
data did not reach it. Linux frees the descriptor whatever close returns (close(2): retrying would
close a descriptor another thread just opened), so an error there is news about the file, never a
reason to raise out of a read's clean-up or replace the result of the code around it.
"""
from __future__ import annotations

import errno
import os


def close_fd(fd: int) -> int:
    """Close ``fd``; never raises. Returns 0, or the errno close reported (the descriptor is freed
    either way). Callers that wrote through ``fd`` treat an error as a failed write."""
    try:
        os.close(fd)
    except OSError as exc:
        return exc.errno or errno.EIO
    return 0
