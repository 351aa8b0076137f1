"""The blocks (device, unit range) a stage of an optimal plan may hold: the MILP's columns.

A block must fit its device's memory, only the source's blocks start at unit 0, and a block
holding the last unit needs a link back to the source. Blocks
an optimal plan never needs are dropped, given an upper bound (the value of a known valid
plan) and the objective's lower bound (1 model time unit = lower bound / SCALE):

- throughput: a stage computes for at most the optimum, so at most the upper bound. When
  only compute matters (links can never bind), an optimal plan may also take every block as
  far as the bottleneck allows (growing a block only shortens the next), so a block that
  could grow by one unit within the lower bound is dropped.
- latency: the block's compute, plus the other units' compute at best, plus the hops into
  and out of the block, plus the return, must stay within the upper bound. "At best" puts
  the other units on the fastest other devices, each taking at most its memory times the
  densest unit's FLOPs per byte, at its fastest seconds per FLOP (measured units count at
  their measured seconds per FLOP, so the bound holds with measured times too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.cost import (
    MEMORY_SLACK,
    capacity,
    compute_table,
    fastest_seconds_per_flop,
    memory_need,
)
from planner.model import Cluster, Device, Workload

SCALE = 1000.0  # the objective's lower bound, in model units
PRUNE = 1 + 1e-9  # blocks costing up to the upper bound (times this) stay


@dataclass(frozen=True)
class Blocks:
    device: np.ndarray  # index into the device list
    start: np.ndarray
    stop: np.ndarray  # one past the last unit
    cost: np.ndarray  # compute, in model units


@dataclass(frozen=True)
class Bounds:
    """What pruning needs, in model units (seconds / tau)."""

    tau: float
    upper: float
    throughput: bool
    compute_bound: bool
    hop_floor: float  # the least latency of any link
    back: np.ndarray  # per device: latency of returning the result to the source (inf: no link)


def candidate_blocks(cluster: Cluster, workload: Workload, devices: list[Device],
                     bounds: Bounds) -> Blocks:
    flops = np.concatenate([[0.0], np.cumsum([u.flops for u in workload.units])])
    need = np.concatenate([[0.0], np.cumsum([memory_need(cluster, u) for u in workload.units])])
    span, load = flops[None, :] - flops[:, None], need[None, :] - need[:, None]
    first, stop = np.triu_indices(len(flops), k=1)
    fastest = [fastest_seconds_per_flop(cluster, workload, d) for d in devices]
    rooms = np.array([capacity(cluster, d) for d in devices]) * (1 + MEMORY_SLACK)
    rest = _RestCompute(flops, need, np.array(fastest) / bounds.tau, rooms)
    device, start, end, cost = [], [], [], []
    for d in range(len(devices)):
        compute = compute_table(cluster, workload, devices[d]).spans() / bounds.tau
        fits = load <= rooms[d]
        keep = fits[first, stop] & ((first == 0) == (d == 0))
        keep &= (stop < len(flops) - 1) | np.isfinite(bounds.back[d])  # the result goes home
        if bounds.throughput:
            keep &= _throughput_keep(compute, fits, first, stop, bounds)
        else:
            others = rest.least(d, flops[-1] - span[first, stop])
            keep &= _latency_keep(compute[first, stop] + others, first, stop, d, bounds,
                                  len(flops) - 1)
        device.append(np.full(keep.sum(), d))
        start.append(first[keep])
        end.append(stop[keep])
        cost.append(compute[first[keep], stop[keep]])
    return Blocks(*(np.concatenate(parts) for parts in (device, start, end, cost)))


def _throughput_keep(compute: np.ndarray, fits: np.ndarray, first: np.ndarray,
                     stop: np.ndarray, bounds: Bounds) -> np.ndarray:
    keep = compute[first, stop] <= bounds.upper * PRUNE
    if bounds.compute_bound:
        grows = np.zeros_like(fits)
        grows[:, :-1] = fits[:, 1:] & (compute[:, 1:] < SCALE * (1 - 1e-9))
        keep &= ~grows[first, stop]
    return keep


def _latency_keep(work: np.ndarray, first: np.ndarray, stop: np.ndarray, d: int,
                  bounds: Bounds, units: int) -> np.ndarray:
    hops = (first > 0).astype(float) + (stop < units)
    others = np.delete(bounds.back, [0, d]) if d else bounds.back[1:]
    back = np.where(stop == units, bounds.back[d], others.min(initial=np.inf))
    return work + hops * bounds.hop_floor + back <= bounds.upper * PRUNE


class _RestCompute:
    """The least compute the units outside a block could take on the other devices
    (`spf`: each device's fastest seconds per FLOP, in model units)."""

    def __init__(self, flops: np.ndarray, need: np.ndarray, spf: np.ndarray,
                 rooms: np.ndarray) -> None:
        unit_flops, unit_need = np.diff(flops), np.diff(need)
        dense = np.inf if (unit_need[unit_flops > 0] == 0).any() else max(
            (unit_flops[unit_need > 0] / unit_need[unit_need > 0]).max(initial=0.0), 0.0)
        self.spf, self.hold = spf, rooms * dense  # FLOPs each device could hold at most

    def least(self, d: int, work: np.ndarray) -> np.ndarray:
        order = [e for e in np.argsort(self.spf) if e != d and self.hold[e] > 0]
        if not order:
            return np.where(work > 0, np.inf, 0.0)
        hold, spf = self.hold[order], self.spf[order]
        if np.isinf(hold[0]):
            return work * spf[0]
        edges = np.concatenate([[0.0], np.cumsum(hold)])
        times = np.concatenate([[0.0], np.cumsum(hold * spf)])
        return np.where(work <= edges[-1] * PRUNE, np.interp(work, edges, times), np.inf)
