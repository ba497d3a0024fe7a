"""Versions sharing tiers: a node upgraded to this tree, or rolled back from it to an older one, while its
tiers keep their pages and the record of a clear() a tier owes (``<tier>/kvstream/<digest>.clears-owed``,
owed.py). The older engine is real: the tree of an older commit (``git archive`` of this checkout, its
extension copied, or built where its _uring sources differ), run in a child process (node.py)
with PYTHONPATH naming that tree. A clone without that history (a shallow one) skips them, saying so.

What a user sees: after a weight update SGLang clears the L3 (``/clear_hicache_storage_backend``); a tier
away at that moment owes the clear, and no start may serve its pages (stale KV of the old weights),
whichever version starts next. (From the review of versions sharing tiers, stop 44.)
"""
from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import pytest

from kvstream_hicache.integrity import unpack_header
from kvstream_hicache.layout import HEADER_SIZE

from helpers import HERE, Node, PageSet, make_engine, page_files, wait_until

ROOT = os.path.dirname(HERE)
BEFORE_REAL_PATHS = "2e0121e"  # stop 43 before cdf2983: the record named its tiers as listed, a link kept
STOP_43 = "ee6037c"  # the record as the JSON list of the tiers' real paths, no time
RETRY_S = 5.0


def _ext(tree: str) -> str | None:
    names = [n for n in os.listdir(os.path.join(tree, "kvstream_hicache"))
             if n.startswith("_uring") and n.endswith(".so")]
    return os.path.join(tree, "kvstream_hicache", names[0]) if names else None


@pytest.fixture(scope="module")
def trees():
    """``trees(commit)``: a directory holding this checkout's tree at ``commit``, its extension ready."""
    made: dict[str, str] = {}
    scratch = tempfile.mkdtemp(prefix="kvstream-versions-")

    def tree(commit: str) -> str:
        if commit in made:
            return made[commit]
        known = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        if known.returncode:
            pytest.skip(f"commit {commit} is not in this clone's history (a shallow clone)")
        path = os.path.join(scratch, commit)
        os.makedirs(path)
        archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit], capture_output=True,
                                 check=True)
        with tempfile.TemporaryFile() as f:
            f.write(archive.stdout)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(path, filter="data")
        ours, sources = _ext(ROOT), sorted(os.listdir(os.path.join(ROOT, "_uring")))
        same = ours is not None and sources == sorted(os.listdir(os.path.join(path, "_uring"))) and all(
            filecmp.cmp(os.path.join(ROOT, "_uring", n), os.path.join(path, "_uring", n), shallow=False)
            for n in sources)
        if same:
            shutil.copy2(ours, os.path.join(path, "kvstream_hicache"))
        else:
            subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=path, capture_output=True,
                           check=True)
        made[commit] = path
        return path

    yield tree
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def versions():
    """``versions(tree)``: an engine of that tree in a child process (node.py's commands)."""
    started: list[Node] = []

    def start(tree: str) -> Node:
        started.append(Node("node.py", tree))
        where = started[-1]("where")["file"]
        assert where.startswith(tree + os.sep), f"the child imported {where}, not the tree {tree}"
        return started[-1]

    yield start
    for node in started:
        node.stop()


def test_a_clear_owed_that_stop_43s_first_commits_recorded_is_done_after_the_upgrade(trees, versions, tier_root):
    """The tiers are listed through a link (``/scratch/nvme1`` -> the mount, as sites do), the same list
    before and after the upgrade. On 2e0121e a clear() finds tier 1 away: the record on tier 0 names tier 1
    as listed, through the link. Upgraded, the node starts with the same tier list: tier 1 still owes that
    clear, and none of its pages may be served. Before, the record was matched with the tiers' real paths
    only: the debt was dropped, tier 1's stale pages served and copied back to tier 0 by catch-up."""
    t0, t1, link = (os.path.join(tier_root, n) for n in ("tier0", "tier1", "nvme1"))
    os.makedirs(t0)
    os.makedirs(t1)
    os.symlink(t1, link)
    dirs = [t0, link]
    pages = PageSet()
    keys = pages.keys(4)
    old = versions(trees(BEFORE_REAL_PATHS))
    old("open", dirs, {"tier_retry": RETRY_S})
    assert old("put", "p", 0, 4, 0)["stored"] == [True] * 4
    os.rename(t1, t1 + ".away")  # (the tier is away: its mount gone)
    old("clear")
    assert [t["healthy"] for t in old("stats")["tiers"]] == [True, False]
    old("close")
    old.stop()
    os.rename(t1 + ".away", t1)
    assert len(page_files(t1)) == 4  # (the stale pages, back with the tier)
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        found = pages.checked_get(engine, keys)
        assert found == [False] * 4, (f"{sum(found)} of 4 pages cleared on {BEFORE_REAL_PATHS} (tier 1 was away) "
                                      f"are served after the upgrade; tier 1 healthy: {engine.tiers[1].healthy}")


def test_a_clear_owed_is_still_done_when_the_node_is_rolled_back_to_stop_43(trees, versions, tier_dirs):
    """This tree: clear() while tier 1 is away; the process ends, and the record on tier 0 says tier 1 owes
    the clear. The node is rolled back to stop 43 (ee6037c), which knows records of clears owed, with tier 1
    back: it must not serve tier 1's pages. Before, b2e98e7 wrote the record as a JSON object, which stop
    43 logged as 'not kvstream's' and ignored: tier 1's stale pages were served."""
    dirs = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(4)
    with make_engine(dirs, tier_retry=RETRY_S) as engine:
        assert pages.put(engine, keys) == [True] * 4
        os.rename(dirs[1], dirs[1] + ".away")
        engine.clear()
        assert not engine.tiers[1].healthy
    os.rename(dirs[1] + ".away", dirs[1])
    old = versions(trees(STOP_43))
    old("open", dirs, {"tier_retry": RETRY_S})
    got = old("get", "p", 0, 4, 0)
    assert got["found"] == [False] * 4, f"{sum(got['found'])} of 4 pages cleared are served by {STOP_43} after a rollback"



BEFORE_COPIED = "afeed1e"  # stop 51 before a catch-up copy's header carried its own stamp (PageHeader.copied_ns)


def test_a_catch_up_copy_this_tree_wrote_is_served_by_a_tree_of_before_its_stamp(trees, versions, tier_dirs):
    """A catch-up copy's header now carries its copier's stamp in bytes 50..57 (``copied``), which every
    writer of format 1 before it left zero (review simp, stop 51). A node rolled back to a tree of before
    reads such a copy as any page: bytes it skips, covered by the header CRC it checks."""
    d0, d1 = tier_dirs[:2]
    pages = PageSet()
    keys = pages.keys(4)
    with make_engine([d0]) as engine:
        assert pages.put(engine, keys) == [True] * 4
    with make_engine([d0, d1]) as engine:  # (its scan finds them on d0, its catch-up copies them to d1)
        wait_until(lambda: all(engine.index.holders(k) == 0b11 for k in keys), what="catch-up never copied to d1")
    copies = []
    for path in page_files(d1):
        with open(path, "rb") as f:
            copies.append(unpack_header(f.read(HEADER_SIZE)))
    assert len(copies) == 4 and all(h.copied_ns > h.created_ns > 0 for h in copies)
    old = versions(trees(BEFORE_COPIED))
    old("open", [d1], {})
    got = old("get", "p", 0, 4, 0)
    assert got["found"] == got["exact"] == [True] * 4, f"{BEFORE_COPIED} did not serve this tree's catch-up copies: {got}"
