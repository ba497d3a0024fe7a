"""examples/serve_swebench.py's client: TTFT against a local server that streams with known delays.

The server here stands in for SGLang only to test the client's clock and parsing: it speaks the
native /generate streaming format (``data: {...}\\n\\n`` events, then ``data: [DONE]``), holds each
request's first chunk for a delay chosen by the prompt length, and the rest of the stream until what
the test waits for has happened. Timing is checked against the server's own timestamps and by
ordering, never by how long anything took on this (shared, loaded) machine. It listens on 127.0.0.1
only and lives for one test.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import threading

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvstream_hicache.tools import workload as wl  # noqa: E402

from helpers import load_serve_swebench  # noqa: E402

REST_S = 0.05  # the rest of a stream comes at least this long after the first chunk (see FakeSGLang.hold)
FIRST_S = {600: 0.30, 1100: 0.10, 1600: 0.20}  # input_length -> delay of the first chunk, seconds
GATE_S = 30.0  # longest a held stream waits for what it waits for (then the test fails, never hangs)


sv = load_serve_swebench()

METRICS_BEFORE = """# HELP sglang:storage_prefetch_hit_tokens_total x
# TYPE sglang:storage_prefetch_hit_tokens_total counter
sglang:storage_prefetch_hit_tokens_total{model_name="m"} 100.0
sglang:cached_tokens_total{cache_source="storage",model_name="m"} 10.0
kvstream:tier_served_bytes_total{tier="0",tp_rank="0",dp_rank="0",pp_rank="0"} 1000.0
kvstream:tier_served_bytes_total{tier="1",tp_rank="0",dp_rank="0",pp_rank="0"} 0.0
"""
METRICS_AFTER = """sglang:storage_prefetch_hit_tokens_total{model_name="m"} 1100.0
sglang:cached_tokens_total{cache_source="storage",model_name="m"} 510.0
sglang:prefetched_tokens_total{model_name="m"} 900.0
kvstream:tier_info{tier="0",path="/a",tp_rank="0",dp_rank="0",pp_rank="0"} 1.0
kvstream:tier_served_bytes_total{tier="0",tp_rank="0",dp_rank="0",pp_rank="0"} 4000.0
kvstream:tier_served_bytes_total{tier="1",tp_rank="0",dp_rank="0",pp_rank="0"} 1000.0
kvstream:tier_read_bytes_total{tier="1",tp_rank="0",dp_rank="0",pp_rank="0"} 1100.0
kvstream:tier_write_bytes_total{tier="1",tp_rank="0",dp_rank="0",pp_rank="0"} 5e3
kvstream:retrieval_seconds_sum{tp_rank="0",dp_rank="0",pp_rank="0"} 1.1
kvstream:retrieval_seconds_count{tp_rank="0",dp_rank="0",pp_rank="0"} 4.0
kvstream:retrieval_bound_seconds_total{tp_rank="0",dp_rank="0",pp_rank="0"} 1.0
kvstream:pages_total{result="found",tp_rank="0",dp_rank="0",pp_rank="0"} 40.0
"""


class FakeSGLang:
    """A minimal /generate + /health + /metrics server in its own thread and event loop.

    Timing is asserted from this server's own clock (``loop.time()``, the monotonic clock) and from
    ordering, never from the wall-clock length of a run: per request it records when it arrived, when
    the first and the last chunk went out, and whether what the rest of the stream waits for
    (``hold``: a condition polled between the first chunk and the rest) came true.
    """

    def __init__(self):
        self.arrivals: list[tuple[float, int]] = []  # (loop time, input length)
        self.requests: list[dict] = []  # per request: n, arrived, first_sent, last_sent, held
        self.hold = None  # called with the request's record; the rest of its stream waits until True
        self.scrapes = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def generate(self, request):
        body = await request.json()
        n = len(body["input_ids"])
        rec = {"n": n, "arrived": self.loop.time()}
        self.arrivals.append((rec["arrived"], n))
        self.requests.append(rec)
        assert body["stream"] is True and body["sampling_params"]["ignore_eos"] is True
        if n == 999:
            return web.Response(status=400, text="prompt too long")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(FIRST_S.get(n, 0.05))
        await resp.write(b'data: {"text": "a", "meta_info": {"completion_tokens": 1}}\n\n')
        rec["first_sent"] = self.loop.time()
        await asyncio.sleep(REST_S)
        if self.hold is not None:
            deadline = self.loop.time() + GATE_S
            while not (held := self.hold(rec)) and self.loop.time() < deadline:
                await asyncio.sleep(0.005)  # polling the condition, not timing anything
            rec["held"] = held
        last = {"text": "ab", "output_ids": [1, 2],
                "meta_info": {"completion_tokens": body["sampling_params"]["max_new_tokens"],
                              "cached_tokens": n // 2,
                              "cached_tokens_details": {"device": n // 4, "host": 0, "storage": n // 4,
                                                        "storage_backend": "KVStreamHiCacheStorage"}}}
        # split one event across two network writes: the client must reassemble it
        raw = b"data: " + json.dumps(last).encode() + b"\n\n"
        rec["last_sent"] = self.loop.time()
        await resp.write(raw[:10])
        await resp.write(raw[10:] + b"data: [DONE]\n\n")
        return resp

    async def health(self, request):
        return web.Response(text="ok")

    async def metrics(self, request):
        self.scrapes += 1
        return web.Response(text=METRICS_BEFORE if self.scrapes == 1 else METRICS_AFTER)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive(), "the fake server's loop did not stop"
        self.loop.close()


def _req(ts_ms, input_length, output_length=5, session=0, turn=0):
    ids = tuple(range(input_length // 512 * 7, input_length // 512 * 7 + math.ceil(input_length / 512)))
    return wl.Request(ts_ms, input_length, output_length, ids, session, turn)


@pytest.fixture
def server():
    with FakeSGLang() as s:
        yield s


def test_ttft_is_the_first_chunk_and_sends_are_open_loop(server, monkeypatch):
    reqs = [_req(0, 600), _req(50, 1100, turn=1), _req(100, 1600, turn=2)]
    results = {}  # input length -> the client's Result, registered as each send starts
    send = sv._send

    async def tracked_send(session, url, body, res, clock, timeout):
        results[res.input_length] = res
        await send(session, url, body, res, clock, timeout)

    def hold(rec) -> bool:
        """The rest of a stream waits until the client has taken its TTFT (so it was taken at the first
        chunk), and the first request's until every request arrived (so the sends did not wait for it)."""
        res = results.get(rec["n"])
        took_ttft = res is not None and not math.isnan(res.ttft)
        return took_ttft and (rec["n"] != 600 or len(server.arrivals) == len(reqs))

    monkeypatch.setattr(sv, "_send", tracked_send)
    server.hold = hold
    out = asyncio.run(sv.run_requests(server.url, reqs, vocab=1000, progress=None, start_delay=0.05))
    assert all(rec["held"] for rec in server.requests), server.requests  # no wait ran into GATE_S
    for r, req in zip(out, reqs):
        assert r.error is None, r.error
        (rec,) = [x for x in server.requests if x["n"] == req.input_length]
        # the client's intervals contain the server's (each starts before and ends after it)
        assert r.ttft >= rec["first_sent"] - rec["arrived"]
        assert r.e2e >= rec["last_sent"] - rec["arrived"] and r.e2e > r.ttft
        assert r.output_tokens == req.output_length
        assert r.cached_tokens == req.input_length // 2
        assert r.cached_details == {"device": req.input_length // 4, "host": 0, "storage": req.input_length // 4}
    # open loop, on the schedule: each sent no earlier than scheduled, in schedule order
    assert all(r.sent >= r.scheduled for r in out)
    assert [r.sent for r in out] == sorted(r.sent for r in out)


def test_failed_requests_are_reported_and_miss_every_slo(server):
    reqs = [_req(0, 600), _req(0, 999)]  # 999 tokens: the server answers 400
    reqs[1] = wl.Request(0, 999, 5, (1, 2), 1, 0)
    results = asyncio.run(sv.run_requests(server.url, reqs, vocab=1000, start_delay=0.01))
    assert results[0].error is None and results[1].error.startswith("HTTP 400")
    assert math.isnan(results[1].ttft)
    slo = sv.slo_attainment(results, [10.0])
    assert slo == {"10": 0.5}


def test_prometheus_parsing_and_storage_deltas():
    before, after = sv.parse_prometheus(METRICS_BEFORE), sv.parse_prometheus(METRICS_AFTER)
    labels = (("dp_rank", "0"), ("pp_rank", "0"), ("tier", "0"), ("tp_rank", "0"))
    assert before[("kvstream:tier_served_bytes_total", labels)] == 1000.0
    m = sv.storage_metrics(before, after)
    assert m["storage_hit_tokens"] == 1000.0 and m["prefetched_tokens"] == 900.0
    assert m["cached_tokens"]["storage"] == 500.0
    assert m["tiers"]["0"]["served_bytes"] == 3000.0 and m["tiers"]["0"]["read_share"] == 0.75
    assert m["tiers"]["0"]["path"] == "/a"
    assert m["tiers"]["1"]["read_share"] == 0.25 and m["tiers"]["1"]["write_bytes"] == 5000.0
    assert m["tiers"]["1"]["read_bytes"] == 1100.0
    assert m["retrieval"]["batches"] == 4 and m["retrieval"]["gap"] == pytest.approx(0.1)
    assert m["pages"] == {"found": 40.0, "missing": 0.0} and m["kvstream_exported"]
    assert sv.storage_metrics(None, None) is None


def test_cli_against_a_running_server_writes_json_and_plot(server, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "slo.png"
    rc = sv.main(["--url", server.url, "--sessions", "2", "--requests", "4", "--mean-input", "1200",
                  "--mean-output", "4", "--rate", "20", "--slo", "0.5,2", "--json", str(out_json),
                  "--plot", str(out_png), "--no-progress", "--metrics-settle", "0", "--label", "fake"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "fake: 4 requests, 0 errors" in text and "TTFT" in text and "tier 0  served" in text and "above the aggregate-bandwidth bound" in text
    report = json.loads(out_json.read_text())
    run = report["runs"]["fake"]
    assert run["requests"] == 4 and run["errors"] == 0
    # every TTFT contains the server's own first-chunk delay for it, so the median does the smallest
    assert run["ttft"]["p50"] >= min(rec["first_sent"] - rec["arrived"] for rec in server.requests)
    assert set(run["slo"]) == {"0.5", "2"}
    assert run["metrics"]["storage_hit_tokens"] == 1000.0
    assert len(run["per_request"]) == 4 and report["workload"]["summary"]["sessions"] == 2
    assert out_png.stat().st_size > 1000


def test_dry_run_prints_the_launch_lines(capsys):
    rc = sv.main(["--dry-run", "--tiers", "/nvme/kv:/pfs/kv", "--compare", "file,kvstream",
                  "--sessions", "3", "--requests", "9", "--mean-input", "2000"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "--hicache-storage-backend kvstream" in text and "--enable-hierarchical-cache" in text
    assert "--page-size 64" in text and "--enable-metrics" in text
    assert "KVSTREAM_TIERS=" in text and "/nvme/kv/serve_swebench-kvstream" in text
    assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=" in text
    assert "9  in 3 sessions" in text


def test_trace_replay_options(tmp_path):
    path = tmp_path / "t.jsonl"
    wl.write_mooncake([wl.Request(0, 600, 3, (0, 1)), wl.Request(1000, 1100, 3, (0, 1, 2)),
                       wl.Request(2000, 700, 3, (5, 6))], path)
    args = sv.parse_args(["--dry-run", "--trace", str(path), "--order", "round-robin",
                          "--rate-factor", "2", "--max-input", "1024"])
    reqs, source = sv.build_workload(args)
    assert [r.timestamp for r in reqs] == [0, 500, 1000]
    assert max(r.input_length for r in reqs) == 1024 and all(len(r.hash_ids) <= 2 for r in reqs)
    assert source["order"] == "round-robin" and source["rate_factor"] == 2


FAKE_SERVER = r'''
import asyncio, json, os, sys
from aiohttp import web

port = int(sys.argv[sys.argv.index("--port") + 1])
backend = sys.argv[sys.argv.index("--hicache-storage-backend") + 1]
dirs = (os.environ.get("KVSTREAM_TIERS") or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "")).split(":")
for d in dirs:  # show where this backend was told to store
    with open(os.path.join(d, "seen-by-fake-server"), "w") as f:
        f.write(backend)

async def generate(request):
    body = await request.json()
    resp = web.StreamResponse()
    await resp.prepare(request)
    await asyncio.sleep(0.2 if backend == "file" else 0.05)
    await resp.write(b'data: {"text": "a", "meta_info": {"completion_tokens": 1}}\n\n')
    meta = {"completion_tokens": body["sampling_params"]["max_new_tokens"], "cached_tokens": 0}
    await resp.write(b"data: " + json.dumps({"meta_info": meta}).encode() + b"\n\ndata: [DONE]\n\n")
    return resp

async def health(request):
    return web.Response(text="ok")

app = web.Application()
app.router.add_post("/generate", generate)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=port, print=None)
'''


def test_compare_starts_stops_each_server_and_reports_speedups(tmp_path, monkeypatch, capsys):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    tiers = [tmp_path / "t0", tmp_path / "t1"]
    for t in tiers:
        t.mkdir()
    seen = []
    original = sv.launch_command

    def fake_command(args, backend, port):
        cmd = original(args, backend, port)
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        return [sys.executable, str(script)] + cmd[3:]

    def spy_exit(self, *exc):  # before the server stops and its directories go: what did it get?
        seen.append((self.backend, sorted(os.listdir(d) for d in self.run_dirs)))
        return real_exit(self, *exc)

    real_exit = sv.Server.__exit__
    monkeypatch.setattr(sv, "launch_command", fake_command)
    monkeypatch.setattr(sv.Server, "__exit__", spy_exit)
    monkeypatch.setattr(sv.serve_cpu, "HEALTH_POLL_S", 0.2)
    out_json = tmp_path / "cmp.json"
    rc = sv.main(["--model", "fake/model", "--tiers", f"{tiers[0]}:{tiers[1]}", "--compare", "file,kvstream",
                  "--port", str(sv.serve_cpu.free_port()), "--sessions", "2", "--requests", "4", "--mean-input", "1200",
                  "--mean-output", "4", "--rate", "20", "--no-progress", "--metrics-settle", "0",
                  "--startup-timeout", "60", "--json", str(out_json), "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    assert seen == [("file", [["seen-by-fake-server"]]),
                    ("kvstream", [["seen-by-fake-server"], ["seen-by-fake-server"]])]
    assert all(os.listdir(t) == [] for t in tiers)  # each run's directories were removed
    report = json.loads(out_json.read_text())
    assert set(report["runs"]) == {"file", "kvstream"}
    assert all(r["errors"] == 0 for r in report["runs"].values())
    assert set(report["speedup_kvstream_over_file"]) == {"mean", "p50", "p90"}
    assert "metrics none" in capsys.readouterr().out  # no /metrics on this server: said, not fatal
    assert sorted(os.listdir(tmp_path / "logs")) == ["sglang-file.log", "sglang-kvstream.log"]


def test_free_port_is_below_the_ephemeral_range_and_free():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        low = int(fh.read().split()[0])
    port = sv.serve_cpu.free_port()
    assert 0 < port < low  # a port bind(0) would hand out is taken by any process's next connection
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: nothing holds it


def test_a_server_that_cannot_bind_its_port_is_reported_at_once(tmp_path, monkeypatch):
    """uvicorn logs the bind failure and then waits: the start-up wait says so and stops the server
    instead of polling /health until its timeout (a CI run waited 600 s)."""
    monkeypatch.setattr(sv.serve_cpu, "HEALTH_POLL_S", 0.1)
    log = tmp_path / "server.log"
    log.write_text("an earlier launch: [Errno 98] address already in use\n")  # not this launch's
    code = ("import sys, time; print('started', flush=True); time.sleep(1.0); "
            "print(\"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): "
            "address already in use\", flush=True); time.sleep(120)")
    proc = sv.serve_cpu.ServerProcess([sys.executable, "-c", code], dict(os.environ), str(log),
                                      url="http://127.0.0.1:1")
    with pytest.raises(sv.serve_cpu.PortInUse, match="in use by another process"):
        proc.start(timeout=60)
    assert proc.proc is None  # stopped: its whole process group is gone
