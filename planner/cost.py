"""The cost model and the simulator that scores any plan with it (docs/planner.md).

Messages: every output is sent once to each other stage holding one of its consumers, and
everything stage a sends to stage b travels as one message over the direct link a -> b.
The message to the next stage (the hop) always exists, even with nothing to carry.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def seconds_per_flop(cluster: Cluster, device: Device) -> float:
    penalty = 1 + cluster.battery_penalty if device.on_battery else 1.0
    return penalty / (device.flops * (1 - device.load))


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
    flops = sum(workload.units[u].flops for u in stage.units)
    return flops * seconds_per_flop(cluster, cluster.device(stage.peer))


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
