"""The least bottleneck any plan reaches when only compute and memory count, with a plan that
reaches it: a lower bound on the throughput objective (messages only add to a bottleneck),
and the optimum itself whenever that plan's messages stay below it.

For a bottleneck T each peer's block from boundary j reaches as far as T and its memory
allow, ext_d(j), which never decreases with j. So the farthest boundary a set S of peers
covers after the source's block [0, ext_source(0)) is

    reach(S) = max over d in S of ext_d(reach(S - {d})),

a DP over the subsets of the other peers, by size; T is feasible when reach(all) = U. The
least feasible T is the cost of some block: bisection over the sorted block costs finds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.cost import usable_devices
from planner.model import Cluster, Stage, Workload
from planner.paths import block_costs, ring

MAX_PEERS = 17  # the source and 16 others: 65536 subsets


@dataclass(frozen=True)
class Reach:
    bottleneck: float  # the least largest stage compute over all plans
    stages: list[Stage]  # a plan whose largest stage compute is that


def least_compute_bottleneck(cluster: Cluster, workload: Workload) -> Reach | None:
    """None when no split fits memory, or with more than MAX_PEERS usable peers."""
    if len(usable_devices(cluster)) > MAX_PEERS:
        return None
    devices = ring(cluster)
    cost = block_costs(cluster, workload, devices)[:, :, 1:]  # [peer, start, width - 1]
    dp = _SubsetDP(len(devices) - 1, len(workload.units))
    candidates = np.unique(cost[np.isfinite(cost)])
    if not len(candidates) or dp.reach(cost, candidates[-1]) is None:
        return None
    lo, hi = 0, len(candidates) - 1  # candidates[hi] is feasible
    while lo < hi:
        middle = (lo + hi) // 2
        feasible = dp.reach(cost, candidates[middle]) is not None
        lo, hi = (lo, middle) if feasible else (middle + 1, hi)
    blocks = dp.reach(cost, candidates[hi])
    assert blocks is not None  # candidates[hi] is feasible
    return Reach(float(candidates[hi]), [Stage(devices[d].id, a, b) for d, a, b in blocks])


class _SubsetDP:
    """reach() over the subsets of `others` peers (peer i + 1 is bit i), layer by layer."""

    def __init__(self, others: int, units: int) -> None:
        self.others, self.units = others, units
        sets = np.arange(1 << others)
        sizes = np.zeros(len(sets), np.int64)
        for bit in range(others):
            sizes += (sets >> bit) & 1
        self.layers = []
        for size in range(1, others + 1):
            layer = sets[sizes == size]
            bits = np.nonzero(((layer[:, None] >> np.arange(others)) & 1).astype(bool))[1]
            self.layers.append((layer, bits.reshape(len(layer), size)))

    def reach(self, cost: np.ndarray, limit: float) -> list[tuple[int, int, int]] | None:
        """The blocks (peer, start, stop) of a plan with no block costing more than `limit`,
        or None when there is none."""
        starts = np.arange(self.units + 1)
        ext = starts + (cost <= limit).sum(axis=2)  # [peer, start]
        far = np.zeros(1 << self.others, np.int64)
        last = np.full(1 << self.others, -1)
        far[0] = ext[0, 0]
        if far[0] == 0:
            return None  # the source cannot hold unit 0
        for layer, bits in self.layers:
            options = ext[bits + 1, far[layer[:, None] ^ (1 << bits)]]
            best = options.argmax(axis=1)
            far[layer] = options[np.arange(len(layer)), best]
            last[layer] = bits[np.arange(len(layer)), best]
        if far[-1] < self.units:
            return None
        return self._blocks(far, last)

    def _blocks(self, far: np.ndarray, last: np.ndarray) -> list[tuple[int, int, int]]:
        blocks, subset = [], len(far) - 1
        while subset:
            bit = int(last[subset])
            before = subset ^ (1 << bit)
            if far[subset] > far[before]:
                blocks.append((bit + 1, int(far[before]), int(far[subset])))
            subset = before
        return [(0, 0, int(far[0]))] + blocks[::-1]
