"""The read path's open of a page file: open_regular's Python steps (open O_NONBLOCK|O_NOFOLLOW, fstat,
owner, F_SETFL) against open_direct's one C call, on 2000 files of DIR (created if missing), 3 passes.
usage: PYTHONPATH=. python docs/data/device-speed-35/open_direct.py DIR"""
import os, sys, time
from kvstream_hicache.integrity import open_regular, open_direct
from kvstream_hicache.trust import Trust
from kvstream_hicache.fds import close_fd
d = sys.argv[1]
os.makedirs(d + "/ab", exist_ok=True)
paths = [f"{d}/ab/{i:064x}.kvp" for i in range(2000)]
for p in paths:
    if not os.path.exists(p):
        with open(p, "wb") as f:
            f.write(b"x" * 8192)
t = Trust.user()
for rep in range(3):
    t0 = time.perf_counter()
    for p in paths:
        close_fd(open_regular(p, os.O_DIRECT, trust=t)[0])
    t1 = time.perf_counter()
    for p in paths:
        close_fd(open_direct(p, t))
    t2 = time.perf_counter()
    print(f"open_regular + close {1e6*(t1-t0)/len(paths):.1f} us, open_direct + close {1e6*(t2-t1)/len(paths):.1f} us")
