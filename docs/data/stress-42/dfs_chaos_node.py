"""Node B of the chaos tests (test_review_chaos.py): an engine on the other mount of the shared tier,
driven one JSON command per line on stdin, one JSON answer per line on stdout. Pages of any size:
``content(key, size)`` (version 0) or ``content(key + '/v1', size)`` (version 1, another writer's bytes).

Commands: ``["open", tiers, settings]``, ``["put", salt, size, idx, version]``, ``["get", salt, size, idx]``
(-> found, exact: the bytes are one whole version), ``["contains", salt, idx]``, ``["delete", salt, idx]``,
``["clear"]``, ``["stats"]``, ``["check", fix]``, ``["close"]``. Every answer carries ``s`` (seconds the
engine call took) and, where the engine raised, ``error`` (the traceback).
"""
from __future__ import annotations

import json
import sys
import time
import traceback

from helpers import content, get_items, key, make_engine, put_items


def data(k: str, size: int, version: int) -> bytes:
    return content(k if not version else k + "/v1", size)


def main() -> int:
    engine = None
    for line in sys.stdin:
        cmd, *args = json.loads(line)
        t0 = time.monotonic()
        try:
            if cmd == "open":
                engine = make_engine(args[0], **args[1])
                out = {"pages": len(engine.index)}
            elif cmd == "put":
                salt, size, idx, version = args
                keys = [key(i, salt) for i in idx]
                out = {"stored": put_items(engine, [(k, data(k, size, version), True) for k in keys])}
            elif cmd == "get":
                salt, size, idx = args
                keys = [key(i, salt) for i in idx]
                found, got = get_items(engine, [(k, size, True) for k in keys])
                out = {"found": found, "exact": [not ok or d in (data(k, size, 0), data(k, size, 1))
                                                 for k, ok, d in zip(keys, found, got)]}
            elif cmd == "contains":
                salt, idx = args
                out = {"held": [engine.contains(key(i, salt)) for i in idx]}
            elif cmd == "delete":
                salt, idx = args
                out = {"held": engine.delete([key(i, salt) for i in idx])}
            elif cmd == "clear":
                engine.clear()
                out = {}
            elif cmd == "stats":
                out = {"stats": engine.stats()}
            elif cmd == "check":
                out = {"problems": [repr(p) for p in engine.check(fix=args[0])]}
            elif cmd == "close":
                engine.close()
                out = {}
            else:
                out = {"error": f"unknown command {cmd!r}"}
        except BaseException:  # reported to the test, which fails on it
            out = {"error": traceback.format_exc()}
        out["s"] = time.monotonic() - t0
        print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
