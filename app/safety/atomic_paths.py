"""Putting a file, link or folder in place of another so that a crash leaves the old one or the new one (checkpoints,
their ``last.ckpt`` link, an export), and removing one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_path(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``: atomically unless either is a real folder (files and links rename over each
    other); a folder is renamed aside first, so a crash between the two renames leaves the previous checkpoint as
    ``NAME.old``."""
    nothing_there = not target.exists() and not target.is_symlink()
    if nothing_there or not (is_real_folder(source) or is_real_folder(target)):
        os.replace(source, target)
        return
    previous = target.with_name(f"{target.name}.old")
    remove_path(previous)
    os.replace(target, previous)
    os.replace(source, target)
    remove_path(previous)


def remove_path(path: Path) -> None:
    """Delete a file, a link (not what it points to) or a folder, if there is one."""
    if is_real_folder(path):
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def is_real_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()
