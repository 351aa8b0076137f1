"""Shared pytest fixtures.

`toy` is the hand-built three-unit ONNX model of tests/toy_units.py: (its numpy reference,
its manifest, the directory of its unit files).

`hf_checkpoint(family, **overrides)` returns the directory of a small random Hugging Face
checkpoint (see tests/checkpoints.py). Building one takes about half a second, so the
directories are built once per test session and shared, keyed by family and overrides:
treat them as read-only (copy one with shutil.copytree before changing it).

The suite runs on two pytest-xdist workers (`pytest -n 2 --dist loadgroup`, as the README
says). The tests that start daemons or browse mDNS run one after another on one worker
(group DAEMONS): two clusters at once would see each other's peers and count them as
strangers. The other tests share out over both workers, so the daemon tests run beside a
busy core, as they must pass on a loaded machine anyway. Both workers share one state
directory for the models they export (tests/run_state.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import run_state
from checkpoints import make_checkpoint
from toy_units import ToyModel, write_toy

DAEMONS = "daemons"  # the xdist group of the tests that start daemons or browse mDNS
_RUN_STATE = pytest.StashKey[Path | None]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RUN_STATE] = run_state.begin()  # before xdist starts the workers


def pytest_unconfigure(config: pytest.Config) -> None:
    run_state.end(config.stash.get(_RUN_STATE, None))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("cluster") or item.get_closest_marker("mdns"):
            item.add_marker(pytest.mark.xdist_group(DAEMONS))


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


@pytest.fixture(scope="session")
def long_answers(hf_checkpoint, tmp_path_factory):
    """A 4-layer llama without an end-of-sequence token (every answer runs its full length)
    and 2048 positions (a plan's K/V reserve holds four long answers at once), a directory
    for clusters, four prompts and their reference answers (tests/streaming.py)."""
    from sharding import reference
    from streaming import NEW_TOKENS, PROMPTS

    model_dir = hf_checkpoint("llama", layers=4, max_position_embeddings=2048,
                              eos_token_id=None)
    root = tmp_path_factory.mktemp("survival")
    expected = {tuple(p): reference(model_dir, tuple(p), NEW_TOKENS, stop_at_eos=True)[0]
                for p in PROMPTS}
    assert all(len(answer) == NEW_TOKENS for answer in expected.values())
    return model_dir, root, expected, PROMPTS
