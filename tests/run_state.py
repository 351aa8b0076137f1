"""One state directory for the whole test run, shared by every pytest-xdist worker.

tests/conftest.py makes it before the workers start and removes it after they end; its path
travels to them in the environment. The models that tests/sharding.py exports live there,
so a model that both workers need is exported once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

VARIABLE = "PEERD_TEST_STATE_DIR"


def begin() -> Path | None:
    """Make the run's directory, unless this process inherited one; the one made, if any."""
    if VARIABLE in os.environ:
        return None
    path = Path(tempfile.mkdtemp(prefix="peerd-test-state-"))
    os.environ[VARIABLE] = str(path)
    return path


def end(made: Path | None) -> None:
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def shared() -> Path | None:
    value = os.environ.get(VARIABLE)
    return Path(value) if value else None
