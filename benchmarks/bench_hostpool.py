"""Through sglang's real host pool: kvstream's SGLang adapter, on one tier or two, against sglang's HiCacheNixl.

What a SGLang user's prefetch costs (issue 27): ``HiCacheController._page_get_zero_copy`` into sglang's
real MHA page_first host pool (as SGLang allocates it on the CPU: an anonymous shared mapping in 4 KiB
pages, or hugetlb pages with ``SGLANG_HUGEPAGE_SIZE=2MB``), llama3-8b pages of PAGE_TOKENS tokens,
BATCH_PAGES pages per call, each contender on its own directory of each tier (DIR, or DIR0,DIR1 for two
tiers: ``nixl`` and a mode whose name contains ``1tier`` use DIR0 alone, every other mode all of them,
so ``adapter-1tier adapter`` compares one tier and two in the same rounds). Modes, read in an order shuffled
every round: ``nixl`` (HiCacheNixl, POSIX plugin, O_DIRECT, zero copy) and any other name: kvstream's
adapter as the tree under test has it, changed in the same process by what the name contains (so an
A/B shares every round): ``inplace`` reads single-holder pages straight into the 4 KiB-page pool
(the huge-page test answers yes), ``claim=window`` restores the claim rule before claims were capped
at half the tier's window (a claim of up to a whole window), ``deep`` holds each tier's window at its
ceiling (the memory budget; a queue nearer nixl's whole batch), ``mem<SIZE>`` sets ``memory`` (e.g.
``adapter-mem256M-deep``), ``noreg`` sets ``register_memory=off`` (the pool is not registered with the
read ring, so reads into its 4 KiB pages are staged: the rule before 2026-12-05), ``fastdeep`` gives the fastest tier of a two-tier call its ceiling and 8 MiB
requests (``fastest_deep``), ``slowcap`` keeps every tier but the fastest of a two-tier call to one
block in flight (``slow_capped``: what the second tier's share costs; since stop 45 the read path does so
itself in the calls where that reads faster, ``flow.SlowerTiers``), ``open`` and ``held`` have every routed
call take that rule of ``flow.SlowerTiers`` (``open``: the rule before stop 45; docs/data/shared-cpu-46 has
``alone``, a third rule of 5af2ddb, not taken), ``countall`` counts every routed call's rate, also one after
a call of the other rule (the rule before stop 46), ``fastinplace`` reads the fastest
tier's first claims of a two-tier call in place (``fastest_in_place``: what staging replicated pages costs), ``vegas`` gives a call one tier alone serves that tier's flow window (the
rule before it queued deeper), ``single<N>M`` sets that depth to N MiB (at most the ceiling), staged
or in place (``singlewin<N>M``: the larger of N MiB and the flow window; main keeps 16 MiB for a staged
call and the ceiling in place, so ``single32M`` is the rule before 2026-12-03; ``indepth<N>M``: a call read in
place keeps at least N MiB, past the ceiling: tried in stop 47, not taken), ``nocoop`` opens the engine's rings without
COOP_TASKRUN (every completion interrupts the submitting thread: the rule before 2026-12-05), ``oldunit`` counts
windows in whole blocks even for pages smaller than a block (the rule before 2026-12-03's second
change: a 2 MiB window of 256 KiB pages held 2 of them); any other name only labels the row (docs/benchmarks.md's ``oldreq`` rows came
from a copy of the tree, first on PYTHONPATH). Prints per mode MB/s and process CPU s/GB (medians and range over the rounds), the
per-round ratio to the first mode (and to the first ``1tier`` mode, when there is one and it is not the
first), with two or more ``1tier`` modes the per-round ratio to the faster of them in that round, a kvstream
contender's bytes read over bytes served (blocks read twice: tail steals, retries), the machine's CPU s/GB and busy CPUs (/proc/stat: kernel workers included, e.g. a loop device's, which
copy every byte of a RAM tier), and the main thread's user/system time inside ``Engine.get``.
Environment: ``FRESH=1`` writes ROUNDS + 1 sets of pages and reads each once (pages never read before,
as a prefix written long ago; otherwise every round reads the same pages), ``STAGES=1`` adds thread CPU per read-path stage, ``CPROF=1`` dumps a cProfile, ``READY=path``
touches ``path`` before the timed rounds (for ``perf record -p``).

usage: python benchmarks/bench_hostpool.py DIR[,DIR1] PAGE_TOKENS BATCH_PAGES ROUNDS [MODE ...]
(run as root from the repository root, under the bench lock: docs/benchmarks.md "Reads into the host pool";
with a testbed's throttled tier, from a shell inside its blkio group: echo $$ > /sys/fs/cgroup/blkio/kvstream-NAME/cgroup.procs)
"""
import ctypes, functools, gc, os, re, sys, time, statistics, shutil, types
import numpy as np
from kvstream_hicache.tools.bench.geometry import from_model
from kvstream_hicache.tools.bench.contenders import SglangHost, AdapterReads, _Op
from kvstream_hicache.tools.bench.nixl import NixlReads
from kvstream_hicache.tools.bench.drift import round_order
from kvstream_hicache.flow import MAX_REQUEST, MIN_REQUESTS, RULE_NAMES
from kvstream_hicache import io as kio
RING = kio.Ring

dirs, ptok, npages, rounds = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
modes = sys.argv[5:] or ["nixl", "adapter"]
g = from_model("llama3-8b", ptok)
host = SglangHost(g, npages)
rng = np.random.default_rng(1)
for k, v in host.chunk_ptrs:
    for a, n in ((k, host.chunk_bytes[0]), (v, host.chunk_bytes[1])):
        src = rng.integers(0, 255, n, dtype=np.uint8)
        ctypes.memmove(a, src.ctypes.data, n)
STAGE = {}
if os.environ.get('STAGES'):
    from kvstream_hicache import inflight, delivery, reads, getcall
    def wrap(cls, name):
        f = getattr(cls, name)
        def w(*a, **k):
            t0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                STAGE[name] = STAGE.get(name, 0.0) + time.thread_time() - t0
        setattr(cls, name, w)
    for cls, name in ((inflight.InFlight, 'submit'), (inflight.InFlight, 'reap'), (delivery.Delivery, 'deliver_under_reads'),
                      (getcall.GetCall, 'plan'), (reads.ReadPath, '_file_under_reads'), (reads.ReadPath, '_end_call_under_reads'),
                      (reads.ReadPath, 'get')):
        wrap(cls, name)
# The variants change one engine's read path, found as it is built (a tool never reaches into an
# engine's parts through the engine: tests/test_facade.py).
from kvstream_hicache.reads import ReadPath
READ_PATHS = []
_read_path_init = ReadPath.__init__
def _recorded_init(self, *a, **k):
    _read_path_init(self, *a, **k)
    READ_PATHS.append(self)
ReadPath.__init__ = _recorded_init
def claims_up_to_the_window(self, call, unit):
    """ReadPath._set_depths_under_reads before claims were capped at half the window (for A/B)."""
    route, flows = call.route, self.io.flows
    share = route.n if call.single else route.n // (2 * len(flows))
    for k, flow in enumerate(flows):
        claim = max(route.m, min(self._request_bytes(k, call.single) // unit, share))
        route.set_depth(k, max(0, flow.window - self.io.orphaned[k]) // unit, claim)
def fastest_deep(self, call, unit):
    """A rule tried and not taken (issue 27, two tiers on a RAM tier): in a call more than one tier
    can serve, the fastest tier (by measured rate) keeps its window's ceiling in flight and sends
    requests up to MAX_REQUEST, as a call one tier alone serves does; the others keep their windows."""
    route, flows = call.route, self.io.flows
    if call.single:
        return ReadPath._set_depths_under_reads(self, call, unit)
    share = route.n // (2 * len(flows))
    fast = max(range(len(flows)), key=lambda k: flows[k].rate)
    for k, flow in enumerate(flows):
        window, req = flow.window, flow.request
        if k == fast and flow.rate:
            window, req = flow.ceiling, MAX_REQUEST
        depth = max(0, window - self.io.orphaned[k]) // unit
        claim = max(route.m, min(req // unit, share, depth // MIN_REQUESTS))
        route.set_depth(k, depth, claim)
def slow_capped(self, call, unit):
    """An experiment (issue 27, two tiers on a RAM tier): in a call more than one tier can serve, every
    tier but the fastest (by measured rate) keeps at most one claim of one block in flight: the slow
    tier is used as little as the router allows, to see what the second tier costs."""
    ReadPath._set_depths_under_reads(self, call, unit)
    flows = self.io.flows
    if not call.single and len(flows) > 1:
        fast = max(range(len(flows)), key=lambda k: flows[k].rate)
        for k in range(len(flows)):
            if k != fast:
                call.route.set_depth(k, 1, 1)
def fastest_in_place(rp):
    """A rule tried and not taken (issue 27, two tiers at 256 KiB on a RAM tier): in a call more than
    one tier can serve, the fastest tier (by measured rate) reads the blocks it claims first (not
    steals) straight into caller memory where the memory takes it, as a single holder's are, and no
    tier re-reads what that tier has in flight: what staging every replicated page costs, measured.
    Not a usable rule: the call then waits for those reads however long a stalled fastest tier takes
    (guarantees.md: a stalled tier never holds a call)."""
    flows, requests, may_steal = rp.io.flows, rp._requests_under_reads, rp._may_steal_under_reads
    now = {"call": None, "fast": 0}  # the call being read (one at a time) and its fastest tier, fixed
    def requests_in_place(call, claims):  # at its first requests
        if now["call"] is not call:
            now.update(call=call, fast=max(range(len(flows)), key=lambda k: flows[k].rate))
        stolen = {item for tier, items, steal in claims if steal for item in items}
        reqs, failed = requests(call, claims)
        for req in reqs:
            page = call.pages[req.p]
            if req.bufs and req.tier == now["fast"] and page.in_place and not stolen.intersection(req.items):
                for b in req.bufs:
                    rp.pool.put(b)
                req.bufs = None
        return reqs, failed
    rp._requests_under_reads = requests_in_place
    rp._may_steal_under_reads = lambda tier, owner: owner != now["fast"] and may_steal(tier, owner)
# GetCall.queue_bytes (how much a call keeps in flight per tier) and item_bytes as each mode has them: a call belongs to no
# engine, so the mode read now picks it (NOW, set before each read)
from kvstream_hicache.getcall import GetCall
NOW, QUEUE_BYTES = [None], {}
_queue_bytes = GetCall.queue_bytes
GetCall.queue_bytes = lambda call, flow: QUEUE_BYTES.get(NOW[0], _queue_bytes)(call, flow)
ITEM_BYTES, _item_bytes = {}, GetCall.item_bytes  # (the same for GetCall.item_bytes)
GetCall.item_bytes = lambda call: ITEM_BYTES.get(NOW[0], _item_bytes)(call)
def in_place_deeper(call, flow, depth):
    """A call one tier alone serves read in place keeps at least ``depth`` bytes in flight, past the
    tier's ceiling (its share of the staging budget, which reads in place do not spend): tried in stop
    47 as IN_PLACE_DEPTH = 128 MiB, not taken (docs/data/inplace-47)."""
    if call.single and call.in_place:
        return max(flow.ceiling, depth)
    return _queue_bytes(call, flow)
def capped_single(call, flow, cap, grow):
    """A call one tier alone serves keeps ``cap`` bytes in flight on it, staged or in place (with
    ``grow``, its flow window where that is larger), never more than the ceiling."""
    if not call.single:
        return flow.window
    return min(flow.ceiling, max(cap, flow.window) if grow else cap)
def vegas_window(call, flow):
    """ReadPath._queue_bytes before a single holder queued deeper: every call keeps each tier's flow
    window (for A/B)."""
    return flow.window
# FRESH=1: every round reads pages never read before (written up front, like a prefix written long
# ago); otherwise every round reads the same pages again
sets = rounds + 1 if os.environ.get("FRESH") else 1
key_sets = [[f"hostpool-{ptok}-{r}-{i}" for i in range(npages)] for r in range(sets)]
keys = key_sets[0]
cons = {}
rps = {}
ENG = {m: [0.0, 0.0] for m in modes}
THR = {m: 0.0 for m in modes}
for m in modes:
    subs = [os.path.join(d, f"hostpool-{m}") for d in (dirs[:1] if m == "nixl" or "1tier" in m else dirs)]
    for sub in subs:
        shutil.rmtree(sub, ignore_errors=True); os.makedirs(sub)
    sub = subs[0]
    if m == "nixl":
        c = NixlReads("hicache-nixl", host, [sub], "llama3-8b", tiers=[0], n_tiers=1)
        ok = all([host.controller_cls._page_set_zero_copy(c.ctl, ks, host.host_indices) for ks in key_sets])
    else:
        mem = re.search(r"mem(\d+[KMG]?)", m)
        extra = {"memory": mem.group(1)} if mem else {}
        if "noreg" in m:  # the host pool not registered with the read ring: staged (the rule before 2026-12-05)
            extra["register_memory"] = False
        if "nocoop" in m:  # its rings without COOP_TASKRUN: each completion interrupts the submitting
            kio.Ring = functools.partial(kio.Ring, cooperative=False)  # thread (the rule before 2026-12-05)
        try:
            c = AdapterReads(host, subs, "llama3-8b", extra, name=m)
        finally:
            kio.Ring = RING
        rp = rps[m] = READ_PATHS[-1]  # the read path of the engine this adapter just opened
        assert not ("nocoop" in m and getattr(rp.io.ring, "cooperative", False)), m  # (the patch took)
        ok = all([host.controller_cls._page_set_zero_copy(c.ctl, ks, host.host_indices) for ks in key_sets])
        if "inplace" in m:
            rp.memory.takes = lambda segments: True
        for rule, name in enumerate(RULE_NAMES):  # every routed call takes this rule (flow.SlowerTiers; open:
            if name in m:  # the rule before stop 45)
                rp.slower.rule = lambda nbytes, _rule=rule: _rule
        if "countall" in m:  # every routed call's rate counts, even after a call of the other rule (before stop 46)
            def count_all(*a, _done=rp.slower.done, _slower=rp.slower):
                _slower._last = None
                _done(*a)
            rp.slower.done = count_all
        if "deep" in m:  # the tier's window held at its ceiling (the memory budget) all run long
            for flow in rp.io.flows:
                def completed(*a, _flow=flow, _completed=flow.completed, **k):
                    _completed(*a, **k)
                    _flow.window = _flow.ceiling
                flow.completed, flow.window = completed, flow.ceiling
        if "fastinplace" in m:
            fastest_in_place(rp)
        if "slowcap" in m:
            rp._set_depths_under_reads = types.MethodType(slow_capped, rp)
        if "fastdeep" in m:
            rp._set_depths_under_reads = types.MethodType(fastest_deep, rp)
        cap = re.search(r"single(win)?(\d+)M", m)
        if cap:  # a call one tier alone serves keeps this much in flight
            QUEUE_BYTES[m] = functools.partial(capped_single, cap=int(cap.group(2)) << 20, grow=bool(cap.group(1)))
        if "oldunit" in m:  # windows counted in whole blocks, even for pages smaller than one
            ITEM_BYTES[m] = lambda call: max(page.info.block for page in call.pages)
        if "vegas" in m:
            QUEUE_BYTES[m] = vegas_window
        deeper = re.search(r"indepth(\d+)M", m)
        if deeper:  # a call read in place keeps this much in flight, past the ceiling
            QUEUE_BYTES[m] = functools.partial(in_place_deeper, depth=int(deeper.group(1)) << 20)
        if "claim=window" in m:
            rp._set_depths_under_reads = types.MethodType(claims_up_to_the_window, rp)
    assert ok, m
    cons[m] = c
    if m != "nixl":
        eng = c.engine; orig = eng.get
        def timed(*a, _orig=orig, _m=m, **k):
            import resource
            r0 = resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return _orig(*a, **k)
            finally:
                r1 = resource.getrusage(resource.RUSAGE_THREAD)
                ENG[_m][0] += r1.ru_utime - r0.ru_utime; ENG[_m][1] += r1.ru_stime - r0.ru_stime
        eng.get = timed
os.sync()
for c in cons.values():  # warm-up
    host.controller_cls._page_get_zero_copy(c.ctl, _Op(), keys, host.host_indices)
gc.freeze()
STAGE.clear()
for m in modes: ENG[m] = [0.0, 0.0]
if os.environ.get('READY'):
    open(os.environ['READY'], 'w').close(); time.sleep(1.5)
res = {m: [] for m in modes}
MACH = {m: [] for m in modes}  # per round, machine-wide busy CPU seconds during the call
import cProfile
prof = cProfile.Profile() if os.environ.get('CPROF') else None
prof and prof.enable()
nbytes = npages * g.page_bytes
HZ = os.sysconf("SC_CLK_TCK")
def machine_busy():
    """Seconds of CPU every CPU of the machine spent busy (all processes and kernel threads: a loop
    device's worker, io_uring's io-wq), from /proc/stat's first line (everything but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / HZ  # user nice system idle iowait irq softirq steal
def tier_bytes(m):
    """The engine's bytes read and served so far, over its tiers (None: not a kvstream contender)."""
    e = getattr(cons[m], "engine", None)
    return None if e is None else [sum(t[k] for t in e.stats()["tiers"]) for k in ("bytes_read", "bytes_served")]
RS0 = {m: tier_bytes(m) for m in modes}
for r in range(rounds):
    for m in round_order(modes, r):  # shuffled, as kvstream bench does
        c, NOW[0] = cons[m], m
        t0, c0, h0, b0 = time.perf_counter(), time.process_time(), time.thread_time(), machine_busy()
        n = host.controller_cls._page_get_zero_copy(c.ctl, _Op(), key_sets[(r + 1) % sets], host.host_indices)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        MACH[m].append(machine_busy() - b0)
        THR[m] += time.thread_time() - h0
        assert n == npages, (m, n)
        last = getattr(getattr(c, "engine", None), "last_batch", None) or {}
        res[m].append((nbytes / dt / 1e6, dc / (nbytes / 1e9), last.get("direct_bytes"), last.get("requests")))
prof and (prof.disable(), prof.dump_stats(os.environ['CPROF']))
def per_round(m, ref):
    ratio = [a[0] / b[0] for a, b in zip(res[m], res[ref])]
    return f"x{ref} med {statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}]"
one = next((m for m in modes[1:] if "1tier" in m), None)
for m in modes:
    mbs = [x[0] for x in res[m]]; cpu = [x[1] for x in res[m]]
    print(f"{m:10s} page {g.page_bytes>>10} KiB: MB/s med {statistics.median(mbs):6.0f} [{min(mbs):.0f}-{max(mbs):.0f}]"
          f"  CPU s/GB med {statistics.median(cpu):.3f} [{min(cpu):.3f}-{max(cpu):.3f}]  {per_round(m, modes[0])}"
          + (f"  {per_round(m, one)}" if one else "") + f"  direct {res[m][-1][2]} reqs {res[m][-1][3]}"
          + (f"  read/served {(rs[0] - RS0[m][0]) / (rs[1] - RS0[m][1]):.3f}" if (rs := tier_bytes(m)) else ""))
ones = [m for m in modes if "1tier" in m]
for m in modes if len(ones) > 1 else ():  # each mode against the best one-tier mode of the same round
    ratio = [res[m][r][0] / max(res[o][r][0] for o in ones) for r in range(rounds)]
    q = statistics.quantiles(ratio, n=4) if rounds > 1 else ratio * 3
    print(f"{m:10s} x best 1tier of the round med {statistics.median(ratio):.2f} "
          f"[{min(ratio):.2f}-{max(ratio):.2f}], quartiles {q[0]:.2f}-{q[2]:.2f}")
for m in modes:  # the machine's CPU, kernel workers included: the bound where every CPU is busy
    wall = sum(nbytes / (x[0] * 1e6) for x in res[m])  # (/proc/stat counts in ticks: totals, not per round)
    print(f"{m:10s} machine CPU s/GB {sum(MACH[m]) / (rounds * nbytes / 1e9):.3f}"
          f"  busy CPUs {sum(MACH[m]) / wall:.2f} of {os.cpu_count()}")
GB = rounds * nbytes / 1e9
if STAGE:
    print("stages (thread CPU s/GB, one engine mode):", {k: round(v / GB, 3) for k, v in STAGE.items()})
for m in modes:
    print(f"{m:10s} per GB: main thread {THR[m]/GB:.3f}  engine.get user {ENG[m][0]/GB:.3f} sys {ENG[m][1]/GB:.3f}")
for m, c in cons.items():
    if m != "nixl":
        print(f"{m:10s} flow at the end: {rps[m].io.flows}; calls' MB/s open, held, per size class: "
              f"{ {c: [round(r / 1e6) for r in rates] for c, rates in rps[m].slower.rates.items()} }")
for c in cons.values():
    c.close()
