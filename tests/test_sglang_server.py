"""A real ``python -m sglang.launch_server`` serving a tiny model on the CPU with kvstream as L3.

The servers are the ones ``kvstream serve-cpu`` starts (kvstream_hicache/tools/serve_cpu.py): the tiny
random-weight Llama, ``--device cpu --attention-backend torch_native``, HiCache with page size 64 and
``--hicache-storage-backend kvstream``, the CPU shims on the server's PYTHONPATH. Requests go to the
native ``/generate`` as token ids, greedy, so two servers must answer one prompt with the same tokens.
The comparison can fail: this model's greedy tokens depend on the prefix's KV (with the first six pages'
KV taken from another prompt, as a wrong page served from L3 would be, the tokens differed for each of 7
prompts tried with transformers), so an L3 hit that answers with the reference's tokens got the right bytes.

Servers are shared, started once per module and in two waves whose start-ups overlap (start-up is most
of the time here), and each is killed (its whole process group) when the module's fixture ends, also
when a test fails. Every wait is bounded. Prompts are a few 64-token pages: enough
to prove a hit, cheap to prefill on two cores. Each test uses its own prompt (a seed), so earlier tests'
pages and damage never decide a later test's outcome.

  reference   no HiCache: the outputs every other server must reproduce
  kv          kvstream on [t0, t1], page_first; restarted on the same tiers by the restart test
  peer        kvstream on [t0b, t1]: a second server sharing tier 1 with ``kv``
  layer_first kvstream on fresh tiers, --hicache-mem-layout layer_first
  gfs         kvstream on [a local directory, a GlusterFS volume] (the ``glusterfs`` fixture), its own test

On a GPU the same tests run against a GPU server (docs/sglang.md, "the GPU check"):
``KVSTREAM_SERVE_DEVICE=cuda KVSTREAM_SERVE_MODEL=/models/small pytest tests/test_sglang_server.py``.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import time

import pytest

from kvstream_hicache._uring import Ring
from kvstream_hicache.tools import serve_cpu
from helpers import flip_byte, page_files, tmp_files, wait_until
from sglang_servers import KV, PAGE, PAGES, Server, prompt, server_dirs, sv

pytestmark = pytest.mark.timeout(900)  # the first test also waits for the first wave

MODEL = os.environ.get("KVSTREAM_SERVE_MODEL")  # default: the tiny model serve-cpu builds


def outputs(out: dict) -> tuple:
    return out["ids"], out["text"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root, scratch, tiers = server_dirs(tmp_path_factory, "serve-test", ("t0", "t1", "t0b", "lf0", "lf1", "one"))
    started: list[Server] = []
    previous = signal.signal(signal.SIGTERM, _terminated)  # teardown below runs on SIGTERM too

    def server(name, tier_names=None, layout="page_first") -> Server:
        srv = Server(name, root, MODEL or serve_cpu.build_model(),
                     [tiers[t] for t in tier_names] if tier_names else None, layout)
        started.append(srv)
        return srv.launch()

    try:
        yield {"server": server, "tiers": tiers}
    finally:
        for srv in started:
            srv.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


@pytest.fixture(scope="module")
def servers(env):
    """The first wave: the reference, the kvstream server and the layer_first one, started together."""
    wave = {"reference": env["server"]("reference"), "kv": env["server"]("kv", ["t0", "t1"]),
            "layer_first": env["server"]("layer_first", ["lf0", "lf1"], layout="layer_first")}
    return {name: srv.wait() for name, srv in wave.items()}


@pytest.fixture(scope="module")
def peer(env):
    """A second kvstream server sharing tier 1 with ``kv``: launched (not waited for) by its first user."""
    return env["server"]("peer", ["t0b", "t1"])


@pytest.fixture(scope="module")
def expected(servers):
    """The reference server's answer to a prompt (memoised): what every kvstream server must say."""
    memo: dict[int, tuple] = {}

    def get(seed: int) -> tuple:
        if seed not in memo:
            memo[seed] = outputs(servers["reference"].generate(prompt(seed)))
        return memo[seed]

    return get


def test_l3_hit_after_flush_gives_the_same_tokens(servers, expected):
    kv, ids = servers["kv"], prompt(1)
    cold = kv.store(ids)
    assert outputs(cold) == expected(1)
    warm, moved = kv.from_l3(ids)
    assert kv.storage_tokens(warm) == PAGES * PAGE, warm["meta"]
    assert moved["storage_hit_tokens"] >= PAGES * PAGE, moved  # sglang's own counter
    assert moved["pages"]["found"] >= PAGES, moved  # kvstream's
    assert sum(t["served_bytes"] for t in moved["tiers"].values()) > 0, moved
    assert outputs(warm) == expected(1)


def test_layer_first_host_layout(servers, expected):
    srv, ids = servers["layer_first"], prompt(7)
    # (its pieces, 64 tokens x 2 heads x 64 x 2 B, are 4096-aligned: written from the pool, not staged)
    line = next(ln for ln in srv.log().splitlines() if "kvstream: 2 tiers [" in ln)
    assert "layout layer_first" in line and "; zero-copy (" in line, line
    assert outputs(srv.store(ids)) == expected(7)
    warm, moved = srv.from_l3(ids)
    assert srv.storage_tokens(warm) == PAGES * PAGE, warm["meta"]
    assert moved["pages"]["found"] >= PAGES, moved
    assert outputs(warm) == expected(7)
    srv.stop()  # done with it: its cores go to the servers the later tests start


def test_one_tier_reads_land_in_the_registered_host_pool(env, servers, expected):
    """One tier: every page has one holder, so a prefetch reads straight into sglang's own host pool (4
    KiB pages, registered with the read ring at attach: READV_FIXED for page_first's K and V pieces),
    and the tokens are the reference's."""
    with Ring() as ring:
        vectored = ring.readv_fixed  # (Linux 6.15)
    srv, ids = env["server"]("one", ["one"]).wait(), prompt(8)
    try:
        line = next(ln for ln in srv.log().splitlines() if "kvstream: 1 tier [" in ln)
        assert ("reads of single-tier pages in place" in line) == vectored, line
        assert outputs(srv.store(ids)) == expected(8)
        warm, moved = srv.from_l3(ids)
        assert srv.storage_tokens(warm) == PAGES * PAGE, warm["meta"]
        assert moved["pages"]["found"] >= PAGES, moved
        tier = moved["tiers"]["0"]  # (kvstream:tier_read_in_place_bytes_total: every byte, or none, in place)
        assert tier["served_bytes"] > 0 and tier["in_place_bytes"] == (tier["served_bytes"] if vectored else 0), moved
        assert outputs(warm) == expected(8)
        assert "failed its check" not in srv.log() and not srv.errors_since(0)
    finally:
        srv.stop()  # (its cores go to the servers the later tests start)


def test_log_and_metrics_show_kvstream(servers):
    kv = servers["kv"]
    # a request of its own (alone, `-k`, the write counter stayed 0: only the tests before it had written); the
    # counters are exported at most once a second
    kv.store(prompt(9))
    wait_until(lambda: sum(v for (name, _l), v in kv.metrics().items() if name == KV + "tier_write_bytes_total") > 0,
               30, "kvstream:tier_write_bytes_total never counted the store")
    log = kv.log()
    assert "[kvstream cpu-shims]" in log and "CPU shims installed" in log  # what the shims replace, said
    start = [ln for ln in log.splitlines() if "kvstream: 2 tiers [" in ln]
    assert start and all(d in start[0] for d in kv.tiers), start
    samples = kv.metrics()
    paths = {dict(lab).get("path") for (name, lab), _v in samples.items() if name == KV + "tier_info"}
    assert paths == set(kv.tiers)
    for family in ("tier_write_bytes_total", "tier_served_bytes_total", "tier_healthy"):
        tiers = {dict(lab)["tier"] for (name, lab), v in samples.items() if name == KV + family}
        assert tiers == {"0", "1"}, family
    assert sum(v for (name, _l), v in samples.items() if name == KV + "tier_write_bytes_total") > 0


def test_damaged_tier_is_served_from_the_other(servers, expected):
    kv, ids = servers["kv"], prompt(2)
    kv.store(ids)
    for path in page_files(kv.tiers[0]):
        flip_byte(path, os.path.getsize(path) // 2)
    mark = len(kv.log())
    warm, moved = kv.from_l3(ids)
    assert kv.storage_tokens(warm) == PAGES * PAGE, warm["meta"]
    # Completion routing decides which tier reads what: tier 1 may claim every page of a short prefix.
    # Either way no damaged byte reaches SGLang: tier 0 read and rejected some copies, or served nothing.
    assert moved["tiers"]["0"]["corrupted_pages"] >= 1 or moved["tiers"]["0"]["served_bytes"] == 0, moved
    assert moved["tiers"]["1"]["served_bytes"] > 0, moved
    assert outputs(warm) == expected(2)
    assert kv.errors_since(mark) == []


def test_every_copy_damaged_is_a_miss_and_recomputed(servers, expected):
    kv, ids = servers["kv"], prompt(3)
    kv.store(ids)
    for tier in kv.tiers:
        for path in page_files(tier):
            flip_byte(path, os.path.getsize(path) // 2)
    mark = len(kv.log())
    warm, moved = kv.from_l3(ids)
    assert kv.storage_tokens(warm) == 0, warm["meta"]
    assert outputs(warm) == expected(3)
    assert kv.errors_since(mark) == []


def test_restarted_server_serves_its_first_request_from_l3(servers, expected, peer):
    kv, ids = servers["kv"], prompt(4)
    kv.store(ids)
    kv.stop()
    kv.launch().wait()  # same tiers, same model: a new process, its L1/L2 empty (the peer starts meanwhile)
    first = kv.generate(ids)
    assert kv.storage_tokens(first) == PAGES * PAGE, first["meta"]
    assert outputs(first) == expected(4)


def test_second_server_serves_the_first_servers_prefix_from_shared_tier(servers, expected, peer):
    kv, ids = servers["kv"], prompt(5)
    peer.wait()  # serving before kv stores the prompt: it finds pages another server wrote after its start
    kv.store(ids)
    first = peer.generate(ids)
    assert peer.storage_tokens(first) == PAGES * PAGE, first["meta"]
    assert outputs(first) == expected(5)
    peer.stop()


def test_tier_directory_removed_while_serving(servers, expected):
    kv = servers["kv"]
    old, new = prompt(4), prompt(6)  # old: stored by the restart test on both tiers
    mark = len(kv.log())
    shutil.rmtree(kv.tiers[0])
    for seed, ids in ((6, new), (4, old)):
        out = kv.generate(ids)
        assert outputs(out) == expected(seed)
    warm, _moved = kv.from_l3(old)  # tier 1 still holds the old prompt's pages
    assert kv.storage_tokens(warm) == PAGES * PAGE, warm["meta"]
    assert outputs(warm) == expected(4)
    assert kv.proc.alive()
    assert kv.errors_since(mark) == []


def _kvstream_trouble(text: str) -> list[str]:
    """Lines of a server's log that show kvstream (or a read or write it serves) in trouble: a traceback,
    an error, an exception, a backup sglang says failed, or a kvstream warning. (sglang's own lines about
    its children on SIGTERM, and the server_args line, which names options like gc_warning, are not.)"""
    bad = ("Traceback", " ERROR ", "Exception", "EngineClosedError", "to storage failed")
    return [ln for ln in text.splitlines()
            if "server_args=" not in ln and "It usually means one child failed" not in ln
            and (any(b in ln for b in bad) or ("kvstream" in ln.lower() and "warn" in ln.lower()))]


def _read_calls(samples: dict) -> dict:
    return {dict(lab)["rule"]: v for (name, lab), v in samples.items() if name == KV + "read_calls_total"}


def test_reads_from_a_fuse_tier_choose_a_rule_that_metrics_count_across_a_sigterm_restart(glusterfs, tmp_path_factory):
    """Tier 1 a GlusterFS volume (a FUSE client: it shares the reader's CPUs, what flow.SlowerTiers is for).
    Prompts that share a prefix are served, read back from L3, and the server is stopped with SIGTERM
    (the whole group), started again and stopped with SIGTERM to the launcher alone; its second life
    serves the same prompts from L3. Every answer is the first one; /metrics counts each prefetch's
    read call under one rule, open or held (each rule is taken: the calls of one size try both), and
    they add up to the read batches, none a second chance; both tiers served; no kvstream trouble in the
    log, shutdowns included (the SGLang engine is left to its threads at exit); no process and no
    temporary file is left, and each tier holds every page."""
    logs, scratch, local = server_dirs(tmp_path_factory, "serve-gfs", ("t0",))
    shared = os.path.join(glusterfs.mount("a"), f"serve-gfs-{os.getpid()}")
    os.makedirs(shared)
    tiers = [local["t0"], shared]
    srv = Server("gfs", logs, MODEL or serve_cpu.build_model(), tiers)
    rng = random.Random(45)
    base = prompt(45)[:4 * PAGE]  # 4 shared pages, 2 of each prompt's own and a partial one
    prompts = [base + [rng.randrange(3, serve_cpu.VOCAB) for _ in range(2 * PAGE + 17)] for _ in range(3)]
    try:
        srv.start()
        first = [outputs(srv.generate(ids)) for ids in prompts]
        deadline = time.monotonic() + 60
        while sv.storage_metrics({}, srv.metrics())["backuped_tokens"] < (4 + 3 * 2) * PAGE:
            assert time.monotonic() < deadline, "L3 backup not done in 60 s"
            time.sleep(0.5)
        assert [outputs(srv.from_l3(ids)[0]) for ids in prompts] == first
        assert sum(_read_calls(srv.metrics()).values()) == 3
        left, log = srv.terminate(group=True), srv.log()
        assert left == [] and _kvstream_trouble(log) == [], (left, _kvstream_trouble(log))
        assert all(tmp_files(t) == [] for t in tiers)
        assert len(page_files(tiers[0])) == len(page_files(tiers[1])) == 4 + 3 * 2

        srv.launch().wait()  # a new process: L1 and L2 empty, the pages on both tiers
        again = srv.generate(prompts[0])
        assert srv.storage_tokens(again) == 6 * PAGE, again["meta"]
        answers = [outputs(again)] + [outputs(srv.from_l3(ids)[0]) for _ in range(3) for ids in prompts]
        assert answers == [first[0]] + first * 3
        time.sleep(3)  # kvstream's export interval and its owed export
        samples = srv.metrics()
        moved = sv.storage_metrics({}, samples)
        calls, batches = _read_calls(samples), moved["retrieval"]["batches"]
        assert all(calls.get(rule, 0) >= 1 for rule in ("open", "held")), calls
        assert sum(calls.values()) == batches == 10, (calls, batches)
        assert moved["tiers"]["0"]["served_bytes"] > 0 and moved["tiers"]["1"]["served_bytes"] > 0, moved
        mark = len(log)
        left, log = srv.terminate(group=False), srv.log()
        assert left == [] and _kvstream_trouble(log[mark:]) == [], (left, _kvstream_trouble(log[mark:]))
        assert all(tmp_files(t) == [] for t in tiers)
    finally:
        srv.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)
