"""The one entry point: check the cluster can hold the model, solve, score, add the overlap."""

from __future__ import annotations

import time
from collections.abc import Callable

from planner.baselines import even_split, memory_split
from planner.constraints import require_feasible, violations
from planner.cost import simulate
from planner.dp import solve_dp
from planner.errors import InvalidInput, PlannerError
from planner.milp import solve_milp
from planner.model import OBJECTIVES, Cluster, Plan, Stage, Workload
from planner.overlap import movable_units

Solver = Callable[[Cluster, Workload, str], list[Stage]]

SOLVERS: dict[str, Solver] = {
    "milp": solve_milp,
    "dp": solve_dp,
    "even": even_split,
    "memory": memory_split,
}


def solve(cluster: Cluster, workload: Workload, objective: str = "throughput",
          solver: str = "milp") -> Plan:
    """The plan `solver` picks for `objective`, scored by the simulator.

    Raises Infeasible (naming the shortfall) when no plan can hold the model, InvalidInput for
    an unknown objective or solver.
    """
    if objective not in OBJECTIVES:
        raise InvalidInput(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    if solver not in SOLVERS:
        raise InvalidInput(f"solver must be one of {', '.join(SOLVERS)}, not {solver!r}")
    require_feasible(cluster, workload)
    started = time.perf_counter()
    stages = SOLVERS[solver](cluster, workload, objective)
    solve_s = time.perf_counter() - started
    broken = violations(cluster, workload, stages)
    if broken:
        raise PlannerError(f"internal error: solver {solver} returned an invalid plan: {broken[0]}")
    return Plan(
        stages=tuple(stages),
        objective=objective,
        solver=solver,
        predicted=simulate(cluster, workload, stages),
        solve_s=solve_s,
        movable=movable_units(cluster, workload, stages),
    )
