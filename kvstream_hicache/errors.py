"""Typed errors of the storage layer.

One rule per layer: the ring reports ``-errno`` per operation; the engine raises these only at
construction / configuration time, with a message that names the setting or path and the fix.
``put``/``get`` never raise for a per-page problem: they return False for that page and count it.
"""
from __future__ import annotations

import logging


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


def printable(value: object) -> object:
    """``value`` with every character a terminal would act on (a newline, an escape, a bell: not
    ``str.isprintable``) written as its escape (``\\n``, ``\\x1b``); anything not a string as is. Names
    listed in a tier are anyone's choice who may write there (a member of a shared tier's group): printed raw,
    one forged a line of the server's log or of ``kvstream check``'s output, or drove the operator's terminal."""
    if isinstance(value, str) and not value.isprintable():
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)
    return value


class PrintableArgs(logging.Filter):
    """The filter of kvstream's loggers (LOGGERS): every string or exception argument of a record
    :func:`printable` (the messages themselves are kvstream's own; what they name, a path found in a tier, is
    not; an exception's message may name one as it is). A logger's filter sees only the records made on that
    logger, not its children's: each logger has it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(printable(str(a) if isinstance(a, BaseException) else a) for a in record.args)
        return True


LOGGERS = ("kvstream", "kvstream.sglang")  # every logger kvstream logs on (PrintableArgs)
