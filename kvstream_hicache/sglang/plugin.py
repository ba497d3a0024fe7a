"""sglang plugin: ``--hicache-storage-backend kvstream`` (entry point group ``sglang.srt.plugins``).

sglang's ``load_plugins()`` calls :func:`register` in the launcher before argv is parsed and again at the
start of every scheduler (and detokenizer, DP controller, ...) process. Three things stand between a new
backend name and a working server in sglang 0.5.23, and ``register`` fixes each:

1. the CLI's fixed ``choices`` list  -> append ``kvstream`` to it in place (the launcher parses argv next);
2. ``StorageBackendFactory._create_builtin_backend`` raises for unknown registered names
   -> register the name and wrap that method (AROUND hook) to construct ``KVStreamHiCacheStorage``;
3. the controller picks the zero-copy ``batch_get_v1``/``batch_set_v1`` calls only for a hard-coded name
   list -> when the factory builds our backend, patch ``HiCacheController._start_storage_threads`` so that,
   for ``kvstream``, the zero-copy page functions are selected before the storage threads start.

It also hooks ``ServerArgs.check_server_args`` (BEFORE), which the launcher runs before it starts a
scheduler, to refuse a kvstream extra config there (:func:`check_extra_config`).

Import-light by design: this module imports nothing from sglang or torch at import time, and ``register``
touches only modules the process has already loaded (``server_args``) or cheap ones (``backend_factory``).
The controller module (~1.5 s to import) is patched lazily from inside the factory hook, where it is
necessarily loaded already, so processes that never build a backend never import it.

Name-based behaviour of sglang that we deliberately do not opt into (checked against 0.5.23):
MLA host-memory dedup (``mla_host_dedup``: every rank reads its own host pool from kvstream; the dedup
helper is not wired up in 0.5.23 anyway), the page-envelope host (``mori`` only), DCP L3 (``file``/
``mooncake`` only: sglang refuses kvstream with DCP at attach, with its own message), the Mooncake layout
rewrite, and the ``dynamic`` shm allocator.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Mapping

NAME = "kvstream"
MODULE = "kvstream_hicache.sglang.storage"
CLASS = "KVStreamHiCacheStorage"

_FACTORY_TARGET = "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory._create_builtin_backend"
_CHECK_TARGET = "sglang.srt.server_args.ServerArgs.check_server_args"
EXTRA_FLAG = "--hicache-storage-backend-extra-config"
EXAMPLE = '\'{"tiers": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"]}\''
_UNREAD = object()  # an extra config only sglang can read (a format it refuses, a parser not installed here)
_CONTROLLER_MODULE = "sglang.srt.managers.cache_controller"
_PATCH_MARK = "_kvstream_zero_copy"
PASS_PREFIX_KEYS = "hicache_storage_pass_prefix_keys"

logger = logging.getLogger("kvstream.sglang")  # (errors.LOGGERS: its arguments escaped)


_registered = False


def register() -> None:
    """Entry point: make ``kvstream`` a backend name sglang accepts, builds and drives zero-copy.

    Idempotent (sglang's ``load_plugins()`` runs once per process; tests may call this directly too).
    """
    global _registered
    if _registered:
        return
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if NAME not in StorageBackendFactory._registry:
        StorageBackendFactory.register_backend(NAME, MODULE, CLASS)
    HookRegistry.register(_FACTORY_TARGET, _create_builtin_backend, HookType.AROUND)
    # The launcher checks its arguments before it starts any scheduler: a bad extra config is refused there,
    # in seconds and naming the flag, not after the model loaded, as a traceback in the scheduler (sglang
    # parses the JSON there: a trailing comma read "JSONDecodeError: Expecting value: line 1 column 34").
    HookRegistry.register(_CHECK_TARGET, _check_server_args, HookType.BEFORE)
    _registered = True
    try:
        allow_cli_choice()
    except Exception as exc:  # the backend still works through sglang.Engine(...) and the dynamic spelling
        logger.warning("kvstream: could not add 'kvstream' to --hicache-storage-backend choices (%s); use the "
                       "'dynamic' spelling documented in docs/sglang.md", exc)


def _check_server_args(server_args, *_args, **_kwargs) -> None:
    """BEFORE hook on ``ServerArgs.check_server_args`` (the launcher, before the schedulers start)."""
    if not (getattr(server_args, "enable_hierarchical_cache", True)
            or getattr(server_args, "disaggregation_decode_enable_offload_kvcache", False)):
        return  # no scheduler builds a storage backend: its extra config is never read (sglang started it)
    check_extra_config(getattr(server_args, "hicache_storage_backend", None),
                       getattr(server_args, "hicache_storage_backend_extra_config", None), probe=True)
    _pass_prefix_keys(server_args)


def _pass_prefix_keys(server_args) -> None:
    """Turn on sglang's ``hicache_storage_pass_prefix_keys`` (off by default) where the user's extra config
    does not set it: each get and set then names the prefix before its pages, which kvstream keeps more
    recent than them (KVStreamHiCacheStorage._touch_prefix). A config in a file (``@path``) is left as written.
    The launcher has resolved its arguments by now (read-only): the new config is declared as sglang's
    resolution records a decision, projected into what the schedulers read when the launcher publishes."""
    text = getattr(server_args, "hicache_storage_backend_extra_config", None)
    if getattr(server_args, "hicache_storage_backend", None) != NAME or (text or "").startswith("@"):
        return
    extra = json.loads(text) if text else {}  # (check_extra_config parsed it)
    if not isinstance(extra, dict) or PASS_PREFIX_KEYS in extra:
        return
    try:
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(server_args, "kvstream", hicache_storage_backend_extra_config=json.dumps(
            {**extra, PASS_PREFIX_KEYS: True}))
    except Exception as exc:  # (published already: a scheduler's own check; or sglang changed): sglang's default
        logger.debug("kvstream: %s left as configured (%s)", PASS_PREFIX_KEYS, exc)
        return
    logger.info("kvstream: %s on (a prefix's head outlives its tail in L3; set it false in %s to opt out)",
                PASS_PREFIX_KEYS, EXTRA_FLAG)


def check_extra_config(backend: str | None, text: str | None, environ: Mapping[str, str] | None = None,
                       probe: bool = False) -> None:
    """Refuse a kvstream extra config the schedulers would refuse, as they would read it: the flag's JSON
    (or ``@file``) as sglang parses it, then every kvstream setting as the backend reads it (extra config
    over ``KVSTREAM_*`` over defaults). Other backends' configs, and a ``dynamic`` one that does not name
    kvstream's module, are sglang's to judge. ``probe``: the tier directories too, as the backend probes
    them at its attach (exists, a writable directory, O_DIRECT; one that does not answer within
    write_timeout is left to the backend, which starts it failed): the launcher, on the schedulers' host.

    :raises kvstream_hicache.errors.ConfigError: naming the flag or the setting, the value as written, the fix.
    """
    from ..config import Config
    from ..errors import ConfigError

    if backend not in (NAME, "dynamic"):
        return
    try:
        extra = _load_extra_config(text)
    except ConfigError:
        if backend == NAME:
            raise
        return  # (dynamic: whose config it is cannot be told; sglang reports it)
    if extra is _UNREAD:
        return
    if backend == "dynamic" and not (isinstance(extra, dict)
                                     and str(extra.get("module_path", "")).startswith("kvstream_hicache")):
        return
    if not isinstance(extra, dict):
        kind = {list: "list", str: "string", bool: "true/false", type(None): "null"}.get(type(extra), "number")
        raise ConfigError(f"{EXTRA_FLAG}: {text!r} is a JSON {kind}, not an object of settings; "
                          f"write e.g. {EXAMPLE}")
    from .storage import SGLANG_KEYS  # (sglang's own keys: its loader's, its controller's)

    config = Config.from_sources(extra, os.environ if environ is None else environ, ignore=SGLANG_KEYS)
    if probe:  # (a missing tier was refused only at the attach, after the model loaded, in a scheduler's traceback)
        from ..probe import let_go, probe_tiers

        let_go(probe_tiers(config, announce=False).looks)  # (the schedulers' engines log its warnings)


def _load_extra_config(text: str | None):
    """The extra config as sglang 0.5.23 reads it (HybridCacheController.parse_storage_backend_extra_config):
    a JSON string, or ``@path`` to a .json, .toml or .yaml file; ``_UNREAD`` where sglang alone can tell."""
    from ..errors import ConfigError

    if not text:
        return {}
    if not text.startswith("@"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{EXTRA_FLAG}: {text!r} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                              f"{exc.colno}); write one JSON object, e.g. {EXAMPLE} (double quotes, no trailing "
                              "comma), or @kvstream.json") from None
    path = text[1:]
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".toml", ".yaml", ".yml"):
        return _UNREAD  # (sglang refuses the format itself)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        if ext == ".json":
            return json.loads(data)
        if ext == ".toml":
            import tomllib

            return tomllib.loads(data.decode())
        import yaml

        return yaml.safe_load(data)
    except OSError as exc:
        raise ConfigError(f"{EXTRA_FLAG}: cannot read {path!r} ({exc.strerror or exc}); give the path of the "
                          "settings file after '@'") from None
    except ImportError:
        return _UNREAD  # (no YAML parser here: sglang reports it)
    except Exception as exc:  # (JSON, TOML and YAML each raise their own error class)
        raise ConfigError(f"{EXTRA_FLAG}: {path!r} does not parse as {ext[1:].upper()} ({exc}); correct the "
                          f"file") from None


def allow_cli_choice() -> bool:
    """Append ``kvstream`` to ``--hicache-storage-backend``'s choices. Returns False if sglang's shape changed.

    ``ServerArgs``' annotations are evaluated objects: ``get_type_hints`` returns the same ``Arg`` instance
    argparse is later built from, so appending to its ``choices`` list in place widens the CLI.
    """
    from typing import get_type_hints

    from sglang.srt.arg_groups.arg_utils import Arg
    from sglang.srt.server_args import ServerArgs

    hint = get_type_hints(ServerArgs, include_extras=True).get("hicache_storage_backend")
    for meta in getattr(hint, "__metadata__", ()):
        if isinstance(meta, Arg) and isinstance(meta.choices, list):
            if NAME not in meta.choices:
                meta.choices.append(NAME)
            return True
    logger.warning("kvstream: could not add 'kvstream' to --hicache-storage-backend choices (sglang changed?); "
                   "use the 'dynamic' spelling documented in docs/sglang.md")
    return False


def _create_builtin_backend(original, cls, backend_name, backend_class, storage_config, mem_pool_host):
    """AROUND hook on the factory: build ours, defer every other name to sglang."""
    if backend_name != NAME:
        return original(cls, backend_name, backend_class, storage_config, mem_pool_host)
    patch_controller()
    return backend_class(storage_config, mem_pool_host)


def patch_controller() -> bool:
    """Make the HiCache controller use the zero-copy v1 calls for ``kvstream`` (idempotent).

    Wraps ``HiCacheController._start_storage_threads``, which ``attach_storage_backend`` calls after it chose
    the page functions and before any storage thread runs (so no call ever takes the legacy path), and
    which the hybrid controller reaches through ``super()``. Returns False if the controller is not loaded
    or lacks the method; the backend then still works through the legacy ``batch_get``/``batch_set``.
    """
    module = sys.modules.get(_CONTROLLER_MODULE)
    cls = getattr(module, "HiCacheController", None)
    original = getattr(cls, "_start_storage_threads", None) if cls is not None else None
    if original is None:
        logger.warning("kvstream: HiCacheController._start_storage_threads not found: zero-copy calls not "
                       "enabled, the copying batch_get/batch_set path will be used")
        return False
    if getattr(original, _PATCH_MARK, False):
        return True

    @functools.wraps(original)
    def _start_storage_threads(self, *args, **kwargs):
        select_zero_copy(self)
        return original(self, *args, **kwargs)

    setattr(_start_storage_threads, _PATCH_MARK, True)
    cls._start_storage_threads = _start_storage_threads
    return True


def select_zero_copy(controller) -> None:
    """Point a controller whose backend is ``kvstream`` at its zero-copy page functions."""
    if getattr(controller, "storage_backend_type", None) == NAME and getattr(controller, "enable_storage", False):
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
