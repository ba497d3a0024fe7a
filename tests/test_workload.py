"""The workload generator's statistics match its parameters; the Mooncake format round-trips."""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import numpy as np
import pytest

from kvstream_hicache.tools import workload as wl

# The two public Mooncake traces (Apache-2.0) are part of the repository, so a clone tests them on its own.
TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "traces", "mooncake")


@pytest.fixture(scope="module")
def default_workload():
    return wl.generate_swebench()  # the paper's SWE-bench agentic defaults


def _by_session(reqs):
    out = defaultdict(list)
    for r in reqs:
        out[r.session_id].append(r)
    return out


def test_defaults_match_the_paper_trace(default_workload):
    s = wl.summarize(default_workload)
    assert s["requests"] == 4000
    assert s["sessions"] == 130
    assert s["input"]["mean"] == pytest.approx(19000, rel=0.01)
    assert s["output"]["mean"] == pytest.approx(95, rel=0.02)
    assert s["rate"] == pytest.approx(1.25, rel=1e-6)  # gaps are normalized to the exact mean rate
    assert s["cv"] == pytest.approx(1.0, rel=0.1)  # Poisson
    assert 0.9 < s["reuse"] < 0.99  # growing agentic sessions: the paper's 80-96% reuse range
    assert default_workload[0].timestamp == 0
    assert all(a.timestamp <= b.timestamp for a, b in zip(default_workload, default_workload[1:]))


@pytest.mark.parametrize("sessions,requests,mean_input,mean_output", [
    (130, 4000, 19000, 95), (8, 64, 2000, 50), (20, 20, 3000, 30), (3, 300, 40000, 200),
])
def test_counts_and_lengths_follow_parameters(sessions, requests, mean_input, mean_output):
    reqs = wl.generate_swebench(sessions, requests, mean_input, mean_output, seed=1)
    s = wl.summarize(reqs)
    assert (s["requests"], s["sessions"]) == (requests, sessions)
    assert s["input"]["mean"] == pytest.approx(mean_input, rel=0.01)
    assert s["output"]["mean"] == pytest.approx(mean_output, rel=0.05)
    assert min(r.output_length for r in reqs) >= 1
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_length / wl.BLOCK_TOKENS)


@pytest.mark.parametrize("rate", [0.5, 1.25, 4.0])
@pytest.mark.parametrize("cv", [0.0, 1.0, 2.0, 4.0])
def test_arrival_rate_and_burstiness(rate, cv):
    s = wl.summarize(wl.generate_swebench(sessions=400, requests=4000, mean_input=4000, mean_output=20, rate=rate, cv=cv, seed=2))
    assert s["rate"] == pytest.approx(rate, rel=1e-6)
    assert s["cv"] == pytest.approx(cv, rel=0.25, abs=1e-6)


def test_cv8_is_very_bursty_and_out_of_range_is_refused():
    assert wl.summarize(wl.generate_swebench(requests=4000, cv=8.0, seed=0))["cv"] > 5
    with pytest.raises(ValueError, match="cv"):
        wl.generate_swebench(cv=9)
    with pytest.raises(ValueError, match="rate"):
        wl.generate_swebench(rate=0)


def test_prompts_grow_by_prefix_within_a_session():
    reqs = wl.generate_swebench(sessions=6, requests=40, mean_input=4000, mean_output=40, seed=3)
    for turns in _by_session(reqs).values():
        assert [r.turn for r in turns] == list(range(len(turns)))  # turn order kept
        for prev, cur in zip(turns, turns[1:]):
            assert cur.input_length >= prev.input_length + prev.output_length  # + output + tool output
            full = len(prev.hash_ids) - (prev.input_length % wl.BLOCK_TOKENS != 0)
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            prev_tokens = wl.to_token_ids(prev)
            assert wl.to_token_ids(cur)[: len(prev_tokens)] == prev_tokens  # shared to the token


def test_sessions_share_their_repository_context_only():
    reqs = wl.generate_swebench(sessions=30, requests=90, mean_input=8000, repos=3, seed=4)
    ctx_blocks = int(wl.CONTEXT_SHARE * 8000) // wl.BLOCK_TOKENS
    first = {r.session_id: r for r in reqs if r.turn == 0}
    by_prefix = defaultdict(set)
    for sid, r in first.items():
        by_prefix[r.hash_ids[:ctx_blocks]].add(sid)
        # past the context each session's stream is its own
        others = {h for s2, r2 in first.items() if s2 != sid for h in r2.hash_ids[ctx_blocks:]}
        assert not others & set(r.hash_ids[ctx_blocks:])
    assert 1 < len(by_prefix) <= 3  # one shared context per repository


def test_orders_interleave_sessions_as_named():
    kw = dict(sessions=10, requests=100, mean_input=2000, seed=5)
    runs = {o: wl.generate_swebench(order=o, **kw) for o in wl.ORDERS}
    # same requests, same arrival times, only the interleaving differs
    key = lambda r: (r.session_id, r.turn, r.input_length, r.output_length)  # noqa: E731
    assert len({tuple(sorted(map(key, rs))) for rs in runs.values()}) == 1
    assert len({tuple(r.timestamp for r in rs) for rs in runs.values()}) == 1
    sids = [r.session_id for r in runs["cache-friendly"]]
    assert sum(a != b for a, b in zip(sids, sids[1:])) == 9  # each session contiguous
    rr = runs["round-robin"]
    assert [r.turn for r in rr[:10]] == [0] * 10 and len({r.session_id for r in rr[:10]}) == 10
    rnd = [r.session_id for r in runs["random"]]
    assert sum(a != b for a, b in zip(rnd, rnd[1:])) > 30  # interleaved
    for rs in runs.values():
        for turns in _by_session(rs).values():
            assert [r.turn for r in turns] == list(range(len(turns)))
    with pytest.raises(ValueError, match="order"):
        wl.generate_swebench(order="lifo")


@pytest.mark.parametrize("target", [0.04, 0.5, 0.77, 0.88])
def test_reuse_share_is_diluted_to_the_target(target):
    reqs = wl.generate_swebench(sessions=30, requests=600, mean_input=10000, reuse=target, seed=6)
    s = wl.summarize(reqs)
    assert s["reuse"] == pytest.approx(target, abs=0.01)
    assert s["input"]["mean"] == pytest.approx(10000, rel=0.01)  # lengths do not change, content does


def test_reuse_above_the_natural_share_is_refused():
    with pytest.raises(ValueError, match="reuse"):
        wl.generate_swebench(sessions=10, requests=20, mean_input=2000, reuse=0.999)


def test_seed_determinism():
    a = wl.generate_swebench(sessions=10, requests=50, mean_input=3000, seed=7)
    assert a == wl.generate_swebench(sessions=10, requests=50, mean_input=3000, seed=7)
    assert a != wl.generate_swebench(sessions=10, requests=50, mean_input=3000, seed=8)


def test_max_input_caps_prompts_and_keeps_prefixes():
    reqs = wl.generate_swebench(sessions=4, requests=80, mean_input=20000, max_input=16384, seed=9)
    assert max(r.input_length for r in reqs) <= 16384
    for turns in _by_session(reqs).values():
        for prev, cur in zip(turns, turns[1:]):
            assert cur.hash_ids[: len(prev.hash_ids) - 1] == prev.hash_ids[: len(prev.hash_ids) - 1]


def test_to_token_ids_is_deterministic_and_prefix_consistent():
    full = wl.Request(0, 1024, 1, (7, 8))
    part = wl.Request(0, 600, 1, (7, 8))
    other = wl.Request(0, 1024, 1, (7, 9))
    t_full, t_part, t_other = (wl.to_token_ids(r, vocab=5000) for r in (full, part, other))
    assert len(t_full) == 1024 and len(t_part) == 600
    assert t_part == t_full[:600]  # a partial block is the leading part of the full one
    assert t_other[:512] == t_full[:512] and t_other[512:] != t_full[512:]
    assert all(wl.FIRST_TOKEN <= t < 5000 for t in t_full)
    assert wl.to_token_ids(full, vocab=5000) == t_full
    assert wl.to_token_ids(full, vocab=5000, seed=1)[:512] != t_full[:512]
    assert len(set(t_full)) > 500  # not degenerate
    with pytest.raises(ValueError):
        wl.to_token_ids(wl.Request(0, 2000, 1, (1,)))


def test_prefix_hits_on_a_hand_made_trace():
    B = wl.BLOCK_TOKENS
    reqs = [
        wl.Request(0, 2 * B + 100, 1, (1, 2, 3)),  # new
        wl.Request(1, 3 * B, 1, (1, 2, 3)),  # block 3 seen with 100 tokens only
        wl.Request(2, 3 * B + 5, 1, (1, 2, 3, 4)),  # all 3 blocks seen in full now
        wl.Request(3, 2 * B, 1, (1, 9)),  # only block 1
        wl.Request(4, 2 * B, 1, (5, 2)),  # block 2 under a different first block is not a prefix hit
    ]
    assert wl.prefix_hits(reqs) == [0, 2 * B + 100, 3 * B, B, 0]


def test_infer_sessions_follows_prompt_extensions():
    reqs = [
        wl.Request(0, 2048, 1, (0, 1, 2, 3)),
        wl.Request(1, 2048, 1, (0, 10, 11, 12)),  # shares only the system-prompt block: new session
        wl.Request(2, 3000, 1, (0, 1, 2, 3, 4, 5)),  # extends request 0
        wl.Request(3, 2600, 1, (0, 10, 11, 12, 13, 14)),  # extends request 1
        wl.Request(4, 3500, 1, (0, 1, 2, 3, 4, 5, 6)),  # extends request 2
    ]
    got = wl.infer_sessions(reqs)
    assert [r.session_id for r in got] == [0, 1, 0, 1, 0]
    assert [r.turn for r in got] == [0, 0, 1, 1, 2]


def test_reorder_keeps_times_and_turn_order():
    reqs = wl.generate_swebench(sessions=8, requests=60, mean_input=2000, order="cache-friendly", seed=10)
    rr = wl.reorder(reqs, "round-robin")
    assert [r.timestamp for r in rr] == [r.timestamp for r in reqs]
    assert [r.turn for r in rr[:8]] == [0] * 8
    for turns in _by_session(rr).values():
        assert [r.turn for r in turns] == list(range(len(turns)))
    back = wl.reorder(rr, "cache-friendly")
    assert [(r.session_id, r.turn) for r in back] == [(r.session_id, r.turn) for r in reqs]
    assert wl.reorder(reqs, "recorded") == reqs
    assert [r.timestamp for r in wl.scale_rate(reqs, 2.0)] == [r.timestamp / 2 for r in reqs]


def test_mooncake_round_trip(tmp_path):
    reqs = wl.generate_swebench(sessions=5, requests=25, mean_input=3000, cv=2.0, seed=11)
    path = tmp_path / "w.jsonl"
    wl.write_mooncake(reqs, path)
    first = json.loads(path.read_text().splitlines()[0])
    assert {"timestamp", "input_length", "output_length", "hash_ids", "session_id", "turn"} <= set(first)
    assert wl.read_mooncake(path) == reqs
    assert wl.read_mooncake(path, limit=3) == reqs[:3]


def test_mooncake_reader_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        wl.read_mooncake(path)
    path.write_text('{"timestamp": 0, "input_length": 600}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1"):
        wl.read_mooncake(path)


def test_reads_the_public_mooncake_traces():
    reqs = wl.read_mooncake(os.path.join(TRACES, "synthetic_trace.jsonl"))
    s = wl.summarize(reqs)
    assert s["requests"] == 3993
    assert s["input"]["mean"] == pytest.approx(15325, rel=0.001)  # the README's figures
    assert s["output"]["mean"] == pytest.approx(149, rel=0.01)
    conv = wl.read_mooncake(os.path.join(TRACES, "conversation_trace.jsonl"), limit=500)
    assert len(conv) == 500 and all(r.session_id is None for r in conv)
    assert np.all(np.diff([r.timestamp for r in conv]) >= 0)
