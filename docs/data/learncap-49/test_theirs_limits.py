"""Review theirs: this engine's own pages taken for another process's (Index THEIRS: never counted nor
evicted by it, nor by any process). Fails on 92bf00a and on main (the other test of the review, a late
rename, is fixed and in tests/test_bounded.py)."""
from __future__ import annotations

import time

from helpers import PAGE_BYTES, PageSet, make_engine, page_files, set_header_field

CREATED_OFF = 24  # the header's created_ns, 8 bytes (integrity.py)


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
        set_header_field(path, CREATED_OFF, ahead, width=8)
    with make_engine(tier_dirs[:1], capacity=str(2 * PAGE_BYTES)) as engine:
        assert pages.put(engine, new) == [True] * 2
        assert pages.checked_get(engine, new) == [True] * 2
        assert (len(page_files(tier_dirs[0])), engine.index.theirs(0)) == (2, 0)
