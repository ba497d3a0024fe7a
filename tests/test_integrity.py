"""Page header, checksums, temp-file ownership, and check_tiers on real files."""
from __future__ import annotations

import errno
import fcntl
import os
import struct
import subprocess
import time

import numpy as np
import pytest

from kvstream_hicache.config import Config
from kvstream_hicache.errors import InvalidKeyError
from kvstream_hicache.io import open_owned
from kvstream_hicache.integrity import (
    HeaderError, NewerFormat, NotRegularFile, PageHeader, Reason, UntrustedFile, block_crcs, check_tiers, crc32c,
    open_direct, open_regular, pack_header, read_header, scan_file, unpack_header,
)
from kvstream_hicache.trust import Trust
from kvstream_hicache.layout import (
    HEADER_SIZE, MAX_BLOCKS, Namespace, TierLayout, block_size_for, block_span, file_size, is_valid_key, round_up,
    validate_key,
)
from kvstream_hicache.tmpfiles import (
    HOST, drop_mark, hold_mark, mark_name, parse_tmp_name, removal_live, removing_name, stale_tmp, tmp_name,
)

from helpers import FLAGS_OFF, VERSION_OFF, PageSet, make_engine, page_files, set_header_field

DIGEST = Namespace({"model": "m"}).digest
KEY = "ab" * 32


def header(**kw):
    fields = dict(key=KEY, digest=DIGEST, length=3 * 4096 + 5, block=8192, crcs=(1, 2), created_ns=7)
    fields.update(kw)
    return PageHeader(**fields)


def packed(h=None) -> bytearray:
    buf = bytearray(HEADER_SIZE)
    pack_header(h or header(), buf)
    return buf


def test_crc32c_check_value_and_chaining():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283


def test_header_round_trip():
    h = header()
    assert unpack_header(packed(h)) == h
    copy = header(copied_ns=9)  # (a catch-up copy's own stamp, in bytes 50..57: its writer's filter key)
    assert unpack_header(packed(copy)) == copy and copy.writer_ns == 9 and h.writer_ns == 7
    assert packed(copy)[:50] == packed(h)[:50] and packed(copy)[58:4092] == packed(h)[58:4092]


@pytest.mark.parametrize("offset", [0, 9, 13, 17, 33, 64, 272, HEADER_SIZE - 1])
def test_any_flipped_header_byte_is_refused(offset):
    buf = packed()
    buf[offset] ^= 0x40
    with pytest.raises(HeaderError):
        unpack_header(buf)


def test_header_with_valid_crc_but_bad_fields_is_refused():
    buf = packed()
    buf[0:8] = b"NOTAPAGE"
    struct.pack_into("<I", buf, HEADER_SIZE - 4, crc32c(bytes(buf[:HEADER_SIZE - 4])))
    with pytest.raises(HeaderError, match="magic"):
        unpack_header(buf)


def test_truncated_header():
    with pytest.raises(HeaderError, match="truncated"):
        unpack_header(packed()[:100])


def _rewritten(buf: bytearray, offset: int, value: int) -> bytearray:
    """``buf``'s 16-bit field at ``offset`` set to ``value``, its header CRC made again (a later writer's)."""
    struct.pack_into("<H", buf, offset, value)
    struct.pack_into("<I", buf, HEADER_SIZE - 4, crc32c(bytes(buf[:HEADER_SIZE - 4])))
    return buf


def test_a_valid_header_of_a_later_format_is_told_from_a_damaged_one():
    """A format version above this one, or a flag this format does not know (every writer of version 1
    writes 0), under a valid magic and header CRC: a later kvstream's page (NewerFormat), never served,
    never removed. A version no kvstream wrote (0), or a version byte damaged (its header CRC fails), is
    damage as before. (Before, a later version was 'unsupported format version 2', judged damaged and
    removed, and flags were never looked at: such a page was served.)"""
    for offset, value, why in ((VERSION_OFF, 2, "format version 2"), (FLAGS_OFF, 1, "header flags 0x0001"),
                               (FLAGS_OFF, 0x8000, "header flags 0x8000")):
        with pytest.raises(NewerFormat, match=why):
            unpack_header(_rewritten(packed(), offset, value))
    damaged = packed()
    damaged[VERSION_OFF] ^= 0x02  # version 3, the header CRC not made again
    for buf, why in ((_rewritten(packed(), VERSION_OFF, 0), "unsupported format version 0"), (damaged, "checksum")):
        with pytest.raises(HeaderError, match=why) as refused:
            unpack_header(buf)
        assert not isinstance(refused.value, NewerFormat)


def test_block_crcs_straddle_segments():
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    address = data.ctypes.data
    whole = block_crcs([(address, 10_000)], 10_000, 4096)
    split = block_crcs([(address, 1), (address + 1, 5000), (address + 5001, 4999)], 10_000, 4096)
    assert whole == split
    assert whole == tuple(crc32c(data[i:i + 4096].tobytes()) for i in range(0, 10_000, 4096))


def test_geometry():
    assert file_size(1) == HEADER_SIZE + 4096 and round_up(8192) == 8192
    assert block_span(10_000, 4096, 2) == (8192, 10_000 - 8192, 4096)
    assert block_size_for(8 << 20, 1 << 20) == 1 << 20
    big = block_size_for(MAX_BLOCKS * 4096 * 3, 4096)
    assert big % 4096 == 0 and -(-(MAX_BLOCKS * 4096 * 3) // big) <= MAX_BLOCKS


@pytest.mark.parametrize("key", ["a" * 64, "x", "Key_-09", "z" * 200])
def test_valid_keys(key):
    assert is_valid_key(key) and validate_key(key) == key


@pytest.mark.parametrize("key", ["", "../etc", "a/b", ".", "..", "a.b", "z" * 201, "a\x00", "é", None, 5, "a b"])
def test_invalid_keys(key):
    assert not is_valid_key(key)
    with pytest.raises(InvalidKeyError):
        validate_key(key)


def test_namespace_digest_is_canonical():
    a = Namespace({"model": "m", "tp": [0, 2], "dtype": "bf16"})
    b = Namespace({"dtype": "bf16", "tp": [0, 2], "model": "m"})
    c = Namespace({"dtype": "fp16", "tp": [0, 2], "model": "m"})
    assert a.digest == b.digest != c.digest and len(a.digest) == 32 and a == b


def test_tmp_names_and_ownership(tier_root):
    name = tmp_name(DIGEST, 123, "tok", 4)
    owner = parse_tmp_name(name)
    assert owner == (DIGEST, HOST, 123, "tok")
    tmp = os.path.join(tier_root, "tmp")
    os.makedirs(tmp)
    live_mine = tmp_name(DIGEST, os.getpid(), "live", 0)
    dead_mine = tmp_name(DIGEST, os.getpid(), "gone", 0)
    dead_pid = tmp_name(DIGEST, 2**22 + 7, "x", 0)  # above pid_max on most systems: never alive
    other_new = f"{DIGEST}.otherhost.1.x.0.tmp"
    other_old = f"{DIGEST}.otherhost.2.x.0.tmp"
    junk = "garbage.tmp"
    for n in (live_mine, dead_mine, dead_pid, other_new, other_old, junk):
        open(os.path.join(tmp, n), "w").close()
    old = time.time() - 7200
    os.utime(os.path.join(tmp, other_old), (old, old))
    stale = {os.path.basename(p) for p in stale_tmp(tmp, {"live"})}
    assert stale == {dead_mine, dead_pid, other_old, junk}


def write_page(root, key=KEY, digest=DIGEST, payload=b"x" * 5000, block=4096):
    layout = TierLayout(root, digest)
    os.makedirs(layout.page_dir(key), exist_ok=True)
    crcs = tuple(crc32c(payload[i:i + block]) for i in range(0, len(payload), block))
    h = PageHeader(key, digest, len(payload), block, crcs, 1)
    data = packed(h) + payload + bytes(round_up(len(payload)) - len(payload))
    with open(layout.page_path(key), "wb") as f:
        f.write(data)
    return layout.page_path(key)


def test_check_tiers_finds_and_fixes(tier_dirs):
    root = tier_dirs[0]
    good = write_page(root, key="aa" + "0" * 62)
    corrupt = write_page(root, key="bb" + "0" * 62)
    with open(corrupt, "r+b") as f:
        f.seek(HEADER_SIZE + 4100)
        f.write(b"!")
    damaged = write_page(root, key="cc" + "0" * 62)
    with open(damaged, "r+b") as f:
        f.seek(20)
        f.write(b"!")
    truncated = write_page(root, key="dd" + "0" * 62)
    os.truncate(truncated, HEADER_SIZE + 10)
    misplaced = write_page(root, key="ee" + "0" * 62)
    os.rename(misplaced, misplaced.replace("ee" + "0" * 62, "ee" + "1" * 62))
    foreign = write_page(root, key="ff" + "0" * 62, digest=Namespace({"model": "other"}).digest)
    other_ns_as_ours = TierLayout(root, DIGEST).page_path("ff" + "0" * 62)
    os.makedirs(os.path.dirname(other_ns_as_ours))
    os.rename(foreign, other_ns_as_ours)
    stray = os.path.join(os.path.dirname(good), "notes.txt")
    open(stray, "w").close()
    tmp_dir = TierLayout(root, DIGEST).tmp
    os.makedirs(tmp_dir, exist_ok=True)
    orphan = os.path.join(tmp_dir, tmp_name(DIGEST, 2**22 + 7, "x", 0))
    open(orphan, "w").close()

    config = Config.from_sources({"tiers": [root]}, environ={})
    problems = check_tiers(config)
    kinds = sorted(p.kind for p in problems)
    assert kinds == sorted(["corrupt", "damaged", "truncated", "misplaced", "misplaced", "stray", "orphan_tmp"])
    assert check_tiers(config, Namespace({"model": "nothing"})) == [p for p in problems if p.kind == "orphan_tmp"]
    assert len(check_tiers(config, payload=False)) == len(problems) - 1  # the payload flip needs payload=True

    fixed = check_tiers(config, fix=True)
    assert all(p.fixed for p in fixed)
    assert check_tiers(config) == []
    assert os.path.exists(good)
    header_, st = read_header(good)
    size = st.st_size
    assert header_.key == "aa" + "0" * 62 and size == file_size(5000)


def test_a_problem_says_its_reason_as_an_enum_and_its_detail_for_people(tmp_path):
    """Code acts on Problem.reason (a vanished file is no problem, an unreadable one is never removed);
    the detail is free text."""
    from kvstream_hicache.integrity import Reason, fix_problem, judge_and_fix, scan_file
    from kvstream_hicache.layout import TierLayout

    layout = TierLayout(str(tmp_path), "0" * 32)
    os.makedirs(os.path.dirname(layout.page_path("ab")))
    gone = scan_file(layout, "0" * 32, "ab").problem
    assert gone.reason is Reason.VANISHED and gone.kind == "stray"
    with open(layout.page_path("ab"), "wb") as f:
        f.write(b"not a header")
    bad = scan_file(layout, "0" * 32, "ab").problem
    assert bad.reason is Reason.INVALID and bad.kind == "damaged"
    unreadable = bad._replace(reason=Reason.UNREADABLE)
    assert not fix_problem(unreadable).fixed and os.path.exists(layout.page_path("ab"))
    assert not fix_problem(bad).fixed  # a page file judged but not held from before: it may not be that file now
    _, fixed = judge_and_fix(layout.page_path("ab"), lambda: scan_file(layout, "0" * 32, "ab"), Trust.user())
    assert fixed.fixed and not os.path.exists(layout.page_path("ab"))


@pytest.mark.parametrize("where", ["open", "payload"])
def test_a_page_another_node_replaced_while_it_was_read_is_no_problem(tier_dirs, monkeypatch, where):
    """On a network tier (GlusterFS) a page another node renamed a new version over, or deleted, since it was
    listed or opened answers ESTALE, not ENOENT: `kvstream check` on node A while node B replaced A's pages
    reported 'unreadable: Stale file handle' and exited 1 (test_reliability_dfs.py's check-while-both-put test,
    1 run in 10). It vanished during the scan, as a page deleted on a local tier does."""
    from kvstream_hicache import integrity

    pages = PageSet()
    with make_engine(tier_dirs[:1]) as engine:
        assert pages.put(engine, pages.keys(1)) == [True]
        config = engine.config

    def stale(*_args):
        raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))

    monkeypatch.setattr(integrity, "open_with_header" if where == "open" else "verify_payload", stale)
    assert check_tiers(config) == []


def test_check_reports_a_later_formats_pages_and_its_fix_never_removes_them(tier_dirs, capsys):
    """`kvstream check` names a page of a later format (a version above this one's, or header flags this
    one does not know) 'newer_format', another kvstream version's page, not damage; `--fix` leaves it
    ("not repaired", exit 1), and so it does one a removal of that version cut short left under its
    private name (this version cannot tell that page's place: a node of its version puts it back).
    (Before, a later version's page was 'damaged' and `--fix` removed it; flags were never looked at.)"""
    from kvstream_hicache.tmpfiles import removing_name
    from kvstream_hicache.tools import cli

    root = tier_dirs[0]
    version, flags, cut_short = (write_page(root, key=c * 2 + "0" * 62) for c in "abc")
    set_header_field(version, VERSION_OFF, 2)
    set_header_field(flags, FLAGS_OFF, 1)
    set_header_field(cut_short, VERSION_OFF, 2)
    private = os.path.join(os.path.dirname(cut_short), removing_name(2**22 + 7))  # (its process: no such pid)
    os.rename(cut_short, private)
    config = Config.from_sources({"tiers": [root]}, environ={})
    for fix in (False, True):
        problems = check_tiers(config, fix=fix)
        assert sorted((p.path, p.kind, p.reason, p.fixed) for p in problems) == [
            (path, "newer_format", Reason.NEWER, False) for path in sorted((version, flags, private))]
    assert all(os.path.exists(path) for path in (version, flags, private))
    assert "format version 2, a later one" in {p.path: p for p in problems}[version].detail
    assert cli.main(["check", "--fix", "--tiers", root]) == 1
    out = capsys.readouterr().out
    assert out.count("kind=newer_format") == 3 and "kind=damaged" not in out and "3 not repaired" in out, out
    assert all(os.path.exists(path) for path in (version, flags, private))


@pytest.mark.leaves_problems("pages with an unknown header flag left on the tier on purpose (check names them)")
def test_a_page_whose_header_sets_flags_this_version_does_not_know_is_not_served(tier_dirs):
    """The header's flags field is 0 in every page this project wrote; it is there for what a later format
    marks in a page (a payload compressed, quantized, laid out otherwise, a tombstone). A reader that
    does not know a flag cannot know what the payload's bytes mean: it must not hand them to SGLang as KV,
    nor remove the page (another version's, on a tier old and new nodes share during an upgrade). Before,
    the field was never looked at (unpacked as ``_flags``): such pages were indexed and served, so no
    later format could use a flag without old nodes serving its pages as raw KV during a rolling upgrade
    (review 'upgrade', stop 44)."""
    dirs = tier_dirs[:1]
    pages = PageSet()
    keys = pages.keys(3)
    with make_engine(dirs) as engine:
        assert pages.put(engine, keys) == [True] * 3
    for path in page_files(dirs[0]):
        set_header_field(path, FLAGS_OFF, 1)
    with make_engine(dirs) as engine:
        found, _ = pages.get(engine, keys)
        assert found == [False] * 3, f"{sum(found)} of 3 pages whose header sets flag 0x1 were served"
        assert engine.scan["newer_format"] == 3 and engine.scan["damaged_removed"] == 0
        assert {p.kind for p in engine.check(fix=True)} == {"newer_format"}
    assert len(page_files(dirs[0])) == 3


def _opened(open_, path, trust):
    """What opening ``path`` gave: the descriptor's access flags (then closed), or the error's type and errno."""
    try:
        fd = open_(path, trust)
    except OSError as exc:
        return type(exc), exc.errno
    try:
        return "fd", fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_ACCMODE | os.O_DIRECT | os.O_NONBLOCK)
    finally:
        os.close(fd)


def test_the_read_paths_open_in_one_call_agrees_with_open_regular_on_every_kind_of_entry(tmp_path):
    """open_direct (the read path's: open, fstat, owner and F_SETFL in one C call) and open_regular
    (the rules, in Python) answer the same for each thing a page's name can hold, for each kind of
    trust; only a trusted regular file opens, O_DIRECT and blocking (io_uring would answer a
    non-blocking one EAGAIN), and nothing else is left open."""
    page = tmp_path / "page"
    page.write_bytes(b"x" * 8192)
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")  # opened blocking, this would hang until a writer came
    (tmp_path / "link").symlink_to(page)
    st = os.stat(page)
    other = max(st.st_uid, 1) + 54321  # a uid that owns nothing here
    trusts = {"owner": Trust(frozenset({st.st_uid})), "group": Trust(frozenset({other}), st.st_gid),
              "stranger": Trust(frozenset({other})), "stranger, other group": Trust(frozenset({other}), st.st_gid + 1)}
    before = len(os.listdir("/proc/self/fd"))
    seen = {}
    for name in ("page", "dir", "fifo", "link", "missing"):
        for label, trust in trusts.items():
            path = str(tmp_path / name)
            fast = _opened(open_direct, path, trust)
            slow = _opened(lambda p, t: open_regular(p, os.O_DIRECT, trust=t)[0], path, trust)
            assert fast == slow, (name, label)
            seen[name, label] = fast
    # the one call alone (open_direct's fallback would hide a fast path that refused too much)
    for name in ("page", "dir", "fifo", "link", "missing"):
        for label, trust in trusts.items():
            fd = open_owned(os.fsencode(tmp_path / name), os.O_DIRECT, trust.uids,
                            -1 if trust.gid is None else trust.gid)
            assert (fd >= 0) == (name == "page" and label in ("owner", "group")), (name, label)
            if fd >= 0:
                assert fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_DIRECT | os.O_NONBLOCK) == os.O_DIRECT
                os.close(fd)
    assert len(os.listdir("/proc/self/fd")) == before
    assert seen["page", "owner"] == seen["page", "group"] == ("fd", os.O_RDONLY | os.O_DIRECT)
    assert seen["page", "stranger"] == seen["page", "stranger, other group"] == (UntrustedFile, errno.EINVAL)
    assert seen["dir", "owner"] == (NotRegularFile, errno.EISDIR)
    assert seen["fifo", "owner"] == seen["link", "owner"] == (NotRegularFile, errno.EINVAL)
    assert seen["missing", "owner"] == (FileNotFoundError, errno.ENOENT)


def test_check_reports_tiers_that_do_not_exist(tier_dirs, capsys, monkeypatch):
    """'kvstream check --tiers /a:/b' (or a mistyped KVSTREAM_TIERS) used to say "no problems found",
    exit 0, having checked nothing; --tiers now takes KVSTREAM_TIERS's ':'-separated form too."""
    from kvstream_hicache.tools import cli

    missing = os.path.join(tier_dirs[0], "nope")
    a_file = os.path.join(tier_dirs[0], "file")
    open(a_file, "w").close()
    problems = check_tiers(Config.from_sources({"tiers": [missing, a_file, tier_dirs[1]]}, environ={}))
    assert [(p.kind, p.tier) for p in problems] == [("missing_tier", missing), ("missing_tier", a_file)]
    assert "does not exist" in problems[0].detail and "not a directory" in problems[1].detail
    assert cli.main(["check", "--tiers", os.pathsep.join([missing, tier_dirs[1]])]) == 1
    out = capsys.readouterr().out
    assert "no problems found" not in out and f"tier={missing}" in out and "(from --tiers)" in out
    assert f"tier={tier_dirs[1]}" not in out  # the second tier of 'a:b' is a tier, checked and fine
    monkeypatch.setenv("KVSTREAM_TIERS", missing)
    assert cli.main(["check", "--fix"]) == 1
    assert "KVSTREAM_TIERS" in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")
def test_check_and_info_report_an_unreadable_tier_and_go_on(tier_root):
    """An unreadable tier or kvstream/ directory used to end check, check --fix and info with a
    PermissionError traceback: it is a problem line of that tier, the other tiers are checked."""
    import contextlib
    import io

    from helpers import as_user, make_engine

    uid = 54324  # no account has it (root ignores permission bits)
    os.chmod(tier_root, 0o755)
    a, b = os.path.join(tier_root, "a"), os.path.join(tier_root, "b")
    for d in (a, b):
        os.mkdir(d)
        os.chown(d, uid, uid)

    def run():
        from kvstream_hicache.tools import cli

        make_engine([a, b], "threads").close()
        stray = os.path.join(b, "kvstream", "tmp", "stray-dir")
        os.mkdir(stray)  # a problem on the readable tier: still found
        for unreadable in (a, os.path.join(a, "kvstream")):
            os.chmod(unreadable, 0)
            for cmd in (["check"], ["check", "--fix"], ["info"]):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    assert cli.main([*cmd, "--tiers", a, b]) == 1, cmd
                text = out.getvalue()
                assert "Traceback" not in text and "not readable" in text, (cmd, text)
                if cmd[0] == "check" or unreadable != a:  # (info: a tier root it cannot use, said in short)
                    assert f"chmod -R u+rwX {unreadable})" in text, (cmd, text)  # the directory to fix
                if cmd[0] == "check":
                    assert "stray-dir" in text, text
            os.chmod(unreadable, 0o700)

    # the CLI's modules imported here, as root: the child, another uid, may not read this Python's library
    # (a Python under /root, 0700), and imported what the command imports lazily only when an earlier test had
    from kvstream_hicache.tools import cli

    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["info", "--tiers", tier_root])
    as_user(uid, run)


def test_a_header_block_size_never_sizes_one_read_of_the_check(tier_root, monkeypatch):
    """A header's block size is another writer's word (up to 4 GiB - 4 KiB): the payload check (check,
    kvstream check, a read's damage check) reads a block in pieces, never the block in one allocation;
    the page still verifies (a sparse 256 MiB block of zeros, its CRC right)."""
    from kvstream_hicache import integrity

    digest = Namespace({"model": "m"}).digest
    layout = TierLayout(tier_root, digest)
    key = "ab" * 32
    os.makedirs(layout.page_dir(key))
    length = block = 256 << 20
    zeros, crc = bytes(1 << 20), 0
    for _ in range(length // len(zeros)):
        crc = crc32c(zeros, crc)
    header = bytearray(HEADER_SIZE)
    pack_header(PageHeader(key, digest, length, block, (crc,), 1), header)
    with open(layout.page_path(key), "wb") as f:
        f.write(header)
        f.truncate(HEADER_SIZE + length)  # sparse: costs no disk
    sizes, real = [], os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: sizes.append(n) or real(fd, n, offset))
    page = scan_file(layout, digest, key, payload=True)
    assert page.problem is None and max(sizes) <= integrity.VERIFY_PIECE < block


def test_a_writer_whose_mark_is_let_go_is_gone_though_its_pid_is_alive_and_its_file_young(tier_root):
    """A node rebooted after a power cut hands its pids out again: the server that now has the pid of the
    writer cut off began after the file's last write by less than PID_REUSE_S (a quick reboot), so the
    file was taken for that live process's and kept. The writer's mark (tmpfiles.hold_mark), still there
    and unlocked, says it is gone: the file and the mark are leftovers; a held mark keeps its files."""
    tmp = os.path.join(tier_root, "tmp")
    os.makedirs(tmp)
    with subprocess.Popen(["sleep", "600"]) as later:  # has the pid now
        try:
            cut = os.path.join(tmp, tmp_name(DIGEST, later.pid, "cut0", 0))
            dead_mark = os.path.join(tmp, mark_name(HOST, later.pid, "cut0"))
            for path in (cut, dead_mark):  # (the mark as its writer's death left it: linked, nobody holds it)
                open(path, "w").close()
            held = hold_mark(tmp, "held")
            assert held is not None
            mine = os.path.join(tmp, tmp_name(DIGEST, later.pid, "held", 1))  # (a live pid: kept by its mark)
            open(mine, "w").close()
            try:
                assert sorted(stale_tmp(tmp, {"held"})) == sorted([cut, dead_mark])
            finally:
                drop_mark(held)
            assert not os.path.exists(held[1])
        finally:
            later.kill()
            later.wait()


def test_a_mark_dropped_while_its_tier_is_away_leaves_nothing_that_says_a_live_engine_died(tier_root):
    """A tier's directory renamed away while its engine writes (a model test's tier vanishing; an operator's
    mv), and back: the engine's mark was dropped by its path meanwhile, which found nothing, so the mark stayed
    linked and unlocked and came back with the directory, and the live engine's temporary files there were
    taken for a dead one's (a fresh-clone CI run: `check()` listed one as a leftover). Dropped through the
    directory's descriptor now, and a mark under the engine's own name is replaced when it holds one again."""
    root = os.path.join(tier_root, "tier")
    tmp = os.path.join(root, "tmp")
    os.makedirs(tmp)
    mine = os.path.join(tmp, tmp_name(DIGEST, os.getpid(), "live", 0))
    open(mine, "w").close()
    held = hold_mark(tmp, "live")
    assert held is not None
    os.rename(root, root + ".away")
    drop_mark(held)
    os.rename(root + ".away", root)
    assert os.listdir(tmp) == [os.path.basename(mine)]
    assert stale_tmp(tmp, {"live"}) == []  # (the engine lives: its file is no leftover)
    open(held[1], "w").close()  # a mark of this engine's a drop could not remove: replaced, held again
    again = hold_mark(tmp, "live")
    assert again is not None and stale_tmp(tmp, {"live"}) == []
    drop_mark(again)
    assert os.listdir(tmp) == [os.path.basename(mine)]


def test_a_dead_writers_tmp_file_is_a_leftover_though_a_later_process_has_its_pid(tier_root):
    """A fleet restarting on kill -9 wraps pids (pid_max 32768 in a container): a killed writer's
    temporary file, named by its pid, was kept while any later process had that pid (at every start of
    every engine on the tier). The file was last written before that process began: its writer is gone."""
    tmp = os.path.join(tier_root, "tmp")
    os.makedirs(tmp)
    with subprocess.Popen(["sleep", "600"]) as later:  # has the pid now
        try:
            dead = os.path.join(tmp, tmp_name(DIGEST, later.pid, "dead", 0))  # written an hour before it began
            live = os.path.join(tmp, tmp_name(DIGEST, later.pid, "live", 1))  # written since it began
            for path in (dead, live):
                open(path, "w").close()
            old = time.time() - 3600
            os.utime(dead, (old, old))
            assert stale_tmp(tmp, set()) == [dead]
            assert not removal_live(removing_name(later.pid), old, tmp)  # a removal's private name: the same
            assert removal_live(removing_name(later.pid), time.time(), tmp)
        finally:
            later.kill()
            later.wait()


def test_a_live_writers_tmp_file_on_a_tier_whose_clock_runs_behind_is_no_leftover(tier_root):
    """This host's temporary file on a network tier is stamped by the file server's clock (NFS), which may
    run an hour behind this host's (tier_now): a writer begun a moment ago writes a file whose mtime is an
    hour before the process began on this host's clock. Its age is told on the tier's clock, as another
    host's file's is: it was written since the writer began, which lives (it was removed under it)."""
    tmp = os.path.join(tier_root, "tmp")
    os.makedirs(tmp)
    with subprocess.Popen(["sleep", "600"]) as writer:
        try:
            live = os.path.join(tmp, tmp_name(DIGEST, writer.pid, "live", 0))
            open(live, "w").close()
            behind = time.time() - 3600  # the server's clock now, an hour behind this host's
            os.utime(live, (behind, behind))  # written just now, on the server's clock
            assert stale_tmp(tmp, set(), now=behind) == []
            assert removal_live(removing_name(writer.pid), behind, tmp, lambda: behind)
        finally:
            writer.kill()
            writer.wait()


def test_a_file_named_as_a_mark_but_no_mark_of_this_user_s_engines_is_reported(tier_root):
    """tmp/ holds a file whose name starts as a mark's but is none (no engine's name: junk; or another
    user's file named as this user's engine's mark): check reports it as it reports any other file there that
    no engine of this user wrote (before: an entry named live.* was judged as a mark alone and never listed,
    so anyone who may write tmp/ hid files there from check)."""
    root = os.path.join(tier_root, "t")
    tmp_dir = TierLayout(root, DIGEST).tmp
    os.makedirs(tmp_dir)
    junk = os.path.join(tmp_dir, "live.junk")
    plain = os.path.join(tmp_dir, "junk")
    for path in (junk, plain):
        open(path, "w").close()
    config = Config.from_sources({"tiers": [root]}, environ={})
    assert sorted(p.path for p in check_tiers(config) if p.kind == "orphan_tmp") == sorted([junk, plain])
