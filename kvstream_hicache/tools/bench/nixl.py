"""sglang's NIXL storage backend (``HiCacheNixl``, POSIX plugin on io_uring, O_DIRECT) as bench contenders.

* ``hicache-nixl``: ``HiCacheNixl`` on tier 0 (one directory): the strongest single-tier peer that
  runs on a CPU machine (zero-copy into the host pool, a whole batch submitted as one transfer).
* ``hicache-nixl-sharded``: the same backend given every tier directory as a comma list: it spreads
  its ``_k``/``_v`` files over the directories by a hash of the file key, a static split without
  replicas (the paper's Eq. 6 applies to it).

Both are built as sglang's controller builds them (``StorageBackendFactory.create_backend("nixl",
storage_config, host_pool)`` then ``register_mem_pool_host``), write their own copy of the bench pages
through the controller's ``_page_set_zero_copy`` and read them back through ``_page_get_zero_copy``
(``batch_set_v1`` / ``batch_get_v1``), called unbound on the bench's controller stand-in, into the
bench's real ``page_first`` host pool (:class:`~.contenders.SglangHost`), as ``sglang-adapter`` does.

Facts of sglang 0.5.23 with nixl 1.5.1 that shape the construction:

* the directory comes only from ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR`` (the factory calls
  ``HiCacheNixl(storage_config)`` and the constructor's default is /tmp/hicache_storage): it is set
  around the factory call and restored after;
* ``{"plugin": {"posix": {"active": true, "use_uring": "true"}}}`` selects the POSIX plugin on
  io_uring (without ``use_uring`` it uses libaio); O_DIRECT is on (``use_direct_io``);
* ``l3_cleaner_enabled: false``: its cleaner thread deletes the oldest files when a disk passes 80%
  full, which a small benchmark tier can reach;
* each construction logs two harmless error lines (a path-mode probe of /nonexistent-nixl-probe);
* a batch is all or nothing: one missing page and the controller counts none.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Sequence

from .contenders import Contender, Outcome, _Op

NIXL = "hicache-nixl"
NIXL_SHARDED = "hicache-nixl-sharded"
NIXL_CONTENDERS = (NIXL, NIXL_SHARDED)
DIR_ENV = "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"


def extra_config(uring: bool = True, direct_io: bool = True) -> dict:
    """What ``--hicache-storage-backend-extra-config`` would hold for the POSIX plugin."""
    posix: dict = {"active": True}
    if uring:
        posix["use_uring"] = "true"
    return {"plugin": {"posix": posix}, "use_direct_io": direct_io, "l3_cleaner_enabled": False}


@contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class NixlReads(Contender):
    """``HiCacheNixl.batch_get_v1`` into the host pool via ``HiCacheController._page_get_zero_copy``.

    :param host: the bench's :class:`~.contenders.SglangHost` (a batch of host pages, the controller stand-in).
    :param dirs: one directory per tier it uses, each in its tier (several: sharded by NIXL's hash).
    :param tiers: the bench tier of each directory (for the per-tier byte counts).
    :param n_tiers: the bench's tier count.
    """

    def __init__(self, name: str, host, dirs: Sequence[str], model_name: str, *, tiers: Sequence[int],
                 n_tiers: int):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self.name = name
        self.host = host
        self.dirs = [os.path.abspath(d) for d in dirs]
        self.tiers = list(tiers)
        self.n_tiers = n_tiers
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        with _env(DIR_ENV, ",".join(self.dirs)):
            self.backend = StorageBackendFactory.create_backend(
                "nixl", host.storage_config(model_name, extra_config()), host.host)
        self._closed = False
        self.backend.register_mem_pool_host(host.host)
        if not self.backend.is_zero_copy:
            self.close()
            raise RuntimeError(f"{name}: HiCacheNixl fell back to bounce buffers (host pool not page aligned?)")
        self.ctl = host.stand_in(self.backend)
        self.views = host.views
        self._split: dict[int, tuple[int, ...]] = {}  # batch index -> payload bytes per tier (known at write)

    def tier_split(self, keys: Sequence[str]) -> tuple[int, ...]:
        """Bytes of ``keys`` each bench tier holds: each ``_k``/``_v`` file is one chunk of the page,
        in the directory NIXL's hash chose (``file_manager.get_file_path``)."""
        fm = self.backend.file_manager
        out = [0] * self.n_tiers
        for name, size in zip(self.backend._get_key_list_from_meta(list(keys)), self._chunk_sizes(len(keys))):
            path = fm.get_file_path(name)
            d = next(i for i, base in enumerate(self.dirs) if path.startswith(base + os.sep))
            out[self.tiers[d]] += size
        return tuple(out)

    def _chunk_sizes(self, n: int) -> list[int]:
        return list(self.host.chunk_bytes) * n  # K and V (MHA), or one chunk (MLA: '_k' only)

    def write(self, ds, batch) -> float:
        """Store ``batch`` through ``_page_set_zero_copy`` (NIXL's O_DIRECT writes); returns seconds."""
        self.host.load(ds, batch)
        n = len(batch.keys)
        t0 = time.perf_counter()
        ok = self.host.controller_cls._page_set_zero_copy(self.ctl, list(batch.keys),
                                                           self.host.host_indices[: n * self.host.page_tokens])
        dt = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"{self.name} failed to store batch {batch.index} in {', '.join(self.dirs)}")
        self._split[batch.index] = self.tier_split(batch.keys)
        return dt

    def read(self, batch) -> Outcome:
        n = len(batch.keys)
        count = self.host.controller_cls._page_get_zero_copy(self.ctl, _Op(), list(batch.keys),
                                                             self.host.host_indices[: n * self.host.page_tokens])
        found = [i < count for i in range(n)]
        split = self._split[batch.index] if count == n else self.tier_split(batch.keys[:count])
        return Outcome(found, split, (None,) * self.n_tiers, split)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.close()
