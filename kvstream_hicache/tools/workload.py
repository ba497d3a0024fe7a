"""Request workloads: a SWE-bench-agentic generator and the Mooncake trace format.

A workload is a list of :class:`Request`, in arrival order, in the Mooncake trace format
(``timestamp`` in ms from the start, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
blocks: equal ids mean the same prefix block), plus the session and turn each request belongs to.
The examples (``examples/serve_swebench.py``, the demo) and the simulator (``kvsim``) share it.

The generated workload models coding-agent sessions (the paper's SWE-bench agentic trace: 130
sessions, about 4000 requests, about 19K input and 95 output tokens per request, Poisson arrivals
at 1.25 req/s). Each session works on one repository and keeps a *token stream*:

    turn 0 prompt = repository context (shared by every session on that repository) + issue text
    turn k prompt = turn k-1 prompt + turn k-1 output + tool output k-1

so every prompt is a prefix of its session's stream and grows turn by turn. A prompt's ``hash_ids``
are the stream's first ``ceil(input_length / 512)`` block ids; a partial last block is the leading
part of the block with that id, which is what makes :func:`to_token_ids` give identical token ids to
identical prefixes, down to the token.

Typical use::

    from kvstream_hicache.tools import workload
    reqs = workload.generate_swebench(sessions=130, requests=4000, order="random", seed=0)
    print(workload.format_summary(workload.summarize(reqs)))
    workload.write_mooncake(reqs, "swebench.jsonl")
    ids = workload.to_token_ids(reqs[0], vocab=32000)      # what to send to the server

Everything here is pure Python + numpy, deterministic for a given seed, and fast (4000 requests in
well under a second).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "BLOCK_TOKENS",
    "ORDERS",
    "Request",
    "generate_swebench",
    "arrival_times",
    "reorder",
    "scale_rate",
    "read_mooncake",
    "write_mooncake",
    "to_token_ids",
    "prefix_hits",
    "infer_sessions",
    "summarize",
    "format_summary",
]

BLOCK_TOKENS = 512  # tokens per Mooncake hash block
ORDERS = ("cache-friendly", "random", "round-robin")  # session interleaving orders (the paper's O6)
MAX_CV = 8.0  # burstiness ceiling: the paper's stress point (Fig. 14)

# Shape of the generated sessions, as shares of mean_input; the tool-output growth per turn is then
# solved so that the mean prompt length comes out at mean_input exactly (up to rounding).
CONTEXT_SHARE = 0.2  # repository context (system prompt, repo map, instructions), block-aligned
ISSUE_SHARE = 0.05  # mean issue text of a session's first turn
REPOS = 12  # SWE-bench's 12 Python repositories
TURNS_SIGMA = 0.6  # lognormal spread of turns per session
OUTPUT_SIGMA = 0.7  # lognormal spread of output lengths
TOOL_SIGMA = 1.0  # lognormal spread of tool outputs (file views are long, command outputs short)
DEFAULT_VOCAB = 32000  # token ids stay below every common model's vocabulary
FIRST_TOKEN = 100  # skip low ids, where some tokenizers keep control tokens

_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment


@dataclass(frozen=True)
class Request:
    """One request of a workload, in the Mooncake trace format plus its session.

    Attributes:
        timestamp: arrival time in milliseconds from the start of the workload.
        input_length: prompt length in tokens.
        output_length: tokens to generate.
        hash_ids: one id per ``BLOCK_TOKENS``-token block of the prompt (the last may be partial);
            equal ids at the same position mean the same prefix up to and including that block.
        session_id: the session (agent run, conversation) the request belongs to, or None when the
            trace does not say (see :func:`infer_sessions`).
        turn: the request's position within its session (0 = first), or None.
    """

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: int | None = None
    turn: int | None = None

    @property
    def arrival_s(self) -> float:
        """Arrival time in seconds from the start."""
        return self.timestamp / 1000.0

    def to_dict(self) -> dict:
        """The Mooncake JSON object, with ``session_id``/``turn`` when known (readers ignore extras)."""
        d = {
            "timestamp": _json_number(self.timestamp),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id is not None:
            d["session_id"] = self.session_id
        if self.turn is not None:
            d["turn"] = self.turn
        return d


def _json_number(x: float):
    return int(x) if float(x).is_integer() else round(float(x), 3)


# ------------------------------------------------------------------------------------------ arrivals
def arrival_times(n: int, rate: float, cv: float = 1.0, rng: np.random.Generator | int | None = 0) -> np.ndarray:
    """Arrival times in ms (first at 0) with mean rate ``rate`` req/s and inter-arrival CV ``cv``.

    Inter-arrival gaps are gamma distributed with shape ``1/cv**2`` (``cv=1``: exponential, i.e.
    Poisson arrivals; ``cv>1``: bursty; ``cv=0``: evenly spaced). The gaps are then scaled so that
    their mean is exactly ``1/rate``: the workload lasts ``(n-1)/rate`` seconds whatever the draw.

    Args:
        n: number of arrivals.
        rate: mean arrival rate, requests per second (> 0).
        cv: coefficient of variation of the gaps, 0 to ``MAX_CV``.
        rng: a numpy Generator or a seed.

    Returns:
        float64 array of ``n`` non-decreasing times in milliseconds.

    Raises:
        ValueError: on a non-positive rate or a cv outside [0, MAX_CV].
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate}")
    if not 0 <= cv <= MAX_CV:
        raise ValueError(f"cv (burstiness) must be within [0, {MAX_CV}], got {cv}")
    rng = np.random.default_rng(rng)
    if n <= 1:
        return np.zeros(max(n, 0))
    if cv == 0:
        gaps = np.ones(n - 1)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / shape, size=n - 1)
        if gaps.sum() <= 0:  # only possible for absurdly small shapes: fall back to one burst
            gaps = np.ones(n - 1)
    gaps *= (n - 1) / (rate * gaps.sum())
    return np.concatenate(([0.0], np.cumsum(gaps))) * 1000.0


# -------------------------------------------------------------------------------------- session order
def _slot_sessions(counts: Sequence[int], order: str, rng: np.random.Generator) -> list[int]:
    """Which session (index into ``counts``) takes each arrival slot, turn order kept per session.

    ``cache-friendly``: each session's turns back to back, sessions one after another (consecutive
    turns of a session arrive close together; the shortest reuse distances). ``random``: whole
    sessions interleaved at random (concurrent multi-session serving). ``round-robin``: every session
    gets one turn per round (the longest reuse distances).
    """
    if order == "cache-friendly":
        return [s for s, c in enumerate(counts) for _ in range(c)]
    if order == "random":
        slots = np.repeat(np.arange(len(counts)), counts)
        rng.shuffle(slots)
        return slots.tolist()
    if order == "round-robin":
        out = []
        for k in range(max(counts, default=0)):
            out.extend(s for s, c in enumerate(counts) if c > k)
        return out
    raise ValueError(f"unknown order {order!r}: choose one of {', '.join(ORDERS)}")


def reorder(requests: Sequence[Request], order: str, seed: int = 0) -> list[Request]:
    """Re-interleave sessions: keep the arrival times, change which request takes each of them.

    Requests are grouped by ``session_id`` (a request without one is a session of its own), each
    session keeps its turn order, and sessions are interleaved as ``order`` says (see ``ORDERS``;
    ``"recorded"`` returns the requests unchanged). For ``cache-friendly``, sessions follow the
    order of their first arrival.

    Returns:
        A new list in arrival order with the original sorted timestamps.
    """
    if order in ("recorded", "as-recorded"):
        return list(requests)
    ordered = sorted(requests, key=lambda r: r.timestamp)
    groups: dict = {}
    for i, r in enumerate(ordered):
        key = ("s", r.session_id) if r.session_id is not None else ("r", i)
        groups.setdefault(key, []).append(r)
    sessions = list(groups.values())  # dict order = first arrival
    slots = _slot_sessions([len(g) for g in sessions], order, np.random.default_rng(seed))
    cursor = [0] * len(sessions)
    out = []
    for t, s in zip((r.timestamp for r in ordered), slots):
        out.append(replace(sessions[s][cursor[s]], timestamp=t))
        cursor[s] += 1
    return out


def scale_rate(requests: Sequence[Request], factor: float) -> list[Request]:
    """Speed arrivals up (``factor > 1``) or slow them down, keeping their order (the paper's rate factor)."""
    if not factor > 0:
        raise ValueError(f"rate factor must be > 0, got {factor}")
    return [replace(r, timestamp=r.timestamp / factor) for r in requests]


# ----------------------------------------------------------------------------------------- generator
@dataclass
class _Shape:
    """Lengths of every turn of every session, before block ids are assigned."""

    repo: np.ndarray  # per session
    context: int  # repository context, tokens (multiple of the block size)
    lengths: list[np.ndarray]  # per session: prompt length per turn
    outputs: list[np.ndarray]  # per session: output length per turn


def _lognormal(rng, mean: float, sigma: float, size) -> np.ndarray:
    return rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, size)


def _draw_shape(rng, sessions, requests, mean_input, mean_output, context, repos, max_input) -> _Shape:
    weights = _lognormal(rng, 1.0, TURNS_SIGMA, sessions)
    counts = 1 + rng.multinomial(requests - sessions, weights / weights.sum())
    zipf = 1.0 / np.arange(1, repos + 1)  # a few repositories dominate, as in SWE-bench (django, sympy)
    repo = rng.choice(repos, size=sessions, p=zipf / zipf.sum())
    issue = _lognormal(rng, max(ISSUE_SHARE * mean_input, 1.0), 0.5, sessions)
    outputs, tools = [], []
    for c in counts:
        o = _lognormal(rng, 1.0, OUTPUT_SIGMA, c)
        outputs.append(o)
        tools.append(_lognormal(rng, 1.0, TOOL_SIGMA, c))
    o_all = np.concatenate(outputs)
    o_scale = mean_output / o_all.mean()
    outputs = [np.maximum(1, np.rint(o * o_scale)).astype(np.int64) for o in outputs]

    # mean prompt = A + g * B, with g the tool-output tokens per unit draw: solve for g.
    grown_out = [np.concatenate(([0], np.cumsum(o[:-1]))) for o in outputs]
    grown_tool = [np.concatenate(([0.0], np.cumsum(t[:-1]))) for t in tools]
    base = np.concatenate([context + issue[s] + grown_out[s] for s in range(sessions)])
    unit = np.concatenate(grown_tool)
    g = (mean_input - base.mean()) / unit.mean() if unit.mean() > 0 else -1.0
    if g < 0:  # single-turn sessions, or outputs alone outgrow mean_input: carry it on the issue text
        g = 0.0
        first = np.concatenate([[issue[s]] * len(grown_out[s]) for s in range(sessions)])
        rest = base - first
        need = mean_input - rest.mean()
        if need <= 0:
            raise ValueError(
                f"mean_input={mean_input} is too small for mean_output={mean_output} over "
                f"{requests / sessions:.1f} turns per session: raise mean_input or lower mean_output"
            )
        issue = issue * (need / first.mean())
    lengths = []
    for s in range(sessions):
        tool_tokens = np.rint(g * tools[s][:-1]).astype(np.int64)
        steps = outputs[s][:-1] + tool_tokens
        first = context + max(1, int(round(issue[s])))
        ls = first + np.concatenate(([0], np.cumsum(steps)))
        if max_input is not None:
            ls = np.minimum(ls, max_input)
        lengths.append(ls.astype(np.int64))
    return _Shape(repo=repo, context=context, lengths=lengths, outputs=outputs)


def _kept_blocks(prev_len: int, f: float, block: int) -> int:
    """Blocks of the previous prompt a diluted turn keeps (f=1: all, including a partial block)."""
    if f >= 1.0:
        return -(-prev_len // block)
    return int(f * prev_len) // block


def _hits_for(shape: _Shape, first_of_repo: np.ndarray, f: float, block: int) -> tuple[int, int]:
    """(reused prompt tokens, total prompt tokens) for dilution factor f, from lengths alone."""
    ctx_kept = _kept_blocks(shape.context, f, block) * block
    hit = total = 0
    for s, ls in enumerate(shape.lengths):
        total += int(ls.sum())
        if not first_of_repo[s]:
            hit += min(ctx_kept, int(ls[0]))
        for k in range(1, len(ls)):
            prev = int(ls[k - 1])
            hit += prev if f >= 1.0 else min(prev, _kept_blocks(prev, f, block) * block)
    return hit, total


def _solve_dilution(shape, first_of_repo, reuse: float, block: int) -> float:
    hit, total = _hits_for(shape, first_of_repo, 1.0, block)
    natural = hit / total
    if reuse > natural + 1e-9:
        raise ValueError(
            f"reuse={reuse:.3f} is above what this workload reaches without dilution ({natural:.3f}); "
            "lower it, or leave it unset for the natural share"
        )
    lo, hi = 0.0, 1.0
    for _ in range(40):  # bisection on a monotone step function: 40 halvings is below one token
        mid = (lo + hi) / 2
        h, _ = _hits_for(shape, first_of_repo, mid, block)
        if h / total < reuse:
            lo = mid
        else:
            hi = mid
    return hi


def generate_swebench(
    sessions: int = 130,
    requests: int = 4000,
    mean_input: float = 19000,
    mean_output: float = 95,
    rate: float = 1.25,
    cv: float = 1.0,
    order: str = "random",
    reuse: float | None = None,
    seed: int = 0,
    *,
    repos: int = REPOS,
    context_tokens: int | None = None,
    max_input: int | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> list[Request]:
    """Generate a SWE-bench-agentic-like workload of coding-agent sessions (see the module docstring).

    Args:
        sessions: number of agent sessions (each at least one request).
        requests: total number of requests (>= sessions); turns per session vary (lognormal).
        mean_input: mean prompt length in tokens; the per-turn tool output is solved to meet it.
        mean_output: mean output length in tokens (lognormal, at least 1).
        rate: mean arrival rate, requests per second.
        cv: coefficient of variation of inter-arrival gaps: 1 = Poisson, up to 8 = very bursty.
        order: how sessions interleave: ``"random"`` (default; whole sessions interleaved at random,
            turn order kept, as in concurrent multi-session serving), ``"cache-friendly"`` (each
            session's turns back to back) or ``"round-robin"``.
        reuse: target share of prompt tokens that repeat a prefix seen by an earlier request
            (``None``: the natural share of growing sessions, about 0.95 with the defaults). Lower
            values dilute it the way the paper's Fig. 15 does: each turn keeps only the leading
            part of the previous prompt and the rest of its prompt is new.
        seed: everything (lengths, sessions, arrivals, order) is a function of the seed.
        repos: repositories sessions are spread over (a repository's context is shared).
        context_tokens: repository context length (rounded down to whole blocks); default
            ``CONTEXT_SHARE * mean_input``.
        max_input: cap on prompt length (a model's context limit); capped prompts stay prefixes.
        block_tokens: tokens per hash block (Mooncake: 512).

    Returns:
        Requests in arrival order; ``hash_ids`` renumbered in order of first appearance.

    Raises:
        ValueError: on inconsistent parameters (requests < sessions, unknown order, reuse out of
            reach, mean_input too small for the outputs, rate/cv out of range).
    """
    if sessions < 1 or requests < sessions:
        raise ValueError(f"need 1 <= sessions <= requests, got sessions={sessions}, requests={requests}")
    if mean_input < 1 or mean_output < 1:
        raise ValueError(f"mean_input and mean_output must be >= 1 token, got {mean_input}, {mean_output}")
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}: choose one of {', '.join(ORDERS)}")
    if reuse is not None and not 0.0 <= reuse <= 1.0:
        raise ValueError(f"reuse is a share of prompt tokens, within [0, 1]; got {reuse}")
    if max_input is not None and max_input < block_tokens:
        raise ValueError(f"max_input must be at least one block ({block_tokens} tokens), got {max_input}")
    rng = np.random.default_rng(seed)
    if context_tokens is None:
        context_tokens = CONTEXT_SHARE * mean_input
    context = int(context_tokens) // block_tokens * block_tokens
    if max_input is not None:
        context = min(context, (max_input - 1) // block_tokens * block_tokens)
    shape = _draw_shape(rng, sessions, requests, mean_input, mean_output, context, repos, max_input)
    times = arrival_times(requests, rate, cv, rng)
    counts = [len(ls) for ls in shape.lengths]
    slots = _slot_sessions(counts, order, rng)

    first_of_repo = np.zeros(sessions, dtype=bool)
    seen_repo: set = set()
    for s in dict.fromkeys(slots):  # sessions by first arrival
        if shape.repo[s] not in seen_repo:
            seen_repo.add(shape.repo[s])
            first_of_repo[s] = True
    f = 1.0 if reuse is None else _solve_dilution(shape, first_of_repo, reuse, block_tokens)

    # Block ids: ("c", repo, j) for the repository context, fresh integers for each stream's own blocks.
    fresh = iter(range(1 << 62))
    ctx_blocks = context // block_tokens
    ctx_kept = ctx_blocks if f >= 1.0 else _kept_blocks(context, f, block_tokens)
    per_session: list[list[tuple]] = []
    for s, ls in enumerate(shape.lengths):
        shared = [("c", int(shape.repo[s]), j) for j in range(ctx_kept)]
        stream = shared + [next(fresh) for _ in range(ctx_blocks - ctx_kept)]
        turns = []
        for k, length in enumerate(ls):
            if k > 0 and f < 1.0:
                keep = _kept_blocks(int(ls[k - 1]), f, block_tokens)
                stream = stream[:keep]
            need = -(-int(length) // block_tokens)
            while len(stream) < need:
                stream.append(next(fresh))
            turns.append(tuple(stream[:need]))
        per_session.append(turns)

    numbering: dict = {}
    cursor = [0] * sessions
    out = []
    for t, s in zip(times, slots):
        k = cursor[s]
        cursor[s] += 1
        ids = tuple(numbering.setdefault(b, len(numbering)) for b in per_session[s][k])
        out.append(Request(round(float(t), 3), int(shape.lengths[s][k]), int(shape.outputs[s][k]), ids, s, k))
    return out


# ----------------------------------------------------------------------------------------- file format
def read_mooncake(path: str | os.PathLike, limit: int | None = None, block_tokens: int = BLOCK_TOKENS) -> list[Request]:
    """Read a Mooncake-format JSONL trace (one request per line).

    Required keys per line: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.
    Optional: ``session_id``, ``turn`` (written by :func:`write_mooncake`). Blank lines are skipped.

    Args:
        path: the ``.jsonl`` file.
        limit: read at most this many requests (the first ones).
        block_tokens: tokens per hash block, used to check ``len(hash_ids) == ceil(input_length/block)``.

    Raises:
        ValueError: naming the file and line of a malformed or inconsistent request.
    """
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                req = Request(
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                    None if d.get("session_id") is None else int(d["session_id"]),
                    None if d.get("turn") is None else int(d["turn"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake request ({type(e).__name__}: {e})") from None
            if len(req.hash_ids) != -(-req.input_length // block_tokens):
                raise ValueError(
                    f"{path}:{lineno}: {len(req.hash_ids)} hash_ids for input_length {req.input_length} "
                    f"(expected ceil({req.input_length}/{block_tokens}))"
                )
            out.append(req)
    return out


def write_mooncake(requests: Iterable[Request], path: str | os.PathLike) -> None:
    """Write requests as a Mooncake-format JSONL trace (with ``session_id``/``turn`` when known)."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(json.dumps(r.to_dict(), separators=(", ", ": ")))
            fh.write("\n")


# ------------------------------------------------------------------------------------------ token ids
def _splitmix64(x: np.ndarray) -> np.ndarray:
    # Counter-based, so token ids depend only on (seed, block id, position): no generator state,
    # stable across numpy versions (np.random streams are not guaranteed to be).
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def to_token_ids(
    request: Request,
    block_tokens: int = BLOCK_TOKENS,
    vocab: int = DEFAULT_VOCAB,
    *,
    seed: int = 0,
    first_token: int = FIRST_TOKEN,
) -> list[int]:
    """The prompt's token ids, a deterministic function of its ``hash_ids``.

    Block ``h`` always expands to the same ``block_tokens`` tokens and a partial last block to the
    leading part of them, so two requests whose ``hash_ids`` share a leading run share exactly that
    many leading tokens (and therefore the server's page hashes and cached KV).

    Args:
        request: the request (only ``hash_ids`` and ``input_length`` are used).
        block_tokens: tokens per hash block.
        vocab: token ids are drawn from ``[first_token, vocab)``; keep ``vocab`` at or below the
            model's vocabulary size.
        seed: a different seed gives disjoint content for the same ids (e.g. two runs that must
            not share cache).
        first_token: lowest id used (skips ids that some tokenizers reserve for control tokens).

    Returns:
        ``input_length`` ints.

    Raises:
        ValueError: when ``hash_ids`` cannot cover ``input_length`` or the id range is empty.
    """
    n = len(request.hash_ids)
    if request.input_length > n * block_tokens:
        raise ValueError(f"{n} blocks of {block_tokens} cannot hold input_length {request.input_length}")
    if vocab <= first_token:
        raise ValueError(f"vocab ({vocab}) must be above first_token ({first_token})")
    with np.errstate(over="ignore"):
        ids = np.asarray(request.hash_ids, dtype=np.uint64)
        base = _splitmix64(ids ^ _splitmix64(np.full(n, seed, dtype=np.uint64)))
        x = _splitmix64(base[:, None] + np.arange(block_tokens, dtype=np.uint64)[None, :])
    tokens = first_token + (x.reshape(-1)[: request.input_length] % np.uint64(vocab - first_token)).astype(np.int64)
    return tokens.tolist()


# ------------------------------------------------------------------------------------------- analysis
def prefix_hits(requests: Sequence[Request], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Per request (in list order), the prompt tokens already seen as a prefix by an earlier request.

    A block counts when its id was seen before, for at most as many tokens as it had then; the run
    stops at the first new block (ids are prefix-chained, so a later match would be a coincidence).
    This is the reuse an unbounded cache would get: ``sum(hits) / sum(input_length)`` is the
    workload's prefix reuse share.
    """
    seen: dict[int, int] = {}  # block id -> most tokens of it seen so far
    hits = []
    for r in requests:
        n = len(r.hash_ids)
        hit, run = 0, True
        for j, h in enumerate(r.hash_ids):
            size = block_tokens if j < n - 1 else r.input_length - block_tokens * (n - 1)
            had = seen.get(h, 0)
            if run:
                hit += min(size, had)
                run = had >= size
            if size > had:
                seen[h] = size
        hits.append(hit)
    return hits


def infer_sessions(requests: Sequence[Request], min_share: float = 0.5) -> list[Request]:
    """Assign session ids to a trace that has none, from shared prefixes.

    A request continues the session of the latest earlier request with which it shares the longest
    leading run of ``hash_ids``, when that run covers at least ``min_share`` of that earlier
    request's blocks (a prompt that mostly extends an earlier one is its next turn); otherwise it
    starts a new session. Requests that already have a session id keep it. O(total blocks).

    Returns:
        New requests with ``session_id`` and ``turn`` set, in the same order.
    """
    root: dict = {}  # trie: block id -> [children, latest request index through this node]
    session_of: list[int] = []
    turns: dict[int, int] = {}
    next_session = max((r.session_id for r in requests if r.session_id is not None), default=-1) + 1
    out = []
    for i, r in enumerate(requests):
        node, depth, best = root, 0, None
        for h in r.hash_ids:
            child = node.get(h)
            if child is None:
                break
            depth += 1
            best = child[1]
            node = child[0]
        if r.session_id is not None:
            sid = r.session_id
        elif best is not None and depth >= min_share * len(requests[best].hash_ids):
            sid = session_of[best]
        else:
            sid, next_session = next_session, next_session + 1
        session_of.append(sid)
        node = root
        for h in r.hash_ids:
            child = node.setdefault(h, [{}, i])
            child[1] = i
            node = child[0]
        turn = turns.get(sid, 0)
        turns[sid] = turn + 1
        out.append(replace(r, session_id=sid, turn=r.turn if r.turn is not None else turn))
    return out


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else 0.0


def summarize(requests: Sequence[Request], block_tokens: int = BLOCK_TOKENS) -> dict:
    """Statistics of a workload: counts, lengths, arrival rate and burstiness, prefix reuse.

    Returns:
        A JSON-ready dict: ``requests``, ``sessions`` (distinct known session ids),
        ``turns_mean``/``turns_max``, ``duration_s``, ``rate`` (req/s over the span),
        ``cv`` (of inter-arrival gaps), ``input`` and ``output`` (mean, p50, p90, max),
        ``input_tokens``, ``reuse`` (share of prompt tokens hitting an earlier prefix),
        ``unique_blocks``.
    """
    n = len(requests)
    ts = np.array(sorted(r.timestamp for r in requests), dtype=float) / 1000.0
    gaps = np.diff(ts)
    inp = np.array([r.input_length for r in requests], dtype=float)
    outp = np.array([r.output_length for r in requests], dtype=float)
    per_session: dict = {}
    for r in requests:
        if r.session_id is not None:
            per_session[r.session_id] = per_session.get(r.session_id, 0) + 1
    duration = float(ts[-1] - ts[0]) if n > 1 else 0.0
    hits = prefix_hits(requests, block_tokens)

    def dist(a):
        return {"mean": float(a.mean()) if n else 0.0, "p50": _pct(a, 50), "p90": _pct(a, 90),
                "max": float(a.max()) if n else 0.0}

    return {
        "requests": n,
        "sessions": len(per_session),
        "turns_mean": float(np.mean(list(per_session.values()))) if per_session else 0.0,
        "turns_max": max(per_session.values(), default=0),
        "duration_s": duration,
        "rate": (n - 1) / duration if duration > 0 else None,  # None: every request at once (offline)
        "cv": float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else 0.0,
        "input": dist(inp),
        "output": dist(outp),
        "input_tokens": int(inp.sum()),
        "reuse": float(sum(hits) / inp.sum()) if n and inp.sum() > 0 else 0.0,
        "unique_blocks": len({h for r in requests for h in r.hash_ids}),
    }


def format_summary(s: dict) -> str:
    """A few human-readable lines for :func:`summarize`'s dict."""
    return "\n".join([
        (f"  requests      {s['requests']}  in {s['sessions']} sessions "
         f"({s['turns_mean']:.1f} turns on average, at most {s['turns_max']})"
         if s["sessions"] else f"  requests      {s['requests']}  (no session ids in the trace)"),
        (f"  arrivals      {s['rate']:.3f} req/s over {s['duration_s']:.0f} s, inter-arrival CV {s['cv']:.2f}"
         if s["rate"] is not None else "  arrivals      all at once (offline batch)"),
        f"  input tokens  mean {s['input']['mean']:.0f}  p50 {s['input']['p50']:.0f}  "
        f"p90 {s['input']['p90']:.0f}  max {s['input']['max']:.0f}  (total {s['input_tokens']:,})",
        f"  output tokens mean {s['output']['mean']:.1f}  p50 {s['output']['p50']:.0f}  p90 {s['output']['p90']:.0f}",
        f"  prefix reuse  {100 * s['reuse']:.1f}% of prompt tokens repeat an earlier prefix "
        f"({s['unique_blocks']:,} unique 512-token blocks)",
    ])
