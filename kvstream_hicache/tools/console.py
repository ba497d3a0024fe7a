"""Terminal helpers shared by the package's commands and examples."""
from __future__ import annotations

import argparse
import os
import sys
import time


def missing_tiers(roots, option: str) -> str | None:
    """Why the tier directories ``roots`` (from ``option``) cannot be used as given, or None. The
    commands make their run directories inside the tiers and never a tier itself: a mistyped or
    unmounted path would otherwise be created and used on the file system below it."""
    for root in roots:
        if not os.path.isdir(root):
            return (f"{option}: tier {root} {'is not a directory' if os.path.exists(root) else 'does not exist'}: "
                    f"create it (mkdir -p {root}), mount it, or correct the path")
    return None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show each option's default in --help, except the empty ones (None, False, '')."""

    def _get_help_string(self, action):
        if action.default in (None, False, "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class Progress:
    """One progress line for a run of ``total`` steps. On a terminal it is redrawn in place (a bar
    and the caller's text, at most every ``interval`` seconds); elsewhere (logs, CI) it is printed
    as a line ``lines`` times over the run, and at the end."""

    WIDTH = 30  # bar characters

    def __init__(self, total: int, label: str = "", *, enabled: bool = True, stream=None,
                 lines: int = 10, interval: float = 0.2):
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.lines, self.interval = max(lines, 1), interval
        self.t0 = time.monotonic()
        self._drawn = float("-inf")  # when the bar was last drawn
        self._step = 0  # the last of the ``lines`` steps printed, when not on a terminal

    def eta(self, done: int) -> float:
        """Seconds left at the pace so far."""
        frac = min(done / self.total, 1.0)
        return (time.monotonic() - self.t0) / frac * (1 - frac) if frac else float("nan")

    def show(self, done: int, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        frac = min(done / self.total, 1.0)
        line = f"{self.label} {text}" if self.label else text
        if self.tty:
            now = time.monotonic()
            if not force and done < self.total and now - self._drawn < self.interval:
                return
            self._drawn = now
            filled = int(frac * self.WIDTH)
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {line}\033[K")
        elif int(frac * self.lines) > self._step or force:
            self._step = int(frac * self.lines)
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
