"""Config: precedence decided once, values parsed with errors that name the setting and the fix."""
from __future__ import annotations

import dataclasses
import errno
import os
import re
from unittest import mock

import pytest

from kvstream_hicache.config import SETTINGS, Capacity, Config, env_name, parse_bytes, parse_flag
from kvstream_hicache.probe import probe_tier, probe_tiers, resolve_capacity
from kvstream_hicache.errors import ConfigError, TierError


def cfg(explicit=None, env=None):
    return Config.from_sources(explicit, environ=env or {})


def test_precedence_explicit_over_env_over_default(tier_dirs):
    a, b, c = tier_dirs
    env = {"KVSTREAM_TIERS": os.pathsep.join([a, b]), "KVSTREAM_FSYNC": "data", "KVSTREAM_CHUNK": "2M"}
    config = cfg({"tiers": [c], "fsync": "full"}, env)
    assert [t.path for t in config.tiers] == [c]
    assert config.fsync == "full"  # explicit beats env
    assert config.chunk == 2 << 20  # env beats default
    assert config.policy == "kvstream"  # default
    assert config.sources["fsync"] == "extra config 'fsync'"
    assert config.sources["chunk"] == "KVSTREAM_CHUNK"
    env_only = cfg(None, env)
    assert [t.path for t in env_only.tiers] == [a, b]
    assert env_only.fsync == "data"


def test_every_setting_has_an_env_variable_and_a_doc():
    for key, setting in SETTINGS.items():
        assert env_name(key) == "KVSTREAM_" + key.upper()
        assert setting.doc


def test_empty_and_none_values_count_as_unset(tier_dirs):
    config = cfg({"tiers": tier_dirs[:1], "fsync": None}, {"KVSTREAM_FSYNC": "  "})
    assert config.fsync == "never"


def test_no_tiers_names_the_variable():
    with pytest.raises(ConfigError, match="KVSTREAM_TIERS"):
        cfg({}, {"KVSTREAM_TIERS": ""})
    with pytest.raises(ConfigError, match="KVSTREAM_TIERS"):
        cfg({"tiers": []})


def test_no_tiers_names_a_misspelt_tiers_variable():
    """KVSTREAM_TEIRS=/nvme/kv: the start failed with 'no tier directories' alone; the 'did you mean' of an
    unknown variable came only when the start went on (a warning), never here where it is the cause."""
    with pytest.raises(ConfigError) as err:
        cfg({}, {"KVSTREAM_TEIRS": "/nvme/kv"})
    assert "no tier directories" in str(err.value) and "KVSTREAM_TEIRS" in str(err.value)
    assert "did you mean KVSTREAM_TIERS?" in str(err.value)


def test_an_empty_tier_entry_is_refused_not_dropped(tier_dirs):
    """["/nvme/kv", ""] (an unset variable in a template) started on one tier without a word, or with
    per-tier capacities failed with '2 capacities for 1 tiers', naming no empty entry."""
    a = tier_dirs[0]
    for explicit, env, source in [({"tiers": [a, ""], "capacity": "1G:2G"}, {}, "extra config 'tiers'"),
                                  ({"tiers": [a, " "]}, {}, "extra config 'tiers'"),
                                  ({}, {"KVSTREAM_TIERS": a + os.pathsep}, "KVSTREAM_TIERS")]:
        with pytest.raises(ConfigError) as err:
            cfg(explicit, env)
        msg = str(err.value)
        assert msg.startswith(source) and "empty entry" in msg and a in msg, msg
    with pytest.raises(ConfigError, match="no tier directories"):  # every entry empty: unset, as before
        cfg({}, {"KVSTREAM_TIERS": os.pathsep})


def test_unknown_key_lists_valid_keys(tier_dirs):
    with pytest.raises(ConfigError) as err:
        cfg({"tiers": tier_dirs, "tier": "/x", "fsnyc": "data"})
    msg = str(err.value)
    assert "'fsnyc'" in msg and "'tier'" in msg and "valid keys" in msg and "capacity" in msg


def test_loader_keys_of_sglang_dynamic_backend_are_ignored(tier_dirs):
    config = cfg({"tiers": tier_dirs, "backend_name": "kvstream", "module_path": "x", "class_name": "y",
                  "interface_v1": 1})
    assert len(config.tiers) == 3


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("1K", 1024), ("1KiB", 1024), ("1KB", 1000), ("1M", 1 << 20), ("200G", 200 << 30),
    ("1.5TiB", int(1.5 * 2**40)), ("500MB", 500_000_000), (8192, 8192), ("2 g", 2 << 30),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "x") == expected


@pytest.mark.parametrize("text", ["abc", "12Q", "-1G", "1..5G", "G"])
def test_parse_bytes_errors(text):
    with pytest.raises(ConfigError, match="x"):
        parse_bytes(text, "x")


def test_capacity_per_tier_single_value_and_share(tier_dirs):
    config = cfg({"tiers": tier_dirs, "capacity": "200G"})
    assert all(t.capacity == Capacity(nbytes=200 << 30) for t in config.tiers)
    config = cfg({"tiers": tier_dirs}, {"KVSTREAM_CAPACITY": os.pathsep.join(["1G", "", "50%"])})
    caps = [t.capacity for t in config.tiers]
    assert caps == [Capacity(nbytes=1 << 30), Capacity(), Capacity(share=0.5)]
    st = os.statvfs(tier_dirs[2])
    assert resolve_capacity(caps[2], tier_dirs[2]) == int(st.f_blocks * st.f_frsize * 0.5)
    assert resolve_capacity(caps[1], tier_dirs[1]) is None


@pytest.mark.parametrize("value,match", [
    ("lots", "cannot parse size"), ("150%", "share"), ("x%", "share"),
])
def test_capacity_errors_name_the_setting(tier_dirs, value, match):
    with pytest.raises(ConfigError, match=match) as err:
        cfg({"tiers": tier_dirs[:1], "capacity": value})
    assert "capacity" in str(err.value)


def test_capacity_count_must_match_tiers(tier_dirs):
    with pytest.raises(ConfigError, match="2 capacities for 3 tiers"):
        cfg({"tiers": tier_dirs, "capacity": ["1G", "2G"]})


@pytest.mark.parametrize("key,value,match", [
    ("chunk", "1000", "multiple of 4096"), ("chunk", "128M", "multiple of 4096"),
    ("fsync", "always", "never, data, full"), ("io_engine", "aio", "auto, uring, threads"),
    ("file_mode", "public", "private, shared"), ("log_level", "loud", "DEBUG"),
    ("read_timeout", "soon", "number"), ("claim", 0, ">= 1"), ("policy", "fastest", "policy"),
])
def test_bad_values_name_the_setting(tier_dirs, key, value, match):
    with pytest.raises(ConfigError, match=match) as err:
        cfg({"tiers": tier_dirs[:1], key: value})
    assert key in str(err.value)


def test_env_errors_name_the_variable(tier_dirs):
    with pytest.raises(ConfigError, match="KVSTREAM_FSYNC"):
        cfg({"tiers": tier_dirs[:1]}, {"KVSTREAM_FSYNC": "sometimes"})


def test_claim_folds_into_policy(tier_dirs):
    assert cfg({"tiers": tier_dirs[:1], "claim": 4}).policy_spec == "kvstream:m=4"
    assert cfg({"tiers": tier_dirs[:1], "claim": 4, "policy": "KVStream"}).policy_spec == "kvstream:m=4"
    for policy in ("tier1", "kvstream:m=8", "static-0.5"):  # each would ignore the claim: refused, not dropped
        with pytest.raises(ConfigError, match=f"claim.*{policy!r}"):
            cfg({"tiers": tier_dirs[:2], "claim": 4, "policy": policy})


def test_duplicate_directory_is_dropped_with_a_warning(tier_dirs):
    a = tier_dirs[0]
    config = cfg({"tiers": [a, a + "/", tier_dirs[1]]})
    assert [t.path for t in config.tiers] == [a, tier_dirs[1]]
    assert any("listed twice" in w for w in config.warnings)


def test_probe_missing_directory(tier_root):
    missing = os.path.join(tier_root, "nope")
    with pytest.raises(TierError, match="does not exist.*mkdir -p"):
        probe_tiers(cfg({"tiers": [missing]}))


def test_probe_not_a_directory(tier_root):
    path = os.path.join(tier_root, "file")
    open(path, "w").close()
    with pytest.raises(TierError, match="not a directory"):
        probe_tiers(cfg({"tiers": [path]}))


def test_probe_same_file_system_warns(tier_dirs):
    warnings = probe_tiers(cfg({"tiers": tier_dirs[:2]})).warnings
    assert any("same file system" in w for w in warnings)
    assert os.path.isdir(os.path.join(tier_dirs[0], "kvstream", "tmp"))
    assert oct(os.stat(os.path.join(tier_dirs[0], "kvstream")).st_mode & 0o777) == "0o700"


def test_probe_without_o_direct(tier_dirs):
    real_open = os.open

    def no_direct(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    with mock.patch("kvstream_hicache.config.os.open", side_effect=no_direct):
        with pytest.raises(TierError, match="does not support O_DIRECT.*ext4"):
            probe_tier(tier_dirs[0], 0o700, "KVSTREAM_TIERS")


def test_an_engine_start_probes_each_tier_once(tier_dirs):
    """One O_DIRECT probe file per tier at start (the configuration check's); the tier's trust
    learns the owner from it rather than writing a second one (each costs a round trip or more on
    a network file system)."""
    from kvstream_hicache import Engine, Namespace
    from kvstream_hicache.tmpfiles import PROBE_PREFIX

    real_open = os.open
    probes = []

    def counting(path, flags, *args, **kw):
        if flags & os.O_DIRECT and flags & os.O_CREAT and os.path.basename(path).startswith(PROBE_PREFIX):
            probes.append(path)
        return real_open(path, flags, *args, **kw)

    with mock.patch("kvstream_hicache.tmpfiles.os.open", side_effect=counting):
        engine = Engine(cfg({"tiers": tier_dirs[:2]}), Namespace({"model": "probe-once"}), announce=False)
    engine.close()
    assert len(probes) == 2, probes


def test_probe_unwritable(tier_dirs):
    # As root chmod does not stop writes, so the refusal is injected as the kernel reports it.
    with mock.patch("kvstream_hicache.config.os.mkdir", side_effect=OSError(errno.EACCES, "Permission denied")):
        with pytest.raises(TierError, match="not writable.*permissions"):
            probe_tier(tier_dirs[0], 0o700, "KVSTREAM_TIERS")


def test_defaults_come_from_the_settings_table(tier_dirs):
    config = Config(tiers=tier_dirs[:1])
    for f in dataclasses.fields(Config):
        if f.name in SETTINGS and f.name != "tiers":
            assert f.default == SETTINGS[f.name].default, f.name
            assert getattr(config, f.name) == getattr(cfg({"tiers": tier_dirs[:1]}), f.name), f.name


@pytest.mark.parametrize("key,value,match", [
    ("chunk", "1000", "multiple of 4096"), ("fsync", "always", "never, data, full"), ("claim", 0, ">= 1"),
    ("policy", "fastest", "policy"), ("discover", "flase", "on/off"), ("read_timeout", -1, ">= 0"),
])
def test_a_config_built_directly_is_checked_too(tier_dirs, key, value, match):
    with pytest.raises(ConfigError, match=match) as err:
        Config(tiers=tier_dirs[:1], **{key: value})
    assert f"Config argument '{key}'" in str(err.value) and env_name(key) in str(err.value)


def test_a_config_built_directly_is_parsed_like_the_sources(tier_dirs):
    direct = Config(tiers=tier_dirs[:2], chunk="64K", fsync="DATA", discover="off", claim="3")
    assert direct == cfg({"tiers": tier_dirs[:2], "chunk": "64K", "fsync": "data", "discover": False, "claim": 3})
    assert dataclasses.replace(direct, fsync="full").fsync == "full"
    assert Config(tiers=tier_dirs[0]).tiers == Config(tiers=[tier_dirs[0]]).tiers  # one path, not its letters
    with pytest.raises(ConfigError, match="no tier directories"):
        Config(tiers=())
    with pytest.raises(ConfigError, match="fsync"):
        dataclasses.replace(direct, fsync="sometimes")


@pytest.mark.parametrize("settings,expected", [({}, 2), ({"claim": 4}, 4), ({"policy": "kvstream:m=3"}, 3),
                                               ({"policy": "static-0.5"}, 2)])
def test_claim_size_is_the_effective_m(tier_dirs, settings, expected):
    assert cfg({"tiers": tier_dirs[:1], **settings}).claim_size == expected


@pytest.mark.parametrize("text,expected", [("on", True), ("TRUE", True), (" 1 ", True), ("yes", True),
                                           ("off", False), ("False", False), ("0", False), ("no", False)])
def test_flag_parser(text, expected):
    assert parse_flag(text, "x") is expected


@pytest.mark.parametrize("text", ["flase", "", "2", "maybe"])
def test_flag_parser_refuses_anything_else(text):
    with pytest.raises(ConfigError, match="x: expected on/off"):
        parse_flag(text, "x")


def test_discover_flag(tier_dirs):
    assert cfg({"tiers": tier_dirs[:1]}).discover is True
    assert cfg({"tiers": tier_dirs[:1]}, {"KVSTREAM_DISCOVER": "off"}).discover is False
    with pytest.raises(ConfigError, match="discover"):
        cfg({"tiers": tier_dirs[:1], "discover": "maybe"})


def _design_settings_table() -> dict[str, tuple[str, str]]:
    """docs/design.md's settings table: {extra-config key: (variable, default as written)}."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "design.md")
    with open(path) as f:
        text = f.read()
    section = text[text.index("\n## Settings"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`KVSTREAM_"):
            key = cells[1].split("`")[1]
            rows[key] = (cells[0].strip("`"), cells[2])
    return rows


def test_the_design_settings_table_is_settings():
    """Every setting in docs/design.md's table, none more, each with its variable and its default."""
    table = _design_settings_table()
    assert sorted(table) == sorted(SETTINGS)
    for key, setting in SETTINGS.items():
        variable, written = table[key]
        assert variable == env_name(key), key
        default = setting.default
        quoted = written.startswith("`") and written.endswith("`")
        value = written.strip("`")
        if default is None or default == "":  # no value: the table says what happens instead
            assert not quoted and value, (key, written)
        elif isinstance(default, bool):
            assert quoted and parse_flag(value, key) is default, (key, written)
        elif isinstance(default, int):
            assert quoted and parse_bytes(value, key) == default, (key, written)
        elif isinstance(default, float):
            assert quoted and float(value) == default, (key, written)
        else:
            assert quoted and value == default, (key, written)


def test_config_does_no_io():
    """Parsing is pure: the checks that touch the tiers are probe.py's."""
    import inspect

    from kvstream_hicache import config

    calls = re.findall(r"\b(os\.(?:stat|lstat|statvfs|mkdir|chmod|open|scandir|listdir|readlink)|open|probe_direct|"
                       r"os\.path\.(?:isdir|exists|lexists|islink))\(", inspect.getsource(config))
    assert calls == []


def test_a_policy_validates_against_the_tier_count_without_building_a_route():
    from kvstream_hicache.router import CompletionDriven, SingleTier, StaticSplit

    CompletionDriven().validate(3)
    SingleTier(1).validate(2)
    with pytest.raises(ValueError, match="no tier 2"):
        SingleTier(2).validate(2)
    with pytest.raises(ValueError, match="3 shares for 2 tiers"):
        StaticSplit((0.5, 0.3, 0.2)).validate(2)


def test_a_single_tier_policy_with_a_bad_claim_is_refused_at_start_up(tier_dirs):
    """'tier0:m=0' was accepted (SingleTier checked no claim), and every get raised ValueError from its route
    (found reading the house, stop 51): a setting's error, named at start-up with the value as written."""
    for spec in ("tier0:m=0", "tier1:m=4,depth=2", "Tier0:M=0"):  # (quoted as written)
        with pytest.raises(ConfigError, match=re.escape(repr(spec))):
            Config.from_sources({"tiers": tier_dirs[:2], "policy": spec}, environ={})
