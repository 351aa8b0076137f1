"""This peer's view of the cluster: who is a member and who leads.

Discovery records, hellos, heartbeats and goodbyes are events of the membership state machine
(peerd/cluster/membership.py); its view of who is alive, and votes and leader claims, are events
of the election state machine (peerd/cluster/election.py). Both return actions, carried out
here: admit and connect a member, send votes, announcements and heartbeats, publish `peer`,
`duplicate` and `leader` events. What the rooms above need to hear is handed to the
subscribers as a `Change`: the voters changed, or the leader did (election.LeaderChanged).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from peerd.cluster import election, membership
from peerd.cluster.election import Candidate, Role
from peerd.cluster.membership import Member
from peerd.cluster.monitor import Monitor, on_mains
from peerd.cluster.records import PeerRecord, RecordError, verify
from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret
from peerd.wire.transport import Endpoint, Incoming, Transport

log = logging.getLogger("peerd.cluster.peers")

CAPABILITY_CHECK_S = 1.0

# How a room answers one kind of message from a member.
Handler = Callable[[Member, Any, Incoming], None]
Publish = Callable[[dict[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class VotersChanged:
    """The set of voting members changed: figures and links need measuring again."""

    voters: frozenset[str]


Change = VotersChanged | election.LeaderChanged


class ClusterView:
    def __init__(self, me: str, instance: str, secret: ClusterSecret, transport: Transport,
                 mains: bool, publish: Publish,
                 membership_timing: membership.Timing = membership.Timing(),  # noqa: B008
                 election_timing: election.Timing = election.Timing()):  # noqa: B008
        self.me = me
        self.instance = instance
        self.secret = secret
        self.transport = transport
        self.publish = publish
        self.heartbeat_s = membership_timing.heartbeat_s
        self.membership = membership.Membership(me, instance, membership_timing)
        self.election = election.Election(me=Candidate(me, mains, 0.0), timing=election_timing)
        self.record: PeerRecord | None = None  # ours, once the transport has its ports
        self._view: election.PeersChanged | None = None
        self._subscribers: list[Callable[[Change], None]] = []
        self._beats = itertools.count()

    def subscribe(self, subscriber: Callable[[Change], None]) -> None:
        self._subscribers.append(subscriber)

    # -- what the rooms above read ------------------------------------------------------------

    @property
    def leader(self) -> str | None:
        return self.election.leader

    @property
    def epoch(self) -> int:
        return self.election.epoch

    @property
    def leading(self) -> bool:
        return self.election.role is Role.LEADER

    def leads(self, epoch: int) -> bool:
        """Whether this peer is the leader of `epoch` (not deposed since)."""
        return self.leading and self.election.epoch == epoch

    def voters(self) -> list[str]:
        """This peer first, then the voting members by id: the peers a plan may use."""
        return [self.me, *sorted(m.id for m in self.membership.voters())]

    def name_of(self, peer_id: str) -> str:
        """The peer's human name, or its id if it is not a member."""
        member = self.membership.members.get(peer_id)
        return member.record.name if member else peer_id

    def member_by_key(self, public_key: str) -> Member | None:
        return next((m for m in self.membership.members.values()
                     if m.record.public_key == public_key), None)

    # -- discovery ------------------------------------------------------------------------------

    def on_record(self, record: PeerRecord, address: str) -> None:
        self.apply_membership(membership.Discovered(record, address, time.monotonic()))

    def on_departure(self, peer_id: str, instance: str) -> None:
        self.apply_membership(membership.Departed(peer_id, instance, time.monotonic()))

    def hello(self, incoming: Incoming) -> None:
        """A static peer introduces itself: learn its record, answer with ours."""
        if not isinstance(incoming.msg, protocol.Hello):
            log.warning("refused a %s on the hello socket from %s", incoming.msg.KIND,
                        incoming.peer_address)
            return
        try:
            record = verify(incoming.msg.record, self.secret)
        except RecordError as exc:
            log.warning("refused a hello from %s: %s", incoming.peer_address, exc)
            return
        self.on_record(record, incoming.peer_address)
        if self.record is not None:
            incoming.reply(protocol.Hello(record=self.record.signed(self.secret)))

    # -- the state machines ---------------------------------------------------------------------

    def apply_membership(self, event: membership.Event) -> None:
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
                self.publish({"event": "peer", "id": peer_id, "name": name, "state": str(state)})
            case membership.DuplicateFound(peer_id=peer_id, detail=detail):
                log.error("duplicate identity %s: %s", peer_id, detail)
                self.publish({"event": "duplicate", "id": peer_id, "detail": detail})
            case membership.DuplicateResolved(peer_id=peer_id):
                log.info("duplicate identity %s resolved", peer_id)
                self.publish({"event": "duplicate-resolved", "id": peer_id})
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
        last = self._view
        if last is not None and dataclasses.replace(last, now=now) == view:
            return
        self._view = view
        if last is None or {c.id for c in last.peers} != {c.id for c in view.peers}:
            self._tell(VotersChanged(frozenset(c.id for c in view.peers)))
        self.apply_election(view)

    def apply_election(self, event: election.Event) -> None:
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
                self.publish({"event": "leader", "leader": leader, "epoch": epoch})
                self._tell(action)

    def _tell(self, change: Change) -> None:
        for subscriber in self._subscribers:
            subscriber(change)

    # -- messages -------------------------------------------------------------------------------

    def handlers(self) -> dict[type, Handler]:
        return {
            protocol.Heartbeat: self._heartbeat,
            protocol.Goodbye: self._goodbye,
            protocol.VoteRequest: self._vote_request,
            protocol.Vote: self._vote,
            protocol.LeaderAnnounce: self._leader_announce,
        }

    def _heartbeat(self, member: Member, msg: protocol.Heartbeat, incoming: Incoming) -> None:
        now = time.monotonic()
        self.apply_membership(
            membership.HeartbeatSeen(member.id, msg.instance, msg.mains, msg.flops, now)
        )
        current = self.membership.members.get(member.id)
        if current and current.record.instance == msg.instance and not current.duplicate:
            self.apply_election(election.LeaderClaimed(member.id, msg.leader, msg.epoch, now))

    def _goodbye(self, member: Member, msg: protocol.Goodbye, incoming: Incoming) -> None:
        self.apply_membership(membership.Departed(member.id, msg.instance, time.monotonic()))

    # A member sharing its identity with another daemon takes no part in elections.

    def _vote_request(self, member: Member, msg: protocol.VoteRequest,
                      incoming: Incoming) -> None:
        if not member.duplicate:
            candidate = Candidate(member.id, msg.mains, msg.flops)
            self.apply_election(election.VoteRequested(candidate, msg.epoch, time.monotonic()))

    def _vote(self, member: Member, msg: protocol.Vote, incoming: Incoming) -> None:
        if not member.duplicate:
            self.apply_election(
                election.VoteReceived(member.id, msg.epoch, msg.granted, time.monotonic())
            )

    def _leader_announce(self, member: Member, msg: protocol.LeaderAnnounce,
                         incoming: Incoming) -> None:
        if member.duplicate:
            return
        if msg.epoch < self.election.epoch:
            # A replayed or late win: unlike a heartbeat's older epoch, it does not mean the
            # sender restarted, so it must not unseat the sender if it leads now.
            log.info("ignored %s's claim to lead old epoch %d", member.id, msg.epoch)
            return
        self.apply_election(
            election.LeaderClaimed(member.id, member.id, msg.epoch, time.monotonic())
        )

    # -- loops ----------------------------------------------------------------------------------

    async def heartbeats(self) -> None:
        """Tick both state machines and tell every member we are here, each heartbeat."""
        while True:
            now = time.monotonic()
            self.apply_membership(membership.Tick(now))
            self.apply_election(election.Tick(now))
            state = self.election
            beat = protocol.Heartbeat(
                self.instance, next(self._beats), state.epoch, state.leader,
                state.me.mains, state.me.flops,
            )
            for peer_id in self.membership.members:
                self.transport.send(peer_id, beat)
            await asyncio.sleep(self.heartbeat_s)

    async def watch_capability(self, monitor: Monitor) -> None:
        """Our own FLOP/s (measured at start, then when old) and power, for the election."""
        while True:
            try:
                flops = (await monitor.speeds.current()).decode
            except Exception:  # ONNX Runtime failing: stay unmeasured, try again
                log.exception("measuring FLOP/s failed")
                flops = self.election.me.flops
            me = Candidate(self.me, on_mains(monitor.battery.read()), flops)
            if me != self.election.me:
                self.apply_election(election.CapabilityChanged(me, time.monotonic()))
            await asyncio.sleep(CAPABILITY_CHECK_S)

    def say_goodbye(self) -> None:
        goodbye = protocol.Goodbye(self.instance)
        for peer_id in self.membership.members:
            self.transport.send(peer_id, goodbye)
