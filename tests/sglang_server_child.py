"""One 'sglang server' of tests/test_sglang_shared_tier.py: sglang's real HybridCacheController on the CPU
with kvstream on a private tier 0 and a tier 1 shared with another server of the same model.

    python sglang_server_child.py WHO TIER0 SHARED OUT GO

1. backs up its own prompt (seed 100 + WHO) through the backup thread;
2. backs up the common prompt (same tokens for both servers, its own bytes: seed 200 + WHO) with its
   writes held until GO exists: both servers looked the pages up and wrote their temporary files
   before either committed, so both store every common page and the shared tier keeps one server's
   version of each;
3. creates OUT.stored and waits for GO.read (both servers stored);
4. prefetches its own prompt, the other server's prompt (found on the shared tier) and the common one,
   and compares every page with the bytes the writer put (regenerated from the seeds);
5. writes OUT (JSON): per prompt the tokens read and whether the bytes match, the engine's counters and
   its check().
"""
from __future__ import annotations

import json
import os
import sys

from kvstream_hicache.tools import cpu_sglang

from helpers import HoldWrites, release_on, wait_for_file

PAGE = 16
PAGES = 6


def main(who: int, tier0: str, shared: str, out: str, go: str) -> int:
    cpu_sglang.install_stubs()
    cpu_sglang.load_kvstream_plugin()
    from kvstream_hicache.engine import Engine
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    plan = HoldWrites(lambda: open(out + ".holding", "w").close())

    def open_engine(self, namespace):  # the backend's engine, with this process's hold on its writes
        return Engine(self.config, namespace, announce=False, fault_plan=plan)

    KVStreamHiCacheStorage._open_engine = open_engine
    pools = cpu_sglang.make_pools("mha", "page_first", page_size=PAGE)
    result: dict = {}
    # reads go to the shared tier first (policy tier1), so the common pages' copies there, one of them
    # the other server's version, are always met
    extra = {"tiers": [tier0, shared], "tier_retry": 0.2, "policy": "tier1"}
    with cpu_sglang.ControllerDriver(pools, "kvstream", extra_config=extra) as drv:
        prompts = {name: cpu_sglang.random_tokens(PAGES * PAGE, seed=seed)
                   for name, seed in (("own", 100 + who), ("other", 100 + (1 - who)), ("common", 7))}
        seeds = {"own": 100 + who, "other": 100 + (1 - who), "common": 200 + who}
        src = cpu_sglang.fill_random(pools, PAGES * PAGE, seed=seeds["own"])
        result["own_stored"] = drv.backup(prompts["own"], src)
        pools.free(src)
        src = cpu_sglang.fill_random(pools, PAGES * PAGE, seed=seeds["common"])
        plan.armed = True
        release_on(plan, go)
        result["common_stored"] = drv.backup(prompts["common"], src)
        pools.free(src)
        open(out + ".stored", "w").close()
        wait_for_file(go + ".read")
        for name, tokens in prompts.items():
            got = drv.prefetch(tokens)
            want = cpu_sglang.fill_random(pools, PAGES * PAGE, seed=seeds[name])
            result[name] = {"tokens": got.tokens, "bytes": got.tokens == len(tokens)
                            and pools.page_bytes(got.host_indices) == pools.page_bytes(want)}
            pools.free(want)
            pools.free(got.host_indices)
        stats = drv.storage.stats()
        result["threads_alive"] = drv.threads_alive()
        result["quarantined"] = sum(t["quarantined"] for t in stats["tiers"])
        result["other_versions"] = sum(t.get("other_versions", 0) for t in stats["tiers"])
        result["adapter_errors"] = stats["adapter"]["errors"]
        result["problems"] = [p._asdict() for p in drv.storage.engine.check()]
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    who, tier0, shared, out, go = sys.argv[1:]
    sys.exit(main(int(who), tier0, shared, out, go))
