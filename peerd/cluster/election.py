"""Leader election with epochs, as a pure state machine.

``apply(state, event) -> (state, actions)`` over frozen dataclasses. The rules:

* Capability orders peers: measured before unmeasured, mains power before battery, more
  FLOP/s before fewer, then the smaller id. The best peer should lead.
* A peer stands for election only when its own FLOP/s and those of every member it knows
  are measured and every member has been heard from (so it knows their capability and who
  leads), it is the best of them, and there is no live leader -- or it *challenges* the
  leader: it is on mains while the leader is on battery, or faster by ``challenge_margin``
  (so measurement noise does not make leadership flap).
* Standing starts epoch ``epoch + 1`` with no leader; the candidate needs a granted vote
  from every member it saw alive when it stood (those that die meanwhile drop out). Votes
  are given once per epoch, and only to a candidate that no known peer outranks and that
  the voter's live leader (if any) does not keep out.
* Any message of a higher epoch moves a peer to that epoch (a leader or candidate steps
  down); messages of a lower epoch are stale and ignored. Leaders announce themselves and
  every heartbeat carries the sender's (epoch, leader), so late joiners catch up.

Partitions, and peers that sleep. An election is a *ballot* ``(epoch, candidate)``: only its
candidate can win it, so two sides of a partition never win the same ballot, even when they
stand in the same epoch number; two leaders of one number that meet keep the better one by
capability (followers switch, the worse leader steps down), and a higher number is followed.
What a ballot must not do is let one isolated peer -- a laptop whose lid closed, a peer cut
off by the network -- bind the others: its epoch is higher than theirs when it returns, and
they would follow the slowest machine of the house. A majority of the members known before
would stop it, but a home of two devices must keep a leader when one is off, and a majority
of two is two. So the rule here is the equivalent for the case that matters: **a win needs
the vote of another member to bind.** A candidate that wins with no granted vote (it saw
nobody, or every voter went away while it stood) leads *alone*: it serves whoever it can
reach -- a lone survivor keeps answering -- but the moment it hears another member it
abdicates, keeping its epoch with no leader. The others then either lead that epoch already
(it adopts their leader), or are behind it and move to it leaderless (the rule above), and
the best peer wins the next epoch with their votes. An isolated peer's win therefore never
survives the heal; a win with votes does, and the best peer challenges it if it outranks it
by the margin. A daemon that was itself frozen does not even stand: membership forgives the
silence across its own stall (peerd/cluster/membership.py), so it wakes as a follower.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping


class Role(enum.StrEnum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    LEADER = "leader"


@dataclasses.dataclass(frozen=True)
class Candidate:
    id: str
    mains: bool
    flops: float

    @property
    def measured(self) -> bool:
        return self.flops > 0

    def order(self) -> tuple:
        """Sort key: the best candidate sorts first."""
        return (not self.measured, not self.mains, -self.flops, self.id)


def best(candidates) -> Candidate:
    return min(candidates, key=Candidate.order)


def challenges(challenger: Candidate, leader: Candidate, margin: float) -> bool:
    if challenger.mains != leader.mains:
        return challenger.mains
    return challenger.flops > leader.flops * margin


@dataclasses.dataclass(frozen=True)
class Timing:
    vote_timeout_s: float = 1.0
    retry_after_s: float = 0.5
    challenge_margin: float = 1.5


@dataclasses.dataclass(frozen=True)
class Election:
    me: Candidate
    timing: Timing = Timing()
    epoch: int = 0
    leader: str | None = None
    role: Role = Role.FOLLOWER
    voted_for: str | None = None
    voters: frozenset[str] = frozenset()  # whose votes the current candidacy needs
    votes: frozenset[str] = frozenset()
    not_before: float = 0.0  # candidacy deadline, or earliest time to stand again
    peers: Mapping[str, Candidate] = dataclasses.field(default_factory=dict)
    reachable: frozenset[str] = frozenset()
    settled: bool = False
    alone: bool = False  # leads by its own vote only: abdicates on hearing another member

    def known(self, peer_id: str) -> Candidate | None:
        return self.me if peer_id == self.me.id else self.peers.get(peer_id)


# -- events ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CapabilityChanged:
    me: Candidate
    now: float


@dataclasses.dataclass(frozen=True)
class PeersChanged:
    """The members that vote (alive, heard), those not dead, and whether all are heard."""

    peers: tuple[Candidate, ...]
    reachable: frozenset[str]
    settled: bool
    now: float


@dataclasses.dataclass(frozen=True)
class VoteRequested:
    candidate: Candidate
    epoch: int
    now: float


@dataclasses.dataclass(frozen=True)
class VoteReceived:
    voter: str
    epoch: int
    granted: bool
    now: float


@dataclasses.dataclass(frozen=True)
class LeaderClaimed:
    """``sender`` says ``leader`` leads ``epoch`` (an announcement, or a heartbeat's view)."""

    sender: str
    leader: str | None
    epoch: int
    now: float


@dataclasses.dataclass(frozen=True)
class Tick:
    now: float


Event = CapabilityChanged | PeersChanged | VoteRequested | VoteReceived | LeaderClaimed | Tick


# -- actions --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RequestVotes:
    epoch: int
    voters: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SendVote:
    to: str
    epoch: int
    granted: bool


@dataclasses.dataclass(frozen=True)
class AnnounceLeader:
    epoch: int
    to: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class LeaderChanged:
    leader: str | None
    epoch: int


Action = RequestVotes | SendVote | AnnounceLeader | LeaderChanged
Result = tuple[Election, tuple[Action, ...]]


def apply(state: Election, event: Event) -> Result:
    before = (state.leader, state.epoch)
    actions: list[Action] = []
    match event:
        case CapabilityChanged():
            state = dataclasses.replace(state, me=event.me)
        case PeersChanged():
            state = dataclasses.replace(
                state,
                peers={c.id: c for c in event.peers if c.id != state.me.id},
                reachable=event.reachable,
                settled=event.settled,
            )
        case VoteRequested():
            state = _vote_requested(state, event, actions)
        case VoteReceived():
            state = _vote_received(state, event)
        case LeaderClaimed():
            state = _leader_claimed(state, event)
        case Tick():
            pass
        case _:
            raise TypeError(f"not an election event: {event!r}")
    state = _evaluate(state, event.now, actions)
    if (state.leader, state.epoch) != before:
        actions.append(LeaderChanged(state.leader, state.epoch))
    return state, tuple(actions)


def _set_leader(state: Election, leader: str | None, alone: bool = False) -> Election:
    role = Role.LEADER if leader == state.me.id else Role.FOLLOWER
    return dataclasses.replace(state, leader=leader, role=role, votes=frozenset(), alone=alone)


def _new_epoch(state: Election, epoch: int) -> Election:
    """Move to a later epoch: nobody leads it yet and we have not voted in it."""
    return _set_leader(dataclasses.replace(state, epoch=epoch, voted_for=None), None)


def _acceptable(state: Election, candidate: Candidate) -> bool:
    """Would this voter be happy with ``candidate`` as leader?"""
    rivals = [c for c in state.peers.values() if c.id != candidate.id]
    if state.me.id != candidate.id and state.me.measured:
        rivals.append(state.me)
    if any(rival.order() < candidate.order() for rival in rivals):
        return False
    leader = state.known(state.leader) if state.leader else None
    if leader is None or leader.id == candidate.id:
        return True
    return challenges(candidate, leader, state.timing.challenge_margin)


def _vote_requested(state: Election, event: VoteRequested, actions: list[Action]) -> Election:
    candidate = event.candidate
    if event.epoch < state.epoch:
        actions.append(SendVote(candidate.id, state.epoch, False))
        return state
    acceptable = _acceptable(state, candidate)
    if event.epoch > state.epoch:
        state = _new_epoch(state, event.epoch)
    granted = acceptable and state.voted_for in (None, candidate.id)
    if granted:
        # Give this candidacy time to finish before standing ourselves.
        state = dataclasses.replace(
            state, voted_for=candidate.id, not_before=event.now + state.timing.vote_timeout_s
        )
    actions.append(SendVote(candidate.id, state.epoch, granted))
    return state


def _vote_received(state: Election, event: VoteReceived) -> Election:
    if event.epoch > state.epoch:
        return _new_epoch(state, event.epoch)
    if state.role is not Role.CANDIDATE or event.epoch != state.epoch:
        return state
    if not event.granted:
        return dataclasses.replace(
            state, role=Role.FOLLOWER, not_before=event.now + state.timing.retry_after_s
        )
    return dataclasses.replace(state, votes=state.votes | {event.voter})


def _leader_claimed(state: Election, event: LeaderClaimed) -> Election:
    if event.sender == state.leader and event.sender != state.me.id and (
        event.leader != event.sender or event.epoch < state.epoch
    ):
        # Our leader says it no longer leads (it restarted, or lost an election we missed).
        state = _set_leader(state, None)
    if event.epoch > state.epoch and event.leader is None:
        # An election we were not asked about (a peer stood without knowing us) moved the
        # others on: follow, or they wait for a leader that never hears the new epoch.
        return _new_epoch(state, event.epoch)
    if event.leader is None or event.epoch < state.epoch:
        return state
    if event.leader == state.me.id and state.role is not Role.LEADER:
        # A claim about a previous run of ours: adopt the epoch, nobody leads it now.
        return _new_epoch(state, event.epoch) if event.epoch > state.epoch else state
    if event.epoch > state.epoch:
        state = dataclasses.replace(state, epoch=event.epoch, voted_for=None)
        return _set_leader(state, event.leader)
    if state.leader is None:
        return _set_leader(state, event.leader)
    current, claimed = state.known(state.leader), state.known(event.leader)
    if claimed is not None and (current is None or claimed.order() < current.order()):
        return _set_leader(state, event.leader)  # two claims for one epoch
    return state


def _should_stand(state: Election, now: float) -> bool:
    if state.role is not Role.FOLLOWER or now < state.not_before:
        return False
    if not (state.settled and all(c.measured for c in [state.me, *state.peers.values()])):
        return False
    if best([state.me, *state.peers.values()]) != state.me:
        return False
    if state.leader is None:
        return True
    leader = state.peers.get(state.leader)
    return leader is not None and challenges(state.me, leader, state.timing.challenge_margin)


def _evaluate(state: Election, now: float, actions: list[Action]) -> Election:
    live = state.reachable | {state.me.id}
    if state.leader is not None and state.leader not in live:
        state = _set_leader(state, None)
    if state.alone and state.peers:
        state = _set_leader(state, None)  # abdicate: the members heard now choose together
    if _should_stand(state, now):
        state = dataclasses.replace(
            state,
            epoch=state.epoch + 1,
            leader=None,
            role=Role.CANDIDATE,
            voted_for=state.me.id,
            voters=frozenset(state.peers),
            votes=frozenset(),
            not_before=now + state.timing.vote_timeout_s,
        )
        if state.voters:
            actions.append(RequestVotes(state.epoch, tuple(sorted(state.voters))))
    if state.role is Role.CANDIDATE:
        if state.voters & set(state.peers) <= state.votes:
            state = _set_leader(state, state.me.id, alone=not state.votes)
            actions.append(AnnounceLeader(state.epoch, tuple(sorted(state.peers))))
        elif now >= state.not_before:
            state = dataclasses.replace(
                state, role=Role.FOLLOWER, not_before=now + state.timing.retry_after_s
            )
    return state
