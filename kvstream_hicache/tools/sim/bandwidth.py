"""Per-tier bandwidth over time: constant, periodic, bursty, or recorded from a real run.

kvsim samples each tier's series at the start of every step and holds it for that step, which is
the paper's per-step ``b_k(i)``.

Command-line forms (``parse_series``)::

    3G                                           constant 3 GB/s (K/M/G/T decimal, Ki/Mi/Gi binary)
    periodic:mean=1G,amp=0.5G,period=60[,phase=0]   mean + amp * sin(2 pi t / period + phase)
    bursty:high=1.2G,low=0.3G,on=20,off=10[,seed=0] alternating high/low phases with exponential
                                                 durations of mean ``on`` and ``off`` seconds
    recorded:PATH[#TIER]                         tier TIER (default 0) of a recorded JSON file

Recorded file schema (what ``kvstream bench --json`` can emit; a dict with this key suffices)::

    {"tiers": [{"name": "nvme", "t": [0, 1, 2, ...], "bps": [2.9e9, 3.1e9, ...],
                "write_bps": [...]},            # optional, same length as t
               {"name": "pfs",  "t": [...],      "bps": [...]}]}

``t`` are seconds (increasing) and ``bps`` the read bandwidth from that time on (step-hold). The
series repeats with the record's period (last ``t`` plus the last interval) so a short bench run
can drive an hour-long trace; pass ``repeat=False`` to hold the last value instead.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .model import parse_bytes

__all__ = ["Series", "Constant", "Periodic", "Bursty", "Recorded", "parse_series", "load_recorded"]


class Series:
    """A tier's read bandwidth as a function of time (bytes/s)."""

    def rate(self, t: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def mean(self, horizon: float, samples: int = 2048) -> float:
        """Time average over ``[0, horizon]`` (sampled)."""
        if horizon <= 0:
            return self.rate(0.0)
        ts = np.linspace(0.0, horizon, samples, endpoint=False)
        return float(np.mean([self.rate(float(t)) for t in ts]))


@dataclass(frozen=True)
class Constant(Series):
    bps: float

    def rate(self, t: float) -> float:
        return self.bps

    def __str__(self) -> str:
        return f"{self.bps / 1e9:g} GB/s"


@dataclass(frozen=True)
class Periodic(Series):
    mean_bps: float
    amp_bps: float
    period_s: float
    phase: float = 0.0

    def __post_init__(self):
        if not self.period_s > 0:  # (rate divides by it)
            raise ValueError(f"periodic bandwidth: period is in seconds and must be > 0, got period={self.period_s:g}")

    def rate(self, t: float) -> float:
        return max(0.0, self.mean_bps + self.amp_bps * math.sin(2 * math.pi * t / self.period_s + self.phase))

    def __str__(self) -> str:
        return f"periodic {self.mean_bps / 1e9:g}+-{self.amp_bps / 1e9:g} GB/s every {self.period_s:g} s"


@dataclass
class Bursty(Series):
    """High phases of mean ``on_s`` seconds alternating with low (contended) phases of mean ``off_s``."""

    high_bps: float
    low_bps: float
    on_s: float
    off_s: float
    seed: int = 0
    _switch: list = field(default_factory=list, repr=False)  # phase boundaries, grown on demand
    _rng: np.random.Generator | None = field(default=None, repr=False)

    def __post_init__(self):
        # Phases of mean length 0 never pass a time t: rate() would loop forever (and numpy refuses
        # a negative mean with a message that names neither setting).
        if not (self.on_s > 0 and self.off_s > 0):
            raise ValueError(f"bursty bandwidth: on and off are mean phase lengths in seconds and must be > 0, "
                             f"got on={self.on_s:g}, off={self.off_s:g}")

    def rate(self, t: float) -> float:
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
            self._switch = [0.0]
        while self._switch[-1] <= t:
            mean = self.on_s if len(self._switch) % 2 == 1 else self.off_s
            self._switch.append(self._switch[-1] + float(self._rng.exponential(mean)))
        phase = int(np.searchsorted(self._switch, t, side="right")) - 1
        return self.high_bps if phase % 2 == 0 else self.low_bps

    def __str__(self) -> str:
        return (f"bursty {self.high_bps / 1e9:g}/{self.low_bps / 1e9:g} GB/s "
                f"(on {self.on_s:g} s, off {self.off_s:g} s, seed {self.seed})")


@dataclass(frozen=True)
class Recorded(Series):
    t: tuple[float, ...]
    bps: tuple[float, ...]
    name: str = "recorded"
    repeat: bool = True

    def __post_init__(self):
        if not self.t or len(self.t) != len(self.bps):
            raise ValueError(f"recorded series {self.name!r}: t and bps must be non-empty and equally long")
        if any(b < a for a, b in zip(self.t, self.t[1:])):
            raise ValueError(f"recorded series {self.name!r}: t must be increasing")

    @property
    def period(self) -> float:
        if len(self.t) == 1:
            return math.inf
        return self.t[-1] - self.t[0] + (self.t[-1] - self.t[-2])

    def rate(self, t: float) -> float:
        t = t + self.t[0]
        if self.repeat and math.isfinite(self.period) and t >= self.t[0] + self.period:
            t = self.t[0] + (t - self.t[0]) % self.period
        i = int(np.searchsorted(self.t, t, side="right")) - 1
        return float(self.bps[max(i, 0)])

    def __str__(self) -> str:
        return f"recorded {self.name} (mean {float(np.mean(self.bps)) / 1e9:.3g} GB/s over {len(self.t)} samples)"


def load_recorded(path: str | os.PathLike, repeat: bool = True) -> tuple[list[Recorded], list[Recorded | None]]:
    """Read a recorded bandwidth file (schema in the module docstring): (read series, write series or None)."""
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    tiers = doc.get("tiers") if isinstance(doc, dict) else None
    if not isinstance(tiers, list) or not tiers:
        raise ValueError(f"{path}: expected {{'tiers': [{{'t': [...], 'bps': [...]}}, ...]}}")
    reads, writes = [], []
    for k, tier in enumerate(tiers):
        try:
            name = str(tier.get("name", f"tier{k}"))
            t = tuple(float(x) for x in tier["t"])
            reads.append(Recorded(t, tuple(float(x) for x in tier["bps"]), name, repeat))
            wb = tier.get("write_bps")
            writes.append(None if wb is None else Recorded(t, tuple(float(x) for x in wb), name + "-write", repeat))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tier {k}: {e}") from None
    return reads, writes


def _fields(body: str, spec: str) -> dict[str, str]:
    out = {}
    for part in body.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"bad field {part!r} in bandwidth {spec!r} (expected key=value)")
        out[key.strip().lower()] = value.strip()
    return out


def parse_series(spec: str) -> Series:
    """A bandwidth series from its command-line form (see the module docstring)."""
    kind, _, body = spec.partition(":")
    kind = kind.strip().lower()
    try:
        if kind == "periodic":
            f = _fields(body, spec)
            return Periodic(parse_bytes(f["mean"]), parse_bytes(f.get("amp", "0")), float(f["period"]),
                            float(f.get("phase", 0)))
        if kind == "bursty":
            f = _fields(body, spec)
            return Bursty(parse_bytes(f["high"]), parse_bytes(f["low"]), float(f.get("on", 10)),
                          float(f.get("off", 10)), int(f.get("seed", 0)))
        if kind == "recorded":
            path, _, tier = body.partition("#")
            reads, _ = load_recorded(path)
            k = int(tier) if tier.strip().isdigit() else (0 if not tier.strip() else -1)
            if not 0 <= k < len(reads):  # (a bare index would raise IndexError, or -1 pick the last tier)
                raise ValueError(f"{path} has {len(reads)} tiers: #{tier.strip()} is not one of them, "
                                 f"use #0 to #{len(reads) - 1}")
            return reads[k]
        return Constant(parse_bytes(spec))
    except KeyError as e:
        raise ValueError(f"bandwidth {spec!r} lacks field {e}") from None
