"""A randomized model test (hypothesis stateful testing): random puts, gets, restarts, injected I/O
errors and corruption (through the ring's FaultyRing hook), tiers vanishing and coming back, and
pages damaged on disk, checked against a plain dict. The two promises:

* never a wrong byte: a page reported found holds exactly the bytes that were put;
* never a lost acknowledged page while a replica survives: a page whose put returned True is found
  whenever a tier that is present, and not faulted in this step, holds a valid copy of it.

"A valid copy" is observed on disk (header and payload checked against the model) after each put;
copies leave the model's set only when the test damages them. An invariant checks that no valid
copy on a present tier ever disappears behind the test's back (no wrongful deletion).
Deterministic in CI: derandomized, no example database; small enough to run in seconds.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstream_hicache.faults import Fault
from kvstream_hicache.integrity import HeaderError, read_header
from kvstream_hicache.io import OP_READ, OP_WRITE
from kvstream_hicache.layout import HEADER_SIZE

from helpers import (NS, FakeClock, TierFaultPlan, content, flip_byte, get_items, key, make_engine,
                                 put_items, wait_until)

# The machine damages copies on disk and restarts the engine in between (restart closes a store it
# damaged on purpose); the_store_agrees_with_its_disk allows exactly those problems, and teardown requires
# check() == [] after check(fix=True).
pytestmark = pytest.mark.leaves_problems("restart closes an engine whose copies the test damaged on purpose")
SCRATCH = os.environ.get("KVSTREAM_TEST_DIR", "/var/tmp")
N_TIERS = 3
N_KEYS = 10
SIZES = [8192, 40 << 10, 12_345, 65_536, 4096 * 3 + 1, 24_576, 100, 57_344, 33_333, 16_384]
KEYS = [key(i, "model") for i in range(N_KEYS)]
DATA = {k: content(k, SIZES[i]) for i, k in enumerate(KEYS)}
ALIGNED = {k: SIZES[i] % 8192 == 0 for i, k in enumerate(KEYS)}
FAULTS = {
    "read_eio": (Fault.error(errno.EIO), OP_READ),
    "read_corrupt": (Fault.corrupt(), OP_READ),
    "write_eio": (Fault.error(errno.EIO), OP_WRITE),
    "write_corrupt": (Fault.corrupt(), OP_WRITE),
}
AFTER_BACKOFF_S = 1000.0  # > the longest back-off: every step probes failed tiers again

key_lists = st.lists(st.sampled_from(range(N_KEYS)), min_size=1, max_size=5)
faults = st.none() | st.tuples(st.integers(0, N_TIERS - 1), st.sampled_from(sorted(FAULTS)))


def _valid_copy(path: str, k: str) -> bool:
    try:
        header, st = read_header(path)
        size = st.st_size
        with open(path, "rb") as f:
            f.seek(HEADER_SIZE)
            payload = f.read(len(DATA[k]))
    except (OSError, HeaderError):
        return False
    return header.digest == NS.digest and header.key == k and header.length == len(DATA[k]) \
        and payload == DATA[k]


class StoreModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="kvstream-model-", dir=SCRATCH)
        self.dirs = [os.path.join(self.root, f"tier{t}") for t in range(N_TIERS)]
        for d in self.dirs:
            os.makedirs(d)
        self.clock = FakeClock()
        self.plan = TierFaultPlan()
        self.model: dict[str, bytes] = {}  # acknowledged pages
        self.copies: dict[str, set[int]] = {k: set() for k in KEYS}  # tiers holding a valid copy
        self.away: set[int] = set()  # tiers whose directory is moved away
        self.engine = self._open()

    def _open(self):
        return make_engine(self.dirs, clock=self.clock, fault_plan=self.plan, tier_retry=1.0)

    def _path(self, t: int, k: str) -> str:
        return self.engine.tiers[t].layout.page_path(k)

    def _arm(self, fault) -> int | None:
        if fault is None:
            return None
        t, kind = fault
        f, opcode = FAULTS[kind]
        self.plan.on(self.dirs[t], f, opcode=opcode)
        return t

    def _disarm(self) -> None:
        """End the step's fault: clear it, then wait for every write job in flight at that moment to
        end. A background replication copy (replication.py) the step started under the fault ends
        under it, in this step: a tier it fails, a corrupt copy it commits, are this step's doing,
        not a later step's, whose put would otherwise meet a tier failed behind its back."""
        self.plan.clear()
        jobs = self.engine._writes.jobs.active
        started = [job for tier_jobs in list(jobs) for job in list(tier_jobs)]
        wait_until(lambda: not any(job in tier_jobs for tier_jobs in jobs for job in started), 30,
                   "a write job of the step never ended")

    # -- operations ----------------------------------------------------------------------------
    @rule(picks=key_lists, fault=faults)
    def put(self, picks, fault):
        keys = [KEYS[i] for i in picks]
        self.clock.advance(AFTER_BACKOFF_S)
        faulted = self._arm(fault)
        try:
            stored = put_items(self.engine, [(k, DATA[k], ALIGNED[k]) for k in keys])
        finally:
            self._disarm()
        writable = [t for t in range(N_TIERS) if t not in self.away and t != faulted]
        for k, ok in zip(keys, stored):
            if ok:
                self.model[k] = DATA[k]
            else:
                assert not writable, f"put of {k[:8]} failed with tiers {writable} writable"
            for t in range(N_TIERS):
                if t not in self.away and _valid_copy(self._path(t, k), k):
                    self.copies[k].add(t)

    @rule(picks=key_lists, fault=faults)
    def get(self, picks, fault):
        keys = [KEYS[i] for i in picks]
        self.clock.advance(AFTER_BACKOFF_S)
        faulted = self._arm(fault)
        try:
            found, got = get_items(self.engine, [(k, len(DATA[k]), ALIGNED[k]) for k in keys])
        finally:
            self._disarm()
        for k, ok, data in zip(keys, found, got):
            if ok:
                assert k in self.model, f"{k[:8]} found but never acknowledged"
                assert data == DATA[k], f"{k[:8]}: wrong bytes served"
            elif k in self.model:
                alive = [t for t in self.copies[k] if t not in self.away and t != faulted]
                assert not alive, f"{k[:8]} missed while tiers {alive} hold a valid copy"

    @precondition(lambda self: not self.away)
    @rule()
    def restart(self):
        self.engine.close()
        self.engine = self._open()
        assert self.engine.wait_scan(30)  # the model's disk rules hold once the start-up scan has run

    @precondition(lambda self: len(self.away) < N_TIERS)
    @rule(t=st.integers(0, N_TIERS - 1))
    def tier_vanishes(self, t):
        if t not in self.away:
            os.rename(self.dirs[t], self.dirs[t] + ".away")
            self.away.add(t)

    # Draws never depend on state observed from the disk: which copies a read quarantines depends
    # on routing, i.e. on timing, and hypothesis needs the same draws when it replays a case.
    @precondition(lambda self: self.away)
    @rule(t=st.integers(0, N_TIERS - 1))
    def tier_returns(self, t):
        t = sorted(self.away)[t % len(self.away)]
        os.rename(self.dirs[t] + ".away", self.dirs[t])
        self.away.discard(t)

    @rule(i=st.integers(0, N_KEYS - 1), t=st.integers(0, N_TIERS - 1))
    def damage_a_copy(self, i, t):
        k = KEYS[i]
        if t not in self.copies[k] or t in self.away:
            return
        flip_byte(self._path(t, k), HEADER_SIZE + len(DATA[k]) // 2, 0x04)
        self.copies[k].discard(t)

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def valid_copies_are_never_deleted(self):
        for k, tiers in self.copies.items():
            for t in tiers - self.away:
                assert os.path.exists(self._path(t, k)), f"valid copy of {k[:8]} on tier {t} vanished"

    @invariant()
    def the_store_agrees_with_its_disk(self):
        """With every tier present, the engine's own check finds problems only on copies the test
        knows to be invalid (damaged, or corrupted in a faulted write): never a valid copy that the
        index forgot, a leftover or a stray file."""
        if self.away:
            return
        valid = {self._path(t, k) for k, tiers in self.copies.items() for t in tiers}
        for problem in self.engine.check():
            assert problem.path not in valid and problem.kind in ("corrupt", "damaged", "index_stale"), problem

    def teardown(self):
        try:
            self.engine.close()
            for t in sorted(self.away):
                os.rename(self.dirs[t] + ".away", self.dirs[t])
            self.away.clear()
            with self._open() as engine:  # after a restart with every tier back: nothing lost
                self.engine = engine
                for k in self.model:
                    if self.copies[k]:
                        (ok,), (data,) = get_items(engine, [(k, len(DATA[k]), ALIGNED[k])])
                        assert ok and data == DATA[k], f"{k[:8]} lost with a valid copy on {self.copies[k]}"
                engine.check(fix=True)  # damaged copies not read yet
                assert engine.check() == []
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


StoreModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreModel = StoreModel.TestCase
