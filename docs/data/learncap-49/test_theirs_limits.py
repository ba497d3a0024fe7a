"""Review theirs: this engine's own pages taken for another process's (Index THEIRS: never counted nor
evicted by it, nor by any process). Fails on 92bf00a; not fixed here (see the report)."""
from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from kvstream_hicache._uring import crc32c
from kvstream_hicache.layout import HEADER_SIZE

from helpers import PAGE_BYTES, PageSet, make_engine, page_files, wait_until

CREATED_OFF = 24  # the header's created_ns, 8 bytes (integrity.py)


@pytest.fixture
def overlay_tier(tier_root):
    """A tier on an overlay mount: not a local file system, so its calls are bounded (as test_bounded's)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount)")
    base = os.path.join(tier_root, "ovl")
    dirs = {n: os.path.join(base, n) for n in ("lower", "upper", "work", "mnt")}
    for d in dirs.values():
        os.makedirs(d)
    opts = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    if subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, dirs["mnt"]]).returncode:
        pytest.skip("overlay mount refused")
    try:
        yield dirs["mnt"]
    finally:
        subprocess.run(["umount", "-l", dirs["mnt"]])


def _set_created(path: str, created_ns: int) -> None:
    """A page's header ``created_ns`` set and the header's CRC made again: as a writer whose clock was
    that far ahead of this host's wrote it."""
    with open(path, "r+b") as f:
        header = bytearray(f.read(HEADER_SIZE))
        header[CREATED_OFF:CREATED_OFF + 8] = created_ns.to_bytes(8, "little")
        header[HEADER_SIZE - 4:] = crc32c(bytes(header[:HEADER_SIZE - 4])).to_bytes(4, "little")
        f.seek(0)
        f.write(header)


def test_pages_of_before_a_restart_stamped_a_minute_ahead_are_counted_and_trimmed(tier_dirs):
    """A run wrote 4 pages and stopped; its clock was a minute ahead of this one's (another node of a
    shared tier, or this host before NTP stepped its clock back: within CLOCK_SKEW_NS, a time, not a
    claim). The restarted engine, with a capacity of 2 pages, found them at its start: the tier as it
    found it, which its scan counts and trims (docs/guarantees.md "Capacity is per process"), and its
    puts evict. On 92bf00a they are THEIRS: 6 pages stay, and no process ever evicts the 4."""
    pages = PageSet()
    old, new = pages.keys(4), pages.keys(2, start=100)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, old) == [True] * 4
    ahead = time.time_ns() + 60 * 10**9
    for path in page_files(tier_dirs[0]):
        _set_created(path, ahead)
    with make_engine(tier_dirs[:1], capacity=str(2 * PAGE_BYTES)) as engine:
        assert pages.put(engine, new) == [True] * 2
        assert pages.checked_get(engine, new) == [True] * 2
        assert (len(page_files(tier_dirs[0])), engine.index.theirs(0)) == (2, 0)


def test_a_put_s_copy_whose_rename_answered_late_is_counted_when_found_again(overlay_tier, tier_dirs):
    """A put's copy on a tier that may hang: its rename is done but answers past write_timeout (the server
    busy): the tier fails, the copy is not indexed. When the tier is back, the engine finds the file (catch-up's
    look, or discovery): its own page, which it must count and evict to keep tier 1's capacity (2 pages).
    On 92bf00a it is THEIRS: tier 1 keeps 3 pages, that one for good."""
    pages = PageSet()
    keys = pages.keys(4)
    release = threading.Event()
    with make_engine([tier_dirs[0], overlay_tier], replicate="all", write_timeout=0.5, tier_retry=0.1,
                     capacity=f"{os.pathsep}{2 * PAGE_BYTES}") as engine:
        tier = engine.tiers[1]
        assert not tier.local
        real = tier._place

        def place(*args):
            out = real(*args)  # in place; its answer comes late
            release.wait(30)
            return out

        tier._place = place
        try:
            assert pages.put(engine, keys[:1]) == [True]  # (tier 0's copy)
            wait_until(lambda: not tier.healthy, 30, "tier 1 never failed")
        finally:
            tier._place = real
            release.set()
        assert os.path.exists(tier.layout.page_path(keys[0]))
        wait_until(lambda: engine.prefix_len(keys[:1]) and engine.index.holders(keys[0]) == 0b11, 60,
                   "tier 1's copy was never found")
        for k in keys[1:]:  # one put each: tier 1 keeps this engine's 2 most recent pages
            assert pages.put(engine, [k]) == [True]
        assert (len(page_files(overlay_tier)), engine.index.theirs(1)) == (2, 0)
