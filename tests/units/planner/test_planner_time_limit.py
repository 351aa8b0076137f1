"""solve()'s time limit: an exact solver cut short hands back the best plan it has and says
so; the daemon's solve_plan uses it."""

from __future__ import annotations

import pytest

from peerd.control import planning
from planner.bounds import quick_plans
from planner.constraints import violations
from planner.cost import simulate
from planner.errors import InvalidInput
from planner.model import Cluster, Device, Link, Output, Unit, Workload
from planner.solve import solve

LINKS_MS = {("p0", "p1"): 13.6, ("p0", "p2"): 3.8, ("p0", "p3"): 9.4, ("p1", "p2"): 4.1,
            ("p1", "p3"): 18.2, ("p2", "p3"): 2.1}


def cluster() -> Cluster:
    """Two slow peers with room for most units, two fast ones with room for two each."""
    devices = tuple(Device(f"p{i}", flops, memory / 0.7) for i, (flops, memory) in
                    enumerate([(2e10, 1.3e9), (2e10, 1.3e9), (4e10, 5e8), (4e10, 5e8)]))
    links = tuple(Link(a, b, ms / 1000, 1e8) for (a, b), ms in LINKS_MS.items())
    return Cluster("p0", devices, links, context=0)


def workload(residual_from: int) -> Workload:
    """Eight units; unit `residual_from` also sends every second later unit a small tensor."""
    flops = [2e9, 2e9, 2e9, 1e9, 2e9, 1e9, 2e9, 2e9]
    units = []
    for u, f in enumerate(flops):
        outputs = [Output(4e4, (u + 1,))] if u + 1 < len(flops) else []
        if u == residual_from:
            outputs.append(Output(2e3, tuple(range(u + 2, len(flops), 2))))
        units.append(Unit(f, 2e8, 0, tuple(outputs)))
    return Workload(tuple(units), return_bytes=8)


def best_quick_latency(cluster: Cluster, workload: Workload) -> float:
    return min(simulate(cluster, workload, stages).latency_s
               for stages in quick_plans(cluster, workload, "latency")
               if not violations(cluster, workload, stages))


@pytest.mark.parametrize("residual_from", [0, 1])  # 0: the search settles it; 1: the MILP
def test_with_no_time_left_the_best_plan_found_comes_back_cut_short(residual_from):
    c, w = cluster(), workload(residual_from)
    cut = solve(c, w, "latency", time_limit_s=0)
    full = solve(c, w, "latency")
    assert cut.solver == "milp (cut short at 0 s)" and full.solver == "milp"
    assert violations(c, w, cut.stages) == []
    assert cut.predicted.latency_s <= best_quick_latency(c, w)
    assert full.predicted.latency_s < cut.predicted.latency_s * (1 - 1e-3)


def test_a_time_limit_the_solver_meets_changes_nothing():
    c, w = cluster(), workload(0)
    limited = solve(c, w, "latency", time_limit_s=60)
    assert limited.solver == "milp"
    assert limited.stages == solve(c, w, "latency").stages


def test_a_negative_time_limit_is_refused():
    with pytest.raises(InvalidInput, match="the time limit must be at least 0 s, not -1"):
        solve(cluster(), workload(0), "latency", time_limit_s=-1)


async def test_the_daemon_takes_the_plan_found_when_the_solver_is_cut_short(monkeypatch):
    monkeypatch.setattr(planning, "SETTLE_S", 30.0)  # all of the limit for the settling
    plan = await planning.solve_plan(cluster(), workload(0), "latency", time_limit_s=30.0)
    assert plan.solver == "milp (cut short at 0 s)"
    assert plan.predicted.latency_s <= best_quick_latency(cluster(), workload(0))
