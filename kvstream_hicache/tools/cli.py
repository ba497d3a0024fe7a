"""The ``kvstream`` command.

  kvstream bench   [tier dirs | --testbed PROFILE] ...   read-back throughput and gap to the bound, per policy
  kvstream check   [--fix] [--tiers DIR ...]              verify every stored page (headers, checksums, orphans)
  kvstream info    [--tiers DIR ...]                      effective configuration and the state of each tier
  kvstream testbed up --profile P | down | status         loop-device tiers for benchmarks (root): throttled,
                                                          RAM-backed (device speed) or the machine's disk
  kvstream serve-cpu [--port N] [--tiers DIR1:DIR2]       a real sglang server on this CPU: a tiny model, kvstream L3

Tier directories come from ``--tiers`` or ``KVSTREAM_TIERS`` (the engine's configuration rules apply).
Exit status: 0 success, 1 problems found (check) or a benchmark target failed to run, 2 usage/config error.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Sequence

from ..errors import printable


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # (`kvstream info --json | head`): the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except _usage_errors() as exc:
        print(f"kvstream {args.command}: {exc}", file=sys.stderr)
        return 2


def _bench(args) -> int:
    """``kvstream bench``: the read benchmark, or with ``--scenario mixed`` the write policies under a
    backup stream (bench/mixed.py)."""
    from .bench import mixed, runner

    if args.scenario == "mixed":
        mixed.run(args)
        return 0
    return runner.run_cli(args)


def _usage_errors() -> tuple[type[BaseException], ...]:
    from ..errors import KVStreamError
    from .bench.runner import UsageError
    from .bench.testbed import TestbedError

    return TestbedError, UsageError, KVStreamError


TIERS_HELP = "tier directories, fastest first: DIR DIR, or DIR:DIR as KVSTREAM_TIERS (default: $KVSTREAM_TIERS)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstream", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="{bench,check,info,testbed,serve-cpu}")

    from .bench import mixed, runner

    b = sub.add_parser("bench", help="benchmark reads against the aggregate-bandwidth bound",
                       description=runner.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner.add_arguments(b)
    mixed.add_arguments(b)
    b.set_defaults(func=_bench)

    c = sub.add_parser("check", help="verify stored pages; --fix removes damaged copies and orphans")
    c.add_argument("--tiers", nargs="+", metavar="DIR", help=TIERS_HELP)
    c.add_argument("--fix", action="store_true", help="repair: quarantine/remove damaged copies, clean leftovers")
    c.add_argument("--json", action="store_true", help="print the problems as JSON")
    c.set_defaults(func=_check)

    i = sub.add_parser("info", help="effective configuration and tier status")
    i.add_argument("--tiers", nargs="+", metavar="DIR", help=TIERS_HELP)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_info)

    t = sub.add_parser("testbed", help="loop-device tiers for benchmarks: throttled or device speed (needs root)")
    tsub = t.add_subparsers(dest="action", metavar="{up,down,status}", required=True)
    tu = tsub.add_parser("up", help="build the testbed (or re-apply another profile) and record fio's figures")
    tu.add_argument("--profile", default="testbed2-1:20",
                    help="throttled: testbed2-1:20 | testbed1-1:20; device speed: ram-0.7 (RAM-backed tier 0 "
                         "unthrottled, tier 1 read-limited to 700 MB/s) | testbed2-1:7 (RAM-backed, 1650 / 515 "
                         "MB/s) | disk+ram-0.7 (tier 0 a directory on this machine's disk) | dfs (a directory beside "
                         "GlusterFS on this machine as the shared tier); or 'R0/W0,R1/W1' in "
                         "MB/s, 0 = no limit, each optionally 'ram:R/W', or 'dir' (default: %(default)s)")
    tu.add_argument("--size", default=None,
                    help="image size per tier, or comma list per tier (default 16G on disk, 6G in RAM; sparse)")
    tu.add_argument("--image-dir", default=None, help="where the sparse images live (default /var/lib/kvstream-testbed)")
    tu.add_argument("--name", default=None, help="testbed name (default kvstream: mounts under /mnt/kvstream)")
    tu.add_argument("--fio-bs", default="8M", help="fio request size: the page size (default %(default)s)")
    tu.add_argument("--fio-runtime", type=float, default=5.0, help="seconds per fio measurement")
    tu.add_argument("--no-fio", action="store_true", help="skip the fio measurements")
    td = tsub.add_parser("down", help="unmount, detach, delete images and the cgroup (idempotent)")
    td.add_argument("--name", default=None)
    td.add_argument("--image-dir", default=None)
    ts = tsub.add_parser("status", help="the testbed's tiers, live throttles and fio figures")
    ts.add_argument("--name", default=None)
    ts.add_argument("--json", action="store_true")
    t.set_defaults(func=_testbed)

    from . import serve_cpu

    sc = sub.add_parser("serve-cpu", help="a real sglang server on this CPU with kvstream as L3 (tiny model)",
                        description=serve_cpu.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_cpu.add_arguments(sc)
    sc.set_defaults(func=serve_cpu.run)
    return p


# ----------------------------------------------------------------------------------------- testbed
def _testbed(args) -> int:
    from .bench import testbed as tb

    name = args.name or tb.DEFAULT_NAME
    if args.action == "up":
        profile = tb.parse_profile(args.profile)
        sizes = [tb.parse_size(s) for s in args.size.split(",")] if args.size else None
        if sizes and len(sizes) == 1:
            sizes *= len(profile.tiers)
        tb.up(profile, name=name, sizes=sizes, image_dir=args.image_dir or tb.IMAGE_DIR,
              fio_bs=None if args.no_fio else tb.parse_size(args.fio_bs), fio_runtime_s=args.fio_runtime)
        print("tier dirs: " + os.pathsep.join(tb.Testbed.load(name).dirs)
              + "   (export KVSTREAM_TIERS=... or: kvstream bench --testbed " + args.profile + ")")
        return 0
    if args.action == "down":
        tb.down(name, image_dir=args.image_dir or tb.IMAGE_DIR)
        return 0
    st = tb.status(name)
    if args.json:
        print(json.dumps(st, indent=1))
        return 0 if st["up"] else 1
    if not st["up"]:
        print(f"testbed {name!r} is not up (kvstream testbed up --profile testbed2-1:20)")
        return 1
    print(f"testbed {name!r}: profile {st['profile']['name']}, blkio group {st['cgroup']}")
    live = st.get("live_limits", {})
    for i, t in enumerate(st["tiers"]):
        if not t["device"]:
            print(f"  tier{i}: {t['mount']}, a directory on this machine's disk; not throttled")
            continue
        r = live.get("read", {}).get(t["devnum"], 0) / 1e6
        w = live.get("write", {}).get(t["devnum"], 0) / 1e6
        limits = ", ".join(f"{kind} {v:.0f} MB/s" if v else f"{kind} not throttled" for kind, v in (("read", r), ("write", w)))
        print(f"  tier{i}: {t['mount']} on {t['device']} ({t['devnum']}), {t['size'] >> 30} GiB {t.get('backing', 'disk')} "
              f"image {t['image']}; throttle {limits}")
    f = st.get("fio") or {}
    if f:
        print(f"  fio (io_uring, O_DIRECT, bs {f['bs'] >> 10} KiB, iodepth {f['iodepth']}), MB/s:")
        for kind in ("read", "write"):
            print(f"    {kind:5s} " + ", ".join(f"{k} {v:.1f}" for k, v in f[kind].items()))
    for p in st["problems"]:
        print(f"  PROBLEM: {p}   (fix: kvstream testbed down && kvstream testbed up ...)")
    return 1 if st["problems"] else 0


# ------------------------------------------------------------------------------------ check / info
def _config(tiers: Sequence[str] | None):
    from ..config import Config
    from ..errors import ConfigError

    # '--tiers /a:/b' as KVSTREAM_TIERS and serve-cpu take it, or '--tiers /a /b': the config's one parser
    # splits both, and its messages name --tiers
    if not tiers and not os.environ.get("KVSTREAM_TIERS", "").strip():
        raise ConfigError("no tier directories: give --tiers DIR1:DIR2 (fastest first) or set KVSTREAM_TIERS")
    return Config.from_sources({"tiers": os.pathsep.join(tiers)} if tiers else None, labels={"tiers": "--tiers"})


def _answering(cfg) -> tuple[list, set[int]]:
    """(first looks, tiers that did not answer one in write_timeout) (probe.answering: a hung network or FUSE
    file system): reported as such, never walked (before, the command waited as long as the server)."""
    from ..probe import answering

    looks = answering(cfg)
    return looks, {k for k, look in enumerate(looks) if look.real is None}


def _check(args) -> int:
    from ..integrity import check_tiers
    from ..owed import recorded
    from ..probe import let_go

    cfg = _config(args.tiers)
    looks, hung = _answering(cfg)
    try:
        problems = check_tiers(cfg, fix=args.fix, looks=looks)  # (a tier in hung: reported 'unreadable', unchecked)
    finally:
        let_go(looks)
    left = [p for p in problems if not p.fixed]
    if args.json:
        print(json.dumps([_problem_dict(p) for p in problems], indent=1))
    else:
        owed = recorded(_tier_dirs(cfg), hung)
        for line in [_replicas_line(_under_replicated(_tier_dirs(cfg), owed, hung)), *_owed_lines(owed)]:
            print(line)
        for p in problems:
            print(_problem_line(p))
        if not problems:
            print("no problems found")
        elif not args.fix:
            print(f"{len(problems)} problem(s) found")
        else:  # exactly what was and was not repaired (a directory is never removed, for one)
            print(f"{len(problems)} problem(s) found: {len(problems) - len(left)} repaired"
                  + (f", {len(left)} not repaired (fixed=False above)" if left else ""))
    return 1 if (left if args.fix else problems) else 0


def _problem_dict(p) -> dict:
    if hasattr(p, "_asdict"):
        return p._asdict()
    if hasattr(p, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(p)
    return {"problem": str(p)}


def _problem_line(p) -> str:
    d = _problem_dict(p)
    if set(d) == {"problem"}:
        return d["problem"]
    # (ident: for code; a path is anyone's choice who may write the tier: escaped, errors.printable)
    return "  ".join(f"{k}={printable(getattr(v, 'value', v))}" for k, v in d.items() if k != "ident")


def _info(args) -> int:
    from ..owed import recorded
    from ..probe import let_go

    cfg = _config(args.tiers)
    settings = _settings(cfg)
    looks, hung = _answering(cfg)
    let_go(looks)  # (what follows walks the tiers that answered, in place: an operator's command)
    owed = recorded(_tier_dirs(cfg), hung)
    tiers = [_tier_status(d, cfg.file_mode == "shared") if k not in hung else
             {"dir": d, "ok": False, "problem": f"did not answer in {cfg.write_timeout:g} s (write_timeout): a hung "
                                               "file system (a FUSE or NFS server away); not looked at"}
             for k, d in enumerate(_tier_dirs(cfg))]
    doc = {"config": settings, "tiers": tiers, "warnings": list(cfg.warnings),
           "under_replicated": _under_replicated(_tier_dirs(cfg), owed, hung),
           "clears_owed": [{"tier": k, "namespace": d, "recorded_on": h} for k, d, h in owed]}
    from .bench import testbed as tb

    st = tb.status()
    if st["up"]:
        doc["testbed"] = {"profile": st["profile"]["name"], "dirs": [t["mount"] for t in st["tiers"]],
                          "fio": st.get("fio"), "problems": st["problems"]}
    from ..config import real_path
    from ..scan import running_scans

    asked = {look.real or t.path for t, look in zip(cfg.tiers, looks)}  # (another engine's scan of other tiers is
    # not news; a scan's tier is looked up as a tier is, bounded: it may be the hung one, or on its mount)
    bound = cfg.write_timeout
    doc["scans"] = [s for s in running_scans() if asked & {d if d in asked else real_path(d, bound) or d
                                                           for d in s.get("tier_dirs", ())}]
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    print("effective configuration (explicit > KVSTREAM_* environment > defaults):")
    width = max(map(len, settings), default=0)
    for key, (value, source) in settings.items():
        print(f"  {key:{width}s} {value!s:<28s} ({source})")
    for w in doc["warnings"]:
        print(f"  warning: {w}")
    print("tiers:")
    for i, t in enumerate(doc["tiers"]):
        if not t["ok"]:
            print(f"  tier{i} {t['dir']}: PROBLEM: {t['problem']}")
            continue
        print(f"  tier{i} {t['dir']}: {t['fstype']} on {t['device']}, {t['free_gib']:.1f} GiB free of "
              f"{t['size_gib']:.1f}; {t['pages']} pages in {t['namespaces']} namespace(s)")
    for scan in doc["scans"]:  # engines of this user on this host (scan.py's progress files)
        shards = sum(t["shards_done"] for t in scan["tiers"]), sum(t["shards"] for t in scan["tiers"])
        state = "done" if scan["done"] else f"running, {shards[0]}/{shards[1]} shard directories"
        # 'indexed' counts copies, one per tier holding a page ("N pages indexed" said twice them on 2 tiers)
        print(f"start-up scan of pid {scan['pid']} (namespace {scan['namespace']}, {', '.join(scan['tier_dirs'])}): "
              f"{state}; {scan['files']} files in {scan['seconds']:.1f} s ({scan['rate']:,.0f}/s), "
              f"{scan['indexed']} copies indexed ({scan.get('pages', '?')} pages in its index), "
              f"{scan['damaged_removed']} damaged and {scan['tmp_removed']} "
              f"leftovers removed; eviction {scan['eviction']}")
    for line in [_replicas_line(doc["under_replicated"]), *_owed_lines(owed)]:
        print(line)
    if "testbed" in doc:
        print(f"testbed: {doc['testbed']['profile']} at {', '.join(doc['testbed']['dirs'])} (kvstream testbed status)")
    return 0 if all(t["ok"] for t in doc["tiers"]) else 1


def _settings(cfg) -> dict[str, tuple[str, str]]:
    """``{setting: (value as text, where it came from)}``."""
    from dataclasses import fields

    sources = getattr(cfg, "sources", {}) or {}
    out = {}
    for f in fields(cfg):
        if f.name in ("warnings", "sources"):
            continue
        value = getattr(cfg, f.name)
        source = sources.get(f.name, "default")
        if f.name == "tiers":
            value = ", ".join(f"{t.path} [{t.capacity}]" for t in value)
        elif f.name == "claim":  # the effective m: unset means the policy's own, or the router's default
            value = cfg.claim_size
            if cfg.claim is None:
                source += f"; m of policy {cfg.policy_spec!r}"
        out[f.name] = (str(value), source)
    return out


def _digests_of(path: str) -> list[str]:
    """The namespace digests on one tier directory. :raises OSError: its kvstream/ cannot be listed."""
    from ..layout import ROOT_DIR, is_digest

    base = os.path.join(path, ROOT_DIR)
    return [d for d in (os.listdir(base) if os.path.isdir(base) else []) if is_digest(d)]


def _groups(path: str, digests: Sequence[str]) -> set[tuple[str, str]]:
    """(digest, entry of its directory) of one tier: a shard directory, or '' for the files beside them. A
    directory that cannot be listed holds nothing here (as os.walk skips it)."""
    from ..layout import ROOT_DIR

    out: set[tuple[str, str]] = set()
    for d in digests:
        try:
            with os.scandir(os.path.join(path, ROOT_DIR, d)) as entries:
                out.update((d, e.name if e.is_dir(follow_symlinks=False) else "") for e in entries)
        except OSError:
            continue
    return out


def _group_names(path: str, digest: str, group: str) -> set[str]:
    """The page file names of one group of :func:`_groups` on one tier (os.walk: no link followed, a
    directory it cannot list skipped)."""
    from ..layout import PAGE_SUFFIX, ROOT_DIR

    top = os.path.join(path, ROOT_DIR, digest)
    if not group:
        try:
            with os.scandir(top) as entries:
                return {e.name for e in entries if e.name.endswith(PAGE_SUFFIX) and not e.is_dir()}
        except OSError:
            return set()
    return {n for _, _, names in os.walk(os.path.join(top, group)) for n in names if n.endswith(PAGE_SUFFIX)}


def _page_count(path: str) -> int:
    """Page files under one tier directory, counted a shard directory at a time (a set of every page's name
    was ~250 B a page: 428 MB of `kvstream info` at 1M pages); a name in several directories of a namespace
    (beside the shards, misplaced) is one page, as when every name was held. :raises OSError: as
    :func:`_digests_of`."""
    total = 0
    for digest in _digests_of(path):
        groups = {g for _, g in _groups(path, [digest])}
        strays: dict[str, set[str]] = {}
        total += sum(len(_homed(_group_names(path, digest, g), g, strays)) for g in groups)
        total += sum(len(names - _home_names(path, digest, home)) for home, names in strays.items())
    return total


def _home(name: str) -> str:
    """The shard directory a page file's name belongs in (layout.page_path: its key's first 2 characters)."""
    from ..layout import PAGE_SUFFIX

    return name[:-len(PAGE_SUFFIX)][:2]


def _homed(names: set[str], group: str, strays: dict[str, set[str]]) -> set[str]:
    """The ``names`` found in ``group`` that belong there; the others (few: misplaced, beside the shards) go
    to ``strays`` by the shard they belong in, compared with it once every group was listed (review: counted
    a group at a time, a name in two directories was two pages, and under-replicated on the tiers that held
    it in one alone)."""
    for name in names:
        if _home(name) != group:
            strays.setdefault(_home(name), set()).add(name)
    return {name for name in names if _home(name) == group}


def _home_names(path: str, digest: str, home: str) -> set[str]:
    """The names that belong in shard ``home`` found there (listed again: only for a shard with strays; none
    where it is missing)."""
    return _homed(_group_names(path, digest, home), home, {})


def _under_replicated(dirs: Sequence[str], owed: Sequence[tuple[int, str, int]] = (), hung: set[int] = frozenset()
                      ) -> dict:
    """Pages some tier lacks, per tier (what background replication still owes, or skipped with it off).
    A tier whose tree cannot be listed counts for nothing here (check and info report it on its own line),
    nor does one that did not answer (``hung``: not touched), nor do the pages of a namespace a tier owes a
    clear of (``owed``, owed.recorded: stale, never copied). The tiers are compared a shard directory at a
    time: one shard's names held, never every page's."""
    stale = {(k, digest) for k, digest, _ in owed}
    digests = [None if k in hung else _readable_digests(d) if os.path.isdir(d) else [] for k, d in enumerate(dirs)]
    digests = [ds if ds is None else [d for d in ds if (k, d) not in stale] for k, ds in enumerate(digests)]
    known = [k for k, ds in enumerate(digests) if ds is not None]
    if len(known) < 2:  # (one tier holds every page it holds: no walk, half of `kvstream info`'s time)
        return {"pages": 0, "lacking_per_tier": [0] * len(dirs)}
    groups = set().union(*(_groups(dirs[k], digests[k]) for k in known))
    counts: dict[tuple[str, str], tuple[list[int], int]] = {}  # (digest, shard) -> (lacking per tier, pages)
    strays: dict[tuple[int, str], dict[str, set[str]]] = {}  # (tier, digest) -> shard -> names misplaced
    for digest, group in sorted(groups):
        held = {k: _homed(_group_names(dirs[k], digest, group), group, strays.setdefault((k, digest), {}))
                if digest in digests[k] else set() for k in known}
        counts[(digest, group)] = _compared(held, len(dirs))
    for digest, home in {(d, h) for (_, d), homes in strays.items() for h in homes}:
        held = {k: (_home_names(dirs[k], digest, home) if digest in digests[k] else set()) |
                strays.get((k, digest), {}).get(home, set()) for k in known}
        counts[(digest, home)] = _compared(held, len(dirs))
    lacking = [sum(c[0][k] for c in counts.values()) for k in range(len(dirs))]
    return {"pages": sum(c[1] for c in counts.values()), "lacking_per_tier": lacking}


def _compared(held: dict[int, set[str]], n: int) -> tuple[list[int], int]:
    """(names each tier lacks of those ``held`` by some, names some tier lacks) of one shard."""
    every = set().union(*held.values())
    lacking = [0] * n
    for k, names in held.items():
        lacking[k] = len(every - names)
    return lacking, len(every - set.intersection(*held.values()))


def _readable_digests(path: str) -> list[str] | None:
    try:
        return _digests_of(path)
    except OSError:  # (EACCES on its kvstream/ tree)
        return None


def _replicas_line(u: dict) -> str:
    if not u["pages"]:
        return "replicas: every page is on every tier"
    return (f"under-replicated: {u['pages']} page(s) lack a tier (" + ", ".join(
        f"tier{k} lacks {n}" for k, n in enumerate(u["lacking_per_tier"]) if n) + "); a running engine writes "
        "those it knows (put, read, or found by its start-up scan; another node's pages on a shared tier once it "
        "reads them) while the tiers have room (background replication, KVSTREAM_CATCHUP)")


def _owed_lines(owed: Sequence[tuple[int, str, int]]) -> list[str]:
    by_tier: dict[tuple[int, str], list[int]] = {}
    for k, digest, holder in owed:
        by_tier.setdefault((k, digest), []).append(holder)
    return [f"tier{k} owes a clear() of namespace {digest} (recorded on " + ", ".join(f"tier{h}" for h in holders)
            + "): its pages of it are stale, removed before it serves at the next start" for (k, digest), holders
            in sorted(by_tier.items())]


def _tier_dirs(cfg) -> list[str]:
    return [t.path for t in cfg.tiers]


def _tier_status(path: str, shared: bool = False) -> dict:
    from ..trust import learn, owner_problem

    out: dict = {"dir": path, "ok": False}
    if not os.path.isdir(path):  # (a file there is no directory to create: said as what it is)
        out["problem"] = (f"{'not a directory' if os.path.exists(path) else 'missing'} (create it, or fix "
                          "KVSTREAM_TIERS / --tiers)")
        return out
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        out["problem"] = "not readable and writable by this user (fix its permissions or owner)"
        return out
    try:
        why = owner_problem(path, learn(path, shared))  # (as start-up refuses it: before, info said ok)
        if why is not None:
            out["problem"] = printable(f"an engine refuses it: {why}")
            return out
        _tier_usage(path, out)
    except OSError as exc:  # its kvstream/ tree unreadable (EACCES): a problem of this tier, not a traceback
        from ..integrity import blocking_dir

        where = blocking_dir(path, exc.filename or path)
        out["problem"] = (f"not readable: {where} ({os.strerror(exc.errno or 5)}): run as the tier's owner, or "
                          f"give this user access (as its owner or root: chmod -R u+rwX {where})")
    return out


def _tier_usage(path: str, out: dict) -> None:
    """File system, free space, namespaces and pages of the tier at ``path`` into ``out``.
    :raises OSError: a directory cannot be listed."""
    from ..probe import mount_field

    usage = shutil.disk_usage(path)
    out.update(size_gib=usage.total / (1 << 30), free_gib=usage.free / (1 << 30), fstype="?", device="?")
    real, best = os.path.realpath(path), ""
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, fstype = (mount_field(field) for field in line.split()[:3])  # (a space in mnt: \040)
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, out["fstype"], out["device"] = mnt, fstype, dev
    out["namespaces"] = len(_digests_of(path))
    out["pages"] = _page_count(path)
    out["ok"] = True


if __name__ == "__main__":
    sys.exit(main())
