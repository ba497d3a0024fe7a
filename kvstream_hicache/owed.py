"""The clear()s a failed tier owes, written down so that a restart does not forget them.

A ``clear()`` (SGLang's ``/clear_hicache_storage_backend``, e.g. after a weight update) that finds a
tier failed is owed by that tier: it removes its page files before it serves again (tiers.py). Kept
in memory only, that debt ended with the process: a tier still failed at exit came back at the next
start with the stale pages, and its scan indexed them. So each change of the set of tiers owing a
clear is also written to a record, and the next engine of the namespace starts each tier it names
failed and due for a probe at once, which has the pages written before the clear removed (on a thread
of its own) before it rejoins (:meth:`Tier.owe_clear`, :meth:`Tier._settle`): on a shared tier other
nodes go on putting pages while this one is away or down, and those stay.

Where: ``<root>/kvstream/<digest>.clears-owed`` on every healthy tier on a local file system that
owes nothing itself. Never on a network tier: other nodes read it, and their local tiers often
have the same paths as ours. Its text: a JSON list of strings, the real path of each tier that owes a
clear (those left out of this start's tier list too: they owe it when they are listed again), and for
each ``"@<ns>:<path>"``, the time of the last clear it missed (ns since the epoch, trust.wall_ns). Stop
43 wrote the paths alone, and reads a list of strings only: it honours this record (its tiers lose every
page; the time entries name no tier of its own, and it keeps them) and this version reads its record (a
path with no time: every page goes). Stop 43's commits before cdf2983 wrote paths as listed, a link in
them kept: a tier is matched by the path it is listed by as well as by its real path. b2e98e7 and 6af416a
wrote a JSON object, ``{"clears_owed": {path: time}}``: read too (it was ignored, the stale pages served).
Written to a new temporary name in ``tmp/`` (start-up cleaning removes one a crash leaves), fsynced
and renamed over the record; read following no link, only a regular file of this user's (its uid on the tier) that no
one else may write (its group only for the tiers it is trusted with: in shared mode the tier's group is trusted with
pages, not with a record naming this engine's other tiers). With no local tier healthy to hold it, the debt stays
in memory (logged).

A record that could not be rewritten when its tier was out may name a tier that has cleared since:
that tier is cleared once more at the next start. That costs cached pages, never a stale one served.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Callable, Collection, Iterable, Sequence

from .fds import close_fd
from .layout import ROOT_DIR, TMP_DIR, is_digest
from .locks import ranked_lock
from .tiers import Tier
from .tmpfiles import NEW_FILE
from .trust import LOOK_FLAGS, Trust, list_below, make_dir, open_below, tier_group

log = logging.getLogger("kvstream")

SUFFIX = ".clears-owed"
EVERY_PAGE = 1 << 62  # the time of a clear a record names with no time (stop 43's): every page was written before
MAX_BYTES = 1 << 16  # a record longer than this is not ours
EARLIER_KEY = "clears_owed"  # the one key of the JSON object b2e98e7 and 6af416a wrote as the record (_parse)


class OwedClears:
    """The record of the clears ``tiers`` owe, for namespace ``digest``."""

    def __init__(self, tiers: Sequence[Tier], digest: str):
        self.tiers = tiers
        self.name = digest + SUFFIX
        self._lock = ranked_lock("owed")  # one rewrite at a time (a clear() and a rejoin's)
        self._recorded: dict[str, int] = {}  # what the records say now
        self._others: dict[str, int] = {}  # tiers recalled that no tier of this engine is: kept in the record
        # (a tier left out of one start's list owes its clear still when it is listed again)
        self._kept_in_memory = False  # logged once per stretch without a holder

    def recall(self) -> None:
        """At start-up: each tier a record names owes a clear (a record of each holder is read: one
        written while another holder was out may be older; the latest time of a tier wins)."""
        owed: dict[str, int] = {}
        for tier in self._holders():
            for root, when in self._read(tier).items():
                owed[root] = max(when, owed.get(root, 0))
        # (real paths win; a tier's, Tier.real, learnt at start-up: a realpath through a hung network mount would
        # hang the start, or a clear() that notes its debt; as written for one that did not answer then)
        mine = {t.root: t for t in self.tiers} | {t.real: t for t in self.tiers}
        for root in owed.keys() & mine.keys():
            mine[root].owe_clear(owed[root])
        self._others = {root: when for root, when in owed.items() if root not in mine}
        self._recorded = owed

    def recall_for(self, tier: Tier) -> None:
        """A tier that did not answer at start-up answers (its real path known now, Tier.real): a record
        recalled then that names it by that path (a link listed, not the path itself) is its clear owed,
        done before it serves (Engine._reconcile, as it rejoins)."""
        with self._lock:
            when = self._others.pop(tier.real, None)
        if when is not None:
            tier.owe_clear(when)

    def note(self) -> None:
        """Write down which tiers owe a clear now (after a clear(), and as a tier rejoins); nothing
        when that did not change. Never raises: a record not written is logged, and written at the next
        call (a clear(), a rejoin, close())."""
        with self._lock:
            owed = {t.real: t.clear_ns for t in self.tiers if t.clear_owed} | self._others
            if owed == self._recorded:
                return
            holders = self._holders()
            named = ", ".join(sorted(owed)) or "no tier"
            if owed and not holders:
                if not self._kept_in_memory:
                    log.warning("kvstream: no healthy tier on a local file system can record the clear() "
                                "owed by %s: a restart before they rejoin forgets it (clear again after it)", named)
                self._kept_in_memory = True
                return
            self._kept_in_memory = False
            written = False
            for tier in holders:
                try:
                    self._write(tier, owed)
                    written = True
                except OSError as exc:
                    log.warning("kvstream: could not record the clear() owed by %s on tier %d (%s): %s",
                                named, tier.k, tier.root, os.strerror(exc.errno or errno.EIO))
            if written:  # (else the next call tries again)
                self._recorded = owed

    def _holders(self) -> list[Tier]:
        return [t for t in self.tiers if t.local and t.healthy and not t.clear_owed]

    def _read(self, tier: Tier) -> dict[str, int]:
        return read_record(tier.root, self.name, tier.trust, self._group_tiers)

    def _group_tiers(self, gid: int) -> set[str]:
        """trusted_paths of this engine's tiers (the group shared mode trusts: Trust.gid, None in private mode)."""
        return trusted_paths(gid, ((t.trust and t.trust.gid, (t.root, t.real)) for t in self.tiers))

    def _write(self, tier: Tier, owed: dict[str, int]) -> None:
        """The record on ``tier`` names ``owed`` (none: it goes)."""
        base = open_below(tier.root, tier.layout.base)
        try:
            if not owed:
                try:
                    os.unlink(self.name, dir_fd=base)  # (kvstream/ is this user's: trust.establish)
                except FileNotFoundError:
                    pass
                return
            tmp_dir = make_dir(TMP_DIR, base, tier.dir_mode)  # (emptied away under a healthy tier: made again)
            tmp = tier.fresh_tmp_name()
            try:
                fd = os.open(tmp, os.O_WRONLY | NEW_FILE, 0o600, dir_fd=tmp_dir)  # (the user's alone: read_record)
                try:
                    os.write(fd, json.dumps(_text(owed)).encode())
                    os.fsync(fd)
                finally:
                    close_fd(fd)
                os.rename(tmp, self.name, src_dir_fd=tmp_dir, dst_dir_fd=base)
            except OSError:
                try:
                    os.unlink(tmp, dir_fd=tmp_dir)  # (ours: a fresh name no one else writes)
                except OSError:
                    pass  # (not made, or renamed; else start-up cleaning removes it)
                raise
            finally:
                close_fd(tmp_dir)
            os.fsync(base)
        finally:
            close_fd(base)


def where(root: str) -> str:
    """A tier directory as a record names it: its real path (a link to it, or the link's target, named
    in the tier list of another start is the same tier)."""
    return os.path.realpath(root)


def trusted_paths(gid: int, tiers: Iterable[tuple[int | None, Iterable[str]]]) -> set[str]:
    """The paths of ``tiers`` (each: the group shared mode trusts with its pages, or None, and its paths: as listed,
    real) whose pages group ``gid`` is trusted with: the tiers a record of this user's that group may write may
    name (its members may remove those pages anyway)."""
    return {p for group, paths in tiers if group == gid for p in paths if p}


def read_record(root: str, name: str, trust: Trust,
                group_tiers: Callable[[int], Collection[str]] | None = None) -> dict[str, int]:
    """The tiers the record ``name`` in ``<root>/kvstream/`` says owe a clear, and the time of the last
    clear each missed, read following no link; {} where there is none, and where it is not kvstream's
    (logged: a link, a FIFO, another owner's file, text that is no record of clears). A record of this user's
    that its group may write (written 0660 by versions before 2026-12-07 in shared mode; a tree made shared
    with ``chmod -R g+rwX``, as docs/guarantees.md says) names only the tiers ``group_tiers(its gid)`` lists,
    whose pages that group is trusted with: a clear owed there is done (ignored, the stale pages were served
    after the restart), one it names elsewhere (a member's edit naming a private tier) is not (logged)."""
    try:
        base = open_below(root, os.path.join(root, ROOT_DIR))
    except OSError:
        return {}
    try:
        fd = os.open(name, LOOK_FLAGS, dir_fd=base)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("kvstream: the record of clears owed %s/%s/%s is unreadable (%s): ignored", root, ROOT_DIR,
                        name, os.strerror(exc.errno or errno.EIO))
        return {}
    finally:
        close_fd(base)
    try:
        st = os.fstat(fd)
        # This user's alone (its uid on the tier), written by no one else: a tier's group, trusted with its pages in
        # shared mode, is not trusted with the record, which names this engine's other tiers (its private tier 0:
        # a member's record there, or a member's edit of ours, 0660 before, had every page of it removed)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in trust.uids or st.st_size > MAX_BYTES:
            raise ValueError("not a regular file of this user's")
        if st.st_mode & stat.S_IWOTH:
            raise ValueError(f"mode {stat.S_IMODE(st.st_mode):o}: every user may write it")
        owed = _parse(json.loads(os.read(fd, MAX_BYTES)))
        if st.st_mode & stat.S_IWGRP:  # (versions before 2026-12-07 wrote it 0660 in shared mode)
            shared = set(group_tiers(st.st_gid)) if group_tiers is not None else set()
            if owed.keys() - shared:
                log.warning("kvstream: the record of clears owed %s/%s/%s (mode %o) names tiers its group may not "
                            "write (%s): ignored there; if a clear() of this namespace was owed when it was written, "
                            "clear again", root, ROOT_DIR, name, stat.S_IMODE(st.st_mode),
                            ", ".join(sorted(owed.keys() - shared)))
            owed = {r: when for r, when in owed.items() if r in shared}
        return owed
    except (OSError, ValueError) as exc:
        log.warning("kvstream: the record of clears owed %s/%s/%s is not kvstream's (%s): ignored", root, ROOT_DIR,
                    name, exc)
        return {}
    finally:
        close_fd(fd)


def _text(owed: dict[str, int]) -> list[str]:
    """The record of ``owed`` (real path: time of the clear) as JSON: the paths, then their times."""
    return sorted(owed) + [f"@{when}:{root}" for root, when in sorted(owed.items()) if when != EVERY_PAGE]


def _parse(text: object) -> dict[str, int]:
    """A record's JSON as {path: time of the clear}; a path with no time given (or a time not well formed)
    owes every page. :raises ValueError: it is not a record."""
    if isinstance(text, dict) and list(text) == [EARLIER_KEY] and isinstance(text[EARLIER_KEY], dict):
        # (b2e98e7 and 6af416a wrote {"clears_owed": {path: time}}: a node upgraded from one logged its record
        # "not kvstream's" and served the stale pages of the clear a tier owed)
        return {r: when if type(when) is int and when >= 0 else EVERY_PAGE
                for r, when in text[EARLIER_KEY].items() if isinstance(r, str)}
    if not (isinstance(text, list) and all(isinstance(r, str) for r in text)):
        raise ValueError("not a list of tier directories")
    owed = {r: EVERY_PAGE for r in text if not r.startswith("@")}
    for entry in text:
        when, _, root = entry[1:].partition(":")
        if entry.startswith("@") and root in owed and when.isascii() and when.isdigit():  # (no sign, no space)
            owed[root] = int(when)
    return owed


def recorded(dirs: Sequence[str], hung: Collection[int] = ()) -> list[tuple[int, str, int]]:
    """(tier owing a clear, namespace digest, tier holding the record) of the records on ``dirs`` (a tier
    list, as ``kvstream info`` and ``check`` are given it): that tier's pages of that namespace are
    stale, removed before it serves at the next start (a tier a record names that is not in ``dirs``
    is left out). The tiers ``hung`` (that did not answer a first look, probe.answering) are not touched:
    no record is read there, and one is named by its path as written."""
    where_k = {d: k for k, d in enumerate(dirs)} | {where(d): k for k, d in enumerate(dirs) if k not in hung}

    def group_tiers(gid: int) -> set[str]:  # (as the engine's shared mode trusts a tier's group: trust._trust)
        return trusted_paths(gid, ((_group_of(d), (d, where(d))) for k, d in enumerate(dirs) if k not in hung))

    out = set()
    for holder, root in enumerate(dirs):
        if holder in hung:
            continue
        try:
            names = list_below(root, os.path.join(root, ROOT_DIR))
        except OSError:
            continue
        for name in names:
            digest = name[: -len(SUFFIX)]
            if name.endswith(SUFFIX) and is_digest(digest):
                out.update((where_k[r], digest, holder) for r in read_record(root, name, Trust.user(), group_tiers)
                           if r in where_k)
    return sorted(out)


def _group_of(root: str) -> int | None:
    """The group shared mode trusts on tier ``root``: the root's, or in a root every user may write, that of its
    ``kvstream/`` (trust._trust); None where it cannot be told."""
    try:
        return tier_group(os.stat(root), lambda: os.lstat(os.path.join(root, ROOT_DIR)))
    except OSError:
        return None
