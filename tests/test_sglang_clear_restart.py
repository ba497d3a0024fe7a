"""A real ``sglang.launch_server`` on this CPU with kvstream as L3 on two tiers, driven as an operator does
after a weight update: pages written to L3, tier 1 made unavailable (its directory moved away), SGLang's
clear endpoint (``POST /hicache/storage-backend/clear``, sglang 0.5.23's spelling of
``/clear_hicache_storage_backend``) and ``/flush_cache``, the server stopped, tier 1 put back with many
more stale pages, the server started again. owed.py records the clear tier 1 missed on tier 0; the next
start keeps tier 1 out while a thread of its own removes its pages, then lets it in.

One scenario (two server lifecycles, ~100 s) for the module; each test asserts one thing it showed.
Written by the review of a real server's clear and restart, which found there that the first request
after the restart waited for the owed clear (35 s for 400k page files, on SGLang's prefetch thread:
now a thread of its own, shown without wall time by
test_reliability_tier_failure.py::test_pages_cleared_while_a_tier_was_failed_stay_cleared_when_it_rejoins)
and that ``kvstream info`` told nothing of the clear owed.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time

import pytest

from kvstream_hicache.layout import TierLayout
from kvstream_hicache.tools import serve_cpu
from helpers import kvstream_cli, page_files
from sglang_servers import PAGE, PAGES, Server, prompt, server_dirs

pytestmark = pytest.mark.timeout(1500)

# Stale pages tier 1 holds besides the prompt's (a tier of a real deployment holds many: an NVMe of
# pages of the model before the weight update). Empty files named as page files: the owed clear
# removes them by name, as it removes any page file of the namespace.
STALE_EXTRA = int(os.environ.get("E2ECLEAR_STALE", "20000"))


def _gauge(metrics: dict, name: str) -> dict:
    """A per-tier family of a /metrics scrape: {tier label: value}."""
    return {dict(labels).get("tier"): v for (n, labels), v in metrics.items() if n == name}


def namespace_files(tier: str) -> set[str]:
    return set(page_files(tier))


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    logs, scratch, dirs = server_dirs(tmp_path_factory, "clear-restart", ("t0", "t1"))
    t0, t1 = dirs["t0"], dirs["t1"]
    obs: dict = {"t0": t0, "t1": t1}
    servers: list[Server] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(128 + s)))
    old, new = prompt(101), prompt(102)  # old: stored before the clear only; new: stored after it
    try:
        # -- lifecycle 1: pages to L3, tier 1 away, clear, flush, serve on -------------------------------
        s1 = Server("first", logs, serve_cpu.build_model(), [t0, t1])
        servers.append(s1)
        s1.start()
        s1.store(old)
        obs["old_files_t1"] = namespace_files(t1)
        obs["old_files_t0"] = namespace_files(t0)
        os.rename(t1, t1 + ".away")
        obs["clear"] = s1.post("/hicache/storage-backend/clear")
        obs["flush"] = s1.post("/flush_cache")
        obs["served_during_outage"] = s1.store(new)  # the server serves (and backs up) with tier 1 out
        obs["alive_1"] = s1.proc.alive()
        obs["t0_after_clear"] = namespace_files(t0)
        digest = os.path.basename(os.path.dirname(os.path.dirname(next(iter(obs["old_files_t1"])))))
        obs["digest"] = digest
        obs["record_1"] = os.path.exists(os.path.join(t0, "kvstream", digest + ".clears-owed"))
        s1.stop()
        obs["log_1"] = s1.log()
        # -- between: tier 1 back; what the operator sees; then many more stale pages on it --------------
        os.rename(t1 + ".away", t1)
        tiers_arg = os.pathsep.join([t0, t1])
        obs["info"] = kvstream_cli("info", "--tiers", tiers_arg)
        obs["check"] = kvstream_cli("check", "--tiers", tiers_arg)
        layout = TierLayout(t1, digest)
        for i in range(STALE_EXTRA):
            path = layout.page_path(hashlib.sha256(f"stale/{i}".encode()).hexdigest())
            try:
                fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
                fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
        # -- lifecycle 2: tier 1 back ----------------------------------------------------------------
        s2 = Server("second", logs, serve_cpu.build_model(), [t0, t1])
        servers.append(s2)
        s2.start()
        obs["first_new"] = s2.generate(new)  # tier 0 holds every page of it (stored after the clear)
        obs["first_old"] = s2.generate(old)  # only tier 1's stale copies exist
        obs["stale_left"] = sorted(obs["old_files_t1"] & namespace_files(t1))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # tier 1 rejoins and catch-up writes the new pages to it
            if obs["t0_after_clear"] and {os.path.basename(p) for p in obs["t0_after_clear"]} <= \
                    {os.path.basename(p) for p in namespace_files(t1)}:
                break
            time.sleep(1)
        obs["t1_after"] = namespace_files(t1)
        while time.monotonic() < deadline:  # (the gauge follows the rejoin within a second: sglang/storage.py)
            obs["metrics_2"] = s2.metrics()
            if _gauge(obs["metrics_2"], "kvstream:tier_healthy").get("1") == 1.0:
                break
            time.sleep(0.5)
        obs["record_2"] = os.path.exists(os.path.join(t0, "kvstream", digest + ".clears-owed"))
        obs["log_2"] = s2.log()
        obs["alive_2"] = s2.proc.alive()
        yield obs
    finally:
        for srv in servers:
            srv.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def test_clear_endpoint_succeeds_and_the_server_serves_on_while_tier1_is_out(scenario):
    o = scenario
    assert o["clear"][0] == 200 and o["flush"][0] == 200, (o["clear"], o["flush"])
    assert o["alive_1"] and Server.storage_tokens(o["served_during_outage"]) == 0
    assert o["old_files_t0"] and not (o["old_files_t0"] & o["t0_after_clear"])  # (tier 0 cleared at once)
    assert o["record_1"], "no record of the clear tier 1 owes on tier 0"


def test_a_page_cleared_is_not_served_after_the_restart(scenario):
    o = scenario
    assert Server.storage_tokens(o["first_old"]) == 0, o["first_old"]["meta"]  # only tier 1's stale copies existed
    assert "owes a clear()" in o["log_2"]


def test_tier1_rejoins_after_the_restart_and_stores_new_pages(scenario):
    o = scenario
    assert Server.storage_tokens(o["first_new"]) == PAGES * PAGE, o["first_new"]["meta"]
    names = {os.path.basename(p) for p in o["t0_after_clear"]}
    assert names and names <= {os.path.basename(p) for p in o["t1_after"]}
    healthy = _gauge(o["metrics_2"], "kvstream:tier_healthy")
    assert healthy.get("1") == 1.0, healthy
    assert not o["record_2"], "the record of the clear owed is left after tier 1 cleared"


def test_kvstream_info_tells_the_operator_tier1_owes_a_clear(scenario):
    """Between the stop and the restart, tier 1 back: ``kvstream info`` on the tiers. The pages tier 1
    holds were cleared (stale KV of before a weight update) and the next start removes them; info must
    not present them as pages a running engine will replicate to tier 0, and says tier 1 owes a clear
    (before, the record on tier 0 was the only trace of it)."""
    out = scenario["info"].stdout
    assert "tier0 lacks" not in out, out  # (the cleared pages of tier 1, announced as to be written to tier 0)
    assert "tier1 owes a clear() of namespace" in out and "(recorded on tier0)" in out, out
    assert "tier1 owes a clear() of namespace" in scenario["check"].stdout
