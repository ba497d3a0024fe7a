"""A shared tier lets no one in (docs/guarantees.md, "Who can do what on a shared tier").

A second user is made by the test: a child process that takes a uid no account has (fork, then
setgroups/setgid/setuid, as root can) and attacks with plain file operations, as a user without kvstream
would: it pre-creates the tree and plants a valid page, plants links at the probe path, at ``tmp/``, at a
shard directory and at a page path, writes as a member of a shared tier's group, and claims a creation
time in the future. The engine runs as the test's user (root in CI: being root changes nothing here,
the engine trusts owners, not permissions).
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

import kvstream_hicache
from kvstream_hicache import Config, ConfigError, check_tiers, integrity, tmpfiles
from kvstream_hicache.integrity import pack_header, unpack_header
from kvstream_hicache.io import AlignedBuffer
from kvstream_hicache.layout import HEADER_SIZE, TierLayout
from kvstream_hicache.router import SingleTier
from kvstream_hicache.tmpfiles import HOST, REMOVING_PREFIX, tmp_name
from kvstream_hicache.tools import cli
from kvstream_hicache.trust import user_name

from helpers import NS, PageSet, as_user, content, kvstream_cli, make_engine, owner_mapping_tier, wait_until

INTRUDER = 54321  # uids and a group no account has: the second user and the shared tier's group
MEMBER = 54322
GROUP = 54320
MAPPED = 54323  # the owner an owner-mapping file system gives every file

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root (CI runs as root)")


def page_file(scratch: str, key: str, data: bytes, created_ns: int | None = None) -> bytes:
    """The bytes of a valid page file of ``key`` holding ``data`` (header, checksums and all: anyone can
    make one), written by an engine on a scratch tier; ``created_ns`` rewrites the header's time."""
    os.makedirs(scratch, exist_ok=True)
    with make_engine([scratch]) as engine:
        assert PageSet(size=len(data), data=lambda k: data).put(engine, [key]) == [True]
        path = engine.tiers[0].layout.page_path(key)
        raw = Path(path).read_bytes()
        engine.clear()
    if created_ns is not None:
        buf = AlignedBuffer(HEADER_SIZE)
        pack_header(unpack_header(raw[:HEADER_SIZE])._replace(created_ns=created_ns), buf)
        raw = bytes(buf) + raw[HEADER_SIZE:]
    return raw


def plant_tree(tier: str, files: dict[str, bytes]) -> None:
    """As the other user: ``kvstream/``, ``tmp/`` and the namespace's page directories, mode 0777, and
    ``files`` (paths relative to the tier) written there."""
    layout = TierLayout(tier, NS.digest)
    os.makedirs(layout.tmp, 0o777, exist_ok=True)
    for rel, data in files.items():
        path = os.path.join(tier, rel)
        os.makedirs(os.path.dirname(path), 0o777, exist_ok=True)
        Path(path).write_bytes(data)


def start(dirs, use=None, **settings):
    """Start an engine on ``dirs``: (the ConfigError, None) when it refuses, else (None, ``use(engine)``),
    the engine closed. The harm a start may do is asserted before the refusal is."""
    try:
        engine = make_engine(dirs, **settings)
    except ConfigError as exc:
        return exc, None
    with engine:
        return None, use(engine) if use is not None else None


@pytest.fixture
def scratch(tier_root):
    """``tier_root`` reachable by every user (the other user must get to the tier), and a world-writable
    sticky scratch area in it, as on a parallel file system."""
    os.chmod(tier_root, 0o755)
    area = os.path.join(tier_root, "scratch")
    os.mkdir(area)
    os.chmod(area, 0o1777)
    return area


def test_a_tree_another_user_made_first_is_refused_and_their_page_never_served(scratch, tier_root):
    """The other user creates kvstream/ and the directories below it (0777) before the engine, and plants
    a valid page for a key the victim never stored: the engine refuses the tier, naming the directory,
    its owner and mode, and the fix; check reports the page as untrusted and never removes it."""
    key = PageSet().keys(1)[0]
    planted = page_file(os.path.join(tier_root, "forge"), key, content("forged", PageSet().size))
    rel = os.path.relpath(TierLayout(scratch, NS.digest).page_path(key), scratch)
    as_user(INTRUDER, plant_tree, scratch, {rel: planted})
    base = os.path.join(scratch, "kvstream")
    err, served = start([scratch], lambda engine: PageSet().get(engine, [key])[0])
    assert served is None, "the other user's page was served"
    msg = str(err)
    for part in (f"tier directory {base} ", f"uid {INTRUDER}", "mode 0777", f"rm -r {base}", "another tier directory"):
        assert part in msg, (part, msg)
    assert "chown" not in msg, msg  # (what the error advises is what an operator runs: test_the_fix_the_refusal_...)
    config = Config.from_sources({"tiers": [scratch]}, environ={})
    layout = TierLayout(scratch, NS.digest)
    for fix in (False, True):  # the directories an engine refuses, and the page: reported, nothing removed
        problems = check_tiers(config, fix=fix)
        assert [(p.kind, p.path, p.fixed) for p in problems] == [
            ("untrusted", layout.base, False), ("untrusted", layout.pages, False),
            ("untrusted", layout.page_path(key), False)], problems
        assert all(f"uid {INTRUDER}" in p.detail for p in problems)
        assert f"rm -r {layout.base}" in problems[0].detail
    assert Path(scratch, rel).read_bytes() == planted  # never removed: not ours


def _plant_private_tree(tier: str, files: dict[str, bytes]) -> None:
    """As the other user: ``kvstream/`` and the tree below it of their own uid and group, 0700 (files 0600)."""
    os.umask(0o077)
    plant_tree(tier, files)
    for top, dirs, names in os.walk(os.path.join(tier, "kvstream")):
        for name in dirs:
            os.chmod(os.path.join(top, name), 0o700)
    os.chmod(os.path.join(tier, "kvstream"), 0o700)


def test_a_tree_another_user_made_first_is_refused_in_shared_mode_too(scratch, tier_root):
    """file_mode=shared in a world-writable sticky root trusts the group of ``kvstream/`` there: the other user
    who made it first (0700, their own uid and group) chose that group. Root's engine opened it, trusted the
    other user's group ("tier 0 trusts root (uid 0) and group <theirs>"), and served their planted page as its
    own (found by an attacker's trial). The start is refused as in private mode, naming the owner and the fix;
    the engine's own ``kvstream/`` of another group of its own is used."""
    key = PageSet().keys(1)[0]
    planted = page_file(os.path.join(tier_root, "forge"), key, content("forged", PageSet().size))
    rel = os.path.relpath(TierLayout(scratch, NS.digest).page_path(key), scratch)
    as_user(INTRUDER, _plant_private_tree, scratch, {rel: planted})
    base = os.path.join(scratch, "kvstream")
    err, served = start([scratch], lambda engine: PageSet().get(engine, [key])[0], file_mode="shared")
    assert served is None, "the other user's page was served"
    for part in (f"tier directory {base} ", f"uid {INTRUDER}", f"rm -r {base}"):
        assert part in str(err), (part, err)
    assert Path(scratch, rel).read_bytes() == planted  # never removed: not ours
    shutil.rmtree(base)
    os.mkdir(base)
    os.chown(base, -1, GROUP)  # the engine's own, of a group the operator chose: its group is trusted
    os.chmod(base, 0o2770)
    pages = PageSet()
    with make_engine([scratch], file_mode="shared") as engine:
        assert engine.tiers[0].trust.gid == GROUP
        assert pages.put(engine, pages.keys(2)) == [True, True]
        assert pages.checked_get(engine, pages.keys(2)) == [True, True]


def test_the_fix_a_refused_tree_names_never_makes_the_other_users_pages_this_engines(scratch, tier_root):
    """The error for a tree another user made first names the fix an operator runs as written. It advised
    `chown -R <user> <dir>` beside `rm -r`: run as root, that made every file in it the engine's own, the other
    user's planted page with it, which was then served as this engine's (found in review of an attacker's
    trial). A cache loses nothing kvstream cannot write again: the fix is to remove the tree."""
    key = PageSet().keys(1)[0]
    planted = page_file(os.path.join(tier_root, "forge"), key, content("forged", PageSet().size))
    rel = os.path.relpath(TierLayout(scratch, NS.digest).page_path(key), scratch)
    as_user(INTRUDER, plant_tree, scratch, {rel: planted})
    err, served = start([scratch], lambda engine: PageSet().get(engine, [key])[0])
    assert served is None
    for _ in range(5):  # the operator runs what each refusal advises, keeping the cache where it may (no rm)
        advised = re.findall(r"\b((?:rm|chown|chmod|chgrp) -R? ?[^ ),;]+(?: [^ ),;]+)?)", str(err))
        assert advised, str(err)
        fix = next((f for f in advised if not f.startswith("rm")), advised[0])
        done = subprocess.run(fix, shell=True, capture_output=True, text=True)
        assert done.returncode == 0, (fix, done.stderr)
        err, served = start([scratch], lambda engine: PageSet().get(engine, [key])[0])
        if err is None:
            break
    assert err is None, err
    assert served == [False], f"the other user's page was served after the fixes the errors gave (last: {fix})"


def test_a_name_with_control_characters_forges_no_log_line_and_no_terminal_output(tier_dirs, caplog, capsys):
    """Anyone who can make a file in a shard (a member of a shared tier) chooses its name: a newline and a
    terminal escape in it printed raw let them forge a line of the server's log ("WARNING kvstream: ...", from
    the scan's line for a file it keeps) and of ``kvstream check``'s output, and recolour or retitle the
    operator's terminal (found by an attacker's trial). Such characters are written escaped ("\\n",
    "\\x1b"), in the log and in check's lines."""
    pages = PageSet()
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, pages.keys(1)) == [True]
        shard = engine.tiers[0].layout.page_dir(pages.keys(1)[0])
    forged = os.path.join(shard, "x\x1b[31mred\x1b[0m\nWARNING kvstream: forged\x07")
    Path(forged).write_bytes(b"")
    os.chown(forged, INTRUDER, INTRUDER)  # (another user's: kept and logged by the scan, never removed)
    caplog.set_level("INFO", logger="kvstream")
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.checked_get(engine, pages.keys(1)) == [True]
        said = [r.getMessage() for r in caplog.records if r.name.startswith("kvstream")]
        code = cli.main(["check", "--tiers", tier_dirs[0]])
        os.unlink(forged)  # (the suite checks that every engine's tiers end clean)
    assert any("forged" in m for m in said), said  # (the file is named)
    assert not [m for m in said if "\n" in m or "\x1b" in m or "\x07" in m], said
    out = capsys.readouterr().out
    assert code == 1 and "forged" in out and "\x1b" not in out and "\x07" not in out, out
    assert not [line for line in out.splitlines() if line.startswith("WARNING")], out


@pytest.mark.parametrize("name", ["kvstream", "kvstream.sglang"])
def test_an_error_naming_a_tier_file_forges_no_log_line_on_any_kvstream_logger(name, caplog):
    """A tier file's name reaches the log inside an exception too (kvstream's own errors name the path in their
    message, which ``str`` of the exception prints as it is), and
    from the SGLang adapter's logger ('kvstream.sglang', where the adapter says a call failed and became a miss,
    and the plugin's): before, only string arguments of records made on the 'kvstream' logger itself were
    escaped (a logger's filter does not see its children's records), so such a name printed a forged line."""
    forged = "x\x1b[31m\nWARNING kvstream: forged\x07"
    caplog.set_level("INFO", logger=name)
    logging.getLogger(name).warning("kvstream: could not read it (%s)", OSError(errno.EIO, f"cannot read {forged}"))
    said = [r.getMessage() for r in caplog.records if r.name == name]
    assert len(said) == 1 and "forged" in said[0], said
    assert "\n" not in said[0] and "\x1b" not in said[0] and "\x07" not in said[0], said


def test_a_world_writable_tier_root_needs_the_sticky_bit(tier_root):
    root = os.path.join(tier_root, "open")
    os.mkdir(root)
    os.chmod(root, 0o777)
    err, _ = start([root])
    assert not os.path.exists(os.path.join(root, "kvstream"))  # refused before anything was made there
    assert re.search(r"writable by every user without the sticky bit \(mode 0777\).*chmod \+t", str(err)), err
    os.chmod(root, 0o1777)  # as /tmp: only the engine's own kvstream/ is used there
    pages = PageSet()
    with make_engine([root]) as engine:
        assert pages.put(engine, pages.keys(2)) == [True, True]
        assert pages.checked_get(engine, pages.keys(2)) == [True, True]


def test_a_tier_root_another_user_owns_is_refused(tier_root, monkeypatch):
    """The owner of a sticky 1777 tier root may rename anything in it (the sticky bit binds everyone but the
    directory's owner). Between a write's look at ``kvstream/`` (one lstat, Tier._gone) and its open of
    ``tmp/<name>`` by path, that user moved the engine's ``kvstream/`` away and put a link in its place: the
    temporary file holding the page was made in the link's target, a directory of the victim's (found by an
    attacker's trial: a loop of such swaps against a put loop left one there within seconds). Here the swap
    runs at the moment the race is won. The start is refused, naming the owner and the fix; nothing is
    written anywhere through the link."""
    os.chmod(tier_root, 0o755)
    root = os.path.join(tier_root, "theirs")
    os.mkdir(root)
    os.chown(root, INTRUDER, INTRUDER)
    os.chmod(root, 0o1777)
    mine = os.path.join(tier_root, "mine")  # a directory of the victim's, with a tmp/ as kvstream/ has
    os.makedirs(os.path.join(mine, "tmp"), 0o700)
    base = os.path.join(root, "kvstream")

    def swap() -> None:
        os.rename(base, base + ".moved")
        os.symlink(mine, base)

    def put(engine) -> None:
        tier, pages = engine.tiers[0], PageSet()
        look = tier._gone

        def raced(*args, **kwargs):
            gone = look(*args, **kwargs)
            if not gone and not os.path.islink(base):
                as_user(INTRUDER, swap)  # the owner wins the race, right after the look
            return gone

        monkeypatch.setattr(tier, "_gone", raced)
        pages.put(engine, pages.keys(1))

    err, _ = start([root], put)
    written = os.listdir(os.path.join(mine, "tmp"))
    if os.path.islink(base):  # (the tree as it was, for the fixture's removal)
        os.unlink(base)
        os.rename(base + ".moved", base)
    assert written == [], f"the page was written through the other user's link: {written}"
    for part in (f"tier directory {root} ", f"{root} belongs to", f"uid {INTRUDER}", "chown", "mkdir -m 700"):
        assert part in str(err), (part, err)
    ours = os.path.join(tier_root, "ours")  # a root of root's, reached through the other user's link: theirs to
    os.mkdir(ours)  # point elsewhere at any moment
    os.chmod(ours, 0o1777)
    links = os.path.join(tier_root, "links")
    os.mkdir(links)
    os.chmod(links, 0o1777)
    pointer = os.path.join(links, "tier")
    as_user(INTRUDER, os.symlink, ours, pointer)
    err, _ = start([pointer])
    assert f"{pointer} belongs to a user this engine does not trust" in str(err), err
    with make_engine([ours]):  # (root's own: used)
        pass


def _sticky_dirs(tier_root: str) -> tuple[str, str]:
    """Two directories of root's, sticky 1777, in ``tier_root`` (made 0755): ``ours``, a tier root the engine
    may use, and ``links``, where anyone may put a link."""
    os.chmod(tier_root, 0o755)
    made = []
    for name in ("ours", "links"):
        made.append(os.path.join(tier_root, name))
        os.mkdir(made[-1])
        os.chmod(made[-1], 0o1777)
    return made[0], made[1]


def test_a_tier_reached_through_another_user_s_link_behind_a_link_of_root_s_is_refused(tier_root):
    """The tier's path goes through a link of root's whose target is reached through another user's: a link of
    theirs (in a sticky 1777 directory), or a directory of theirs holding the next link. Neither is on the
    configured path nor on the real one, yet its owner may point it elsewhere at any moment (a write's open of
    ``kvstream/tmp/<name>`` by path then goes where they chose, as with a link of theirs on the configured path:
    test_a_tier_root_another_user_owns_is_refused). Every link and directory the path is resolved through
    must be trusted (from a review: the check looked at the configured and the real path's directories only)."""
    ours, links = _sticky_dirs(tier_root)
    as_user(INTRUDER, os.symlink, ours, os.path.join(links, "tier"))
    theirs = os.path.join(tier_root, "theirs")  # the other user's directory, holding a link of root's
    os.mkdir(theirs)
    os.symlink(ours, os.path.join(theirs, "tier"))
    os.chown(theirs, INTRUDER, INTRUDER)
    hops = ((os.path.join(links, "tier"), os.path.join(links, "tier")), (os.path.join(theirs, "tier"), theirs))
    for hop, owner in hops:
        entry = os.path.join(tier_root, "entry")  # root's own link, on the configured path
        os.symlink(hop, entry)
        err, _ = start([entry])
        os.unlink(entry)
        assert f"{owner} belongs to a user this engine does not trust" in str(err), (hop, err)
    with make_engine([ours]):  # (root's own, reached directly: used)
        pass


def _plant_probe_links(tmp: str, target: str, pid: int, seqs: range) -> None:
    for seq in seqs:
        os.symlink(target, os.path.join(tmp, f"probe.{pid}.config.{seq}"))


def test_a_link_at_the_probe_path_overwrites_nothing(scratch, tier_root):
    """Links planted at the names the start-up probe would use, to a file only the victim may write:
    the file keeps every byte (the probe creates its file O_EXCL|O_NOFOLLOW under a random name)."""
    secret = os.path.join(tier_root, "secret")
    Path(secret).write_bytes(b"only the victim writes this\n" * 300)
    os.chmod(secret, 0o600)
    before = Path(secret).read_bytes()
    nxt = int(re.fullmatch(r"count\((\d+)\)", repr(tmpfiles._probe_seq)).group(1))  # the next probe's number
    tmp = TierLayout(scratch, NS.digest).tmp
    as_user(INTRUDER, lambda: (plant_tree(scratch, {}), _plant_probe_links(tmp, secret, os.getppid(),
                                                                           range(nxt, nxt + 16))))
    err, _ = start([scratch])
    assert Path(secret).read_bytes() == before, "the probe wrote through a link"
    assert f"uid {INTRUDER}" in str(err)  # and the tree is the other user's: refused
    assert sorted(os.listdir(tmp)) == sorted(f"probe.{os.getpid()}.config.{s}" for s in range(nxt, nxt + 16))


def _precious(directory: str) -> dict[str, bytes]:
    """A directory of the victim's own files, named as kvstream's leftovers and strays would be."""
    os.makedirs(directory)
    files = {tmp_name(NS.digest, 2**22 + 7, "x", 0): b"a", "garbage.tmp": b"b", "notes.txt": b"c"}
    for name, data in files.items():
        Path(directory, name).write_bytes(data)
    return files


def _unchanged(directory: str, files: dict[str, bytes]) -> bool:
    return {n: Path(directory, n).read_bytes() for n in os.listdir(directory)} == files


@pytest.mark.parametrize("where", ["tmp", "shard"])
def test_a_link_at_tmp_or_at_a_shard_deletes_nothing_in_its_target(tier_dirs, tier_root, where):
    """``kvstream/tmp`` or a shard directory replaced by a link to another directory of the user's: start-up
    refuses the tier (it follows no link), and check --fix reports the link, never removes through it."""
    pages = PageSet()
    keys = pages.keys(3)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 3
        layout = engine.tiers[0].layout
    precious = os.path.join(tier_root, "precious")
    files = _precious(precious)
    link = layout.tmp if where == "tmp" else os.path.join(layout.pages, "zz")
    if where == "tmp":
        os.rmdir(link)
    os.symlink(precious, link)
    err, _ = start(tier_dirs[:1])
    assert _unchanged(precious, files), "start-up deleted files through a link"
    assert re.search(f"{re.escape(link)} .*is a symbolic link.*follows no link", str(err)), err
    here = os.path.dirname(os.path.dirname(os.path.abspath(kvstream_hicache.__file__)))  # the tree under test
    run = kvstream_cli("check", "--fix", "--tiers", tier_dirs[0], env={**os.environ, "PYTHONPATH": here})
    assert run.returncode == 1 and "0 repaired, 1 not repaired" in run.stdout + run.stderr, run
    assert _unchanged(precious, files)
    problems = check_tiers(Config.from_sources({"tiers": tier_dirs[:1]}, environ={}),
                           fix=True)
    assert [(p.kind, p.path, p.fixed) for p in problems] == [("stray", link, False)]
    assert _unchanged(precious, files)
    os.unlink(link)
    if where == "tmp":
        os.mkdir(link, 0o700)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.checked_get(engine, keys) == [True] * 3


def test_a_link_at_a_page_path_is_never_followed(tier_dirs, tier_root):
    """A link under a page's name to a valid page of that key outside the tier: never opened, so never
    served nor indexed (by discovery, a read or start-up), never removed; check reports it."""
    pages = PageSet()
    keys = pages.keys(3)
    outside = os.path.join(tier_root, "outside.kvp")
    Path(outside).write_bytes(page_file(os.path.join(tier_root, "forge"), keys[2], pages.data(keys[2])))
    before = Path(outside).read_bytes()
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys[:2]) == [True, True]
        link = engine.tiers[0].layout.page_path(keys[2])
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(outside, link)
        assert not engine.contains(keys[2])
        assert pages.checked_get(engine, keys) == [True, True, False]
        assert [(p.kind, p.path, p.fixed) for p in engine.check(fix=True)] == [("stray", link, False)]
        os.unlink(link)
    os.symlink(outside, link)
    with make_engine(tier_dirs[:1]) as engine:
        assert engine.wait_scan(30)
        assert engine.scan["pages"] == 2 and engine.scan["kept"] == 1 and os.path.islink(link)
        assert pages.checked_get(engine, keys) == [True, True, False]
        os.unlink(link)
    assert Path(outside).read_bytes() == before


def test_clear_removes_only_the_engines_own_page_files(tier_dirs, tier_root, caplog):
    """``clear`` (HiCache's, LMCache's) removes this namespace's page files and nothing else found in its
    tree: another owner's page file, a directory of the user's files under a shard, a name kvstream never
    writes and a link (to the user's files elsewhere) all stay, and their owner's files are intact."""
    pages = PageSet()
    keys = pages.keys(4)
    precious = os.path.join(tier_root, "precious")
    files = _precious(precious)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True] * 4
        layout = engine.tiers[0].layout
        theirs = layout.page_path(keys[3])
        os.chown(theirs, INTRUDER, INTRUDER)  # as another user's file comes to be there (a mapping, a chown)
        shard = layout.page_dir(keys[0])
        planted = {os.path.join(shard, "notes.txt"): b"n", os.path.join(shard, "mine", "data.bin"): b"d"}
        for path, data in planted.items():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Path(path).write_bytes(data)
        link = os.path.join(shard, "elsewhere")
        os.symlink(precious, link)
        engine.clear()
        assert [engine.contains(k) for k in keys] == [False] * 4
        assert [os.path.exists(layout.page_path(k)) for k in keys] == [False, False, False, True]
        assert os.stat(theirs).st_uid == INTRUDER and os.path.islink(link) and _unchanged(precious, files)
        assert {p: Path(p).read_bytes() for p in planted} == planted
        assert "clear left 4 entries of tier 0" in caplog.text
        assert pages.put(engine, keys[:2]) == [True] * 2  # the shards are used again
        assert pages.checked_get(engine, keys[:2]) == [True] * 2
        for path in (theirs, link, *planted):  # the suite checks that every engine's tiers end clean
            os.unlink(path)
        os.rmdir(os.path.join(shard, "mine"))


def test_a_put_of_a_page_whose_file_became_a_link_writes_it_again(tier_dirs, tier_root):
    """A held page's file replaced by a link (to a valid copy of it outside the tier): a put of that key
    does not take the link for the copy (a read never follows it): it writes the page again, over the
    link, and the page is served; the link's target is untouched."""
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True, True]
        path = engine.tiers[0].layout.page_path(keys[1])
        outside = os.path.join(tier_root, "outside.kvp")
        os.rename(path, outside)
        before = Path(outside).read_bytes()
        os.symlink(outside, path)
        assert pages.put(engine, keys) == [True, True]
        assert not os.path.islink(path) and Path(outside).read_bytes() == before
        assert pages.checked_get(engine, keys) == [True, True]


@pytest.fixture
def shared_tier(tier_root):
    """A tier directory of group GROUP, 2770, as an operator sets one up for file_mode=shared."""
    os.chmod(tier_root, 0o755)
    tier = os.path.join(tier_root, "shared")
    os.mkdir(tier)
    os.chown(tier, -1, GROUP)
    os.chmod(tier, 0o2770)
    return tier


def _write_as_writer(tier: str, key: str, data: bytes, group: int | None) -> None:
    """Write a page file as a writer would (a temporary file, renamed into place); ``group`` re-groups it."""
    layout = TierLayout(tier, NS.digest)
    tmp = os.path.join(layout.tmp, f"{key[:8]}.forge")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)
    try:
        os.write(fd, data)
        if group is not None:
            os.fchown(fd, -1, group)
    finally:
        os.close(fd)
    os.makedirs(layout.page_dir(key), 0o2770, exist_ok=True)
    os.rename(tmp, layout.page_path(key))


def test_shared_mode_trusts_the_tier_group_and_no_one_else(shared_tier, tier_root, caplog):
    """file_mode=shared: a page a member of the tier's group writes is trusted (served: members are
    trusted); a file of another group (a member's own group) is untrusted: never served, never removed,
    reported by check. The start-up line names the group."""
    pages = PageSet()
    keys = pages.keys(3)
    forge = os.path.join(tier_root, "forge")
    by_member = page_file(forge, keys[1], pages.data(keys[1]))
    other_group = page_file(forge, keys[2], pages.data(keys[2]))
    caplog.set_level("INFO", logger="kvstream")
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert pages.put(engine, keys[:1]) == [True]
    as_user(MEMBER, lambda: (_write_as_writer(shared_tier, keys[1], by_member, None),
                             _write_as_writer(shared_tier, keys[2], other_group, MEMBER)), groups=(GROUP,))
    layout = TierLayout(shared_tier, NS.digest)
    assert os.stat(layout.page_path(keys[1])).st_gid == GROUP  # the setgid directory gave it the tier's group
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert engine.wait_scan(30)
        assert engine.scan["pages"] == 2 and engine.scan["kept"] == 1
        assert pages.checked_get(engine, keys) == [True, True, False]
        problems = engine.check(fix=True)
        assert [(p.kind, p.path, p.fixed) for p in problems] == [("untrusted", layout.page_path(keys[2]), False)]
        assert f"uid {MEMBER}" in problems[0].detail
        assert os.path.exists(layout.page_path(keys[2]))
        os.unlink(layout.page_path(keys[2]))
    assert any(f"and group gid {GROUP}" in r.getMessage() for r in caplog.records), caplog.text


def test_a_creation_time_in_the_future_never_wins_over_the_own_copy(tier_dirs, shared_tier, tier_root):
    """A member of the shared tier's group replaces the victim's copy there with other bytes whose header
    claims a creation time years ahead: after a restart the victim's own copy (its private tier 0) is
    served, not the newest-looking one; an honest newer version still wins."""
    pages = PageSet()
    keys = pages.keys(2)
    theirs = {k: content(k + "-member", pages.size) for k in keys}
    future = time.time_ns() + 10 * 365 * 86400 * 10**9
    forged = page_file(os.path.join(tier_root, "forge"), keys[0], theirs[keys[0]], created_ns=future)
    tiers = [tier_dirs[0], shared_tier]
    with make_engine(tiers, file_mode="shared", replicate="all") as engine:
        assert pages.put(engine, keys) == [True, True]
    honest = page_file(os.path.join(tier_root, "forge"), keys[1], theirs[keys[1]])  # written after the victim's
    as_user(MEMBER, lambda: (_write_as_writer(shared_tier, keys[0], forged, None),
                             _write_as_writer(shared_tier, keys[1], honest, None)), groups=(GROUP,))
    with make_engine(tiers, file_mode="shared") as engine:
        found, got = pages.get(engine, keys)
        assert found == [True, True]
        assert got[0] == pages.data(keys[0])  # the victim's own bytes, not the forged future copy
        assert got[1] == theirs[keys[1]]  # a member is trusted: its honest newer version is the newest
        assert engine.check() == []


def test_every_probe_name_is_new(tier_dirs):
    """Two probes in one process never share a name, and a name cannot be guessed (a random part)."""
    names = {tmpfiles.probe_name("config") for _ in itertools.repeat(None, 50)}
    assert len(names) == 50 and all(re.fullmatch(rf"probe\.{os.getpid()}\.config\.\d+\.[0-9a-f]{{8}}", n)
                                    for n in names)


@pytest.fixture
def mapped_tier(tier_root):
    """A tier on a FUSE file system that maps every owner to MAPPED (bindfs --force-user), as NFS root
    squash and some FUSE mounts do: a file the engine creates there comes out owned by MAPPED."""
    with owner_mapping_tier(os.path.join(tier_root, "src"), os.path.join(tier_root, "mapped"), MAPPED) as tier:
        yield tier


def test_an_owner_mapping_file_system_is_trusted_for_the_owner_its_files_get(mapped_tier, caplog):
    """Where the file system maps owners, the start-up probe sees the owner the engine's own files get,
    trusts that owner on that tier, and says so in the start-up line; pages are stored, served and found
    again after a restart (nothing of the engine's is taken for another user's)."""
    pages = PageSet()
    keys = pages.keys(3)
    caplog.set_level("INFO", logger="kvstream")
    with make_engine([mapped_tier]) as engine:
        assert os.stat(engine.tiers[0].layout.base).st_uid == MAPPED
        assert pages.put(engine, keys) == [True] * 3
    line = next(r.getMessage() for r in caplog.records if "start-up scan in the background" in r.getMessage())
    assert f"trusts {user_name(os.geteuid())} and uid {MAPPED} (its files come out owned by uid {MAPPED} " \
           "there)" in line, line
    with make_engine([mapped_tier]) as engine:
        assert engine.wait_scan(30)
        assert engine.scan["pages"] == 3 and engine.scan["kept"] == 0
        assert pages.checked_get(engine, keys) == [True] * 3
        assert engine.check() == []


@pytest.mark.parametrize("case", ["group-writable in private mode", "writable by every user"])
def test_a_directory_others_may_write_is_refused_with_the_fix(tier_dirs, case):
    """StrictModes: a directory of the tree that a group this engine does not trust, or every user, may
    write (a tree made for file_mode=shared, then used in private mode; a careless chmod) is refused,
    naming it and the chmod that fixes it; after the fix the engine starts and finds its pages."""
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine(tier_dirs[:1], file_mode="shared" if case.startswith("group") else "private") as engine:
        assert pages.put(engine, keys) == [True, True]
        layout = engine.tiers[0].layout
    if case.startswith("writable"):
        os.chmod(layout.pages, 0o707)
    err, _ = start(tier_dirs[:1])
    fix = "chmod -R g-w" if case.startswith("group") else "chmod -R o-w"
    target = layout.base if case.startswith("group") else layout.pages
    assert re.search(f"tier directory {re.escape(target)} .*(writable by a group this engine does not trust"
                     f"|writable by every user).*{fix} {re.escape(target)}", str(err)), err
    subprocess.run(["chmod", "-R", fix.split()[-1], target], check=True)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.checked_get(engine, keys) == [True, True]


# ------------------------------------------------------------------ what another user's junk may cost
def _junk(where: str, n: int, group: int) -> None:
    """As a member: ``n`` empty files named ``junk<i>`` in ``where``, each re-grouped to ``group``: files
    the engine does not trust (never read past their fstat, never removed)."""
    os.makedirs(where, 0o2770, exist_ok=True)
    for i in range(n):
        fd = os.open(os.path.join(where, f"junk{i:06d}"), os.O_WRONLY | os.O_CREAT, 0o660)
        os.fchown(fd, -1, group)
        os.close(fd)


@pytest.mark.leaves_problems("a member's untrusted junk: never removed, check reports it")
def test_another_user_s_junk_costs_a_bounded_number_of_log_lines(shared_tier, caplog):
    """A member leaves 400 files of another group (untrusted) under a shard and 400 in tmp/: the start-up
    scan counts all 800 as kept and removes none, but logs the first 10 alone and one line for the rest
    (before: one warning line per file at every start, a million lines for a million files)."""
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert pages.put(engine, keys) == [True, True]
    layout = TierLayout(shared_tier, NS.digest)
    n = 400
    as_user(MEMBER, lambda: (_junk(layout.page_dir(keys[0]), n, MEMBER), _junk(layout.tmp, n, MEMBER)),
            groups=(GROUP,))
    caplog.set_level("INFO", logger="kvstream")
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert engine.scan["kept"] == 2 * n and engine.scan["pages"] == 2
        assert pages.checked_get(engine, keys) == [True, True]
    assert len(os.listdir(layout.tmp)) == n and len(os.listdir(layout.page_dir(keys[0]))) == n + 1  # none removed
    about_junk = [r for r in caplog.records if "junk" in r.getMessage()]
    assert len(about_junk) == 10, f"{len(about_junk)} log lines for {2 * n} junk files"
    assert any(f"left {2 * n} entries in place" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.leaves_problems("junk and leftovers the scan, stopped at close, had no time to walk")
def test_a_tmp_directory_full_of_junk_is_walked_at_the_scan_s_pace_in_little_memory(shared_tier):
    """tmp/ is walked one entry at a time: 20,000 untrusted files a member left there cost the scan a
    few hundred KiB of memory, not a list of them (before: ~450 B each, 9 MiB here, 430 MiB for a
    million); and each entry counts against scan_rate, so a scan held to one file a second and stopped at
    once by close() removes next to none of 3,000 of this user's dead leftovers (before: it judged and
    removed them all, unpaced, after close())."""
    pages = PageSet()
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert pages.put(engine, pages.keys(1)) == [True]
    tmp = TierLayout(shared_tier, NS.digest).tmp
    as_user(MEMBER, _junk, tmp, 20_000, MEMBER, groups=(GROUP,))
    logging.disable(logging.WARNING)  # (the memory of the walk alone, not of log records kept by pytest)
    tracemalloc.start()
    try:
        with make_engine([shared_tier], file_mode="shared", scan_rate=0, scan_cpu=1) as engine:
            assert engine.wait_scan(300) and engine.scan["kept"] == 20_000
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    assert peak < 3 << 20, f"the scan of tmp/ took {peak >> 20} MiB for 20,000 junk files"
    n = 3000
    for i in range(n):  # a dead process's leftovers (this user's: removable)
        open(os.path.join(tmp, tmp_name(NS.digest, 2**22 + 7, "dead", i)), "w").close()
    make_engine([shared_tier], file_mode="shared", scan_rate=1).close()  # the walk would take 23,000 s
    wait_until(lambda: not any(t.name.startswith("kvstream-scan-") for t in threading.enumerate()), 120,
               "the scan thread never ended")
    left = sum(name.startswith(NS.digest) for name in os.listdir(tmp))
    assert left >= n - 50, f"{n - left} of {n} leftovers removed by a scan paced at 1 file/s, stopped at once"


@pytest.mark.leaves_problems("a member's untrusted junk: never removed, check reports it")
def test_junk_beside_the_shards_costs_the_start_little_memory(shared_tier):
    """A member leaves 50,000 files of another group in the namespace directory, beside the shards: the
    start-up checks, which look at every shard before the engine serves, keep no list of the entries
    (before: every name listed, kinded and sorted, ~130 B each: 6.5 MiB here, 130 MiB for a million);
    the engine starts, serves, and leaves the files."""
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert pages.put(engine, keys) == [True, True]
    layout = TierLayout(shared_tier, NS.digest)
    as_user(MEMBER, _junk, layout.pages, 50_000, MEMBER, groups=(GROUP,))
    tracemalloc.start()
    try:  # (the scan held to a file in 1,000 s: what Engine() itself takes before it returns)
        engine = make_engine([shared_tier], file_mode="shared", scan_rate=0.001)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with engine:
        assert pages.checked_get(engine, keys) == [True, True]
    assert len(os.listdir(layout.pages)) == 50_000 + len({k[:2] for k in keys})
    assert peak < 2 << 20, f"Engine() took {peak >> 20} MiB beside 50,000 junk files"


@pytest.mark.leaves_problems("a member's untrusted junk: never removed, check reports it")
def test_a_shard_full_of_junk_is_scanned_in_little_memory(shared_tier):
    """A member leaves 50,000 files of another group in one shard directory: the background scan reads
    the shard one entry at a time (before: a list of every (name, path), ~260 B an entry: 13 MiB here,
    260 MiB for a million), indexes the shard's pages, and leaves the files."""
    pages = PageSet()
    keys = pages.keys(3)
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert pages.put(engine, keys) == [True] * 3
    layout = TierLayout(shared_tier, NS.digest)
    as_user(MEMBER, _junk, layout.page_dir(keys[0]), 50_000, MEMBER, groups=(GROUP,))
    logging.disable(logging.WARNING)  # (the memory of the walk alone, not of log records kept by pytest)
    tracemalloc.start()
    try:
        with make_engine([shared_tier], file_mode="shared", scan_rate=0, scan_cpu=1) as engine:
            assert engine.wait_scan(600) and engine.scan["kept"] == 50_000 and engine.scan["pages"] == 3
            _, peak = tracemalloc.get_traced_memory()
            assert pages.checked_get(engine, keys) == [True] * 3
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    assert len(os.listdir(layout.page_dir(keys[0]))) >= 50_000
    assert peak < 3 << 20, f"the scan took {peak >> 20} MiB for a shard of 50,000 junk files"


# ------------------------------------------------------------------ names and links a member makes during the walks
def _plant(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o660))


ODD_PIDS = {  # names as kvstream gives them, with a pid no process can have: digits int() refuses, past any pid_t
    "tmp-superscript": ("tmp", f"{NS.digest}.otherhost.\u00b2\u00b3.tok.0.tmp"),
    "tmp-huge": ("tmp", f"{NS.digest}.{HOST}.{10**20}.tok.0.tmp"),
    "removing-superscript": ("shard", f"{REMOVING_PREFIX}{HOST}.\u00b9.abcd1234"),
    "removing-huge": ("shard", f"{REMOVING_PREFIX}{HOST}.{10**20}.abcd1234"),
}


@pytest.mark.leaves_problems("a member's file of an odd name: check reports it")
@pytest.mark.parametrize("case", sorted(ODD_PIDS))
def test_a_name_with_a_pid_no_process_has_stops_neither_the_scan_nor_check(shared_tier, case, caplog):
    """A member names a file in tmp/ (a temporary file's name) or in a shard (a removal's private name)
    with a pid of digits int() refuses ('\u00b2\u00b3': str.isdigit() takes them) or past any pid_t: the
    background scan reads every page of the tier and check runs (before: ValueError or OverflowError
    stopped the tier's scan at every start, its pages left to discovery, and check raised)."""
    where, name = ODD_PIDS[case]
    pages = PageSet()
    keys = pages.keys(6)
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert pages.put(engine, keys) == [True] * 6
    layout = TierLayout(shared_tier, NS.digest)
    path = os.path.join(layout.tmp if where == "tmp" else layout.page_dir(keys[0]), name)
    as_user(MEMBER, _plant, path, groups=(GROUP,))
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert engine.wait_scan(60)
        assert not any("background scan of tier 0" in r.getMessage() and "stopped" in r.getMessage()
                       for r in caplog.records), caplog.text
        assert engine.scan["pages"] == 6, engine.scan
        problems = engine.check(fix=True)
        assert pages.checked_get(engine, keys) == [True] * 6
    assert [p.path for p in problems if not p.fixed] in ([], [path])
    if os.path.exists(path):
        os.unlink(path)


@pytest.mark.parametrize("walk", ["tmp", "shard"])
def test_the_walks_read_the_tier_s_clock_through_no_link(shared_tier, tier_root, monkeypatch, walk):
    """A member replaces tmp/ with a link to a directory of the engine user's at the moment a walk needs
    the tier's clock (a file made in tmp/ and removed: tmpfiles.tier_now), to judge another host's
    temporary file (tmp/) or another host's removal's private name (a shard) by its age: nothing is
    made in the link's target (before: the clock's file was made and removed there, and its file
    system's clock judged the ages)."""
    pages = PageSet()
    keys = pages.keys(2)
    precious = os.path.join(tier_root, "precious")
    os.mkdir(precious, 0o700)
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert pages.put(engine, keys) == [True, True]
        assert engine.wait_scan(60)
        layout = engine.tiers[0].layout
        tmp = layout.tmp
        planted = (os.path.join(tmp, f"{NS.digest}.otherhost.123.tok.0.tmp") if walk == "tmp" else
                   os.path.join(layout.page_dir(keys[0]), f"{REMOVING_PREFIX}otherhost.1.abcd1234"))
        _plant(planted)  # (just made: young, left by both walks)
        swapped: list[int] = []

        def swap() -> None:
            os.rename(tmp, tmp + ".away")
            os.symlink(precious, tmp)

        def at_the_judgment(real):  # the member's swap, the moment the walk judges the planted entry
            def call(name, *args):
                if os.path.basename(planted) in (name, os.path.basename(str(name))) and not swapped:
                    as_user(MEMBER, swap, groups=(GROUP,))
                    swapped.append(os.stat(precious).st_mtime_ns)
                return real(name, *args)
            return call

        module, attr = (tmpfiles, "parse_tmp_name") if walk == "tmp" else (integrity, "removal_live")
        monkeypatch.setattr(module, attr, at_the_judgment(getattr(module, attr)))
        try:
            engine.check(fix=True)
        finally:
            monkeypatch.undo()
            if swapped:
                os.unlink(tmp)
                os.rename(tmp + ".away", tmp)
        after = os.stat(precious).st_mtime_ns
        if os.path.exists(planted):
            os.unlink(planted)
    assert len(swapped) == 1
    assert os.listdir(precious) == [] and after == swapped[0], "a file was made (and removed) through the link"


def test_a_member_s_record_of_clears_owed_never_clears_the_victim_s_private_tier(tier_dirs, shared_tier):
    """A member of the shared tier's group may write, replace and delete pages of that tier, nothing else. The
    record of clears owed (``kvstream/<digest>.clears-owed``, owed.py) is written on every local tier, the
    shared one too, and its ``kvstream/`` is the group's to write: a record a member put there naming the
    victim's private tier 0 had every page of tier 0 removed at the victim's next start (the record was read
    if its file was of the tier's group). Only a record this engine's user wrote is honoured. Found by an
    attacker's trial."""
    pages = PageSet()
    keys = pages.keys(3)
    tiers = [tier_dirs[0], shared_tier]
    with make_engine(tiers, file_mode="shared", replicate="all") as engine:
        assert pages.put(engine, keys) == [True] * 3
        own = [engine.tiers[0].layout.page_path(k) for k in keys]
    record = os.path.join(shared_tier, "kvstream", NS.digest + ".clears-owed")

    def plant() -> None:
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)  # (as the engine writes it, shared)
        with open(fd, "w") as fh:
            fh.write(json.dumps([os.path.realpath(tier_dirs[0])]))

    as_user(MEMBER, plant, groups=(GROUP,))
    assert os.stat(record).st_gid == GROUP  # (the setgid directory gave it the tier's group)
    with make_engine(tiers, file_mode="shared") as engine:
        found, got = pages.get(engine, keys)  # (a call probes a failed tier that is due: a clear owed runs)
        assert found == [True] * 3 and got == [pages.data(k) for k in keys]
        wait_until(lambda: pages.get(engine, keys[:1])[0] == [True] and engine.tiers[0].healthy)
        assert [os.path.exists(p) for p in own] == [True] * 3, "the victim's private tier lost its pages"


def test_a_member_who_plants_the_names_of_the_victim_s_next_temporary_files_fails_none_of_its_writes(
        shared_tier, caplog):
    """A member lists ``tmp/`` (the group's to read and write) and sees the names of the victim's temporary files:
    ``<digest>.<host>.<pid>.<token>.<seq>.tmp``, the seq counting up. Files of the member's at the next names
    (O_EXCL: EEXIST) failed one write of the victim's each, with a warning line each: a million names planted, a
    million failed writes and lines. The names are unpredictable now. Found by an attacker's trial."""
    pages = PageSet()
    keys = pages.keys(4)
    with make_engine([shared_tier], file_mode="shared") as engine:
        assert pages.put(engine, keys[:1]) == [True]
        tier = engine.tiers[0]
        seen = tier.fresh_tmp_name()  # (as the member sees one in tmp/: the token, the pid, the seq)
        head, seq = seen[: -len(".tmp")].rsplit(".", 1)
        planted = [os.path.join(tier.layout.tmp, f"{head}.{int(seq) + i}.tmp") for i in range(1, 41)]

        def plant() -> None:
            for path in planted:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660))

        as_user(MEMBER, plant, groups=(GROUP,))
        caplog.set_level("WARNING", logger="kvstream")
        try:
            assert pages.put(engine, keys[1:]) == [True] * 3
            assert engine.stats()["tiers"][0]["write_failures"] == 0
            assert not [r for r in caplog.records if "File exists" in r.getMessage()], caplog.text
        finally:
            for path in planted:
                os.unlink(path)


def test_a_member_s_page_larger_than_memory_is_never_read_whole_into_memory(tier_dirs, shared_tier):
    """A member writes a valid page of any size on the shared tier: a sparse file of zeros, its header and block
    CRCs right, costs them no disk. The victim's catch-up copied it to its private tier 0, read whole into one
    buffer of the page's size (256 MiB here with ``memory=8M``; 64 GiB would end the server): a copy is read into
    one buffer of at most ``memory`` (docs/design.md), and a larger page is never copied (counted
    ``replication_dropped``); it stays where it is. Found by an attacker's trial."""
    from kvstream_hicache.integrity import PageHeader, pack_header
    from kvstream_hicache.io import crc32c

    length, block = 256 << 20, 4 << 20
    key = "f" * 64
    header = PageHeader(key, NS.digest, length, block, (crc32c(bytes(block)),) * (length // block), time.time_ns())
    buf = AlignedBuffer(HEADER_SIZE)
    pack_header(header, buf)
    layout = TierLayout(shared_tier, NS.digest)
    with make_engine([tier_dirs[0], shared_tier], file_mode="shared"):
        pass  # (the tree, made by the victim)

    def plant() -> None:
        os.makedirs(layout.page_dir(key), 0o2770, exist_ok=True)
        fd = os.open(layout.page_path(key), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.write(fd, bytes(buf))
            os.ftruncate(fd, HEADER_SIZE + length)
        finally:
            os.close(fd)

    as_user(MEMBER, plant, groups=(GROUP,))
    with make_engine([tier_dirs[0], shared_tier], file_mode="shared", memory="8M") as engine:
        tier0 = lambda: engine.stats()["tiers"][0]  # noqa: E731
        wait_until(lambda: tier0()["replication_done"] + tier0()["replication_dropped"] > 0)
        pool = engine._writes.pool
        assert pool.peak_bytes <= pool.max_bytes, f"{pool.peak_bytes >> 20} MiB staged of {pool.max_bytes >> 20}"
        assert tier0()["replication_dropped"] == 1 and not os.path.exists(TierLayout(tier_dirs[0], NS.digest)
                                                                            .page_path(key))
    os.unlink(layout.page_path(key))


@pytest.mark.leaves_problems("the other group's planted page: untrusted, never removed")
def test_the_chgrp_a_refusal_names_never_makes_another_groups_pages_trusted(tier_root):
    """Shared mode trusts a file by its group. A shard directory of the engine's own that another group may write
    is refused with a fix; the fix advised `chgrp -R <the tier's group> <dir>`: run as written, it gave every file
    in it the trusted group, the page a member of the other group planted there with them, which was then served
    (as `chown -R` did: test_the_fix_a_refused_tree_names_never_makes_the_other_users_pages_this_engines). Its
    group named as 'gid N' where no name exists was no command either. From a review of stop 56."""
    other = GROUP + 4  # a group the engine does not trust, the intruder a member of it
    os.chmod(tier_root, 0o755)
    tier = os.path.join(tier_root, "shared")
    os.mkdir(tier)
    os.chown(tier, 0, GROUP)
    os.chmod(tier, 0o2775)  # (setgid: the tree the engine makes is of the tier's group, as on a group's scratch)
    pages = PageSet()
    key = pages.keys(1)[0]
    planted = page_file(os.path.join(tier_root, "forge"), key, content("forged", pages.size))
    with make_engine([tier], file_mode="shared") as engine:
        shard = os.path.dirname(engine.tiers[0].layout.page_path(key))
        os.makedirs(shard, exist_ok=True)
    for up in (os.path.dirname(os.path.dirname(shard)), os.path.dirname(shard)):  # (kvstream/, the namespace:
        os.chmod(up, os.stat(up).st_mode | 0o001)  # the intruder may pass, not write)
    os.chown(shard, 0, other)
    os.chmod(shard, 0o2775)
    as_user(INTRUDER, Path(shard, os.path.basename(TierLayout(tier, NS.digest).page_path(key))).write_bytes, planted,
            groups=(other,))
    err, served = start([tier], lambda engine: pages.get(engine, [key])[0], file_mode="shared")
    advised = re.search(r"(chgrp .+?) \(the tier directory's group\)", str(err))
    assert advised, err
    done = subprocess.run(advised[1], shell=True, capture_output=True, text=True)
    assert done.returncode == 0, (advised[1], done.stderr)
    err, served = start([tier], lambda engine: pages.get(engine, [key])[0], file_mode="shared")
    assert err is None, err
    assert served == [False], f"the other group's page was served after the fix the error gave ({advised[1]})"


def _try_rename(src: str, dst: str) -> None:
    with contextlib.suppress(PermissionError):
        os.rename(src, dst)


def test_the_fix_a_tier_under_another_user_s_directory_names_leaves_it_theirs_to_swap_nowhere(tier_root):
    """The owner check's error names the fix an operator runs as written (as root). It advised `chown root <path>`:
    for a link of theirs that changed the owner of the link's target (chown follows a link) and left the link
    theirs, refused again at every start; for a directory of theirs they had made 0777, it made the directory root's
    and still theirs to write: the tier was used, and they could move it away and put a link in its place (what
    test_a_tier_root_another_user_owns_is_refused guards against). From a review of stop 56."""
    ours, links = _sticky_dirs(tier_root)
    pointer = os.path.join(links, "tier")
    as_user(INTRUDER, os.symlink, ours, pointer)
    theirs = os.path.join(tier_root, "theirs")  # the other user's, 0777, holding a tier root of root's
    os.mkdir(theirs)
    inner = os.path.join(theirs, "tier")
    os.mkdir(inner, 0o700)
    os.chown(theirs, INTRUDER, INTRUDER)
    as_user(INTRUDER, os.chmod, theirs, 0o777)
    for tier in (pointer, inner):
        err, _ = start([tier])
        fixes = []
        while err is not None and len(fixes) < 4:  # the operator runs what each refusal advises as root
            advised = re.search(r"\(as root: ([^)]+)\)", str(err))
            assert advised, err
            fixes.append(advised[1])
            done = subprocess.run(advised[1], shell=True, capture_output=True, text=True)
            assert done.returncode == 0, (advised[1], done.stderr)
            err, _ = start([tier])
        assert err is None, (fixes, err)
        moved = os.path.join(os.path.dirname(tier), "moved")
        as_user(INTRUDER, _try_rename, tier, moved)  # what a swap does first
        assert not os.path.lexists(moved), f"{tier} is still the other user's to move away after {fixes}"


def test_check_reports_a_tier_an_engine_refuses_for_another_user_s_directory_above_it(tier_root, capsys):
    """`kvstream check` reports what an engine would refuse at start-up (dir_problems). A tier root in a directory of
    another user's (trust.owner_problem, this stop) was refused by every engine, and check said 'no problems
    found' (exit 0), its --fix walking a tree that user may swap for a link. From a review of stop 56."""
    os.chmod(tier_root, 0o755)
    theirs = os.path.join(tier_root, "theirs")
    os.mkdir(theirs)
    tier = os.path.join(theirs, "tier")
    os.mkdir(tier, 0o700)
    os.chown(theirs, INTRUDER, INTRUDER)
    err, _ = start([tier])
    assert f"{theirs} belongs to a user this engine does not trust" in str(err), err
    capsys.readouterr()
    code, out = cli.main(["check", "--tiers", tier]), capsys.readouterr().out
    assert code == 1 and f"{theirs} belongs to a user this engine does not trust" in out, (code, out)
    problems = check_tiers(Config.from_sources({"tiers": [tier]}, environ={}), fix=True)
    assert [(p.kind, p.path, p.fixed) for p in problems] == [("untrusted", tier, False)], problems


def test_info_reports_a_tier_an_engine_refuses_for_another_user_s_directory_above_it(tier_root, capsys):
    """``kvstream info`` looks at a tier as start-up judges its owners (trust.owner_problem): a tier root in
    another user's directory is reported as refused, not "ok" (from a review of stop 56)."""
    os.chmod(tier_root, 0o755)
    theirs = os.path.join(tier_root, "theirs")
    tier = os.path.join(theirs, "tier")
    os.makedirs(tier, 0o700)
    os.chown(theirs, INTRUDER, INTRUDER)
    with pytest.raises(ConfigError):
        make_engine([tier])
    assert cli.main(["info", "--tiers", tier]) == 1
    out = capsys.readouterr().out
    assert "an engine refuses it" in out and f"uid {INTRUDER}" in out, out


def test_a_tier_in_a_project_directory_of_a_group_is_refused_privately_and_used_shared(tier_root):
    """A project directory its group may write, without the sticky bit (a parallel file system's project
    space: root, its group, 2770), holding the user's tier: any member may rename in it, so a private
    engine refuses the tier naming the way to trust that group; file_mode=shared with the tier directory of
    that group uses it."""
    os.chmod(tier_root, 0o755)
    project = os.path.join(tier_root, "project")
    tier = os.path.join(project, "alice")
    os.makedirs(tier, 0o700)
    os.chown(project, 0, GROUP)
    os.chmod(project, 0o2770)
    with pytest.raises(ConfigError) as err:
        make_engine([tier])
    for part in (f"{project} may be written by users", "file_mode=shared", f"chgrp {GROUP} <tier directory>"):
        assert part in str(err.value), (part, err.value)
    fix = f"chgrp {GROUP} {tier} && chmod 2770 {tier}"  # (what the error says, the tier made setgid)
    for _ in range(4):  # then what each refusal of the shared engine advises, as written (the first start made
        # kvstream/ and its tmp/ of the group it had then)
        done = subprocess.run(fix, shell=True, capture_output=True, text=True)
        assert done.returncode == 0, (fix, done.stderr)
        err, _ = start([tier], file_mode="shared")
        if err is None:
            break
        fix = re.findall(r"\b(chgrp [^ ),;]+ [^ ),;]+)", str(err))[0]
    assert err is None, err
    pages = PageSet()
    with make_engine([tier], file_mode="shared") as engine:
        assert pages.put(engine, pages.keys(1)) == [True]
        assert pages.checked_get(engine, pages.keys(1)) == [True]


def test_another_users_file_under_a_page_name_is_not_called_damage(tier_dirs, caplog):
    """The engine's copy replaced by another user's file (a member of a shared tier may rename one over it): a
    read leaves it alone and serves the replica, and says what it is: not "is damaged", not counted
    `quarantined` (nothing was judged nor removed; found by an attacker's trial)."""
    pages = PageSet()
    keys = pages.keys(2)
    with make_engine(tier_dirs[:2]) as engine:
        assert pages.put(engine, keys) == [True, True]
        path = engine.tiers[0].layout.page_path(keys[1])
        os.chown(path, INTRUDER, INTRUDER)
        caplog.set_level("INFO", logger="kvstream")
        assert pages.checked_get(engine, keys, SingleTier(0)) == [True, True]  # (keys[1] from tier 1)
        said = [r.getMessage() for r in caplog.records if keys[1] in r.getMessage()]
        assert said and not any("damaged" in m for m in said), said
        assert any(f"uid {INTRUDER}" in m and "left in place" in m for m in said), said
        assert engine.stats()["tiers"][0]["quarantined"] == 0
        assert os.path.exists(path)
        os.unlink(path)
