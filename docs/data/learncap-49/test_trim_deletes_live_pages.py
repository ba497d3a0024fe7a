"""trim2 review: two processes of one namespace, same capacity, on one shared tier."""
from __future__ import annotations

import pytest

from helpers import PAGE_BYTES, PageSet, make_engine, page_files, wait_until


def _trimmed(engine, k=0):
    t = getattr(engine, "_trims", [None])[k]  # (none before the change)
    return t is None or not t.is_alive()


@pytest.mark.leaves_problems("the reader's index lists the page the writer evicted (index_stale: another "
                             "process's eviction, harmless, docs/guarantees.md)")
def test_a_readers_trim_never_removes_a_page_the_writer_holds_while_the_tier_is_within_its_capacity(tier_dirs):
    """A writer and a reader (MLA ranks, two servers) with the same capacity, 4 pages, on one tier. The
    reader reads the writer's 4 pages; the writer reads its first page again (its most recent) and puts a
    fifth, evicting its least recent page (the second). The directory holds 4 pages: its capacity. The
    reader finds the fifth page: its index, which still lists the page the writer evicted, is 'over', and
    its trim removes ITS least recent page, the first, a live page the writer holds as its most recent."""
    pages = PageSet()
    keys = pages.keys(5)
    cap = 4 * PAGE_BYTES
    with make_engine(tier_dirs[:1], capacity=str(cap)) as writer, \
            make_engine(tier_dirs[:1], capacity=str(cap)) as reader:
        assert pages.put(writer, keys[:4]) == [True] * 4
        assert pages.checked_get(reader, keys[:4]) == [True] * 4  # discovered, read
        assert pages.checked_get(writer, keys[:1]) == [True]  # the writer's most recent page
        assert pages.put(writer, keys[4:]) == [True]  # evicts keys[1], the writer's least recent
        assert len(page_files(tier_dirs[0])) == 4  # the directory: at its capacity, not over it
        assert reader.prefix_len(keys[4:]) == 1
        wait_until(lambda: _trimmed(reader), 30, "the reader's trim never ended")
        on_disk = len(page_files(tier_dirs[0]))
        found = pages.checked_get(writer, [keys[0], *keys[2:]])
        assert (on_disk, found) == (4, [True] * 4), \
            f"files {on_disk}, the writer's gets {found}: the reader's trim removed a live page"


@pytest.mark.leaves_problems("the reader's index lists pages the writer evicted (index_stale: another process's "
                             "eviction, harmless, docs/guarantees.md)")
def test_a_readers_trim_never_removes_the_hot_page_a_writer_reads_every_round(tier_dirs):
    """Steady state (a prefill server writing, a decode server reading what it wrote, one directory, the same
    capacity of 4 pages): the writer reads its hot page H each round (a shared system prompt) and puts a new
    page; the reader reads each new page once. The writer's own eviction never takes H (its most recent), so
    before the capacity trim H was found every round; the reader's trim, over only by the page the writer
    evicted that its index still lists, removes H (the reader's least recent page): the writer misses it."""
    pages = PageSet()
    hot, *first = pages.keys(4)
    more = pages.keys(12, 100)
    cap = 4 * PAGE_BYTES
    misses = []
    with make_engine(tier_dirs[:1], capacity=str(cap)) as writer, \
            make_engine(tier_dirs[:1], capacity=str(cap)) as reader:
        assert pages.put(writer, [hot, *first]) == [True] * 4
        assert pages.checked_get(reader, [hot, *first]) == [True] * 4
        for i, k in enumerate(more):
            if pages.checked_get(writer, [hot]) != [True]:
                misses.append(i)
                assert pages.put(writer, [hot]) == [True]  # recomputed and stored again
            assert pages.put(writer, [k]) == [True]
            assert pages.checked_get(reader, [k]) == [True]
            wait_until(lambda: _trimmed(reader), 30, "the reader's trim never ended")
    assert misses == [], f"the writer's hot page was removed before rounds {misses} of {len(more)}"
