"""Bandwidth-drift scenarios, each one flag of ``kvstream bench --scenario``.

  quiet               nothing changes
  periodic            tier ``--drift-tier`` (default 1) has its read throttle multiplied by
                      ``--drift-factor`` (default 0.5) for ``--drift-period`` seconds, then restored
                      for as long, and so on (needs ``--testbed``: it edits the blkio throttle)
  competing           another tenant of tier ``--drift-tier``: an fio random-read job (requests of
                      one page, iodepth 4) runs for a period, pauses for a period, and so on. On the
                      testbed it runs inside the bench's blkio group, so it takes its share of that
                      tier's throttled bandwidth, as a second user of a shared file system would
  write-interference  tier 0 under concurrent writes: an fio sequential-write job on tier 0, on and
                      off with the same period (on the testbed, throttled at tier 0's write limit)

Every change is recorded as an event ``{"t": s, "scenario": ..., "tier": k, ...}`` with ``t`` on the
run's clock, so plots can mark them and the bound can be read against them.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Callable

from . import fio

SCENARIOS = ("quiet", "periodic", "competing", "write-interference")
DRIFT_PERIOD_S = 3.0  # seconds between changes: a few batches of 128 pages on the 1:20 testbeds
DRIFT_FACTOR = 0.5  # periodic: the throttled share of the tier's read limit
TENANT_IODEPTH = 4  # competing tenant / writer: requests in flight
TENANT_FILE_BYTES = 1 << 30  # bytes of the tenant's file on its tier


class Scenario:
    """Base: ``start(clock)`` begins the drift (a thread), ``stop()`` ends it and restores the tier."""

    name = "quiet"

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock: Callable[[], float] = time.perf_counter
        self.error: BaseException | None = None

    def prepare(self) -> None:
        """Untimed set-up (files the tenant needs), before the read phase."""

    def start(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        if type(self)._cycle is Scenario._cycle:
            return
        self._thread = threading.Thread(target=self._run, name=f"drift-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._restore()

    def _run(self) -> None:
        try:
            phase = 0
            while not self._stop.is_set():
                self._cycle(phase)
                phase ^= 1
                if self._stop.wait(self.period):
                    break
        except BaseException as exc:  # reported by the runner: a scenario that failed silently would fake calm
            self.error = exc

    def _cycle(self, phase: int) -> None:
        """Phase 1: drift on; phase 0: drift off (the first call, at start, is phase 0)."""

    def _restore(self) -> None:
        pass

    def _event(self, **fields) -> None:
        self.events.append({"t": round(self._clock(), 4), "scenario": self.name, **fields})


class Periodic(Scenario):
    name = "periodic"

    def __init__(self, testbed, tier: int = 1, factor: float = DRIFT_FACTOR, period: float = DRIFT_PERIOD_S):
        super().__init__()
        if testbed is None:
            raise ValueError("--scenario periodic changes a blkio throttle: it needs --testbed PROFILE")
        self.testbed, self.tier, self.factor, self.period = testbed, tier, factor, period
        self.full = testbed.profile.tiers[tier].read_bps

    def _cycle(self, phase: int) -> None:
        bps = int(self.full * self.factor) if phase else self.full
        if phase:
            self.testbed.set_read_bps(self.tier, bps)
            self._event(tier=self.tier, read_bps=bps)
        elif self.events:  # phase 0 after a drift: restore
            self.testbed.set_read_bps(self.tier, bps)
            self._event(tier=self.tier, read_bps=bps)

    def _restore(self) -> None:
        self.testbed.set_read_bps(self.tier, self.full)
        self._event(tier=self.tier, read_bps=self.full)


class _FioTenant(Scenario):
    """An fio job on one tier, on for a period and off for a period."""

    rw = "randread"

    def __init__(self, directory: str, tier: int, bs: int, period: float = DRIFT_PERIOD_S):
        super().__init__()
        self.tier, self.bs, self.period = tier, bs, period
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

    def _cycle(self, phase: int) -> None:
        if phase:
            self.proc = fio.spawn([self.job()])
            self._event(tier=self.tier, tenant="on", rw=self.rw)
        elif self.proc is not None:
            self._kill()
            self._event(tier=self.tier, tenant="off", rw=self.rw)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _restore(self) -> None:
        if self.proc is not None:
            self._kill()
            self._event(tier=self.tier, tenant="off", rw=self.rw)
        if os.path.exists(self.path):
            os.unlink(self.path)


class Competing(_FioTenant):
    name = "competing"
    rw = "randread"


class WriteInterference(_FioTenant):
    name = "write-interference"
    rw = "write"


def make(name: str, *, testbed, dirs: list[str], bs: int, tier: int | None = None,
         factor: float = DRIFT_FACTOR, period: float = DRIFT_PERIOD_S) -> Scenario:
    """The scenario called ``name`` for these tiers."""
    if name == "quiet":
        return Scenario()
    if name == "periodic":
        return Periodic(testbed, 1 if tier is None else tier, factor, period)
    if name == "competing":
        k = len(dirs) - 1 if tier is None else tier
        return Competing(dirs[k], k, bs, period)
    if name == "write-interference":
        k = 0 if tier is None else tier
        return WriteInterference(dirs[k], k, bs, period)
    raise ValueError(f"unknown scenario {name!r}: use one of {', '.join(SCENARIOS)}")
