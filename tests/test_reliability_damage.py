"""Damaged pages are never served wrong: a flipped payload bit, a damaged header, a truncated or
empty file, and valid page files of another model, another layout or another key placed under the
right name. Each is tried while the engine runs and across a restart, with a valid replica on the
other tier (served from it) and without one (a miss); the damaged copy is removed and counted.

What "never served" means precisely (docs/guarantees.md): no byte is returned unless it matches the
crc32c recorded when the page was written. A header damaged while the engine runs, over an intact
payload, still yields the right bytes (the read path verifies payload blocks against the checksums
in the index, not the header); the damaged header is found by check() and at the next start.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from kvstream_hicache import Namespace
from kvstream_hicache.layout import HEADER_SIZE
from kvstream_hicache.router import SingleTier

from helpers import (
    NS, PAGE_BYTES, PageSet, content, flip_byte, get_items, gone_or_restored, key, make_engine, messages, put_items,
)

N = 4
VICTIM = 1  # index of the damaged page


def _foreign(root: str, namespace: Namespace, k: str, pages: PageSet) -> str:
    """A valid page file of ``k`` written under ``namespace`` with other content (sglang's keys
    are token hashes: another model or layout stores other bytes under the same key)."""
    d = os.path.join(root, f"foreign-{namespace.digest[:8]}")
    os.makedirs(d, exist_ok=True)
    foreign = PageSet(pages.size, data=lambda key: content(key[::-1], pages.size))
    with make_engine([d], namespace=namespace) as engine:
        assert foreign.put(engine, [k]) == [True]
        return engine.tiers[0].layout.page_path(k)


def _replace(path: str, src: str) -> None:
    tmp = path + ".planted"
    shutil.copyfile(src, tmp)
    os.replace(tmp, path)


# kind -> (damage(path, ctx), detected while running without reading the header)
DAMAGE = {
    "payload_bit": (lambda path, ctx: flip_byte(path, HEADER_SIZE + ctx["size"] // 2), True),
    "header": (lambda path, ctx: flip_byte(path, 30), False),
    "truncated": (lambda path, ctx: os.truncate(path, HEADER_SIZE + 4096), True),
    "empty": (lambda path, ctx: os.truncate(path, 0), True),
    "other_model": (lambda path, ctx: _replace(path, ctx["other_model"]), True),
    "other_layout": (lambda path, ctx: _replace(path, ctx["other_layout"]), True),
    "other_key": (lambda path, ctx: _replace(path, ctx["other_key"]), True),
}


@pytest.mark.parametrize("replica", [True, False], ids=["replica", "single"])
@pytest.mark.parametrize("when", ["live", "restart"])
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_page_is_never_served(tier_dirs, tier_root, caplog, kind, when, replica):
    caplog.set_level(logging.WARNING, logger="kvstream")
    pages = PageSet(size=40 << 10, aligned=kind != "header")
    keys = pages.keys(N)
    victim = keys[VICTIM]
    dirs = tier_dirs[:2] if replica else tier_dirs[:1]
    ctx = {"size": pages.size}
    if kind.startswith("other_"):
        ctx["other_model"] = _foreign(tier_root, Namespace({**NS.fields, "model": "another-model"}), victim, pages)
        ctx["other_layout"] = _foreign(tier_root, Namespace({**NS.fields, "layout": "layer_first"}), victim, pages)
    damage, live_detected = DAMAGE[kind]

    engine = make_engine(dirs)
    path = engine.tiers[0].layout.page_path(victim)
    ctx["other_key"] = engine.tiers[0].layout.page_path(keys[0])
    try:
        assert pages.put(engine, keys) == [True] * N
        if when == "restart":
            engine.close()
            damage(path, ctx)
            engine = make_engine(dirs)
            assert engine.wait_scan(30)
            removed_at_start = engine.scan["damaged_removed"]
            assert removed_at_start == (0 if kind == "payload_bit" else 1)  # headers are checked at start
            if removed_at_start:  # (with a replica, background replication may have written it again)
                assert gone_or_restored(engine, 0, victim)
                assert any("removed 1 damaged" in m for m in messages(caplog))
        else:
            damage(path, ctx)
        detected = when == "restart" or live_detected

        # tier 0 first: the damaged copy is the one a read reaches
        found = pages.checked_get(engine, keys, policy=SingleTier(0))  # asserts every True is byte-exact
        want = [True] * N
        want[VICTIM] = replica or not detected  # a live header-only damage still has a verified payload
        assert found == want
        stats = engine.stats()
        if detected:
            # removed (and, with a replica, written again from it by background replication)
            assert gone_or_restored(engine, 0, victim), "the damaged copy is removed"
            assert engine.index.holders(victim) in ((0b10, 0b11) if replica else (0,))
            if not (when == "restart" and kind != "payload_bit"):  # else removed at start, never read
                assert stats["tiers"][0]["quarantined"] == 1 and stats["tiers"][0]["corrupted"] >= 1
                assert len(messages(caplog, victim, "damaged")) == 1
            assert not engine.contains(victim) or replica
        else:
            # found by the consistency check, which removes it with fix=True
            problems = engine.check()
            assert sorted((p.kind, p.path) for p in problems) == [("damaged", path), ("index_stale", path)]
            assert all(p.fixed for p in engine.check(fix=True))
            assert gone_or_restored(engine, 0, victim)  # (with a replica, catch-up may write it again)
        # again: the answer is stable, a replica is still served, never the damaged bytes
        found = pages.checked_get(engine, keys)
        assert found == [True] * N if replica else found[VICTIM] is False
        assert engine.check() == []
    finally:
        engine.close()


def test_damaged_on_every_replica_is_a_miss_then_rewritten(tier_dirs):
    """Both copies damaged: a miss (never wrong bytes), both removed; a new put stores it again."""
    pages = PageSet()
    keys = pages.keys(3)
    with make_engine(tier_dirs[:2]) as engine:
        assert pages.put(engine, keys) == [True] * 3
        for tier in engine.tiers:
            flip_byte(tier.layout.page_path(keys[0]), HEADER_SIZE + 100)
        assert pages.checked_get(engine, keys) == [False, True, True]
        stats = engine.stats()
        assert sum(t["quarantined"] for t in stats["tiers"]) == 2 and stats["pages_missing"] == 1
        assert not engine.contains(keys[0]) and engine.prefix_len(keys) == 0
        assert pages.put(engine, keys[:1]) == [True]  # sglang writes it again on the next backup
        assert pages.checked_get(engine, keys) == [True] * 3
        assert engine.check() == []


@pytest.mark.parametrize("cut", [0, 1, 3000])  # bytes of the last 4 KiB of padding left: 5000 + cut < 8192
def test_a_page_cut_inside_its_padding_is_removed_by_a_read_then_written_again(tier_dirs, io_engine, cut):
    """A copy shorter than its header's file size is 'truncated' for the scan and check; a read judges it
    alike (its payload intact, its O_DIRECT read short forever): removed, so the next put writes it
    again (before: taken for a transfer fault each time, the key a miss that put never mended)."""
    pages = PageSet(size=5000, aligned=False)
    keys = pages.keys(1)
    with make_engine(tier_dirs[:1], io_engine) as engine:
        assert pages.put(engine, keys) == [True]
        os.truncate(engine.tiers[0].layout.page_path(keys[0]), HEADER_SIZE + 5000 + cut)
        assert pages.checked_get(engine, keys) == [False]
        assert engine.stats()["tiers"][0]["quarantined"] == 1 and not engine.contains(keys[0])
        assert pages.put(engine, keys) == [True]
        assert pages.checked_get(engine, keys) == [True]
        assert engine.check() == []


def test_page_symlinked_out_of_the_tier_is_not_served_and_the_target_survives(tier_dirs, tier_root):
    """A symlink planted under a page's name pointing outside the tier: never opened (O_NOFOLLOW),
    never removed (kvstream removes only its own files, trust.py), reported by check; the target
    survives and the page is read from its replica."""
    pages = PageSet()
    keys = pages.keys(2)
    outside = os.path.join(tier_root, "precious")
    with open(outside, "wb") as f:
        f.write(os.urandom(HEADER_SIZE + pages.size))
    before = Path(outside).read_bytes()
    with make_engine(tier_dirs[:2], catchup="off") as engine:  # no catch-up copy races the planted link
        assert pages.put(engine, keys) == [True] * 2
        path = engine.tiers[0].layout.page_path(keys[1])
        os.unlink(path)
        os.symlink(outside, path)
        assert pages.checked_get(engine, keys, policy=SingleTier(0)) == [True, True]
        assert os.path.islink(path) and Path(outside).read_bytes() == before
        assert [(p.kind, p.path, p.fixed) for p in engine.check(fix=True)] == [("stray", path, False)]
        os.unlink(path)
        assert engine.check() == []
    os.symlink(outside, path)  # and at start-up: never followed, never removed
    with make_engine(tier_dirs[:2]) as engine:
        assert engine.wait_scan(30)
        assert engine.scan["damaged_removed"] == 0 and engine.scan["kept"] == 1 and os.path.islink(path)
        assert Path(outside).read_bytes() == before
        assert pages.checked_get(engine, keys) == [True, True]
        os.unlink(path)


# 48 KiB pages in 16 KiB blocks (helpers.CHUNK): three checksum blocks a page, as an 8 MiB SGLang page
# holds eight at the default 1 MiB chunk.
N_PAGES = 32
N_DAMAGED = 16


def _damage_front_pages(engine, keys):
    """Damage whole copies on tier 0: the first 8 files truncated to 8 KiB (a torn file), the next 8 with
    a byte flipped in each of their three blocks. The batch is read with SingleTier(0): tier 0 reads every
    block, and a block it fails is read from tier 1."""
    layout = engine.tiers[0].layout
    for k in keys[:8]:
        os.truncate(layout.page_path(k), 8192)
    for k in keys[8:N_DAMAGED]:
        path = layout.page_path(k)
        payload = os.path.getsize(path) - PAGE_BYTES
        with open(path, "r+b") as f:
            for j in range(3):
                f.seek(payload + j * (16 << 10) + 100)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x10]))


def test_damaged_copies_count_once_in_corrupted_and_replica_retries(tier_dirs):
    """docs/design.md (Stats) and docs/sglang.md: ``corrupted`` / ``kvstream:tier_corrupted_pages_total``
    count *copies* (pages) on the tier that failed verification, and ``replica_retries`` /
    ``kvstream:tier_fallbacks_total`` "page reads this tier failed that were retried on another replica".
    16 damaged copies of 3 blocks each, each read once and served by tier 1, are 16 of both (before: every
    failed block counted, 48 here, 8 per torn 8 MiB SGLang page; found by the review of what an operator
    sees)."""
    engine = make_engine(tier_dirs[:2], replicate="all", catchup="off")
    try:
        keys = [key(i, "corrupt") for i in range(N_PAGES)]
        assert all(put_items(engine, [(k, content(k), True) for k in keys]))
        _damage_front_pages(engine, keys)
        found, data = get_items(engine, [(k, PAGE_BYTES, True) for k in keys], SingleTier(0))
        assert all(found) and all(d == content(k) for d, k in zip(data, keys))
        t0 = engine.stats()["tiers"][0]
        assert t0["quarantined"] == N_DAMAGED  # one removed copy per damaged page
        assert (t0["corrupted"], t0["replica_retries"]) == (N_DAMAGED, N_DAMAGED), t0
    finally:
        engine.close()


def test_an_evicted_page_whose_header_was_damaged_since_leaves_with_its_file(tier_dirs):
    """A counted page's header damaged on disk since it was written (a bit flipped by the medium): its
    eviction removes its file, as it did before stop 50 (an unlink by name). Else the index forgets it and
    the damaged file stays beyond the capacity: nothing looks at it again in this run (no read, no scan)."""
    pages = PageSet()
    x, y = pages.keys(2)
    with make_engine(tier_dirs[:1], capacity=str(PAGE_BYTES)) as a:
        assert pages.put(a, [x]) == [True]
        flip_byte(a.tiers[0].layout.page_path(x), 30)  # (in created: the header's CRC fails)
        assert pages.put(a, [y]) == [True]  # X evicted
        assert a.stats()["tiers"][0]["evictions"] == 1 and not a.index.holders(x)
        assert not os.path.exists(a.tiers[0].layout.page_path(x)), "the evicted page's damaged file stays"
