"""EdgeShard's dynamic programs: Algorithm 1 (latency) and Algorithm 2 (throughput).

As published they see sequential hops only: the bytes unit i-1 hands to unit i at a stage
boundary, plus the result's return to the source; residual messages are ignored while
solving, and the plan is scored by the full simulator afterwards. The state is EdgeShard's
(units placed, set of devices used, device holding the last stage); the first stage is on the
source. Algorithm 1 adds compute and hop times, Algorithm 2 takes their maximum (the pipeline
bottleneck). Tracking the device set keeps each device to one contiguous stage, so the
result is optimal for this sequential model; the cost is exponential in the number of peers.

`ordered_stages` runs the same recurrence with the devices' order fixed (any may be skipped),
which is polynomial; the MILP uses it for its upper bound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import numpy as np

from planner.constraints import violations
from planner.cost import MEMORY_SLACK, capacity, compute_table, memory_need, usable_devices
from planner.errors import Infeasible, PlannerError
from planner.model import Cluster, Device, Stage, Workload

MAX_PEERS = 10

# state -> (best cost by units placed, previous device, previous cut)
Key = TypeVar("Key", bound=Hashable)
Table = dict[Key, tuple[np.ndarray, np.ndarray, np.ndarray]]


class _Tables:
    """Stage and hop costs for every device (pair) and unit range, in seconds (inf: not allowed)."""

    def __init__(self, cluster: Cluster, workload: Workload, objective: str,
                 devices: list[Device]) -> None:
        self.cluster, self.devices = cluster, devices
        self.latency = objective == "latency"
        self.units = len(workload.units)
        need = np.concatenate(
            [[0.0], np.cumsum([memory_need(cluster, u) for u in workload.units])]
        )
        upper = np.triu(np.ones((self.units + 1,) * 2, dtype=bool), k=1)
        self.compute = []
        for d in devices:
            room = capacity(cluster, d) * (1 + MEMORY_SLACK)
            fits = upper & (need[None, :] - need[:, None] <= room)
            self.compute.append(
                np.where(fits, compute_table(cluster, workload, d).spans(), np.inf)
            )
        self.sequential = np.zeros(self.units + 1)
        for u, unit in enumerate(workload.units):
            self.sequential[u + 1] = sum(o.bytes for o in unit.outputs if u + 1 in o.consumers)
        self.return_bytes = workload.return_bytes
        self.size = self.units + 1

    def combine(self, a, b):
        return np.add(a, b) if self.latency else np.maximum(a, b)

    def _cost(self, d: int, e: int, nbytes) -> float | np.ndarray:
        link = self.cluster.link(self.devices[d].id, self.devices[e].id)
        if link is None:
            return np.inf
        return nbytes / link.bandwidth_Bps + (link.latency_s if self.latency else 0.0)

    def relax(self, cost: np.ndarray, d: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Best cost of ending a new stage on e at each boundary after d's stage, and its cut."""
        hop = np.broadcast_to(self._cost(d, e, self.sequential), (self.size,)).copy()
        hop[[0, self.units]] = np.inf  # a hop falls strictly inside the units
        reach = self.combine(self.combine(cost, hop)[:, None], self.compute[e])
        return reach.min(axis=0), reach.argmin(axis=0)

    def back(self, d: int) -> float:
        """Cost of returning the result from device d to the source (device 0)."""
        return 0.0 if d == 0 else float(self._cost(d, 0, self.return_bytes))

    def start(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.compute[0][0].copy(), np.full(self.size, -1), np.zeros(self.size, dtype=int)

    def merge(self, table: Table[Key], key: Key, value: np.ndarray, cut: np.ndarray,
              d: int) -> None:
        old, prev_dev, prev_cut = table.get(
            key, (np.full(self.size, np.inf), np.full(self.size, -1), np.zeros(self.size, int)))
        better = value < old
        table[key] = (np.where(better, value, old), np.where(better, d, prev_dev),
                      np.where(better, cut, prev_cut))


def _stages(t: _Tables, table: Table[Key], device_of: Callable[[Key], int],
            previous: Callable[[Key, int], Key]) -> list[Stage] | None:
    """Walk back from the best final state; None when no state reaches the last unit."""
    finals = {key: t.combine(cost[t.units], t.back(device_of(key)))
              for key, (cost, _, _) in table.items()}
    key = min(finals, key=lambda k: finals[k], default=None)
    if key is None or not np.isfinite(finals[key]):
        return None
    stages, stop = [], t.units
    while True:
        _, prev_dev, prev_cut = table[key]
        d = device_of(key)
        start = int(prev_cut[stop]) if prev_dev[stop] >= 0 else 0
        stages.append(Stage(t.devices[d].id, start, stop))
        if prev_dev[stop] < 0:
            return stages[::-1]
        key, stop = previous(key, int(prev_dev[stop])), start


def _ring(cluster: Cluster) -> list[Device]:
    return [cluster.device(cluster.source)] + [
        d for d in usable_devices(cluster) if d.id != cluster.source
    ]


def solve_dp(cluster: Cluster, workload: Workload, objective: str) -> list[Stage]:
    """EdgeShard's plan for `objective`; Infeasible if none fits or it needs a missing link."""
    devices = _ring(cluster)
    if len(devices) > MAX_PEERS:
        raise PlannerError(
            f"dp enumerates sets of peers and handles at most {MAX_PEERS} usable peers "
            f"(this cluster has {len(devices)}); use the milp solver"
        )
    t = _Tables(cluster, workload, objective, devices)
    table: Table[tuple[int, int]] = {(1, 0): t.start()}
    for mask in range(1, 1 << len(devices), 2):  # sets holding the source; supersets come later
        for d in range(len(devices)):
            if (mask, d) not in table:
                continue
            cost = table[mask, d][0]
            for e in range(1, len(devices)):
                if not mask >> e & 1:
                    value, cut = t.relax(cost, d, e)
                    if np.isfinite(value).any():
                        t.merge(table, (mask | 1 << e, e), value, cut, d)
    stages = _stages(t, table, lambda key: key[1],
                     lambda key, d: (key[0] & ~(1 << key[1]), d))
    if stages is None:
        raise Infeasible("no plan fits: dp found no contiguous split that respects every memory")
    broken = violations(cluster, workload, stages)
    if broken:
        raise Infeasible(f"the dp plan (sequential hops only) breaks what it does not model: "
                         f"{broken[0]}")
    return stages


def ordered_stages(cluster: Cluster, workload: Workload, objective: str,
                   devices: list[Device]) -> list[Stage] | None:
    """The best sequential-model stages using `devices` in this order, the first (the source)
    always and any other possibly skipped; None when nothing fits."""
    t = _Tables(cluster, workload, objective, devices)
    table: Table[int] = {0: t.start()}
    for e in range(1, len(devices)):
        for d in range(e):
            if d not in table:
                continue
            value, cut = t.relax(table[d][0], d, e)
            if np.isfinite(value).any():
                t.merge(table, e, value, cut, d)
    return _stages(t, table, lambda key: key, lambda key, d: d)
