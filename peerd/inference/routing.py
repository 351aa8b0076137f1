"""Who sends which tensors to whom: the message routes of a split model.

Given a manifest's dependency maps and a split of its units into stages, each stage sends,
after every step, one message per consuming stage holding exactly the tensors that stage
needs: the sequential output goes to the next stage, residual outputs go straight to every
later stage that consumes them (never relayed through the stages in between), aggregated
per target and ordered nearest target first. Request inputs (producer -1) come from the head,
which is stage 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shards.manifest import REQUEST, Manifest


@dataclass(frozen=True)
class Route:
    """One message a stage sends every step: these tensors, to that stage."""

    target: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class StageRoutes:
    """What one stage sends after a step, and what it must receive before it can run one."""

    sends: tuple[Route, ...]
    expects: dict[int, tuple[str, ...]]  # source stage -> the tensors it sends here
    returns: tuple[str, ...]  # outputs consumed by the request itself (the logits)


def stage_of_units(ranges: Sequence[tuple[int, int]], unit_count: int) -> list[int]:
    """unit index -> stage index, checking that the ranges cover the units in order."""
    owner: list[int] = []
    for stage, (first, last) in enumerate(ranges):
        if first != len(owner) or last < first:
            raise ValueError(f"stage {stage} covers units {first}-{last}, expected {len(owner)}-")
        owner.extend([stage] * (last - first + 1))
    if len(owner) != unit_count:
        raise ValueError(f"stages cover {len(owner)} units, the model has {unit_count}")
    return owner


def routes(manifest: Manifest, ranges: Sequence[tuple[int, int]]) -> tuple[StageRoutes, ...]:
    owner = stage_of_units(ranges, len(manifest.units))
    sends: list[dict[int, list[str]]] = [{} for _ in ranges]
    returns: list[list[str]] = [[] for _ in ranges]
    for stage, (first, last) in enumerate(ranges):
        for name, consumers in manifest.stage_outputs(first, last).items():
            if REQUEST in consumers:
                returns[stage].append(name)
            for target in sorted({owner[c] for c in consumers if c != REQUEST}):
                sends[stage].setdefault(target, []).append(name)
        for name, producer in manifest.stage_inputs(first, last).items():
            if producer == REQUEST and stage != 0:
                sends[0].setdefault(stage, []).append(name)
    expects: list[dict[int, tuple[str, ...]]] = [{} for _ in ranges]
    for source, by_target in enumerate(sends):
        for target, names in by_target.items():
            expects[target][source] = tuple(names)
    return tuple(
        StageRoutes(
            sends=tuple(Route(t, tuple(sends[s][t])) for t in sorted(sends[s])),
            expects=expects[s],
            returns=tuple(returns[s]),
        )
        for s in range(len(ranges))
    )
