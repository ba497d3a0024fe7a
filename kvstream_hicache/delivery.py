"""What a completed read delivers: the blocks that arrived whole are verified against the index's
checksums (from staging, copied into the caller's segments in the same pass: one pass over the
bytes), a block that fails its check goes to damage.py (and its page may be looked up again: the
second chance), and the router is told each item's outcome. A read that failed is its tier's
health. Runs under the read path's lock (reads.py): methods ending ``_under_reads``.
"""
from __future__ import annotations

import errno

from . import damage
from .getcall import GetCall, Req
from .index import Index
from .memory import CallerMemory
from .stats import Stats
from .tiers import Tier


class Delivery:
    """Verifies and hands over what the read ring delivered, for a read path's ``tiers``."""

    def __init__(self, tiers: list[Tier], index: Index, stats: Stats, digest: str, memory: CallerMemory):
        self.tiers = tiers
        self.index = index
        self.stats = stats
        self.digest = digest
        self.memory = memory  # told when a read in place failed in transfer (memory.py)

    def deliver_under_reads(self, req: Req, res: int) -> list:
        """Verify (and, from staging, copy in) the blocks that arrived; tell the router."""
        call, tier = req.call, req.tier
        page = call.pages[req.p]
        info = page.info
        if res < 0:
            self.failed_read_under_reads(tier, page.key, -res, call)
        # Blocks wholly read (a short read means the file is shorter than its header says).
        if res >= req.nbytes:
            complete = req.j1 - req.j0
        else:
            complete = max(res, 0) // info.block  # every block but a page's last is a whole block
        skip = 0
        for i, item in enumerate(req.items):
            if call.arrived[item]:
                skip |= 1 << i
        bad = 0
        if complete:
            staging = None if req.bufs is None else [b.address for b in req.bufs[:complete]]  # None: in place
            bad = page.map.check(req.j0, req.j0 + complete, staging, skip & ((1 << complete) - 1))
        results = []
        duplicates = 0
        for i, item in enumerate(req.items):
            if skip >> i & 1:
                ok = res >= 0  # a duplicate: the first arrival already won
                duplicates += ok
            elif i < complete and not bad >> i & 1:
                ok = True
                call.arrived[item] = 1
                served = min(info.block, info.length - (req.j0 + i) * info.block)
                call.served[tier] += served
                if req.bufs is None:  # landed and verified in the caller's memory: no copy
                    call.direct[tier] += served
                call.page_tiers[req.p] |= 1 << tier
            else:
                ok = False
                call.failed.append((tier, item))
                if res >= 0 and (tier, req.p) not in call.bad:  # (a copy counts once, whatever its blocks:
                    # `corrupted` unless it is another writer's intact version, damage.block_failed)
                    self._quarantine_under_reads(call, tier, req.p, req.j0 + i,
                                                 "checksum" if i < complete else "truncated", req.bufs is None)
            results.append((item, ok))
        if duplicates:
            self.stats.total("duplicate_reads", duplicates)
        return call.route.complete_many(tier, results)

    def failed_read_under_reads(self, tier: int, key: str, err: int, call: GetCall, what: str = "read") -> None:
        """An open or read of ``key``'s file on ``tier`` failed with ``err``. A copy deleted or replaced
        under us (an operator, another rank, another node of a shared file system: ENOENT, ESTALE) is
        forgotten and the key looked up again after the call; anything else is the tier's health (the
        whole tier went, unmounted, moved away: the index keeps its copies, which may come back with
        it; rejoining reconciles with what survived). ETIME: the get's own time ran out first (an open
        on a tier that may hang, bounded.py): a miss here, the tier not judged."""
        if err == errno.ETIME:
            return
        if self.tiers[tier].copy_gone(err, key):
            self.index.remove(key, tier)
            if err != errno.ESTALE or self.tiers[tier].listed(key, call.left()):  # (ESTALE: replaced, not deleted)
                call.relook.add(key)
            return
        self.stats.add(tier, "errors")
        self.tiers[tier].fail(err, f"{what} {key}")

    def stale_copy(self, tier: int, key: str) -> None:
        """Closing a read descriptor of ``key`` on ``tier`` answered ESTALE: the file was replaced or
        deleted by another node since it was opened; that copy leaves the index."""
        if self.tiers[tier].copy_gone(errno.ESTALE, key):
            self.index.remove(key, tier)

    def _quarantine_under_reads(self, call: GetCall, tier: int, p: int, j: int, why: str, in_place: bool) -> None:
        """A block failed its check (damage.py tells what the copy on disk is)."""
        page = call.pages[p]
        call.bad.add((tier, p))
        # (a checksum, not a short read, in place: the bytes the caller's memory holds were checked)
        segments = page.map.ranges(0, page.info.length) if in_place and why == "checksum" else None
        in_transfer = (lambda: self.memory.fault(page.key, segments)) if segments else (lambda: None)
        if damage.block_failed(self.tiers[tier], self.index, self.stats, self.digest, page.key, page.info, j, why,
                               in_transfer):
            call.relook.add(page.key)
