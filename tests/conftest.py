"""Shared pytest fixtures.

`toy` is the hand-built three-unit ONNX model of tests/toy_units.py: (its numpy reference,
its manifest, the directory of its unit files).

`hf_checkpoint(family, **overrides)` returns the directory of a small random Hugging Face
checkpoint (see tests/checkpoints.py). Building one takes about half a second, so the
directories are built once per test session and shared, keyed by family and overrides:
treat them as read-only (copy one with shutil.copytree before changing it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from checkpoints import make_checkpoint
from toy_units import ToyModel, write_toy


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    built: dict[tuple, Path] = {}

    def get(family: str, **overrides: Any) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in built:
            built[key] = make_checkpoint(tmp_path_factory.mktemp("hf"), family, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("toy")
    model = ToyModel()
    return model, write_toy(directory, model), directory
