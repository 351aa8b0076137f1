"""How a layer is split among N shares of a tensor-parallel group, by their speeds.

Attention splits by KV-head group (one KV head and the num_heads / num_kv_heads query heads
that read it; one head for a model without grouped-query attention), the MLP by blocks of
intermediate columns (the largest of 64, 32, ..., 1 dividing intermediate_size that leaves
every share a block), and the step's rows (positions) for the connective blocks by the same
weights. Each share gets a contiguous range, sized in grains by largest-remainder rounding
of the weights, and at least one grain of attention and of the MLP (rows may be none: a
one-row decode step has one share do its connective part, the largest weight, the first
of equals).

Pure functions over dataclasses, torch-free: the planner sizes shares with them too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shards.config import ModelConfig

COLUMN_BLOCKS = (64, 32, 16, 8, 4, 2, 1)


class ShareError(ValueError):
    """A split that cannot be made: more shares than grains, or bad weights."""


@dataclass(frozen=True)
class Span:
    """A contiguous range [start, stop)."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class LayerShape:
    """What the split of a layer depends on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @classmethod
    def of(cls, config: ModelConfig) -> LayerShape:
        return cls(config.num_heads, config.num_kv_heads, config.head_dim,
                   config.intermediate_size)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class Share:
    """One share of a layer: its KV heads, the query heads that read them, its MLP columns."""

    index: int
    kv_heads: Span
    heads: Span
    columns: Span


def split_layer(shape: LayerShape, weights: Sequence[float]) -> tuple[Share, ...]:
    """The shares of a layer for one share per weight (relative speeds)."""
    count = len(weights)
    kv = apportion(shape.num_kv_heads, weights, "KV-head groups")
    block = column_block(shape.intermediate_size, count)
    blocks = apportion(shape.intermediate_size // block, weights, "MLP column blocks")
    return tuple(
        Share(i, kv_span, Span(kv_span.start * shape.group, kv_span.stop * shape.group),
              Span(col.start * block, col.stop * block))
        for i, (kv_span, col) in enumerate(zip(kv, blocks, strict=True))
    )


def column_block(intermediate_size: int, count: int) -> int:
    """The MLP grain: the largest of COLUMN_BLOCKS dividing intermediate_size into at least
    `count` blocks."""
    for block in COLUMN_BLOCKS:
        if intermediate_size % block == 0 and intermediate_size // block >= count:
            return block
    raise ShareError(f"{count} shares exceed the {intermediate_size} MLP columns")


def split_rows(rows: int, weights: Sequence[float]) -> tuple[Span, ...]:
    """The step's rows each share computes the connective blocks of (some may get none)."""
    return _spans(_largest_remainder(rows, _checked(weights)))


def apportion(grains: int, weights: Sequence[float], what: str) -> tuple[Span, ...]:
    """`grains` in contiguous spans proportional to `weights`, at least one each."""
    weights = _checked(weights)
    if len(weights) > grains:
        raise ShareError(f"{len(weights)} shares exceed the {grains} {what} of a layer")
    counts = _largest_remainder(grains, weights)
    quotas = _quotas(grains, weights)
    for empty in [i for i, c in enumerate(counts) if c == 0]:
        donor = max((i for i, c in enumerate(counts) if c > 1),
                    key=lambda i: counts[i] - quotas[i])
        counts[donor] -= 1
        counts[empty] = 1
    return _spans(counts)


def _checked(weights: Sequence[float]) -> list[float]:
    if not weights:
        raise ShareError("a split needs at least one share")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ShareError(f"share weights must be positive numbers, not {list(weights)}")
    return [float(w) for w in weights]


def _quotas(total: int, weights: list[float]) -> list[float]:
    return [total * w / sum(weights) for w in weights]


def _largest_remainder(total: int, weights: list[float]) -> list[int]:
    """Hamilton's method: floors of the quotas, the rest one each to the largest remainders
    (ties to the first)."""
    quotas = _quotas(total, weights)
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _spans(counts: list[int]) -> tuple[Span, ...]:
    bounds = [0, *itertools.accumulate(counts)]
    return tuple(Span(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True))

