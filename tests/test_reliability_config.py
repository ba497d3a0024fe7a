"""Bad configuration is refused at start-up with one clear message that names the setting (as the
user wrote it: the extra-config key or the KVSTREAM_* variable), the offending value or path, and
the fix. Directories that cannot be used are made for real: missing, a file in the way, under a
read-only mount (root ignores permission bits), on a file system without O_DIRECT (ramfs; tmpfs
supports O_DIRECT since Linux 6.6, so the tmpfs case asserts whichever this kernel does, and an
injected EINVAL shows the check on any file system).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess

import pytest

import kvstream_hicache.io as kio
from kvstream_hicache import Config, ConfigError, Engine, TierError

from kvstream_hicache.integrity import check_tiers

from helpers import (  # noqa: F401  (loop_fs: fixture)
    ARRAY_CHUNK, NS, PageSet, Pages, key, kvstream_cli, loop_devices_usable, loop_fs, make_array_engine, make_engine,
)


def _start(explicit=None, environ=None) -> Exception:
    """Start an engine that must refuse; returns the error."""
    with pytest.raises(ConfigError) as info:
        Engine(Config.from_sources(explicit, environ=environ or {}), NS).close()
    return info.value


def _has_all(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} missing from: {message}"


# -- tier directories --------------------------------------------------------------------------
@pytest.mark.parametrize("via", ["extra", "env"])
def test_missing_directory(tier_root, via):
    path = os.path.join(tier_root, "missing")
    err = _start({"tiers": [path]} if via == "extra" else None, {"KVSTREAM_TIERS": path} if via == "env" else None)
    assert isinstance(err, TierError)
    _has_all(str(err), path, "extra config 'tiers'" if via == "extra" else "KVSTREAM_TIERS", "does not exist",
             f"mkdir -p {path}")
    assert not os.path.exists(path), "a missing tier is never created silently"


def test_a_tier_list_separated_by_commas_says_which_separator(tier_root):
    """'a,b' is one directory named 'a,b' (':' separates tiers): the message says so."""
    paths = [os.path.join(tier_root, n) for n in ("a", "b")]
    err = _start({"tiers": ",".join(paths)})
    _has_all(str(err), "does not exist", f"separated by '{os.pathsep}', not ','")


@pytest.mark.parametrize("key", ["tiers", "capacity"])
def test_a_json_list_in_a_variable_says_how_a_variable_lists(tier_root, key):
    """docs/sglang.md: `tiers` is "a JSON list, or one string separated by ':'"; a user who wrote the list in
    KVSTREAM_TIERS (as the extra config takes it) had it taken as one relative directory named '["/a", "/b"]'
    under the server's working directory, and was told to `mkdir -p` it."""
    paths = [os.path.join(tier_root, n) for n in ("a", "b")]
    for p in paths:
        os.mkdir(p)
    env = {"KVSTREAM_TIERS": os.pathsep.join(paths)}
    written = json.dumps(paths if key == "tiers" else ["1G", "2G"])
    env[f"KVSTREAM_{key.upper()}"] = written
    with pytest.raises(ConfigError) as info:
        Config.from_sources(None, environ=env)
    want = os.pathsep.join(paths) if key == "tiers" else f"1G{os.pathsep}2G"
    _has_all(str(info.value), f"KVSTREAM_{key.upper()}", repr(written), "JSON list", want)


@pytest.mark.parametrize("written", ["1G,2G", "1G 50%", "1G;2G"])
def test_capacities_separated_by_commas_say_which_separator(tier_root, written):
    """'1G,2G' (as a user writes a list) read as one size that does not parse: the message says why."""
    paths = [os.path.join(tier_root, n) for n in ("a", "b")]
    with pytest.raises(ConfigError) as info:
        Config.from_sources(None, environ={"KVSTREAM_TIERS": os.pathsep.join(paths), "KVSTREAM_CAPACITY": written})
    _has_all(str(info.value), "KVSTREAM_CAPACITY", repr(written), f"separated by '{os.pathsep}'",
             f"not {written[2]!r}")
    with pytest.raises(ConfigError) as info:  # a size that does not parse is no list: no separator named
        Config.from_sources(None, environ={"KVSTREAM_TIERS": paths[0], "KVSTREAM_CAPACITY": "1 gig"})
    assert "separated" not in str(info.value)


def test_an_environment_variable_an_explicit_setting_overrides_is_warned_about(tier_root):
    """Extra config wins over KVSTREAM_*: a user who exported a variable is told it does not count."""
    config = Config.from_sources({"tiers": [tier_root], "replicate": "all"},
                                 environ={"KVSTREAM_REPLICATE": "budget", "KVSTREAM_TIERS": tier_root})
    assert config.replicate == "all"
    assert [w for w in config.warnings if "KVSTREAM_REPLICATE=budget is overridden by extra config 'replicate'" in w]
    assert not [w for w in config.warnings if "KVSTREAM_TIERS" in w]  # (the same value: nothing to say)


@pytest.mark.parametrize("env,extra", [({"KVSTREAM_CATCHUP": "0"}, {"catchup": False}),
                                       ({"KVSTREAM_READ_TIMEOUT": "30"}, {"read_timeout": 30.0}),
                                       ({"KVSTREAM_CHUNK": "1M"}, {"chunk": 1 << 20})])
def test_no_override_warning_when_the_extra_config_holds_the_same_value(tier_root, env, extra):
    """The same value written another way ('30' and 30.0, '1M' and 1048576) is no override."""
    config = Config.from_sources({"tiers": [tier_root], **extra}, environ=env)
    assert not [w for w in config.warnings if "overridden" in w], config.warnings


def test_a_capacity_in_a_message_reads_as_a_size(tier_root):
    """'4K' for 8 KiB pages: the message says 4 KiB, not '3.81e-06 GiB' (nor LMCache's 2000-byte
    capacities in its start-up line)."""
    err = None
    with pytest.raises(ConfigError) as info:
        Engine(Config.from_sources({"tiers": [tier_root], "capacity": "4K"}, environ={}), NS, page_bytes=8192).close()
    err = str(info.value)
    _has_all(err, "extra config 'capacity'", "4 KiB of tier", "4096 bytes, less than one page")
    assert "e-0" not in err, err



@pytest.mark.parametrize("via", ["extra", "env"])
def test_a_capacity_count_that_does_not_fit_the_tiers_names_the_value_as_written(tier_root, via):
    """Three capacities for two tiers: the message names the setting, the value as written (which the
    operator greps the config for) and the fix (before: only the counts). Found by a review."""
    tiers = [os.path.join(tier_root, n) for n in ("a", "b")]
    for t in tiers:
        os.makedirs(t)
    value = os.pathsep.join(["1G", "2G", "3G"])
    if via == "env":
        err = _start({"tiers": tiers}, {"KVSTREAM_CAPACITY": value})
        setting = "KVSTREAM_CAPACITY"
    else:
        err = _start({"tiers": tiers, "capacity": value})
        setting = "extra config 'capacity'"
    _has_all(str(err), setting, repr(value), "3 capacities for 2 tiers", "give one value per tier")

def test_file_in_the_way(tier_root):
    afile = os.path.join(tier_root, "afile")
    open(afile, "w").close()
    _has_all(str(_start({"tiers": [afile]})), afile, "is not a directory", "point the tier list at a directory")
    sub = os.path.join(afile, "sub")
    _has_all(str(_start({"tiers": [sub]})), sub, f"{afile} is a file", "correct the tier list")
    blocked = os.path.join(tier_root, "blocked")
    os.makedirs(blocked)
    open(os.path.join(blocked, "kvstream"), "w").close()  # where kvstream keeps its tree
    _has_all(str(_start({"tiers": [blocked]})), os.path.join(blocked, "kvstream"), "is in the way", "move or remove it")


def test_directory_under_a_read_only_mount(loop_fs):
    fs = loop_fs(16 << 20, "ro")
    tier = os.path.join(fs.mnt, "kv")
    os.mkdir(tier)
    fs.remount("ro")
    err = _start({"tiers": [tier]})
    _has_all(str(err), tier, "not writable", "Read-only file system", "fix its permissions or mount")
    fs.remount("rw")
    Engine(Config.from_sources({"tiers": [tier]}, environ={}), NS).close()  # writable again: starts


def _o_direct_supported(path: str) -> bool:
    probe = os.path.join(path, ".odirect-probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.mark.parametrize("fstype", ["ramfs", "tmpfs"])
def test_file_system_without_o_direct(tier_root, fstype):
    why = loop_devices_usable()  # mount needs root as well
    if why:
        pytest.skip(why)
    mnt = os.path.join(tier_root, fstype)
    os.mkdir(mnt)
    subprocess.run(["mount", "-t", fstype, "-o", "size=16m", fstype, mnt], check=True)
    try:
        if _o_direct_supported(mnt):  # tmpfs on Linux >= 6.6
            assert fstype == "tmpfs", "ramfs has no O_DIRECT"
            Engine(Config.from_sources({"tiers": [mnt]}, environ={}), NS).close()
        else:
            err = _start({"tiers": [mnt]})
            _has_all(str(err), mnt, "extra config 'tiers'", "does not support O_DIRECT", "ext4 or xfs")
    finally:
        subprocess.run(["umount", "-l", mnt], check=True)


def test_o_direct_refusal_injected(tier_root, monkeypatch):
    """The probe's EINVAL on an O_DIRECT open, injected: the same message on any file system."""
    real_open = os.open

    def open_without_direct(path, flags, *args, **kw):
        # the probe opens its file relative to the tmp directory's descriptor (trust.py)
        if flags & os.O_DIRECT and (str(path).startswith(tier_root) or kw.get("dir_fd") is not None):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_without_direct)
    err = _start(None, {"KVSTREAM_TIERS": tier_root})
    _has_all(str(err), tier_root, "KVSTREAM_TIERS", "does not support O_DIRECT", "put the tier on a disk file system")


# -- settings ----------------------------------------------------------------------------------
BAD = [
    # (explicit, environ, parts of the message)
    (None, {"KVSTREAM_TIERS": ""}, ["no tier directories", "KVSTREAM_TIERS=", "extra config key 'tiers'"]),
    (None, {"KVSTREAM_TIERS": os.pathsep}, ["no tier directories", "KVSTREAM_TIERS="]),
    ({"tiers": []}, None, ["no tier directories"]),
    ({"tiers": "{root}", "tier": "/x"}, None, ["unknown kvstream setting", "'tier'", "valid keys: tiers"]),
    ({"tiers": "{root}", "capacity": "lots"}, None, ["extra config 'capacity'", "'lots'", "e.g. '200G'"]),
    ({"tiers": "{root}", "capacity": "12X"}, None, ["extra config 'capacity'", "'12X'", "e.g. '200G'"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_CAPACITY": "-5G"}, ["KVSTREAM_CAPACITY", "'-5G'"]),
    ({"tiers": "{root}", "capacity": "150%"}, None, ["extra config 'capacity'", "'150%'", "(0, 100]"]),
    ({"tiers": ["{root}", "{root}/b"], "capacity": ["1G", "2G", "3G"]}, None,
     ["3 capacities for 2 tiers", "one value per tier"]),
    ({"tiers": "{root}", "fsync": "sometimes"}, None, ["extra config 'fsync'", "'sometimes'", "never, data, full"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_POLICY": "fastest"}, ["KVSTREAM_POLICY", "'fastest'", "static-0.75"]),
    ({"tiers": "{root}", "chunk": "1000"}, None, ["extra config 'chunk'", "multiple of 4096", "e.g. '1M'"]),
    ({"tiers": "{root}", "file_mode": "world"}, None, ["extra config 'file_mode'", "private, shared"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_IO_ENGINE": "spdk"}, ["KVSTREAM_IO_ENGINE", "auto, uring, threads"]),
    ({"tiers": "{root}", "read_timeout": "soon"}, None, ["extra config 'read_timeout'", "expected a number"]),
    # settings that used to pass start-up and fail later, or fail raw (issue 16)
    ({"tiers": "{root}", "policy": "tier1"}, None,
     ["extra config 'policy'", "'tier1'", "1 tier", "no tier 1", "'tier0'"]),
    (None, {"KVSTREAM_TIERS": "{root}:{root}/b", "KVSTREAM_POLICY": "static-0.5/0.3/0.2"}, ["KVSTREAM_POLICY",
     "'static-0.5/0.3/0.2'", "2 tiers", "3 shares"]),
    ({"tiers": "{root}", "capacity": float("nan")}, None, ["extra config 'capacity'", "nan is not a size", "empty for unlimited"]),
    ({"tiers": "{root}", "capacity": [float("inf")]}, None, ["extra config 'capacity'", "inf is not a size"]),
    ({"tiers": "{root}", "capacity": "0"}, None, ["extra config 'capacity'", "'0' holds no page", "at least 1",
                                                   "empty for unlimited"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_CAPACITY": "0K"}, ["KVSTREAM_CAPACITY", "'0K' holds no page"]),
    ({"tiers": ["{root}/a\x00b"]}, None, ["extra config 'tiers'", "'{root}/a\\x00b'", "NUL byte",
                                          "correct the tier list"]),
    (None, {"KVSTREAM_TIERS": "{root}\x00"}, ["KVSTREAM_TIERS", "NUL byte"]),
    ({"tiers": "{root}", "read_timeout": "nan"}, None, ["extra config 'read_timeout'", "'nan'", "finite", "0 to wait forever"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_READ_TIMEOUT": "inf"}, ["KVSTREAM_READ_TIMEOUT", "'inf'", "finite"]),
    ({"tiers": "{root}", "write_timeout": "nan"}, None, ["extra config 'write_timeout'", "'nan'", "finite",
                                                          "0 to wait forever"]),
    ({"tiers": "{root}", "write_timeout": -2}, None, ["extra config 'write_timeout'", "-2", ">= 0", "e.g. 10"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_WRITE_TIMEOUT": "soon"}, ["KVSTREAM_WRITE_TIMEOUT", "'soon'",
                                                                           "expected a number"]),
    ({"tiers": "{root}", "tier_retry": float("nan")}, None, ["extra config 'tier_retry'", "nan", "finite", "e.g. 5"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_TIER_RETRY": "Infinity"}, ["KVSTREAM_TIER_RETRY", "'Infinity'"]),
    ({"tiers": "{root}", "claim": float("inf")}, None, ["extra config 'claim'", "expected a whole number"]),
    # review of the issue 13-16 change: values that were taken and then misbehaved
    ({"tiers": "{root}", "claim": 2.5}, None, ["extra config 'claim'", "whole number", "2.5"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_TIER_RETRY": "0"}, ["KVSTREAM_TIER_RETRY", ">= 0.1", "'0'", "e.g. 5"]),
    ({"tiers": "{root}", "replicate_slack": -1}, None, ["extra config 'replicate_slack'", ">= 0", "e.g. 1"]),
    # the background scan's pacing (issue 26)
    ({"tiers": "{root}", "scan_rate": -5}, None, ["extra config 'scan_rate'", ">= 0", "-5", "0 for no limit"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_SCAN_RATE": "fast"}, ["KVSTREAM_SCAN_RATE", "'fast'", "e.g. 2000"]),
    ({"tiers": "{root}", "scan_cpu": 0}, None, ["extra config 'scan_cpu'", "above 0 and at most 1", "e.g. 0.25"]),
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_SCAN_CPU": "1.5"}, ["KVSTREAM_SCAN_CPU", "'1.5'", "at most 1"]),
    # review of the configuration surface: values that were silently ignored or bent
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_POLICY": "kvstream:m=8", "KVSTREAM_CLAIM": "2"},
     ["KVSTREAM_CLAIM", "KVSTREAM_POLICY", "'kvstream:m=8'", "fixes its own m", "'kvstream:m=2'"]),
    ({"tiers": ["{root}", "{root}/b"], "policy": "static-0.5", "claim": 2}, None,
     ["extra config 'claim'", "extra config 'policy'", "'static-0.5'", "would ignore it", "'static-0.5:m=2'"]),
    ({"tiers": "{root}", "read_timeout": True}, None, ["extra config 'read_timeout'", "expected a number", "True"]),
    ({"tiers": "{root}", "catchup_share": True}, None, ["extra config 'catchup_share'", "True"]),
    ({"tiers": "{root}", "write_backlog": 1.5}, None, ["extra config 'write_backlog'", "1.5", "whole number of bytes"]),
    # review of the docs against the code: a fraction of a byte written as text (an environment variable
    # always is) was cut down (1.5 -> a backlog of 1 byte), and more tiers than the index holds raised raw
    (None, {"KVSTREAM_TIERS": "{root}", "KVSTREAM_WRITE_BACKLOG": "1.5"}, ["KVSTREAM_WRITE_BACKLOG", "'1.5'",
                                                                          "whole number of bytes"]),
    ({"tiers": "{root}", "capacity": "4096.5"}, None, ["extra config 'capacity'", "'4096.5'", "whole number of bytes"]),
    ({"tiers": ["{root}/t%d" % i for i in range(33)]}, None, ["extra config 'tiers'", "33 tiers", "at most 32"]),
    ({"tiers": ["{root}", "{root}/", "{root}/b"], "capacity": ["1G", "2G", "3G"]}, None,
     ["3 capacities for 2 tiers", "tier {root} is listed twice in extra config 'tiers'", "remove the duplicate"]),
    ({"tiers": ["$KVSTREAM_TEST_UNSET_VAR/kv"]}, None, ["extra config 'tiers'", "'$KVSTREAM_TEST_UNSET_VAR/kv'",
                                                       "not set", "write the path out"]),
]


@pytest.mark.parametrize("explicit,environ,parts", BAD, ids=lambda v: None)
def test_bad_setting_is_one_clear_message(tier_root, caplog, explicit, environ, parts):
    caplog.set_level(logging.DEBUG, logger="kvstream")

    def fill(value):
        if isinstance(value, str):
            return value.replace("{root}", tier_root)
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return value

    err = _start(fill(explicit), fill(environ))
    _has_all(str(err), *[fill(p) for p in parts])
    assert "\n" not in str(err), "one message, one line"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "nothing else is reported"


def test_a_capacity_share_smaller_than_one_page_is_refused(tier_root):
    """A share of the file system is resolved at start-up: one that comes to less than one page of the
    caller's size (capacity counts payload bytes) is refused there, naming the setting and the bytes."""
    st = os.statvfs(tier_root)
    share = f"{4096 / (st.f_blocks * st.f_frsize) * 100:.10f}".rstrip("0") + "%"  # about 4 KiB of this disk
    with pytest.raises(ConfigError) as info:
        Engine(Config.from_sources({"tiers": [tier_root], "capacity": share}, environ={}), NS, page_bytes=8192).close()
    _has_all(str(info.value), "extra config 'capacity'", share, tier_root, "less than one page", "8192 bytes")


def test_tier_path_messages_say_what_is_wrong(tier_root):
    """A symlink loop is not 'missing: mkdir -p'; a dangling link names its target; /proc and /sys are
    kernel interfaces, not 'not writable (No such file or directory)'."""
    loop = os.path.join(tier_root, "loop")
    os.symlink(loop, loop)
    err = _start({"tiers": [loop]})
    _has_all(str(err), loop, "symbolic link loop", "point the tier list at a real directory")
    assert "mkdir" not in str(err) and "does not exist" not in str(err)
    dangling = os.path.join(tier_root, "dangling")
    os.symlink(os.path.join(tier_root, "nowhere"), dangling)
    _has_all(str(_start({"tiers": [dangling]})), dangling, "symbolic link to", "nowhere", "which does not exist")
    for pseudo, fstype in (("/proc", "proc"), ("/proc/sys/kernel", "proc"), ("/sys", "sysfs")):
        err = _start({"tiers": [pseudo]})
        _has_all(str(err), pseudo, f"on a {fstype} file system", "cannot store files", "ext4 or xfs")
        assert "No such file" not in str(err)


def test_a_tier_set_to_another_tiers_kvstream_directory_is_refused_before_anything_is_created(tier_root):
    """On tiers never used before, tier <a>/kvstream (or a directory under it, or the same reached through
    a link to <a>) used to pass the overlap check, which found the tree by its inode before the probes
    created it: the engine started, wrote its pages into tier a's tree, and every later start was
    refused. Found by a review (8101dc5)."""
    a, b = os.path.join(tier_root, "a"), os.path.join(tier_root, "b")
    os.makedirs(a)
    os.makedirs(b)
    link = os.path.join(tier_root, "link")
    os.symlink(a, link)
    tree = os.path.join(a, "kvstream")
    for inner in (tree, os.path.join(tree, "x"), os.path.join(link, "kvstream")):
        for order in ([a, b, inner], [inner, a, b]):
            err = _start({"tiers": order})
            assert isinstance(err, TierError), err
            _has_all(str(err), "extra config 'tiers'", f"tier {inner} ", tree, "choose a directory outside it")
            assert ("itself" in str(err)) == (os.path.realpath(inner) == tree), str(err)
            with pytest.raises(TierError):  # kvstream check refuses the same configuration
                check_tiers(Config.from_sources({"tiers": order}, environ={}))
            assert not os.path.lexists(tree) and not os.path.lexists(os.path.join(b, "kvstream")), \
                "nothing was created"


@pytest.mark.parametrize("n_tiers,least_text", [(2, "512K"), (3, "768K"), (4, "1M")])
def test_a_memory_setting_too_small_for_the_tier_count_is_refused_and_the_least_accepted_bounds_reads(
        tier_root, n_tiers, least_text):
    """Half of memory is read staging, an equal share per tier, and a tier's read window never falls
    below two blocks (flow.py): 4 blocks (the minimum for one tier) used to be accepted for 3-4 tiers,
    and read staging reached 2 blocks per tier, 1.5-2x the whole setting. Refused now, naming the least
    that works for the tier count; at that least, read staging stays within half of it. Found by a
    review (8101dc5)."""
    dirs = [os.path.join(tier_root, f"t{i}") for i in range(n_tiers)]
    for d in dirs:
        os.makedirs(d)
    least = 4 * ARRAY_CHUNK * n_tiers
    err = _start({"tiers": dirs, "chunk": str(ARRAY_CHUNK), "memory": "256K"})
    _has_all(str(err), "extra config 'memory'", "'256K'", f"give at least {least_text} for {n_tiers} tiers",
             "64 KiB")
    with pytest.raises(ConfigError):
        Config.from_sources({"tiers": dirs, "chunk": str(ARRAY_CHUNK), "memory": least - 4096}, environ={})
    n = 30
    pages = Pages(n, aligned=False)  # (unaligned: every read is staged)
    keys = [key(i) for i in range(n)]
    with make_array_engine(dirs, replicate="all", memory=str(least)) as engine:
        assert engine.put(keys, pages.src_segments) == [True] * n
        for _ in range(3):
            assert engine.get(keys, pages.dst_segments) == [True] * n
        assert all(pages.equal(i) for i in range(n))
        memory = engine.stats()["memory"]
        assert memory["read_peak_bytes"] <= memory["limit_bytes"] // 2, memory


@pytest.mark.parametrize("policy", ["tier2", "static-0.5/0.3/0.2"])
def test_a_policy_that_no_longer_fits_after_a_duplicate_tier_was_dropped_names_the_duplicate(tier_root, policy):
    """Three tiers listed, the third a link to the first: the duplicate is dropped, and a policy written
    for the three tiers listed no longer fits. The message said 'cannot route reads over 2 tiers' without
    a word about the duplicate (its warning never logged: the config raises first); it names it first
    now, as the capacity check does. Found by a review (8101dc5)."""
    a, b, c = (os.path.join(tier_root, d) for d in "abc")
    os.makedirs(a)
    os.makedirs(b)
    os.symlink(a, c)
    with pytest.raises(ConfigError) as info:
        Config.from_sources({"tiers": [a, b, c], "policy": policy}, environ={})
    message = str(info.value)
    _has_all(message, "extra config 'policy'", repr(policy), "cannot route reads over 2 tiers",
             f"tier {c} is listed twice in extra config 'tiers' (same directory as {a})", "remove it",
             "write the policy for 2 tiers")
    assert message.index("listed twice") < message.index("valid:"), message
    with pytest.raises(ConfigError, match="twice"):  # (the capacity check, which already did)
        Config.from_sources({"tiers": [a, b, c], "capacity": "1G:2G:3G"}, environ={})


def test_listed_twice_and_one_file_system_are_warnings_not_errors(tier_dirs, caplog):
    caplog.set_level(logging.WARNING, logger="kvstream")
    config = Config.from_sources({"tiers": [tier_dirs[0], tier_dirs[0] + "/", tier_dirs[1]]}, environ={})
    assert [t.path for t in config.tiers] == tier_dirs[:2]
    with Engine(config, NS) as engine:
        assert any("listed twice" in w for w in engine.warnings)
        assert any("same file system" in w for w in engine.warnings)
    assert len([r for r in caplog.records if "listed twice" in r.getMessage()]) == 1


def test_misspelt_variable_is_warned_about_with_the_closest_setting(tier_dirs, caplog):
    """KVSTREAM_CAPACTIY used to leave the capacity unlimited without a word; variables the project
    itself reads elsewhere (build, tests, serve-cpu) are no typo."""
    caplog.set_level(logging.WARNING, logger="kvstream")
    env = {"KVSTREAM_TIERS": tier_dirs[0], "KVSTREAM_CAPACTIY": "10G", "KVSTREAM_REPLICAT": "all",
           "KVSTREAM_LIBURING": "/x", "KVSTREAM_SERVE_MODEL": "m", "KVSTREAM_LOCK_CHECK": "0"}
    config = Config.from_sources(None, environ=env)
    assert len(config.warnings) == 2, config.warnings
    _has_all(config.warnings[0], "KVSTREAM_CAPACTIY", "did you mean KVSTREAM_CAPACITY?")
    _has_all(config.warnings[1], "KVSTREAM_REPLICAT", "did you mean KVSTREAM_REPLICATE?")
    with Engine(config, NS):
        pass
    assert len([r for r in caplog.records if "KVSTREAM_CAPACTIY" in r.getMessage()]) == 1  # logged at start-up


def test_tier_paths_expand_variables_and_errors_show_them_as_written(tier_root, monkeypatch):
    """JSON has no shell: '$HOME/kv' in the extra config used to become '<cwd>/$HOME/kv' with a 'mkdir -p'
    fix that made a directory named '$HOME'."""
    monkeypatch.setenv("KVSTREAM_TEST_ROOT", tier_root)
    os.mkdir(os.path.join(tier_root, "kv"))
    config = Config.from_sources({"tiers": ["${KVSTREAM_TEST_ROOT}/kv"]}, environ={})
    assert [t.path for t in config.tiers] == [os.path.join(tier_root, "kv")]
    Engine(config, NS).close()
    err = _start({"tiers": ["$KVSTREAM_TEST_ROOT/missing"]})
    missing = os.path.join(tier_root, "missing")
    _has_all(str(err), missing, "written '$KVSTREAM_TEST_ROOT/missing'", f"mkdir -p {missing}")


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")
def test_an_unreadable_namespace_directory_is_a_tier_error(tier_root):
    """A namespace directory this user cannot open (chmod 000, another user's) used to stop the start-up
    with a bare "PermissionError: ... '<digest>'"."""
    from helpers import as_user

    uid = 54323  # no account has it: the engine's user here (root ignores permission bits)
    os.chmod(tier_root, 0o755)
    tier = os.path.join(tier_root, "t")
    os.mkdir(tier)
    os.chown(tier, uid, uid)

    def start_twice():
        Engine(Config.from_sources({"tiers": [tier]}, environ={}), NS).close()
        ns_dir = os.path.join(tier, "kvstream", NS.digest)
        os.chmod(ns_dir, 0)
        with pytest.raises(TierError) as info:
            Engine(Config.from_sources({"tiers": [tier]}, environ={}), NS).close()
        _has_all(str(info.value), tier, "extra config 'tiers'", ns_dir, "Permission denied", "mode 0000",
                 f"chmod -R u+rwX {ns_dir}", "file_mode=shared")

    as_user(uid, start_twice)


def test_cli_reports_a_bad_setting_and_exits_2(tier_root):
    env = {**os.environ, "KVSTREAM_TIERS": os.path.join(tier_root, "missing"), "KVSTREAM_CAPACITY": "lots"}
    proc = kvstream_cli("check", env=env)
    assert proc.returncode == 2, proc
    _has_all(proc.stderr, "KVSTREAM_CAPACITY", "'lots'")
    assert "Traceback" not in proc.stderr


# -- io_uring refused (seccomp in containers, io_uring_disabled) -------------------------------------
def test_io_uring_refused_falls_back_or_names_the_setting(tier_dirs, monkeypatch, caplog):
    """What a container's seccomp profile does to io_uring_setup (EPERM), injected: 'auto' runs on the
    thread-pool engine with a log line saying why and how to silence it; 'uring' refuses to start and
    names KVSTREAM_IO_ENGINE and the fix."""

    class Refused:
        def __init__(self, *args, **kwargs):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(kio, "Ring", Refused)
    caplog.set_level(logging.WARNING, logger="kvstream")
    pages = PageSet()
    with make_engine(tier_dirs[:2], io_engine="auto") as engine:
        assert engine.io_engine == "ThreadRing"
        assert pages.put(engine, pages.keys(3)) == [True] * 3
        assert pages.checked_get(engine, pages.keys(3)) == [True] * 3
    lines = [r.getMessage() for r in caplog.records if "io_uring unavailable" in r.getMessage()]
    assert len(lines) == 1, lines  # one line per engine, not one per ring
    _has_all(lines[0], "KVSTREAM_IO_ENGINE=threads", "not permitted")
    err = _start({"tiers": tier_dirs[:1], "io_engine": "uring"})
    _has_all(str(err), "extra config 'io_engine' = 'uring'", "not permitted", "'auto' or 'threads'", "seccomp")


def test_io_uring_refused_for_the_second_ring_puts_both_paths_on_threads(tier_dirs, monkeypatch):
    """Under a memlock limit io_uring may take the read ring and refuse the write ring: under 'auto'
    both paths then run on threads, the engine reported (stats, SGLang's start-up line)."""
    real, opened = kio.Ring, []

    def second_refused(entries):
        opened.append(entries)
        if len(opened) == 2:
            raise OSError(errno.ENOMEM, "io_uring_setup refused")
        return real(entries)

    monkeypatch.setattr(kio, "Ring", second_refused)
    pages = PageSet()
    with make_engine(tier_dirs[:1], io_engine="auto") as engine:
        used = {type(engine._reads.io.ring).__name__, type(engine._writes.io.ring).__name__}
        assert used == {engine.stats()["io_engine"]} == {"ThreadRing"}
        assert pages.put(engine, pages.keys(2)) == [True] * 2
        assert pages.checked_get(engine, pages.keys(2)) == [True] * 2
