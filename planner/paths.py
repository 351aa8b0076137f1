"""The cost model as tables over unit boundaries, for the exact latency search.

It applies when every residual output (one with a consumer other than the next unit) comes
from unit 0, which always sits on the source: the rotary tables and masks of every model
`peerd shard` makes. Then only three kinds of message exist, and a plan's latency follows
from its blocks alone (docs/planner.md):

- the hop from the source's block [0, p) to the next stage, carrying the sequential output
  of unit p - 1 and every output of unit 0 the next block reads (`first_hop`);
- the hop between two other stages at boundary k, carrying unit k - 1's output (`hop`);
- unit 0's message to any later stage that reads one of its outputs, which leaves when the
  source finishes (`residual`: its transfer time; -inf where the block reads none).

Devices are indexed with the source first. Blocks are stored as bands: `block[d, j, w]` is
the compute of d's block of units j..j+w-1 (inf where it does not fit or runs past the end).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.cost import MEMORY_SLACK, capacity, compute_table, memory_need, usable_devices
from planner.model import Cluster, Device, Workload

INF = np.inf


@dataclass(frozen=True)
class PathModel:
    devices: list[Device]
    units: int
    block: np.ndarray  # (D, U + 1, W + 1) compute of a block, by start and width
    hop: np.ndarray  # (D, D, U + 1) d's block ends at k, e's starts there (d, e not the source)
    first_hop: np.ndarray  # (D, U + 1, W + 1) source's block [0, p) to e's block [p, p + w)
    residual: np.ndarray  # (D, U + 1, W + 1) unit 0's message to e's block [j, j + w)
    back: np.ndarray  # (D,) the result's return from a final stage on d (0 on the source)

    @property
    def width(self) -> int:
        return self.block.shape[2] - 1


def follows_unit_zero(workload: Workload) -> bool:
    """Whether every output of a unit after the first goes to the next unit only (or nowhere)."""
    return all(o.consumers in ((), (u + 1,))
               for u, unit in enumerate(workload.units) if u > 0 for o in unit.outputs)


def ring(cluster: Cluster) -> list[Device]:
    """The usable devices, the source first."""
    return [cluster.device(cluster.source)] + [
        d for d in usable_devices(cluster) if d.id != cluster.source
    ]


def path_model(cluster: Cluster, workload: Workload) -> PathModel:
    devices = ring(cluster)
    units = len(workload.units)
    block = block_costs(cluster, workload, devices)
    latency, per_byte = _links(cluster, devices)
    sent, reads = _unit_zero_reads(workload, block.shape[2] - 1)
    handed = np.zeros(units + 1)  # bytes unit k - 1 hands unit k, for k >= 2
    for u, unit in enumerate(workload.units[1:], start=1):
        handed[u + 1] = sum(o.bytes for o in unit.outputs if o.consumers)
    hop = latency[:, :, None] + handed[None, None, :] * per_byte[:, :, None]
    hop[0], hop[:, 0] = INF, INF
    hop[:, :, :2], hop[:, :, units] = INF, INF
    first = np.where(np.arange(units + 1) >= 2, handed, 0.0)[:, None] + sent
    first_hop = latency[0, :, None, None] + first[None] * per_byte[0, :, None, None]
    first_hop[:, 0] = INF
    residual = np.where(reads[None], latency[0, :, None, None]
                        + sent[None] * per_byte[0, :, None, None], -INF)
    back = latency[:, 0] + workload.return_bytes * per_byte[:, 0]
    back[0] = 0.0
    return PathModel(devices, units, block, _finite(hop), _finite(first_hop),
                     _finite(residual), _finite(back))


def _finite(table: np.ndarray) -> np.ndarray:
    """A message over a missing link (nan) costs inf."""
    return np.where(np.isnan(table), INF, table)


def block_costs(cluster: Cluster, workload: Workload, devices: list[Device]) -> np.ndarray:
    """[d, j, w]: the compute of d's block of units j..j+w-1; inf where it does not fit."""
    units = len(workload.units)
    need = np.concatenate([[0.0], np.cumsum([memory_need(cluster, u) for u in workload.units])])
    rooms = np.array([capacity(cluster, d) for d in devices]) * (1 + MEMORY_SLACK)
    starts = np.arange(units + 1)
    longest = [int((np.searchsorted(need, need + room, "right") - 1 - starts).max())
               for room in rooms]
    width = max(max(longest), 1)
    stop = starts[:, None] + np.arange(width + 1)[None, :]
    inside = stop <= units
    stop = np.minimum(stop, units)
    load = need[stop] - need[:, None]
    block = np.full((len(devices), units + 1, width + 1), INF)
    for d, device in enumerate(devices):
        ok = inside & (load <= rooms[d])
        compute = compute_table(cluster, workload, device).block(starts[:, None], stop)
        block[d] = np.where(ok, compute, INF)
    block[:, :, 0] = INF
    return block


def _links(cluster: Cluster, devices: list[Device]) -> tuple[np.ndarray, np.ndarray]:
    """Latency and seconds per byte per ordered pair of devices; nan where there is no link."""
    count = len(devices)
    latency, per_byte = np.full((count, count), np.nan), np.full((count, count), np.nan)
    for a, src in enumerate(devices):
        for b, dst in enumerate(devices):
            found = cluster.link(src.id, dst.id) if a != b else None
            if found is not None:
                latency[a, b], per_byte[a, b] = found.latency_s, 1 / found.bandwidth_Bps
    return latency, per_byte


def _unit_zero_reads(workload: Workload, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block [j, j + w): the bytes of unit 0's outputs it reads, and whether it reads any."""
    units = len(workload.units)
    starts = np.arange(units + 1)[:, None]
    stops = np.minimum(starts + np.arange(width + 1)[None, :], units)
    sent, reads = np.zeros(stops.shape), np.zeros(stops.shape, bool)
    for output in workload.units[0].outputs if units else ():
        if not output.consumers:
            continue
        consumers = np.array(output.consumers)
        later = np.searchsorted(consumers, starts)  # first consumer at or after j
        first = consumers[np.minimum(later, len(consumers) - 1)]
        hit = (later < len(consumers)) & (first < stops)
        sent += np.where(hit, output.bytes, 0.0)
        reads |= hit
    return sent, reads
