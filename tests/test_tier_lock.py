"""No I/O under Tier._lock: a probe and the rescan of a rejoining tier (on_rejoin) run outside it, so
a thread asking about the tier's health meanwhile is never held behind a slow file system."""
from __future__ import annotations

import errno
import os

from kvstream_hicache import tmpfiles
from kvstream_hicache.tiers import Tier


def test_a_rejoining_tier_is_rescanned_outside_its_lock(tier_root):
    os.makedirs(os.path.join(tier_root, "kvstream"))
    seen = []
    answers = []

    def on_rejoin(tier: Tier) -> None:
        seen.append(tier._lock.locked())
        if not seen[-1]:  # (held, as before, these calls would wait for ever)
            answers.append(tier.usable())  # another caller meanwhile: answered (not yet healthy), not held
            answers.append(tier.fail(errno.EIO, "a second failure"))  # accounted without waiting

    token = tmpfiles.register()
    try:
        tier = Tier(0, tier_root, "0" * 32, None, (0o600, 0o700), "never", 5.0, token, lambda: 0.0, on_rejoin)
        assert tier.fail(errno.EIO, "read x")
        assert tier.usable(now=True) is False  # the probe passed, but the tier failed again during it
        assert seen == [False] and answers == [False, True]
        assert "a second failure" in tier.last_error
    finally:
        tmpfiles.release(token)


def test_a_probe_that_passes_brings_the_tier_back(tier_root):
    os.makedirs(os.path.join(tier_root, "kvstream"))
    token = tmpfiles.register()
    rejoined = []
    try:
        tier = Tier(0, tier_root, "0" * 32, None, (0o600, 0o700), "never", 5.0, token, lambda: 0.0, rejoined.append)
        tier.fail(errno.EIO, "read x")
        assert not tier.healthy and tier.usable(now=True) and tier.healthy and rejoined == [tier]
    finally:
        tmpfiles.release(token)
