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
import logging
import sys

NAME = "kvstream"
MODULE = "kvstream_hicache.sglang.storage"
CLASS = "KVStreamHiCacheStorage"

_FACTORY_TARGET = "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory._create_builtin_backend"
_CONTROLLER_MODULE = "sglang.srt.managers.cache_controller"
_PATCH_MARK = "_kvstream_zero_copy"

logger = logging.getLogger(__name__)


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
    _registered = True
    try:
        allow_cli_choice()
    except Exception as exc:  # the backend still works through sglang.Engine(...) and the dynamic spelling
        logger.warning("kvstream: could not add 'kvstream' to --hicache-storage-backend choices (%s); use the "
                       "'dynamic' spelling documented in docs/sglang.md", exc)


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
