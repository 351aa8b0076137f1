"""Example inputs for each unit, produced by running the units before it.

Export runs every unit on a few cases, each a (new tokens T, cached positions P, sequences
B) triple: four small ones whose differences tell which axes of every tensor follow T, P and
B (the dynamic axes of the ONNX graph), a 128-token prefill and a one-token decode of one
sequence for measuring FLOPs and message sizes. A unit's outputs in each case become the
inputs of the units that read them, so the whole model never has to run at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shards.config import ModelConfig
from shards.segment import REQUEST_INPUTS, UnitGraph

# The traced example avoids T, P or B of 0 and 1, which torch.export would specialise on.
EXPORT, MORE_TOKENS, MORE_PAST, MORE_SEQUENCES = "export", "more_tokens", "more_past", "more_seq"
PREFILL, DECODE = "prefill", "decode"
PROFILE_CONTEXT = 128


@dataclass(frozen=True)
class Case:
    tokens: int
    past: int
    batch: int = 1


def cases(config: ModelConfig) -> dict[str, Case]:
    context = min(PROFILE_CONTEXT, config.max_positions // 2)
    return {
        EXPORT: Case(3, 4, 2),
        MORE_TOKENS: Case(4, 4, 2),
        MORE_PAST: Case(3, 5, 2),
        MORE_SEQUENCES: Case(3, 4, 3),
        PREFILL: Case(context, 0),
        DECODE: Case(1, context),
    }


class ExampleStore:
    """Tensors flowing between units for every case, dropped once their last reader ran."""

    def __init__(self, config: ModelConfig, consumers: dict[str, tuple[int, ...]]) -> None:
        self.config = config
        self.cases = cases(config)
        self.consumers = consumers
        self._values: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.cases}
        generator = torch.Generator().manual_seed(0)
        for name, case in self.cases.items():
            self._values[name].update(self._request(case, generator))

    def _request(self, case: Case, generator: torch.Generator) -> dict[str, torch.Tensor]:
        shape = (case.batch, case.tokens)
        ids = torch.randint(0, self.config.vocab_size, shape, generator=generator)
        positions = torch.arange(case.past, case.past + case.tokens).expand(shape)
        return dict(zip(REQUEST_INPUTS, (ids, positions), strict=True))

    def inputs(self, unit: UnitGraph, case: str) -> tuple[torch.Tensor, ...]:
        """The unit's positional inputs for `case` (random K/V of the case's past length)."""
        past, batch = self.cases[case].past, self.cases[case].batch
        shape = (batch, self.config.num_kv_heads, past, self.config.head_dim)
        generator = torch.Generator().manual_seed(unit.index)
        states = [torch.randn(shape, generator=generator) for _ in unit.state]
        return (*(self._values[case][name] for name in unit.inputs), *states)

    def record(self, unit: UnitGraph, case: str, outputs: tuple[torch.Tensor, ...]) -> None:
        """Keep what later units read; forget what no unit after this one needs."""
        values = self._values[case]
        values.update(zip(unit.outputs, outputs[: len(unit.outputs)], strict=True))
        for name in list(values):
            if name in self.consumers and max(self.consumers[name]) <= unit.index:
                del values[name]


@dataclass(frozen=True)
class Axes:
    """Which axes of a tensor follow the new tokens (T), the cached positions (P) and the
    sequences (B)."""

    tokens: tuple[int, ...]
    past: tuple[int, ...]
    batch: tuple[int, ...]


def dynamic_axes(shapes: dict[str, torch.Size]) -> Axes:
    """Compare one tensor's shape across the EXPORT case and the three that differ from it
    in one size."""
    base = shapes[EXPORT]

    def following(case: str) -> tuple[int, ...]:
        return tuple(a for a, d in enumerate(base) if shapes[case][a] != d)

    return Axes(following(MORE_TOKENS), following(MORE_PAST), following(MORE_SEQUENCES))
