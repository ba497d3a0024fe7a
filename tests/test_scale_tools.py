"""The operator's commands on a tier of many pages: ``kvstream check`` and ``kvstream info`` hold no
object per page of the tier. A shared tier holds millions of pages (docs/benchmarks.md "Scale"); at 1M
pages of 4 KiB (trial 'scale', ext4 on a loop device) ``kvstream check`` peaked at 937 MB RSS (every
valid page's ScannedPage kept in a dict, then dropped) and ``kvstream info`` at 428 MB (a set of every
page's name per tier, built twice). Memory is measured with tracemalloc (Python's own allocations,
deterministic): what a page more costs at the peak, between two page counts.
"""
from __future__ import annotations

import contextlib
import io
import os
import tracemalloc

from kvstream_hicache import Config, check_tiers
from kvstream_hicache.integrity import PageHeader, block_crcs, pack_header
from kvstream_hicache.io import AlignedBuffer
from kvstream_hicache.layout import HEADER_SIZE, TierLayout, file_size

from helpers import NS, make_engine

PAGE = 4096
FEW, MANY = 400, 2400
PER_PAGE_B = 60  # bytes a page more may cost at the peak: one shard's names at a time is a few bytes a page


def _raw_pages(tier: str, start: int, n: int) -> None:
    """Pages ``start..start+n`` of NS on ``tier``, written straight in the page format (scale_bench's fill):
    an engine's puts of thousands of pages take the test's time, not what it tests."""
    make_engine([tier]).close()  # (the tier's tree, as an engine makes it)
    layout = TierLayout(tier, NS.digest)
    buf = AlignedBuffer(file_size(PAGE))
    view = memoryview(buf)
    try:
        view[HEADER_SIZE:HEADER_SIZE + PAGE] = bytes(range(256)) * (PAGE // 256)
        crcs = block_crcs([(buf.address + HEADER_SIZE, PAGE)], PAGE, 1 << 20)
        for i in range(start, start + n):
            key = f"{i:064x}"[::-1]  # (the shard is the key's first two characters: spread over 256 of them)
            os.makedirs(layout.page_dir(key), mode=0o700, exist_ok=True)
            pack_header(PageHeader(key, NS.digest, PAGE, 1 << 20, crcs, 1 + i), buf)
            fd = os.open(layout.page_path(key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, view)
            finally:
                os.close(fd)
    finally:
        view.release()


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _per_page(tiers: list[str], fn, extra: int = 0) -> tuple[float, list]:
    """Peak bytes of ``fn()`` per page added, from FEW to MANY pages on every tier of ``tiers`` (the last
    tier ``extra`` pages more), and the results of the two calls."""
    results = []

    def call():
        results.append(fn())

    for tier in tiers:
        _raw_pages(tier, 0, FEW)
    fn()  # (the modules it imports on its first call: not a page's cost)
    few = _peak(call)
    for k, tier in enumerate(tiers):
        _raw_pages(tier, FEW, MANY - FEW + (extra if k == len(tiers) - 1 else 0))
    many = _peak(call)
    return (many - few) / (MANY - FEW), results


def test_check_holds_no_object_per_page(tier_dirs):
    """check_tiers (``kvstream check``) kept every valid page's ScannedPage of a namespace (check_tier's
    dict of valid pages, which the engine's check needs and the command discarded): ~900 B a page."""
    config = Config.from_sources({"tiers": tier_dirs[:1]}, environ={})
    cost, results = _per_page(tier_dirs[:1], lambda: check_tiers(config))
    assert results == [[], []]  # (both clean: the walk found every page valid)
    assert cost < PER_PAGE_B, f"kvstream check holds {cost:.0f} B per page of the tier"


def test_info_holds_no_object_per_page_and_counts_as_before(tier_dirs):
    """``kvstream info`` built a set of every page's name per tier, twice (its page count, and the pages some
    tier lacks): ~420 B a page. It counts a shard directory at a time, and says the same."""
    from kvstream_hicache.tools import cli

    def info() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["info", "--tiers", *tier_dirs[:2]]) == 0
        return out.getvalue()

    cost, (_, text) = _per_page(tier_dirs[:2], info, extra=5)
    assert f"; {MANY} pages in 1 namespace(s)" in text and f"; {MANY + 5} pages in 1 namespace(s)" in text, text
    assert "under-replicated: 5 page(s) lack a tier (tier0 lacks 5)" in text, text
    assert cost < PER_PAGE_B, f"kvstream info holds {cost:.0f} B per page of the tier"


def test_info_counts_a_page_named_in_two_directories_of_a_namespace_once(tier_dirs):
    """A page file's name in two directories of a namespace (a copy beside the shards, or misplaced into another
    shard: an operator's copy) was one page to ``kvstream info`` when it held every name; counted a shard
    directory at a time it became two, and a page the other tier holds in its shard alone was under-replicated
    on both (review of d619d5c: the counts must not change)."""
    from kvstream_hicache.tools import cli

    _raw_pages(tier_dirs[0], 0, 3)
    _raw_pages(tier_dirs[1], 0, 3)
    layout = TierLayout(tier_dirs[0], NS.digest)
    first = layout.page_path(f"{0:064x}"[::-1])
    beside = os.path.join(layout.pages, os.path.basename(first))
    misplaced = os.path.join(layout.page_dir(f"{1:064x}"[::-1]), os.path.basename(first))
    for path in (beside, misplaced):
        os.link(first, path)
    os.unlink(TierLayout(tier_dirs[1], NS.digest).page_path(f"{0:064x}"[::-1]))
    os.link(TierLayout(tier_dirs[1], NS.digest).page_path(f"{1:064x}"[::-1]),
            os.path.join(TierLayout(tier_dirs[1], NS.digest).pages, os.path.basename(first)))  # (tier 1: beside)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["info", "--tiers", *tier_dirs[:2]])
    text = out.getvalue()
    assert text.count("; 3 pages in 1 namespace(s)") == 2, text
    assert "under-replicated" not in text or "0 page(s)" in text, text
