#!/usr/bin/env python3
"""Serve a SWE-bench-agentic workload with SGLang HiCache on kvstream and measure time to first token.

Starts ``python -m sglang.launch_server`` with ``--enable-hierarchical-cache --page-size 64
--hicache-storage-backend kvstream --enable-metrics`` and the tier directories in ``KVSTREAM_TIERS``
(or attaches to a running server with ``--url``), then sends a generated coding-agent workload (or a
Mooncake-format trace) as token ids to SGLang's native ``/generate`` with ``stream: true``, open loop:
each request leaves at its arrival time whether or not earlier ones have answered. TTFT is the time
from sending a request to its first streamed chunk.

Examples (see examples/README.md)::

    # on a GPU node: two tiers, the paper's defaults (130 sessions, 4000 requests, 1.25 req/s)
    python examples/serve_swebench.py --model Qwen/Qwen2.5-7B-Instruct --tiers /mnt/nvme/kv:/lustre/kv
    # the same workload on sglang's file backend, then on kvstream, and the speedups
    python examples/serve_swebench.py --model M --tiers /mnt/nvme/kv:/lustre/kv --compare file,kvstream
    # a running server; a Mooncake trace; what would run, without a server
    python examples/serve_swebench.py --url http://127.0.0.1:30000 --trace conversation_trace.jsonl
    python examples/serve_swebench.py --dry-run --tiers /a:/b

Output: mean/p50/p90 TTFT, SLO attainment per deadline (``--slo``), storage hit tokens (from the
responses' ``cached_tokens_details`` and the server's /metrics), per-tier reads (kvstream's metrics),
``--json PATH`` and ``--plot PATH`` (an SLO attainment curve like the paper's Fig. 11).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

try:  # run from a checkout without installing the package
    from kvstream_hicache.tools import workload as wl
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from kvstream_hicache.tools import workload as wl
from kvstream_hicache.tools import serve_cpu
from kvstream_hicache.tools.console import HelpFormatter, Progress, missing_tiers

try:
    import orjson

    def _dumps(obj) -> bytes:
        return orjson.dumps(obj)

    _loads = orjson.loads
except ImportError:  # pragma: no cover - orjson ships with sglang
    def _dumps(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

BACKENDS = ("kvstream", "file", "nixl", "none")  # none: HiCache (L1 + L2) without an L3 backend
DEFAULT_SLOS = (0.5, 1.0, 2.0, 5.0, 10.0)  # seconds: the deadlines reported in the paper's Fig. 11
LOOKAHEAD_S = 2.0  # request bodies are built this far ahead of their send time...
MAX_PREBUILT = 256  # ...but never more than this many at once (a 19K-token body is ~120 KB)
RUN_DIR_PREFIX = "serve_swebench-"  # the only directories this script creates (and removes) in a tier


# ------------------------------------------------------------------------------------------- workload
def build_workload(args) -> tuple[list[wl.Request], dict]:
    """The requests to send and a description of where they came from."""
    if args.trace:
        reqs = wl.read_mooncake(args.trace, limit=args.limit)
        source = {"trace": os.path.abspath(args.trace), "limit": args.limit}
        if args.order:
            if all(r.session_id is None for r in reqs):
                reqs = wl.infer_sessions(reqs)
            reqs = wl.reorder(reqs, args.order, seed=args.seed)
            source["order"] = args.order
    else:
        _check_generator_args(args)
        params = dict(sessions=args.sessions, requests=args.requests, mean_input=args.mean_input,
                      mean_output=args.mean_output, rate=args.rate, cv=args.cv, order=args.order or "random",
                      reuse=args.reuse, seed=args.seed, max_input=args.max_input)
        reqs = wl.generate_swebench(**params)
        if args.limit is not None:  # (parse_args refused < 1: `if args.limit` sent everything for 0)
            reqs = reqs[: args.limit]
        source = {"generator": "swebench-agentic", **params, "limit": args.limit}
    if args.rate_factor != 1.0:
        reqs = wl.scale_rate(reqs, args.rate_factor)
        source["rate_factor"] = args.rate_factor
    if args.max_input and args.trace:
        reqs = [_truncate(r, args.max_input) for r in reqs]
    return reqs, source


def _check_generator_args(args) -> None:
    """The generator's own limits (workload.generate_swebench), checked here so that the message names
    the flag: the generator's names its parameters."""
    rules = [  # (flag, value, holds, what to give instead)
        ("--requests", args.requests, args.requests >= 1, "give >= 1 request"),
        ("--sessions", args.sessions, 1 <= args.sessions <= args.requests,
         f"give 1 to --requests ({args.requests}) sessions"),
        ("--mean-input", args.mean_input, args.mean_input >= 1, "give >= 1 token"),
        ("--mean-output", args.mean_output, args.mean_output >= 1, "give >= 1 token"),
        ("--rate", args.rate, args.rate > 0, "give an arrival rate > 0 req/s"),
        ("--cv", args.cv, 0 <= args.cv <= wl.MAX_CV, f"give a burstiness within [0, {wl.MAX_CV:g}]"),
        ("--reuse", args.reuse, args.reuse is None or 0 <= args.reuse <= 1, "give a share within [0, 1]"),
        ("--max-input", args.max_input, args.max_input is None or args.max_input >= wl.BLOCK_TOKENS,
         f"give at least one block ({wl.BLOCK_TOKENS} tokens)"),
    ]
    for flag, value, holds, fix in rules:
        if not holds:
            raise ValueError(f"{flag} {value:g}: {fix}")


def _truncate(r: wl.Request, max_input: int) -> wl.Request:
    if r.input_length <= max_input:
        return r
    n = -(-max_input // wl.BLOCK_TOKENS)
    return wl.Request(r.timestamp, max_input, r.output_length, r.hash_ids[:n], r.session_id, r.turn)


def request_body(r: wl.Request, vocab: int, token_seed: int) -> bytes:
    """The JSON body of SGLang's native /generate for one request: token ids, fixed output length."""
    return _dumps({
        "input_ids": wl.to_token_ids(r, vocab=vocab, seed=token_seed),
        "sampling_params": {"max_new_tokens": r.output_length, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    })


# --------------------------------------------------------------------------------------------- client
@dataclass
class Result:
    """One request's measurement. Times in seconds; ``sent`` and ``scheduled`` from the run's start."""

    index: int
    session: int | None
    turn: int | None
    input_length: int
    scheduled: float
    sent: float = math.nan
    ttft: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    cached_tokens: int = 0
    cached_details: dict = field(default_factory=dict)
    error: str | None = None


def _progress_text(state: dict, in_flight: int, total: int) -> str:
    mean = f"{np.mean(state['ttfts']):.2f}s" if state["ttfts"] else "-"
    return f"{state['done']}/{total} done, {in_flight} in flight, {state['errors']} errors, mean TTFT {mean}"


def _parse_events(buf: bytearray) -> list[bytes]:
    """Pop the complete SSE ``data:`` payloads from ``buf`` (events end with a blank line)."""
    out = []
    while True:
        end = buf.find(b"\n\n")
        if end < 0:
            return out
        event = bytes(buf[:end])
        del buf[: end + 2]
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())


async def _send(session, url: str, body: bytes, res: Result, clock: Callable[[], float], timeout: float):
    import aiohttp

    res.sent = clock()
    last = None
    try:
        async with session.post(url + "/generate", data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                for data in _parse_events(buf):
                    if data == b"[DONE]":
                        continue
                    if math.isnan(res.ttft):
                        res.ttft = clock() - res.sent  # first streamed chunk: the first token is out
                    last = data
        res.e2e = clock() - res.sent
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return
    if last is None:
        res.error = "the stream ended without a chunk"
        return
    try:
        out = _loads(last)
    except ValueError:
        res.error = "unparsable final chunk"
        return
    if "error" in out:
        res.error = str(out["error"].get("message", out["error"]) if isinstance(out["error"], dict) else out["error"])[:200]
        res.ttft = math.nan
        return
    meta = out.get("meta_info") or {}
    res.output_tokens = int(meta.get("completion_tokens") or len(out.get("output_ids") or ()))
    res.cached_tokens = int(meta.get("cached_tokens") or 0)
    res.cached_details = {k: v for k, v in (meta.get("cached_tokens_details") or {}).items()
                          if isinstance(v, (int, float))}


async def run_requests(url: str, requests: Sequence[wl.Request], *, vocab: int = wl.DEFAULT_VOCAB,
                       token_seed: int = 0, timeout: float = 600.0, progress: Progress | None = None,
                       start_delay: float = 0.5) -> list[Result]:
    """Send ``requests`` open loop at their arrival times and measure each one's TTFT.

    Bodies are built ahead of time (up to ``LOOKAHEAD_S``) so that building them does not delay a
    send; each send is its own task, so a slow reply never holds back a later arrival.

    Returns:
        One :class:`Result` per request, in the given order.
    """
    import aiohttp

    loop = asyncio.get_running_loop()
    t0 = loop.time() + start_delay
    clock = lambda: loop.time() - t0  # noqa: E731
    base = requests[0].timestamp if requests else 0.0
    sched = [(r.timestamp - base) / 1000.0 for r in requests]
    results = [Result(i, r.session_id, r.turn, r.input_length, sched[i]) for i, r in enumerate(requests)]
    bodies: dict[int, bytes] = {}
    tasks: set = set()
    state = {"done": 0, "errors": 0, "ttfts": []}

    def finished(task, res: Result):
        tasks.discard(task)
        state["done"] += 1
        if res.error:
            state["errors"] += 1
        else:
            state["ttfts"].append(res.ttft)
        if progress:
            progress.show(state["done"], _progress_text(state, len(tasks), len(requests)))

    connector = aiohttp.TCPConnector(limit=0, force_close=False)  # open loop: no client-side queue
    async with aiohttp.ClientSession(connector=connector) as session:
        built = 0
        for i, r in enumerate(requests):
            while built < len(requests) and (built <= i or (sched[built] <= clock() + LOOKAHEAD_S
                                                            and built - i < MAX_PREBUILT)):
                bodies[built] = request_body(requests[built], vocab, token_seed)
                built += 1
            delay = sched[i] - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(_send(session, url, bodies.pop(i), results[i], clock, timeout))
            task.add_done_callback(lambda t, res=results[i]: finished(t, res))
            tasks.add(task)
        while tasks:
            await asyncio.wait(set(tasks))
    if progress:
        progress.show(state["done"], _progress_text(state, 0, len(requests)), force=True)
        progress.close()
    return results


# -------------------------------------------------------------------------------------------- metrics
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+([-+0-9.eEinfNa]+)(\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple, float]:
    """Prometheus text exposition -> ``{(name, ((label, value), ...)): value}`` (labels sorted)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            continue
    return out


def scrape(url: str, timeout: float = 10.0) -> dict[tuple, float] | None:
    """The server's /metrics, parsed; None when it has none (no ``--enable-metrics``) or is unreachable."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as resp:
            return parse_prometheus(resp.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _sum(samples: dict, name: str, **match) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == val for k, val in match.items()))


KV = "kvstream:"  # kvstream's metric families (kvstream_hicache/sglang/metrics.py)
TIER_FAMILIES = {"read_bytes": KV + "tier_read_bytes_total", "served_bytes": KV + "tier_served_bytes_total",
                 "write_bytes": KV + "tier_write_bytes_total", "fallbacks": KV + "tier_fallbacks_total",
                 "corrupted_pages": KV + "tier_corrupted_pages_total", "errors": KV + "tier_errors_total",
                 "in_place_bytes": KV + "tier_read_in_place_bytes_total"}


def storage_metrics(before: dict | None, after: dict | None) -> dict | None:
    """What the run moved through the storage tier, from counter deltas of sglang's and kvstream's metrics.

    sglang: storage-hit tokens found by the prefetch query, tokens prefetched from storage, tokens
    backed up, cached prompt tokens by source. kvstream (kvstream_hicache/sglang/metrics.py): per tier bytes
    read, served (first arrivals: the tier's read share), read in place (no staging copy) and written,
    fallbacks, corrupted pages; read
    batches' total time against their aggregate-bandwidth bound. Counters are summed over ranks; any
    family the server does not export is simply absent (zero).
    """
    if after is None:
        return None
    before = before or {}
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out = {
        "storage_hit_tokens": _sum(delta, "sglang:storage_prefetch_hit_tokens_total"),
        "prefetched_tokens": _sum(delta, "sglang:prefetched_tokens_total"),
        "backuped_tokens": _sum(delta, "sglang:backuped_tokens_total"),
        "cached_tokens": {src: _sum(delta, "sglang:cached_tokens_total", cache_source=src)
                          for src in ("device", "host", "storage")},
        "prompt_tokens": _sum(delta, "sglang:prompt_tokens_total"),
    }
    tiers: dict[str, dict] = {}
    for (name, labels), v in delta.items():
        lab = dict(labels)
        for field_name, family in TIER_FAMILIES.items():
            if name == family and "tier" in lab:
                t = tiers.setdefault(lab["tier"], dict.fromkeys(TIER_FAMILIES, 0.0))
                t[field_name] += v
    for (name, labels), _v in after.items():  # tier position -> directory
        lab = dict(labels)
        if name == KV + "tier_info" and lab.get("tier") in tiers:
            tiers[lab["tier"]]["path"] = lab.get("path")
    served = sum(t["served_bytes"] for t in tiers.values())
    for t in tiers.values():
        t["read_share"] = t["served_bytes"] / served if served else 0.0
    out["tiers"] = dict(sorted(tiers.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0]))
    time_s = _sum(delta, KV + "retrieval_seconds_sum")
    bound_s = _sum(delta, KV + "retrieval_bound_seconds_total")
    out["retrieval"] = {"batches": _sum(delta, KV + "retrieval_seconds_count"), "time_s": time_s,
                        "bound_s": bound_s, "gap": time_s / bound_s - 1.0 if bound_s > 0 else None}
    out["pages"] = {r: _sum(delta, KV + "pages_total", result=r) for r in ("found", "missing")}
    out["kvstream_exported"] = any(n.startswith(KV) for (n, _l) in after)
    return out


# --------------------------------------------------------------------------------------------- report
def _stats(a: Sequence[float]) -> dict:
    a = np.asarray(a, dtype=float)
    if not len(a):
        return {k: None for k in ("mean", "p50", "p90", "p99", "max")}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def slo_attainment(results: Sequence[Result], deadlines: Sequence[float]) -> dict[str, float]:
    """Share of ALL requests whose TTFT met each deadline (a failed request misses every deadline)."""
    n = len(results)
    ok = np.array([r.ttft for r in results if r.error is None and not math.isnan(r.ttft)])
    return {f"{d:g}": (float((ok <= d).sum()) / n if n else 0.0) for d in deadlines}


def summarize_run(results: Sequence[Result], deadlines: Sequence[float], wall_s: float,
                  metrics: dict | None) -> dict:
    good = [r for r in results if r.error is None and not math.isnan(r.ttft)]
    lag = [r.sent - r.scheduled for r in results if not math.isnan(r.sent)]
    details: dict[str, float] = {}
    for r in good:
        for k, v in r.cached_details.items():
            details[k] = details.get(k, 0) + v
    errors = [r.error for r in results if r.error]
    return {
        "requests": len(results),
        "errors": len(errors),
        "first_errors": errors[:5],
        "wall_s": wall_s,
        "ttft": _stats([r.ttft for r in good]),
        "e2e": _stats([r.e2e for r in good]),
        "slo": slo_attainment(results, deadlines),
        "client_lag": _stats(lag),
        "prompt_tokens": sum(r.input_length for r in good),
        "output_tokens": sum(r.output_tokens for r in good),
        "cached_tokens": sum(r.cached_tokens for r in good),
        "cached_tokens_by_source": details,
        "metrics": metrics,
    }


def speedups(base: dict, new: dict) -> dict:
    """``base / new`` for mean, p50 and p90 TTFT (> 1: ``new`` is faster)."""
    out = {}
    for k in ("mean", "p50", "p90"):
        b, n = base["ttft"].get(k), new["ttft"].get(k)
        out[k] = b / n if b and n else None
    return out


def _finite(obj):
    """NaN/inf -> None, recursively: strict JSON (a failed request has no TTFT)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _fmt_tokens(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


def format_run(name: str, s: dict) -> str:
    t = s["ttft"]
    lines = [
        f"{name}: {s['requests']} requests, {s['errors']} errors, {s['wall_s']:.0f} s",
        f"  TTFT    mean {_fmt_s(t['mean'])}  p50 {_fmt_s(t['p50'])}  p90 {_fmt_s(t['p90'])}  "
        f"p99 {_fmt_s(t['p99'])}  max {_fmt_s(t['max'])}",
        "  SLO     " + "  ".join(f"<= {d} s: {100 * v:.1f}%" for d, v in s["slo"].items()),
        f"  E2E     mean {_fmt_s(s['e2e']['mean'])}  p90 {_fmt_s(s['e2e']['p90'])}",
    ]
    if s["client_lag"]["p99"] is not None:
        lines.append(f"  client  sends behind schedule by p99 {1000 * s['client_lag']['p99']:.1f} ms "
                     f"(max {1000 * s['client_lag']['max']:.1f} ms)")
    by_src = s["cached_tokens_by_source"]
    src = ", ".join(f"{k} {_fmt_tokens(by_src[k])}" for k in ("device", "host", "storage") if k in by_src)
    lines.append(f"  cache   {_fmt_tokens(s['cached_tokens'])} of {_fmt_tokens(s['prompt_tokens'])} prompt tokens "
                 f"cached" + (f" ({src})" if src else "") + "  [responses]")
    m = s["metrics"]
    if m is None:
        lines.append("  metrics none (start the server with --enable-metrics to see storage and tier figures)")
    else:
        lines.append(f"  storage hit tokens {_fmt_tokens(m['storage_hit_tokens'])}, prefetched "
                     f"{_fmt_tokens(m['prefetched_tokens'])}, backed up {_fmt_tokens(m['backuped_tokens'])}  [/metrics]")
        for k, v in m["tiers"].items():
            lines.append(f"  tier {k}  served {v['served_bytes'] / 1e9:.2f} GB ({100 * v['read_share']:.0f}% of reads), "
                         f"read {v['read_bytes'] / 1e9:.2f} GB, wrote {v['write_bytes'] / 1e9:.2f} GB"
                         + (f", {v['fallbacks']:.0f} fallbacks" if v["fallbacks"] else "")
                         + (f", {v['corrupted_pages']:.0f} corrupted" if v["corrupted_pages"] else "")
                         + (f"  [{v['path']}]" if v.get("path") else ""))
        r = m["retrieval"]
        if r["batches"]:
            gap = f", {100 * r['gap']:.1f}% above the aggregate-bandwidth bound ({r['bound_s']:.2f} s)" \
                if r["gap"] is not None else ""
            lines.append(f"  reads   {r['batches']:.0f} batches in {r['time_s']:.2f} s{gap}")
        if not m["kvstream_exported"]:
            lines.append("  tiers   no kvstream metrics on this server (another backend, or an older kvstream)")
    return "\n".join(lines)


def plot_slo(runs: dict[str, list[Result]], deadlines: Sequence[float], path: str, title: str) -> None:
    """TTFT SLO attainment curves (the paper's Fig. 11): share of requests meeting each deadline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    finite = [r.ttft for rs in runs.values() for r in rs if r.error is None and not math.isnan(r.ttft)]
    lo = max(min(finite, default=0.01), 1e-3)
    hi = max(max(finite, default=10.0), max(deadlines, default=1.0))
    xs = np.logspace(math.log10(lo / 1.5), math.log10(hi * 1.5), 300)
    for name, rs in runs.items():
        ok = np.sort([r.ttft for r in rs if r.error is None and not math.isnan(r.ttft)])
        ys = 100.0 * np.searchsorted(ok, xs, side="right") / max(len(rs), 1)
        ax.plot(xs, ys, label=name, linewidth=2)
    for d in deadlines:
        ax.axvline(d, color="0.8", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT SLO (s)")
    ax.set_ylabel("requests meeting the SLO (%)")
    ax.set_ylim(0, 101)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- server
def split_tiers(spec: str | None) -> list[str]:
    """``DIR1:DIR2`` (os.pathsep) -> directories; empty when unset."""
    return [d for d in (spec or "").split(os.pathsep) if d]


def launch_command(args, backend: str, port: int) -> list[str]:
    """The ``sglang.launch_server`` command line for one backend (``--cpu``: plus the CPU server's flags)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model or "<MODEL>",
           "--host", args.host, "--port", str(port),
           "--enable-hierarchical-cache", "--page-size", str(args.page_size), "--enable-metrics"]
    if backend != "none":
        cmd += ["--hicache-storage-backend", backend]
    if args.cpu:
        cmd += list(serve_cpu.CPU_ARGS)
    if args.hicache_ratio:
        cmd += ["--hicache-ratio", str(args.hicache_ratio)]
    if args.hicache_size:
        cmd += ["--hicache-size", str(args.hicache_size)]
    if args.prefetch_policy:
        cmd += ["--hicache-storage-prefetch-policy", args.prefetch_policy]
    if args.tp > 1:
        cmd += ["--tp", str(args.tp)]
    return cmd + shlex.split(args.server_args or "")


def backend_env(backend: str, run_dirs: Sequence[str]) -> dict[str, str]:
    """The environment variables that point a backend at its (per-run) directories."""
    if backend == "kvstream":
        return {"KVSTREAM_TIERS": os.pathsep.join(run_dirs)}
    # sglang's file and nixl backends use one directory: the fastest tier, as a user would
    if backend == "file":
        return {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": run_dirs[0]} if run_dirs else {}
    if backend == "nixl":
        return {"SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": run_dirs[0]} if run_dirs else {}
    return {}


def run_dir_tiers(backend: str, tiers: Sequence[str]) -> Sequence[str]:
    """The tiers a backend's run stores in: kvstream all of them, file and nixl tier 0, none nothing."""
    return tiers if backend == "kvstream" else tiers[:1] if backend in ("file", "nixl") else ()


class Server:
    """An ``sglang.launch_server`` child process in its own process group, with fresh tier directories.

    Each run gets new ``serve_swebench-*`` subdirectories in the given tier directories (so runs never
    read each other's pages); they are removed on exit unless ``keep_data``. The process itself is
    ``serve_cpu.ServerProcess`` (started, waited for, its whole group stopped), with ``--cpu`` in the
    CPU server's environment (the shims on PYTHONPATH).
    """

    def __init__(self, args, backend: str, port: int, log_dir: str):
        self.args, self.backend, self.port = args, backend, port
        self.url = f"http://{args.host}:{port}"
        self.log_path = os.path.join(log_dir, f"sglang-{backend}.log")
        self.proc: serve_cpu.ServerProcess | None = None
        self.run_dirs: list[str] = []

    def __enter__(self) -> "Server":
        stamp = f"{RUN_DIR_PREFIX}{self.backend}-{os.getpid()}-{int(time.time())}"
        for tier in run_dir_tiers(self.backend, split_tiers(self.args.tiers)):
            path = os.path.join(tier, stamp)
            os.makedirs(path)
            self.run_dirs.append(path)
        extra = backend_env(self.backend, self.run_dirs)
        env = serve_cpu.server_env(**extra) if self.args.cpu else {**os.environ, **extra}
        cmd = launch_command(self.args, self.backend, self.port)
        print(f"[serve] starting sglang ({self.backend}): {shlex.join(cmd)}", file=sys.stderr)
        print(f"[serve] server log: {self.log_path}", file=sys.stderr)
        self.proc = serve_cpu.ServerProcess(cmd, env, self.log_path, url=self.url)
        try:
            self.proc.start(self.args.startup_timeout)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        print(f"[serve] {self.url} is healthy", file=sys.stderr)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.stop()
        if not self.args.keep_data:
            for path in self.run_dirs:
                if os.path.basename(path).startswith(RUN_DIR_PREFIX):
                    shutil.rmtree(path, ignore_errors=True)
        return False


def _drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError as e:
        print(f"[serve] --drop-caches: cannot drop the page cache ({e}); run as root", file=sys.stderr)


# ----------------------------------------------------------------------------------------------- main
def run_one(args, url: str, requests: Sequence[wl.Request], name: str) -> tuple[dict, list[Result]]:
    if args.flush and args.url:
        try:
            urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=30).close()
        except (urllib.error.URLError, OSError) as e:
            print(f"[serve] /flush_cache failed: {e}", file=sys.stderr)
    if args.drop_caches:
        _drop_caches()
    before = scrape(url)
    progress = Progress(len(requests), name, enabled=not args.no_progress)
    t = time.monotonic()
    results = asyncio.run(run_requests(url, requests, vocab=args.vocab, token_seed=args.seed,
                                       timeout=args.request_timeout, progress=progress))
    wall = time.monotonic() - t
    time.sleep(args.metrics_settle)  # the schedulers publish counters a little after the last reply
    metrics = storage_metrics(before, scrape(url))
    return summarize_run(results, args.slo, wall, metrics), results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    srv = p.add_argument_group("server")
    srv.add_argument("--model", help="model path for sglang.launch_server (not needed with --url or --cpu)")
    srv.add_argument("--cpu", action="store_true",
                     help="serve on this CPU: the tiny model of `kvstream serve-cpu` (unless --model), its flags "
                          "(--device cpu --attention-backend torch_native ...) and shims; --vocab follows the model")
    srv.add_argument("--url", help="attach to a running server instead of starting one")
    srv.add_argument("--tiers", default=os.environ.get("KVSTREAM_TIERS"),
                     help="tier directories, fastest first, separated by ':' (default: $KVSTREAM_TIERS)")
    srv.add_argument("--backend", default="kvstream", choices=BACKENDS, help="storage backend to start")
    srv.add_argument("--compare", help="run the same workload on several backends in turn, e.g. file,kvstream")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=30000)
    srv.add_argument("--page-size", type=int, default=64, help="tokens per KV page (a storage-friendly size)")
    srv.add_argument("--hicache-ratio", type=float, help="host KV pool size relative to the device pool")
    srv.add_argument("--hicache-size", type=int, help="host KV pool size in GB (overrides the ratio)")
    srv.add_argument("--prefetch-policy", choices=("best_effort", "wait_complete", "timeout"),
                     help="--hicache-storage-prefetch-policy (sglang's default: timeout)")
    srv.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    srv.add_argument("--server-args", help="more sglang.launch_server arguments, one quoted string")
    srv.add_argument("--startup-timeout", type=float, default=1800, help="seconds to wait for the server")
    srv.add_argument("--log-dir", help="where the server logs go (default: a new temporary directory)")
    srv.add_argument("--keep-data", action="store_true", help="keep each run's pages in the tier directories")
    srv.add_argument("--flush", action="store_true", help="with --url: POST /flush_cache before the run")
    srv.add_argument("--drop-caches", action="store_true",
                     help="drop the page cache before each run (root; keeps buffered backends honest)")
    wk = p.add_argument_group("workload")
    wk.add_argument("--trace", help="replay a Mooncake-format JSONL trace instead of generating one")
    wk.add_argument("--sessions", type=int, default=130)
    wk.add_argument("--requests", type=int, default=4000)
    wk.add_argument("--mean-input", type=float, default=19000, help="mean prompt tokens")
    wk.add_argument("--mean-output", type=float, default=95, help="mean output tokens")
    wk.add_argument("--rate", type=float, default=1.25, help="arrival rate, req/s")
    wk.add_argument("--cv", type=float, default=1.0, help="burstiness: CV of inter-arrival gaps (1 = Poisson, <= 8)")
    wk.add_argument("--order", choices=wl.ORDERS, help="session interleaving (generated: default random; "
                                                        "traces: as recorded unless given)")
    wk.add_argument("--reuse", type=float, help="dilute prefix reuse to this share of prompt tokens")
    wk.add_argument("--seed", type=int, default=0)
    wk.add_argument("--max-input", type=int, help="cap prompt length (stay below the model's context length)")
    wk.add_argument("--limit", type=int, help="send only the first N requests")
    wk.add_argument("--rate-factor", type=float, default=1.0, help="speed arrivals up (>1) or down (<1)")
    wk.add_argument("--vocab", type=int, help=f"token ids stay below this (default {wl.DEFAULT_VOCAB}; --cpu: "
                                              f"{serve_cpu.VOCAB})")
    out = p.add_argument_group("output")
    out.add_argument("--slo", type=lambda s: [float(x) for x in s.split(",") if x], default=list(DEFAULT_SLOS),
                     help="TTFT deadlines in seconds, comma separated")
    out.add_argument("--json", help="write the results as JSON to this path")
    out.add_argument("--plot", help="write the SLO attainment curve (PNG) to this path")
    out.add_argument("--label", help="with --url: the name of this run in the report (e.g. the server's backend)")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    out.add_argument("--metrics-settle", type=float, default=2.0, help=argparse.SUPPRESS)
    out.add_argument("--dry-run", action="store_true", help="print the launch command(s) and the workload; no server")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.compare.split(",")] if args.compare else [args.backend]
    if args.vocab is None:
        args.vocab = serve_cpu.VOCAB if args.cpu else wl.DEFAULT_VOCAB
    if args.vocab <= wl.FIRST_TOKEN:  # (else the first request body fails, after the server is up)
        p.error(f"--vocab {args.vocab}: token ids are drawn from [{wl.FIRST_TOKEN}, vocab): "
                f"give more than {wl.FIRST_TOKEN}, at most the model's vocabulary size")
    if args.limit is not None and args.limit < 1:  # (0 sent every request, -3 all but the last 3)
        p.error(f"--limit {args.limit}: give N >= 1, or leave it out for every request")
    if args.max_input is not None and args.max_input < 1:
        p.error(f"--max-input {args.max_input}: give a prompt cap >= 1 token")
    if not args.rate_factor > 0:  # (wl.scale_rate's message names neither the flag nor the trace's fault)
        p.error(f"--rate-factor {args.rate_factor:g}: give a factor > 0 (2 = twice as fast)")
    for b in args.backends:
        if b not in BACKENDS:
            p.error(f"--compare: unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    if args.url and args.compare:
        p.error("--compare starts one server per backend; it cannot be combined with --url")
    if not (args.url or args.model or args.cpu or args.dry_run):
        p.error("give --model or --cpu (to start sglang) or --url (to use a running server)")
    if not args.url and not args.dry_run and "kvstream" in args.backends and not split_tiers(args.tiers):
        p.error("kvstream needs tier directories: --tiers DIR1:DIR2 or KVSTREAM_TIERS")
    missing = None if args.url or args.dry_run else missing_tiers(split_tiers(args.tiers), "--tiers")
    if missing:
        p.error(missing)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        requests, source = build_workload(args)
    except (OSError, ValueError) as exc:  # (--trace: a missing file, not a Mooncake trace)
        # Only a trace's faults are the trace's: the generated workload's name their flags themselves.
        where = f"--trace {args.trace}: " if args.trace else "the generated workload: "
        print(f"serve_swebench.py: {where}{exc}", file=sys.stderr)
        return 2
    if not requests:
        print("the workload is empty", file=sys.stderr)
        return 2
    summary = wl.summarize(requests)
    print("workload: " + (f"trace {source['trace']}" if args.trace else "SWE-bench agentic (generated)"))
    print(wl.format_summary(summary))
    if args.dry_run:
        if args.url:
            print(f"\nwould send it to {args.url}/generate (streaming, open loop)")
        for b in args.backends if not args.url else ():
            tiers = split_tiers(args.tiers)
            dirs = [os.path.join(t, f"{RUN_DIR_PREFIX}{b}-<pid>-<time>") for t in run_dir_tiers(b, tiers)]
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in backend_env(b, dirs).items())
            print(f"\n{b} launch command:\n  {env + ' ' if env else ''}{shlex.join(launch_command(args, b, args.port))}")
        return 0

    if args.cpu and not args.model:
        args.model = serve_cpu.build_model()
    if threading.current_thread() is threading.main_thread():
        # SIGTERM -> SystemExit, so the server context below still stops the sglang process group
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    report = {"workload": {"source": source, "summary": summary}, "runs": {}}
    all_results: dict[str, list[Result]] = {}

    def record(name: str, outcome: tuple[dict, list[Result]]) -> None:
        report["runs"][name], all_results[name] = outcome
        print("\n" + format_run(name, outcome[0]), flush=True)  # now, in case a later run fails

    if args.url:
        report["server"] = {"url": args.url}
        record(args.label or "server", run_one(args, args.url.rstrip("/"), requests, args.label or "server"))
    else:
        log_dir = args.log_dir or tempfile.mkdtemp(prefix="serve_swebench-logs-")
        os.makedirs(log_dir, exist_ok=True)
        report["server"] = {"logs": log_dir, "launch": {}}
        for b in args.backends:
            report["server"]["launch"][b] = {"command": launch_command(args, b, args.port),
                                             "env": list(backend_env(b, ["..."]))}
            with Server(args, b, args.port, log_dir) as srv:
                record(b, run_one(args, srv.url, requests, b))
    if "file" in report["runs"] and "kvstream" in report["runs"]:
        sp = speedups(report["runs"]["file"], report["runs"]["kvstream"])
        report["speedup_kvstream_over_file"] = sp
        print("speedup (file / kvstream TTFT): " + "  ".join(
            f"{k} {v:.2f}x" if v else f"{k} -" for k, v in sp.items()))
    if args.plot:
        title = (f"TTFT SLO attainment, {len(requests)} requests"
                 + (f" ({os.path.basename(args.trace)})" if args.trace else " (SWE-bench agentic)"))
        plot_slo(all_results, args.slo, args.plot, title)
        print(f"plot: {args.plot}")
    if args.json:
        for name, rs in all_results.items():
            report["runs"][name]["per_request"] = [asdict(r) for r in rs]
        with open(args.json, "w") as fh:
            json.dump(_finite(report), fh, indent=1)
        print(f"json: {args.json}")
    return 1 if any(s["errors"] == s["requests"] for s in report["runs"].values()) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TimeoutError as exc:  # (a server that did not come up: its log's last lines say why)
        print(f"serve_swebench.py: {exc}", file=sys.stderr)
        sys.exit(1)
