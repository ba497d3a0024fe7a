"""Typed errors of the storage layer.

One rule per layer: the ring reports ``-errno`` per operation; the engine raises these only at
construction / configuration time, with a message that names the setting or path and the fix.
``put``/``get`` never raise for a per-page problem: they return False for that page and count it.
"""
from __future__ import annotations


class KVStreamError(Exception):
    """Base class of every error raised by kvstream_hicache."""


class ConfigError(KVStreamError, ValueError):
    """A setting is missing, malformed or unusable; the message names the setting and the fix."""


class TierError(ConfigError):
    """A tier directory cannot be used (missing, unwritable, no O_DIRECT)."""


class InvalidKeyError(KVStreamError, ValueError):
    """A page key that could escape the tier directory or is not a valid key."""


class EngineClosedError(KVStreamError, RuntimeError):
    """The engine was used after close()."""
