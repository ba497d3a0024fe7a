"""fio job files (built as text, so they can be checked without running fio) and fio JSON results.

The testbed records fio's figures for each tier alone and for all tiers at once, with the same
request size as the engine (one page per request) and ``io_uring`` + ``O_DIRECT``, so the
physical bound sits on record beside the engine's own.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

FIO_IODEPTH = 4  # requests in flight per tier: the engine's default claim depth (2 claims of m=2 pages)
FIO_FILE_BYTES = 1 << 30  # bytes per tier probe file: large enough to defeat any device cache in a run
FIO_RUNTIME_S = 5.0  # seconds per measurement


@dataclass(frozen=True)
class FioJob:
    """One fio job: ``rw`` on ``filename`` with requests of ``bs`` bytes."""

    name: str
    filename: str
    rw: str  # "randread" | "read" | "write" | "randwrite"
    bs: int
    size: int = FIO_FILE_BYTES
    iodepth: int = FIO_IODEPTH
    runtime_s: float | None = FIO_RUNTIME_S  # None: run once over the file (used to fill it)


def jobfile(jobs: Sequence[FioJob]) -> str:
    """The fio job file running ``jobs`` concurrently (one fio process, one job section each)."""
    lines = ["[global]", "ioengine=io_uring", "direct=1", "thread=1", "group_reporting=0", ""]
    for job in jobs:
        size = job.size - job.size % job.bs  # fio refuses a size that is not a multiple of bs for some rw
        lines += [
            f"[{job.name}]",
            f"filename={job.filename}",
            f"rw={job.rw}",
            f"bs={job.bs}",
            f"size={size}",
            f"iodepth={job.iodepth}",
        ]
        if job.runtime_s is not None:
            lines += ["time_based=1", f"runtime={job.runtime_s:g}s"]
        lines.append("")
    return "\n".join(lines)


def parse_json(text: str) -> dict[str, dict[str, float]]:
    """fio ``--output-format=json`` -> ``{job name: {"read_bps": ..., "write_bps": ...}}`` (bytes/s).

    fio may print warnings before the JSON document; they are skipped.
    """
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON in fio output: {text[:200]!r}")
    doc = json.loads(text[start:])
    out: dict[str, dict[str, float]] = {}
    for job in doc.get("jobs", []):
        out[job["jobname"]] = {
            "read_bps": float(job["read"]["bw_bytes"]),
            "write_bps": float(job["write"]["bw_bytes"]),
        }
    return out


def available() -> bool:
    return shutil.which("fio") is not None


def run(jobs: Sequence[FioJob], *, timeout_s: float | None = None, preexec_fn=None) -> dict[str, dict[str, float]]:
    """Run ``jobs`` concurrently in one fio process and return :func:`parse_json` of its output.

    Raises ``RuntimeError`` with fio's stderr when fio fails.
    """
    proc = subprocess.run(
        ["fio", "--output-format=json", "-"],
        input=jobfile(jobs),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        preexec_fn=preexec_fn,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return parse_json(proc.stdout)


def spawn(jobs: Sequence[FioJob]) -> subprocess.Popen:
    """Start fio in the background (a drift scenario's competing tenant); the caller terminates it."""
    proc = subprocess.Popen(
        ["fio", "--output-format=json", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(jobfile(jobs))
    proc.stdin.close()
    return proc


def summarize(results: Mapping[str, Mapping[str, float]], key: str) -> dict[str, float]:
    """``{job: MB/s}`` of one direction (``"read_bps"`` or ``"write_bps"``), rounded for display."""
    return {name: round(r[key] / 1e6, 1) for name, r in results.items()}


def fill(files: Sequence[str], bs: int, size: int = FIO_FILE_BYTES, iodepth: int = FIO_IODEPTH, *,
         preexec_fn=None) -> None:
    """Write each probe file in full (all at once), so it is allocated before anything is timed;
    a file already at ``size`` (an earlier fill) is left as it is."""
    todo = [f for f in files if not os.path.exists(f) or os.path.getsize(f) < size - size % bs]
    if todo:
        run([FioJob(f"fill{i}", f, "write", bs, size=size, runtime_s=None, iodepth=iodepth)
             for i, f in enumerate(todo)], preexec_fn=preexec_fn)


def alone_and_together(files: Sequence[str], rw: str, bs: int, *, size: int = FIO_FILE_BYTES,
                       iodepth: int = FIO_IODEPTH, runtime_s: float = FIO_RUNTIME_S, preexec_fn=None,
                       log: Callable[[str], None] = print) -> dict[str, float]:
    """fio ``rw`` on each file (one per tier) alone, then on all at once: MB/s as
    ``{"tier0": alone, ..., "tier0+": in the all-at-once run, ..., "all": the all-at-once sum}``."""
    key = "write_bps" if "write" in rw else "read_bps"
    kind = "write" if "write" in rw else "read"
    out: dict[str, float] = {}
    for i, f in enumerate(files):
        job = FioJob(f"tier{i}", f, rw, bs, size=size, iodepth=iodepth, runtime_s=runtime_s)
        out[f"tier{i}"] = summarize(run([job], preexec_fn=preexec_fn), key)[f"tier{i}"]
        log(f"  fio {kind:5s} tier{i} alone: {out[f'tier{i}']:8.1f} MB/s")
    jobs = [FioJob(f"tier{i}+", f, rw, bs, size=size, iodepth=iodepth, runtime_s=runtime_s) for i, f in enumerate(files)]
    together = summarize(run(jobs, preexec_fn=preexec_fn), key)
    out.update(together)
    out["all"] = round(sum(together.values()), 1)
    log(f"  fio {kind:5s} all at once: " + ", ".join(f"{k} {v:.1f}" for k, v in together.items())
        + f" -> {out['all']:.1f} MB/s")
    return out
