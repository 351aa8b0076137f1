"""The planner's inputs built from what the leader measured, and the solve itself.

The cluster is the latest ClusterReport: every peer that reported a positive FLOP/s, with its
memory available (already capped by its --memory-budget), CPU load and battery, the links
measured between those peers, and the model peer as the source (it holds unit 0 and the
tokenizer). The workload is the model's manifest. KV is reserved for the model's maximum
context, at most DEFAULT_CONTEXT tokens.

The default solver is the exact one (`milp`). It gets MILP_TIME_LIMIT_S less SETTLE_S: if it
has not proven its plan optimal by then, it returns the best plan found (its `solver` says it
was cut short). If it fails, or still has no answer after MILP_TIME_LIMIT_S, the EdgeShard DP
solves instead, and the log says so. An Infeasible answer (the model does not fit) is final:
no other solver can do better.
"""

from __future__ import annotations

import asyncio
import logging

from peerd.wire.protocol import Battery, ClusterReport
from planner import model as pm
from planner.errors import Infeasible
from planner.io import workload_from_dict
from planner.solve import solve
from shards.manifest import Manifest

log = logging.getLogger("peerd.control.planning")

DEFAULT_CONTEXT = 2048
MILP_TIME_LIMIT_S = 10.0
SETTLE_S = 1.0  # of the time limit, kept for scoring the plan found and its overlap plan
FALLBACK_SOLVER = "dp"


def cluster_from_report(report: ClusterReport, source: str, context: int) -> pm.Cluster:
    """The planner's view of the measured peers, with `source` holding unit 0."""
    devices = tuple(
        pm.Device(
            id=f.id,
            flops=f.flops,
            memory_available=float(f.memory_available),
            load=f.load,
            battery=_battery(f.battery),
        )
        for f in sorted(report.peers, key=lambda f: f.id)
        if f.flops > 0
    )
    ids = {d.id for d in devices}
    if source not in ids:
        raise Infeasible(f"the model peer {source} has not been measured yet")
    links = tuple(
        pm.Link(link.source, link.target, link.latency_s, link.bandwidth_Bps)
        for link in report.links
        if link.source in ids and link.target in ids
    )
    return pm.Cluster(source=source, devices=devices, links=links, context=context)


def _battery(battery: Battery | None) -> pm.Battery | None:
    return None if battery is None else pm.Battery(battery.percent, battery.plugged)


def workload_from_manifest(manifest: Manifest) -> pm.Workload:
    return workload_from_dict(manifest.to_dict())


def context_for(manifest: Manifest) -> int:
    """Tokens of KV each plan reserves: the model's context, at most DEFAULT_CONTEXT."""
    return min(manifest.model.max_positions, DEFAULT_CONTEXT)


async def solve_plan(
    cluster: pm.Cluster,
    workload: pm.Workload,
    objective: str = "throughput",
    solver: str = "milp",
    time_limit_s: float = MILP_TIME_LIMIT_S,
) -> pm.Plan:
    """The plan `solver` finds (in a worker thread; the best found when its search is cut
    short), or the DP's when that solver fails or runs past `time_limit_s`. Raises Infeasible
    when no plan can hold the model."""
    search_s = max(time_limit_s - SETTLE_S, 0.0)
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(solve, cluster, workload, objective, solver, search_s), time_limit_s
        )
    except Infeasible:
        raise
    except Exception as exc:  # any failure of one solver is worth trying another for
        if solver == FALLBACK_SOLVER:
            raise
        reason = f"no answer in {time_limit_s:g}s" if isinstance(exc, TimeoutError) else exc
        log.warning("solver %s failed (%s); solving with %s instead", solver, reason,
                    FALLBACK_SOLVER)
    return await asyncio.to_thread(solve, cluster, workload, objective, FALLBACK_SOLVER)
