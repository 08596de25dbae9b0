"""The one exception type for mistakes a user can fix (bad config, data, checkpoint or environment), and the
checks that every layer shares.

The CLI prints it as a single line, without a traceback; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import NoReturn


class UserError(Exception):
    """A problem with the user's input. The message says what was wrong and what to do instead."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser for Cohort's own commands (prepare, export, consolidate): what it refuses (a missing or
    unknown argument, a value of the wrong type) is a UserError, one line, instead of the usage and an error."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message} ({self.prog} --help lists its arguments)")


def check_ranges(section: str, rules: dict[str, tuple[bool, str]], values: dict[str, object]) -> None:
    """A UserError naming the first setting whose rule does not hold: ``rules`` maps a name to (holds, what it
    must be), ``values`` holds the values as given."""
    for name, (holds, requirement) in rules.items():
        if not holds:
            raise UserError(f"{section}.{name}={values[name]!r} must be {requirement}: change it in the config or on "
                            "the command line")


def check_writable_folder(folder: Path, what: str) -> Path:
    """A UserError unless ``folder`` is, or can be made as, a writable folder; creates nothing. Returns the nearest
    folder that exists (``folder`` itself or a parent), where its files will go."""
    broken = next((parent for parent in (folder, *folder.parents) if parent.is_symlink() and not parent.exists()), None)
    if broken is not None:
        raise UserError(f"the {what} {folder} cannot be made: {broken} is a symbolic link to {os.readlink(broken)}, "
                        "which does not exist: remove the link or make its target")
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    if not existing.is_dir():
        raise UserError(f"the {what} {folder} cannot be made: {existing} is a file, not a folder: point it at a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"the {what} {folder} cannot be written: {existing} is not writable (permissions or a "
                        "read-only file system): point it at a writable folder")
    return existing
