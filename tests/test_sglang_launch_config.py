"""What an SGLang user sees of a configuration mistake, and what docs/sglang.md tells them to watch.

Found on real servers (``python -m sglang.launch_server ... --hicache-storage-backend kvstream``, the CPU
flags of ``kvstream serve-cpu``): an extra config with a trailing comma stopped the server only after the
model loaded, with a traceback in the scheduler ending in ``JSONDecodeError: Expecting value: line 1
column 34 (char 33)`` (no flag named, no fix); a misspelt key, two 35-line scheduler tracebacks. The
plugin now checks both in the launcher, before any scheduler starts. The counters the docs list were
absent from ``/metrics`` until their first event, and the docs named admin endpoints that sglang 0.5.23
answers with 404.
"""
from __future__ import annotations

import json
import os
import re
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest

from sglang_fixtures import run_python  # noqa: F401 (first: CPU stubs)

from kvstream_hicache.errors import ConfigError

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture
def tier(tmp_path):
    return str(tmp_path)


@pytest.mark.parametrize("text,expected", [
    ('{{"tiers": ["{tier}",], "capacity": "1G"}}',
     ["--hicache-storage-backend-extra-config", '["{tier}",]', "is not valid JSON", "no trailing comma"]),
    ('["{tier}"]', ["--hicache-storage-backend-extra-config", "is a JSON list, not an object", '{{"tiers"']),
    ("null", ["is a JSON null"]),
    ('{{"tiers": ["{tier}"], "capcity": "1G"}}', ["'capcity'", "did you mean 'capacity'?", "valid keys: tiers"]),
    ('{{"tiers": ["{tier}"], "read_timeout": true}}', ["extra config 'read_timeout'", "True", "give seconds"]),
    ("@{tier}/missing.json", ["--hicache-storage-backend-extra-config", "missing.json", "No such file"]),
    ("{{}}", ["no tier directories", "KVSTREAM_TIERS"]),
], ids=["trailing-comma", "list", "null", "typo", "wrong-type", "missing-file", "no-tiers"])
def test_the_launcher_check_names_the_flag_or_setting_and_the_fix(tier, text, expected):
    from kvstream_hicache.sglang.plugin import check_extra_config

    with pytest.raises(ConfigError) as exc:
        check_extra_config("kvstream", text.format(tier=tier), environ={})
    for part in expected:
        assert part.format(tier=tier) in str(exc.value), (part, str(exc.value))


@pytest.mark.parametrize("ext,body", [(".json", '{{"tiers": ["{tier}"], "policy": "static-0.5"}}'),
                                      (".toml", 'tiers = ["{tier}"]\npolicy = "static-0.5"\n'),
                                      (".yaml", "tiers: ['{tier}']\npolicy: static-0.5\n")])
def test_a_good_config_passes_the_check_in_every_spelling(tier, ext, body):
    from kvstream_hicache.sglang.plugin import check_extra_config

    path = os.path.join(tier, "kvstream" + ext)
    with open(path, "w") as fh:
        fh.write(body.format(tier=tier))
    for text in (json.dumps({"tiers": [tier], "policy": "static-0.5", "prefetch_threshold": 64}), "@" + path):
        check_extra_config("kvstream", text, environ={})
    check_extra_config("kvstream", None, environ={"KVSTREAM_TIERS": tier})  # (the environment alone)


def test_other_backends_configs_are_sglangs_to_judge(tier):
    from kvstream_hicache.sglang.plugin import check_extra_config

    check_extra_config("file", '{"bad",}', environ={})
    check_extra_config("dynamic", '{"bad",}', environ={})  # (whose it is cannot be told)
    check_extra_config("dynamic", json.dumps({"backend_name": "x", "module_path": "x.y", "class_name": "X",
                                              "tier_dirs": 1}), environ={})
    with pytest.raises(ConfigError, match="did you mean 'tiers'"):
        check_extra_config("dynamic", json.dumps({"backend_name": "kvstream", "class_name": "KVStreamHiCacheStorage",
                                                  "module_path": "kvstream_hicache.sglang.storage", "interface_v1": 1,
                                                  "tiers": [tier], "tier_dirs": 1}), environ={})


LAUNCHER = textwrap.dedent("""
    import json, sys
    from kvstream_hicache.tools import cpu_sglang
    cpu_sglang.install_stubs()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(json.loads(sys.argv[1]))
    try:
        args.check_server_args()
        print("RESULT " + json.dumps("accepted"))
    except Exception as exc:
        print("RESULT " + json.dumps(f"{type(exc).__name__}: {exc}"))
""")


def test_sglangs_launcher_refuses_a_bad_extra_config_before_any_scheduler_starts(tier):
    """The plugin's hook on ServerArgs.check_server_args, which sglang's launcher runs before it starts a
    scheduler (entrypoints/engine.py): the same argv a user types, refused there."""
    argv = ["--model-path", "dummy", "--enable-hierarchical-cache", "--page-size", "64",
            "--hicache-storage-backend", "kvstream",
            "--hicache-storage-backend-extra-config", f'{{"tiers": ["{tier}",]}}']
    proc = run_python(LAUNCHER.replace("json.loads(sys.argv[1])", repr(argv)))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    got = json.loads(lines[-1][len("RESULT "):])
    assert got.startswith("ConfigError: --hicache-storage-backend-extra-config"), got
    assert "is not valid JSON" in got, got


def test_sglangs_launcher_refuses_a_tier_the_backend_would_refuse_before_any_scheduler_starts(tier):
    """A newcomer's first mistake, a tier directory that does not exist (or a file, or not writable), passed the
    launcher's check: the server loaded its model, the scheduler raised at the backend's attach (~35 s on a CPU
    server, a 35-line traceback), and sglang SIGKILLed the launcher. docs/sglang.md, section 5: the launcher
    checks every kvstream setting before it starts a scheduler."""
    afile = os.path.join(tier, "afile")
    open(afile, "w").close()
    for tiers, expected in (([tier, os.path.join(tier, "nope")], ["does not exist", "mkdir -p"]),
                            ([afile], ["is not a directory"])):
        argv = ["--model-path", "dummy", "--enable-hierarchical-cache", "--page-size", "64",
                "--hicache-storage-backend", "kvstream", "--hicache-storage-backend-extra-config",
                json.dumps({"tiers": tiers})]
        proc = run_python(LAUNCHER.replace("json.loads(sys.argv[1])", repr(argv)))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        got = json.loads(lines[-1][len("RESULT "):])
        assert got.startswith("TierError: tier "), got
        assert "extra config 'tiers'" in got and all(e in got for e in expected), got
    if os.geteuid() != 0:  # (root writes anywhere)
        os.chmod(afile, 0o600)
        ro = os.path.join(tier, "ro")
        os.mkdir(ro, 0o555)
        with pytest.raises(ConfigError, match="is not writable"):
            check_extra_config_probed(ro)
    check_extra_config_probed(tier)  # (a tier the backend takes passes)


def check_extra_config_probed(tier: str) -> None:
    from kvstream_hicache.sglang.plugin import check_extra_config

    check_extra_config("kvstream", json.dumps({"tiers": [tier]}), environ={}, probe=True)


def test_the_counters_the_docs_list_are_at_0_from_the_attach():
    """A counter that appears only at its first event is absent from /metrics (a real server showed no
    under_replicated_pages_total, adapter_errors_total or pages_total{result="missing"}), and Prometheus'
    rate()/increase() lose that first event."""
    from prometheus_client import REGISTRY

    from kvstream_hicache.sglang.metrics import Exporter

    labels = {"tp_rank": "launch-config-test", "dp_rank": "0", "pp_rank": "0", "attn_cp_rank": "0"}
    Exporter(labels, ["/t0", "/t1"])
    assert REGISTRY.get_sample_value("kvstream:pages_total", dict(labels, result="found")) == 0
    assert REGISTRY.get_sample_value("kvstream:pages_total", dict(labels, result="missing")) == 0
    assert REGISTRY.get_sample_value("kvstream:under_replicated_pages_total", labels) == 0
    assert REGISTRY.get_sample_value("kvstream:retrieval_bound_seconds_total", labels) == 0
    for op in ("batch_exists", "batch_get_v1", "batch_set_v1"):  # (the calls sglang's threads make)
        assert REGISTRY.get_sample_value("kvstream:adapter_errors_total", dict(labels, op=op)) == 0, op


def test_read_timeouts_are_exported_as_a_counter():
    """stats()'s read_timeouts (a get that read_timeout ended with reads in flight: its pages missed) had no
    family at /metrics, where write_timeouts has one: a tier that stalls reads showed only as misses."""
    from prometheus_client import REGISTRY

    from kvstream_hicache.sglang.metrics import Exporter

    labels = {"tp_rank": "read-timeouts-test", "dp_rank": "0", "pp_rank": "0", "attn_cp_rank": "0"}
    exporter = Exporter(labels, ["/t0"])
    assert REGISTRY.get_sample_value("kvstream:read_timeouts_total", labels) == 0
    exporter.sync({"tiers": [{}], "read_timeouts": 2})
    exporter.sync({"tiers": [{}], "read_timeouts": 3})
    assert REGISTRY.get_sample_value("kvstream:read_timeouts_total", labels) == 3


def test_the_sglang_endpoints_the_docs_name_exist_in_sglang():
    """docs/sglang.md and guarantees.md named /clear_hicache_storage_backend and
    /detach_hicache_storage_backend, which sglang 0.5.23 answers with 404 (POST /hicache/storage-backend/clear,
    DELETE /hicache/storage-backend)."""
    root = find_spec("sglang").submodule_search_locations[0]
    source = Path(root, "srt", "entrypoints", "http_server.py").read_text()
    routes = set(re.findall(r'@app\.(?:api_route|get|post|put|delete)\(\s*"([^"]+)"', source))
    # (and /metrics, which sglang mounts with --enable-metrics: srt/utils/common.py)
    routes |= set(re.findall(r'Mount\(\s*"([^"]+)"', Path(root, "srt", "utils", "common.py").read_text()))
    assert "/flush_cache" in routes and "/generate" in routes, sorted(routes)[:20]
    # an endpoint as the docs write one: `/flush_cache`, `POST /hicache/storage-backend/clear`
    named = set()
    for doc in ("sglang.md", "guarantees.md"):
        text = (DOCS / doc).read_text()
        named |= set(re.findall(r"`(?:(?:GET|POST|PUT|DELETE) )?(/(?:[a-z]+_[a-z_]+|hicache/[a-z/_-]+|"
                                r"generate|metrics|health))`", text))
        named |= set(re.findall(r"localhost:\d+(/[a-z_/-]+)", text))
    assert named, "no endpoint found in the docs: the pattern no longer matches how they write them"
    missing = sorted(n for n in named if n not in routes)
    assert not missing, f"docs name endpoints sglang does not serve: {missing}"



def test_the_launcher_check_leaves_a_config_no_scheduler_reads(tier):
    """Without --enable-hierarchical-cache no scheduler builds a storage backend: its extra config is never
    read (a launch script that passes the backend's flags and turns HiCache on and off, for an A/B run). The
    launcher accepted such a launch before the check; the check refused it for an extra config that is never
    used (here: no tiers anywhere). The plugin's hook is called as the launcher calls it, on the arguments as
    sglang parsed them (sglang's own checks need a real model). Found by a review."""
    argv = ["--model-path", "dummy", "--page-size", "64", "--hicache-storage-backend", "kvstream",
            "--hicache-storage-backend-extra-config", "{}"]
    code = LAUNCHER.replace("json.loads(sys.argv[1])", repr(argv)).replace(
        "args.check_server_args()", "from kvstream_hicache.sglang.plugin import _check_server_args\n"
                                    "    _check_server_args(args)")
    proc = run_python(code, env={"KVSTREAM_TIERS": ""})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert json.loads(lines[-1][len("RESULT "):]) == "accepted"


def test_the_launcher_turns_on_prefix_keys_for_kvstream_unless_the_config_sets_them(tier):
    """kvstream keeps a prefix's head more recent than its tails only where sglang names each call's prefix
    (``hicache_storage_pass_prefix_keys``, off in sglang): the launcher's hook turns it on in the extra config
    the schedulers read, leaves a value the user wrote, and a config in a file, as written. As the launcher
    runs it: on arguments already resolved (read-only: assigning the field raised AttributeError and the
    server did not start; found by a trial), published after (what the schedulers read)."""
    path = os.path.join(tier, "kv.json")
    with open(path, "w") as fh:
        json.dump({"tiers": [tier]}, fh)
    code = LAUNCHER.replace("args.check_server_args()", (  # (sglang's own checks need a real model: the hook alone)
        "args.resolve_once()\n    from kvstream_hicache.sglang.plugin import _check_server_args\n"
        "    _check_server_args(args)\n    from sglang.srt.runtime_context import get_memory, publish\n"
        "    publish(args, role='tokenizer')")).replace(
        'json.dumps("accepted")', 'json.dumps(get_memory().hicache_storage_backend_extra_config)')
    on, off = {"hicache_storage_pass_prefix_keys": True}, {"hicache_storage_pass_prefix_keys": False}
    for given, expected in ((json.dumps({"tiers": [tier]}), {"tiers": [tier], **on}),
                            (json.dumps({"tiers": [tier], **off}), {"tiers": [tier], **off}),
                            ("@" + path, "@" + path)):
        argv = ["--model-path", "dummy", "--enable-hierarchical-cache", "--page-size", "64",
                "--hicache-storage-backend", "kvstream", "--hicache-storage-backend-extra-config", given]
        proc = run_python(code.replace("json.loads(sys.argv[1])", repr(argv)))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        got = json.loads(lines[-1][len("RESULT "):])
        assert (got if given.startswith("@") else json.loads(got)) == expected
