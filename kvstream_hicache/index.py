"""The in-memory index: which tiers hold which page, per-tier LRU and byte accounting. Pure (no I/O).

Lifecycle of a page on a tier (as SGLang's LRU file evictor)::

    reserve(tier, nbytes) -> victims to delete      (capacity made before the write starts)
        commit(key, tier, ...)  |  abort(tier, nbytes)
    touch(key)                                      (a hit or a repeated put: most recent)
    pin(keys) ... unpin(keys)                       (a read in progress: never a victim)
    remove(key, tier)                               (damaged, vanished, or tier reconciled)

Bytes are counted as the caller passes them: the engine counts a page's payload, so a capacity holds
what callers stored (LMCache's adapters count the same), not the 4 KiB header and padding of its file.

The engine's read, write and existence threads call at once. Every method that changes the index,
and ``keys``, takes the index lock; the one-key queries (``get``, ``holders``, ``contains``,
``prefix_len``, ``pages_on``, ``len``) do not: each reads one dict entry or one length, which the
GIL makes atomic, and answers what was true at some moment during the call (the existence queries
SGLang's prefetch thread asks must not wait behind an eviction). Methods ending ``_under_index``
run with the lock held.
Victims are removed from the index *before* the caller deletes their files, so a reader either
pinned a page before it was chosen (it is then not chosen) or never finds it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from .locks import ranked_lock


class PageInfo:
    """What the index knows of one page. ``tiers`` is a bitmask (bit k = tier k holds a copy)."""

    __slots__ = ("length", "block", "crcs", "nbytes", "tiers", "pins")

    def __init__(self, length: int, block: int, crcs: tuple[int, ...], nbytes: int):
        self.length = length
        self.block = block
        self.crcs = crcs
        self.nbytes = nbytes
        self.tiers = 0
        self.pins = 0

    def same_content(self, length: int, block: int, crcs: tuple[int, ...]) -> bool:
        return self.length == length and self.block == block and self.crcs == crcs

    def __repr__(self) -> str:
        return f"PageInfo(length={self.length}, block={self.block}, tiers={self.tiers:#b}, pins={self.pins})"


class Index:
    """key -> PageInfo, plus per tier an LRU order (oldest first) and byte counts.

    :param capacities: per tier, the byte limit or None (unlimited).
    """

    def __init__(self, capacities: Sequence[int | None]):
        # Called, under the index lock, with a key no tier holds any more (evicted, removed, deleted);
        # it must not block nor call the index (the LMCache adapter queues the key for its accounting).
        self.on_gone: Callable[[str], None] | None = None
        self.capacities = list(capacities)
        self.n_tiers = len(self.capacities)
        self._lock = ranked_lock("index")
        self._pages: dict[str, PageInfo] = {}
        self._lru: list[OrderedDict[str, None]] = [OrderedDict() for _ in self.capacities]
        self.used = [0] * self.n_tiers  # committed bytes per tier
        self.held_bytes = 0  # bytes of the distinct pages held on any tier
        self.reserved = [0] * self.n_tiers  # bytes of writes in progress per tier
        self.evictions = [0] * self.n_tiers

    # -- queries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._pages)

    def get(self, key: str) -> PageInfo | None:
        return self._pages.get(key)

    def holders(self, key: str) -> int:
        info = self._pages.get(key)
        return info.tiers if info is not None else 0

    def contains(self, key: str, mask: int = -1) -> bool:
        """True when some tier in ``mask`` holds ``key``."""
        info = self._pages.get(key)
        return info is not None and bool(info.tiers & mask)

    def prefix_len(self, keys: Iterable[str], mask: int = -1) -> int:
        """Length of the leading run of ``keys`` held by some tier in ``mask``."""
        n = 0
        pages = self._pages
        for key in keys:
            info = pages.get(key)
            if info is None or not info.tiers & mask:
                break
            n += 1
        return n

    def keys(self, tier: int | None = None) -> list[str]:
        with self._lock:
            return list(self._pages) if tier is None else list(self._lru[tier])

    def pages_on(self, tier: int) -> int:
        return len(self._lru[tier])

    # -- reads ----------------------------------------------------------------------------------
    def pin(self, keys: Sequence[str]) -> list[PageInfo | None]:
        """Look up and pin every key (pins nest); None for keys not held anywhere."""
        out: list[PageInfo | None] = []
        with self._lock:
            for key in keys:
                info = self._pages.get(key)
                if info is not None:
                    info.pins += 1
                out.append(info)
        return out

    def unpin(self, infos: Iterable[PageInfo | None]) -> None:
        with self._lock:
            for info in infos:
                if info is not None:
                    info.pins -= 1

    def touch(self, key: str) -> bool:
        """Make ``key`` the most recent on every tier holding it; False if not held."""
        with self._lock:
            info = self._pages.get(key)
            if info is None:
                return False
            for tier in tiers_in(info.tiers):
                self._lru[tier].move_to_end(key)
            return True

    # -- writes ---------------------------------------------------------------------------------
    def reserve(self, tier: int, nbytes: int, evict: bool = True) -> list[str] | None:
        """Make room for ``nbytes`` on ``tier`` within its capacity (by evicting only if ``evict``).

        :returns: keys evicted from the index for this (delete their files on ``tier``), or None
            when the room cannot be made (too many pinned pages, a page larger than the tier, or no
            room without eviction); nothing is evicted then.
        """
        with self._lock:
            cap = self.capacities[tier]
            if cap is None:
                self.reserved[tier] += nbytes
                return []
            excess = self.used[tier] + self.reserved[tier] + nbytes - cap
            if excess > 0 and not evict:
                return None
            victims = self._victims_under_index(tier, excess) if excess > 0 else []
            if victims is None:
                return None
            for key in victims:
                self._drop_under_index(key, tier)
            self.evictions[tier] += len(victims)
            self.reserved[tier] += nbytes
            return victims

    def evict(self, tier: int, nbytes: int) -> list[str]:
        """Evict least-recent unpinned pages of ``tier`` totalling >= ``nbytes`` (or as many as
        there are), regardless of capacity: the file system said ENOSPC."""
        with self._lock:
            victims = self._victims_under_index(tier, nbytes, partial=True) or []
            for key in victims:
                self._drop_under_index(key, tier)
            self.evictions[tier] += len(victims)
            return victims

    def abort(self, tier: int, nbytes: int) -> None:
        with self._lock:
            self.reserved[tier] -= nbytes

    def commit(self, key: str, tier: int, length: int, block: int, crcs: tuple[int, ...],
               nbytes: int, *, reserved: bool = True, oldest: bool = False) -> list[int]:
        """Record that ``tier`` holds ``key`` (most recent, or with ``oldest`` least recent). With
        ``reserved`` the bytes move from the reservation to the used count.

        :returns: tiers whose copy the index forgot because it describes other content (one key
            holds one content in the index); normally empty. Their files stay: another writer's
            version of the page is valid, and is found again when no indexed copy is left.
        """
        with self._lock:
            if reserved:
                self.reserved[tier] -= nbytes
            info = self._pages.get(key)
            displaced: list[int] = []
            if info is not None and not info.same_content(length, block, crcs):
                displaced = [t for t in tiers_in(info.tiers) if t != tier]
                for t in tiers_in(info.tiers):  # this tier's own entry too: it described the other content
                    self._drop_under_index(key, t)
                info = self._pages.get(key)
            if info is None:
                info = self._pages[key] = PageInfo(length, block, crcs, nbytes)
                self.held_bytes += nbytes
            if info.tiers & (1 << tier):
                self.used[tier] -= info.nbytes  # re-commit of the same copy: count once
            info.tiers |= 1 << tier
            self.used[tier] += nbytes
            self._lru[tier][key] = None
            self._lru[tier].move_to_end(key, last=not oldest)
            return displaced

    def remove(self, key: str, tier: int) -> bool:
        """Forget ``tier``'s copy of ``key``; True when there was one."""
        with self._lock:
            return self._drop_under_index(key, tier)

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            for lru in self._lru:
                lru.clear()
            self.used = [0] * self.n_tiers
            self.held_bytes = 0

    # -- internals ------------------------------------------------------------------------------
    def _victims_under_index(self, tier: int, nbytes: int, partial: bool = False) -> list[str] | None:
        victims: list[str] = []
        freed = 0
        for key in self._lru[tier]:
            if freed >= nbytes:
                break
            info = self._pages[key]
            if info.pins:
                continue
            victims.append(key)
            freed += info.nbytes
        if freed < nbytes and not partial:
            return None
        return victims

    def _drop_under_index(self, key: str, tier: int) -> bool:
        info = self._pages.get(key)
        bit = 1 << tier
        if info is None or not info.tiers & bit:
            return False
        info.tiers &= ~bit
        self.used[tier] -= info.nbytes
        self._lru[tier].pop(key, None)
        if not info.tiers:
            del self._pages[key]
            self.held_bytes -= info.nbytes
            if self.on_gone is not None:
                self.on_gone(key)
        return True


def tiers_in(mask: int) -> Iterable[int]:
    """The tiers of a bitmask (bit k = tier k), lowest first."""
    tier = 0
    while mask:
        if mask & 1:
            yield tier
        mask >>= 1
        tier += 1
