"""The splits other systems use, as baselines: they ignore the objective and the links.

`even`: LinguaLinked's baseline, equal unit counts over all usable peers (source first, then
the cluster's order). `memory`: exo / llama.cpp style, unit counts in proportion to each
usable peer's memory (source first, then by memory, largest first). Both use every usable
peer (up to one per unit) and raise Infeasible when their split breaks a constraint.
"""

from __future__ import annotations

import math
from itertools import accumulate

from planner.constraints import violations
from planner.cost import capacity, usable_devices
from planner.errors import Infeasible
from planner.model import Cluster, Device, Stage, Workload


def _ring(cluster: Cluster, count: int, key=None) -> list[Device]:
    others = [d for d in usable_devices(cluster) if d.id != cluster.source]
    if key is not None:
        others.sort(key=key)
    return [cluster.device(cluster.source)] + others[: count - 1]


def _stages(cluster: Cluster, workload: Workload, peers: list[Device], counts: list[int],
            name: str) -> list[Stage]:
    bounds = [0, *accumulate(counts)]
    stages = [Stage(p.id, a, b) for p, a, b in zip(peers, bounds, bounds[1:], strict=False)]
    broken = violations(cluster, workload, stages)
    if broken:
        raise Infeasible(f"the {name} split does not fit: {broken[0]}")
    return stages


def even_split(cluster: Cluster, workload: Workload, objective: str) -> list[Stage]:
    units = len(workload.units)
    peers = _ring(cluster, units)
    share, extra = divmod(units, len(peers))
    counts = [share + (i < extra) for i in range(len(peers))]
    return _stages(cluster, workload, peers, counts, "even")


def proportional_counts(weights: list[float], total: int) -> list[int]:
    """Largest-remainder apportionment of `total` items (>= len(weights)), at least one each."""
    scale = sum(weights)
    quotas = [total * w / scale if scale > 0 else total / len(weights) for w in weights]
    counts = [max(1, math.floor(q)) for q in quotas]
    spots = range(len(weights))
    while sum(counts) < total:
        counts[max(spots, key=lambda i: quotas[i] - counts[i])] += 1
    while sum(counts) > total:
        counts[max((i for i in spots if counts[i] > 1), key=lambda i: counts[i] - quotas[i])] -= 1
    return counts


def memory_split(cluster: Cluster, workload: Workload, objective: str) -> list[Stage]:
    units = len(workload.units)
    peers = _ring(cluster, units, key=lambda d: -d.memory_available)
    counts = proportional_counts([capacity(cluster, p) for p in peers], units)
    return _stages(cluster, workload, peers, counts, "memory")
