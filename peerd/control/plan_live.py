"""When a plan is live here, said in two events the serving side subscribes to.

`StageLoaded`: this peer's stage of the plan it holds is loaded; its data plane can be built
now, before any other peer sends it data. `PlanLive`: the plan is live: the leader's report
shows every stage's peer ready with it (a plan without stages is live as soon as this peer
holds it); the head answers on it from now on and older planes retire.

`PlanWatch` produces each event once per plan, from the two things that make it true: this
peer's deployment reporting progress, and each report of the leader (the leader measures
again as soon as every stage reports its units loaded, so that report follows within a round
trip). Nothing else, a status read included, changes which plan serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from peerd.control.deploy import Deployment, LoadedStage
from peerd.wire.protocol import ClusterReport, PeerFigures, PlanAssignment


@dataclasses.dataclass(frozen=True)
class StageLoaded:
    plan: PlanAssignment
    loaded: LoadedStage


@dataclasses.dataclass(frozen=True)
class PlanLive:
    plan: PlanAssignment
    loaded: LoadedStage | None  # this peer's stage of it, if it has one
    alive: frozenset[str]  # the peers the leader's report measured


PlanEvent = StageLoaded | PlanLive


def plan_active(plan: PlanAssignment | None, figures: tuple[PeerFigures, ...] | None) -> bool:
    """Whether the leader's latest report shows every stage peer ready with this plan."""
    if plan is None or not plan.stages or figures is None:
        return False
    ready = {f.id: f.plan for f in figures}
    return all(ready.get(peer) == plan.key for peer in plan.peers)


class PlanWatch:
    def __init__(self, deployment: Deployment, listener: Callable[[PlanEvent], None]):
        self.deployment = deployment
        self._listener = listener
        self._figures: tuple[PeerFigures, ...] | None = None
        self._loaded: str | None = None  # key of the plan whose StageLoaded went out
        self._live: str | None = None  # key of the plan whose PlanLive went out

    def deployed(self) -> None:
        """This peer's deployment moved on (it just reported to the leader)."""
        self._check()

    def measured(self, report: ClusterReport) -> None:
        self._figures = report.peers
        self._check()

    def _check(self) -> None:
        plan, loaded = self.deployment.assignment, self.deployment.loaded
        if plan is None:
            return
        if loaded is not None and self._loaded != plan.key and self._holds_stage(plan, loaded):
            self._loaded = plan.key
            self._listener(StageLoaded(plan, loaded))
        if self._live != plan.key and (not plan.stages or plan_active(plan, self._figures)):
            self._live = plan.key
            alive = frozenset(f.id for f in self._figures or ())
            self._listener(PlanLive(plan, loaded if self._loaded == plan.key else None, alive))

    def _holds_stage(self, plan: PlanAssignment, loaded: LoadedStage) -> bool:
        stage = next((s for s in plan.stages if self.deployment.me in s.peers), None)
        return (
            stage is not None
            and (loaded.first, loaded.last) == (stage.first, stage.last)
            and loaded.manifest.key == (plan.manifest or {}).get("key")
        )
