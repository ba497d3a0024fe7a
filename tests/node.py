"""Another engine in a child process (``python node.py``, driven by helpers.Node): another node of a
shared file system on its own mount, another server of the namespace on the same tiers, or an engine of
another version (test_versions.py: PYTHONPATH names that version's tree). It runs the commands the test
sends, one JSON list per line on stdin, answering one JSON object per line on stdout. It uses kvstream's
public API only and imports nothing of the tests but pagebytes.py (helpers.py imports modules an older
tree lacks); pages are the reliability suite's (``content(key)``; ``version`` v stores another writer's
bytes, ``twin_content(key, v)``), put and got through 4096-aligned memory in K and V halves.

Commands: ``["open", [tiers...], {settings}]``, ``["put", salt, start, n, version]`` (-> stored),
``["get", salt, start, n, version]`` (-> found, and whether each found page holds that version's
bytes), ``["delete", salt, start, n]`` (-> held), ``["clear"]``, ``["check", fix]``, ``["stats"]``,
``["close"]``, ``["where"]`` (-> the kvstream_hicache file imported).
"""
from __future__ import annotations

import json
import mmap
import sys

import numpy as np
from pagebytes import CHUNK, NS_FIELDS, PAGE_BYTES, content, key, twin_content

from kvstream_hicache import Config, Engine, Namespace


def data(k: str, version: int) -> bytes:
    return twin_content(k, version) if version else content(k)


def memory(payload: bytes | None = None) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One page of 4096-aligned caller memory (holding ``payload``), and its K and V segments."""
    array = np.frombuffer(mmap.mmap(-1, PAGE_BYTES), dtype=np.uint8)
    if payload is not None:
        array[:] = np.frombuffer(payload, dtype=np.uint8)
    base, half = array.ctypes.data, PAGE_BYTES // 2
    return array, [(base, half), (base + half, PAGE_BYTES - half)]


def run(engine: Engine | None, cmd: str, args: list) -> tuple[Engine | None, dict]:
    if cmd == "open":
        settings = {"tiers": list(args[0]), "io_engine": "auto", "chunk": CHUNK, **args[1]}
        engine = Engine(Config.from_sources(settings, environ={}), Namespace(NS_FIELDS))
        assert engine.wait_scan(120.0), "the start-up scan did not finish in 120 s"  # (it runs in the background)
        return engine, {"pages": len(engine.index)}
    if cmd in ("put", "get", "delete"):
        salt, start, n, *version = args
        keys = [key(i, salt) for i in range(start, start + n)]
        if cmd == "delete":
            return engine, {"held": engine.delete(keys)}
        pages = [memory(data(k, version[0]) if cmd == "put" else None) for k in keys]
        if cmd == "put":
            return engine, {"stored": engine.put(keys, [segments for _, segments in pages])}
        found = engine.get(keys, [segments for _, segments in pages])
        return engine, {"found": found, "exact": [ok and array.tobytes() == data(k, version[0])
                                                  for k, ok, (array, _) in zip(keys, found, pages)]}
    if cmd == "clear":
        engine.clear()
        return engine, {}
    if cmd == "check":
        return engine, {"problems": [f"{p.kind} {p.path} {p.detail}" for p in engine.check(fix=args[0])]}
    if cmd == "stats":
        tiers = engine.stats()["tiers"]
        return engine, {"tiers": [{k: t.get(k) for k in ("healthy", "failures", "pages", "last_error")} for t in tiers]}
    if cmd == "close":
        engine.close()
        return engine, {}
    if cmd == "where":
        import kvstream_hicache
        return engine, {"file": kvstream_hicache.__file__}
    return engine, {"error": f"unknown command {cmd!r}"}


def main() -> int:
    engine = None
    for line in sys.stdin:
        cmd, *args = json.loads(line)
        try:
            engine, out = run(engine, cmd, args)
        except Exception as exc:  # reported to the test, which fails on it
            out = {"error": repr(exc)}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
