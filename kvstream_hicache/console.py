"""Terminal helpers shared by the package's commands and examples."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show each option's default in --help, except the empty ones (None, False, '')."""

    def _get_help_string(self, action):
        if action.default in (None, False, "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)
