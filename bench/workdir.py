"""Where a benchmark works: a directory it is given, or a temporary one."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def run_in(directory: str | None, bench: Callable[[Path], T]) -> T:
    """Run `bench` in `directory`, kept so that a rerun reuses what it made, or without one
    in a temporary directory removed afterwards; what `bench` returns."""
    if directory:
        return bench(Path(directory))
    with tempfile.TemporaryDirectory(prefix="peerd-bench-") as root:
        return bench(Path(root))
