"""Bandwidth-drift scenarios, each one flag of ``kvstream bench --scenario``.

  quiet               nothing changes
  periodic            tier ``--drift-tier`` (default 1) has its read throttle multiplied by
                      ``--drift-factor`` (default 0.5) for a phase, then restored for a phase, and so
                      on (needs ``--testbed``: it edits the blkio throttle)
  competing           another tenant of tier ``--drift-tier`` (default: the last tier): an fio
                      random-read job (requests of one page, iodepth 4) runs for a phase, pauses for
                      a phase, and so on. On the testbed it runs inside the bench's blkio group, so it
                      takes its share of that tier's throttled bandwidth, as a second user of a
                      shared file system would
  write-interference  tier 0 under concurrent writes: an fio sequential-write job on tier 0, on and
                      off by phases (on the testbed, throttled at tier 0's write limit). blk-throttle
                      meters reads and writes separately and the disk under the loop devices has
                      headroom, so on the testbed writes alone barely touch reads (580 -> 559 MB/s
                      with an unthrottled 756 MB/s writer). A real device shares one budget, so on the
                      testbed tier 0's read limit is also multiplied by ``--drift-factor`` while the
                      writer runs (``--interference emulated``, the default); ``physical`` runs the
                      writer only.

Phases last ``--drift-period`` seconds times a factor drawn uniformly in [0.5, 1.5) from the run's
seed: fixed phases lock onto the round structure of the bench (a round takes about two periods),
so one policy would always read during the "off" phase. Every change is recorded as an event
``{"t": s, "scenario": ..., "tier": k, "on": bool, ...}`` on the run's clock; :func:`exposure`
gives the share of an interval spent with the drift on, so fairness across policies is checked.
"""
from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from typing import Callable, Sequence

from . import fio

SCENARIOS = ("quiet", "periodic", "competing", "write-interference")
DRIFT_PERIOD_S = 3.0  # mean seconds per phase: a couple of batches of 128 pages on the 1:20 testbeds
DRIFT_FACTOR = 0.5  # periodic / emulated interference: the share of the read limit left while on
PHASE_JITTER = (0.5, 1.5)  # phase length = period x U(PHASE_JITTER)
TENANT_IODEPTH = 4  # competing tenant / writer: requests in flight
TENANT_FILE_BYTES = 1 << 30  # bytes of the tenant's file on its tier


class Scenario:
    """Base: ``start(clock)`` begins the drift (a thread), ``stop()`` ends it and restores the tier."""

    name = "quiet"
    tier: int | None = None

    def __init__(self, period: float = DRIFT_PERIOD_S, seed: int = 0) -> None:
        self.period = period
        self.events: list[dict] = []
        self.error: BaseException | None = None
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock: Callable[[], float] = time.perf_counter
        self._on = False

    def prepare(self) -> None:
        """Untimed set-up (files the tenant needs), before the read phase."""

    def start(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        if type(self)._switch is Scenario._switch:
            return  # quiet: no thread
        self._thread = threading.Thread(target=self._run, name=f"drift-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._on:
            self._switch(False)
            self._on = False
            self._event(on=False)
        self._cleanup()

    def _run(self) -> None:
        try:
            # Start "off" for a random part of a phase, then alternate.
            if self._stop.wait(self.period * self._rng.uniform(0.0, 1.0)):
                return
            while not self._stop.is_set():
                self._on = not self._on
                self._switch(self._on)
                self._event(on=self._on)
                if self._stop.wait(self.period * self._rng.uniform(*PHASE_JITTER)):
                    break
        except BaseException as exc:  # reported by the runner: a scenario that failed silently would fake calm
            self.error = exc

    def _switch(self, on: bool) -> None:
        """Turn the drift on or off."""

    def _cleanup(self) -> None:
        pass

    def _event(self, **fields) -> None:
        self.events.append({"t": round(self._clock(), 4), "scenario": self.name, "tier": self.tier, **fields})


class Periodic(Scenario):
    name = "periodic"

    def __init__(self, testbed, tier: int = 1, factor: float = DRIFT_FACTOR, period: float = DRIFT_PERIOD_S,
                 seed: int = 0):
        super().__init__(period, seed)
        if testbed is None:
            raise ValueError("--scenario periodic changes a blkio throttle: it needs --testbed PROFILE")
        self.testbed, self.tier, self.factor = testbed, tier, factor
        self.full = testbed.profile.tiers[tier].read_bps

    def _switch(self, on: bool) -> None:
        self.testbed.set_read_bps(self.tier, int(self.full * self.factor) if on else self.full)

    def _event(self, **fields) -> None:
        bps = int(self.full * self.factor) if fields.get("on") else self.full
        super()._event(read_bps=bps, **fields)


class _FioTenant(Scenario):
    """An fio job on one tier, on for a phase and off for a phase."""

    rw = "randread"

    def __init__(self, directory: str, tier: int, bs: int, period: float = DRIFT_PERIOD_S, seed: int = 0):
        super().__init__(period, seed)
        self.tier, self.bs = tier, bs
        self.path = os.path.join(directory, f".kvstream-bench-{self.name}")
        self.proc: subprocess.Popen | None = None

    def job(self) -> fio.FioJob:
        return fio.FioJob(self.name, self.path, self.rw, self.bs, size=TENANT_FILE_BYTES,
                          iodepth=TENANT_IODEPTH, runtime_s=3600.0)

    def prepare(self) -> None:
        if not fio.available():
            raise RuntimeError(f"--scenario {self.name} runs fio: install it (apt-get install fio)")
        if os.path.exists(self.path) and os.path.getsize(self.path) >= TENANT_FILE_BYTES:
            return
        fill = fio.FioJob("fill", self.path, "write", self.bs, size=TENANT_FILE_BYTES, runtime_s=None)
        fio.run([fill])

    def _switch(self, on: bool) -> None:
        if on:
            self.proc = fio.spawn([self.job()])  # inherits the bench's blkio group
        else:
            self._kill()

    def _event(self, **fields) -> None:
        super()._event(tenant="on" if fields.get("on") else "off", rw=self.rw, **fields)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _cleanup(self) -> None:
        self._kill()
        if os.path.exists(self.path):
            os.unlink(self.path)


class Competing(_FioTenant):
    name = "competing"
    rw = "randread"


class WriteInterference(_FioTenant):
    name = "write-interference"
    rw = "write"

    def __init__(self, directory: str, tier: int, bs: int, period: float = DRIFT_PERIOD_S, seed: int = 0,
                 testbed=None, factor: float = DRIFT_FACTOR):
        super().__init__(directory, tier, bs, period, seed)
        self.testbed, self.factor = testbed, factor
        self.full = testbed.profile.tiers[tier].read_bps if testbed is not None else None

    def _switch(self, on: bool) -> None:
        super()._switch(on)
        if self.testbed is not None:  # emulated read/write coupling (module docstring)
            self.testbed.set_read_bps(self.tier, int(self.full * self.factor) if on else self.full)

    def _event(self, **fields) -> None:
        if self.testbed is not None:
            fields["read_bps"] = int(self.full * self.factor) if fields.get("on") else self.full
        super()._event(**fields)


def make(name: str, *, testbed, dirs: list[str], bs: int, tier: int | None = None,
         factor: float = DRIFT_FACTOR, period: float = DRIFT_PERIOD_S, seed: int = 0,
         interference: str = "emulated") -> Scenario:
    """The scenario called ``name`` for these tiers."""
    if name == "quiet":
        return Scenario(period, seed)
    if name == "periodic":
        return Periodic(testbed, 1 if tier is None else tier, factor, period, seed)
    if name == "competing":
        k = len(dirs) - 1 if tier is None else tier
        return Competing(dirs[k], k, bs, period, seed)
    if name == "write-interference":
        k = 0 if tier is None else tier
        emulate = testbed if interference == "emulated" else None
        return WriteInterference(dirs[k], k, bs, period, seed, testbed=emulate, factor=factor)
    raise ValueError(f"unknown scenario {name!r}: use one of {', '.join(SCENARIOS)}")


def round_order(items: Sequence, r: int, seed: int = 0) -> list:
    """The order in which round ``r`` reads ``items`` (policies): shuffled from the run's seed and the
    round, so each item meets drift at every place in the round, and follows a different item from
    round to round. A rotation kept each item behind the same one: a two-tier policy that always
    followed its one-tier twin always found a throttled tier 1 idle, its blk-throttle burst credit
    unspent (the first 64 MB of a "0.7 GB/s" tier at 3-4 GB/s; docs/benchmarks.md, "Two tiers against
    one")."""
    out = list(items)
    random.Random(seed * 1_000_003 + r).shuffle(out)
    return out


def exposure(events: Sequence[dict], t0: float, t1: float) -> float:
    """Share of [t0, t1] during which the drift was on, from a scenario's events."""
    if t1 <= t0:
        return 0.0
    on_since: float | None = None
    total = 0.0
    for e in sorted(events, key=lambda e: e["t"]):
        if e.get("on") and on_since is None:
            on_since = e["t"]
        elif not e.get("on") and on_since is not None:
            total += max(0.0, min(t1, e["t"]) - max(t0, on_since))
            on_since = None
    if on_since is not None:
        total += max(0.0, t1 - max(t0, on_since))
    return total / (t1 - t0)
