"""The membership state machine and failure detector, without a network."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.cluster.membership import (
    Connect,
    Departed,
    Disconnect,
    Discovered,
    DuplicateFound,
    DuplicateResolved,
    HeartbeatSeen,
    Membership,
    PeerState,
    Stalled,
    StateChanged,
    Tick,
    Timing,
    apply,
)
from peerd.cluster.records import PeerRecord

TIMING = Timing(heartbeat_s=0.25, suspect_after_s=1.0, dead_after_s=2.0, forget_after_s=10.0)


def record(peer: str, instance: str = "i1", port: int = 5000) -> PeerRecord:
    return PeerRecord(peer, f"name-{peer}", instance, f"key-{peer}", port, port + 1, port + 2)


def start() -> Membership:
    return Membership("me", "mine", TIMING)


def run(state, *events):
    actions = []
    for event in events:
        state, new = apply(state, event)
        actions.extend(new)
    return state, actions


def beat(peer, now, instance="i1", flops=1e9, mains=True):
    return HeartbeatSeen(peer, instance, mains, flops, now)


def test_a_discovered_peer_is_connected_and_suspect_until_heard():
    state, actions = run(start(), Discovered(record("b"), "10.0.0.2", 0.0))
    assert actions == [Connect(record("b"), "10.0.0.2"), StateChanged("b", PeerState.SUSPECT, None)]
    assert not state.settled() and state.voters() == ()
    state, actions = run(state, beat("b", 0.1, flops=5e9, mains=False))
    member = state.members["b"]
    assert (member.state, member.flops, member.mains) == (PeerState.ALIVE, 5e9, False)
    assert actions == [StateChanged("b", PeerState.ALIVE, PeerState.SUSPECT)]
    assert state.settled() and [m.id for m in state.voters()] == ["b"]


def test_silence_makes_a_peer_suspect_then_dead_then_forgotten():
    state, _ = run(start(), Discovered(record("b"), "a", 0.0), beat("b", 0.0))
    state, actions = run(state, Tick(0.9))
    assert actions == []
    state, actions = run(state, Tick(1.1))
    assert actions == [StateChanged("b", PeerState.SUSPECT, PeerState.ALIVE)]
    state, actions = run(state, Tick(2.1))
    assert actions == [StateChanged("b", PeerState.DEAD, PeerState.SUSPECT)]
    assert "b" not in state.reachable() and state.settled()
    state, actions = run(state, *ticks(2.1, 10.5))
    assert actions == [Disconnect("b", "key-b")] and state.members == {}


def ticks(after: float, until: float, every: float = TIMING.heartbeat_s) -> list[Tick]:
    """The ticks of a daemon that runs steadily from `after` to `until`."""
    count = int((until - after) / every)
    return [Tick(after + every * i) for i in range(1, count + 1)] + [Tick(until)]


def test_a_daemon_that_stalled_does_not_count_the_gap_as_everyone_s_silence():
    state, _ = run(start(), Discovered(record("b"), "a", 0.0), Discovered(record("c"), "a", 0.0),
                   beat("b", 0.0), beat("c", 0.0), Tick(0.25), beat("b", 0.5), Tick(0.5))
    state, actions = run(state, Tick(15.5))  # frozen for 15 s
    assert actions == [Stalled(15.0)]
    assert {m.state for m in state.members.values()} == {PeerState.ALIVE}
    slow, actions = run(state, *ticks(15.5, 16.5, every=1.0), beat("b", 16.5),
                        *ticks(16.5, 19.5, every=1.5))
    assert Stalled not in map(type, actions)  # a slow loop still sees a silent peer die
    assert slow.members["c"].state is PeerState.DEAD
    state, actions = run(state, beat("b", 15.6), *ticks(15.5, 16.5), beat("b", 16.5),
                         *ticks(16.5, 17.25))
    assert actions == [StateChanged("c", PeerState.SUSPECT, PeerState.ALIVE),
                       StateChanged("c", PeerState.DEAD, PeerState.SUSPECT)]
    assert state.members["b"].state is PeerState.ALIVE  # c was silent 2 s of running time


def test_a_heartbeat_brings_a_dead_peer_back():
    state, _ = run(start(), Discovered(record("b"), "a", 0.0), beat("b", 0.0), Tick(3.0))
    assert state.members["b"].state is PeerState.DEAD
    state, actions = run(state, beat("b", 3.1))
    assert actions == [StateChanged("b", PeerState.ALIVE, PeerState.DEAD)]


def test_a_goodbye_of_the_current_run_marks_the_peer_dead_at_once():
    state, _ = run(start(), Discovered(record("b"), "a", 0.0), beat("b", 0.0))
    unchanged, actions = run(state, Departed("b", "older-run", 0.1))
    assert actions == [] and unchanged == state
    state, actions = run(state, Departed("b", "i1", 0.1))
    assert actions == [StateChanged("b", PeerState.DEAD, PeerState.ALIVE)]


def test_a_new_address_for_the_same_run_reconnects_without_changing_state():
    state, _ = run(start(), Discovered(record("b"), "a", 0.0), beat("b", 0.0))
    state, actions = run(state, Discovered(record("b", port=6000), "a2", 0.2))
    assert actions == [Connect(record("b", port=6000), "a2")]
    assert state.members["b"].state is PeerState.ALIVE
    assert run(state, Discovered(record("b", port=6000), "a2", 0.3))[1] == []


def test_a_restart_replaces_the_old_run_without_a_duplicate_report():
    state, _ = run(start(), Discovered(record("b"), "a", 0.0), beat("b", 0.0))
    state, actions = run(state, Discovered(record("b", "i2"), "a", 0.5))
    assert actions == [
        Connect(record("b", "i2"), "a"), StateChanged("b", PeerState.SUSPECT, PeerState.ALIVE)
    ]
    state, actions = run(state, beat("b", 0.6, "i2"), Tick(5.0), beat("b", 5.0, "i2"))
    assert not any(isinstance(a, DuplicateFound) for a in actions)
    assert state.members["b"].state is PeerState.ALIVE


def test_two_runs_with_one_identity_are_reported_not_merged():
    state, _ = run(start(), Discovered(record("b"), "a", 0.0), beat("b", 0.0))
    state, _ = run(state, Discovered(record("b", "i2"), "elsewhere", 0.1), beat("b", 0.2, "i2"))
    state, actions = run(state, beat("b", 0.3, "i1"), beat("b", 0.4, "i1"))
    found = [a for a in actions if isinstance(a, DuplicateFound)]
    assert len(found) == 1 and found[0].peer_id == "b"
    assert state.members["b"].duplicate and state.voters() == ()
    # The copy disappears: once it has been silent long enough, the peer counts again.
    state, actions = run(state, beat("b", 2.0, "i2"), Tick(2.5), beat("b", 2.6, "i2"))
    assert actions == [DuplicateResolved("b")]
    assert [m.id for m in state.voters()] == ["b"]


def test_our_own_identity_elsewhere_is_reported_once():
    state, actions = run(start(), Discovered(record("me", "mine"), "here", 0.0))
    assert actions == [] and state.self_duplicate is None
    state, actions = run(
        state, Discovered(record("me", "copy"), "10.0.0.9", 0.1),
        Discovered(record("me", "copy"), "10.0.0.9", 0.2),
    )
    assert [type(a) for a in actions] == [DuplicateFound]
    assert state.self_duplicate == "10.0.0.9" and state.members == {}
    state, actions = run(state, Departed("me", "copy", 1.0))
    assert actions == [DuplicateResolved("me")] and state.self_duplicate is None


def test_heartbeats_from_unknown_peers_or_runs_are_ignored():
    state, _ = run(start(), Discovered(record("b"), "a", 0.0))
    after, actions = run(state, beat("zzz", 0.1), beat("b", 0.1, "unknown-run"))
    assert actions == [] and after == state


# -- properties over random event sequences ---------------------------------------------------

PEERS = ["b", "c", "d"]
events = st.one_of(
    st.tuples(st.just("discover"), st.sampled_from(PEERS), st.sampled_from(["i1", "i2"]),
              st.sampled_from(["x", "y"])),
    st.tuples(st.just("beat"), st.sampled_from(PEERS), st.sampled_from(["i1", "i2"])),
    st.tuples(st.just("bye"), st.sampled_from(PEERS), st.sampled_from(["i1", "i2"])),
    st.tuples(st.just("tick")),
)


def _event(spec, now):
    match spec:
        case ("discover", peer, instance, address):
            return Discovered(record(peer, instance), address, now)
        case ("beat", peer, instance):
            return beat(peer, now, instance)
        case ("bye", peer, instance):
            return Departed(peer, instance, now)
        case ("tick",):
            return Tick(now)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(events, st.floats(0, 3)), max_size=60))
def test_random_histories_keep_states_sockets_and_reports_consistent(history):
    state, now = start(), 0.0
    sockets = {}  # what the transport would hold after carrying out every action
    for spec, delay in history:
        now += delay
        state, actions = apply(state, _event(spec, now))
        for action in actions:
            if isinstance(action, Connect):
                sockets[action.record.id] = (action.record, action.address)
            elif isinstance(action, Disconnect):
                del sockets[action.peer_id]
            elif isinstance(action, StateChanged):
                assert state.members[action.peer_id].state is action.state
        assert sockets == {m.id: (m.record, m.address) for m in state.members.values()}
        assert "me" not in state.members
        if spec == ("tick",):
            for member in state.members.values():
                silent = now - member.last_heard
                if member.state is PeerState.ALIVE:
                    assert silent <= TIMING.suspect_after_s
                if silent > TIMING.dead_after_s:
                    assert member.state is PeerState.DEAD
        for member in state.voters():
            assert member.heard and not member.duplicate


def test_membership_is_immutable():
    state = start()
    after, _ = apply(state, Discovered(record("b"), "a", 0.0))
    assert state.members == {} and after.members != {}
    assert dataclasses.is_dataclass(after) and type(after).__dataclass_params__.frozen
