"""Another node of a shared file system, as a child process (``python dfs_node.py``): it opens an
engine on its own mount of the shared tier and runs the commands the test sends, one JSON list per
line on stdin, answering one JSON object per line on stdout. Pages are the reliability suite's
(``content(key)``; ``version`` 1 stores another writer's bytes, ``twin_content(key, 1)``).

Commands: ``["open", [tiers...], {settings}]``, ``["put", salt, start, n, version]``,
``["get", salt, start, n, version]`` (-> found, and whether each found page holds that version's
bytes), ``["delete", salt, start, n]`` (-> held), ``["clear"]``, ``["stats"]``, ``["close"]``.
"""
from __future__ import annotations

import json
import sys

from helpers import PAGE_BYTES, PageSet, make_engine, twin_content


def pages(salt: str, version: int) -> PageSet:
    return PageSet(PAGE_BYTES, salt=salt, data=(lambda k: twin_content(k, 1)) if version else None)


def main() -> int:
    engine = None
    for line in sys.stdin:
        cmd, *args = json.loads(line)
        try:
            if cmd == "open":
                engine = make_engine(args[0], **args[1])
                assert engine.wait_scan(60.0), "the start-up scan did not finish in 60 s"  # it runs in the background
                out = {"pages": len(engine.index)}
            elif cmd == "put":
                salt, start, n, version = args
                ps = pages(salt, version)
                out = {"stored": ps.put(engine, ps.keys(n, start))}
            elif cmd == "get":
                salt, start, n, version = args
                ps = pages(salt, version)
                keys = ps.keys(n, start)
                found, got = ps.get(engine, keys)
                out = {"found": found, "exact": [ok and data == ps.data(k) for k, ok, data in zip(keys, found, got)]}
            elif cmd == "delete":
                salt, start, n = args
                out = {"held": engine.delete(PageSet(salt=salt).keys(n, start))}
            elif cmd == "clear":
                engine.clear()
                out = {}
            elif cmd == "stats":
                st = engine.stats()
                out = {"tiers": [{k: t[k] for k in ("healthy", "failures", "pages", "last_error")} for t in st["tiers"]]}
            elif cmd == "close":
                engine.close()
                out = {}
            else:
                out = {"error": f"unknown command {cmd!r}"}
        except Exception as exc:  # reported to the test, which fails on it
            out = {"error": repr(exc)}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
