"""The engine's facade is closed: adapters and tools call Engine's methods, never its parts."""
from __future__ import annotations

import ctypes
import os
import re

from kvstream_hicache.config import Config
from kvstream_hicache.engine import Engine
from kvstream_hicache.layout import Namespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE_THE_CORE = ["kvstream_hicache/sglang", "kvstream_hicache/lmcache", "kvstream_hicache/tools", "scripts",
                    "benchmarks", "examples"]
# an engine's parts (index, tiers, read and write paths, ...) or a tier's file operations
REACH = re.compile(r"engine\.(index|tiers|priority|_\w+)\b|\.(unlink_page|open_page|create_tmp)\(")


def test_nothing_outside_the_core_reaches_into_an_engine():
    found = []
    for top in OUTSIDE_THE_CORE:
        for folder, _dirs, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        if REACH.search(line):
                            found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not found, "use Engine's methods (pin/unpin/delete/...):\n" + "\n".join(found)


def _engine(tier_dirs) -> Engine:
    config = Config.from_sources({"tiers": tier_dirs[:2], "chunk": "4K"}, environ={})
    return Engine(config, Namespace({"model": "facade"}))


def test_delete_removes_every_copy_and_pin_holds_pages(tier_dirs):
    buf = bytearray(os.urandom(3 * 4096))
    address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    pages = [[(address + 4096 * i, 4096)] for i in range(3)]
    keys = ["a", "b", "c"]
    with _engine(tier_dirs) as engine:
        assert engine.put(keys, pages) == [True] * 3
        handles = engine.pin(keys + ["missing"])
        assert handles[-1] is None and all(h is not None for h in handles[:3])
        engine.unpin(handles)
        assert engine.delete(["a", "missing"]) == 1
        assert not engine.contains("a") and engine.contains("b")
        assert not any(os.path.exists(tier.layout.page_path("a")) for tier in engine.tiers)
        assert all(os.path.exists(tier.layout.page_path("b")) for tier in engine.tiers)
        assert engine.check() == []



def test_one_fork_detector():
    """_uring/ring.pxi counts fork()s; io.py's ThreadRing and engine.py's Engine ask it (io.forks)."""
    hooks = []
    for folder in ("kvstream_hicache", "_uring"):
        for path, _dirs, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if name.endswith((".py", ".pxi", ".pyx")):
                    with open(os.path.join(path, name), encoding="utf-8") as f:
                        if "register_at_fork" in f.read():
                            hooks.append(os.path.relpath(os.path.join(path, name), ROOT))
    assert hooks == ["_uring/ring.pxi"]
