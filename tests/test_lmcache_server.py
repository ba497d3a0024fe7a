"""docs/lmcache.md's server line works: ``lmcache server --l2-adapter '{"type":"plugin",...}'`` starts on
the CPU with our adapter as its L2, reports it healthy on ``/status``, and shuts down on SIGINT.

Loopback only, ports picked free; bounded waits. Run:
``.venv-lmcache/bin/python -m pytest -q -m lmcache tests/test_lmcache_server.py``
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

# opentelemetry (imported by LMCache) warns about its own LoggingHandler: not ours to fix
pytestmark = [pytest.mark.lmcache, pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

START_S = 180.0  # the server imports torch, numba and LMCache: up to a minute on a busy 2-core machine
STOP_S = 30.0


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def server_command(tiers: list[str], ports: list[int]) -> list[str]:
    zmq_port, http_port, prom_port = ports
    spec = {"type": "plugin", "module_path": "kvstream_hicache.lmcache.adapter", "class_name": "KVStreamL2Adapter",
            "adapter_params": {"tiers": tiers}}
    lmcache = os.path.join(os.path.dirname(sys.executable), "lmcache")
    return [lmcache, "server", "--host", "127.0.0.1", "--port", str(zmq_port), "--http-host", "127.0.0.1",
            "--http-port", str(http_port), "--prometheus-port", str(prom_port), "--l1-size-gb", "0.05",
            "--eviction-policy", "LRU", "--chunk-size", "16", "--l2-adapter", json.dumps(spec)]


def test_lmcache_server_runs_with_the_adapter(tier_dirs, tmp_path):
    tiers = tier_dirs[:2]
    ports = free_ports(3)
    log_path = tmp_path / "server.log"
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_command(tiers, ports), stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(tmp_path))
    try:
        status = wait_status(proc, ports[1], log_path)
        (adapter,) = status["storage_manager"]["l2_adapters"]
        assert adapter["type"] == "KVStreamL2Adapter" and adapter["is_healthy"]
        assert [t["path"] for t in adapter["engine"]["tiers"]] == tiers
        assert all(os.path.isdir(os.path.join(t, "kvstream")) for t in tiers)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"lmcache server ignored SIGINT for {STOP_S} s:\n{log_path.read_text()[-3000:]}")


def wait_status(proc: subprocess.Popen, http_port: int, log_path) -> dict:
    """Poll /status until the server answers (or exits, or START_S passes)."""
    deadline = time.monotonic() + START_S
    url = f"http://127.0.0.1:{http_port}/status"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"lmcache server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)  # not up yet: the HTTP frontend starts last
    pytest.fail(f"lmcache server not up after {START_S} s:\n{log_path.read_text()[-3000:]}")
