"""What a stage's tensor-parallel shares are, torch-free: the split of every layer
(shards.share_split), the share units' files and ONNX names, and the pre-norms the runner
computes on its rows (peerd.inference.shares). shards.share_units writes them.

The connective blocks (pre-norms, residual adds) are numpy `Norm`s: they act on each row
alone, so each share computes them on its own rows; float32 numpy computes the formula of
the torch module (RMSNorm's x / sqrt(mean(x^2) + eps), LayerNorm's biased variance), equal
to within float32 rounding of the sums (~1e-7 relative).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shards.manifest import Unit, UnitFile
from shards.share_split import Share

ATTN, MLP = "attn", "mlp"
HIDDEN = ".hidden"  # shards.segment names a unit's sequential output "<unit>.hidden"
NORMED, PARTIAL = "normed", "partial"
PAST, PRESENT = ("past_k", "past_v"), ("present_k", "present_v")


@dataclass(frozen=True)
class Norm:
    """A pre-norm, for numpy: LayerNorm with a bias, RMSNorm without."""

    weight: np.ndarray
    bias: np.ndarray | None
    eps: float

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.bias is None:
            return self.weight * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.eps))
        centred = x - x.mean(-1, keepdims=True)
        variance = np.mean(centred * centred, -1, keepdims=True)
        return centred / np.sqrt(variance + self.eps) * self.weight + self.bias


@dataclass(frozen=True)
class ShareUnit:
    """One exported share unit: `path` takes `inputs` and gives `outputs` (ONNX names)."""

    layer: int
    half: str  # ATTN or MLP
    share: int
    path: Path
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    files: tuple[UnitFile, ...] = ()  # as written: the model, then its data file


@dataclass(frozen=True)
class ShareUnits:
    """Every layer's share units, its pre-norms, and how the residual branch starts."""

    shares: tuple[Share, ...]
    weights: tuple[float, ...]
    units: dict[tuple[int, str, int], ShareUnit]  # by (layer, half, share)
    norms: dict[tuple[int, str], Norm]  # by (layer, half)
    residual_post_norm: bool  # BLOOM: the residual is the normed hidden state

    def unit(self, layer: int, half: str, share: int) -> ShareUnit:
        return self.units[(layer, half, share)]


def step_inputs(unit: Unit) -> list[str]:
    """The per-step tensors an attention unit of the manifest reads (all its inputs but the
    hidden state), in its order."""
    return [i.name for i in unit.inputs if not i.name.endswith(HIDDEN)]
