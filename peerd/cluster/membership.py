"""Membership and the failure detector, as a pure state machine.

``apply(state, event) -> (state, actions)`` over frozen dataclasses; the daemon feeds it
discovery records, heartbeats, goodbyes and clock ticks, and carries out the actions.

A member is *suspect* when first discovered (known but not yet heard) and after
``suspect_after_s`` without a heartbeat, *alive* while heartbeats arrive, *dead* after
``dead_after_s`` of silence or a goodbye, and forgotten after ``forget_after_s``.

A daemon can itself be the one that was absent: frozen (SIGSTOP, a thrashing machine) or
starved of CPU. When its clock ticks jump by more than ``dead_after_s``, the silence across
the gap says nothing about the others, so it is not counted: every member keeps the silence
it had before the gap (plus one tick), and the daemon learns who is alive from the
heartbeats that follow instead of declaring everyone dead and standing alone. Shorter gaps
count in full: a daemon whose loop is merely slow must still see a peer die.

Every daemon run has a random instance id. A restart changes it, and the old instance falls
silent. A copied state directory makes two daemons with one identity: they are told apart by
heartbeats from both instances interleaving (the replaced instance speaks again after the
switch). Such a member is flagged *duplicate*, reported, and kept out of elections and
measurements until one instance falls silent; a record or heartbeat carrying our own id with
another instance means our own identity is running elsewhere.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

from peerd.cluster.records import PeerRecord


class PeerState(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclasses.dataclass(frozen=True)
class Timing:
    heartbeat_s: float = 0.25
    suspect_after_s: float = 1.0
    dead_after_s: float = 2.0
    forget_after_s: float = 120.0


@dataclasses.dataclass(frozen=True)
class Member:
    record: PeerRecord
    address: str
    state: PeerState
    last_heard: float
    heard: bool = False  # a heartbeat from this instance arrived: capability known
    mains: bool = True
    flops: float = 0.0
    previous_instance: str | None = None
    previous_heard: float = -math.inf
    duplicate: bool = False

    @property
    def id(self) -> str:
        return self.record.id


@dataclasses.dataclass(frozen=True)
class Membership:
    self_id: str
    self_instance: str
    timing: Timing = Timing()
    members: Mapping[str, Member] = dataclasses.field(default_factory=dict)
    self_duplicate: str | None = None  # address of another daemon with our identity
    last_tick: float | None = None

    def with_member(self, member: Member) -> Membership:
        return dataclasses.replace(self, members={**self.members, member.id: member})

    def voters(self) -> tuple[Member, ...]:
        """Members that take part in elections and measurements."""
        return tuple(
            m for m in self.members.values()
            if m.state is PeerState.ALIVE and m.heard and not m.duplicate
        )

    def reachable(self) -> frozenset[str]:
        return frozenset(m.id for m in self.members.values() if m.state is not PeerState.DEAD)

    def settled(self) -> bool:
        """Every member that is not dead has been heard from at least once."""
        return all(m.heard or m.state is PeerState.DEAD for m in self.members.values())


# -- events ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Discovered:
    record: PeerRecord
    address: str
    now: float


@dataclasses.dataclass(frozen=True)
class Departed:
    peer_id: str
    instance: str
    now: float


@dataclasses.dataclass(frozen=True)
class HeartbeatSeen:
    peer_id: str
    instance: str
    mains: bool
    flops: float
    now: float


@dataclasses.dataclass(frozen=True)
class Tick:
    now: float


Event = Discovered | Departed | HeartbeatSeen | Tick


# -- actions --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Connect:
    """Admit the record's key and open sockets to it (replacing older ones)."""

    record: PeerRecord
    address: str


@dataclasses.dataclass(frozen=True)
class Disconnect:
    """Close the sockets to a forgotten member and stop admitting its key."""

    peer_id: str
    public_key: str


@dataclasses.dataclass(frozen=True)
class StateChanged:
    peer_id: str
    state: PeerState
    previous: PeerState | None


@dataclasses.dataclass(frozen=True)
class DuplicateFound:
    peer_id: str
    detail: str


@dataclasses.dataclass(frozen=True)
class DuplicateResolved:
    peer_id: str


@dataclasses.dataclass(frozen=True)
class Stalled:
    """This daemon's own ticks stopped for ``seconds``: nobody's silence across it counts."""

    seconds: float


Action = Connect | Disconnect | StateChanged | DuplicateFound | DuplicateResolved | Stalled
Result = tuple[Membership, tuple[Action, ...]]


def apply(state: Membership, event: Event) -> Result:
    match event:
        case Discovered():
            return _discovered(state, event)
        case Departed():
            return _departed(state, event)
        case HeartbeatSeen():
            return _heartbeat(state, event)
        case Tick():
            return _tick(state, event.now)
    raise TypeError(f"not a membership event: {event!r}")


def _self_duplicate(state: Membership, instance: str, address: str) -> Result:
    if instance == state.self_instance or state.self_duplicate is not None:
        return state, ()
    detail = f"another daemon at {address} runs with this peer's identity (copied state dir?)"
    return (
        dataclasses.replace(state, self_duplicate=address),
        (DuplicateFound(state.self_id, detail),),
    )


def _discovered(state: Membership, event: Discovered) -> Result:
    record = event.record
    if record.id == state.self_id:
        return _self_duplicate(state, record.instance, event.address)
    known = state.members.get(record.id)
    if known is None:
        member = Member(record, event.address, PeerState.SUSPECT, last_heard=event.now)
        return state.with_member(member), (
            Connect(record, event.address),
            StateChanged(record.id, PeerState.SUSPECT, None),
        )
    if record.instance == known.record.instance:
        if (record, event.address) == (known.record, known.address):
            return state, ()
        moved = dataclasses.replace(known, record=record, address=event.address)
        return state.with_member(moved), (Connect(record, event.address),)
    # A new run of a known id: a restart, or a second daemon with a copied identity.
    replaced = Member(
        record,
        event.address,
        PeerState.SUSPECT,
        last_heard=event.now,
        previous_instance=known.record.instance,
        previous_heard=known.last_heard if known.heard else -math.inf,
        duplicate=known.duplicate and record.instance == known.previous_instance,
    )
    actions: list[Action] = [Connect(record, event.address)]
    if known.state is not PeerState.SUSPECT:
        actions.append(StateChanged(record.id, PeerState.SUSPECT, known.state))
    return state.with_member(replaced), tuple(actions)


def _departed(state: Membership, event: Departed) -> Result:
    if event.peer_id == state.self_id:
        if event.instance != state.self_instance and state.self_duplicate is not None:
            return dataclasses.replace(state, self_duplicate=None), (
                DuplicateResolved(state.self_id),
            )
        return state, ()
    member = state.members.get(event.peer_id)
    if member is None or member.record.instance != event.instance:
        return state, ()
    return _set_state(state, member, PeerState.DEAD)


def _heartbeat(state: Membership, event: HeartbeatSeen) -> Result:
    if event.peer_id == state.self_id:
        return _self_duplicate(state, event.instance, "an unknown address")
    member = state.members.get(event.peer_id)
    if member is None:
        return state, ()
    if event.instance == member.record.instance:
        heard = dataclasses.replace(
            member, last_heard=event.now, heard=True, mains=event.mains, flops=event.flops
        )
        return _set_state(state, heard, PeerState.ALIVE)
    if event.instance != member.previous_instance:
        return state, ()
    # The replaced instance is still talking: two daemons share this identity.
    both = dataclasses.replace(member, previous_heard=event.now, duplicate=True)
    actions: tuple[Action, ...] = ()
    if not member.duplicate:
        detail = f"two daemons run with the identity of {member.record.name} ({member.id})"
        actions = (DuplicateFound(member.id, detail),)
    return state.with_member(both), actions


def _set_state(state: Membership, member: Member, new: PeerState) -> Result:
    updated = dataclasses.replace(member, state=new)
    actions = () if member.state is new else (StateChanged(member.id, new, member.state),)
    return state.with_member(updated), actions


def _forgive_own_stall(state: Membership, now: float) -> Result:
    gap = now - (now if state.last_tick is None else state.last_tick)
    state = dataclasses.replace(state, last_tick=now)
    if gap <= state.timing.dead_after_s:
        return state, ()
    unheard = gap - state.timing.heartbeat_s
    members = {
        peer_id: dataclasses.replace(member, last_heard=min(now, member.last_heard + unheard))
        for peer_id, member in state.members.items()
    }
    return dataclasses.replace(state, members=members), (Stalled(gap),)


def _tick(state: Membership, now: float) -> Result:
    state, stalled = _forgive_own_stall(state, now)
    timing = state.timing
    members = dict(state.members)
    actions: list[Action] = list(stalled)
    for member in state.members.values():
        silent = now - member.last_heard
        if member.state is PeerState.DEAD and silent > timing.forget_after_s:
            del members[member.id]
            actions.append(Disconnect(member.id, member.record.public_key))
            continue
        new = member.state
        if silent > timing.dead_after_s:
            new = PeerState.DEAD
        elif silent > timing.suspect_after_s and member.state is PeerState.ALIVE:
            new = PeerState.SUSPECT
        updated = dataclasses.replace(member, state=new)
        if new is not member.state:
            actions.append(StateChanged(member.id, new, member.state))
        if member.duplicate and now - member.previous_heard > timing.dead_after_s:
            updated = dataclasses.replace(updated, duplicate=False, previous_instance=None)
            actions.append(DuplicateResolved(member.id))
        members[member.id] = updated
    return dataclasses.replace(state, members=members), tuple(actions)
