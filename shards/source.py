"""Where a model comes from: a Hugging Face checkpoint directory or a GGUF file.

`open_model(path)` is the one place that tells the two apart. Everything that reads a
model goes through the `ModelSource` it returns: `shards.config.load_config` (its config),
`shards.checkpoint.load_tensors`/`materialize` (its tensors, named and laid out as in a
Hugging Face checkpoint, so that `checkpoint.param_sources` serves both) and the shard
cache's content digest. Opening a source reads nothing yet, and this module does not
import torch: the daemon names its model through it.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from shards.config import WEIGHTS_FILE, WEIGHTS_INDEX, ModelConfig, read_checkpoint_config
from shards.gguf.file import is_gguf

if TYPE_CHECKING:
    import torch


class ModelSource(ABC):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    @abstractmethod
    def name(self) -> str:
        """What the model is called where people see it (the directory or file name)."""

    @abstractmethod
    def config(self) -> ModelConfig:
        """The validated config; ModelError with a one-line reason if the model is unusable."""

    @abstractmethod
    def digest(self) -> str:
        """sha256 over everything that decides the model: equal digests, equal models."""

    @abstractmethod
    def read_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Just the named tensors (Hugging Face checkpoint names and layouts), float32."""


def open_model(model: str | Path | ModelSource) -> ModelSource:
    """The source of the model at `model` (a source passes through unchanged)."""
    if isinstance(model, ModelSource):
        return model
    if is_gguf(model):
        from shards.gguf.model import GGUFModel

        return GGUFModel(model)
    return CheckpointDirectory(model)


class CheckpointDirectory(ModelSource):
    """`config.json`, `generation_config.json` and safetensors weights (one file or sharded)."""

    @property
    def name(self) -> str:
        return self.path.name

    def config(self) -> ModelConfig:
        return read_checkpoint_config(self.path)

    def digest(self) -> str:
        """sha256 over config.json and every weight file of the checkpoint."""
        digest = hashlib.sha256()
        for path in [self.path / "config.json", *self._weight_files()]:
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
        return digest.hexdigest()

    def _weight_files(self) -> list[Path]:
        index = self.path / WEIGHTS_INDEX
        if not index.is_file():
            return [self.path / WEIGHTS_FILE]
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [index, *(self.path / name for name in shards)]

    def read_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from shards.checkpoint import read_safetensors

        return read_safetensors(self.path, names)
