"""The contenders that store their own copy of the pages (peers, and kvstream run another way than the
bench engine's routing policies): their names, what each needs installed, which tiers hold its copy,
and how the runner builds one.

Two environments: sglang (``.venv``: ``hicache-file``, ``sglang-adapter``, and with the ``peers`` extra
``hicache-nixl``, ``hicache-nixl-sharded``) and LMCache (``.venv-lmcache``: the ``lmcache-*`` L2
adapters). Nothing of either is imported unless one of its contenders is chosen, so ``kvstream
bench`` runs in both venvs; one run cannot mix them (sglang and LMCache 0.5.6 need separate venvs).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from .contenders import HICACHE_FILE, KVSTREAM_1TIER, LMCACHE_ADAPTER, SGLANG_ADAPTER, SGLANG_ADAPTER_1TIER, \
    SGLANG_ADAPTER_1TIER_STAGED, AdapterReads, Contender, HiCacheFileReads, OneTierReads, SglangHost
from .lmcache_l2 import FS_NATIVE_ODIRECT, L2_CONTENDERS, LMCACHE_KVSTREAM
from .nixl import NIXL, NIXL_SHARDED

SGLANG_PEERS = (HICACHE_FILE, SGLANG_ADAPTER, SGLANG_ADAPTER_1TIER, SGLANG_ADAPTER_1TIER_STAGED, NIXL, NIXL_SHARDED)
LMCACHE_PEERS = L2_CONTENDERS
OWN_COPY = SGLANG_PEERS + LMCACHE_PEERS + (KVSTREAM_1TIER,)  # write their own copy of the data set
NOT_POLICIES = OWN_COPY + (LMCACHE_ADAPTER,)  # every other name is a routing policy of the bench engine
# the comparisons a device-speed run is about: each contender's ratio to these, in the same run
REFERENCES = ("tier0", HICACHE_FILE, NIXL, FS_NATIVE_ODIRECT)

_NEEDS = {HICACHE_FILE: ("sglang",), SGLANG_ADAPTER: ("sglang",), SGLANG_ADAPTER_1TIER: ("sglang",),
          SGLANG_ADAPTER_1TIER_STAGED: ("sglang",),
          NIXL: ("sglang", "nixl"),
          NIXL_SHARDED: ("sglang", "nixl"), **{name: ("lmcache",) for name in LMCACHE_PEERS}}
_HOW = {
    "sglang": "sglang 0.5.23 is installed in .venv (scripts/setup-env.sh): run .venv/bin/kvstream bench",
    "nixl": "nixl comes with the peers extra: pip install -c scripts/constraints.txt '.[peers]' "
            "(scripts/setup-env.sh installs it in .venv)",
    "lmcache": "lmcache 0.5.6 lives in its own venv (scripts/setup-lmcache-env.sh): run "
               ".venv-lmcache/bin/kvstream bench",
}


def missing(specs: list[str]) -> list[str]:
    """One line per package the chosen contenders need and this Python lacks (empty: all there)."""
    need: dict[str, list[str]] = {}
    for spec in specs:
        for pkg in _NEEDS.get(spec, ()):
            need.setdefault(pkg, []).append(spec)
    out = [f"{', '.join(names)} need{'s' if len(names) == 1 else ''} {pkg}, not importable here: {_HOW[pkg]}"
           for pkg, names in need.items() if importlib.util.find_spec(pkg) is None]
    if need.keys() & {"sglang", "nixl"} and "lmcache" in need:
        out.append("sglang and LMCache contenders cannot share one run (separate venvs): run them apart")
    return out


def copies(spec: str, n_tiers: int) -> list[float]:
    """Copies of the data set ``spec`` writes to each tier (for the space check)."""
    if spec in (SGLANG_ADAPTER, LMCACHE_KVSTREAM):
        return [1.0] * n_tiers
    if spec == NIXL_SHARDED:  # its hash split, with room for an uneven one
        return [1.0] if n_tiers == 1 else [0.75] * n_tiers
    if spec in OWN_COPY:
        return [1.0] + [0.0] * (n_tiers - 1)
    return [0.0] * n_tiers


@dataclass
class Context:
    """What the runner hands over to build a peer."""

    dirs: list[str]  # the bench's directory in each tier
    geometry: Any
    batch_pages: int
    settings: dict  # --engine-config
    namespace: Any  # the bench engine's namespace (kvstream-1tier shares it, in its own directory)
    dest: Any  # the engine policies' destination buffer, and its page views
    dest_views: list
    drop_caches: str = "fadvise"
    _sglang: Any = field(default=None, repr=False)
    _l1: Any = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        return f"kvstream-bench/{self.geometry.label.replace(' ', '_')}"

    def sglang_host(self) -> SglangHost:
        if self._sglang is None:
            self._sglang = SglangHost(self.geometry, self.batch_pages)
        return self._sglang

    def l1_host(self):
        if self._l1 is None:
            from .lmcache_l2 import L1Host

            self._l1 = L1Host(self.geometry, self.batch_pages, self.model_name)
        return self._l1

    def close(self) -> None:
        """Release the hosts (after every contender using them closed)."""
        if self._l1 is not None:
            self._l1.close()
            self._l1 = None


def build(spec: str, ctx: Context) -> Contender:
    """The contender ``spec`` of :data:`OWN_COPY`, with its own directories, not yet written."""
    own = [os.path.join(d, spec) for d in ctx.dirs]
    n = len(ctx.dirs)
    if spec == HICACHE_FILE:
        return HiCacheFileReads(ctx.sglang_host(), own[0], ctx.model_name, drop=ctx.drop_caches)
    if spec == SGLANG_ADAPTER:
        return AdapterReads(ctx.sglang_host(), ctx.dirs, ctx.model_name, ctx.settings)
    if spec in (SGLANG_ADAPTER_1TIER, SGLANG_ADAPTER_1TIER_STAGED):
        os.makedirs(own[0], exist_ok=True)
        settings = {**ctx.settings, "register_memory": False} if spec == SGLANG_ADAPTER_1TIER_STAGED else ctx.settings
        return AdapterReads(ctx.sglang_host(), own[:1], ctx.model_name, settings, name=spec, n_tiers=n)
    if spec in (NIXL, NIXL_SHARDED):
        from .nixl import NixlReads

        dirs = own[:1] if spec == NIXL else own
        return NixlReads(spec, ctx.sglang_host(), dirs, ctx.model_name, tiers=range(len(dirs)), n_tiers=n)
    if spec in LMCACHE_PEERS:
        from .lmcache_l2 import L2AdapterReads

        return L2AdapterReads(spec, ctx.l1_host(), own, ctx.settings)
    if spec == KVSTREAM_1TIER:
        return OneTierReads(own[0], ctx.namespace, ctx.settings, ctx.dest, ctx.dest_views, ctx.geometry,
                            ctx.batch_pages, n)
    raise ValueError(f"{spec!r} is not a contender with its own copy")
