# 256 files of 256 KiB written as the engine writes a page (create O_DIRECT, write, close, rename) by T threads: python write_threads.py DIR T
import os, sys, time, mmap, shutil
from concurrent.futures import ThreadPoolExecutor
root, n, threads = sys.argv[1], 256, int(sys.argv[2])
d = os.path.join(root, "pw"); shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
buf = mmap.mmap(-1, 256 << 10)
def one(i):
    tmp = os.path.join(d, f".t{i}"); fin = os.path.join(d, f"p{i}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    os.write(fd, buf); os.close(fd); os.rename(tmp, fin)
for r in range(2):
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(r * n, (r + 1) * n)))
    w = time.perf_counter() - t
    print(f"{threads} threads: {n*(256<<10)/w/1e6:.0f} MB/s, {w/n*1e3:.2f} ms/page")
shutil.rmtree(d, ignore_errors=True)
