"""LMCache keys and settings mapped onto the engine's: keys, namespace, adapter_params. Pure.

An LMCache ``ObjectKey`` (model, kv rank, object group, chunk hash, cache salt) is hashed to a 64-hex
engine key (:func:`engine_key`), so models, ranks, groups and salts never share a page. The object's
layout is not part of the key: a lookup carries it only as a hint that callers may leave empty (LMCache's
base class: "most adapters ignore it"), and a load of a page of another size fails its size check (a
miss). A deployment that changes the KV dtype under the same model name keeps apart with ``namespace``.
The engine's :class:`~kvstream_hicache.layout.Namespace`
(``integration: lmcache-mp`` plus the ``namespace`` adapter parameter) keeps the directory apart from
SGLang's pages in shared tiers.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

KEY_SCHEME = "sha256(model@rank@group@hash@salt)/2"  # changes only with a new key format (/1 had #layout)
INTEGRATION = "lmcache-mp"
# adapter_params that belong to the adapter; every other key is an engine setting (config.SETTINGS).
ADAPTER_PARAMS = {
    "namespace": "dict merged into the engine namespace (e.g. {'deployment': 'prod-a'}): pages written "
                 "under another namespace are never found",
    "pool_loads": "true (default): load tasks waiting together are read as one routed batch",
    "max_pool_pages": "largest pooled load batch, pages (default 4096)",
}


def engine_key(key: Any) -> str:
    """64-hex engine key of an LMCache ``ObjectKey``.

    '@' cannot occur in ``model_name`` or ``cache_salt`` (LMCache rejects it), so the string form is
    unambiguous; sha256 makes it a valid engine key of fixed length whatever the model name."""
    text = (f"{key.model_name}@{key.kv_rank:x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
            f"@{key.cache_salt}")
    return hashlib.sha256(text.encode()).hexdigest()


def namespace_fields(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Engine namespace of the LMCache MP path (``extra`` may not override the two fixed fields).

    :raises ConfigError: ``extra`` is no mapping of JSON values (adapter_params 'namespace')."""
    if extra is not None and not isinstance(extra, Mapping):  # dict('prod-a') would fail with a riddle
        raise ConfigError(f"adapter_params 'namespace': expected a mapping, e.g. {{'deployment': 'prod-a'}}, got "
                          f"{extra!r}")
    try:  # the namespace digest is taken of its JSON (layout.Namespace)
        json.dumps(dict(extra or {}), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"adapter_params 'namespace': {extra!r} is not JSON ({exc}); use strings, numbers, "
                          "booleans, lists and mappings, e.g. {'deployment': 'prod-a'}") from None
    fields = dict(extra or {})
    fields.update(integration=INTEGRATION, keys=KEY_SCHEME)
    return fields


def split_params(params: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter options, engine settings) from LMCache's ``adapter_params``."""
    params = dict(params or {})
    adapter = {k: params.pop(k) for k in list(params) if k in ADAPTER_PARAMS}
    return adapter, params

