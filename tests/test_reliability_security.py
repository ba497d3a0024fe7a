"""Security: keys cannot name a path outside their tier; files and directories are private to the
user by default (0600 / 0700, whatever the umask), group-shared with file_mode=shared (0660 /
2770); and the namespace digest keeps one model's pages from ever being served to another model,
layout, dtype, page geometry or rank.
"""
from __future__ import annotations

import os
import stat
import threading

import pytest

from kvstream_hicache import InvalidKeyError, Namespace, check_tiers, validate_key
from kvstream_hicache.integrity import PageHeader, pack_header
from kvstream_hicache.faults import Fault
from kvstream_hicache.io import OP_WRITE, AlignedBuffer
from kvstream_hicache.layout import HEADER_SIZE, KEY_MAX

from helpers import NS, PageSet, TierFaultPlan, content, key, make_engine, wait_for_fault

HOSTILE = ["../x", "../../etc/passwd", "/abs", "/etc/passwd", "a/b", "a\x00b", "\x00", "x" * (KEY_MAX + 1),
           "", ".", "..", "a.b", "a b", "ké", "a\nb", "~", "$HOME", "*", None, 123, b"ab"]


def _tree(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}


def test_hostile_keys_are_refused_everywhere(tier_root):
    pages = PageSet()
    good = pages.keys(2) + ["A" * KEY_MAX, "sglang_page-0"]
    # Tiers two levels below the walked root, so a key escaping up to two levels ("../../x") would
    # still land where the walk sees it; walking only our own root keeps other processes out of it.
    tiers = [os.path.join(tier_root, "n", f"tier{i}") for i in range(2)]
    for d in tiers:
        os.makedirs(d)
    before = _tree(tier_root)
    with make_engine(tiers) as engine:
        batch = good[:1] + HOSTILE + good[1:]
        assert pages.put(engine, [str(k) if isinstance(k, bytes) else k for k in batch]) == \
            [True] + [False] * len(HOSTILE) + [True] * 3
        assert engine.stats()["invalid_keys"] == len(HOSTILE)
        found = pages.checked_get(engine, batch)
        assert found == [True] + [False] * len(HOSTILE) + [True] * 3
        assert not any(engine.contains(k) for k in HOSTILE)
        assert engine.prefix_len(good[:1] + HOSTILE[:1] + good[1:]) == 1
        assert engine.check() == []
    created = _tree(tier_root) - before
    digest_dir = os.path.join("kvstream", NS.digest)
    for path in created:  # only page files of the valid keys, each inside its tier's page tree
        rel = path.split(os.sep, 2)
        assert len(rel) == 3 and rel[1].startswith("tier") and rel[2].startswith(digest_dir), path
    assert len(created) == 2 * len(good)
    for k in HOSTILE:
        with pytest.raises(InvalidKeyError, match="invalid page key"):
            validate_key(k)
    assert all(validate_key(k) == k for k in good + [key(0)])


def test_a_header_naming_a_hostile_key_is_removed_at_start(tier_dirs):
    """A planted file whose header names '../../x' (valid file name, valid checksum): refused."""
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True, True]
        path = engine.tiers[0].layout.page_path(keys[1])
    buf = AlignedBuffer(HEADER_SIZE)
    pack_header(PageHeader("../../x", NS.digest, pages.size, 16 << 10, (0,) * 3), buf)
    with open(path, "r+b") as f:
        f.write(bytes(buf))
    with make_engine(tier_dirs[:1]) as engine:
        assert engine.scan["damaged_removed"] == 1 and not os.path.exists(path)
        assert pages.checked_get(engine, keys) == [True, False]
        assert engine.check() == []


@pytest.mark.parametrize("mode,file_bits,dir_bits", [("private", 0o600, 0o700), ("shared", 0o660, 0o2770)])
@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_file_and_directory_modes(tier_dirs, mode, file_bits, dir_bits, umask):
    old = os.umask(umask)
    plan = TierFaultPlan()
    try:
        pages = PageSet()
        with make_engine(tier_dirs[:1], file_mode=mode, fault_plan=plan) as engine:
            assert pages.put(engine, pages.keys(3)) == [True] * 3
            # a put in flight: its temporary files already have the final mode
            plan.on(tier_dirs[0], Fault.hold(), opcode=OP_WRITE)
            writer = threading.Thread(target=pages.put, args=(engine, pages.keys(1, 3)))
            writer.start()
            try:
                wait_for_fault(plan)
                tmp = engine.tiers[0].layout.tmp
                in_flight = [os.path.join(tmp, f) for f in os.listdir(tmp)]
                assert in_flight and all(stat.S_IMODE(os.stat(p).st_mode) == file_bits for p in in_flight)
            finally:  # never leave the writer held: close() would wait for it
                plan.clear()
                plan.release()
                writer.join(60)
            assert not writer.is_alive(), "the released writer did not finish"
        base = os.path.join(tier_dirs[0], "kvstream")
        dirs = [d for d, _, _ in os.walk(base)]
        files = [os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs]
        assert len(files) == 4 and len(dirs) >= 4  # kvstream, tmp, <digest>, shards
        assert {oct(stat.S_IMODE(os.stat(d).st_mode)) for d in dirs} == {oct(dir_bits)}
        assert {oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files} == {oct(file_bits)}
    finally:
        os.umask(old)


VARIANTS = {
    "model": {"model": "another-model"},
    "layout": {"layout": "layer_first"},
    "dtype": {"dtype": "fp8_e4m3"},
    "page_geometry": {"page": 32},
    "tp_rank": {"tp": [1, 2]},
    "tp_size": {"tp": [0, 2]},
    "pp_rank": {"pp": [1, 2]},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_namespace_keeps_models_layouts_dtypes_and_ranks_apart(tier_dirs, variant):
    other = Namespace({**NS.fields, **VARIANTS[variant]})
    assert other.digest != NS.digest
    mine = PageSet()
    theirs = PageSet(data=lambda k: content(k[::-1], mine.size))  # same keys, other bytes
    keys = mine.keys(4)
    with make_engine(tier_dirs[:2]) as engine:
        assert mine.put(engine, keys) == [True] * 4
    with make_engine(tier_dirs[:2], namespace=other) as engine:
        assert engine.scan["pages"] == 0 and engine.prefix_len(keys) == 0
        assert not any(engine.contains(k) for k in keys)
        assert theirs.checked_get(engine, keys) == [False] * 4  # a miss, never the other model's bytes
        assert theirs.put(engine, keys) == [True] * 4  # stored beside, not over, the first model's pages
        assert theirs.checked_get(engine, keys) == [True] * 4
    with make_engine(tier_dirs[:2]) as engine:
        assert mine.checked_get(engine, keys) == [True] * 4
        assert engine.check() == []
    assert check_tiers(engine.config) == []


def test_namespace_digest_is_canonical():
    a = Namespace({"model": "m", "tp": [0, 2], "dtype": "bf16"})
    assert a == Namespace({"dtype": "bf16", "tp": [0, 2], "model": "m"})  # field order does not matter
    assert a != Namespace({"model": "m", "tp": [1, 2], "dtype": "bf16"})
    assert a != Namespace({"model": "m", "tp": [0, 2], "dtype": "bf16", "extra": None})
