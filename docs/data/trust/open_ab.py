import os, sys, time, hashlib, json
tree, root = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
from kvstream_hicache import Config, Engine, Namespace
eng = Engine(Config.from_sources({"tiers": [root]}, environ={}), Namespace({"model": "sc"}), announce=False)
if hasattr(eng, "wait_scan"): eng.wait_scan(60)
tier = eng.tiers[0]
keys = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(3000)]
for k in keys[:200]: os.close(tier.open_page(k))
best = None
for rep in range(5):
    t, c = time.perf_counter(), time.thread_time()
    for k in keys: os.close(tier.open_page(k))
    w, cc = (time.perf_counter() - t) / len(keys) * 1e6, (time.thread_time() - c) / len(keys) * 1e6
    best = (w, cc) if best is None or cc < best[1] else best
eng.close()
print(json.dumps({"wall_us": best[0], "cpu_us": best[1]}))
