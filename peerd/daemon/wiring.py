"""The daemon (`peerd start`): wires discovery, membership, election, measurement and the
local API around the transport, on one asyncio loop (uvloop when available).

Discovery records and heartbeats feed the membership state machine; its view of who is alive
feeds the election state machine; both return actions that this module carries out (open
sockets, send votes, publish events). While this peer leads, it measures every peer and link
each round, shares the figures with everyone, and then plans and hands the plan out
(``solve_and_deploy``, peerd/control/coordinator.py). Every peer deploys its stage of the plan it
gets (peerd/control/deploy.py); the peer started with --model shards the model in a child process
and serves its unit files (peerd/control/model_host.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import logging
import math
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from peerd import statedir
from peerd.api import openai_api, status
from peerd.api.local_api import EventBus, LocalApi, Send
from peerd.api.openai_api import OpenAiApi, served_model
from peerd.api.plan_events import plan_events
from peerd.cluster import election, membership
from peerd.cluster.benchmark import PROBE_BYTES, collect_figures, collect_links, measure_links
from peerd.cluster.discovery import MdnsDiscovery, StaticPeers, advertised_addresses, parse_peer
from peerd.cluster.election import Candidate, Role
from peerd.cluster.history import FiguresHistory
from peerd.cluster.monitor import Monitor, on_mains, parse_size
from peerd.cluster.records import PeerRecord, RecordError, verify
from peerd.control import rebalance
from peerd.control.coordinator import Coordinator, ModelStatus
from peerd.control.deploy import Deployment
from peerd.control.model_host import ModelHost
from peerd.control.unit_store import UnitStore
from peerd.control.unit_transfer import CHUNK_TIMEOUT_S, ChunkServer
from peerd.daemon.limits import raise_file_limit
from peerd.daemon.sd_notify import Notifier
from peerd.errors import PeerdError
from peerd.inference.serving import Serving
from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret, Identity, load_identity, load_secret
from peerd.wire.transport import Endpoint, Incoming, Transport, TransportError
from shards.gguf.file import SUFFIX as GGUF_SUFFIX
from shards.gguf.file import is_gguf
from shards.manifest import Quant
from shards.source import open_model

log = logging.getLogger("peerd.daemon.wiring")

MEASURE_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 60.0
CAPABILITY_CHECK_S = 1.0
LINK_RETRY_S = 3.0  # after a round that could not measure every link
SHUTDOWN_STEP_S = 5.0
UNITS_DIR = "units"  # the unit file cache in the state directory
ELECTION_KINDS = (protocol.VoteRequest, protocol.Vote, protocol.LeaderAnnounce)
SERVING_KINDS = (
    protocol.StageData, protocol.SequenceOpen, protocol.SequenceToken, protocol.SequenceDrop,
    protocol.SequenceFailed, protocol.SequenceStatsRequest, protocol.SequenceMove,
    protocol.SequenceState, protocol.ChatRequest, protocol.ChatEvent, protocol.ChatCancel,
)


@dataclasses.dataclass(frozen=True)
class Options:
    state_dir: Path
    interface: str | None = None
    port: int = 0
    memory_budget: int | None = None
    static_peers: tuple[tuple[str, int], ...] = ()
    battery_file: str | None = None
    model: str | None = None
    quant: Quant = Quant.NONE  # the weights of the units made of `model`
    membership_timing: membership.Timing = membership.Timing()
    election_timing: election.Timing = election.Timing()
    measure_interval_s: float = 1.0  # figures from every peer; links every links_interval_s
    links_interval_s: float = 60.0
    probe_bytes: int = PROBE_BYTES
    fp16_wire: bool = False
    rebalance: bool = True  # as leader, move work when load or battery change
    objective: str = "throughput"  # what this peer's plans optimise while it leads
    openai: openai_api.Settings | None = None  # the OpenAI-compatible endpoint, if served


class Daemon:
    def __init__(self, identity: Identity, secret: ClusterSecret, options: Options):
        self.identity = identity
        self.secret = secret
        self.options = options
        self.instance = secrets.token_hex(4)
        model_name = open_model(options.model).name if options.model else None
        self.monitor = Monitor(
            identity.id, options.memory_budget, options.battery_file, model_name
        )
        self.transport = Transport(
            identity.keys, secret, self._on_message, options.interface, options.port
        )
        self.membership = membership.Membership(
            identity.id, self.instance, options.membership_timing
        )
        mains = on_mains(self.monitor.battery.read())
        self.election = election.Election(
            me=Candidate(identity.id, mains, 0.0), timing=options.election_timing
        )
        self.events = EventBus()
        self.report: protocol.ClusterReport | None = None
        self.history = FiguresHistory()
        self.model_host = (
            ModelHost(Path(options.model), options.state_dir, options.quant)
            if options.model else None
        )
        self.chunks = ChunkServer(self._served_files)
        self.deployment = Deployment(
            identity.id, UnitStore(options.state_dir / UNITS_DIR), self._unit_asker,
            self._send_deploy_report, local_files=self._served_files,
        )
        self.coordinator = Coordinator(
            self._ask_manifest, self._send_plan, objective=options.objective,
            policy=rebalance.Policy() if options.rebalance else None,
        )
        self.serving = Serving(
            identity.id, self.transport, Path(options.model) if options.model else None,
            fp16_wire=options.fp16_wire,
        )
        self._peers_view: election.PeersChanged | None = None
        self._links: tuple[protocol.LinkFigures, ...] = ()
        self._linked: frozenset[str] = frozenset()
        self._links_at = -math.inf
        self._round: asyncio.Task | None = None
        self._probing: tuple[int, asyncio.Task] | None = None  # (epoch, session)
        self._stopping = asyncio.Event()
        self._remeasure = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._beats = itertools.count()
        self._handlers = {
            protocol.Heartbeat: self._heartbeat,
            protocol.Goodbye: self._goodbye,
            protocol.VoteRequest: self._vote_request,
            protocol.Vote: self._vote,
            protocol.LeaderAnnounce: self._leader_announce,
            protocol.MeasureRequest: self._measure_request,
            protocol.ProbeRequest: self._probe_request,
            protocol.Ping: lambda member, msg, incoming: incoming.reply(protocol.Pong(msg.req)),
            protocol.BandwidthProbe: self._bandwidth_probe,
            protocol.ClusterReport: self._cluster_report,
            protocol.ManifestRequest: self._manifest_request,
            protocol.PlanAssignment: self._plan_assignment,
            protocol.DeployReport: self._deploy_report,
            protocol.UnitChunkRequest: self._unit_chunk_request,
            **{kind: self._serving_message for kind in SERVING_KINDS},
        }

    @property
    def id(self) -> str:
        return self.identity.id

    # -- lifetime -----------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        self.notifier = Notifier.from_environment()
        raise_file_limit()
        try:
            ports = self.transport.start()
        except TransportError as exc:
            await self.transport.close()
            raise PeerdError(str(exc)) from None
        self.record = PeerRecord(
            self.id, self.identity.name, self.instance, self.identity.keys.public,
            ports.hello, ports.control, ports.data,
        )
        self.api = LocalApi(
            statedir.socket_path(self.options.state_dir),
            {"status": self._op_status, "stop": self._op_stop, "subscribe": self._op_subscribe,
             "chat": self._op_chat, "rebalance": self._op_rebalance},
        )
        self.openai = (
            OpenAiApi(self._op_chat, lambda: served_model(self.deployment), self.options.openai)
            if self.options.openai else None
        )
        self.discovery = MdnsDiscovery(
            self.record, self.secret, self.options.interface, self._on_record,
            self._on_departure,
        )
        try:
            await self.api.start()
            if self.openai is not None:
                await self.openai.start()
            await self.discovery.start()
            self._start_loops()
            log.info("peerd %s (%s) started: hello %d, control %d, data %d, instance %s",
                     self.identity.name, self.id, ports.hello, ports.control, ports.data,
                     self.instance)
            self.notifier.ready(f"{self.identity.name} ready: hello {ports.hello}, "
                                f"control {ports.control}, data {ports.data}")
            await self._stopping.wait()
        finally:
            await self._shutdown()

    def _start_loops(self) -> None:
        self._spawn(self._heartbeats())
        self._spawn(self._watch_capability())
        self._spawn(self._lead())
        self._spawn(self.notifier.feed_watchdog())
        if self.model_host is not None:
            self._spawn(self.model_host.run())
        if self.options.static_peers:
            static = StaticPeers(
                list(self.options.static_peers), self.record, self.secret, self.transport,
                self._on_record,
            )
            self._spawn(static.run())

    def stop(self) -> None:
        log.info("stopping")
        self._stopping.set()

    async def _shutdown(self) -> None:
        if self.openai is not None:
            await _within("the OpenAI endpoint", self.openai.close())
        self.notifier.stopping()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await _within("the daemon's tasks", asyncio.gather(*tasks, return_exceptions=True),
                      tasks)
        await _within("serving", self.serving.close())
        await _within("deployment", self.deployment.close())
        if self.model_host is not None:
            await _within("the model host", self.model_host.close())
        goodbye = protocol.Goodbye(self.instance)
        for peer_id in self.membership.members:
            self.transport.send(peer_id, goodbye)
        # mDNS goodbyes; meanwhile the control goodbyes flush
        await _within("discovery", self.discovery.close())
        await _within("the local API", self.api.close())
        await _within("the transport", self.transport.close())
        log.info("stopped")

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    # -- discovery ------------------------------------------------------------------------------

    def _on_record(self, record: PeerRecord, address: str) -> None:
        self._membership_event(membership.Discovered(record, address, time.monotonic()))

    def _on_departure(self, peer_id: str, instance: str) -> None:
        self._membership_event(membership.Departed(peer_id, instance, time.monotonic()))

    def _hello(self, incoming: Incoming) -> None:
        try:
            record = verify(incoming.msg.record, self.secret)
        except RecordError as exc:
            log.warning("refused a hello from %s: %s", incoming.peer_address, exc)
            return
        self._on_record(record, incoming.peer_address)
        incoming.reply(protocol.Hello(record=self.record.signed(self.secret)))

    # -- the state machines -------------------------------------------------------------------

    def _membership_event(self, event: membership.Event) -> None:
        self.membership, actions = membership.apply(self.membership, event)
        for action in actions:
            self._carry_out_membership(action)
        self._update_election_view(event.now)

    def _carry_out_membership(self, action: membership.Action) -> None:
        match action:
            case membership.Connect(record=record, address=address):
                self.transport.admit(record.public_key)
                self.transport.connect(
                    record.id,
                    Endpoint(address, record.control_port, record.data_port, record.public_key),
                )
            case membership.Disconnect(peer_id=peer_id, public_key=public_key):
                self.transport.disconnect(peer_id)
                self.transport.revoke(public_key)
            case membership.StateChanged(peer_id=peer_id, state=state, previous=previous):
                name = self.membership.members[peer_id].record.name
                log.info("peer %s (%s): %s -> %s", name, peer_id, previous, state)
                self.events.publish({"event": "peer", "id": peer_id, "name": name,
                                     "state": str(state)})
            case membership.DuplicateFound(peer_id=peer_id, detail=detail):
                log.error("duplicate identity %s: %s", peer_id, detail)
                self.events.publish({"event": "duplicate", "id": peer_id, "detail": detail})
            case membership.DuplicateResolved(peer_id=peer_id):
                log.info("duplicate identity %s resolved", peer_id)
                self.events.publish({"event": "duplicate-resolved", "id": peer_id})
            case membership.Stalled(seconds=seconds):
                log.warning("this daemon stalled %.1f s (frozen, suspended or starved of CPU): "
                            "waiting for the others' heartbeats before judging them", seconds)

    def _update_election_view(self, now: float) -> None:
        view = election.PeersChanged(
            peers=tuple(Candidate(m.id, m.mains, m.flops) for m in self.membership.voters()),
            reachable=self.membership.reachable(),
            settled=self.membership.settled(),
            now=now,
        )
        last = self._peers_view
        if last is not None and dataclasses.replace(last, now=now) == view:
            return
        self._peers_view = view
        if last is None or {c.id for c in last.peers} != {c.id for c in view.peers}:
            self._remeasure.set()
        self._election_event(view)

    def _election_event(self, event: election.Event) -> None:
        self.election, actions = election.apply(self.election, event)
        for action in actions:
            self._carry_out_election(action)

    def _carry_out_election(self, action: election.Action) -> None:
        me = self.election.me
        match action:
            case election.RequestVotes(epoch=epoch, voters=voters):
                log.info("standing for leader of epoch %d", epoch)
                for voter in voters:
                    self.transport.send(voter, protocol.VoteRequest(epoch, me.mains, me.flops))
            case election.SendVote(to=to, epoch=epoch, granted=granted):
                self.transport.send(to, protocol.Vote(epoch, granted))
            case election.AnnounceLeader(epoch=epoch, to=to):
                for peer_id in to:
                    self.transport.send(peer_id, protocol.LeaderAnnounce(epoch))
            case election.LeaderChanged(leader=leader, epoch=epoch):
                log.info("leader of epoch %d: %s", epoch, leader or "none")
                self.events.publish({"event": "leader", "leader": leader, "epoch": epoch})
                self._end_stale_measurements(leader, epoch)
                if leader == self.id:
                    self._remeasure.set()

    def _end_stale_measurements(self, leader: str | None, epoch: int) -> None:
        """A new epoch ends the probing done for an older one, and a deposed leader's round."""
        if self._probing is not None and self._probing[0] < epoch:
            self._probing[1].cancel()
        if leader != self.id and self._round is not None:
            self._round.cancel()

    # -- messages -----------------------------------------------------------------------------

    def _on_message(self, incoming: Incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, protocol.Hello):
            self._hello(incoming)
            return
        member = next(
            (m for m in self.membership.members.values()
             if m.record.public_key == incoming.sender_key),
            None,
        )
        if member is None:
            log.info("dropped %s from a key that is not a member", msg.KIND)
            return
        if member.duplicate and isinstance(msg, ELECTION_KINDS):
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.info("dropped %s from %s: nothing here handles it yet", msg.KIND, member.id)
            return
        handler(member, msg, incoming)

    def _heartbeat(self, member, msg: protocol.Heartbeat, incoming) -> None:
        now = time.monotonic()
        self._membership_event(
            membership.HeartbeatSeen(member.id, msg.instance, msg.mains, msg.flops, now)
        )
        current = self.membership.members.get(member.id)
        if current and current.record.instance == msg.instance and not current.duplicate:
            self._election_event(election.LeaderClaimed(member.id, msg.leader, msg.epoch, now))

    def _goodbye(self, member, msg: protocol.Goodbye, incoming) -> None:
        self._membership_event(membership.Departed(member.id, msg.instance, time.monotonic()))

    def _vote_request(self, member, msg: protocol.VoteRequest, incoming) -> None:
        candidate = Candidate(member.id, msg.mains, msg.flops)
        self._election_event(election.VoteRequested(candidate, msg.epoch, time.monotonic()))

    def _vote(self, member, msg: protocol.Vote, incoming) -> None:
        self._election_event(
            election.VoteReceived(member.id, msg.epoch, msg.granted, time.monotonic())
        )

    def _leader_announce(self, member, msg: protocol.LeaderAnnounce, incoming) -> None:
        if msg.epoch < self.election.epoch:
            # A replayed or late win: unlike a heartbeat's older epoch, it does not mean the
            # sender restarted, so it must not unseat the sender if it leads now.
            log.info("ignored %s's claim to lead old epoch %d", member.id, msg.epoch)
            return
        self._election_event(
            election.LeaderClaimed(member.id, member.id, msg.epoch, time.monotonic())
        )

    def _measure_request(self, member, msg: protocol.MeasureRequest, incoming) -> None:
        if msg.epoch < self.election.epoch:
            return  # a deposed leader's request

        async def answer() -> None:
            incoming.reply(protocol.Measurement(msg.req, await self._own_figures()))

        self._spawn(answer())

    def _probe_request(self, member, msg: protocol.ProbeRequest, incoming) -> None:
        if msg.epoch < self.election.epoch:
            return
        targets = tuple(t for t in msg.targets if t in self.transport.connected())

        async def answer() -> None:
            links = await self._probe(targets, msg.payload_bytes, msg.epoch)
            incoming.reply(protocol.ProbeReport(msg.req, links))

        self._spawn(answer())

    def _bandwidth_probe(self, member, msg: protocol.BandwidthProbe, incoming) -> None:
        incoming.reply(protocol.BandwidthAck(msg.req, msg.tensors["payload"].nbytes))

    def _cluster_report(self, member, msg: protocol.ClusterReport, incoming) -> None:
        if member.id == self.election.leader and msg.epoch == self.election.epoch:
            self.report = msg
            self.history.add(msg)
            self.events.publish(_measurements_event(msg))
            self._refresh_serving()

    # -- loops --------------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        while True:
            now = time.monotonic()
            self._membership_event(membership.Tick(now))
            self._election_event(election.Tick(now))
            state = self.election
            beat = protocol.Heartbeat(
                self.instance, next(self._beats), state.epoch, state.leader,
                state.me.mains, state.me.flops,
            )
            for peer_id in self.membership.members:
                self.transport.send(peer_id, beat)
            await asyncio.sleep(self.options.membership_timing.heartbeat_s)

    async def _watch_capability(self) -> None:
        """Our own FLOP/s (measured at start, then when old) and power, for the election."""
        while True:
            try:
                flops = await self.monitor.flops.current()
            except Exception:  # ONNX Runtime failing: stay unmeasured, try again
                log.exception("measuring FLOP/s failed")
                flops = self.election.me.flops
            me = Candidate(self.id, on_mains(self.monitor.battery.read()), flops)
            if me != self.election.me:
                self._election_event(election.CapabilityChanged(me, time.monotonic()))
            await asyncio.sleep(CAPABILITY_CHECK_S)

    async def _lead(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # races with the event being set, and this loop would outlive `peerd stop`
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.measure_interval_s):
                    await self._remeasure.wait()
            self._remeasure.clear()
            if self.election.role is Role.LEADER:
                self._round = self._spawn(self._measurement_round(self.election.epoch))
                await asyncio.wait({self._round})

    async def _measurement_round(self, epoch: int) -> None:
        peers = [self.id, *sorted(m.id for m in self.membership.voters())]
        figures = await collect_figures(lambda p: self._ask_figures(p, epoch), peers)
        stale = time.monotonic() - self._links_at > self.options.links_interval_s
        if stale or frozenset(peers) != self._linked:
            self._links = await collect_links(lambda s, t: self._ask_links(s, t, epoch), peers)
            self._linked, self._links_at = frozenset(peers), time.monotonic()
            if len(self._links) < len(peers) * (len(peers) - 1):
                # a peer that joined a moment ago may not take probes yet; without its links
                # no plan can use it, so try again soon rather than a whole interval later
                self._links_at -= self.options.links_interval_s - LINK_RETRY_S
        if (self.election.role, self.election.epoch) != (Role.LEADER, epoch):
            return  # deposed while measuring
        report = protocol.ClusterReport(epoch, tuple(figures.values()), self._links)
        self.report = report
        self.history.add(report)
        self._refresh_serving()
        for peer_id in peers[1:]:
            self.transport.send(peer_id, report)
        self.events.publish(_measurements_event(report))
        await self.solve_and_deploy(report)

    async def _ask_figures(self, peer_id: str, epoch: int) -> protocol.PeerFigures:
        if peer_id == self.id:
            return await self._own_figures()
        answer = await self.transport.request(
            peer_id, protocol.MeasureRequest(0, epoch), MEASURE_TIMEOUT_S
        )
        return answer.figures

    async def _ask_links(
        self, source: str, targets: tuple[str, ...], epoch: int
    ) -> tuple[protocol.LinkFigures, ...]:
        size = self.options.probe_bytes
        if source == self.id:
            return await self._probe(targets, size, epoch)
        answer = await self.transport.request(
            source, protocol.ProbeRequest(0, epoch, targets, size), PROBE_TIMEOUT_S
        )
        return answer.links

    async def _probe(
        self, targets: tuple[str, ...], size: int, epoch: int
    ) -> tuple[protocol.LinkFigures, ...]:
        """Measure our links to ``targets``: one session at a time, a new request replacing
        the session in progress (its transfers would distort each other's timings)."""
        if self._probing is not None:
            self._probing[1].cancel()
        session = asyncio.create_task(measure_links(self.transport, self.id, targets, size))
        self._probing = (epoch, session)
        return await session

    async def _own_figures(self) -> protocol.PeerFigures:
        """This peer's readings, with the units it has loaded."""
        return dataclasses.replace(
            await self.monitor.figures(), units=self.deployment.units,
            plan=self.deployment.ready_plan, stage_s=self.serving.stage_seconds(),
        )

    async def solve_and_deploy(self, report: protocol.ClusterReport) -> None:
        """The leader's planning step, after every measurement round (peerd/control/coordinator.py):
        plan anew if the peers or the model changed, and send the plan to members lacking it."""
        members = [self.id, *sorted(m.id for m in self.membership.voters())]
        await self.coordinator.step(report.epoch, report, members)

    # -- deployment ---------------------------------------------------------------------------

    def _served_files(self) -> dict[str, Path]:
        return dict(self.model_host.files) if self.model_host else {}

    def _unit_asker(self, peer_id: str):
        return lambda msg: self.transport.request(peer_id, msg, CHUNK_TIMEOUT_S)

    def _manifest_offer(self, req: int, have: str | None) -> protocol.ManifestOffer:
        if self.model_host is None:
            return protocol.ManifestOffer(req, "", "failed", "this peer serves no model",
                                          None, None)
        return self.model_host.offer(req, have)

    async def _ask_manifest(self, peer_id: str, have: str | None) -> protocol.ManifestOffer:
        if peer_id == self.id:
            return self._manifest_offer(0, have)
        request = protocol.ManifestRequest(0, self.election.epoch, have)
        return await self.transport.request(peer_id, request, MEASURE_TIMEOUT_S)

    def _manifest_request(self, member, msg: protocol.ManifestRequest, incoming) -> None:
        if msg.epoch >= self.election.epoch:
            incoming.reply(self._manifest_offer(msg.req, msg.have))

    def _send_plan(self, peer_id: str, plan: protocol.PlanAssignment) -> None:
        if peer_id == self.id:
            self._take_plan(plan)
        else:
            self.transport.send(peer_id, plan)

    def _plan_assignment(self, member, msg: protocol.PlanAssignment, incoming) -> None:
        if member.id == self.election.leader and msg.epoch == self.election.epoch:
            self._take_plan(msg)
        else:
            log.info("ignored plan %d of epoch %d from %s: not the current leader",
                     msg.plan_id, msg.epoch, member.id)

    def _take_plan(self, plan: protocol.PlanAssignment) -> None:
        if self.deployment.assign(plan):
            for event in plan_events(plan):
                self.events.publish(event)

    def _send_deploy_report(self, report: protocol.DeployReport) -> None:
        self._refresh_serving()  # a stage just loaded gets its plane before the leader hears
        leader = self.election.leader
        if leader == self.id:
            self._take_deploy_report(self.id, report)
        elif leader is not None:
            self.transport.send(leader, report)

    def _deploy_report(self, member, msg: protocol.DeployReport, incoming) -> None:
        self._take_deploy_report(member.id, msg)

    def _take_deploy_report(self, peer_id: str, report: protocol.DeployReport) -> None:
        if self.election.role is not Role.LEADER or report.epoch != self.election.epoch:
            return
        if self.coordinator.on_report(peer_id, report):
            self._remeasure.set()  # a round now shows every peer's loaded units

    # -- serving ------------------------------------------------------------------------------

    def _refresh_serving(self) -> None:
        """Bring the data plane in line with the deployed plan and the leader's last report."""
        figures = self.report.peers if self.report else None
        self.serving.refresh(self.deployment.assignment, self.deployment.loaded, figures)

    def _serving_message(self, member, msg, incoming) -> None:
        # no refresh here, on the hot path: planes follow deploy reports and cluster reports
        self.serving.handle(member.id, msg, incoming.reply)

    def _unit_chunk_request(self, member, msg: protocol.UnitChunkRequest, incoming) -> None:
        async def answer() -> None:
            incoming.reply(await self.chunks.answer(msg))

        self._spawn(answer())

    # -- local API ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        me = status.SelfInfo(
            id=self.id,
            name=self.identity.name,
            instance=self.instance,
            cluster=self.secret.cluster_id,
            address=advertised_addresses(self.options.interface)[0],
            ports=dataclasses.asdict(self.transport.ports),
        )
        counters = status.Counters(
            ignored_records=self.discovery.ignored,
            refused_handshakes=self.transport.zap.denied,
            malformed_messages=self.transport.malformed,
        )
        document = status.build(
            me, self.membership, self.election, self.report, counters,
            self.deployment.plan_document(), self._model(),
        )
        document["deployment"] = self.deployment.status()
        document["history"] = self.history.document()
        document["rebalance"] = self.coordinator.policy is not None
        document["replan_pending"] = (
            self.election.role is Role.LEADER and self.coordinator.settling
        )
        self._refresh_serving()
        document["dataplane"] = self.serving.status()
        document["torch_imported"] = "torch" in sys.modules
        document["openai"] = self.openai.status() if self.openai is not None else None
        return document

    def _model(self) -> dict[str, Any] | None:
        """The model as this peer knows it: from the leader's own look at it, this peer's
        sharding, the plan it holds, or the figures naming a model peer."""
        model = self.coordinator.model if self.election.role is Role.LEADER else None
        host, plan = self.model_host, self.deployment.assignment
        if model is None and host is not None:
            model = ModelStatus(self.id, host.name, host.state, host.detail, host.manifest)
        if model is None and plan is not None and plan.model is not None:
            manifest = self.deployment.manifest
            model = ModelStatus(plan.model_peer, plan.model, "ready" if manifest else "unknown",
                                plan.problem or "", manifest)
        holders = [f for f in self.report.peers if f.model] if self.report else []
        if model is None and holders:
            model = ModelStatus(holders[0].id, holders[0].model, "unknown", "")
        return model.document() if model else None

    async def _op_status(self, request: dict[str, Any], send: Send) -> None:
        await send({"ok": True, "status": self.status()})

    async def _op_rebalance(self, request: dict[str, Any], send: Send) -> None:
        enabled = request.get("enabled")
        if not isinstance(enabled, bool):
            raise PeerdError('"enabled" must be true or false')
        self.coordinator.set_policy(rebalance.Policy() if enabled else None)
        log.info("rebalancing %s (local API)", "on" if enabled else "off")
        await send({"ok": True, "rebalance": enabled})

    async def _op_stop(self, request: dict[str, Any], send: Send) -> None:
        await send({"ok": True, "stopping": True})
        self.stop()

    async def _op_chat(self, request: dict[str, Any], send: Send) -> None:
        self._refresh_serving()
        await self.serving.chat.op_chat(request, send)

    async def _op_subscribe(self, request: dict[str, Any], send: Send) -> None:
        with self.events.subscription() as queue:
            await send({"ok": True, "subscribed": True})
            while True:
                await send(await queue.get())


async def _within(what: str, step, tasks: list[asyncio.Task] = ()) -> None:
    """One step of shutting down, given SHUTDOWN_STEP_S: a stuck step is logged (with the
    tasks still running) and passed over, so `peerd stop` always ends the process."""
    try:
        await asyncio.wait_for(step, SHUTDOWN_STEP_S)
    except TimeoutError:
        stuck = [task.get_coro().__qualname__ for task in tasks if not task.done()]
        log.warning("shutdown: %s did not finish in %gs%s; going on", what, SHUTDOWN_STEP_S,
                    f" ({', '.join(stuck)})" if stuck else "")


def _measurements_event(report: protocol.ClusterReport) -> dict[str, Any]:
    return {"event": "measurements", "epoch": report.epoch, "peers": len(report.peers),
            "links": len(report.links)}


# -- `peerd start` --------------------------------------------------------------------------


def options_from_args(args: argparse.Namespace) -> Options:
    if args.interface:
        try:
            ipaddress.ip_address(args.interface)
        except ValueError:
            raise PeerdError(f"--interface {args.interface!r} is not an IP address") from None
    if not 0 <= args.port <= 65533:
        raise PeerdError(f"--port {args.port} is out of range (it uses PORT..PORT+2)")
    model = Path(args.model) if args.model else None
    if model and not (model.is_dir() or (model.is_file() and is_gguf(model))):
        raise PeerdError(f"--model {args.model} is neither a checkpoint directory nor a "
                         f"{GGUF_SUFFIX} file")
    return Options(
        state_dir=statedir.resolve(args.state_dir),
        interface=args.interface,
        port=args.port,
        memory_budget=parse_size(args.memory_budget) if args.memory_budget else None,
        static_peers=tuple(parse_peer(p) for p in args.peer),
        battery_file=args.battery_file,
        fp16_wire=args.fp16_wire,
        rebalance=not args.no_rebalance,
        objective=args.objective,
        model=args.model,
        quant=args.quant,
        openai=openai_api.settings_from_args(args),
    )


def _refuse_second_daemon(state_dir: Path) -> None:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(statedir.socket_path(state_dir)))
    except OSError:
        return
    finally:
        probe.close()
    raise PeerdError(f"a daemon is already running for {state_dir}")


def _configure_logging(name: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s peerd[{name}] %(levelname)s %(name)s: %(message)s",
    )


def _event_loop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def cmd_start(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    identity = load_identity(options.state_dir)
    secret = load_secret(options.state_dir)
    _refuse_second_daemon(options.state_dir)
    _configure_logging(identity.name)
    os.umask(0o077)
    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        runner.run(Daemon(identity, secret, options).run())
    return 0
