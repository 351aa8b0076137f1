"""The planner's inputs built from what the leader measured, and the solve itself.

The cluster is the latest ClusterReport: every peer that reported a positive FLOP/s, with its
memory available (already capped by its --memory-budget), CPU load and battery, the links
measured between those peers, and the model peer as the source (it holds unit 0 and the
tokenizer). The workload is the model's manifest. KV is reserved for the model's maximum
context, at most DEFAULT_CONTEXT tokens.

Units are priced by what they measured (docs/planner.md, "How a unit is priced"): a unit a
peer ran costs its own measured seconds per decode token there (`PeerFigures.unit_times`,
for the model's manifest key); a unit it never ran but others did, their times scaled by
how much faster this peer computes (FLOP/s x (1 - load), the median over the peers that ran
it); a unit nobody ran yet, its FLOPs at the peer's FLOP/s (the planner's own fallback).
Each stage also costs its peer's measured overhead per step (`UnitTimes.overhead_s`:
receiving, sending, scheduling, sampling), estimated the same way for a peer that has not
run a decode step yet, and 0 while nobody has.

The default solver is the exact one (`milp`). It gets MILP_TIME_LIMIT_S less SETTLE_S: if it
has not proven its plan optimal by then, it returns the best plan found (its `solver` says it
was cut short). If it fails, or still has no answer after MILP_TIME_LIMIT_S, the EdgeShard DP
solves instead, and the log says so. An Infeasible answer (the model does not fit) is final:
no other solver can do better.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import statistics

from peerd.wire.protocol import Battery, ClusterReport, PeerFigures, PlanAssignment
from planner import model as pm
from planner.constraints import violations
from planner.cost import simulate, usable_devices
from planner.errors import Infeasible, PlannerError
from planner.groups import Shape, best_shape
from planner.io import workload_from_dict
from planner.solve import solve
from shards.manifest import Manifest

log = logging.getLogger("peerd.control.planning")

DEFAULT_CONTEXT = 2048
SHAPE_PROMPT_TOKENS = 512  # the prompt the first-token objective plans for
MILP_TIME_LIMIT_S = 10.0
SETTLE_S = 1.0  # of the time limit, kept for scoring the plan found and its overlap plan
FALLBACK_SOLVER = "dp"
LAYER_HALF = re.compile(r"layer\d+\.(attn|mlp)")


def cluster_from_report(report: ClusterReport, source: str, context: int,
                        model: str | None = None, units: int = 0) -> pm.Cluster:
    """The planner's view of the measured peers, with `source` holding unit 0; with `model`
    (a manifest key) of `units` units, priced by the unit times measured for it."""
    peers = [f for f in sorted(report.peers, key=lambda f: f.id) if f.flops > 0]
    prices = unit_prices(peers, model, units) if model else {}
    devices = tuple(
        pm.Device(
            id=f.id,
            flops=f.flops,
            prompt_flops=f.prompt_flops,
            memory_available=float(f.memory_available),
            load=f.load,
            battery=_battery(f.battery),
            unit_s=prices[f.id].unit_s if model else {},
            stage_overhead_s=prices[f.id].overhead_s if model else 0.0,
        )
        for f in peers
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


@dataclasses.dataclass(frozen=True)
class Prices:
    """What a peer's compute costs: seconds per decode token by unit, and its stage's
    overhead per step."""

    unit_s: dict[int, float]
    overhead_s: float = 0.0


def unit_prices(peers: list[PeerFigures], model: str, units: int) -> dict[str, Prices]:
    """Each peer's prices where anyone measured them: the peer's own times, else the
    others' scaled by their speed over this peer's (the median over them)."""
    measured = {f.id: f.unit_times for f in peers
                if f.unit_times is not None and f.unit_times.model == model}
    speed = {f.id: f.flops * (1 - f.load) for f in peers}

    def scaled(peer: str, own: float | None, others: dict[str, float]) -> float | None:
        if own is not None:
            return own
        found = [seconds * speed[e] / speed[peer] for e, seconds in others.items()
                 if speed[e] > 0 and speed[peer] > 0]
        return statistics.median(found) if found else None

    times = {e: t.by_unit() for e, t in measured.items()}
    overheads = {e: t.overhead_s for e, t in measured.items() if t.overhead_s is not None}
    prices = {}
    for f in peers:
        mine = times.get(f.id, {})
        unit_s = {u: scaled(f.id, mine.get(u), {e: t[u] for e, t in times.items() if u in t})
                  for u in range(units)}
        overhead = scaled(f.id, overheads.get(f.id), overheads)
        prices[f.id] = Prices({u: s for u, s in unit_s.items() if s is not None},
                              overhead or 0.0)
    return prices


def _battery(battery: Battery | None) -> pm.Battery | None:
    return None if battery is None else pm.Battery(battery.percent, battery.plugged)


def planner_inputs(report: ClusterReport, source: str,
                   manifest: Manifest) -> tuple[pm.Cluster, pm.Workload]:
    """The cluster, priced by the unit times measured for `manifest`, and its workload."""
    cluster = cluster_from_report(report, source, context_for(manifest), manifest.key,
                                  len(manifest.units))
    return cluster, workload_from_manifest(manifest)


def rescore(report: ClusterReport, plan: PlanAssignment,
            manifest: Manifest) -> pm.Prediction | None:
    """What the planner predicts for `plan` at the prices of `report`; None where the plan
    no longer holds under it (a peer gone, too loaded, out of memory)."""
    if plan.model_peer is None or not plan.stages or any(s.shares for s in plan.stages):
        return None  # a group plan is scored as planned (planner.groups)
    stages = [pm.Stage(s.peer, s.first, s.last + 1) for s in plan.stages]
    try:
        cluster, workload = planner_inputs(report, plan.model_peer, manifest)
        if violations(cluster, workload, stages):
            return None
        return simulate(cluster, workload, stages)
    except PlannerError:
        return None


def workload_from_manifest(manifest: Manifest) -> pm.Workload:
    """The planner's workload; a layer half can be shared by as many peers as its layer
    has grains (`ModelInfo.share_grains`), the embedding and the head by none."""
    document = manifest.to_dict()
    grains = manifest.model.share_grains
    for unit in document["units"]:
        if LAYER_HALF.fullmatch(unit["name"]):
            unit["share_grains"] = grains
    return workload_from_dict(document)


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


async def solve_shape(cluster: pm.Cluster, workload: pm.Workload, manifest: Manifest,
                      objective: str, group_size: int | None) -> Shape:
    """The best shape of planner.groups for `objective` (with `group_size`: every stage a
    group of that many peers), in a worker thread. Raises Infeasible, saying why in one
    line, where no such shape can serve the model."""
    grains = manifest.model.share_grains
    if group_size is not None:
        peers = len(usable_devices(cluster))
        if group_size > peers:
            raise Infeasible(f"--tensor-parallel {group_size} needs {group_size} peers; "
                             f"{peers} can take work")
        if grains == 0:
            raise Infeasible("the model's manifest predates groups: shard it again")
        if group_size > grains:
            raise Infeasible(f"--tensor-parallel {group_size}: the model's layers split "
                             f"{grains} ways at most (its KV-head groups)")
    return await asyncio.to_thread(best_shape, cluster, workload, objective,
                                   SHAPE_PROMPT_TOKENS, group_size)
