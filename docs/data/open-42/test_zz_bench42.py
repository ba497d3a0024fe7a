import os, time, uuid, shutil, statistics
from helpers import PageSet, make_engine
from kvstream_hicache.router import SingleTier

def test_bench_gluster_get(glusterfs, tier_root):
    share = f"bench-{uuid.uuid4().hex[:8]}"
    d = os.path.join(glusterfs.mount("a"), share)
    os.makedirs(d)
    pages = PageSet(256 << 10)
    keys = pages.keys(64)
    out = []
    with make_engine([d]) as engine:
        assert pages.put(engine, keys) == [True] * 64
        for r in range(7):
            t0 = time.perf_counter(); c0 = time.process_time()
            found, _ = pages.get(engine, keys, SingleTier(0))
            out.append((time.perf_counter() - t0, time.process_time() - c0))
            assert all(found)
    shutil.rmtree(d, ignore_errors=True)
    w = statistics.median(x for x, _ in out); c = statistics.median(y for _, y in out)
    print(f"\nBENCH {os.environ.get('TREE')} wall_med={w*1000:.1f}ms cpu_med={c*1000:.1f}ms all={[round(x*1000,1) for x,_ in out]}")
