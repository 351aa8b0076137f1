"""What a plan must satisfy, and the shortfalls that rule out every plan before solving."""

from __future__ import annotations

from collections.abc import Sequence

from planner.cost import capacity, exclusion, fits, memory_need, messages, usable_devices
from planner.errors import Infeasible
from planner.model import Cluster, Stage, Workload


def size(nbytes: float) -> str:
    """Bytes for people: '9.1 GB', '312.0 MB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def violations(cluster: Cluster, workload: Workload, stages: Sequence[Stage]) -> list[str]:
    """Every constraint `stages` breaks, as one line each; empty when the plan is valid."""
    if not stages:
        return ["the plan has no stages"]
    found = _shape_violations(cluster, workload, stages)
    if found:
        return found
    for stage in stages:
        device = cluster.device(stage.peer)
        reason = exclusion(cluster, device)
        if reason:
            found.append(f"{reason} but holds units")
        need = sum(memory_need(cluster, workload.units[u]) for u in stage.units)
        if not fits(need, capacity(cluster, device)):
            found.append(
                f"peer {stage.peer!r} needs {size(need)} for units {stage.start}-{stage.stop - 1} "
                f"but offers {size(capacity(cluster, device))} at beta {cluster.beta:g}"
            )
    pairs = [(stages[a].peer, stages[b].peer) for a, b in messages(workload, stages)]
    if len(stages) > 1:
        pairs.append((stages[-1].peer, cluster.source))
    found += [f"no link {a!r} -> {b!r} for a message" for a, b in pairs if not cluster.link(a, b)]
    return found


def _shape_violations(cluster: Cluster, workload: Workload, stages: Sequence[Stage]) -> list[str]:
    found = []
    if stages[0].peer != cluster.source:
        found.append(f"the first stage is on {stages[0].peer!r}, not the source {cluster.source!r}")
    peers = [stage.peer for stage in stages]
    if len(set(peers)) < len(peers):
        found.append("a peer holds more than one stage")
    found += [f"unknown peer {p!r}" for p in peers if p not in {d.id for d in cluster.devices}]
    bounds = [0] + [stage.stop for stage in stages]
    if [stage.start for stage in stages] != bounds[:-1] or bounds[-1] != len(workload.units):
        found.append(f"stages do not cover units 0-{len(workload.units) - 1} in order")
    found += [f"stage on {s.peer!r} holds no units" for s in stages if s.stop <= s.start]
    return found


def require_feasible(cluster: Cluster, workload: Workload) -> None:
    """Raise Infeasible naming the shortfall when no plan can exist, whatever the solver."""
    usable = usable_devices(cluster)
    if not usable:
        raise Infeasible(
            "no usable peers: every peer is fully loaded or on battery below "
            f"{cluster.battery_min_percent:g}%"
        )
    source = cluster.device(cluster.source)
    reason = exclusion(cluster, source)
    if reason:
        raise Infeasible(f"source {reason}; it must hold unit 0")
    needs = [memory_need(cluster, unit) for unit in workload.units]
    offered = sum(capacity(cluster, d) for d in usable)
    if not fits(sum(needs), offered):
        raise Infeasible(
            f"model needs {size(sum(needs))} at beta {cluster.beta:g}; "
            f"usable peers offer {size(offered)}"
        )
    if not fits(needs[0], capacity(cluster, source)):
        raise Infeasible(
            f"unit 0 needs {size(needs[0])}; the source {source.id!r} offers "
            f"{size(capacity(cluster, source))} at beta {cluster.beta:g}"
        )
    largest = max(capacity(cluster, d) for d in usable)
    for u, need in enumerate(needs):
        if not fits(need, largest):
            raise Infeasible(
                f"unit {u} needs {size(need)}; the largest usable peer offers "
                f"{size(largest)} at beta {cluster.beta:g}"
            )
