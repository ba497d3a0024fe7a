"""Randomized model test (hypothesis, stateful): puts, gets, restarts, injected I/O errors, tier
failures and lost files against a plain set of acknowledged keys.

Invariants: a page returned True is byte-exact (never a wrong byte); a page acknowledged by put is
found whenever the tiers are healthy and one of its copies survives (never a lost page); the store's
own check() finds nothing wrong at the end.
"""
from __future__ import annotations

import errno
import hashlib
import shutil
import tempfile
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstream_hicache import Config, Engine, Namespace
from kvstream_hicache.faults import Fault
from kvstream_hicache.faults import TierFaultPlan as TierPlan
from kvstream_hicache.io import OP_READ, OP_WRITE

from helpers import FakeClock, uring_available

# The machine deletes page files behind the engine's back and restarts it in between (restart closes a
# store it damaged on purpose); teardown repairs with check(fix=True) and then requires check() == [].
pytestmark = pytest.mark.leaves_problems("restart closes an engine whose files the test deleted on purpose")
NS = Namespace({"model": "hypothesis"})
KEYS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(10)]
PAGE = 16 << 10  # 4 blocks of 4 KiB
SCRATCH = os.environ.get("KVSTREAM_TEST_DIR", "/var/tmp")


def payload(k: str) -> np.ndarray:
    """Keys identify content (as sglang's page hashes do): the same key always carries the same bytes."""
    return np.frombuffer(hashlib.shake_256(k.encode()).digest(PAGE), dtype=np.uint8)


class EngineModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="kvstream-model-", dir=SCRATCH)
        self.dirs = [os.path.join(self.root, f"t{k}") for k in range(2)]
        for d in self.dirs:
            os.makedirs(d)
        self.plan = TierPlan()
        self.clock = FakeClock()
        self.engine = None
        self.acked: set[str] = set()
        self.lost: set[str] = set()  # acked keys whose every copy was deleted by the test
        self.deleted: set[str] = set()  # page files deleted by the test
        self.src = {k: payload(k) for k in KEYS}

    def open(self) -> None:
        io = "uring" if uring_available() else "threads"
        config = Config.from_sources({"tiers": self.dirs, "chunk": "4K", "io_engine": io, "tier_retry": 1},
                                     environ={})
        self.engine = Engine(config, NS, fault_plan=self.plan, clock=self.clock)

    @initialize()
    def start(self):
        self.open()

    def teardown(self):
        try:
            if self.engine is not None:
                self.heal()
                problems = self.engine.check(fix=True)
                # only the files this test deleted behind the engine's back may be reported
                assert all(p.kind == "index_stale" and p.path in self.deleted for p in problems), problems
                assert self.engine.check() == []
                self.engine.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- rules ----------------------------------------------------------------------------------
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def put(self, keys):
        ok = self.engine.put(keys, [[(self.src[k].ctypes.data, PAGE)] for k in keys])
        for k, stored in zip(keys, ok):
            if stored:
                self.acked.add(k)
                self.lost.discard(k)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def get(self, keys):
        dst = [np.zeros(PAGE, dtype=np.uint8) for _ in keys]
        ok = self.engine.get(keys, [[(d.ctypes.data, PAGE)] for d in dst])
        for k, found, d in zip(keys, ok, dst):
            if found:
                assert k in self.acked, f"{k} found but never acknowledged"
                assert np.array_equal(d, self.src[k]), "wrong bytes served"
        if not self.plan._tier_rules and all(t.healthy for t in self.engine.tiers):
            for k, found in zip(keys, ok):
                if k in self.acked and k not in self.lost:
                    assert found, f"acknowledged page {k} lost while a replica survives"

    @rule(tier=st.integers(0, 1), op=st.sampled_from([OP_READ, OP_WRITE]), times=st.integers(1, 4),
          err=st.sampled_from([errno.EIO, errno.EAGAIN, errno.ENOSPC]))
    def inject_error(self, tier, op, times, err):
        self.plan.on(self.dirs[tier], Fault.error(err), opcode=op, times=times)

    @rule(tier=st.integers(0, 1))
    def corrupt_a_transfer(self, tier):
        self.plan.on(self.dirs[tier], Fault.corrupt(), opcode=OP_READ, times=1)

    @rule()
    def heal(self):
        self.plan.clear()
        self.clock.now += 1000  # past any back-off: failed tiers are probed and rejoin

    @precondition(lambda self: self.acked)
    @rule(data=st.data(), tier=st.integers(0, 1))
    def lose_a_file(self, data, tier):
        k = data.draw(st.sampled_from(sorted(self.acked)))
        path = self.engine.tiers[tier].layout.page_path(k)
        if os.path.exists(path):
            os.unlink(path)
            self.deleted.add(path)
        if not any(os.path.exists(t.layout.page_path(k)) for t in self.engine.tiers):
            self.lost.add(k)

    @rule()
    def restart(self):
        self.engine.close()
        self.open()

    @invariant()
    def index_agrees_with_acks(self):
        if self.engine is not None:
            for k in KEYS:
                if self.engine.contains(k):
                    assert k in self.acked


EngineModel.TestCase.settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_engine_model = EngineModel.TestCase
