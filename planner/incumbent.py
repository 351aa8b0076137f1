"""The best valid plan found so far while solving, as the simulator scores it."""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.constraints import violations
from planner.cost import simulate
from planner.model import Cluster, Stage, Workload

TOLERANCE = 1e-9  # relative: a plan must beat the incumbent by more to matter to a bound


class Incumbent:
    def __init__(self, cluster: Cluster, workload: Workload, objective: str) -> None:
        self.cluster, self.workload, self.objective = cluster, workload, objective
        self.value = math.inf
        self.stages: list[Stage] | None = None

    @property
    def cutoff(self) -> float:
        """What a plan's objective must stay below to improve on this one."""
        return self.value * (1 - TOLERANCE)

    def offer(self, stages: Sequence[Stage]) -> float:
        """The plan's objective (inf if it breaks a constraint); it becomes the incumbent if it
        is better."""
        stages = list(stages)
        if violations(self.cluster, self.workload, stages):
            return math.inf
        value = simulate(self.cluster, self.workload, stages).objective(self.objective)
        if value < self.value:
            self.value, self.stages = value, stages
        return value

    def proven_by(self, lower: float) -> bool:
        """Whether `lower`, a bound on every plan's objective, shows this one optimal."""
        return self.value <= lower * (1 + TOLERANCE)
