"""The Tier health state machine (tiers.py), driven by a fake clock over a real directory: which errors
fail a tier, the back-off between probes (doubling, capped, reset on recovery), the forced probe of a
read that has no other holder, and a vanished directory looked for every LOOK_S."""
from __future__ import annotations

import errno
import os

import pytest

from helpers import FakeClock
from kvstream_hicache.layout import TierLayout
from kvstream_hicache.tiers import LOOK_S, MAX_RETRY_S, Tier

RETRY_S = 10.0  # long beside LOOK_S: a rejoin within a look is not the back-off


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def rejoined():
    """The tiers the health machine handed to on_rejoin, in order."""
    return []


@pytest.fixture
def tier(tier_root, clock, rejoined):
    os.makedirs(TierLayout(tier_root, "ns").base)
    return Tier(0, tier_root, "ns", None, (0o600, 0o700), "never", RETRY_S, "token", clock,
                on_rejoin=rejoined.append)


def _break_probe(tier: Tier) -> None:
    """The probe's file cannot be created: ``<tier>/kvstream/tmp`` is a regular file now."""
    os.rmdir(tier.layout.tmp)
    with open(tier.layout.tmp, "w"):
        pass


def _mend_probe(tier: Tier) -> None:
    os.unlink(tier.layout.tmp)
    os.mkdir(tier.layout.tmp)


def test_a_page_error_does_not_fail_the_tier(tier):
    for err in (errno.ENOENT, errno.ENOSPC, errno.EDQUOT, errno.EINVAL):
        assert tier.fail(err, "open a page") is False
    assert tier.healthy and tier.failures == 0 and tier.usable()


@pytest.mark.parametrize("err", [errno.EIO, errno.EROFS, errno.EACCES, errno.ESTALE, errno.ENOTCONN])
def test_a_tier_error_fails_it_once(tier, err):
    assert tier.fail(err, "read") is True
    assert tier.fail(err, "read again") is True  # still failed: counted as one change of state
    assert not tier.healthy and tier.failures == 1
    assert tier.last_error == f"read again: {os.strerror(err)}"


def test_a_failed_tier_is_probed_when_its_back_off_expires_and_rejoins(tier, clock, rejoined):
    tier.fail(errno.EIO, "read")
    clock.advance(RETRY_S * 0.99)
    assert not tier.usable() and len(rejoined) == 0  # not due: no probe
    clock.advance(RETRY_S * 0.02)
    assert tier.usable() and tier.healthy
    assert len(rejoined) == 1  # the index is reconciled before the tier takes writes again
    assert tier.usable() and len(rejoined) == 1  # healthy: no probe, no second rejoin


def test_a_tier_that_rejoins_shows_no_error_as_current(tier, clock, rejoined):
    """stats()'s last_error is why the tier is failed: kept after it rejoined, an operator saw an error long
    healed as the state of a healthy tier (its failures count and the log keep the past ones)."""
    tier.fail(errno.EIO, "read")
    assert tier.last_error == f"read: {os.strerror(errno.EIO)}"
    clock.advance(RETRY_S * 1.01)
    assert tier.usable() and len(rejoined) == 1
    assert tier.last_error == "" and tier.failures == 1


def test_the_back_off_doubles_after_each_failed_probe_and_resets_on_recovery(tier, clock, rejoined):
    tier.fail(errno.EIO, "read")
    _break_probe(tier)
    waits = []
    for _ in range(4):  # failed probes at +1, +2, +4, +8 after the one before
        wait = RETRY_S * 2 ** len(waits)
        clock.advance(wait * 0.99)
        assert not tier.usable()
        clock.advance(wait * 0.02)
        assert not tier.usable() and tier.last_error.startswith("probe")
        waits.append(wait)
    _mend_probe(tier)
    clock.advance(RETRY_S * 2 ** len(waits) * 1.001)
    assert tier.usable() and len(rejoined) == 1
    tier.fail(errno.EIO, "read")  # a new failure starts from the first back-off again
    clock.advance(RETRY_S * 1.01)
    assert tier.usable() and tier.failures == 2


def test_the_back_off_never_drops_below_tier_retry(tier_root, clock):
    """tier_retry above the 300 s cap (600): the back-off after a failed probe stays 600 s, not 300."""
    os.makedirs(TierLayout(tier_root, "ns").base)
    tier = Tier(0, tier_root, "ns", None, (0o600, 0o700), "never", 2 * MAX_RETRY_S, "token", clock, on_rejoin=lambda t: None)
    tier.fail(errno.EIO, "read")
    _break_probe(tier)
    clock.advance(2 * MAX_RETRY_S * 1.001)
    assert not tier.usable() and tier.last_error.startswith("probe")  # probed, failed: the back-off again
    clock.advance(2 * MAX_RETRY_S * 0.99)
    _mend_probe(tier)
    assert not tier.usable(), "probed again before tier_retry passed"
    clock.advance(2 * MAX_RETRY_S * 0.02)
    assert tier.usable()


def test_the_back_off_is_capped(tier, clock):
    tier.fail(errno.EIO, "read")
    _break_probe(tier)
    for _ in range(12):  # 1, 2, 4, ... would pass MAX_RETRY_S by the tenth
        clock.advance(MAX_RETRY_S)
        assert not tier.usable()
    _mend_probe(tier)
    clock.advance(MAX_RETRY_S * 1.001)
    assert tier.usable()


def test_a_read_with_no_other_holder_forces_a_probe_at_most_every_look(tier, clock, rejoined):
    tier.fail(errno.EIO, "read")
    _break_probe(tier)
    clock.advance(RETRY_S * 1.01)
    assert not tier.usable()  # back-off now 2 s
    assert not tier.usable(now=True)  # forced, fails
    _mend_probe(tier)
    clock.advance(LOOK_S / 2)
    assert not tier.usable(now=True)  # forced again too soon: no probe
    clock.advance(LOOK_S / 2 + 0.01)
    assert tier.usable(now=True) and len(rejoined) == 1  # well before the back-off's 2 s


def test_a_vanished_directory_is_looked_for_every_look_and_rejoins_when_back(tier, clock, rejoined):
    aside = tier.layout.base + ".away"
    os.rename(tier.layout.base, aside)
    assert tier.fail(errno.ENOENT, "open a page") is True  # ENOENT fails the tier when its directory went
    assert tier.gone() and not tier.healthy
    clock.advance(LOOK_S * 1.01)
    assert not tier.usable()  # looked (one stat): still gone
    os.rename(aside, tier.layout.base)
    clock.advance(LOOK_S / 2)
    assert not tier.usable()  # the next look is not due yet
    clock.advance(LOOK_S / 2 + 0.01)
    assert tier.usable() and len(rejoined) == 1  # back within a second, not after the back-off
