"""Caller memory: may a read land in it directly, or must it be staged and copied?

An O_DIRECT read into memory of 4 KiB pages pins every page for every request and goes to the
device as one segment per page, so the block layer splits it at the device's segment limit (a
512 KiB bio on a loop device, ~1 MiB on virtio-blk). Measured on this project's RAM-backed tiers
(docs/benchmarks.md "Device speed"): reading 32 MiB pages straight into 4 KiB-page memory ran at
4.7 GB/s for 0.085 CPU s/GB, 26% of it pinning pages; reading them into huge-page staging buffers
and copying them over (checksum in the same pass) ran at 8.0 GB/s for 0.087 s/GB; reading straight
into huge-page memory ran at 7.2 GB/s for 0.043 s/GB. Measured again through the SGLang adapter
into sglang's real host pool (its own shared mapping in 4 KiB pages, 8 MiB pages in 8 MiB requests;
docs/benchmarks.md "Reads into SGLang's host pool"): in place read 0.81x staged on a RAM tier and
0.64x on this machine's disk (virtio-blk splits each request at its segment limit), for the same CPU
per GB (the pinning of 4 KiB pages costs what the copy saves).

So a read lands in caller memory where that memory is

* huge-page backed (THP or hugetlbfs), which the kernel reports per mapping in /proc/self/smaps
  (:class:`HugePageMap`), or
* registered with the read ring (:class:`CallerMemory`, ``Engine.register_memory``: the adapters
  register SGLang's host pool and LMCache's buffer): the kernel pinned it once, so a read into it
  pins nothing (READ_FIXED; a page of several pieces, e.g. page_first's K and V, needs READV_FIXED,
  Linux 6.15). In place then costs 0.005 s/GB of kernel time where staging costs the copy (0.07
  s/GB with the checksum) and a plain read into 4 KiB pages 0.03-0.07 s/GB of pinning
  (docs/benchmarks.md, "Reads into registered memory"). The kernel keeps 16 bytes per 4 KiB page
  registered (0.4% of the memory) and pins it for the engine's life.

The answer for huge pages is cached per mapping. Reading smaps walks the page tables of every mapping (63 ms for a
process with sglang loaded and a 2 GiB pool, seconds for a 100 GB host pool), so it never runs on the
read path: an address outside every mapping the table knows, or a table older than
:data:`REFRESH_S` (the kernel may collapse or split huge pages), starts one read in a background
thread, and until it lands the answer is "not huge" (the read is staged: always correct).
"""
from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Sequence

from .errors import EngineClosedError
from .io import memlock_hint
from .layout import is_aligned
from .locks import ranked_lock
from .segments import Segment

log = logging.getLogger("kvstream")

REFRESH_S = 600.0  # the kernel's answer is re-read in the background at least this often, s
HUGE = 2 << 20  # a page at least this large counts as huge, bytes
_PMD_FIELDS = (b"AnonHugePages:", b"ShmemPmdMapped:", b"FilePmdMapped:")


class HugePageMap:
    """Which mappings of this process are (mostly) huge-page backed; see the module docstring.

    :param background: read smaps in a background thread (the read path's use); False reads it in
        the caller's thread when needed (tools, tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, smaps: str = "/proc/self/smaps",
                 background: bool = True):
        self.clock = clock
        self.path = smaps
        self.background = background
        self._table: tuple[list[int], list[int], list[bool]] = ([], [], [])  # starts, ends, huge: swapped whole
        self._read_at = -float("inf")
        self._reading = threading.Lock()  # one read at a time

    def huge(self, address: int, nbytes: int) -> bool:
        """True when every byte of ``[address, address + nbytes)`` lies in mappings known to be
        huge-page backed (mostly: at least half of a mapping's resident memory, see _read)."""
        stale = self.clock() - self._read_at > REFRESH_S
        flags = self._lookup(address, nbytes)
        if flags is None or stale:  # memory mapped since the last read, or an old answer
            if not self.background:
                self.refresh()
                flags = self._lookup(address, nbytes)
            elif self._reading.acquire(blocking=False):
                threading.Thread(target=self._refresh_held, name="kvstream-smaps", daemon=True).start()
        return bool(flags) and all(flags)

    def refresh(self) -> None:
        """Read the kernel's answer now (in this thread)."""
        with self._reading:
            self._read()

    def _refresh_held(self) -> None:
        try:
            self._read()
        finally:
            self._reading.release()

    def _lookup(self, address: int, nbytes: int) -> list[bool] | None:
        """Whether each mapping the range spans is huge; None when part of it is in no known mapping."""
        starts, ends, huge = self._table
        end = address + nbytes
        i = bisect.bisect_right(starts, address) - 1
        flags = []
        while address < end:
            if i < 0 or i >= len(starts) or not starts[i] <= address < ends[i]:
                return None
            flags.append(huge[i])
            address = ends[i]
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
        self._table = (starts, ends, huge)
        self._read_at = self.clock()


class CallerMemory:
    """Which caller memory a read may land in directly (see the module docstring): the read path's
    one question about memory, asked per page (``takes``). Used under the read path's lock.

    :param ring: the read ring: registration needs a ``Ring`` (the thread-pool engine has none, and
        never reads into registered memory; the fault-injecting wrapper passes it to the ring it wraps).
    :param register: the ``register_memory`` setting.
    """

    def __init__(self, ring, register: bool):
        self.huge = HugePageMap()
        self.ring = ring if register and hasattr(ring, "register_memory") else None
        self.spans: list[Segment] = []  # what was registered (the same again with a new ring: rebind)

    def register(self, address: int, nbytes: int) -> bool:
        """Pin ``[address, address + nbytes)`` with the read ring (it must stay mapped while the engine
        is open); returns whether reads of pages of any number of pieces may land in it. A refusal (the
        memlock limit of a user without CAP_IPC_LOCK, a kernel before 5.19) leaves it to the huge-page
        test (whose map the caller refreshed), with one log line."""
        ring = self.ring
        if ring is not None and not ring.covers(address, nbytes):
            t0 = time.perf_counter()
            try:
                if ring.register_memory(address, nbytes):  # (0: it overlaps memory registered before)
                    self.spans.append((address, nbytes))
                log.debug("kvstream: %d MiB of caller memory registered with io_uring in %.2f s: reads into it "
                          "pin nothing%s", nbytes >> 20, time.perf_counter() - t0,
                          "" if ring.readv_fixed else " (pages of one piece; a page of several is staged "
                                                      "before Linux 6.15)")
            except OSError as exc:
                log.warning("kvstream: could not register %d MiB of caller memory with io_uring: %s%s; reads "
                            "into it are staged unless it is huge-page backed (register_memory=off silences "
                            "this)", nbytes >> 20, exc.strerror, memlock_hint(exc))
        registered = ring is not None and ring.covers(address, nbytes)
        return (registered and ring.readv_fixed) or self.huge.huge(address, nbytes)

    def rebind(self, ring) -> None:
        """The read ring was replaced (its old one failed: inflight.py): register the same memory with
        the new one (it stays mapped while the engine is open: ``Engine.register_memory``)."""
        if self.ring is None or ring.closed:
            return
        # (io_engine=auto: the new one may be the thread pool's, where io_uring_setup was refused now)
        self.ring = ring if hasattr(ring, "register_memory") else None
        spans, self.spans = self.spans, []
        if self.ring is None:
            log.warning("kvstream: the read ring was replaced by the thread-pool engine: reads into caller memory "
                        "are staged from now on")
            return
        for address, nbytes in spans:
            self.register(address, nbytes)

    def takes(self, segments: Sequence[Segment]) -> bool:
        """Whether a read of a page whose payload is ``segments`` may land in them: each 4096-aligned,
        and all huge-page backed, or all in one registered piece (several pieces only where the kernel
        reads a vector into fixed buffers)."""
        if not all(is_aligned(a, n) for a, n in segments):
            return False
        ring = self.ring
        if ring is not None and (len(segments) == 1 or ring.readv_fixed) and self._piece(segments) >= 0:
            return True
        return all(self.huge.huge(a, n) for a, n in segments)

    def _piece(self, segments: Sequence[Segment]) -> int:
        """The registered piece that holds every segment (what one fixed read can target), or -1."""
        ring = self.ring
        if ring is None or not ring.fixed_bytes or not segments:
            return -1
        piece = ring.fixed(*segments[0])
        return piece if all(ring.fixed(a, n) == piece for a, n in segments[1:]) else -1

    def fault(self, key: str, segments: Sequence[Segment]) -> None:
        """A read in place of page ``key`` into ``segments`` failed its checksum while the copy on disk
        is intact. In registered memory that means it may have been unmapped and mapped again (a read
        lands in the pages pinned at registration, wherever the address points now): every
        registration is dropped, and reads are staged from now on (always correct)."""
        if self._piece(segments) < 0:  # (read plain, or not registered: nothing stale to drop)
            return
        log.warning("kvstream: a read of page %s into registered memory failed its check; if that memory was "
                    "freed and mapped again, register it again (Engine.register_memory). Reads into it are "
                    "staged from now on", key)
        self.spans = []
        try:
            self.ring.unregister_memory()
        except OSError as exc:  # (nothing is sent as fixed any more all the same)
            log.warning("kvstream: could not unpin the registered memory: %s", exc.strerror)


class CallerGate:
    """Whether a get may still touch its caller's memory. A get holds the gate while it runs and lets
    it go only while it waits for completions. ``close()`` that gives up on a get that does not end
    (its reads into caller memory held by a hung tier: they must land before it returns) shuts the
    gate and returns, and the caller's owner may then free the memory (LMCache frees L1 at shutdown).
    The get, back from its wait, finds the gate shut and ends touching nothing of the caller's: a read
    the kernel still holds lands in the pages it pinned, wherever the freed range is mapped again.

    The write side has one per caller of ``put_deferred`` that may let go of its memory before its
    stores end (``rank`` "source": LMCache's L2Core, whose close() gives up on a writer a hung tier
    holds in a call): the writer holds it while it reads that memory (checksums, staging copies)."""

    def __init__(self, rank: str = "caller"):
        self._lock = ranked_lock(rank)
        self.shut = False

    def __enter__(self) -> "CallerGate":
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def leave(self) -> None:
        """Before a wait for completions (the gate held): ``close`` may shut it meanwhile. (Two plain
        calls around the wait, not a context manager: this runs once per reap.)"""
        self._lock.release()

    def back(self) -> None:
        """After the wait: the gate held again. :raises EngineClosedError: ``close`` shut it meanwhile
        (what the wait reaped is dropped: the engine is gone)."""
        self._lock.acquire()
        if self.shut:
            raise EngineClosedError("kvstream engine closed while this get waited for a hung tier")

    def close(self, timeout: float) -> bool:
        """Shut the gate; False when the get did not let it go within ``timeout`` (it is in a call that
        does not return: a page file's open on a hung network file system). Shut all the same: the get
        sees it when that call returns, and ends there."""
        self.shut = True  # (first: read without the lock by a get whose call never let the gate go)
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True
