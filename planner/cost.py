"""The cost model and the simulator that scores any plan with it (docs/planner.md).

Compute: a unit measured on a device (`Device.unit_s`) costs its measured seconds there;
any other unit its FLOPs x the device's seconds per FLOP; a stage adds the device's measured
overhead per step (`Device.stage_overhead_s`). All take the battery penalty.

Messages: every output is sent once to each other stage holding one of its consumers, and
everything stage a sends to stage b travels as one message over the direct link a -> b.
The message to the next stage (the hop) always exists, even with nothing to carry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.errors import InvalidInput
from planner.model import Cluster, Device, Link, Prediction, Stage, Unit, Workload


def exclusion(cluster: Cluster, device: Device) -> str | None:
    """Why `device` may not be used, or None when it may."""
    if device.load >= 1:
        return f"peer {device.id!r} is fully loaded (load {device.load:g})"
    battery = device.battery
    if device.on_battery and battery and battery.percent < cluster.battery_min_percent:
        return (
            f"peer {device.id!r} is on battery at {battery.percent:g}% "
            f"(below {cluster.battery_min_percent:g}%)"
        )
    return None


def usable_devices(cluster: Cluster) -> list[Device]:
    return [d for d in cluster.devices if exclusion(cluster, d) is None]


def battery_factor(cluster: Cluster, device: Device) -> float:
    return 1 + cluster.battery_penalty if device.on_battery else 1.0


def seconds_per_flop(cluster: Cluster, device: Device, prompt: bool = False) -> float:
    """Seconds per FLOP of a decode step's one row, or (`prompt`) of a prompt's rows."""
    rate = device.prompt_flops if prompt and device.prompt_flops > 0 else device.flops
    return battery_factor(cluster, device) / (rate * (1 - device.load))


@dataclass(frozen=True)
class ComputeTable:
    """One device's compute time of any unit range, from two prefix sums over the units:
    the FLOPs of the units not measured there, and the measured seconds of the others (a
    range without measured units costs exactly its FLOPs x seconds per FLOP); a stage adds
    the device's overhead per step."""

    flops: np.ndarray  # [U + 1]: FLOPs of the unmeasured units before each boundary
    measured: np.ndarray  # [U + 1]: measured seconds of the units before each boundary
    spf: float
    factor: float  # the battery penalty on measured seconds
    overhead: float  # of a stage, per step (battery penalty included)

    def between(self, start, stop):
        """Seconds of units start..stop-1 (numpy broadcasting over arrays of boundaries)."""
        return ((self.flops[stop] - self.flops[start]) * self.spf
                + (self.measured[stop] - self.measured[start]) * self.factor)

    def block(self, start, stop):
        """Seconds of a stage holding units start..stop-1: its units and its overhead."""
        return self.between(start, stop) + self.overhead

    def spans(self) -> np.ndarray:
        """[start, stop]: seconds of a stage of units start..stop-1 (meaningless on and
        below the diagonal)."""
        boundaries = np.arange(len(self.flops))
        return self.block(boundaries[:, None], boundaries[None, :])

    def prefix(self) -> np.ndarray:
        """[U + 1]: seconds of the units before each boundary."""
        return self.between(0, np.arange(len(self.flops)))

    @property
    def total(self) -> float:
        """Seconds of one stage holding every unit."""
        return float(self.block(0, len(self.flops) - 1))


def compute_table(cluster: Cluster, workload: Workload, device: Device) -> ComputeTable:
    timed = device.unit_s
    flops = [0.0 if u in timed else unit.flops for u, unit in enumerate(workload.units)]
    seconds = [timed.get(u, 0.0) for u in range(len(workload.units))]
    factor = battery_factor(cluster, device)
    return ComputeTable(np.concatenate([[0.0], np.cumsum(flops)]),
                        np.concatenate([[0.0], np.cumsum(seconds)]),
                        seconds_per_flop(cluster, device), factor,
                        device.stage_overhead_s * factor)


def check_measured(cluster: Cluster, workload: Workload) -> None:
    """InvalidInput for a measured time of a unit the workload lacks, one not > 0, or a
    stage overhead not >= 0."""
    for device in cluster.devices:
        if not (math.isfinite(device.stage_overhead_s) and device.stage_overhead_s >= 0):
            raise InvalidInput(f"peer {device.id!r}: the stage overhead must be >= 0 seconds, "
                               f"got {device.stage_overhead_s!r}")
        for u, seconds in device.unit_s.items():
            if not 0 <= u < len(workload.units):
                raise InvalidInput(f"peer {device.id!r} has a measured time for unit {u}; "
                                   f"the model has units 0-{len(workload.units) - 1}")
            if not (math.isfinite(seconds) and seconds > 0):
                raise InvalidInput(f"peer {device.id!r}: the measured time of unit {u} must be "
                                   f"a positive number of seconds, got {seconds!r}")


def fastest_seconds_per_flop(cluster: Cluster, workload: Workload, device: Device) -> float:
    """The least seconds per FLOP of any unit on the device: no unit it holds computes its
    FLOPs faster, so bounds built on it stay valid with measured times."""
    timed = device.unit_s
    factor = battery_factor(cluster, device)
    rates = [timed[u] * factor / unit.flops for u, unit in enumerate(workload.units)
             if u in timed and unit.flops > 0]
    if any(unit.flops > 0 and u not in timed for u, unit in enumerate(workload.units)):
        rates.append(seconds_per_flop(cluster, device))
    return min(rates, default=seconds_per_flop(cluster, device))


def capacity(cluster: Cluster, device: Device) -> float:
    """Bytes the planner may fill on `device`: beta x memory available."""
    return cluster.beta * device.memory_available


MEMORY_SLACK = 1e-9  # relative; absorbs float rounding when units fill a peer exactly


def fits(need: float, room: float) -> bool:
    return need <= room * (1 + MEMORY_SLACK)


def memory_need(cluster: Cluster, unit: Unit) -> float:
    """Weights plus the KV cache reserved for the cluster's context length."""
    return unit.weight_bytes + cluster.context * unit.kv_bytes_per_token


def link(cluster: Cluster, src: str, dst: str) -> Link:
    found = cluster.link(src, dst)
    if found is None:
        raise InvalidInput(f"the plan sends from {src!r} to {dst!r} but there is no such link")
    return found


def messages(workload: Workload, stages: Sequence[Stage]) -> dict[tuple[int, int], float]:
    """Bytes per token from stage a to stage b, for every pair (a, b) that exchanges a message."""
    stage_of = [s for s, stage in enumerate(stages) for _ in stage.units]
    sent: dict[tuple[int, int], float] = {(s, s + 1): 0.0 for s in range(len(stages) - 1)}
    for u, unit in enumerate(workload.units):
        for output in unit.outputs:
            for target in {stage_of[c] for c in output.consumers} - {stage_of[u]}:
                key = (stage_of[u], target)
                sent[key] = sent.get(key, 0.0) + output.bytes
    return sent


def stage_compute_s(cluster: Cluster, workload: Workload, stage: Stage) -> float:
    device = cluster.device(stage.peer)
    timed = device.unit_s
    flops = sum(workload.units[u].flops for u in stage.units if u not in timed)
    seconds = sum(timed[u] for u in stage.units if u in timed) + device.stage_overhead_s
    return flops * seconds_per_flop(cluster, device) + seconds * battery_factor(cluster, device)


def critical_path_s(cluster: Cluster, workload: Workload, stages: Sequence[Stage]) -> float:
    """Every stage's compute, every hop and the return, one after another: the latency when
    no stage waits for a residual message."""
    sent = messages(workload, stages)
    total = sum(stage_compute_s(cluster, workload, stage) for stage in stages)
    for s in range(len(stages) - 1):
        total += link(cluster, stages[s].peer, stages[s + 1].peer).transfer_s(sent[s, s + 1])
    if len(stages) > 1:
        total += link(cluster, stages[-1].peer, cluster.source).transfer_s(workload.return_bytes)
    return total


def simulate(cluster: Cluster, workload: Workload, stages: Sequence[Stage]) -> Prediction:
    """Latency of one token through the ring, and the pipeline's bottleneck and throughput."""
    compute = [stage_compute_s(cluster, workload, stage) for stage in stages]
    arrivals: list[list[float]] = [[0.0] for _ in stages]
    outgoing: list[list[tuple[int, float]]] = [[] for _ in stages]
    for (a, b), nbytes in messages(workload, stages).items():
        outgoing[a].append((b, nbytes))
    finish: list[float] = []
    link_loads: list[float] = []
    for a, stage in enumerate(stages):
        finish.append(max(arrivals[a]) + compute[a])
        for b, nbytes in outgoing[a]:
            hop = link(cluster, stage.peer, stages[b].peer)
            arrivals[b].append(finish[a] + hop.transfer_s(nbytes))
            link_loads.append(nbytes / hop.bandwidth_Bps)
    latency = finish[-1]
    if len(stages) > 1:
        back = link(cluster, stages[-1].peer, cluster.source)
        latency += back.transfer_s(workload.return_bytes)
        link_loads.append(workload.return_bytes / back.bandwidth_Bps)
    bottleneck = max(compute + link_loads)
    return Prediction(latency_s=latency, throughput_tps=1 / bottleneck, bottleneck_s=bottleneck)
