"""The table in docs/benchmarks.md, "Stop 42's changes against the read path": per run the ratio to
nixl in that run, over runs the median and the range. python table.py (in this directory)."""
import re
import statistics as st

SETS = {"rounds 1-4": ["ramA-ab.txt"], "rounds 5-8 (1 MiB)": ["ramA-ab2.txt"], "rounds 1-8": ["ramA-ab.txt", "ramA-ab2.txt"]}
for name, files in SETS.items():
    runs = {}
    for f in files:
        tree = geo = None
        for line in open(f):
            m = re.match(r"=== round (\d+) tree (\w+) geo (\d+)", line)
            if m:
                rnd, tree, geo = m.group(1), m.group(2), {"8": "1 MiB", "2": "256 KiB"}[m.group(3)]
                continue
            m = re.match(r"(adapter-1tier|adapter|nixl)\s+page \d+ KiB: MB/s med\s+(\d+).*CPU s/GB med ([\d.]+)", line)
            if m:
                runs.setdefault((rnd, tree, geo), {})[m.group(1)] = (int(m.group(2)), float(m.group(3)))
    for geo in ("1 MiB", "256 KiB"):
        for tree in ("new", "old"):
            rs = [v for (r, t, g), v in runs.items() if t == tree and g == geo and len(v) == 3]
            if not rs:
                continue
            f = lambda a: f"{st.median(a):.2f} [{min(a):.2f}-{max(a):.2f}]"  # noqa: E731
            print(name, geo, tree, len(rs), "| 1t x nixl", f([v["adapter-1tier"][0] / v["nixl"][0] for v in rs]),
                  "| 2t x nixl", f([v["adapter"][0] / v["nixl"][0] for v in rs]),
                  "| 2t x 1t", f([v["adapter"][0] / v["adapter-1tier"][0] for v in rs]),
                  "| CPU x nixl 1t", f([v["adapter-1tier"][1] / v["nixl"][1] for v in rs]),
                  "2t", f([v["adapter"][1] / v["nixl"][1] for v in rs]))
