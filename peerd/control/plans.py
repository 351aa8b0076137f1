"""This peer's part in plans, as leader and as member.

As leader (peerd/control/coordinator.py): after each measurement round, ask the model peer for
its manifest, plan when the peers or the model changed, hand the plan to every voter, and
follow their DeployReports; once every stage has its units loaded, ask for a round at once
(`on_deployed`), whose report makes the plan live everywhere. As member: take the current
leader's plans, deploy this peer's stage (peerd/control/deploy.py), report progress to the
leader, and tell the `PlanWatch` (peerd/control/plan_live.py). The peer started with --model
shards it (peerd/control/model_host.py) and serves its unit files (peerd/control/unit_transfer.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peerd.cluster.measuring import MEASURE_TIMEOUT_S, Spawn
from peerd.cluster.membership import Member
from peerd.cluster.peers import ClusterView, Handler
from peerd.cluster.unit_clock import UnitClock
from peerd.control import rebalance
from peerd.control.coordinator import Coordinator, ModelStatus, Shapes
from peerd.control.deploy import Deployment
from peerd.control.model_host import ModelHost
from peerd.control.plan_live import PlanEvent, PlanWatch
from peerd.control.planning import rescore
from peerd.control.unit_store import UnitStore
from peerd.control.unit_transfer import CHUNK_TIMEOUT_S, Ask, ChunkServer
from peerd.wire import protocol
from peerd.wire.states import ModelState
from peerd.wire.transport import Incoming, Transport
from planner.model import Prediction
from shards.early_exit import ExitSettings
from shards.manifest import Quant

log = logging.getLogger("peerd.control.plans")

UNITS_DIR = "units"  # the unit file cache in the state directory


class Plans:
    def __init__(self, cluster: ClusterView, transport: Transport, state_dir: Path,
                 model: Path | None, quant: Quant, objective: str, rebalancing: bool,
                 spawn: Spawn, listener: Callable[[PlanEvent], None],
                 on_new_plan: Callable[[protocol.PlanAssignment], None],
                 on_deployed: Callable[[], None], unit_clock: UnitClock | None = None,
                 exits: ExitSettings | None = None, shapes: Shapes | None = None,
                 memory_budget: int | None = None):
        """`listener` hears StageLoaded and PlanLive; `on_new_plan` each plan new to this
        peer; `on_deployed` that the leader's current plan has every stage loaded;
        `unit_clock` gets the units' warm-up times; `exits` places an early exit on this
        peer's stage when it is the first; `memory_budget` caps the memory its stages may
        count on (peerd/control/deploy.py)."""
        self.cluster = cluster
        self.transport = transport
        self._spawn = spawn
        self._on_new_plan = on_new_plan
        self._on_deployed = on_deployed
        self.model_host = ModelHost(model, state_dir, quant) if model else None
        self.chunks = ChunkServer(self._served_files)
        self.deployment = Deployment(
            cluster.me, UnitStore(state_dir / UNITS_DIR), self._unit_asker,
            self._send_deploy_report, self._ask_shares, local_files=self._served_files,
            unit_clock=unit_clock,
            exits=exits,
            memory_budget=memory_budget,
        )
        self.watch = PlanWatch(self.deployment, listener)
        self._rescore: tuple[protocol.ClusterReport, str, Prediction | None] | None = None
        self.coordinator = Coordinator(
            self._ask_manifest, self._send_plan, objective=objective,
            policy=rebalance.Policy() if rebalancing else None, name_of=cluster.name_of,
            shapes=shapes,
        )

    async def close(self) -> None:
        await self.deployment.close()
        if self.model_host is not None:
            await self.model_host.close()

    # -- the leader -----------------------------------------------------------------------------

    async def solve_and_deploy(self, report: protocol.ClusterReport) -> None:
        """The leader's planning step, after every measurement round: plan anew if the peers
        or the model changed, and send the plan to members lacking it."""
        await self.coordinator.step(report.epoch, report, self.cluster.voters())

    def set_rebalancing(self, enabled: bool) -> None:
        self.coordinator.set_policy(rebalance.Policy() if enabled else None)
        log.info("rebalancing %s (local API)", "on" if enabled else "off")

    @property
    def replan_pending(self) -> bool:
        return self.cluster.leading and self.coordinator.settling

    async def _ask_manifest(self, peer_id: str, have: str | None) -> protocol.ManifestOffer:
        if peer_id == self.cluster.me:
            return self._manifest_offer(0, have)
        request = protocol.ManifestRequest(0, self.cluster.epoch, have)
        return await self.transport.request(peer_id, request, MEASURE_TIMEOUT_S)

    def _send_plan(self, peer_id: str, plan: protocol.PlanAssignment) -> None:
        if peer_id == self.cluster.me:
            self._take_plan(plan)
        else:
            self.transport.send(peer_id, plan)

    def _take_deploy_report(self, peer_id: str, report: protocol.DeployReport) -> None:
        if not self.cluster.leads(report.epoch):
            return
        if self.coordinator.on_report(peer_id, report):
            self._on_deployed()

    # -- the member -----------------------------------------------------------------------------

    def _take_plan(self, plan: protocol.PlanAssignment) -> None:
        if self.deployment.assign(plan):
            self._on_new_plan(plan)

    def _send_deploy_report(self, report: protocol.DeployReport) -> None:
        self.watch.deployed()  # a stage just loaded gets its plane before the leader hears
        leader = self.cluster.leader
        if leader == self.cluster.me:
            self._take_deploy_report(self.cluster.me, report)
        elif leader is not None:
            self.transport.send(leader, report)

    def _served_files(self) -> dict[str, Path]:
        return self.model_host.served() if self.model_host else {}

    async def _ask_shares(self, peer_id: str,
                          request: protocol.SharesRequest) -> protocol.SharesOffer:
        if peer_id == self.cluster.me:
            return self._shares_offer(request)
        return await self.transport.request(peer_id, request, MEASURE_TIMEOUT_S)

    def _shares_offer(self, request: protocol.SharesRequest) -> protocol.SharesOffer:
        if self.model_host is None:
            return protocol.SharesOffer(request.req, "failed", "this peer serves no model")
        return self.model_host.shares(request)

    def _unit_asker(self, peer_id: str) -> Ask:
        return lambda msg: self.transport.request(peer_id, msg, CHUNK_TIMEOUT_S)

    def _manifest_offer(self, req: int, have: str | None) -> protocol.ManifestOffer:
        if self.model_host is None:
            return protocol.ManifestOffer(req, "", ModelState.FAILED,
                                          "this peer serves no model", None, None)
        return self.model_host.offer(req, have)

    # -- messages -------------------------------------------------------------------------------

    def handlers(self) -> dict[type, Handler]:
        return {
            protocol.ManifestRequest: self._manifest_request,
            protocol.PlanAssignment: self._plan_assignment,
            protocol.DeployReport: self._deploy_report,
            protocol.UnitChunkRequest: self._unit_chunk_request,
            protocol.SharesRequest: self._shares_request,
        }

    def _shares_request(self, member: Member, msg: protocol.SharesRequest,
                        incoming: Incoming) -> None:
        incoming.reply(self._shares_offer(msg))

    def _manifest_request(self, member: Member, msg: protocol.ManifestRequest,
                          incoming: Incoming) -> None:
        if msg.epoch >= self.cluster.epoch:
            incoming.reply(self._manifest_offer(msg.req, msg.have))

    def _plan_assignment(self, member: Member, msg: protocol.PlanAssignment,
                         incoming: Incoming) -> None:
        if member.id == self.cluster.leader and msg.epoch == self.cluster.epoch:
            self._take_plan(msg)
        else:
            log.info("ignored plan %d of epoch %d from %s: not the current leader",
                     msg.plan_id, msg.epoch, member.id)

    def _deploy_report(self, member: Member, msg: protocol.DeployReport,
                       incoming: Incoming) -> None:
        self._take_deploy_report(member.id, msg)

    def _unit_chunk_request(self, member: Member, msg: protocol.UnitChunkRequest,
                            incoming: Incoming) -> None:
        async def answer() -> None:
            incoming.reply(await self.chunks.answer(msg))

        self._spawn(answer())

    # -- what status shows ----------------------------------------------------------------------

    def plan_document(self, report: protocol.ClusterReport | None,
                      answers: protocol.AnswerFigures | None = None) -> dict[str, Any] | None:
        """The current plan as `peerd status` shows it: `predicted` at the latest measured
        prices (as planned, `predicted_at_planning`, when the plan no longer holds under
        them), and `measured`, what the head's answers measured on it (`answers`: this
        peer's own, when it is the head; else the head's, from the report)."""
        document = self.deployment.plan_document()
        plan = self.deployment.assignment
        if document is None or plan is None:
            return document
        rescored = self._rescored(report, plan)
        if rescored is not None:
            document["predicted"] = dataclasses.asdict(rescored)
        document["measured"] = _measured(plan.key, report, answers)
        return document

    def _rescored(self, report: protocol.ClusterReport | None,
                  plan: protocol.PlanAssignment) -> Prediction | None:
        """`rescore` once per report and plan (status may be read many times a second)."""
        manifest = self.deployment.manifest
        if report is None or manifest is None:
            return None
        cached = self._rescore
        if cached is None or cached[0] is not report or cached[1] != plan.key:
            self._rescore = cached = (report, plan.key, rescore(report, plan, manifest))
        return cached[2]

    def model_status(self, report: protocol.ClusterReport | None) -> dict[str, Any] | None:
        """The model as this peer knows it: from the leader's own look at it, this peer's
        sharding, the plan it holds, or the figures naming a model peer."""
        model = self.coordinator.model if self.cluster.leading else None
        host, plan = self.model_host, self.deployment.assignment
        if model is None and host is not None:
            model = ModelStatus(self.cluster.me, host.name, host.state, host.detail,
                                host.manifest)
        if model is None and plan is not None and plan.model and plan.model_peer:
            manifest = self.deployment.manifest
            state = ModelState.READY if manifest else ModelState.UNKNOWN
            model = ModelStatus(plan.model_peer, plan.model, state, plan.problem or "", manifest)
        holder = next((f for f in report.peers if f.model), None) if report else None
        if model is None and holder is not None and holder.model:
            model = ModelStatus(holder.id, holder.model, ModelState.UNKNOWN, "")
        return model.document() if model else None


def _measured(plan: str, report: protocol.ClusterReport | None,
              answers: protocol.AnswerFigures | None) -> dict[str, Any] | None:
    """The answers' figures on plan `plan`: this peer's, else the head's in the report."""
    if answers is None or answers.plan != plan:
        peers = report.peers if report else ()
        answers = next((f.answers for f in peers if f.answers and f.answers.plan == plan), None)
    if answers is None:
        return None
    return {"latency_s": answers.latency_s, "throughput_tps": answers.throughput_tps,
            "tokens": answers.tokens}
