"""Stand-ins that put kvstream's SGLang backend where sglang's Mooncake-store test builds its store.

Imported by the rewritten test (tests/peers/suites.py) in place of ``MooncakeStore``: each call opens a
real :class:`KVStreamHiCacheStorage` over a fresh tier directory (the storage config's ``extra_config``,
as ``--hicache-storage-backend-extra-config`` gives it). ``config`` is the fixture the test's
``test_batch_operation(config)`` needs under pytest: the four configurations its ``__main__`` runs.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from typing import Any

import pytest

from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

ROOT = tempfile.mkdtemp(prefix="kvstream-peers-", dir=os.environ.get("KVSTREAM_TEST_DIR", "/var/tmp"))
atexit.register(shutil.rmtree, ROOT, True)
_open: list[KVStreamHiCacheStorage] = []


@atexit.register
def _close_all() -> None:
    for store in _open:
        store.close()


def MooncakeStore(storage_config: Any) -> KVStreamHiCacheStorage:  # noqa: N802 (the peer's name)
    config = dataclasses.replace(storage_config, extra_config={"tiers": [tempfile.mkdtemp(dir=ROOT)]})
    store = KVStreamHiCacheStorage(config)
    _open.append(store)  # the test never closes its store; the process's end does
    return store


@pytest.fixture(params=[(False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)],
                ids=["mha-tp0of1", "mla-tp0of1", "mha-tp1of4", "mla-tp3of8"])
def config(request):
    is_mla, rank, size = request.param
    return request.module.make_hicache_storage_config(is_mla_model=is_mla, tp_rank=rank, tp_size=size)
