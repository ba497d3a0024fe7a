"""Workloads for kvsim: Mooncake traces or generated ones, arrival order and rate, and the block stream
with its reuse distances.

Requests come from the project's shared workload module (``kvstream_hicache.tools.workload``: the Mooncake
JSONL reader, session inference, session re-interleaving and the rate factor), so kvsim and the
examples read traces the same way. This module adds what the model needs on top:

* ``BlockStream``: every (request, block) access in serving order, with the tokens each access
  reuses from an earlier prefix (the matched prefix, ``V``), the tokens it adds (the writes, ``W``)
  and its **reuse distance** ``d``: the tokens of distinct KV touched since the block's previous use,
  the block itself included (multiply by the KV bytes per token to get bytes). Under LRU a reuse hits
  the GPU+host memory of capacity ``M`` exactly when ``d <= M`` (Eq. 2), so one pass gives the
  storage demand for every capacity.
* ``lru_misses``: an explicit LRU cache, independent of the distances, to check Eq. 2 against.

Block sizes: block ``j`` of a prompt has ``min(512, input_length - 512 j)`` tokens; a block id keeps
the largest size seen, and a reuse matches ``min(size now, size stored)`` tokens, the run of matched
blocks stopping at the first block that is new or longer than stored (ids are prefix-chained).
Every block of a prompt is touched (moved to most recent) when its request is served.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["ORDERS", "load_requests", "BlockStream", "build_stream", "lru_misses", "brute_force_distances"]

ORDERS = ("recorded", "random", "round-robin", "cache-friendly")
_ALIASES = {"as-recorded": "recorded", "shuffled": "random", "sessions-shuffled": "random", "rr": "round-robin"}
BLOCK_TOKENS = 512  # tokens per Mooncake hash block


def _workload():
    from .. import workload  # the shared reader/generator (examples issue); imported on first use

    return workload


def load_requests(
    path: str | os.PathLike | None = None,
    *,
    workload: str | None = None,
    order: str = "recorded",
    rate: float = 1.0,
    seed: int = 0,
    limit: int | None = None,
    reuse: float | None = None,
) -> list:
    """Requests in serving order from a Mooncake JSONL ``path`` or a generated ``workload``
    (``"swebench"``), re-interleaved by ``order`` and with arrivals sped up by ``rate``.

    ``order``: ``recorded`` (as in the trace), ``random`` (alias ``shuffled``: whole sessions
    interleaved at random, turn order kept), ``round-robin`` (one turn per session per round: the
    longest reuse distances), ``cache-friendly`` (each session's turns back to back). Traces without
    session ids get them inferred from shared prefixes first.
    """
    wl = _workload()
    order = _ALIASES.get(order, order)
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}: choose one of {', '.join(ORDERS)} (or 'shuffled')")
    if (path is None) == (workload is None):
        raise ValueError("give exactly one of a trace path and a workload name")
    if path is not None:
        requests = wl.read_mooncake(path, limit=limit)
    elif workload == "swebench":
        requests = wl.generate_swebench(seed=seed, reuse=reuse)
        if limit is not None:
            requests = requests[:limit]
    else:
        raise ValueError(f"unknown workload {workload!r}: the generated workload is 'swebench'")
    if order != "recorded":
        if any(r.session_id is None for r in requests):
            requests = wl.infer_sessions(requests)
        requests = wl.reorder(requests, order, seed=seed)
    if rate != 1.0:
        requests = wl.scale_rate(requests, rate)
    return requests


@dataclass
class BlockStream:
    """Per access (one per prompt block, in serving order) and per request arrays; tokens, not bytes."""

    request: np.ndarray  # int: request index of each access
    position: np.ndarray  # int: block index within its prompt
    block_id: np.ndarray  # int: hash id
    reused: np.ndarray  # int: tokens this access reuses from a stored prefix (0: not in the matched run)
    written: np.ndarray  # int: new tokens this access stores
    distance: np.ndarray  # float: reuse distance in tokens (inf: first touch)
    # per request
    arrival_s: np.ndarray
    input_length: np.ndarray
    output_length: np.ndarray
    n_blocks: np.ndarray
    start: np.ndarray  # index of the request's first access

    @property
    def reuse_tokens(self) -> int:
        """``V`` in tokens: the matched prefix tokens of the whole session."""
        return int(self.reused.sum())

    def miss_tokens(self, capacity_tokens: float) -> np.ndarray:
        """Per access: reused tokens that miss a GPU+host LRU memory of ``capacity_tokens``."""
        return np.where(self.distance > capacity_tokens, self.reused, 0)

    def storage_tokens(self, capacity_tokens: float) -> int:
        """Eq. 2 in tokens: ``V * Pr[d > M]``, with the probability weighted by reused tokens."""
        return int(self.miss_tokens(capacity_tokens).sum())


def build_stream(requests: Sequence, block_tokens: int = BLOCK_TOKENS) -> BlockStream:
    """The block stream of ``requests`` (in the order given) with reuse distances, in one pass.

    Distances use a Fenwick tree over access positions holding, at each block's latest access, the
    block's stored tokens: the tokens of distinct blocks touched since position ``p`` are the tree's
    total minus its prefix sum through ``p``. O(accesses * log accesses).
    """
    n_acc = sum(len(r.hash_ids) for r in requests)
    request = np.empty(n_acc, dtype=np.int32)
    position = np.empty(n_acc, dtype=np.int32)
    block_id = np.empty(n_acc, dtype=np.int64)
    reused = np.zeros(n_acc, dtype=np.int64)
    written = np.zeros(n_acc, dtype=np.int64)
    distance = np.full(n_acc, np.inf)
    start = np.empty(len(requests), dtype=np.int64)

    tree = [0] * (n_acc + 1)  # Fenwick tree, 1-based
    last: dict[int, int] = {}  # block id -> position of its latest access (0-based)
    stored: dict[int, int] = {}  # block id -> tokens stored
    total = 0
    dist_out = distance  # local alias for speed
    t = 0
    for r_index, req in enumerate(requests):
        start[r_index] = t
        ids = req.hash_ids
        n = len(ids)
        run = True
        for j, h in enumerate(ids):
            size = block_tokens if j < n - 1 else req.input_length - block_tokens * (n - 1)
            had = stored.get(h, 0)
            request[t] = r_index
            position[t] = j
            block_id[t] = h
            if run:
                reused[t] = min(size, had)
                run = had >= size
            new = size if size > had else had
            if new > had:
                written[t] = new - had
                stored[h] = new
            p = last.get(h)
            if p is not None:
                s, i = 0, p + 1
                while i > 0:
                    s += tree[i]
                    i -= i & -i
                dist_out[t] = total - s + had
                i = p + 1
                while i <= n_acc:
                    tree[i] -= had
                    i += i & -i
            i = t + 1
            while i <= n_acc:
                tree[i] += new
                i += i & -i
            total += new - had
            last[h] = t
            t += 1
    return BlockStream(
        request=request,
        position=position,
        block_id=block_id,
        reused=reused,
        written=written,
        distance=distance,
        arrival_s=np.array([r.timestamp / 1000.0 for r in requests], dtype=float),
        input_length=np.array([r.input_length for r in requests], dtype=np.int64),
        output_length=np.array([r.output_length for r in requests], dtype=np.int64),
        n_blocks=np.array([len(r.hash_ids) for r in requests], dtype=np.int64),
        start=start,
    )


def lru_misses(stream: BlockStream, capacity_tokens: float) -> np.ndarray:
    """Per access: reused tokens an explicit LRU memory of ``capacity_tokens`` misses.

    Independent of the distances (an ``OrderedDict`` with byte accounting, evicting least recently
    used blocks until the rest fits), so it checks Eq. 2.
    """
    cache: OrderedDict[int, int] = OrderedDict()  # block id -> tokens, least recent first
    used = 0
    out = np.zeros(len(stream.block_id), dtype=np.int64)
    sizes: dict[int, int] = {}
    for t in range(len(stream.block_id)):
        h = int(stream.block_id[t])
        had = sizes.get(h, 0)
        new = had + int(stream.written[t])
        sizes[h] = new
        if stream.reused[t] and h not in cache:
            out[t] = stream.reused[t]
        if h in cache:
            used -= cache.pop(h)
        cache[h] = new
        used += new
        while used > capacity_tokens and cache:
            _, evicted = cache.popitem(last=False)
            used -= evicted
    return out


def brute_force_distances(stream: BlockStream) -> np.ndarray:
    """Reuse distances by definition (quadratic; for tests): for each access with an earlier use, the
    stored tokens of the distinct blocks touched since that use, plus the block's own stored tokens."""
    ids = [int(x) for x in stream.block_id]
    sizes: dict[int, int] = {}
    size_after: list[int] = []
    for t, h in enumerate(ids):
        sizes[h] = sizes.get(h, 0) + int(stream.written[t])
        size_after.append(sizes[h])
    out = np.full(len(ids), np.inf)
    for t, h in enumerate(ids):
        prev = max((p for p in range(t) if ids[p] == h), default=None)
        if prev is None:
            continue
        latest: dict[int, int] = {}
        for p in range(prev + 1, t):
            latest[ids[p]] = size_after[p]  # a block's size as of its latest touch in the window
        out[t] = sum(latest.values()) + size_after[prev]
    return out
