"""Quick bounds the exact methods start from: a valid lower bound, and quick plans.

Lower: for latency all the work on the fastest usable peer; for throughput the least T at
which the peers' largest blocks could cover the work (`planner.reach` is exact for compute
and memory, but limited in peers: this one is the fallback). Quick plans: the even and memory
baselines and EdgeShard's recurrence over three fixed peer orders (source first, then by
speed, by memory, or each next peer the one with the quickest link from the last); the best
valid one is the first incumbent.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from planner.baselines import even_split, memory_split
from planner.cost import (
    MEMORY_SLACK,
    capacity,
    compute_table,
    fastest_seconds_per_flop,
    memory_need,
    usable_devices,
)
from planner.dp import ordered_stages
from planner.errors import Infeasible
from planner.model import Cluster, Device, Stage, Workload


def lower_bound(cluster: Cluster, workload: Workload, objective: str) -> float:
    usable = usable_devices(cluster)
    if objective == "latency":  # every unit on the peer where it is quickest
        return float(np.min([_unit_seconds(cluster, workload, d) for d in usable],
                            axis=0).sum())
    flops = sum(u.flops for u in workload.units)
    speeds = [1 / fastest_seconds_per_flop(cluster, workload, d) for d in usable]
    return _windows_bound(cluster, workload, flops / sum(speeds))


def _unit_seconds(cluster: Cluster, workload: Workload, device: Device) -> np.ndarray:
    return np.diff(compute_table(cluster, workload, device).prefix())


def _windows_bound(cluster: Cluster, workload: Workload, low: float) -> float:
    """The least bottleneck T at which the peers' largest blocks could cover all the flops:
    each peer's largest contiguous block costing <= T that fits its memory (the source's
    must start at unit 0), summed over peers, must reach the total. (The FLOPs only weigh the
    units: blocks partition them whatever each unit costs, so this holds with measured
    times.)"""
    flops = np.concatenate([[0.0], np.cumsum([u.flops for u in workload.units])])
    need = np.concatenate([[0.0], np.cumsum([memory_need(cluster, u) for u in workload.units])])
    peers = [(compute_table(cluster, workload, d), capacity(cluster, d) * (1 + MEMORY_SLACK),
              d.id == cluster.source) for d in usable_devices(cluster)]

    def covered(limit: float) -> float:
        total = 0.0
        for table, room, source in peers:
            seconds, starts = table.prefix(), np.arange(1 if source else len(flops) - 1)
            end = np.minimum(
                np.searchsorted(seconds, seconds[starts] + limit - table.overhead, "right"),
                np.searchsorted(need, need[starts] + room, "right")) - 1
            total += (flops[np.maximum(end, starts)] - flops[starts]).max()
        return total

    high = max(table.total for table, _, _ in peers)
    enough = flops[-1] * (1 - 1e-12)  # sums of differences of prefix sums round
    if covered(high) < enough:
        return low
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (low, middle) if covered(middle) >= enough else (middle, high)
    return low * (1 - 1e-9)


def _nearest_first(cluster: Cluster, source: Device, others: list[Device]) -> list[Device]:
    """From the source, each next peer is the one with the quickest link from the last."""
    order, last, left = [], source, list(others)
    while left:
        latency = {d.id: link.latency_s if (link := cluster.link(last.id, d.id)) else math.inf
                   for d in left}
        last = min(left, key=lambda d: latency[d.id])
        order.append(last)
        left.remove(last)
    return order


def quick_plans(cluster: Cluster, workload: Workload, objective: str) -> list[list[Stage]]:
    """The plans of the baselines and of the fixed-order recurrences (some may be invalid)."""
    source = cluster.device(cluster.source)
    others = [d for d in usable_devices(cluster) if d.id != cluster.source]
    orders = [sorted(others, key=lambda d: compute_table(cluster, workload, d).total),
              sorted(others, key=lambda d: -d.memory_available),
              _nearest_first(cluster, source, others)]
    makers: list[Callable[[], list[Stage] | None]] = [
        lambda: even_split(cluster, workload, objective),
        lambda: memory_split(cluster, workload, objective),
        *(lambda order=order: ordered_stages(cluster, workload, objective, [source, *order])
          for order in orders),
    ]
    plans = []
    for make in makers:
        try:
            stages = make()
        except Infeasible:
            continue
        if stages:
            plans.append(stages)
    return plans
