"""Settings: one frozen dataclass, precedence decided once in :meth:`Config.from_sources`.

Every setting has an extra-config key (SGLang's ``--hicache-storage-backend-extra-config``, an
LMCache config) and an environment variable ``KVSTREAM_<KEY upper case>``; the explicit key wins
over the variable, which wins over the default. The table :data:`SETTINGS` is the single source of
names, defaults and documentation (docs/design.md lists the same).

No I/O but names: a path is made absolute, and a duplicate tier found by its real path (``realpath``, on a
thread of its own and bounded: real_path; a hung tier is not waited for). probe.py does the checks that
touch the tiers (directory exists, writable, O_DIRECT works, two tiers on one file
system, capacities as a share of a file system) once when an engine starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .bounded import BoundedCalls
from .errors import ConfigError
from .flow import MIN_REQUESTS
from .index import MAX_TIERS
from .layout import ALIGN, DEFAULT_BLOCK
from .router import parse_policy

ENV_PREFIX = "KVSTREAM_"
FSYNC_MODES = ("never", "data", "full")
IO_ENGINES = ("auto", "uring", "threads")
FILE_MODES = ("private", "shared")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_CHUNK = 64 << 20  # largest routing block, bytes
MIN_CAPACITY = 1  # capacity counts payload bytes (index.py): the least capacity holds a page of one byte
# Keys SGLang's `dynamic` backend loader puts in the extra config next to ours.
LOADER_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})

# File and directory permissions by KVSTREAM_FILE_MODE: private to the user, or group-shared
# (setgid directories keep the group of the tier on shared file systems).
MODES = {"private": (0o600, 0o700), "shared": (0o660, 0o2770)}

# KVSTREAM_* variables the project reads that are not settings (build, tests, tools): no warning for them.
OTHER_VARIABLES = frozenset({"KVSTREAM_LIBURING", "KVSTREAM_CACHE", "KVSTREAM_REQUIRE_URING", "KVSTREAM_LOCK_CHECK",
                             "KVSTREAM_STRICT", "KVSTREAM_1TIER", "KVSTREAM_VENV",
                             "KVSTREAM_LMCACHE_VENV", "KVSTREAM_SGLANG_PYTHON", "KVSTREAM_PEERS_CACHE",
                             "KVSTREAM_DEMO_DIR"})
OTHER_PREFIXES = ("KVSTREAM_SERVE_", "KVSTREAM_TEST_")  # kvstream serve-cpu's own; the test suite's


class Setting(NamedTuple):
    default: Any
    doc: str


SETTINGS: dict[str, Setting] = {
    "tiers": Setting(None, "tier directories, fastest first (env: separated by os.pathsep, like PATH)"),
    "capacity": Setting("", "per-tier capacity, os.pathsep-separated in tier order (one value = every "
                            "tier): '200G', '1.5TiB', '500MB', '50%' of the file system; empty = unlimited"),
    "policy": Setting("kvstream", "read routing: 'kvstream[:m=N]', 'static-G' (share G to tier 0), 'tierK'"),
    "claim": Setting(None, "m, blocks claimed at a time by a tier under the kvstream policy (router default)"),
    "chunk": Setting(DEFAULT_BLOCK, "routing and checksum block, bytes (multiple of 4096, e.g. '1M')"),
    "fsync": Setting("never", "'never' (data reaches the device via O_DIRECT, no flush), 'data' (fsync each "
                              "page before its rename), 'full' (and fsync the directory after the rename)"),
    "io_engine": Setting("auto", "'auto' (io_uring, else threads with one log line), 'uring', 'threads'"),
    "file_mode": Setting("private", "'private' (files 0600, dirs 0700; trusts the user's files) or 'shared' "
                                     "(0660 / 2770; also trusts the tier directory's group)"),
    "log_level": Setting(None, "level of the 'kvstream' logger (DEBUG, INFO, WARNING, ...); unset = inherit"),
    "memory": Setting("64M", "staging memory of the engine, bytes: half for reads in flight (shared by the "
                             "tiers), half for staged write requests in flight (pages not 4096-aligned in "
                             "memory, tiers on network file systems); e.g. '64M', '1G'"),
    "read_timeout": Setting(30.0, "seconds a get waits for its last block before reporting the rest missing"
                                  " (0 = wait forever); a read landing in caller memory is waited for regardless"),
    "write_timeout": Setting(10.0, "seconds a tier's writes in flight may go without progress before the tier "
                                   "is failed and the puts answer without its copy (0 = wait forever, but 10 s in "
                                   "close(): an exit is bounded); its writes "
                                   "are abandoned, their files never committed; on a tier not on a local file "
                                   "system, also how long a create, rename, unlink or probe there is waited for"),
    "tier_retry": Setting(5.0, "seconds before a failed tier is probed again (doubles up to 300 s)"),
    "discover": Setting(True, "look up pages the index lacks on the tiers (written by another process sharing "
                              "the namespace, e.g. MLA's writer rank); off = index only"),
    "replicate": Setting("budget", "'all' (every new page on every tier) or 'budget' (a slower tier skips a new "
                                   "page's replica when its pending writes would drain later than the home tier's, "
                                   "or than replicate_slack)"),
    "replicate_slack": Setting(1.0, "replicate=budget: a replica is written when its tier drains it within "
                                    "max(the home copy's drain time, this many seconds)"),
    "catchup": Setting(True, "background replication: a replica a page lacks (skipped by replicate=budget, lost "
                             "to a failure, damage or eviction) is written later from a copy that exists, and a "
                             "page read from a slower tier alone is copied to the faster ones; off = never"),
    "catchup_share": Setting(0.75, "catch-up writes take at most this share (0 < share <= 1) of a tier's write "
                                   "time, and only while no get reads the tier and no put waits for it"),
    "read_priority": Setting(True, "writes to a tier wait while a get reads from it (on), or go out whatever is "
                                   "read (off: the behaviour before read priority, every write in flight at once)"),
    "register_memory": Setting(True, "memory an adapter reads pages into (SGLang's host pool, LMCache's buffer) is "
                                     "registered with the read ring once (io_uring fixed buffers: pinned for the "
                                     "engine's life), so reads land in it directly without pinning it per read; off "
                                     "= reads into memory in 4 KiB pages are staged and copied"),
    "write_backlog": Setting("2G", "deferred writes (the LMCache path): bytes of pages queued and not yet "
                                   "committed; a store beyond it waits (back-pressure), e.g. '2G'"),
    "scan_rate": Setting(2000.0, "the background start-up scan reads at most this many page files a second per "
                                 "tier (each an open, a 4 KiB read and a close: a shared file system's metadata "
                                 "servers serve every restarting server at once); 0 = as fast as it goes"),
    "scan_cpu": Setting(0.25, "share of one core the background start-up scan of a tier may use, above 0 up "
                              "to 1 (1 = as much as it takes)"),
}
REPLICATE_MODES = ("all", "budget")


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


# ----------------------------------------------------------------------------- value parsing
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_bytes(text: str | int, what: str) -> int:
    """'4096', '1M', '1MiB' (binary), '1MB' (decimal, as dd), '1.5T' -> bytes."""
    if isinstance(text, bool):
        raise ConfigError(f"{what}: expected a size like '1M', got {text!r}")
    if isinstance(text, int):
        value = text
    elif isinstance(text, float):  # JSON 1.5: a byte count has no half bytes, and truncating hides the typo
        if not text.is_integer():
            raise ConfigError(f"{what}: {text!r} is not a whole number of bytes; give bytes or a size like '2G'")
        value = int(text)
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if not m:
            raise ConfigError(f"{what}: cannot parse size {text!r}; use a number with an optional unit "
                              "K, M, G, T, P (binary, also KiB...) or KB, MB, GB... (decimal), e.g. '200G'")
        number, unit, binary, b = m.groups()
        if not unit and not float(number).is_integer():  # a plain byte count, as JSON 1.5 above (with
            # a unit, '1.1G' is a size and its fraction of a byte rounds down)
            raise ConfigError(f"{what}: {text!r} is not a whole number of bytes; give bytes or a size like '2G'")
        base = 1000 if (b and not binary and unit) else 1024
        value = int(float(number) * base ** _POW[unit.lower()])
    if value < 0:
        raise ConfigError(f"{what}: size must be >= 0, got {text!r}")
    return value


class Capacity(NamedTuple):
    """A tier's limit: ``nbytes`` or ``share`` of its file system, or neither (unlimited)."""

    nbytes: int | None = None
    share: float | None = None

    @classmethod
    def parse(cls, text: str | int | float | None, what: str) -> "Capacity":
        try:
            return cls._parse(text, what)
        except ConfigError as exc:  # '1G,2G': a list in another separator reads as one value that does not parse
            sep = next((c for c in ",; " if isinstance(text, str) and _capacities(text.strip().split(c), what)), None)
            if sep is None:
                raise
            raise ConfigError(f"{exc}; capacities are separated by '{os.pathsep}' (one per tier, in tier order), "
                              f"not {sep!r}") from None

    @classmethod
    def _parse(cls, text: str | int | float | None, what: str) -> "Capacity":
        if text is None or (isinstance(text, str) and text.strip() in ("", "none", "unlimited")):
            return cls()
        if isinstance(text, str) and text.strip().endswith("%"):
            try:
                pct = float(text.strip()[:-1])
            except ValueError:
                raise ConfigError(f"{what}: cannot parse share {text!r}; use e.g. '50%'") from None
            if not 0 < pct <= 100:
                raise ConfigError(f"{what}: share must be in (0, 100]%, got {text!r}")
            return cls(share=pct / 100)
        if isinstance(text, float):
            if not math.isfinite(text):
                raise ConfigError(f"{what}: {text!r} is not a size; give bytes or a size like '200G', or leave it "
                                  "empty for unlimited")
        nbytes = parse_bytes(text, what)
        if nbytes < MIN_CAPACITY:
            raise ConfigError(f"{what}: {text!r} holds no page (capacity counts the bytes of the pages stored, at "
                              f"least {MIN_CAPACITY}); give a size like '200G', or leave it empty for unlimited")
        return cls(nbytes=nbytes)

    def __str__(self) -> str:
        if self.share is not None:
            return f"{self.share * 100:.12f}".rstrip("0").rstrip(".") + "%"  # '0.000003%', not '3e-06%'
        if self.nbytes is None:
            return "unlimited"
        if self.nbytes < 1024:
            return f"{self.nbytes} bytes"
        unit, scale = next((u, 1 << p) for u, p in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10))
                           if self.nbytes >= 1 << p)
        x = self.nbytes / scale
        return f"{x:.0f} {unit}" if x >= 100 else f"{x:.3g} {unit}"  # '1.5 TiB', '977 KiB': not '3.81e-06 GiB'


def _capacities(parts: list[str], what: str) -> bool:
    """Whether ``parts`` are two or more capacities, each as Capacity.parse takes it."""
    if len(parts) < 2:
        return False
    try:
        for part in parts:
            Capacity._parse(part, what)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class TierConfig:
    path: str
    capacity: Capacity = Capacity.parse(SETTINGS["capacity"].default, "capacity")  # (one tier: no limit)
    # the entry as written ('$HOME/kv', 'kv0'): messages name it too, the operator greps the config for it
    written: str | None = field(default=None, compare=False)
    # later entries of the tier list that name this directory again, dropped (Config.from_sources): a
    # policy or capacities written for the list as written no longer fit, and the messages say why
    duplicates: tuple[str, ...] = field(default=(), compare=False)
    # its real path answered when the settings were read (Config.from_sources, in write_timeout); False: it
    # did not (a network tier whose server is away): the engine and the CLI start it failed at once, and do
    # not wait for it a second time (probe.look_at)
    answered: bool = field(default=True, compare=False)


def _choice(value: Any, choices: tuple[str, ...], what: str, upper: bool = False) -> str:
    text = str(value).strip()
    text = text.upper() if upper else text.lower()
    if text not in choices:
        raise ConfigError(f"{what}: {value!r} is not one of {', '.join(choices)}")
    return text


def parse_number(value: Any, what: str, kind: Callable = float, minimum: float = 0, hint: str = "") -> Any:
    """``kind(value)``, finite and >= ``minimum``; anything else is an error naming ``what``."""
    try:
        if isinstance(value, bool):  # JSON true is no number of seconds (float(True) would be 1.0)
            raise ValueError
        out = kind(value)
        if kind is int and isinstance(value, float) and out != value:  # int() would truncate 2.5 to 2
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{what}: expected {'a whole' if kind is int else 'a'} number, got {value!r}{hint}") from None
    if not math.isfinite(out):
        raise ConfigError(f"{what}: expected a finite number, got {value!r}{hint}")
    if out < minimum:
        raise ConfigError(f"{what}: must be >= {minimum}, got {value!r}{hint}")
    return out


def parse_flag(value: Any, what: str) -> bool:
    """on/off, 1/0, true/false, yes/no (any case) or a bool; anything else is an error naming ``what``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}: expected on/off (1/0, true/false), got {value!r}")


def _split(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        if value.strip().startswith("[") and value.strip().endswith("]"):  # (the extra config's list, in a string)
            try:
                listed = os.pathsep.join(map(str, json.loads(value)))
            except (ValueError, TypeError):
                listed = f"a{os.pathsep}b"
            raise ConfigError(f"{what}: {value!r} is a JSON list in a string; a string takes the entries "
                              f"separated by {os.pathsep!r}, as PATH does: {listed} (the extra config also takes "
                              "a JSON list itself)")
        return value.split(os.pathsep)
    if isinstance(value, (list, tuple)):
        return [str(v) if v is not None else "" for v in value]
    raise ConfigError(f"{what}: expected a list or an {os.pathsep!r}-separated string, got {value!r}")


# -------------------------------------------------------------------------------------- Config
def _default(key: str) -> Any:
    return SETTINGS[key].default


@dataclass(frozen=True)
class Config:
    """Effective settings. Build with :meth:`from_sources` (precedence, tier lists as text) or directly,
    e.g. ``Config(tiers=["/a", "/b"], chunk="64K")``. Either way :meth:`__post_init__` parses and checks
    every setting, so a Config never holds a value the engine would refuse; the fields hold the parsed
    values (``chunk`` in bytes, ``fsync`` in lower case, ...). Defaults come from :data:`SETTINGS`."""

    tiers: tuple[TierConfig, ...]
    policy: str = _default("policy")
    claim: int | None = _default("claim")
    chunk: int = _default("chunk")
    fsync: str = _default("fsync")
    io_engine: str = _default("io_engine")
    file_mode: str = _default("file_mode")
    log_level: str | None = _default("log_level")
    memory: int = _default("memory")
    read_timeout: float = _default("read_timeout")
    write_timeout: float = _default("write_timeout")
    tier_retry: float = _default("tier_retry")
    discover: bool = _default("discover")
    replicate: str = _default("replicate")
    replicate_slack: float = _default("replicate_slack")
    catchup: bool = _default("catchup")
    catchup_share: float = _default("catchup_share")
    read_priority: bool = _default("read_priority")
    register_memory: bool = _default("register_memory")
    write_backlog: int = _default("write_backlog")
    scan_rate: float = _default("scan_rate")
    scan_cpu: float = _default("scan_cpu")
    warnings: tuple[str, ...] = field(default=(), compare=False)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_sources(cls, explicit: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
                     *, ignore: frozenset[str] | set[str] = LOADER_KEYS, labels: Mapping[str, str] | None = None
                     ) -> "Config":
        """Decide every setting once: explicit key > ``KVSTREAM_*`` variable > default.

        :param explicit: extra-config dict (keys as in :data:`SETTINGS`); None values count as unset.
        :param environ: environment mapping (default ``os.environ``).
        :param ignore: keys of the host's own loader to skip silently.
        :param labels: where an explicit key comes from, for messages (default "extra config 'KEY'"),
            e.g. ``{"tiers": "--tiers"}``.
        :raises ConfigError: unknown key, malformed value, no tiers; the message names the setting.
        """
        environ = os.environ if environ is None else environ
        explicit = {k: v for k, v in (explicit or {}).items() if k not in ignore}
        unknown = sorted(set(explicit) - set(SETTINGS))
        if unknown:
            # (a typo names the setting meant, as a misspelt KVSTREAM_* variable does: unknown_variables)
            close = [(k, m) for k in unknown if (m := _closest(k, SETTINGS))]
            close = [repr(m) if len(unknown) == 1 else f"{m!r} for {k!r}" for k, m in close]
            raise ConfigError(f"unknown kvstream setting(s) {', '.join(map(repr, unknown))} in the extra config; "
                              + (f"did you mean {', '.join(close)}? " if close else "")
                              + f"valid keys: {', '.join(SETTINGS)}")
        raw: dict[str, Any] = {}
        sources: dict[str, str] = {}
        shadowed: dict[str, str] = {}  # key -> the variable's text an explicit setting overrides
        for key, setting in SETTINGS.items():
            if explicit.get(key) is not None:
                raw[key], sources[key] = explicit[key], (labels or {}).get(key, f"extra config '{key}'")
                if environ.get(env_name(key), "").strip():
                    shadowed[key] = environ[env_name(key)].strip()
            elif environ.get(env_name(key), "").strip():
                raw[key], sources[key] = environ[env_name(key)], env_name(key)
            else:
                raw[key], sources[key] = setting.default, f"default of {env_name(key)}"
        what = lambda key: setting_source(sources, key)  # noqa: E731
        try:  # (the bound of a tier's first look, below; a bad value is refused with the others, in __post_init__)
            bound = parse_number(raw["write_timeout"], what("write_timeout"))
        except ConfigError:
            bound = SETTINGS["write_timeout"].default
        reals: dict[str, str | None] = {}  # (a tier's real path is waited for once: a hung one costs write_timeout)
        try:
            warnings, tiers = _parse_tiers(raw["tiers"], raw["capacity"], what, bound, reals)
        except ConfigError as exc:  # a misspelt KVSTREAM_TIERS is why there are no tiers: said in the error,
            hints = unknown_variables(environ)  # as it is said in a warning when the start goes on
            if not hints:
                raise
            raise ConfigError(f"{exc}; {'; '.join(hints)}") from None
        values = {k: v for k, v in raw.items() if k not in ("tiers", "capacity")}
        config = cls(tiers=tiers, **values, sources=dict(sources))
        overridden = [f"{env_name(key)}={env} is overridden by {sources[key]} = {explicit[key]!r} (an explicit "
                      "setting wins over the environment)"  # (a user who exported it expects it to count)
                      for key, env in shadowed.items() if not config._same(key, env, raw, reals)]
        return dataclasses.replace(config, warnings=tuple(warnings + overridden + unknown_variables(environ)))

    def _same(self, key: str, text: str, raw: Mapping[str, Any], reals: dict[str, str | None]) -> bool:
        """Whether ``text`` (a variable's) parses to the value this config holds for ``key``: the same
        value written another way ('30' and 30.0, '1M' and 1048576) overrides nothing. ``reals``: as
        _parse_tiers takes it."""
        try:
            if key in ("tiers", "capacity"):
                # (a path the settings in use do not name is not asked: the variable is only compared, and
                # one on a hung mount, a stale KVSTREAM_TIERS, would cost the start another write_timeout)
                other = _parse_tiers(*(text if k == key else raw[k] for k in ("tiers", "capacity")),
                                     lambda k: k, self.write_timeout, reals, ask=False)[1]
                return [(t.path, t.capacity) for t in other] == [(t.path, t.capacity) for t in self.tiers]
            return getattr(dataclasses.replace(self, **{key: text}), key) == getattr(self, key)
        except ConfigError:
            return False

    def __post_init__(self) -> None:
        """Parse and check every setting (the values as written, or already parsed ones: parsing is
        idempotent, so ``dataclasses.replace`` re-checks too); errors name the setting and the fix."""
        def what(key: str) -> str:
            return setting_source(self.sources, key)

        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)  # frozen: normalise once, here

        given = (self.tiers,) if isinstance(self.tiers, (str, os.PathLike, TierConfig)) else (self.tiers or ())
        tiers = tuple(t if isinstance(t, TierConfig) else TierConfig(_tier_path(str(t), what("tiers")))
                      for t in given)
        if not tiers:
            raise _no_tiers()
        if len(tiers) > MAX_TIERS:
            raise ConfigError(f"{what('tiers')}: {len(tiers)} tiers; kvstream holds at most {MAX_TIERS} (one bit "
                              "each in the index): list fewer directories")
        for t in tiers:
            _tier_path(t.path, what("tiers"))  # a TierConfig built by hand is checked too
        put("tiers", tiers)
        chunk = parse_bytes(self.chunk, what("chunk"))
        if chunk < ALIGN or chunk % ALIGN or chunk > MAX_CHUNK:
            raise ConfigError(f"{what('chunk')}: {self.chunk!r} must be a multiple of {ALIGN} bytes between "
                              f"4K and {MAX_CHUNK >> 20}M (O_DIRECT alignment), e.g. '1M'")
        put("chunk", chunk)
        memory = parse_bytes(self.memory, what("memory"))
        # Half of memory is read staging, shared equally by the tiers (engine.py); a tier's read window
        # never falls below MIN_REQUESTS blocks (flow.py), so a share smaller than that would be
        # exceeded by every tier at once.
        need = 2 * MIN_REQUESTS * chunk * len(tiers)
        if memory < need:
            tiers_text = f"{len(tiers)} tier{'s' * (len(tiers) != 1)}"
            raise ConfigError(f"{what('memory')}: {self.memory!r} is less than {2 * MIN_REQUESTS} blocks of "
                              f"{chunk >> 10} KiB per tier ({tiers_text}: half of it is for reads, an equal share per "
                              f"tier holding a window of at least {MIN_REQUESTS} blocks, half for writes); give at least "
                              f"{_size_text(need)} for {tiers_text} (default {SETTINGS['memory'].default}), or a "
                              "smaller chunk")
        put("memory", memory)
        put("claim", None if self.claim is None else parse_number(self.claim, what("claim"), int, 1))
        written = self.policy
        put("policy", str(self.policy).strip().lower())  # the router reads 'KVStream' as 'kvstream' too
        _check_policy(written, self.claim, what("policy"), len(tiers), what("claim"),
                      [(d, t.path) for t in tiers for d in t.duplicates], what("tiers"))
        if self.log_level is not None:
            put("log_level", _choice(self.log_level, LOG_LEVELS, what("log_level"), upper=True))
        put("fsync", _choice(self.fsync, FSYNC_MODES, what("fsync")))
        put("io_engine", _choice(self.io_engine, IO_ENGINES, what("io_engine")))
        put("file_mode", _choice(self.file_mode, FILE_MODES, what("file_mode")))
        put("read_timeout", parse_number(self.read_timeout, what("read_timeout"),
                                         hint="; give seconds, e.g. 30, or 0 to wait forever"))
        put("write_timeout", parse_number(self.write_timeout, what("write_timeout"),
                                          hint="; give seconds, e.g. 10, or 0 to wait forever"))
        put("tier_retry", parse_number(self.tier_retry, what("tier_retry"), minimum=0.1,
                                       hint="; give seconds before a failed tier is probed again, e.g. 5"))
        put("discover", parse_flag(self.discover, what("discover")))
        put("replicate", _choice(self.replicate, REPLICATE_MODES, what("replicate")))
        put("replicate_slack", parse_number(self.replicate_slack, what("replicate_slack"),
                                            hint="; give seconds, e.g. 1 (the default)"))
        put("catchup", parse_flag(self.catchup, what("catchup")))
        share = parse_number(self.catchup_share, what("catchup_share"),
                             hint="; give a share of the tier's write time, e.g. 0.75 (the default)")
        if not 0 < share <= 1:
            raise ConfigError(f"{what('catchup_share')}: must be above 0 and at most 1, got {self.catchup_share!r}; "
                              "give e.g. 0.75 (the default), or catchup=off to turn background replication off")
        put("catchup_share", share)
        put("read_priority", parse_flag(self.read_priority, what("read_priority")))
        put("register_memory", parse_flag(self.register_memory, what("register_memory")))
        put("write_backlog", parse_bytes(self.write_backlog, what("write_backlog")))
        put("scan_rate", parse_number(self.scan_rate, what("scan_rate"),
                                      hint="; give page files a second per tier, e.g. 2000, or 0 for no limit"))
        scan_cpu = parse_number(self.scan_cpu, what("scan_cpu"), hint="; give a share of one core, e.g. 0.25")
        if not 0 < scan_cpu <= 1:
            raise ConfigError(f"{what('scan_cpu')}: {self.scan_cpu!r} must be above 0 and at most 1 (a share of "
                              f"one core, e.g. 0.25; 1 = no limit)")
        put("scan_cpu", scan_cpu)
        put("warnings", tuple(self.warnings))
        put("sources", dict(self.sources))

    # -- derived ------------------------------------------------------------------------------
    @property
    def policy_spec(self) -> str:
        """The router policy spec, with ``claim`` folded into a bare 'kvstream'."""
        if self.claim is not None and self.policy == "kvstream":
            return f"kvstream:m={self.claim}"
        return self.policy

    @property
    def claim_size(self) -> int:
        """``m``, the blocks a tier claims at a time: ``claim``, else what the policy spec says, else the
        router's default."""
        return parse_policy(self.policy_spec).m

    @property
    def modes(self) -> tuple[int, int]:
        """(file mode, directory mode) for KVSTREAM_FILE_MODE."""
        return MODES[self.file_mode]

    def summary(self) -> str:
        tiers = ", ".join(f"{t.path} [{t.capacity}]" for t in self.tiers)
        replicate = self.replicate if self.replicate == "all" else f"budget (slack {self.replicate_slack:g} s)"
        return (f"tiers: {tiers}; policy {self.policy_spec}; chunk {self.chunk >> 10} KiB; memory "
                f"{self.memory >> 20} MiB; fsync {self.fsync}; io {self.io_engine}; files {self.file_mode}; "
                f"replicate {replicate}; catch-up "
                f"{f'on (share {self.catchup_share:g})' if self.catchup else 'off'}; "
                f"read priority {'on' if self.read_priority else 'off'}")


def setting_source(sources: Mapping[str, str], key: str) -> str:
    """Where setting ``key`` came from, for messages: the source, and for a default also its names."""
    source = sources.get(key)
    if source is None or source.startswith("default of"):
        return f"{source or f'Config argument {key!r}'} ({env_name(key)} / extra config '{key}')"
    return source


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``KVSTREAM_*`` variable that is no setting and none the project reads elsewhere:
    a misspelt KVSTREAM_CAPACTIY would otherwise leave the setting at its default without a word. A
    warning, not an error: other tools may use the namespace."""
    names = [env_name(key) for key in SETTINGS]
    out = []
    for var in sorted(environ):
        if (var.startswith(ENV_PREFIX) and var not in names and var not in OTHER_VARIABLES
                and not var.startswith(OTHER_PREFIXES)):
            close = _closest(var, names)
            out.append(f"environment variable {var} is not a kvstream setting and is ignored"
                       + (f"; did you mean {close}?" if close else f"; the settings are {', '.join(names)}"))
    return out


def _closest(name: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` a typo of ``name`` most likely meant (a misspelt key or variable), or None."""
    close = difflib.get_close_matches(name, list(names), n=1)
    return close[0] if close else None


def _no_tiers() -> ConfigError:
    return ConfigError(f"no tier directories: set {env_name('tiers')}=/fast/dir{os.pathsep}/slow/dir "
                       "(fastest first) or the extra config key 'tiers' (a list; LMCache: adapter_params 'tiers')")


def _parse_tiers(raw_tiers: Any, raw_capacity: Any, what: Callable[[str], str], bound: float = 0.0,
                 reals: dict[str, str | None] | None = None, ask: bool = True
                 ) -> tuple[list[str], tuple[TierConfig, ...]]:
    """(warnings, tiers) from the tier list and capacities as written (lists, or os.pathsep-separated).
    A tier listed twice is told by its real path, looked up on a thread waited for at most ``bound`` s
    (write_timeout; 0: in place): a realpath through a FUSE or NFS mount whose server stopped never
    returns, and every start (an engine's, ``kvstream check``'s) waited with it. A tier that does not
    answer is kept as written (only the same text names it twice) and marked so (TierConfig.answered):
    the start fails it at once (probe.py). ``reals``: the real paths (None: no answer) already looked up
    in this reading of the settings, and where the ones looked up here go (each path is waited for once);
    ``ask`` False: a path not in ``reals`` is not looked up, only its text tells it from the others."""
    warnings: list[str] = []
    paths: list[str] = []
    written: dict[str, str] = {}
    reals = {} if reals is None else reals
    twice: dict[str, list[str]] = {}  # tier kept -> the later entries naming it again
    if raw_tiers is not None:
        seen: dict[str, str] = {}
        entries = _split(raw_tiers, what("tiers"))
        for entry in entries:
            if not entry.strip():
                if any(e.strip() for e in entries):  # ["/nvme/kv", "$PFS"] with PFS unset: a tier lost unsaid
                    raise ConfigError(f"{what('tiers')}: {raw_tiers!r} has an empty entry; give every tier's "
                                      "directory, or remove the empty entry (and its capacity)")
                continue  # (every entry empty: unset, as an empty variable)
            path = _tier_path(entry.strip(), what("tiers"))
            if path not in reals and ask:
                reals[path] = real_path(path, bound)
            real = reals.get(path) or path
            if real in seen:
                warnings.append(f"tier {path} is listed twice ({what('tiers')}; same directory as {seen[real]}): "
                                "the duplicate is ignored, it would add no bandwidth and no redundancy")
                twice.setdefault(seen[real], []).append(path)
                continue
            seen[real] = path
            paths.append(path)
            written[path] = entry.strip()
    if not paths:
        raise _no_tiers()
    if raw_capacity in (None, "") or isinstance(raw_capacity, (int, float)):
        caps = [raw_capacity]
    elif isinstance(raw_capacity, (list, tuple)):
        caps = list(raw_capacity)
    else:
        caps = _split(raw_capacity, what("capacity"))
    if len(caps) == 1:
        caps = caps * len(paths)
    if len(caps) != len(paths):
        dup = _listed_twice([(d, p) for p, ds in twice.items() for d in ds], what("tiers"),
                            "remove the duplicate and its capacity")  # the likely cause of the mismatch, said first
        raise ConfigError(f"{what('capacity')}: {raw_capacity!r} is {len(caps)} capacities for {len(paths)} tiers"
                          f"{dup}; give one value per tier in tier order (empty = unlimited) or a single value "
                          f"for all")  # (the value as written: the operator greps the config for it)
    return warnings, tuple(TierConfig(p, Capacity.parse(c, f"{what('capacity')} for tier {p}"), written[p],
                                      tuple(twice.get(p, ())), reals.get(p, p) is not None) for p, c in zip(paths, caps))


def _listed_twice(twice: list[tuple[str, str]], what_tiers: str, fix: str) -> str:
    """'; tier D is listed twice in <tiers> (same directory as P): <fix>' for each (duplicate D, tier P
    kept): said first in a message about a count that no longer fits the tiers as listed."""
    return "".join(f"; tier {d} is listed twice in {what_tiers}{f' (same directory as {p})' * (d != p)}: {fix}"
                   for d, p in twice)


def _size_text(nbytes: int) -> str:
    """A size as a setting takes it, exact: '12M', '768K', '4096'."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes and not nbytes % (1 << shift):
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def real_path(path: str, bound: float) -> str | None:
    """The real path of ``path`` (:func:`real_path_on`) on a thread of its own, waited for at most ``bound`` s
    (bounded.py; 0: in place, no limit); None: it did not return in time (the thread ends when the tier answers)."""
    calls = BoundedCalls(f"tier {path}", bound)
    try:
        return real_path_on(calls, path)
    finally:
        calls.close()


def real_path_on(calls: BoundedCalls, path: str) -> str | None:
    """``os.path.realpath(path)`` on ``calls`` (a tier's calls thread, bounded.py): a realpath through a mount
    whose server stopped never returns. None: it did not return in time (a hung network or FUSE tier)."""
    try:
        return calls.run(os.path.realpath, path)
    except OSError:  # (ETIMEDOUT: the one error a realpath raises, being given up on)
        return None


def _tier_path(entry: str, what: str) -> str:
    """A tier path as written -> absolute, '~' and '$VAR' / '${VAR}' expanded as a shell would (an
    extra config is JSON: no shell expanded them); a variable that is not set is refused, not left in
    the path as a directory named '$VAR'. A NUL byte (no file name can hold one) is refused here, before
    any system call would fail on it with a bare 'embedded null byte'."""
    if "\0" in entry:
        raise ConfigError(f"{what}: tier path {entry!r} contains a NUL byte, which no file name can hold: "
                          "correct the tier list")
    expanded = os.path.expandvars(os.path.expanduser(entry))
    unset = re.search(r"\$(\w+|\{[^}]*\})", expanded)
    if unset:
        raise ConfigError(f"{what}: tier path {entry!r} names the environment variable {unset.group(0)}, which is "
                          "not set in this process: set it, or write the path out")
    return os.path.abspath(expanded)


def check_policy(policy: str, what: str, n_tiers: int) -> None:
    """A routing policy given elsewhere than in the settings (``kvstream bench --policies``), checked as the
    setting is: it parses and fits ``n_tiers`` tiers; ``what`` names where it was given.
    :raises ConfigError: naming ``what``, the policy as written and the valid forms."""
    _check_policy(policy, None, what, n_tiers)


def _check_policy(written: str, claim: int | None, what: str, n_tiers: int, what_claim: str = "claim",
                  twice: list[tuple[str, str]] | None = None, what_tiers: str = "tiers") -> None:
    """The policy ``written`` (as the user wrote it: the messages quote it so) parses and fits the tiers
    (``tier2`` with two tiers, three static shares for two tiers would fail every read); ``claim`` goes
    with the bare 'kvstream' policy only (any other spec would silently override or ignore it:
    Config.policy_spec). ``twice``: (duplicate, tier kept) of the entries dropped from the tier list, named
    first when the policy does not fit (it was likely written for the tiers as listed)."""
    policy = str(written).strip().lower()
    if claim is not None and policy != "kvstream":
        base, _, opts = policy.partition(":")
        example = base + ":" + ",".join([o for o in opts.split(",") if o and not o.strip().startswith("m=")]
                                        + [f"m={claim}"])
        raise ConfigError(f"{what_claim}: {claim} sets m for the bare 'kvstream' policy only, but {what} is "
                          f"{written!r}, which {'fixes its own m' if 'm=' in opts else 'would ignore it'}: drop "
                          f"{what_claim}, or write m into the policy, e.g. {example!r}")
    spec = f"kvstream:m={claim}" if claim is not None and policy == "kvstream" else policy
    tiers = f"'tier0' .. 'tier{n_tiers - 1}'" if n_tiers > 1 else "'tier0'"
    valid = f"valid: 'kvstream', 'kvstream:m=4', 'static-0.75', {tiers}"
    try:
        parsed = parse_policy(spec)
    except ValueError as exc:  # (its name, options, shares, claim and depth: whatever the tiers)
        raise ConfigError(f"{what}: {written!r} is not a routing policy ({exc}); {valid}") from None
    try:
        parsed.validate(n_tiers)
    except ValueError as exc:
        counted = f"{n_tiers} tier{'s' * (n_tiers != 1)}"
        dup = _listed_twice(twice or [], what_tiers, f"the duplicate is dropped, leaving {counted}; remove it and "
                                                     f"write the policy for {counted}")
        raise ConfigError(f"{what}: {written!r} cannot route reads over {counted} ({exc}){dup}; {valid}") from None


def check_capacities(config: "Config", capacities: list[int | None], page_bytes: int | None) -> None:
    """Resolved capacities (a share of the file system, e.g. '0.0001%') that cannot hold one page (of
    ``page_bytes`` when the caller knows its page size) would make every put on that tier fail quietly:
    refuse them at start-up, naming the setting and the fix.

    :raises ConfigError:"""
    need = max(page_bytes or MIN_CAPACITY, MIN_CAPACITY)
    for tier, cap in zip(config.tiers, capacities):
        if cap is not None and cap < need:
            page = f"a page of {page_bytes} bytes" if page_bytes else "the smallest page"
            raise ConfigError(f"{setting_source(config.sources, 'capacity')}: {tier.capacity} of tier {tier.path} "
                              f"is {cap} bytes, less than one page ({need} bytes for {page}): give at least "
                              f"{need} bytes, or leave it empty for unlimited")
