"""Two sglang servers of one model, each with a private tier 0, sharing tier 1 (what discovery exists for),
through sglang's real HybridCacheController in two processes. Both back up their own prompt and, at the
same moment, a common prompt with their own bytes (two servers' KV for one prefix need not be
bit-identical). Each server's pages survive, each finds the other's pages on the shared tier, and no
page file is deleted (tests/sglang_server_child.py is one server)."""

from __future__ import annotations

import os
import subprocess
import sys

from sglang_fixtures import cpu_sglang  # noqa: F401  (first: skips without sglang; CPU stubs)

from helpers import HERE, page_files, store_at_once  # noqa: E402

WAIT_S = 300
PAGES = 6  # per prompt (sglang_server_child.PAGES)


def test_two_servers_sharing_a_tier_keep_and_find_each_others_pages(tier_root):
    dirs = {name: os.path.join(tier_root, name) for name in ("private0", "private1", "shared")}
    for d in dirs.values():
        os.makedirs(d)
    go = os.path.join(tier_root, "go")
    outs = [os.path.join(tier_root, f"server{who}.json") for who in range(2)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH", "")]))}
    env.pop("SGLANG_PLUGINS", None)
    children = [subprocess.Popen([sys.executable, os.path.join(HERE, "sglang_server_child.py"), str(who),
                                  dirs[f"private{who}"], dirs["shared"], outs[who], go],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for who in range(2)]
    results = store_at_once(children, outs, go, WAIT_S)
    tokens = PAGES * 16
    met = 0
    for who, result in enumerate(results):
        met += result["other_versions"]
        assert result["own_stored"] == tokens and result["common_stored"] == tokens, (who, result)
        assert result["own"] == {"tokens": tokens, "bytes": True}, (who, result)  # its pages survive
        assert result["other"] == {"tokens": tokens, "bytes": True}, (who, result)  # found on the shared tier
        assert result["common"] == {"tokens": tokens, "bytes": True}, (who, result)  # its own version, tier 0
        assert result["threads_alive"] and result["adapter_errors"] == 0, (who, result)
        assert result["quarantined"] == 0, (who, result)
        # its index describes its own bytes; the other server's pages on the shared tier were written
        # after its start (discovery finds them): check() sees them, nothing is damaged
        assert {p["kind"] for p in result["problems"]} <= {"index_missing", "index_stale"}, result["problems"]
    assert met == PAGES, "each common page on the shared tier is one server's version: the other met it"
    # nothing deleted: each private tier holds its server's two prompts (and the other's, where catch-up
    # promoted them there after they were read from the shared tier: issue 23), the shared one all three
    for who in range(2):
        assert 2 * PAGES <= len(page_files(dirs[f"private{who}"])) <= 3 * PAGES, who
    assert len(page_files(dirs["shared"])) == 3 * PAGES
