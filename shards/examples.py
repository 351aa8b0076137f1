"""Example inputs for each unit, produced by running the units before it.

Export runs every unit on a few cases, each a (new tokens T, cached positions P) pair: three
small ones whose differences tell which axes of every tensor follow T and which follow P (the
dynamic axes of the ONNX graph), a 128-token prefill and a one-token decode for measuring
FLOPs and message sizes. A unit's outputs in each case become the inputs of the units that
read them, so the whole model never has to run at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shards.config import ModelConfig
from shards.segment import REQUEST_INPUTS, UnitGraph

# The traced example avoids T or P of 0 and 1, which torch.export would specialise on.
EXPORT, MORE_TOKENS, MORE_PAST = "export", "more_tokens", "more_past"
PREFILL, DECODE = "prefill", "decode"
PROFILE_CONTEXT = 128


@dataclass(frozen=True)
class Case:
    tokens: int
    past: int


def cases(config: ModelConfig) -> dict[str, Case]:
    context = min(PROFILE_CONTEXT, config.max_positions // 2)
    return {
        EXPORT: Case(3, 4),
        MORE_TOKENS: Case(4, 4),
        MORE_PAST: Case(3, 5),
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
        ids = torch.randint(0, self.config.vocab_size, (1, case.tokens), generator=generator)
        positions = torch.arange(case.past, case.past + case.tokens)[None]
        return dict(zip(REQUEST_INPUTS, (ids, positions), strict=True))

    def inputs(self, unit: UnitGraph, case: str) -> tuple[torch.Tensor, ...]:
        """The unit's positional inputs for `case` (random K/V of the case's past length)."""
        past = self.cases[case].past
        shape = (1, self.config.num_kv_heads, past, self.config.head_dim)
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
    """Which axes of a tensor follow the new tokens (T) and the cached positions (P)."""

    tokens: tuple[int, ...]
    past: tuple[int, ...]


def dynamic_axes(shapes: dict[str, torch.Size]) -> Axes:
    """Compare one tensor's shape across the EXPORT, MORE_TOKENS and MORE_PAST cases."""
    base = shapes[EXPORT]
    tokens = tuple(a for a, d in enumerate(base) if shapes[MORE_TOKENS][a] != d)
    past = tuple(a for a, d in enumerate(base) if shapes[MORE_PAST][a] != d)
    return Axes(tokens, past)
