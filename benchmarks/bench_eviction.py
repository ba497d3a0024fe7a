"""Which pages an L3 at its capacity keeps: a Mooncake trace replayed through a host cache and kvstream's
own index (kvstream_hicache.index.Index) as L3, under three LRU orders of a call's pages.

As SGLang's HiCache runs (write-through): each request's blocks are a chain (Mooncake's ``hash_ids``, 512
tokens a block); host memory holds ``--host`` blocks, LRU, evicting a chain from its tail as SGLang's radix
tree evicts leaves; a request hits host memory for its leading run of blocks there, then L3 for the leading
run after that (``batch_exists``), which is read (``batch_get``); the blocks after are computed and written
to host memory and L3 (``batch_set``). L3 holds ``--l3`` blocks (one tier). The orders:

- ``batch``: a call's pages touched in batch order, nothing for its prefix (kvstream before stop 55);
- ``reverse``: in reverse batch order (a call's head the most recent: PutCall.lru_order);
- ``prefix``: reverse, then the pages before the call (SGLang's ``prefix_keys``) touched, head last
  (Engine.touch_prefix: kvstream with ``hicache_storage_pass_prefix_keys``, on for kvstream's launcher).

Prints, per order, the tokens served from L3 and the prompt tokens found in host memory or L3 (of every
request's input tokens), and the index's CPU for the touches.

``--agents``: a generated workload instead of a trace, the case the orders are for: 8 agents, each with a
context of 40 blocks shared by its requests (a repository, a document), each request adding 4 blocks of its
own; every 10th request is another user's prompt of 40 new blocks, which pushes the agents' contexts out of
host memory; the agents' requests come round-robin.

usage: python benchmarks/bench_eviction.py [--trace data/traces/mooncake/conversation_trace.jsonl | --agents N]
           [--host 2000] [--l3 20000] [--requests N]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict

from kvstream_hicache.index import Index

BLOCK = 512  # tokens a Mooncake block


def replay(requests: list[dict], host_blocks: int, l3_blocks: int, order: str) -> dict:
    index = Index([l3_blocks])  # (capacity in blocks: each page counts 1 byte)
    host: OrderedDict[int, None] = OrderedDict()
    served = found = total = 0
    touch_s = 0.0
    for req in requests:
        ids = req["hash_ids"]
        sizes = [min(BLOCK, req["input_length"] - BLOCK * j) for j in range(len(ids))]
        keys = [f"{i:064x}" for i in ids]
        in_host = 0
        while in_host < len(ids) and ids[in_host] in host:
            in_host += 1
        in_l3 = index.prefix_len(keys[in_host:])
        read, new = keys[in_host:in_host + in_l3], keys[in_host + in_l3:]
        served += sum(sizes[in_host:in_host + in_l3])
        found += sum(sizes[:in_host + in_l3])
        total += sum(sizes)
        t0 = time.thread_time()
        for call in (read, new):  # batch_get, then batch_set
            if call is new:
                for key in new:
                    if index.reserve(0, 1) is not None:
                        index.commit(key, 0, 1, 1, (0,), 1)
            if call:
                index.touch_many(call if order == "batch" else call[::-1])
                if order == "prefix":
                    index.touch_many(keys[:keys.index(call[0])][::-1])
        touch_s += time.thread_time() - t0
        for i in reversed(ids):  # host memory: the request's blocks, its head the most recent
            host[i] = None
            host.move_to_end(i)
        while len(host) > host_blocks:
            host.popitem(last=False)
    return {"l3_tokens": served, "hit_share": found / total, "touch_s": touch_s}


def agents(n: int, contexts: int = 8, shared: int = 40, own: int = 4, every: int = 10, other: int = 40) -> list[dict]:
    """``n`` requests of the ``--agents`` workload (see the module's docstring), as a Mooncake trace's lines."""
    fresh = iter(range(contexts * shared, 1 << 62))
    reqs = []
    for r in range(n):
        if r % every == every - 1:
            ids = [next(fresh) for _ in range(other)]
        else:
            a = r % contexts
            ids = list(range(a * shared, (a + 1) * shared)) + [next(fresh) for _ in range(own)]
        reqs.append({"input_length": BLOCK * len(ids), "hash_ids": ids})
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="data/traces/mooncake/conversation_trace.jsonl")
    ap.add_argument("--host", type=int, default=2000, help="host memory, blocks of 512 tokens")
    ap.add_argument("--l3", type=int, default=20000, help="L3 capacity, blocks of 512 tokens")
    ap.add_argument("--requests", type=int, default=0, help="the first N requests (0: all)")
    ap.add_argument("--agents", type=int, default=0, help="N requests of the generated agents' workload")
    args = ap.parse_args()
    if args.agents:
        requests, name = agents(args.agents), "agents"
    else:
        with open(args.trace) as fh:
            requests, name = [json.loads(line) for line in fh if line.strip()], args.trace
    if args.requests:
        requests = requests[:args.requests]
    print(f"{name}: {len(requests)} requests, host {args.host} blocks, L3 {args.l3} blocks")
    base = None
    for order in ("batch", "reverse", "prefix"):
        r = replay(requests, args.host, args.l3, order)
        base = r["l3_tokens"] if base is None else base
        ratio = f"{r['l3_tokens'] / base:.2f}x" if base else "-"
        print(f"{order:8s} L3 tokens served {r['l3_tokens']:>12,d} ({ratio} batch)  "
              f"prompt tokens found {100 * r['hit_share']:.1f}%  touches {r['touch_s']:.2f} s CPU")


if __name__ == "__main__":
    main()
