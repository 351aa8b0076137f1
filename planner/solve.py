"""The one entry point: check the cluster can hold the model, solve, score, add the overlap."""

from __future__ import annotations

import time
from collections.abc import Callable

from planner.baselines import even_split, memory_split
from planner.constraints import require_feasible, violations
from planner.cost import check_measured, simulate
from planner.deadline import Deadline
from planner.dp import solve_dp
from planner.errors import InvalidInput, PlannerError
from planner.exact import Solved, solve_exact
from planner.model import OBJECTIVES, Cluster, Plan, Stage, Workload
from planner.overlap import movable_units

Solver = Callable[[Cluster, Workload, str, Deadline], Solved]


def _at_once(split: Callable[[Cluster, Workload, str], list[Stage]]) -> Solver:
    """A solver that answers at once, so no deadline can cut it short."""
    return lambda cluster, workload, objective, deadline: Solved(split(cluster, workload,
                                                                       objective))


SOLVERS: dict[str, Solver] = {
    "milp": solve_exact,
    "dp": _at_once(solve_dp),
    "even": _at_once(even_split),
    "memory": _at_once(memory_split),
}


def solve(cluster: Cluster, workload: Workload, objective: str = "throughput",
          solver: str = "milp", time_limit_s: float | None = None) -> Plan:
    """The plan `solver` picks for `objective`, scored by the simulator.

    With `time_limit_s`, an exact solver that has not proven its plan optimal by then returns
    the best plan found, and the plan's `solver` says it was cut short.
    Raises Infeasible (naming the shortfall) when no plan can hold the model, InvalidInput for
    an unknown objective or solver, a negative time limit or a measured time of a unit the
    workload lacks.
    """
    if objective not in OBJECTIVES:
        raise InvalidInput(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    if solver not in SOLVERS:
        raise InvalidInput(f"solver must be one of {', '.join(SOLVERS)}, not {solver!r}")
    if time_limit_s is not None and not time_limit_s >= 0:
        raise InvalidInput(f"the time limit must be at least 0 s, not {time_limit_s!r}")
    check_measured(cluster, workload)
    require_feasible(cluster, workload)
    started = time.perf_counter()
    solved = SOLVERS[solver](cluster, workload, objective, Deadline.after(time_limit_s))
    solve_s = time.perf_counter() - started
    broken = violations(cluster, workload, solved.stages)
    if broken:
        raise PlannerError(f"internal error: solver {solver} returned an invalid plan: {broken[0]}")
    return Plan(
        stages=tuple(solved.stages),
        objective=objective,
        solver=f"{solver} (cut short at {time_limit_s:g} s)" if solved.cut_short else solver,
        predicted=simulate(cluster, workload, solved.stages),
        solve_s=solve_s,
        movable=movable_units(cluster, workload, solved.stages),
    )
