"""Where a benchmark works: a directory it is given, or a temporary one."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path


def run_in(directory: str | None, bench: Callable[[Path], None]) -> None:
    """Run `bench` in `directory`, kept so that a rerun reuses what it made, or without one
    in a temporary directory removed afterwards."""
    if directory:
        bench(Path(directory))
        return
    with tempfile.TemporaryDirectory(prefix="peerd-bench-") as root:
        bench(Path(root))
