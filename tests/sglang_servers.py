"""A real sglang server (``serve_cpu.ServerProcess``: the one ``kvstream serve-cpu`` starts, kvstream as L3)
and what the real-server tests ask of it: generate, flush, clear, metrics, logs. Shared by
test_sglang_server.py and test_sglang_clear_restart.py (no test module imports another)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from kvstream_hicache.tools import serve_cpu
from helpers import load_serve_swebench

sv = load_serve_swebench()  # examples/serve_swebench.py: its /metrics parser and counter deltas

PAGE = serve_cpu.PAGE_TOKENS
PAGES = 6
PROMPT_TOKENS = PAGES * PAGE + 17  # a partial last page: sglang stores whole pages only
OUTPUT_TOKENS = 12
STARTUP_S = 600.0  # bounded, and generous: a loaded 2-core machine took 280 s for three at once
PORT_TRIES = 3  # a port another process took while the server started (CI saw it once): start on another
REQUEST_S = 120.0
BACKUP_S = 60.0  # longest the write-through backup of one prompt may take to reach L3
METRICS_SETTLE_S = 2.0  # kvstream's export interval (1 s) and its owed export after a skipped one
KV = "kvstream:"
DEVICE = os.environ.get("KVSTREAM_SERVE_DEVICE", "cpu")

def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, serve_cpu.VOCAB) for _ in range(PROMPT_TOKENS)]  # 0-2: pad, bos, eos


class Server:
    """One real sglang server (``serve_cpu.ServerProcess``) and what the tests ask of it."""

    def __init__(self, name: str, logs: str, model: str, tiers: list[str] | None, layout: str = "page_first"):
        self.name, self.model, self.tiers, self.layout = name, model, tiers, layout
        self.log_path = os.path.join(logs, f"{name}.log")
        self.proc: serve_cpu.ServerProcess | None = None
        self.ready = False

    def launch(self) -> "Server":
        port = serve_cpu.free_port()
        # wait_complete: a prefetch is never cut short by sglang's timeout on a loaded machine
        extra = ["--hicache-storage-prefetch-policy", "wait_complete"] if self.tiers else []
        cmd = serve_cpu.launch_command(self.model, port=port, backend="kvstream" if self.tiers else None,
                                       layout=self.layout, device=DEVICE, extra=extra)
        env = serve_cpu.server_env(device=DEVICE, KVSTREAM_TIERS=os.pathsep.join(self.tiers or []),
                                   KVSTREAM_TIER_RETRY="0.5")
        self.proc = serve_cpu.ServerProcess(cmd, env, self.log_path, url=f"http://127.0.0.1:{port}").launch()
        self.ready = False
        return self

    def wait(self) -> "Server":
        for attempt in range(PORT_TRIES):
            if self.ready:
                break
            try:
                self.proc.wait(STARTUP_S)  # stops the server if it raises
                self.ready = True
            except serve_cpu.PortInUse:
                if attempt == PORT_TRIES - 1:
                    raise
                self.launch()
        return self

    def start(self) -> "Server":
        return self.launch().wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def terminate(self, group: bool = True, timeout: float = 60.0) -> list[str]:
        """SIGTERM, as a user stops a server: the whole group (Ctrl-C in a shell, ``killpg``) or the launcher
        alone (``docker stop``, systemd: the launcher ends its children). Waits (bounded) for every process
        of the group to end on its own and returns those still there (``ps`` lines), which ``stop()`` then
        kills."""
        pgid = self.proc.proc.pid
        (os.killpg if group else os.kill)(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        left: list[str] = []
        while time.monotonic() < deadline:
            self.proc.proc.poll()  # (reaps the launcher: a zombie is not a process left behind)
            ps = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-s", str(pgid)], capture_output=True, text=True)
            left = [ln for ln in ps.stdout.splitlines() if ln.split()[1:2] != ["Z"]]
            if not left:
                break
            time.sleep(0.5)
        self.stop()
        return left

    def post(self, path: str) -> tuple[int, str]:
        """POST ``path`` (an admin endpoint: /flush_cache, /hicache/storage-backend/clear): (status, body)."""
        req = urllib.request.Request(self.url + path, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_S) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    @property
    def url(self) -> str:
        return self.proc.url

    def generate(self, ids: list[int]) -> dict:
        body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": OUTPUT_TOKENS,
                                                                 "temperature": 0.0, "ignore_eos": True}})
        req = urllib.request.Request(self.url + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_S) as resp:
            assert resp.status == 200
            out = json.load(resp)
        return {"ids": out["output_ids"], "text": out["text"], "meta": out["meta_info"]}

    @staticmethod
    def storage_tokens(out: dict) -> int:
        return int((out["meta"].get("cached_tokens_details") or {}).get("storage", 0))

    def flush(self) -> None:
        """Empty L1 and L2 (POST /flush_cache): the next request's prefix can only come from L3."""
        assert self.post("/flush_cache")[0] == 200

    def metrics(self) -> dict:
        got = sv.scrape(self.url)
        assert got is not None, f"{self.name}: no /metrics"
        return got

    def store(self, ids: list[int]) -> dict:
        """Serve ``ids`` and wait until sglang reports its full pages backed up to L3."""
        before = self.metrics()
        out = self.generate(ids)
        deadline = time.monotonic() + BACKUP_S
        while True:
            moved = sv.storage_metrics(before, self.metrics())
            if moved["backuped_tokens"] >= PAGES * PAGE:
                return out
            assert time.monotonic() < deadline, f"{self.name}: L3 backup not done in {BACKUP_S}s: {moved}"
            time.sleep(0.5)

    def from_l3(self, ids: list[int]) -> tuple[dict, dict]:
        """Flush, serve ``ids`` again; returns the response and what the request moved (counter deltas)."""
        self.flush()
        before = self.metrics()
        out = self.generate(ids)
        # kvstream exports its stats at most once a second, a skipped export a second later at the latest
        # (sglang/storage.py, _arm_trailing_sync): settle, then wait (bounded) for the read's pages to show.
        time.sleep(METRICS_SETTLE_S)
        deadline = time.monotonic() + BACKUP_S
        while True:
            moved = sv.storage_metrics(before, self.metrics())
            if sum(moved["pages"].values()) > 0 or time.monotonic() > deadline:
                return out, moved
            time.sleep(0.5)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def errors_since(self, mark: int) -> list[str]:
        """Lines of the log after byte ``mark`` that show an exception or error reaching sglang."""
        text = self.log()[mark:]
        return [ln for ln in text.splitlines() if "Traceback" in ln or " ERROR " in ln or "Exception" in ln]


def server_dirs(tmp_path_factory, tag: str, names) -> tuple[str, str, dict[str, str]]:
    """(a directory for the servers' logs, a scratch directory to remove at the end, {name: an empty
    tier directory in it}); skips where the server's packages are missing (CI installs them, and
    KVSTREAM_STRICT turns a skip there into a failure)."""
    if serve_cpu.missing_packages():
        pytest.skip("the server's packages are missing (bash scripts/setup-env.sh installs them): "
                    + " ".join(serve_cpu.missing_packages()))
    logs = str(tmp_path_factory.mktemp(tag))
    scratch = os.path.join(os.environ.get("KVSTREAM_TEST_DIR", "/var/tmp"), f"kvstream-{tag}-{os.getpid()}")
    tiers = {name: os.path.join(scratch, name) for name in names}
    for d in tiers.values():
        os.makedirs(d)
    return logs, scratch, tiers
