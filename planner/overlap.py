"""The overlap plan (LinguaLinked Eq. 6-7): movable copies of ring neighbours' boundary units.

Each stage may keep copies of the last units of the stage before it and of the first units of
the stage after it, so that a rebalance can move a boundary without shipping weights. Eq. 6:
maximise the bytes kept as copies (plus one per unit, so weightless units count too). Eq. 7:
a stage's own units and its copies fit in beta x its memory, KV for the context included, and
its holdings stay one contiguous range. Every unit is copied by at most one neighbour, and
every stage keeps at least one unit nobody copies, so any set of moves leaves no stage empty.
The ring's wrap (last stage -> source) moves no boundary: unit 0 stays on the source.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.cost import MEMORY_SLACK, capacity, memory_need
from planner.mip import Mip
from planner.model import Cluster, Stage, Workload

Copies = tuple[np.ndarray, np.ndarray]  # (units, their binary variables)


def movable_units(cluster: Cluster, workload: Workload,
                  stages: Sequence[Stage]) -> tuple[tuple[int, ...], ...]:
    """Per stage, the neighbours' units it should keep as movable copies (ascending)."""
    count = len(stages)
    if count == 1:
        return ((),)
    need = np.array([memory_need(cluster, u) for u in workload.units])
    m = Mip()
    tails = [_copies(m, stages[s - 1], tail=True) if s > 0 else _none() for s in range(count)]
    heads = [_copies(m, stages[s + 1], tail=False) if s + 1 < count else _none()
             for s in range(count)]
    for s, stage in enumerate(stages):
        room = capacity(cluster, cluster.device(stage.peer)) * (1 + MEMORY_SLACK)
        units, variables = _join(tails[s], heads[s])
        m.row(variables, need[units], hi=room - need[stage.start:stage.stop].sum())
        _, away = _join(heads[s - 1] if s > 0 else _none(),
                        tails[s + 1] if s + 1 < count else _none())
        m.row(away, np.ones(len(away)), hi=len(stage.units) - 1)
    gain = {int(v): workload.units[u].weight_bytes + 1
            for units, variables in tails + heads for u, v in zip(units, variables, strict=True)}
    x = m.solve(gain, maximize=True).x
    assert x is not None  # keeping no copy is always feasible
    kept = [_join(tails[s], heads[s]) for s in range(count)]
    return tuple(tuple(int(u) for u, v in zip(*pair, strict=True) if x[v] > 0.5)
                 for pair in kept)


def _none() -> Copies:
    return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


def _join(a: Copies, b: Copies) -> Copies:
    return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])


def _copies(m: Mip, neighbour: Stage, tail: bool) -> Copies:
    """Binary copy choices over `neighbour`'s units, nested so the copies are its tail (head)."""
    units = np.arange(neighbour.start, neighbour.stop)
    chosen = m.binaries(len(units))
    inner, outer = (chosen[:-1], chosen[1:]) if tail else (chosen[1:], chosen[:-1])
    m.rows(np.stack([inner, outer], axis=-1), [1, -1], hi=0)
    return units, chosen
