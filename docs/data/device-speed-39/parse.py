import re,sys,statistics
rows={}
for f in sys.argv[1:]:
    tree=geo=None
    for line in open(f):
        m=re.match(r'=== round (\d+) tree (\w+) geo (\d+) (\d+)',line)
        if m: rnd,tree,geo=m.group(1),m.group(2),{'8':'1MiB','2':'256KiB'}[m.group(3)]; continue
        m=re.match(r'(nixl|adapter-1tier|adapter)\s+page \d+ KiB: MB/s med\s+(\d+).*CPU s/GB med ([\d.]+).*xnixl med ([\d.]+).*xadapter-1tier med ([\d.]+)',line)
        if m and tree:
            rows.setdefault((geo,tree,m.group(1)),[]).append((int(m.group(2)),float(m.group(3)),float(m.group(4)),float(m.group(5))))
for geo in ('1MiB','256KiB'):
    for tree in ('new','old'):
        for mode in ('adapter-1tier','adapter'):
            r=rows.get((geo,tree,mode),[])
            if not r: continue
            xn=[x[2] for x in r]; x1=[x[3] for x in r]; cpu=[x[1] for x in r]
            print(f"{geo:7s} {tree} {mode:14s} runs {len(r)}  x nixl med {statistics.median(xn):.2f} [{min(xn):.2f}-{max(xn):.2f}]  x 1tier med {statistics.median(x1):.2f} [{min(x1):.2f}-{max(x1):.2f}]  CPU s/GB med {statistics.median(cpu):.3f}")
    r=rows.get((geo,'new','nixl'),[])+rows.get((geo,'old','nixl'),[])
    print(f"{geo} nixl CPU s/GB med {statistics.median([x[1] for x in r]):.3f}")
