# Engine.put of N pages of K KiB to one tier directory (a put throughput probe): python put_one_tier.py DIR KIB N
import os, sys, time, shutil, resource
from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.io import AlignedBuffer
root, page_kib, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
page = page_kib << 10
d = os.path.join(root, "putg"); shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
eng = Engine(Config.from_sources({"tiers": [d], "replicate": "all"}, environ={}), Namespace({"model": "putg", "page": page_kib}))
buf = AlignedBuffer(page * n + 4096)
for r in range(3):
    keys = [f"r{r}-{i:05d}" for i in range(n)]
    pages = [[(buf.address + i * page, page)] for i in range(n)]
    t = time.perf_counter(); c = resource.getrusage(resource.RUSAGE_SELF)
    ok = eng.put(keys, pages)
    w = time.perf_counter() - t; c2 = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{root}: {n} x {page_kib} KiB put: {n*page/w/1e6:.0f} MB/s, {n/w:.0f} pages/s, {w/n*1e3:.2f} ms/page, ok {sum(map(bool, ok)) if isinstance(ok, list) else ok}")
eng.close(); shutil.rmtree(d, ignore_errors=True)
