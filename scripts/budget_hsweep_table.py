"""Table of scripts/budget_hsweep.sh: per H, mean and worst over seeds of tier0/policy (mean TTFT) and, at high
reuse, policy vs today's kvstream."""
import glob, json, os, sys
from collections import defaultdict
out = sys.argv[1]
vs_t0, vs_kv = defaultdict(list), defaultdict(list)
for f in glob.glob(os.path.join(out, "*.json")):
    case, seed, tb, m = os.path.basename(f)[:-5].split(".")
    pol = json.load(open(f))["policies"]
    for name, p in pol.items():
        if name == "tier0":
            continue
        key = (case, tb, m, name)
        vs_t0[key].append(pol["tier0"]["ttft_mean_s"] / p["ttft_mean_s"])
        vs_kv[key].append(pol["kvstream"]["ttft_mean_s"] / p["ttft_mean_s"])
names = sorted({k[3] for k in vs_t0}, key=lambda n: (n != "kvstream", float(n.split("+")[-1]) if "+" in n else 0))
cols = sorted({k[:3] for k in vs_t0})
print("| policy | " + " | ".join(f"{c}.{t}.{m}" for c, t, m in cols) + " |")
print("|---|" + "---|" * len(cols))
for n in names:
    cells = []
    for c in cols:
        v = vs_kv[c + (n,)] if c[0] == "swe" else vs_t0[c + (n,)]
        cells.append(f"{sum(v) / len(v):.2f} ({min(v):.2f})")
    print(f"| {n.replace('budget:h=', 'budget ')} | " + " | ".join(cells) + " |")
