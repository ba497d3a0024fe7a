# per-call timing on DIR: create(O_DIRECT|O_EXCL), write 256 KiB, fdatasync, close, rename; T threads
import os, sys, time, mmap, shutil, statistics as st
from concurrent.futures import ThreadPoolExecutor
root, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = os.path.join(root, "pc"); shutil.rmtree(d, ignore_errors=True); os.makedirs(d+"/tmp"); os.makedirs(d+"/pages")
buf = mmap.mmap(-1, 256 << 10)
T = {k: [] for k in ("create", "write", "fdatasync", "close", "rename")}
def one(i):
    tmp = os.path.join(d, "tmp", f"t{i}"); fin = os.path.join(d, "pages", f"p{i}")
    a = time.perf_counter(); fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_NOFOLLOW, 0o600)
    b = time.perf_counter(); os.pwrite(fd, buf, 0)
    c = time.perf_counter(); os.fdatasync(fd)
    e = time.perf_counter(); os.close(fd)
    f = time.perf_counter(); os.rename(tmp, fin); g = time.perf_counter()
    for k, v in zip(T, (b-a, c-b, e-c, f-e, g-f)): T[k].append(v*1e3)
t = time.perf_counter()
with ThreadPoolExecutor(threads) as ex: list(ex.map(one, range(n)))
w = time.perf_counter() - t
print(f"{threads} thr: {n*(256<<10)/w/1e6:.0f} MB/s; ms median/p90: " + ", ".join(f"{k} {st.median(v):.2f}/{sorted(v)[int(.9*len(v))]:.2f}" for k, v in T.items()))
shutil.rmtree(d, ignore_errors=True)
