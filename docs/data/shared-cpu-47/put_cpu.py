# put_one_tier.py with CPU: put_cpu.py DIR KIB N P [FSYNC]: N pages of K KiB to one tier DIR, P puts (fsync FSYNC, default never); prints MB/s and process CPU s/GB per put
import os, sys, time, shutil, resource
from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.io import AlignedBuffer
root, page_kib, n, puts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fsync = sys.argv[5] if len(sys.argv) > 5 else "never"
page = page_kib << 10
d = os.path.join(root, "putg"); shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
eng = Engine(Config.from_sources({"tiers": [d], "replicate": "all", "fsync": fsync}, environ={}), Namespace({"model": "putg", "page": page_kib}))
buf = AlignedBuffer(page * n + 4096)
for r in range(puts):
    keys = [f"r{r}-{i:05d}" for i in range(n)]
    pages = [[(buf.address + i * page, page)] for i in range(n)]
    c = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    ok = eng.put(keys, pages)
    w = time.perf_counter() - t; c2 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = c2.ru_utime + c2.ru_stime - c.ru_utime - c.ru_stime
    assert all(ok)
    print(f"RESULT {n*page/w/1e6:.1f} {cpu/(n*page/1e9):.3f}")
eng.close(); shutil.rmtree(d, ignore_errors=True)
