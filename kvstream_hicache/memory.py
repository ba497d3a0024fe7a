"""Caller memory: is a range backed by huge pages? (Whether a read may land in it directly.)

An O_DIRECT read into memory of 4 KiB pages pins every page for every request and goes to the
device as one segment per page, so the block layer splits it at the device's segment limit (a
512 KiB bio on a loop device, ~1 MiB on virtio-blk). Measured on this project's RAM-backed tiers
(docs/benchmarks.md "Device speed"): reading 32 MiB pages straight into 4 KiB-page memory ran at
4.7 GB/s for 0.085 CPU s/GB, 26% of it pinning pages; reading them into huge-page staging buffers
and copying them over (checksum in the same pass) ran at 8.0 GB/s for 0.087 s/GB; reading straight
into huge-page memory ran at 7.2 GB/s for 0.043 s/GB. So a read lands in caller memory only where
that memory is huge-page backed (THP or hugetlbfs), which the kernel reports per mapping in
/proc/self/smaps.

The answer is cached per mapping; the table is read again when an address falls outside every
mapping it knows, or after :data:`REFRESH_S` (the kernel may collapse or split huge pages).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable

REFRESH_S = 30.0  # the kernel's answer is re-read at least this often, s
HUGE = 2 << 20  # a page at least this large counts as huge, bytes
_PMD_FIELDS = (b"AnonHugePages:", b"ShmemPmdMapped:", b"FilePmdMapped:")


class HugePageMap:
    """Which mappings of this process are (mostly) huge-page backed; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, smaps: str = "/proc/self/smaps"):
        self.clock = clock
        self.path = smaps
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._huge: list[bool] = []
        self._read_at = -float("inf")

    def huge(self, address: int, nbytes: int) -> bool:
        """True when every byte of ``[address, address + nbytes)`` lies in huge-page backed mappings."""
        flags = None if self.clock() - self._read_at > REFRESH_S else self._lookup(address, nbytes)
        if flags is None:  # stale, or memory mapped since the last read
            self._read()
            flags = self._lookup(address, nbytes)
        return bool(flags) and all(flags)

    def _lookup(self, address: int, nbytes: int) -> list[bool] | None:
        """Whether each mapping the range spans is huge; None when part of it is in no known mapping."""
        end = address + nbytes
        i = bisect.bisect_right(self._starts, address) - 1
        flags = []
        while address < end:
            if i < 0 or i >= len(self._starts) or not self._starts[i] <= address < self._ends[i]:
                return None
            flags.append(self._huge[i])
            address = self._ends[i]
            i += 1
        return flags

    def _read(self) -> None:
        starts, ends, huge = [], [], []
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError:  # no procfs (or not Linux): nothing counts as huge; reads are staged
            data = b""
        rss = pmd = page = 0
        for line in data.splitlines():
            if line[:1].isdigit() or line[:1] in b"abcdef":  # "start-end perms ..." opens a mapping
                if starts:
                    huge.append(page >= HUGE or (rss > 0 and 2 * pmd >= rss))
                span = line.split(b" ", 1)[0].split(b"-")
                starts.append(int(span[0], 16))
                ends.append(int(span[1], 16))
                rss = pmd = page = 0
            elif line.startswith(b"Rss:"):
                rss = int(line.split()[1])
            elif line.startswith(_PMD_FIELDS):
                pmd += int(line.split()[1])
            elif line.startswith(b"KernelPageSize:"):
                page = int(line.split()[1]) << 10
        if starts:
            huge.append(page >= HUGE or (rss > 0 and 2 * pmd >= rss))
        self._starts, self._ends, self._huge = starts, ends, huge
        self._read_at = self.clock()
