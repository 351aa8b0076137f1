"""Measuring the cluster: while this peer leads, every round asks each voter for its figures
(peerd/cluster/benchmark.py), probes the links when they are old or the voters changed, and
shares the result with everyone as a ClusterReport; every peer keeps the leader's latest
report and its history. A round runs every `interval_s`, and at once when the voters or the
leader change or a room above asks (`remeasure`: a plan just deployed everywhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from peerd.cluster import election
from peerd.cluster.benchmark import (
    PROBE_BYTES,
    answer_relay,
    collect_figures,
    collect_links,
    measure_links,
)
from peerd.cluster.history import FiguresHistory
from peerd.cluster.membership import Member
from peerd.cluster.peers import ClusterView, Handler, Publish, VotersChanged
from peerd.wire import protocol
from peerd.wire.transport import Incoming, Transport

log = logging.getLogger("peerd.cluster.measuring")

MEASURE_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 60.0
LINK_RETRY_S = 3.0  # after a round that could not measure every link

Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Task]


@dataclasses.dataclass(frozen=True)
class Timing:
    interval_s: float = 1.0  # figures from every peer; links every links_interval_s
    links_interval_s: float = 60.0
    probe_bytes: int = PROBE_BYTES


class Measuring:
    def __init__(self, cluster: ClusterView, transport: Transport,
                 own_figures: Callable[[], Awaitable[protocol.PeerFigures]],
                 spawn: Spawn, publish: Publish, timing: Timing = Timing()):  # noqa: B008
        """`own_figures()` reads this peer's figures; `spawn` runs an answer in the
        background; `publish` tells local subscribers of each report."""
        self.cluster = cluster
        self.transport = transport
        self.timing = timing
        self._own_figures = own_figures
        self._spawn = spawn
        self._publish = publish
        self.report: protocol.ClusterReport | None = None  # the leader's latest
        self.history = FiguresHistory()
        self.links: tuple[protocol.LinkFigures, ...] = ()
        self.links_at = -math.inf
        self._linked: frozenset[str] = frozenset()
        self._round: asyncio.Task | None = None
        self._planning = False  # the round has measured and is planning: let it finish
        self._voters: frozenset[str] = frozenset()
        self._probing: tuple[int, asyncio.Task] | None = None  # (epoch, session)
        self._remeasure = asyncio.Event()
        self._listeners: list[Callable[[protocol.ClusterReport], None]] = []
        cluster.subscribe(self._cluster_changed)

    def on_report(self, listener: Callable[[protocol.ClusterReport], None]) -> None:
        """Call `listener` with every report of the leader, on every peer."""
        self._listeners.append(listener)

    def remeasure(self) -> None:
        self._remeasure.set()

    def _cluster_changed(self, change: VotersChanged | election.LeaderChanged) -> None:
        match change:
            case VotersChanged(voters=voters):
                if self._voters - voters:
                    self._abandon_measuring()
                self._voters = voters
                self._remeasure.set()
            case election.LeaderChanged(leader=leader, epoch=epoch):
                self._end_stale(leader, epoch)
                if leader == self.cluster.me:
                    self._remeasure.set()

    def _abandon_measuring(self) -> None:
        """A voter left: a round still measuring may be waiting on it, and a frozen peer's
        sockets stay open, so its requests would run to their timeouts (10 s for figures)
        before the plan without it. Start over without it at once."""
        if self._round is not None and not self._round.done() and not self._planning:
            self._round.cancel()

    def _end_stale(self, leader: str | None, epoch: int) -> None:
        """A new epoch ends the probing done for an older one, and a deposed leader's round."""
        if self._probing is not None and self._probing[0] < epoch:
            self._probing[1].cancel()
        if leader != self.cluster.me and self._round is not None:
            self._round.cancel()

    def _take(self, report: protocol.ClusterReport) -> None:
        self.report = report
        self.history.add(report)
        self._publish({"event": "measurements", "epoch": report.epoch,
                       "peers": len(report.peers), "links": len(report.links)})
        for listener in self._listeners:
            listener(report)

    # -- the leader -----------------------------------------------------------------------------

    async def lead(self, plan: Callable[[protocol.ClusterReport], Awaitable[None]]) -> None:
        """While this peer leads, measure every round and hand each report to `plan`."""
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # races with the event being set, and this loop would outlive `peerd stop`
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timing.interval_s):
                    await self._remeasure.wait()
            self._remeasure.clear()
            if self.cluster.leading:
                self._round = self._spawn(self._measure_and_plan(self.cluster.epoch, plan))
                await asyncio.wait({self._round})

    async def _measure_and_plan(
        self, epoch: int, plan: Callable[[protocol.ClusterReport], Awaitable[None]]
    ) -> None:
        """One round and its planning step: both end when this peer is deposed."""
        report = await self.round(epoch)
        if report is not None:
            self._planning = True
            try:
                await plan(report)
            finally:
                self._planning = False

    async def round(self, epoch: int) -> protocol.ClusterReport | None:
        """One measurement round for `epoch`; its report goes to every voter (None when
        this peer was deposed meanwhile)."""
        peers = self.cluster.voters()
        figures = await collect_figures(lambda p: self._ask_figures(p, epoch), peers)
        stale = time.monotonic() - self.links_at > self.timing.links_interval_s
        if stale or frozenset(peers) != self._linked:
            self.links = await collect_links(lambda s, t: self._ask_links(s, t, epoch), peers)
            self._linked, self.links_at = frozenset(peers), time.monotonic()
            if len(self.links) < len(peers) * (len(peers) - 1):
                # a peer that joined a moment ago may not take probes yet; without its links
                # no plan can use it, so try again soon rather than a whole interval later
                self.links_at -= self.timing.links_interval_s - LINK_RETRY_S
        if not self.cluster.leads(epoch):
            return None  # deposed while measuring
        report = protocol.ClusterReport(epoch, tuple(figures.values()), self.links)
        self._take(report)
        for peer_id in peers[1:]:
            self.transport.send(peer_id, report)
        return report

    async def _ask_figures(self, peer_id: str, epoch: int) -> protocol.PeerFigures:
        if peer_id == self.cluster.me:
            return await self._own_figures()
        answer = await self.transport.request(
            peer_id, protocol.MeasureRequest(0, epoch), MEASURE_TIMEOUT_S
        )
        return answer.figures

    async def _ask_links(
        self, source: str, targets: tuple[str, ...], epoch: int
    ) -> tuple[protocol.LinkFigures, ...]:
        size = self.timing.probe_bytes
        if source == self.cluster.me:
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
        session = asyncio.create_task(
            measure_links(self.transport, self.cluster.me, targets, size)
        )
        self._probing = (epoch, session)
        return await session

    # -- messages -------------------------------------------------------------------------------

    def handlers(self) -> dict[type, Handler]:
        return {
            protocol.MeasureRequest: self._measure_request,
            protocol.ProbeRequest: self._probe_request,
            protocol.Ping: self._ping,
            protocol.Relay: self._relay,
            protocol.BandwidthProbe: self._bandwidth_probe,
            protocol.ClusterReport: self._cluster_report,
        }

    def _measure_request(self, member: Member, msg: protocol.MeasureRequest,
                         incoming: Incoming) -> None:
        if msg.epoch < self.cluster.epoch:
            return  # a deposed leader's request

        async def answer() -> None:
            incoming.reply(protocol.Measurement(msg.req, await self._own_figures()))

        self._spawn(answer())

    def _probe_request(self, member: Member, msg: protocol.ProbeRequest,
                       incoming: Incoming) -> None:
        if msg.epoch < self.cluster.epoch:
            return
        targets = tuple(t for t in msg.targets if t in self.transport.connected())

        async def answer() -> None:
            links = await self._probe(targets, msg.payload_bytes, msg.epoch)
            incoming.reply(protocol.ProbeReport(msg.req, links))

        self._spawn(answer())

    def _ping(self, member: Member, msg: protocol.Ping, incoming: Incoming) -> None:
        incoming.reply(protocol.Pong(msg.req))

    def _relay(self, member: Member, msg: protocol.Relay, incoming: Incoming) -> None:
        answer_relay(msg, incoming.reply)

    def _bandwidth_probe(self, member: Member, msg: protocol.BandwidthProbe,
                         incoming: Incoming) -> None:
        incoming.reply(protocol.BandwidthAck(msg.req, msg.tensors["payload"].nbytes))

    def _cluster_report(self, member: Member, msg: protocol.ClusterReport,
                        incoming: Incoming) -> None:
        if member.id == self.cluster.leader and msg.epoch == self.cluster.epoch:
            self._take(msg)
