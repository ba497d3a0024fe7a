"""trust.py's rules where the engine runs on: a tier rejoining after its directory vanished, a tier root a
group may write, directories made through descriptors, and removals that take only the file judged (a
valid page renamed over a damaged one's name since is never deleted). A second user, where needed, is a
child process that takes another uid, as root can (tests/test_security_shared_tier.py does the same)."""
from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

import kvstream_hicache.tiers as tiers
import kvstream_hicache.trust as trust
from kvstream_hicache.errors import ConfigError
from kvstream_hicache.layout import HEADER_SIZE, TierLayout
from kvstream_hicache.tiers import LOOK_S, Tier

from helpers import FakeClock, PageSet, as_user, flip_byte, make_engine

INTRUDER = 54321  # a uid no account has: the second user
OTHER_GID = INTRUDER  # a group no account has
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root (CI runs as root)")


def _tier(root: str, clock: FakeClock, shared: bool = False) -> Tier:
    os.mkdir(TierLayout(root, "ns").base, 0o700)  # (the engine's start-up probe makes it: probe.py)
    return Tier(0, root, "ns", None, (0o660, 0o2770) if shared else (0o600, 0o700), "never", 10.0, "token",
                clock, on_rejoin=lambda tier: "")


# -- a failed tier rejoins only through a tree start-up would accept ----------------------------------------
@root_only
def test_a_vanished_tier_never_rejoins_through_a_kvstream_dir_another_user_made(tier_root, caplog):
    os.chmod(tier_root, 0o755)  # (the other user may reach the scratch area)
    scratch = os.path.join(tier_root, "scratch")
    os.mkdir(scratch)
    os.chmod(scratch, 0o1777)  # a scratch area every user may write (sticky, as /tmp)
    clock = FakeClock()
    tier = _tier(scratch, clock)
    shutil.rmtree(tier.layout.base)  # a scratch purge
    assert tier.fail(errno.ENOENT, "open a page") and tier.gone()
    as_user(INTRUDER, os.mkdir, tier.layout.base, 0o777)  # the other user makes kvstream/ first
    for _ in range(3):
        clock.advance(LOOK_S * 1.01)
        assert not tier.usable(now=True), "rejoined through a kvstream/ another user owns"
    assert os.lstat(tier.layout.base).st_uid == INTRUDER and not os.path.exists(tier.layout.tmp)  # nothing made there
    assert re.search(rf"{re.escape(tier.layout.base)} belongs to a user .*uid {INTRUDER}", tier.last_error)
    said = [r.getMessage() for r in caplog.records if "stays failed" in r.getMessage()]
    assert len(said) == 1 and f"uid {INTRUDER}" in said[0], said  # logged once, naming the path and owner
    os.rmdir(tier.layout.base)  # the operator's fix: kvstream's own directory again
    os.mkdir(tier.layout.base, 0o700)
    clock.advance(tier._backoff * 1.01)
    assert tier.usable() and os.lstat(tier.layout.tmp).st_uid == os.geteuid()


@root_only
def test_a_failed_tier_never_rejoins_through_a_root_another_user_came_to_own(tier_root):
    """A tier root that became another user's while its tier was failed (chown'ed, or a scratch area handed over):
    its owner may move ``kvstream/`` away and put a link in its place between a write's look and its open
    (test_security_shared_tier.py::test_a_tier_root_another_user_owns_is_refused): the probe runs start-up's
    checks, which refuse it, so the tier stays failed, naming the owner; root's again, it rejoins."""
    clock = FakeClock()
    tier = _tier(tier_root, clock)
    assert tier.fail(errno.EIO, "read")
    os.chown(tier_root, INTRUDER, INTRUDER)
    clock.advance(tier._backoff * 1.01)
    assert not tier.usable(), "rejoined in a tier root another user owns"
    assert f"{tier_root} belongs to a user this engine does not trust" in tier.last_error, tier.last_error
    os.chown(tier_root, 0, 0)
    clock.advance(tier._backoff * 1.01)
    assert tier.usable()


def test_a_failed_tier_never_rejoins_through_a_link_where_its_namespace_was(tier_root):
    clock = FakeClock()
    tier = _tier(tier_root, clock)
    elsewhere = os.path.join(tier_root, "elsewhere")
    os.mkdir(elsewhere, 0o700)
    assert tier.fail(errno.EIO, "read")
    os.rmdir(tier.layout.pages)
    os.symlink(elsewhere, tier.layout.pages)
    clock.advance(tier._backoff * 1.01)
    assert not tier.usable() and "is a symbolic link" in tier.last_error
    assert os.listdir(elsewhere) == []


@root_only
@pytest.mark.parametrize("occupant", ["link", "directory"])
def test_a_healthy_tier_never_writes_through_a_kvstream_link_another_user_made_after_a_purge(tier_root, occupant):
    """A scratch purge while the tier is healthy (not failed yet, unlike the tests above): in the sticky
    1777 root another user then makes ``kvstream`` again, as a link to a directory of the victim's on the
    same file system (0700: the other user cannot even enter it), or as a directory of theirs (0777).
    Before, the next put wrote through it: the write path makes its temporary file, directories and
    rename by path (Tier._create_tmp, _mkdir with Tier._dirs cached, _place), and Tier._gone followed the
    link (os.stat: same device, "not gone"), so ``tmp/`` and temporary files holding the victim's page
    data were made in the link's target (or the other user's directory) and left there. Now every write
    starts with one lstat of ``kvstream/`` against the directory checked (inode, owner): the tier fails,
    nothing is made there, and it never rejoins through it; once ``kvstream/`` is the user's own again
    it rejoins, and writes go through the directory its probe checked."""
    os.chmod(tier_root, 0o755)  # (the other user may reach the scratch area)
    scratch = os.path.join(tier_root, "scratch")
    os.mkdir(scratch)
    os.chmod(scratch, 0o1777)
    victim = os.path.join(tier_root, "victim-private")  # the victim's, 0700
    os.mkdir(victim, 0o700)
    pages = PageSet(48 << 10, salt="purge")
    keys = pages.keys(8)
    clock = FakeClock()
    with make_engine([scratch], clock=clock) as engine:
        assert pages.put(engine, keys[:4]) == [True] * 4
        base = os.path.join(scratch, "kvstream")
        # (held open: its inode number is not reused by the directory made below, whose identity the
        # rejoin must take from its probe)
        held = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
        shutil.rmtree(base)  # the scratch purge
        if occupant == "link":
            as_user(INTRUDER, os.symlink, victim, base)
        else:
            as_user(INTRUDER, os.mkdir, base, 0o777)
        into = victim if occupant == "link" else base
        assert pages.put(engine, keys[4:]) == [False] * 4
        made = sorted(os.path.relpath(os.path.join(d, n), into) for d, ds, fs in os.walk(into) for n in ds + fs)
        assert made == [], f"the engine wrote through another user's {occupant} into {into}: {made}"
        tier = engine.tiers[0]
        assert not tier.healthy and not tier.usable(now=True)  # (its probe refuses what is there)
        assert os.listdir(into) == []
        os.unlink(base) if occupant == "link" else os.rmdir(base)  # the operator's fix: kvstream's own again
        os.mkdir(base, 0o700)
        os.close(held)
        clock.advance(tier._backoff * 1.01)
        assert pages.put(engine, keys[4:]) == [True] * 4 and tier.healthy
        assert pages.checked_get(engine, keys[4:]) == [True] * 4


# -- the tier root ---------------------------------------------------------------------------------------
@root_only
def test_a_root_its_group_may_write_needs_the_sticky_bit_unless_the_group_is_trusted(tier_root):
    root = os.path.join(tier_root, "project")
    os.mkdir(root)
    os.chown(root, -1, OTHER_GID)  # a project directory its group may write: a member could swap kvstream/
    os.chmod(root, 0o775)
    with pytest.raises(ConfigError) as err:
        make_engine([root])
    text = str(err.value)
    assert f"tier directory {root} (from " in text and "'tiers'" in text and "mode 0775" in text, text
    assert all(fix in text for fix in (f"chmod +t {root}", f"chmod g-w {root}", "file_mode=shared")), text
    assert not os.path.exists(os.path.join(root, "kvstream"))  # refused before anything was made there
    for mode, settings in ((0o1775, {}), (0o775, {"file_mode": "shared"})):  # sticky; or the group trusted
        os.chmod(root, mode)
        _stores(root, settings)
    os.chown(root, -1, os.getegid())  # the user's private group (umask 002): writable by the user alone
    os.chmod(root, 0o775)
    _stores(root, {})


def _stores(root: str, settings: dict) -> None:
    pages = PageSet()
    with make_engine([root], **settings) as engine:
        assert pages.put(engine, pages.keys(1)) == [True]
        engine.clear()


# -- directories made through descriptors ----------------------------------------------------------------
def test_make_dir_closes_its_descriptor_when_fchmod_fails(tmp_path, monkeypatch):
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)

    def refuse(fd, mode):
        raise PermissionError(errno.EPERM, "fchmod refused (a mount that forces modes)")

    monkeypatch.setattr(trust.os, "fchmod", refuse)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        with pytest.raises(PermissionError):
            trust.make_dir(f"d{i}", parent, 0o770)
    monkeypatch.undo()
    leaked = len(os.listdir("/proc/self/fd")) - before
    os.close(parent)
    assert leaked == 0, f"{leaked} directory descriptors leaked"


def test_a_new_shard_s_mode_is_never_set_through_a_link_put_at_its_name(tier_root, monkeypatch):
    tier = _tier(tier_root, FakeClock(), shared=True)  # shared: group bits set after the mkdir
    victim = os.path.join(tier_root, "victim")
    os.mkdir(victim, 0o700)
    shard = tier.layout.page_dir("ab")
    real_mkdir = os.mkdir

    def mkdir_then_swap(path, mode=0o777, *, dir_fd=None):  # a trusted member's race on the new shard
        real_mkdir(path, mode, dir_fd=dir_fd)
        if os.path.basename(path) == "ab":
            os.rename(path, "ab.away", src_dir_fd=dir_fd, dst_dir_fd=dir_fd) if dir_fd is not None \
                else os.rename(path, path + ".away")
            os.symlink(victim, path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    with pytest.raises(OSError):
        tier._mkdir(shard)
    monkeypatch.undo()
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o700, "the link's target was chmodded"


def test_listed_follows_no_link_at_a_shard(tier_root):
    tier = _tier(tier_root, FakeClock())
    key = "ab" + "c" * 30
    elsewhere = os.path.join(tier_root, "elsewhere")
    os.mkdir(elsewhere)
    Path(elsewhere, os.path.basename(tier.layout.page_path(key))).write_bytes(b"x")
    os.symlink(elsewhere, tier.layout.page_dir(key))
    assert not tier.listed(key)
    os.unlink(tier.layout.page_dir(key))
    os.rename(elsewhere, tier.layout.page_dir(key))
    assert tier.listed(key)


# -- removal takes only the file judged ------------------------------------------------------------------
def test_remove_takes_only_the_file_judged(tier_root):
    layout = TierLayout(tier_root, "ns")
    os.makedirs(layout.pages)
    path = os.path.join(layout.pages, "page")
    Path(path).write_bytes(b"damaged")
    judged = trust.same_file(trust.identity(os.lstat(path)))  # (what integrity.Problem.ident records)
    Path(path + ".new").write_bytes(b"valid")
    os.rename(path + ".new", path)  # another writer's page renamed over the damaged one since
    why = trust.remove(tier_root, path, trust.Trust.user(), judged=judged)
    assert why and "replaced since it was judged" in why
    assert os.listdir(layout.pages) == ["page"] and Path(path).read_bytes() == b"valid"  # back, no leftover
    assert trust.remove(tier_root, path, trust.Trust.user(),
                        judged=trust.same_file(trust.identity(os.lstat(path)))) is None
    assert os.listdir(layout.pages) == []
    os.mkfifo(path)  # a stray, judged with no descriptor: only a non-file goes (damage.remove_copy's default)
    assert trust.remove(tier_root, path, trust.Trust.user(), judged=trust.not_a_file) is None
    Path(path).write_bytes(b"valid")
    assert trust.remove(tier_root, path, trust.Trust.user(), judged=trust.not_a_file) is not None
    assert Path(path).read_bytes() == b"valid"


def _inode_thief(monkeypatch, path: str, tmp_dir: str, valid: bytes) -> list:
    """When the removal of the damaged file at ``path`` begins (its rename aside), two other writers put
    the page: the first rename frees the damaged file's inode unless something holds it; the second
    page's file takes that inode back (ext4 hands out the lowest free one), with the page's size and,
    as on a file system of coarse timestamps (or ``cp -p``), the damaged file's mtime. Returns a list
    that holds True once it ran."""
    damaged, real_rename, done = os.stat(path), os.rename, []

    def write_valid(name: str) -> str:
        Path(tmp_dir, name).write_bytes(valid)
        return os.path.join(tmp_dir, name)

    def rename(src, dst, *args, **kwargs):
        if str(dst).startswith(".kvstream-removing") and not done:
            done.append(True)
            real_rename(write_valid("writer1"), path)
            spare = []
            for i in range(64):
                again = write_valid(f"writer2.{i}")
                if os.stat(again).st_ino == damaged.st_ino:
                    break
                spare.append(again)
            for name in spare:
                os.unlink(name)
            os.utime(again, ns=(damaged.st_atime_ns, damaged.st_mtime_ns))
            real_rename(again, path)
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    return done


@pytest.mark.parametrize("who", ["scan", "read", "check"])
def test_a_removal_never_takes_a_valid_page_that_got_the_judged_files_inode(tier_dirs, monkeypatch, who):
    """The file judged damaged is held open from before its judgment to its removal (the start-up scan,
    a read, check --fix): its inode cannot go to a valid page renamed over the name meanwhile, which
    identity alone (device, inode, size, mtime) would take for it. Found by a review of the change that
    had dropped the held descriptor."""
    from kvstream_hicache import files

    monkeypatch.setattr(files, "READ_FILES_HELD", 0)  # (a read's own descriptors closed once idle)
    pages = PageSet(size=40 << 10)
    keys = pages.keys(1)
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, keys) == [True]
        layout = engine.tiers[0].layout
        path = layout.page_path(keys[0])
        valid = Path(path).read_bytes()
        if who != "scan":
            flip_byte(path, HEADER_SIZE + 100)
            done = _inode_thief(monkeypatch, path, layout.tmp, valid)
            if who == "read":
                pages.checked_get(engine, keys)
            else:
                engine.check(fix=True)
            monkeypatch.undo()
            assert pages.checked_get(engine, keys) == [True]  # the valid page, found again
    if who == "scan":
        flip_byte(path, 30)
        done = _inode_thief(monkeypatch, path, layout.tmp, valid)
        with make_engine(tier_dirs[:1]) as engine:
            assert engine.wait_scan(30)
            monkeypatch.undo()
            assert pages.checked_get(engine, keys) == [True]
    assert done, "the damaged file's removal never began"
    assert Path(path).read_bytes() == valid, "a valid page that took the judged file's inode was deleted"


def test_a_read_never_deletes_a_valid_page_renamed_over_the_damaged_copy(tier_dirs, monkeypatch):
    pages = PageSet()
    key = pages.keys(1)[0]
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, [key]) == [True]
        path = engine.tiers[0].layout.page_path(key)
        valid = Path(path).read_bytes()
        flip_byte(path, HEADER_SIZE + 10)  # the copy on disk is damaged: its read fails, it is judged
        other = os.path.join(engine.tiers[0].layout.tmp, "other-writer")
        real_remove = trust.remove

        def other_writer_then_remove(root, p, *args, **kw):
            if p == path:  # another process's put of the key commits between the judgement and the removal
                Path(other).write_bytes(valid)
                os.rename(other, path)
            return real_remove(root, p, *args, **kw)

        monkeypatch.setattr(tiers, "remove", other_writer_then_remove)
        pages.checked_get(engine, [key])  # (found or not; never wrong bytes)
        monkeypatch.undo()
        assert Path(path).read_bytes() == valid, "the read deleted a valid page another writer had committed"
        assert pages.put(engine, [key]) == [True]  # indexed again (the read dropped the damaged copy)


@pytest.mark.parametrize("links", [True, False], ids=["hard-link", "no-links"])
def test_link_new_names_a_file_only_where_nothing_has_the_name(tmp_path, monkeypatch, links):
    """trust.link_new (a catch-up copy's commit, a removal's page put back): a hard link, else (a file
    system without hard links: EPERM) a look and a rename; never over what has the name."""
    link_new = trust.link_new
    if not links:
        def refused(*args, **kwargs):
            raise PermissionError(errno.EPERM, "no hard links here")
        monkeypatch.setattr(os, "link", refused)
    (tmp_path / "src").write_bytes(b"new")
    (tmp_path / "taken").write_bytes(b"theirs")
    assert not link_new(str(tmp_path / "src"), str(tmp_path / "taken"))
    assert (tmp_path / "taken").read_bytes() == b"theirs" and (tmp_path / "src").exists()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert link_new("src", "free", fd, fd)
    finally:
        os.close(fd)
    assert (tmp_path / "free").read_bytes() == b"new" and (tmp_path / "src").exists() == links


def test_private_mode_after_shared_mode_names_a_fix_for_every_shard_it_refuses(tier_dirs):
    """An operator runs a private tree in file_mode=shared for a while (its new shards come out 2770), then
    switches back to private: the start is refused, and the fix it names, run once, is the whole fix. Before,
    it named the first refused shard alone (chmod -R g-w <that shard>): each restart refused the next one, up
    to 256 restarts (reviewer reconfig)."""
    pages = PageSet()
    with make_engine(tier_dirs[:1]) as engine:  # private: the tree and its first shards 0700
        assert pages.put(engine, pages.keys(2)) == [True] * 2
    with make_engine(tier_dirs[:1], file_mode="shared") as engine:
        assert pages.put(engine, pages.keys(8, start=100)) == [True] * 8
    for attempt in range(2):
        try:
            make_engine(tier_dirs[:1]).close()
            break
        except ConfigError as exc:
            fix = re.search(r"chmod -R g-w (\S+)", str(exc))
            assert fix is not None and attempt == 0, f"refused again after the named fix was run: {exc}"
            assert subprocess.run(["chmod", "-R", "g-w", fix.group(1)]).returncode == 0
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.checked_get(engine, pages.keys(2) + pages.keys(8, start=100)) == [True] * 10


def test_a_tier_the_kernel_reaches_through_links_past_path_max_starts(tier_root):
    """The owner check walks the tier's path as the kernel resolves it (trust._resolved). It looked at each step
    as one path string: reached through two links, each target 3000 characters (the kernel's limit is per link,
    not per path walked), that string passed PATH_MAX and the start was an OSError traceback (ENAMETOOLONG) on a
    tier the kernel opens. From a review of stop 56."""
    seg = os.path.join(*["y" * 250] * 12)  # (one link target's worth: made one chdir at a time, each under PATH_MAX)
    here = os.open(tier_root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ["y" * 250] * 24 + ["tier"]:
            os.mkdir(name, 0o700, dir_fd=here)
            below = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = below
    finally:
        os.close(here)
    os.symlink(seg, os.path.join(tier_root, seg, "deeper"))  # (relative: its own directory's seg below it)
    entry = os.path.join(tier_root, "entry")
    os.symlink(os.path.join(tier_root, seg, "deeper", "tier"), entry)
    assert os.path.isdir(entry)  # the kernel resolves it
    with make_engine([entry]) as engine:
        pages = PageSet()
        assert pages.put(engine, pages.keys(1)) == [True]
        assert pages.checked_get(engine, pages.keys(1)) == [True]
