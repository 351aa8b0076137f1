"""The leader's side of deployment: find the model, plan, hand the plan to every member, and
follow the members until every stage reports ready.

`step` runs once per measurement round with the fresh ClusterReport. It asks the model peer
for its manifest, sending the key it already holds so that an unchanged manifest costs a few
bytes, and re-plans only when what a plan depends on changes: the leader epoch, the set of
measured peers, the model peer, or its manifest or sharding state. New figures alone do not
re-plan (moving work as load changes is rebalancing, a separate step), so a round where
nothing changed costs one small request. A change that leaves the current plan runnable (a
peer joined, or one without a stage left) waits until it has held for `settle_s`, so a peer
that comes and goes does not move units back and forth; one that breaks the plan (a stage's
peer gone, a new epoch or model, no plan yet) re-plans at once. Each plan gets the next plan
id and goes to every member; a member that has not answered it with a DeployReport gets it
again the next round, and one that reported `failed` retries when it gets it again. When no
plan is possible (no model yet, or the model does not fit) the members get a plan without
stages whose `problem` says why, and unload. While nothing of that changes and the plan is
deployed, every round re-scores it with the fresh figures and the rebalancing policy
(peerd/control/rebalance.py) decides whether to move work. Every plan carries why it was made (and,
for a rebalance, its predicted gain), which every member publishes to its local subscribers
(peerd/api/plan_events.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from peerd.control import rebalance
from peerd.control.planning import planner_inputs, solve_plan, solve_shape
from peerd.wire.protocol import (
    ClusterReport,
    DeployReport,
    ManifestOffer,
    PlanAssignment,
    PlanFigures,
    PlanRebalance,
    PlanShare,
    PlanStage,
)
from peerd.wire.states import DeployState, ModelState
from peerd.wire.transport import TransportError
from planner import model as pm
from planner.constraints import violations
from planner.cost import simulate
from planner.errors import PlannerError
from planner.groups import Shape
from shards.manifest import Manifest, ManifestError

log = logging.getLogger("peerd.control.coordinator")

REPLAN_SETTLE_S = 10.0

AskManifest = Callable[[str, str | None], Awaitable[ManifestOffer]]


@dataclasses.dataclass(frozen=True)
class ModelStatus:
    """The model as the cluster sees it: who serves it, and how far its sharding got."""

    peer: str
    name: str
    state: ModelState
    detail: str
    manifest: Manifest | None = None

    def document(self) -> dict[str, Any]:
        """The `model` field of `peerd status`."""
        manifest = self.manifest
        return {
            "name": self.name,
            "peer": self.peer,
            "state": self.state,
            "detail": self.detail,
            "architecture": manifest.model.architecture if manifest else None,
            "units": len(manifest.units) if manifest else None,
            "key": manifest.key if manifest else None,
            "quant": manifest.options.quant.value if manifest else None,
        }


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Plan shapes of planner.groups: with `group_size`, every stage a group of that many
    peers (`peerd start --tensor-parallel N`); without, whichever is best for the objective
    (`--shapes`)."""

    group_size: int | None = None


@dataclasses.dataclass(frozen=True)
class _PlanInputs:
    epoch: int
    peers: frozenset[str]
    model_peer: str | None
    model_state: ModelState | None
    model_key: str | None


@dataclasses.dataclass(frozen=True)
class _Served:
    """A model ready to plan: its status and its manifest."""

    model: ModelStatus
    manifest: Manifest


class Coordinator:
    def __init__(
        self,
        ask_manifest: AskManifest,
        send: Callable[[str, Any], None],
        objective: str = "throughput",
        solver: str = "milp",
        settle_s: float = REPLAN_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
        policy: rebalance.Policy | None = rebalance.Policy(),  # noqa: B008 - frozen
        name_of: Callable[[str], str] = str,
        shapes: Shapes | None = None,
    ):
        """`ask_manifest(peer, have_key)` returns that peer's ManifestOffer; `send(peer, msg)`
        delivers a message to a member (this peer included); `policy` is when to rebalance
        (None: never); `name_of(peer)` is a peer's name, for messages; `shapes`: plan by
        planner.groups (groups, pipelines or both) rather than pipelines alone."""
        self.shapes = shapes
        self._ask_manifest = ask_manifest
        self._send = send
        self.objective = objective
        self.solver = solver
        self.model: ModelStatus | None = None
        self.plan: PlanAssignment | None = None
        self.reports: dict[str, DeployReport] = {}
        self._manifests: dict[str, Manifest] = {}
        self._inputs: _PlanInputs | None = None
        self._pending: tuple[_PlanInputs, float] | None = None  # a change, and since when
        self._settle_s = settle_s
        self._clock = clock
        self.policy = policy
        self._rebalancing = rebalance.State()
        self._plan_ids = itertools.count(1)
        self._name_of = name_of
        self._cause: str | None = None  # which peers of the plan stopped answering

    async def step(self, epoch: int, report: ClusterReport, members: Iterable[str]) -> None:
        """Plan anew if the inputs changed, and (re)send the plan to members that need it."""
        self._cause = self._stopped_answering(report)
        self.model = await self._find_model(report)
        model = self.model
        inputs = _PlanInputs(
            epoch=epoch,
            peers=frozenset(f.id for f in report.peers if f.flops > 0),
            model_peer=model.peer if model else None,
            model_state=model.state if model else None,
            model_key=model.manifest.key if model and model.manifest else None,
        )
        if inputs == self._inputs:
            self._pending = None  # a change that went away again
            if self.deployed and self.policy is not None and self.shapes is None:
                await self._rebalance(epoch, report, self.policy)
            elif self.plan is not None and not self.plan.stages and inputs.model_key:
                await self._retry(epoch, report)
        elif self._replan_now(inputs):
            reason = _reason(self._inputs, inputs)
            if self._cause:
                reason = f"{self._cause}; re-planning ({reason})"
            self._inputs, self._pending = inputs, None
            self._adopt(await self._new_plan(epoch, report), reason)
        for member in members:
            if self._needs_plan(member):
                self._send(member, self.plan)

    def _adopt(self, plan: PlanAssignment, reason: str,
               moved: PlanRebalance | None = None) -> None:
        if plan.problem:
            log.warning("plan %d: %s", plan.plan_id, plan.problem)
        self.plan = dataclasses.replace(plan, reason=reason, rebalance=moved)
        self.reports = {}
        self._rebalancing = dataclasses.replace(self._rebalancing, changed_at=self._clock())

    async def _retry(self, epoch: int, report: ClusterReport) -> None:
        """With the model ready but no plan (peers were too loaded, on low battery...), try
        again with the fresh figures; a plan that works goes out."""
        plan = await self._new_plan(epoch, report)
        if plan.stages:
            self._adopt(plan, "fresh figures")

    @property
    def settling(self) -> bool:
        """Whether a change of peers or model waits to settle before the next plan."""
        return self._pending is not None

    def set_policy(self, policy: rebalance.Policy | None) -> None:
        """Rebalance by `policy` from now on (None: keep deployed plans), judging afresh:
        what was seen before does not count towards the sustain time."""
        self.policy = policy
        self._rebalancing = rebalance.State()

    async def _rebalance(self, epoch: int, report: ClusterReport,
                         policy: rebalance.Policy) -> None:
        """Score the deployed plan with fresh figures; move work when the policy says so."""
        served, deployed = self._served(), self.plan
        if served is None or deployed is None:
            return
        look = await self._look(report, served, deployed)
        if look is None or self.policy is not policy:
            return  # switched off or on while looking: the next round judges
        before = self._rebalancing
        self._rebalancing, decision = rebalance.apply(before, policy, look[0])
        if decision is None:
            _log_waiting(before, self._rebalancing, look[0], policy)
            return
        assignment = self._assignment(epoch, look[1] if decision.full else look[2], served)
        log.info("rebalancing (%s): %s", "full plan" if decision.full else "boundaries",
                 decision.reason)
        gain = decision.gain if math.isfinite(decision.gain) else None
        self._adopt(assignment, f"rebalance: {decision.reason}",
                    PlanRebalance(decision.reason, gain, decision.full))

    async def _look(self, report: ClusterReport, served: _Served, deployed: PlanAssignment
                    ) -> tuple[rebalance.Look, pm.Plan, pm.Plan] | None:
        """The policy's view of this round, with the best plan and the best boundary move."""
        current = tuple(pm.Stage(s.peer, s.first, s.last + 1) for s in deployed.stages)
        try:
            cluster, workload = planner_inputs(report, served.model.peer, served.manifest)
            best = await solve_plan(cluster, workload, self.objective, self.solver)
        except PlannerError:
            return None  # nothing better exists; a broken plan is re-planned as peers leave
        ours = {s.peer for s in current}
        mine = dataclasses.replace(cluster, devices=tuple(d for d in cluster.devices
                                                          if d.id in ours))
        try:
            moved = await solve_plan(mine, workload, self.objective, self.solver)
        except PlannerError:
            moved = None
        broken = violations(cluster, workload, current)
        score = simulate(cluster, workload, current).objective(self.objective)
        look = rebalance.Look(
            now=self._clock(),
            current_s=math.inf if broken else score,
            boundaries_s=moved.predicted.objective(self.objective) if moved else None,
            best_s=best.predicted.objective(self.objective),
            broken=f"the plan no longer holds: {broken[0]}" if broken else None,
        )
        return look, best, moved or best

    def _replan_now(self, inputs: _PlanInputs) -> bool:
        if self._breaks_plan(inputs):
            return True
        if self._pending is None or self._pending[0] != inputs:
            self._pending = (inputs, self._clock())
        return self._clock() - self._pending[1] >= self._settle_s

    def _breaks_plan(self, inputs: _PlanInputs) -> bool:
        plan, current = self.plan, self._inputs
        if plan is None or current is None or not plan.stages:
            return True
        model = dataclasses.replace(inputs, peers=current.peers)
        return model != current or any(p not in inputs.peers for p in plan.peers)

    def on_report(self, peer: str, report: DeployReport) -> bool:
        """Record a member's progress on the current plan; True when it completes the plan."""
        plan = self.plan
        if plan is None or (report.epoch, report.plan_id) != (plan.epoch, plan.plan_id):
            return False
        was_deployed = self.deployed
        previous = self.reports.get(peer)
        self.reports[peer] = report
        if plan.stages and (previous is None or previous.state != report.state):
            log.info("plan %d: peer %s is %s (%s)", plan.plan_id, peer, report.state,
                     report.detail)
        if self.deployed and not was_deployed:
            log.info("plan %d deployed on %d peers", plan.plan_id, len(plan.peers))
            return True
        return False

    @property
    def deployed(self) -> bool:
        """Every stage of the current plan has reported its units loaded."""
        plan = self.plan
        if plan is None or not plan.stages:
            return False
        return all(self._stage_ready(stage) for stage in plan.stages)

    def _stage_ready(self, stage: PlanStage) -> bool:
        units = tuple(range(stage.first, stage.last + 1))
        reports = [self.reports.get(peer) for peer in stage.peers]
        return all(r is not None and r.state == DeployState.READY and r.units == units
                   for r in reports)

    def _needs_plan(self, member: str) -> bool:
        report = self.reports.get(member)
        return report is None or report.state == DeployState.FAILED

    # -- the model ------------------------------------------------------------------------------

    async def _find_model(self, report: ClusterReport) -> ModelStatus | None:
        """The first model peer (by id) whose model is ready, else the first one's state."""
        found = []
        for peer in sorted(f.id for f in report.peers if f.model):
            status = await self._model_status(peer)
            if status is not None and status.manifest is not None:
                return status
            found.append(status)
        return next((s for s in found if s is not None), None)

    async def _model_status(self, peer: str) -> ModelStatus | None:
        known = self.model if self.model and self.model.peer == peer else None
        held = known.manifest if known else None
        try:
            offer = await self._ask_manifest(peer, held.key if held else None)
        except TransportError as exc:  # it answered the measurement: keep what it said last
            log.info("no manifest from %s: %s", peer, exc)
            return known
        if offer.state != ModelState.READY or offer.key is None:
            return ModelStatus(peer, offer.model, ModelState(offer.state), offer.detail)
        manifest = self._manifests.get(offer.key)
        if offer.manifest is not None:
            try:
                manifest = Manifest.from_dict(offer.manifest)
            except ManifestError as exc:
                return ModelStatus(peer, offer.model, ModelState.FAILED,
                                   f"unusable manifest: {exc}")
            self._manifests = {manifest.key: manifest}
        if manifest is None or manifest.key != offer.key:
            return ModelStatus(peer, offer.model, ModelState.FAILED,
                               "the manifest did not arrive")
        return ModelStatus(peer, offer.model, ModelState.READY, offer.detail, manifest)

    # -- planning -------------------------------------------------------------------------------

    async def _new_plan(self, epoch: int, report: ClusterReport) -> PlanAssignment:
        plan_id = next(self._plan_ids)
        model = self.model
        if model is None:
            return self._problem(epoch, plan_id, "no other peer serves the model" if self._cause
                                 else "no peer serves a model (start one with --model)")
        if model.manifest is None:
            sharding = model.state == ModelState.SHARDING
            what = "is sharding" if sharding else f"failed: {model.detail}"
            return self._problem(epoch, plan_id, f"model {model.name} on peer {model.peer} {what}")
        served = _Served(model, model.manifest)
        try:
            cluster, workload = planner_inputs(report, model.peer, served.manifest)
            log.info("plan %d priced from %s", plan_id, _readings(cluster))
            if self.shapes is not None:
                shape = await solve_shape(cluster, workload, served.manifest, self.objective,
                                          self.shapes.group_size)
                return self._shape_assignment(epoch, shape, served, plan_id)
            plan = await solve_plan(cluster, workload, self.objective, self.solver)
        except PlannerError as exc:
            return self._problem(epoch, plan_id, str(exc))
        return self._assignment(epoch, plan, served, plan_id)

    def _served(self) -> _Served | None:
        model = self.model
        if model is None or model.manifest is None:
            return None
        return _Served(model, model.manifest)

    def _assignment(self, epoch: int, plan: pm.Plan, served: _Served,
                    plan_id: int | None = None) -> PlanAssignment:
        """The plan as the members get it."""
        plan_id = next(self._plan_ids) if plan_id is None else plan_id
        model, manifest = served.model, served.manifest
        copies = plan.movable or tuple(() for _ in plan.stages)
        stages = tuple(PlanStage(s.peer, s.start, s.stop - 1, held)
                       for s, held in zip(plan.stages, copies, strict=True))
        log.info("plan %d (%s, %s): %s; predicted %.1f tokens/s", plan_id, plan.objective,
                 plan.solver, ", ".join(f"{s.peer} {s.first}-{s.last}" for s in stages),
                 plan.predicted.throughput_tps)
        return PlanAssignment(
            epoch=epoch,
            plan_id=plan_id,
            stages=stages,
            model=model.name,
            model_peer=model.peer,
            manifest=manifest.to_dict(),
            objective=plan.objective,
            solver=plan.solver,
            predicted=PlanFigures(plan.predicted.latency_s, plan.predicted.throughput_tps,
                                  plan.predicted.bottleneck_s),
            problem=None,
        )

    def _shape_assignment(self, epoch: int, shape: Shape, served: _Served,
                          plan_id: int) -> PlanAssignment:
        """A shape of planner.groups as the members get it: a group stage lists its shares."""
        stages = tuple(
            PlanStage(s.lead, s.start, s.stop - 1, shares=tuple(
                PlanShare(share.peer, share.fraction) for share in s.shares
            ) if len(s.shares) > 1 else ())
            for s in shape.stages)
        log.info("plan %d (%s, %s): %s; predicted first token in %.3f s, %.1f tokens/s",
                 plan_id, shape.objective, shape.kind.value, ", ".join(
                     f"{'+'.join(s.peers)} {s.first}-{s.last}" for s in stages),
                 shape.predicted.first_token_s, shape.predicted.throughput_tps)
        predicted = shape.predicted
        return PlanAssignment(
            epoch=epoch, plan_id=plan_id, stages=stages, model=served.model.name,
            model_peer=served.model.peer, manifest=served.manifest.to_dict(),
            objective=shape.objective, solver="groups",
            predicted=PlanFigures(predicted.latency_s, predicted.throughput_tps,
                                  predicted.bottleneck_s),
            problem=None,
        )

    def _stopped_answering(self, report: ClusterReport) -> str | None:
        """'peer laptop (units 8-15) stopped answering' for the current plan's stages, and
        the model's peer, missing from the report; None when all answered."""
        answering = {f.id for f in report.peers}
        stages = self.plan.stages if self.plan else ()
        gone = [f"peer {self._name_of(peer)} (units {s.first}–{s.last})"
                for s in stages for peer in s.peers if peer not in answering]
        model = self.model
        if model and model.peer not in answering and model.peer not in {
                p for s in stages for p in s.peers}:
            gone.append(f"peer {self._name_of(model.peer)} (the model's)")
        return f"{' and '.join(gone)} stopped answering" if gone else None

    def _problem(self, epoch: int, plan_id: int, problem: str) -> PlanAssignment:
        if self._cause:
            problem = f"{self._cause}; {problem}"
        model = self.model
        return PlanAssignment(
            epoch=epoch,
            plan_id=plan_id,
            stages=(),
            model=model.name if model else None,
            model_peer=model.peer if model else None,
            manifest=None,
            objective=self.objective,
            solver=self.solver,
            predicted=None,
            problem=problem,
        )


def _reason(old: _PlanInputs | None, new: _PlanInputs) -> str:
    """What changed since the last plan, in words, for the plan event."""
    if old is None:
        return f"first plan of epoch {new.epoch}"
    changes = []
    if new.epoch != old.epoch:
        changes.append(f"new leader epoch {new.epoch}")
    if joined := new.peers - old.peers:
        changes.append("joined: " + ", ".join(sorted(joined)))
    if left := old.peers - new.peers:
        changes.append("left: " + ", ".join(sorted(left)))
    if new.model_peer != old.model_peer:
        changes.append(f"model peer {new.model_peer}")
    if new.model_state != old.model_state:
        changes.append(f"model {new.model_state}")
    elif new.model_key != old.model_key:
        changes.append("new manifest")
    return "; ".join(changes)


def _log_waiting(before: rebalance.State, after: rebalance.State, look: rebalance.Look,
                 policy: rebalance.Policy) -> None:
    """Log when a better plan starts or stops waiting out the sustain time: a rebalance
    that does not happen says why in the log."""
    if before.better_since is None and after.better_since is not None:
        log.info("rebalance: a plan predicted %.0f%% faster; moving if it holds for %.0f s "
                 "(and %.0f s after the last change)", 100 * look.best_gain,
                 policy.sustain_s, policy.cooldown_s)
    elif before.better_since is not None and after.better_since is None:
        log.info("rebalance: the better plan is no longer %.0f%% faster (%.0f%%); waiting "
                 "again", 100 * policy.margin, 100 * look.best_gain)


def _readings(cluster: pm.Cluster) -> str:
    """The figures a plan is priced from, peer by peer: the log's answer to why it chose."""
    return "; ".join(
        f"{d.id}: {d.flops / 1e9:.1f} GFLOP/s decode, {d.prompt_flops / 1e9:.1f} prompt, "
        f"load {d.load:.2f}, {len(d.unit_s)} units timed" for d in cluster.devices)
