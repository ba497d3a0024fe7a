"""The read path: one batch, one pool of blocks, routed over the tiers by completions.

Data flow of ``get`` (one call at a time per read ring)::

    reap orphans of earlier calls (non-blocking)
    pin the pages in the index; items = every block of every page held by a usable tier (GetCall.plan)
    route = policy.start(n_tiers, holders)                 (router.py, pure)
    loop: claims -> requests: each tier's claimed blocks of one page, adjacent ones merged into one
          read (up to its flow's request size), into staging buffers or straight into caller memory
          -> submit, reap (inflight.py) -> delivery.py: verify each block's crc32c against the index
          (staged blocks copied into the caller's segments in the same pass; a block that fails:
          damage.py) -> route.complete_many(tier, results)
          -> each tier's window follows its device (flow.py) -> next claims
    until every item is found or failed (or read_timeout passes)
    unpin; staged reads still in flight become *orphans*: they keep their staging buffers and file
    descriptor until a later call (or close) reaps them, and never touch caller memory again.
    second chance (once): pages missed while a failed tier holds them, or whose indexed copies were
    gone or another writer's version, go to the engine's ``recover`` (probe those tiers now, look the
    pages up on disk) and are read again if that gave them a holder they did not have

Where a read lands. Into an engine-owned staging buffer, copied into the caller's segments on its
first verified arrival (checksum and copy in one pass), or straight into the caller's pages: only a
block one usable tier alone holds (nobody can race for it), where the memory suits O_DIRECT
(4096-aligned; registered with the ring or huge-page backed: memory.py). The call waits for reads in
place however long the device takes (returning earlier would let them land in memory the caller
reuses). Every block another tier could deliver is staged: a stalled tier never holds a call.
"""
from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Sequence

from . import damage
from .delivery import Delivery
from .errors import EngineClosedError
from .files import ReadFile, ReadFiles
from .flow import HELD, MAX_REQUEST, MIN_REQUESTS, SlowerTiers, outpaces
from .getcall import GetCall, Req, record_get
from .index import Index
from .inflight import InFlight
from .integrity import NotRegularFile, UntrustedFile
from .io import MAX_VECTOR, OP_READ
from .layout import HEADER_SIZE, round_up
from .locks import ranked_lock
from .memory import CallerGate, CallerMemory
from .priority import ReadPriority
from .segments import Segment, copy_payload
from .staging import BufferPool
from .stats import Every, Stats
from .tiers import Tier

log = logging.getLogger("kvstream")


class ReadPath:
    """Owns the read ring's in-flight core (each tier's flow, the reads in flight, orphans included),
    its staging pool and its descriptors.

    :param pool: staging buffers (its ``max_bytes`` bounds what the read path holds, in flight and idle).
    :param block: the routing block, bytes.
    :param ceiling: most bytes one tier may keep in flight (the pool's share per tier).
    :param priority: told which tiers each call reads from (writes there wait: priority.py).
    :param recover: the engine's ``recover(missed, relook, mask)`` (the second chance): ``relook``,
        keys whose indexed copies were gone, another writer's version or of another size, each with the
        caller's page size; returns the tiers usable now.
    :param after_get: the engine's ``after_get(keys, pages, found)`` (replication.py), called before a
        get returns: ``pages`` hold the caller's verified copies of the pages ``found``; a page that
        lacks a tier is owed to it. ``reopen``: opens a new ring (inflight.py). ``register_memory``: the
        setting (memory.py).

    Lock: ``lock``, one call at a time (``get``, ``drain``, ``close``, ``register_memory`` take it):
    methods ending ``_under_reads`` run with it held.
    """

    def __init__(self, ring, tiers: list[Tier], index: Index, stats: Stats, pool: BufferPool, block: int,
                 read_timeout: float, ceiling: int, digest: str, priority: ReadPriority,
                 recover: Callable[[list[str], set[str], int], int],
                 after_get: Callable[[Sequence[str], Sequence[Sequence[Segment]], list[bool]], None]
                 = lambda keys, pages, found: None, *, reopen: Callable[[], object], register_memory: bool):
        self.io = InFlight(ring, len(tiers), block, ceiling, reopen, "read")
        self.slower = SlowerTiers()  # which rule a routed call's slower tiers read by
        self.recover, self.after_get, self.priority, self.closed = recover, after_get, priority, False
        self.tiers, self.index, self.stats, self.pool = tiers, index, stats, pool
        self.read_timeout, self.said, self.said_wait = read_timeout, Every(log), Every(log)  # (a slow tier: every get)
        self.lock = ranked_lock("read")
        self.memory = CallerMemory(ring, register_memory)
        self.gate = CallerGate()  # a get holds it while it may touch caller memory (close() gives up: shut)
        self.waiting_direct = False  # a get waits for reads into caller memory: no read_timeout bounds it
        self.delivery = Delivery(tiers, index, stats, digest, self.memory)
        self.files = ReadFiles(self.delivery.stale_copy)

    @property
    def orphans(self) -> int:
        """Reads of finished calls still in flight (engine-owned buffers)."""
        return self.io.orphans

    def register_memory(self, address: int, nbytes: int) -> bool:
        """See Engine.register_memory (memory.py). False once closed."""
        self.memory.huge.refresh()  # (outside the lock: reading smaps of a large pool takes seconds)
        with self.lock:
            return not self.closed and self.memory.register(address, nbytes)

    # -- get -----------------------------------------------------------------------------------
    def get(self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], policy, mask: int) -> list[bool]:
        """See Engine.get. ``mask``: tiers usable for this batch."""
        found = [False] * len(keys)
        t0 = time.perf_counter()
        with self.lock, self.gate:
            if self.closed:  # close() ran while this call waited for the lock
                raise EngineClosedError("kvstream engine is closed")
            try:
                self._reap_under_reads(0, 0)
                busy0 = self.io.busy.snapshot()
                # read_timeout bounds the whole get: the second chance reads in what is left of it
                deadline = time.monotonic() + self.read_timeout if self.read_timeout > 0 else None
                calls = [self._call_under_reads(keys, pages, policy, mask, list(range(len(keys))), found, deadline)]
                retry: list[int] = []
                if deadline is None or time.monotonic() < deadline:
                    retry, mask = calls[0].second_chance(keys, pages, found, mask, self.index, self.recover)
                if retry:
                    calls.append(self._call_under_reads([keys[i] for i in retry], [pages[i] for i in retry],
                                                        policy, mask, retry, found, deadline))
                busy = [b - a for a, b in zip(busy0, self.io.busy.snapshot())]
            finally:
                if self.io.failed:  # (the call raises; the next one reads on a new ring)
                    self._replace_ring_under_reads()
        self.index.touch_many([keys[p] for p in range(len(keys) - 1, -1, -1) if found[p]])  # (PutCall.lru_order)
        with self.gate:  # (promotion copies from caller memory: not once close() gave up on this get)
            if not self.gate.shut:
                self.after_get(keys, pages, found)
        record_get(self.stats, calls, len(keys), sum(found), time.perf_counter() - t0, busy, policy, self.io.flows)
        return found

    def _call_under_reads(self, keys: Sequence[str], pages, policy, mask: int, pos: list[int],
                          found: list[bool], deadline: float | None) -> GetCall:
        """One routed pass over ``keys`` until ``deadline`` (monotonic; None: no limit); marks
        ``found[pos[i]]`` for each key read whole."""
        infos = self.index.pin(keys)
        call = GetCall(len(self.tiers), deadline)
        try:
            call.plan(keys, pages, infos, mask, self.stats, self.memory)
            if call.items:
                self._run_under_reads(call, policy, mask, deadline)
            done = call.pages_done()
            for p, ok in enumerate(done):
                if ok:
                    found[pos[call.page_of[p]]] = True
            for i, p in call.dups:  # (read once: its verified bytes go to the other buffer, if another)
                src = pages[call.page_of[p]]
                found[pos[i]] = done[p] and (list(pages[i]) == list(src) or copy_payload(src, pages[i]))
        finally:
            try:
                self.index.unpin(infos)
                if call.direct_in_flight and not self.gate.shut:  # an error cut the call short: reads into caller
                    # memory land first (not once close() gave up on them: the memory may be gone)
                    self._settle_direct_under_reads(call)
                self._end_call_under_reads(call)
            finally:  # (whatever the clean-up raised: a tier left read from would hold its writes)
                if call.reading:
                    self.priority.end(call.reading)  # writes to its tiers may go now (priority.py)
        return call

    def _run_under_reads(self, call: GetCall, policy, mask: int, deadline: float | None) -> None:
        route = call.route = policy.start(len(self.tiers), call.holders)
        adaptive = getattr(policy, "depth", None) is None  # a policy that fixes the depth keeps it
        unit, t0 = call.item_bytes(), time.monotonic()
        if adaptive:  # else the policy's own rule, as written (the paper's fixed m and depth)
            call.fastest = None if call.single else call.fastest_holder(self.io.flows)
            call.rule = None if call.fastest is None else self.slower.rule(call.nbytes)
            self._set_depths_under_reads(call, unit)
            route.may_steal = self._may_steal_under_reads
        claims = route.start()
        while True:
            self._submit_under_reads(call, claims)
            if route.done:
                break
            if not call.in_flight and not self.io.orphans:
                log.error("kvstream: router stalled with %d unresolved items and nothing in flight; "
                          "reporting them missing", sum(1 for a in call.arrived if not a))
                break
            # (nothing of this call in flight but earlier calls' reads fill the windows: reaping
            # them below makes room)
            now = time.monotonic()
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                call.timed_out = True
                self.said.warning("kvstream: a read batch timed out after %g s (read_timeout) with %d reads in "
                                  "flight; their pages are reported missing", self.read_timeout, call.in_flight)
                break
            wait = self.io.overdue_wait(now)
            if wait is not None:
                left = wait if left is None else min(left, wait)
            claims = []
            for req, res in self._wait_under_reads(left):
                claims += self._complete_under_reads(req, res)
            if adaptive:
                self._set_depths_under_reads(call, unit)
            claims += route.refill()  # a grown window, or a tier that turned overdue
        # Completions already there (no wait) are taken while the call is active: an error among them
        # fails its tier now, not when a later call reaps it as an orphan; buffers come back sooner.
        for req, res in self.io.reap(0, 0):
            self._complete_under_reads(req, res)
        if call.direct_in_flight:
            self._wait_direct_under_reads(call, timed_out=not route.done)
        if call.rule is not None and route.done:
            self.slower.done(call.rule, call.nbytes, sum(call.served), time.monotonic() - t0)

    # -- requests --------------------------------------------------------------------------------
    def _submit_under_reads(self, call: GetCall, claims: list) -> None:
        """Turn claims into requests and submit them; items whose page cannot be opened on the
        claiming tier fail there at once (and may be claimed by another holder)."""
        while claims:
            reqs, failed = self._requests_under_reads(call, claims)
            claims = []
            for tier, item in failed:
                call.failed.append((tier, item))
                claims += call.route.complete(tier, item, False)
            if reqs:
                self._start_under_reads(reqs)

    def _requests_under_reads(self, call: GetCall, claims: list) -> tuple[list[Req], list[tuple[int, int]]]:
        runs: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for tier, items, _steal in claims:
            for item in items:
                p, j = call.items[item]
                runs.setdefault((tier, p), []).append((j, item))
        reqs: list[Req] = []
        failed: list[tuple[int, int]] = []
        for (tier, p), blocks in runs.items():
            f = self._file_under_reads(call, tier, p)
            if f is None:
                failed += [(tier, item) for _, item in blocks]
                continue
            blocks.sort()
            page = call.pages[p]
            cap = min(max(1, self._request_bytes(tier, page.single) // page.info.block), MAX_VECTOR)  # (a
            # staged request is one buffer per block, a vectored op)
            start = 0
            for end in range(1, len(blocks) + 1):
                if end < len(blocks) and blocks[end][0] == blocks[end - 1][0] + 1 and end - start < cap:
                    continue
                reqs.append(self._request_under_reads(call, tier, p, f, blocks[start:end]))
                start = end
        return reqs, failed

    def _request_under_reads(self, call: GetCall, tier: int, p: int, f: ReadFile,
                             blocks: list[tuple[int, int]]) -> Req:
        page = call.pages[p]
        info = page.info
        j0, j1 = blocks[0][0], blocks[-1][0] + 1
        end = min(j1 * info.block, round_up(info.length))  # the last block's read is padded to ALIGN
        nbytes = end - j0 * info.block
        if page.in_place and page.single:
            bufs = None
        else:
            bufs = [self.pool.get(info.block) for _ in range(j0, j1 - 1)]
            bufs.append(self.pool.get(end - (j1 - 1) * info.block))
        f.refs += 1
        return Req(call, tier, p, j0, j1, [item for _, item in blocks], bufs, f, nbytes)

    def _file_under_reads(self, call: GetCall, tier: int, p: int) -> ReadFile | None:
        """The call's read descriptor of page ``p`` on ``tier`` (opened on first use, or again if it
        was closed while idle), or None."""
        f = call.files.get((tier, p))
        if f is None:
            f = call.files[(tier, p)] = ReadFile(tier, call.pages[p].key)
        if f.fd is None and not f.failed:
            page = call.pages[p]
            f.failed = True  # until the open below succeeds
            if self.tiers[tier].healthy:  # failed during this batch: its items go to the other holders
                within = call.left()  # (a tier that may hang: bounded, the get's time left at most; bounded.py)
                try:
                    self.files.open_file(f, call.files, lambda: self.tiers[tier].open_page(page.key, within))
                    f.failed = False
                except NotRegularFile as exc:  # a FIFO, directory, ... under the page's name: a stray
                    damage.remove_copy(self.tiers[tier], self.index, self.stats, page.key,
                                       f"{exc.strerror} under its name", remove=exc.errno != errno.EISDIR,
                                       theirs=isinstance(exc, UntrustedFile))
                except OSError as exc:
                    self.delivery.failed_read_under_reads(tier, page.key, exc.errno or errno.EIO, call, "open")
        return f if f.fd is not None else None

    def _start_under_reads(self, reqs: list[Req]) -> None:
        now = time.monotonic()
        for req in reqs:
            page = req.call.pages[req.p]
            if req.bufs is None:
                target = page.map.ranges(req.j0 * page.info.block, req.nbytes)
            else:
                target = [(b.address, b.nbytes) for b in req.bufs]
            self.io.add(req, OP_READ, req.file.fd, target[0] if len(target) == 1 else target,  # (one: a plain read)
                        HEADER_SIZE + req.j0 * page.info.block, now)
        call = reqs[0].call
        first = sum({1 << req.tier for req in reqs}) & ~call.reading  # tiers this call reads from anew
        if first:  # they hold their writes (priority.py) from before the read is on the ring: no write
            self.priority.begin(first)  # starts between the two (the call's end releases them)
            call.reading |= first
        try:
            self.io.submit()
        except BaseException:
            for req in reqs:
                self.files.drop(req.file)
                self._release_under_reads(req)
            raise
        for req in reqs:
            call.in_flight += 1
            call.requests += 1
            if req.bufs is None:
                call.direct_in_flight += 1

    # -- completions ---------------------------------------------------------------------------
    def _complete_under_reads(self, req: Req, res: int, timely: bool = True) -> list:
        """``timely``: reaped while a call waited for completions. Otherwise (orphans reaped when the
        next call starts, or by drain) the completion may be long past: it shows the tier progressed,
        but its latency and the busy time up to now measure the gap between calls, not the device."""
        call, tier = req.call, req.tier
        self.priority.progress(tier)
        self.io.measure(req, res, time.monotonic(), timely)
        self.files.drop(req.file)
        call.in_flight -= 1
        if req.bufs is None:
            call.direct_in_flight -= 1
        if res > 0:
            call.read[tier] += res
        self.stats.add(tier, "blocks_read", req.j1 - req.j0)
        self.stats.add(tier, "requests")
        if not call.active:  # orphan of an earlier call: its batch is over, only release (an error
            self.stats.total("orphan_reads")  # still tells about the tier's health)
            if res > 0:  # (its call was recorded already: the bytes count here, as every transfer does)
                self.stats.add(tier, "bytes_read", res)
            if res < 0:
                self.delivery.failed_read_under_reads(tier, call.pages[req.p].key, -res, call)
            self._release_under_reads(req)
            return []
        try:
            return self.delivery.deliver_under_reads(req, res)
        finally:
            self._release_under_reads(req)

    def _release_under_reads(self, req: Req) -> None:
        for b in req.bufs or ():
            self.pool.put(b)
        req.bufs = None if req.bufs is None else []

    # -- flow ----------------------------------------------------------------------------------
    def _request_bytes(self, tier: int, single: bool) -> int:
        """Most bytes one request of ``tier`` carries: the flow's size (small, so that little is left for
        another tier to wait on when the batch ends), or MAX_REQUEST for blocks one tier alone can
        deliver (no other tier could take over; fewer, larger requests cost less CPU per byte)."""
        return MAX_REQUEST if single else self.io.flows[tier].request

    def _set_depths_under_reads(self, call: GetCall, unit: int) -> None:
        """Each tier's window, less what earlier calls still have in flight on it, in items. A tier
        claims what one of its requests carries (at least the policy's m), but no more than a share
        of the batch that leaves every tier a few claims (a batch that one tier alone can deliver is
        not split), and no more than a MIN_REQUESTS-th of its window: a claim as large as the window
        would let the device wait for every round of completions (2 MiB pages: 0.6x nixl; half the
        window: 1.0-1.2x). How much each tier keeps in flight: ``GetCall.queue_bytes``; a routed call's rule
        (flow.SlowerTiers) may hold every tier but ``call.fastest`` to one item, until that one fails or stalls."""
        route = call.route
        flows = self.io.flows
        share = route.n if call.single else route.n // (2 * len(flows))
        held = call.rule == HELD and self.tiers[call.fastest].healthy and not self.io.overdue(call.fastest)
        for k, flow in enumerate(flows):
            depth = max(0, call.queue_bytes(flow) - self.io.orphaned[k]) // unit
            depth = depth or int(not self.io.bytes[k])  # (a block larger than the window: one at a time)
            claim = max(route.m, min(self._request_bytes(k, call.single) // unit, share, depth // MIN_REQUESTS))
            if held and k != call.fastest and flow.rate:  # (no more than what its orphans left: a stalled
                depth, claim = min(depth, 1), 1  # tier took one more read per call, past its window)
            route.set_depth(k, depth, claim)

    def _may_steal_under_reads(self, tier: int, owner: int) -> bool:
        """An idle tier re-reads items in flight on ``owner`` only when it outpaces it (flow.outpaces),
        ``owner`` has fallen quiet (InFlight.quiet_for) or is overdue (stalled): otherwise the owner delivers
        them sooner than a re-read."""
        flows = self.io.flows
        return outpaces(flows[tier].rate, flows[owner].rate) or self.io.quiet_for(owner, tier) or self.io.overdue(owner)

    # -- end of a call -----------------------------------------------------------------------------
    def _wait_direct_under_reads(self, call: GetCall, timed_out: bool) -> None:
        """Reads into caller memory must land before the call returns: wait for them. (After a
        timeout that is news; otherwise another tier delivered their blocks first, which is routine.)"""
        (self.said_wait.warning if timed_out else log.debug)(  # (a slow tier: after every get's timeout)
            "kvstream: waiting for %d reads into caller memory before returning", call.direct_in_flight)
        while call.direct_in_flight and self.io.ring.in_flight:  # (a completion lost to an error has landed)
            self.waiting_direct = True  # (a hung tier holds them: close() may give up on this get)
            try:
                done = self._wait_under_reads(None)
            finally:
                self.waiting_direct = False
            for req, res in done:
                self._complete_under_reads(req, res)

    def _wait_under_reads(self, timeout: float | None) -> list:
        """At least one completion (or none by ``timeout``), the caller-memory gate let go while waiting:
        close() may give up on this get meanwhile (memory.CallerGate: then EngineClosedError)."""
        self.gate.leave()
        try:
            return self.io.reap(1, timeout)
        finally:
            self.gate.back()

    def _settle_direct_under_reads(self, call: GetCall) -> None:
        """After an error inside a call: its reads into caller memory must still land before it
        returns. Where the ring failed (then, or while waiting here), replacing it lands or cancels them."""
        try:
            if not self.io.failed:
                self._wait_direct_under_reads(call, timed_out=True)
        finally:
            if call.direct_in_flight:
                self._replace_ring_under_reads()

    def _replace_ring_under_reads(self) -> None:
        """Replace the failed ring (inflight.py), the caller memory registered with the new one. If none
        opens, the read path closes (calls raise EngineClosedError)."""
        self.stats.total("ring_failures")
        self._give_up_under_reads(self.io.replace())
        self.closed = self.io.ring.closed
        self.memory.rebind(self.io.ring)

    def _give_up_under_reads(self, reqs: list[Req]) -> None:
        """Release requests the ring will never complete: an active call misses their blocks."""
        for req in reqs:
            req.call.in_flight -= req.call.active
            req.call.direct_in_flight -= req.call.active and req.bufs is None
            self.files.drop(req.file)
            self._release_under_reads(req)

    def _end_call_under_reads(self, call: GetCall) -> None:
        call.active = False
        if call.in_flight:
            self.io.orphan(req for req in self.io.requests() if req.call is call)
        for k in range(len(self.tiers)):
            self.stats.add(k, "pages_read", sum(1 for mask in call.page_tiers if mask >> k & 1))
        self.files.release(call.files)
        if call.route is not None:
            for tier, _ in {(tier, call.items[item][0]) for tier, item in call.failed if call.arrived[item]}:
                self.stats.add(tier, "replica_retries")  # (a page read, whatever its blocks)

    # -- orphans -------------------------------------------------------------------------------
    def _reap_under_reads(self, min_complete: int, timeout: float | None) -> None:
        if len(self.io):
            for req, res in self.io.reap(min_complete, timeout):
                self._complete_under_reads(req, res, timely=False)

    def drain(self, timeout: float | None, closing: bool = False) -> int:
        """Reap orphans until none is in flight or ``timeout`` passes; returns how many remain. A get
        still inside past ``timeout`` counts as one; ``closing``: close() gives up on it (CallerGate) if it
        waits for reads into caller memory (nothing bounds that wait), else after its read_timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        got = self.lock.acquire(timeout=-1 if timeout is None else timeout)
        if not got and closing and self.read_timeout > 0 and not self.waiting_direct:
            got = self.lock.acquire(timeout=self.read_timeout)  # (a get inside, slow: read_timeout ends it)
        if not got:
            if closing and not self.gate.close(timeout):
                log.warning("kvstream: close(): a get is held in a call on a hung tier; it ends when that call "
                            "returns, touching no caller memory after")
            return max(1, len(self.io))
        try:
            while len(self.io):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._reap_under_reads(1, left)
        except OSError:  # the ring failed (inflight.py): replacing it ends what it held
            self._replace_ring_under_reads()
        finally:
            self.lock.release()
        return len(self.io)

    def close(self) -> None:
        """Close the ring (it drains what is in flight), then release every request's resources."""
        with self.lock:
            self.closed = True
            self.io.ring.close()
            self._give_up_under_reads(self.io.abandon())
            self.pool.close()
