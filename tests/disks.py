"""Small real filesystems for tests of a full disk: a tmpfs mounted for a block (needs root),
resized, or filled to the last byte."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted on `directory` (created) for the block; skips without root."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                   check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def resize(directory: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(directory)], check=True)


def fill(path: Path) -> None:
    """Write `path` until its filesystem has no byte left."""
    block = b"\0" * 4096
    with path.open("wb", buffering=0) as ballast, contextlib.suppress(OSError):
        while True:
            ballast.write(block)
    assert shutil.disk_usage(path.parent).free < len(block), "the filesystem is not full"
