"""The `milp` solver: the optimum under the full cost model, proven, by whichever exact
method settles the instance fastest.

The best quick plan (`planner.bounds`) is the first incumbent (`planner.incumbent`), which
every method below improves and which is what comes back.

- Throughput: the least compute-only bottleneck (`planner.reach`) bounds every plan from
  below and comes with a plan; if that plan's messages stay under it, it is optimal. If not,
  the MILP (`planner.milp`) settles it with that bound.
- Latency, when every residual output comes from unit 0 (`planner.paths`; every sharded
  model) and there are at most search.MAX_PEERS peers: the search over peer sets
  (`planner.search`). Otherwise the MILP.

A deadline cuts the exact phase short: the incumbent then comes back unproven.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.bounds import lower_bound, quick_plans
from planner.cost import usable_devices
from planner.deadline import Deadline, TimeUp
from planner.errors import Infeasible, PlannerError
from planner.incumbent import Incumbent
from planner.milp import milp_latency, milp_throughput
from planner.model import Cluster, Stage, Workload
from planner.paths import follows_unit_zero, path_model
from planner.reach import least_compute_bottleneck
from planner.search import MAX_PEERS, settle_latency

NO_PLAN = ("no plan fits: no contiguous split of the units over the usable peers respects "
           "every peer's memory over the links that exist")


@dataclass(frozen=True)
class Solved:
    stages: list[Stage]
    cut_short: bool = False  # the deadline passed first: the best plan found, maybe not optimal


def solve_exact(cluster: Cluster, workload: Workload, objective: str,
                deadline: Deadline) -> Solved:
    best = Incumbent(cluster, workload, objective)
    for stages in quick_plans(cluster, workload, objective):
        best.offer(stages)
    try:
        if objective == "throughput":
            _least_bottleneck(cluster, workload, best, deadline)
        elif follows_unit_zero(workload) and len(usable_devices(cluster)) <= MAX_PEERS:
            settle_latency(path_model(cluster, workload), best, deadline)
        else:
            milp_latency(cluster, workload, best, deadline)
        cut_short = False
    except TimeUp:
        cut_short = True
    if best.stages is None:
        if cut_short:
            raise PlannerError("no plan found before the time limit")
        raise Infeasible(NO_PLAN)
    return Solved(best.stages, cut_short)


def _least_bottleneck(cluster: Cluster, workload: Workload, best: Incumbent,
                      deadline: Deadline) -> None:
    reach = least_compute_bottleneck(cluster, workload)
    if reach is None:
        lower = lower_bound(cluster, workload, "throughput")
    else:
        best.offer(reach.stages)
        if best.proven_by(reach.bottleneck):
            return
        lower = reach.bottleneck * (1 - 1e-9)  # block sums round differently in the simulator
    milp_throughput(cluster, workload, lower, best, deadline)
