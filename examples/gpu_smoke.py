#!/usr/bin/env python3
"""GPU smoke test: a real sglang server with ``--hicache-storage-backend kvstream`` serves a prompt from L3.

What it does:
  1. starts ``python -m sglang.launch_server`` with HiCache, page size 64, the kvstream backend on ``--tiers``,
     ``--hicache-storage-prefetch-policy wait_complete`` and ``--enable-metrics``;
  2. sends a long prompt (greedy, a few output tokens) and waits until kvstream has written its pages
     (the ``kvstream:tier_write_bytes_total`` metric stops growing);
  3. flushes the device and host caches (``POST /flush_cache``);
  4. sends the same prompt again and checks that it was served from kvstream: the response's
     ``meta_info.cached_tokens_details.storage`` (tokens loaded from L3) covers most of the prompt, the
     backend named there is kvstream's, and kvstream's served-bytes and found-pages metrics grew;
  5. reports the start-up line kvstream logged, the two outputs (identical with greedy decoding unless the
     GPU kernels are not batch-invariant), and PASS or FAIL (exit status 0 or 1).

Usage (on a machine with a GPU, sglang and this package installed, the model available locally):
    python examples/gpu_smoke.py --model Qwen/Qwen2.5-0.5B-Instruct --tiers /mnt/nvme0/kv:/mnt/nvme1/kv
    python examples/gpu_smoke.py --model /models/llama-3.2-1b -- --tp 2 --mem-fraction-static 0.6
Arguments after ``--`` go to sglang unchanged (e.g. ``--load-format dummy`` for a config-only model dir).
Without ``--tiers`` two directories under a fresh temporary directory are used (same file system: fine for
a smoke test, no added bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

PAGE = 64  # tokens per HiCache page (what the NIXL/kvstream docs recommend for L3)
STORAGE_SHARE = 0.5  # the second request must load at least this share of its prompt from L3


# ----------------------------------------------------------------------------------------------- http
def http(method: str, url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def metrics(base: str) -> dict[str, float]:
    """Sum of each kvstream/sglang metric family over its label sets (name -> value)."""
    status, text = http("GET", f"{base}/metrics", timeout=30)
    out: dict[str, float] = {}
    if status != 200:
        return out
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name.startswith(("kvstream:", "sglang:prefetched_tokens", "sglang:backuped_tokens")):
            key = name + ('{result="found"}' if 'result="found"' in labels else "")
            out[key] = out.get(key, 0.0) + value
    return out


# ----------------------------------------------------------------------------------------------- steps
def prompt_text(tokens: int, seed: int) -> str:
    """A long, deterministic, non-repetitive prompt of roughly ``tokens`` tokens."""
    import random

    rng = random.Random(seed)
    words = ("storage tier replica bandwidth kernel page cache prefix token request latency queue device "
             "host memory engine router claim batch stream fabric vector matrix layer head block disk").split()
    body = " ".join(f"{rng.choice(words)}-{rng.randrange(10_000)}" for _ in range(tokens // 3))
    return f"Summarize the following log in one sentence.\n{body}\nSummary:"


def generate(base: str, text: str, new_tokens: int, timeout: float) -> dict:
    status, body = http("POST", f"{base}/generate",
                        {"text": text, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}},
                        timeout=timeout)
    if status != 200:
        raise RuntimeError(f"/generate returned HTTP {status}: {body[:500]}")
    return json.loads(body)


def wait_until(what: str, predicate, timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def wait_writes_settled(base: str, timeout: float) -> float:
    """kvstream's written bytes > 0 and unchanged over two polls 2 s apart."""
    history: list[float] = []

    def settled():
        history.append(sum(v for k, v in metrics(base).items() if k.startswith("kvstream:tier_write_bytes")))
        return history[-1] if len(history) >= 3 and history[-1] > 0 and history[-1] == history[-3] else 0

    return wait_until("kvstream to finish writing the prompt's pages", settled, timeout, interval=1.0)


def launch(args, tiers: list[str], log_path: str) -> subprocess.Popen:
    extra = {"tiers": tiers}
    if args.policy:
        extra["policy"] = args.policy
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--enable-hierarchical-cache", "--page-size", str(PAGE),
           "--hicache-write-policy", "write_through", "--hicache-storage-backend", "kvstream",
           "--hicache-storage-prefetch-policy", "wait_complete", "--enable-metrics",
           "--hicache-storage-backend-extra-config", json.dumps(extra), *args.sglang_args]
    env = dict(os.environ)
    env.pop("SGLANG_PLUGINS", None)  # a whitelist without 'kvstream' would disable the plugin
    env["KVSTREAM_TIERS"] = os.pathsep.join(tiers)  # the documented variable (the extra config also says it)
    print("launch:", " ".join(cmd), flush=True)
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------------------------- main
def preflight() -> list[str]:
    problems = []
    try:
        import torch

        if not torch.cuda.is_available():
            problems.append("torch.cuda.is_available() is False: this smoke test needs a GPU")
    except ImportError:
        problems.append("torch is not installed")
    try:
        from importlib.metadata import entry_points

        if not any(ep.name == "kvstream" for ep in entry_points(group="sglang.srt.plugins")):
            problems.append("the kvstream sglang plugin is not installed (pip install kvstream-hicache)")
    except Exception as exc:  # noqa: BLE001 - report, do not crash the preflight
        problems.append(f"cannot list sglang plugins: {exc}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="model path or HF id (local)")
    parser.add_argument("--port", type=int, default=30123)
    parser.add_argument("--tiers", default=None,
                        help=f"tier directories, fastest first, separated by {os.pathsep!r} (default: 2 temp dirs)")
    parser.add_argument("--policy", default=None, help="KVSTREAM_POLICY, e.g. 'kvstream' or 'static-0.5'")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="approximate prompt length")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for the server to come up")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--strict-output", action="store_true",
                        help="also FAIL when the two greedy outputs differ (needs batch-invariant kernels)")
    parser.add_argument("--log", default=None, help="server log file (default: in the work directory)")
    parser.add_argument("sglang_args", nargs=argparse.REMAINDER, help="after '--': extra sglang arguments")
    args = parser.parse_args(argv)
    if args.sglang_args and args.sglang_args[0] == "--":
        args.sglang_args = args.sglang_args[1:]

    problems = preflight()
    if problems:
        for p in problems:
            print("FAIL:", p)
        return 1

    work = tempfile.mkdtemp(prefix="kvstream-smoke-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    if args.tiers:
        tiers = [t for t in args.tiers.split(os.pathsep) if t]
    else:
        tiers = [os.path.join(work, f"tier{i}") for i in range(2)]
    for t in tiers:
        os.makedirs(t, exist_ok=True)
    log_path = args.log or os.path.join(work, "server.log")
    base = f"http://127.0.0.1:{args.port}"
    checks: list[tuple[str, bool, str]] = []
    proc = launch(args, tiers, log_path)
    try:
        def up():
            if proc.poll() is not None:
                raise RuntimeError(f"sglang exited with status {proc.returncode} during start-up")
            try:
                return http("GET", f"{base}/health", timeout=5)[0] == 200
            except OSError:
                return False

        t0 = time.monotonic()
        wait_until("the server to start", up, args.startup_timeout, interval=2.0)
        print(f"server up in {time.monotonic() - t0:.0f} s; log: {log_path}", flush=True)
        startup = [ln.strip() for ln in tail(log_path, 100000).splitlines()
                   if re.search(r"kvstream: \d+ tiers? \[", ln)]
        checks.append(("kvstream start-up line logged", bool(startup), startup[0] if startup else "none"))

        text = prompt_text(args.prompt_tokens, seed=7)
        first = generate(base, text, args.new_tokens, args.request_timeout)
        prompt_tokens = int(first["meta_info"].get("prompt_tokens", 0))
        print(f"request 1: {prompt_tokens} prompt tokens, cached {first['meta_info'].get('cached_tokens')}",
              flush=True)
        written = wait_writes_settled(base, timeout=args.request_timeout)
        before = metrics(base)
        print(f"kvstream wrote {written / 2**20:.1f} MiB (all tiers)", flush=True)

        wait_until("/flush_cache", lambda: http("POST", f"{base}/flush_cache", timeout=30)[0] == 200, 60)
        second = generate(base, text, args.new_tokens, args.request_timeout)
        after = metrics(base)
        meta = second["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        storage = int(details.get("storage") or 0)
        print(f"request 2: cached {meta.get('cached_tokens')}, details {details}", flush=True)

        need = int(STORAGE_SHARE * prompt_tokens)
        checks.append((f"request 2 loaded >= {need} prompt tokens from L3", storage >= need,
                       f"storage={storage} of {prompt_tokens}"))
        backend = str(details.get("storage_backend", ""))
        checks.append(("L3 backend is kvstream", "kvstream" in backend.lower(), backend or "none reported"))

        def grew(name):
            return after.get(name, 0.0) - before.get(name, 0.0)

        served = sum(grew(k) for k in after if k.startswith("kvstream:tier_served_bytes"))
        checks.append(("kvstream served bytes grew", served > 0, f"+{served / 2**20:.2f} MiB"))
        found = grew('kvstream:pages_total{result="found"}')
        checks.append(("kvstream found pages grew", found > 0, f"+{found:.0f} pages"))
        errors = after.get("kvstream:adapter_errors_total", 0.0)
        checks.append(("no adapter errors", errors == 0, f"{errors:.0f}"))
        same = first["text"] == second["text"]
        print(f"output 1: {first['text']!r}\noutput 2: {second['text']!r}", flush=True)
        if args.strict_output:
            checks.append(("greedy outputs identical", same, "" if same else "outputs differ"))
        elif not same:
            print("note: greedy outputs differ (non-batch-invariant kernels can do this; --strict-output fails it)")
    except Exception as exc:  # noqa: BLE001 - a smoke test reports every failure as FAIL
        checks.append(("smoke run completed", False, f"{type(exc).__name__}: {exc}"))
    finally:
        stop(proc)

    ok = all(passed for _, passed, _ in checks)
    print("\n== kvstream GPU smoke ==")
    for name, passed, detail in checks:
        print(f"  [{'PASS' if passed else 'FAIL'}] {name}: {detail}")
    if not ok:
        print(f"\n--- last lines of {log_path} ---\n{tail(log_path)}")
    print("PASS" if ok else "FAIL")
    if ok and not args.tiers and not args.log:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
