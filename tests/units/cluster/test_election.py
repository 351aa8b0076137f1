"""The election state machine: rules one by one, then whole clusters simulated with random
message orders, losses, a killed leader, a peer that restarts knowing only some peers,
partitions and heals, and peers that freeze and wake."""

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.cluster.election import (
    AnnounceLeader,
    Candidate,
    CapabilityChanged,
    Election,
    LeaderChanged,
    LeaderClaimed,
    PeersChanged,
    RequestVotes,
    Role,
    SendVote,
    Tick,
    Timing,
    VoteReceived,
    VoteRequested,
    apply,
    best,
    challenges,
)

TIMING = Timing(vote_timeout_s=1.0, retry_after_s=0.5, challenge_margin=1.5)


def cand(peer, flops=1e9, mains=True) -> Candidate:
    return Candidate(peer, mains, flops)


def node(me: Candidate, *peers: Candidate, settled=True) -> Election:
    """A peer that knows these peers and has not yet evaluated anything."""
    return Election(
        me=me, timing=TIMING, peers={p.id: p for p in peers},
        reachable=frozenset(p.id for p in peers), settled=settled,
    )


def run(state, *events):
    actions = []
    for event in events:
        state, new = apply(state, event)
        actions.extend(new)
    return state, actions


def test_ranking_prefers_measured_then_mains_then_flops_then_smaller_id():
    assert best([cand("a", 0), cand("b", 1)]).id == "b"
    assert best([cand("a", 9e9, mains=False), cand("b", 1e9)]).id == "b"
    assert best([cand("a", 1e9), cand("b", 2e9)]).id == "b"
    assert best([cand("b", 1e9), cand("a", 1e9)]).id == "a"


def test_a_lone_measured_peer_leads_epoch_one_at_once():
    state, actions = run(node(cand("a")), Tick(0.1))
    assert (state.role, state.leader, state.epoch) == (Role.LEADER, "a", 1)
    assert LeaderChanged("a", 1) in actions


def test_no_candidacy_until_every_capability_is_measured_and_everyone_is_heard():
    assert run(node(cand("a", 0)), Tick(1))[0].role is Role.FOLLOWER
    assert run(node(cand("a"), settled=False), Tick(1))[0].role is Role.FOLLOWER
    # b is still measuring: it could turn out faster, so a waits rather than win and be
    # challenged a moment later.
    assert run(node(cand("a", 2e9), cand("b", 0)), Tick(1))[0].role is Role.FOLLOWER


def test_only_the_best_stands_and_asks_everyone():
    state, actions = run(node(cand("a", 2e9), cand("b"), cand("c")), Tick(0.1))
    assert state.role is Role.CANDIDATE and state.epoch == 1
    assert RequestVotes(1, ("b", "c")) in actions
    follower, actions = run(node(cand("b"), cand("a", 2e9), cand("c")), Tick(0.1))
    assert follower.role is Role.FOLLOWER and follower.epoch == 0
    assert not any(isinstance(a, RequestVotes) for a in actions)


def test_a_challenger_has_no_leader_while_it_stands():
    state, actions = run(node(cand("b", 2e9), cand("a", 1e9)), LeaderClaimed("a", "a", 4, 0.1))
    assert (state.role, state.leader, state.epoch) == (Role.CANDIDATE, None, 5)
    assert LeaderChanged(None, 5) in actions


def test_the_candidate_wins_with_every_vote_and_announces_itself():
    state, _ = run(node(cand("a", 2e9), cand("b"), cand("c")), Tick(0.1))
    state, actions = run(state, VoteReceived("b", 1, True, 0.2))
    assert state.role is Role.CANDIDATE
    state, actions = run(state, VoteReceived("c", 1, True, 0.3))
    assert (state.role, state.leader) == (Role.LEADER, "a")
    assert AnnounceLeader(1, ("b", "c")) in actions and LeaderChanged("a", 1) in actions


def test_a_voter_that_dies_during_the_candidacy_is_not_waited_for():
    state, _ = run(node(cand("a", 2e9), cand("b"), cand("c")), Tick(0.1),
                   VoteReceived("b", 1, True, 0.2))
    state, _ = run(state, PeersChanged((cand("b"),), frozenset({"b"}), True, 0.4))
    assert state.role is Role.LEADER


def test_a_refusal_or_a_timeout_ends_the_candidacy_and_it_retries_later():
    state, _ = run(node(cand("a", 2e9), cand("b")), Tick(0.1))
    refused, _ = run(state, VoteReceived("b", 1, False, 0.2))
    assert refused.role is Role.FOLLOWER
    assert run(refused, Tick(0.5))[0].role is Role.FOLLOWER
    again, actions = run(refused, Tick(0.8))
    assert again.role is Role.CANDIDATE and RequestVotes(2, ("b",)) in actions
    timed_out, _ = run(state, Tick(1.2))
    assert timed_out.role is Role.FOLLOWER and timed_out.epoch == 1


def test_votes_are_given_once_per_epoch_and_never_for_a_stale_one():
    voter = node(cand("v"), cand("a", 2e9), cand("b", 2e9))
    voter, actions = run(voter, VoteRequested(cand("a", 2e9), 3, 0.1))
    assert SendVote("a", 3, True) in actions and voter.epoch == 3
    voter, actions = run(voter, VoteRequested(cand("b", 2e9), 3, 0.2))
    assert actions == [SendVote("b", 3, False)]
    voter, actions = run(voter, VoteRequested(cand("a", 2e9), 2, 0.3))
    assert actions == [SendVote("a", 3, False)]


def test_no_vote_for_a_candidate_that_a_known_peer_outranks():
    voter = node(cand("v"), cand("a", 1e9), cand("b", 5e9))
    _, actions = run(voter, VoteRequested(cand("a", 1e9), 1, 0.1))
    assert SendVote("a", 1, False) in actions
    _, actions = run(node(cand("v", 9e9), cand("a")), VoteRequested(cand("a"), 1, 0.1))
    assert SendVote("a", 1, False) in actions


def _led_by(me: Candidate, leader: Candidate, *others: Candidate) -> Election:
    state = node(me, leader, *others)
    return run(state, LeaderClaimed(leader.id, leader.id, 4, 0.1))[0]


def test_followers_adopt_announcements_and_ignore_stale_ones():
    state = _led_by(cand("v"), cand("a"))
    assert (state.leader, state.epoch, state.role) == ("a", 4, Role.FOLLOWER)
    stale, actions = run(state, LeaderClaimed("b", "b", 3, 0.2))
    assert (stale.leader, stale.epoch, actions) == ("a", 4, [])


def test_a_higher_epoch_makes_a_leader_step_down():
    leader, _ = run(node(cand("a", 2e9), cand("b")), Tick(0.1), VoteReceived("b", 1, True, 0.2))
    assert leader.role is Role.LEADER
    deposed, actions = run(leader, LeaderClaimed("b", "b", 5, 0.3))
    assert (deposed.role, deposed.leader, deposed.epoch) == (Role.FOLLOWER, "b", 5)
    assert LeaderChanged("b", 5) in actions


def test_a_live_leader_is_kept_against_a_slightly_better_peer():
    state = _led_by(cand("v"), cand("a", 1.0e9), cand("b", 1.2e9))
    state, actions = run(state, Tick(1.0), VoteRequested(cand("b", 1.2e9), 5, 1.1))
    assert SendVote("b", 5, False) in actions
    challenger = _led_by(cand("b", 1.2e9), cand("a", 1.0e9))
    assert run(challenger, Tick(2.0))[0].role is Role.FOLLOWER


def test_a_much_faster_peer_or_one_on_mains_challenges_the_leader():
    fast, actions = run(node(cand("b", 2e9), cand("a", 1e9)), LeaderClaimed("a", "a", 4, 0.1))
    assert fast.role is Role.CANDIDATE and RequestVotes(5, ("a",)) in actions
    mains = _led_by(cand("b", 1e9), cand("a", 3e9, mains=False))
    assert mains.role is Role.CANDIDATE
    voter = _led_by(cand("v"), cand("a", 1e9), cand("b", 2e9))
    assert SendVote("b", 5, True) in run(voter, VoteRequested(cand("b", 2e9), 5, 2.0))[1]


def test_a_dead_leader_is_dropped_and_the_best_survivor_stands_in_a_new_epoch():
    state = _led_by(cand("b", 2e9), cand("a", 3e9), cand("c"))
    state, actions = run(state, PeersChanged((cand("c"),), frozenset({"c"}), True, 3.0))
    assert state.role is Role.CANDIDATE and state.epoch == 5
    assert RequestVotes(5, ("c",)) in actions


def test_a_leader_that_says_it_no_longer_leads_is_dropped():
    state = _led_by(cand("v"), cand("a"), cand("b", 0.5e9))
    state, actions = run(state, LeaderClaimed("a", None, 0, 0.5))
    assert state.leader is None and LeaderChanged(None, 4) in actions


def test_a_claim_about_our_previous_run_only_moves_the_epoch():
    state, _ = run(node(cand("a", 0), cand("b")), LeaderClaimed("b", "a", 7, 0.1))
    assert (state.leader, state.epoch, state.role) == (None, 7, Role.FOLLOWER)


def test_a_leaderless_higher_epoch_moves_even_the_leader_so_the_best_can_stand_in_it():
    leader, _ = run(node(cand("a", 2e9), cand("b")), Tick(0.1), VoteReceived("b", 1, True, 0.2))
    moved, actions = run(leader, LeaderClaimed("b", None, 3, 2.0))
    assert (moved.role, moved.epoch) == (Role.CANDIDATE, 4)
    assert LeaderChanged(None, 3) not in actions and RequestVotes(4, ("b",)) in actions


def test_losing_mains_power_is_a_capability_change():
    state, _ = run(node(cand("a", 2e9), cand("b")), CapabilityChanged(cand("a", 2e9, False), 0))
    assert state.role is Role.FOLLOWER  # b on mains now outranks a


# -- whole clusters ---------------------------------------------------------------------------


class Cluster:
    """Election machines connected by a simulated network with random delivery order.

    The network can be cut into sides (``partition``) and healed; a peer can be frozen (it
    processes and sends nothing, and the others see it die) and thawed, after which it has
    either noticed its own stall and keeps its view until heartbeats come (membership's
    `Stalled`), or not, and for a moment sees nobody at all."""

    def __init__(self, capabilities: list[Candidate]):
        self.caps = {c.id: c for c in capabilities}
        self.alive = set(self.caps)
        self.frozen: set[str] = set()
        self.blind: set[str] = set()  # woke without noticing: sees nobody until a heartbeat
        self.side = dict.fromkeys(self.caps, 0)
        self.knows = {peer: set(self.caps) for peer in self.caps}  # whom mDNS has shown it
        self.heard = {peer: set(self.caps) for peer in self.caps}  # whose heartbeats it had
        self.nodes = {c.id: Election(me=c, timing=TIMING) for c in capabilities}
        self.in_flight: list[tuple[str, str, object]] = []  # (sender, receiver, event)
        self.won: dict[int, set[str]] = {}  # epoch -> the live peers that won it
        self.granted: dict[tuple[str, int], set[str]] = {}  # (voter, epoch) -> candidates
        self.now = 0.0
        for peer in self.caps:
            self.deliver(peer, self._view(peer))

    def running(self) -> set[str]:
        return self.alive - self.frozen

    def can_talk(self, a: str, b: str) -> bool:
        return {a, b} <= self.running() and self.side[a] == self.side[b]

    def _view(self, peer: str) -> PeersChanged:
        seen = set() if peer in self.blind else {
            p for p in self.knows[peer] if p != peer and self.can_talk(peer, p)
        }
        voters = tuple(self.caps[p] for p in sorted(seen & self.heard[peer]))
        return PeersChanged(voters, frozenset(seen), seen <= self.heard[peer], self.now)

    def refresh_views(self) -> None:
        for peer in sorted(self.running()):
            self.deliver(peer, self._view(peer))

    def deliver(self, peer: str, event, sender: str | None = None) -> None:
        if peer not in self.running() or (sender is not None and not self.can_talk(sender, peer)):
            return  # lost: the receiver is down or frozen, or the network is cut between them
        event = dataclasses.replace(event, now=self.now)
        self.nodes[peer], actions = apply(self.nodes[peer], event)
        for action in actions:
            self._send(peer, action)
        if isinstance(event, LeaderClaimed) and (
            event.sender not in self.heard[peer] or peer in self.blind
        ):
            self.heard[peer].add(event.sender)
            self.blind.discard(peer)
            self.deliver(peer, self._view(peer))

    def _send(self, sender: str, action) -> None:
        match action:
            case RequestVotes(epoch=epoch, voters=voters):
                for voter in voters:
                    self._post(sender, voter, VoteRequested(self.caps[sender], epoch, 0))
            case SendVote(to=to, epoch=epoch, granted=granted):
                if granted:
                    self.granted.setdefault((sender, epoch), set()).add(to)
                self._post(sender, to, VoteReceived(sender, epoch, granted, 0))
            case AnnounceLeader(epoch=epoch, to=to):
                for peer in to:
                    self._post(sender, peer, LeaderClaimed(sender, sender, epoch, 0))
            case LeaderChanged(leader=leader, epoch=epoch) if leader == sender:
                self.won.setdefault(epoch, set()).add(sender)

    def _post(self, sender: str, receiver: str, event) -> None:
        self.in_flight.append((sender, receiver, event))

    def heartbeats(self) -> None:
        for sender in sorted(self.running()):
            state = self.nodes[sender]
            for peer in self.alive - {sender}:
                self._post(sender, peer, LeaderClaimed(sender, state.leader, state.epoch, 0))

    def tick(self, seconds: float = 0.25) -> None:
        self.now += seconds
        for peer in sorted(self.running()):
            self.deliver(peer, Tick(self.now))

    def _forget(self, peer: str) -> None:
        """A peer's new instance: suspect to everyone until its first heartbeat, and its
        wins and votes end with the old one (a fresh peer may reuse an epoch nobody saw)."""
        for winners in self.won.values():
            winners.discard(peer)
        self.granted = {key: to for key, to in self.granted.items() if key[0] != peer}
        for heard in self.heard.values():
            heard.discard(peer)

    def kill(self, peer: str) -> None:
        self.alive.discard(peer)
        self.frozen.discard(peer)
        self._forget(peer)
        self.refresh_views()

    def restart(self, peer: str, knows: set[str]) -> None:
        """`peer` starts afresh (epoch 0) and has discovered only `knows` so far."""
        self.alive.add(peer)
        self.knows[peer] = knows | {peer}
        self.heard[peer] = {peer}
        self.blind.discard(peer)
        self.nodes[peer] = Election(me=self.caps[peer], timing=TIMING)
        self.refresh_views()

    def partition(self, sides: list[set[str]]) -> None:
        """Cut the network: peers on different sides exchange nothing; messages in flight
        between them are lost on arrival."""
        for number, side in enumerate(sides):
            for peer in side:
                self.side[peer] = number
        self.refresh_views()

    def heal(self) -> None:
        self.partition([set(self.caps)])

    def freeze(self, peer: str) -> None:
        self.frozen.add(peer)
        self.refresh_views()

    def thaw(self, peer: str, noticed: bool) -> None:
        """It wakes with its clock jumped by the time frozen. Having noticed its stall it
        keeps the view it had until heartbeats come; otherwise it first sees everyone dead."""
        self.frozen.discard(peer)
        if not noticed:
            self.blind.add(peer)
            self.deliver(peer, self._view(peer))
        self.deliver(peer, Tick(self.now))
        self.refresh_views()

    def discover_all(self) -> None:
        for peer in sorted(self.alive):
            self.knows[peer] = set(self.caps)
        self.refresh_views()

    def settle(self, rounds: int = 40) -> None:
        """Reliable, in-order delivery with heartbeats and ticks."""
        for _ in range(rounds):
            self.heartbeats()
            while self.in_flight:
                sender, receiver, event = self.in_flight.pop(0)
                self.deliver(receiver, event, sender)
            self.tick()

    def agreed(self) -> tuple[str | None, int]:
        views = {(self.nodes[p].leader, self.nodes[p].epoch) for p in self.alive}
        assert len(views) == 1, views
        return views.pop()


capabilities = st.lists(
    st.builds(Candidate, st.sampled_from("abcdef"), st.booleans(),
              st.sampled_from([1e9, 2e9, 4e9, 9e9])),
    min_size=1, max_size=5, unique_by=lambda c: c.id,
)


def test_a_peer_restarting_that_knows_only_a_follower_does_not_leave_the_cluster_split():
    cluster = Cluster([cand("a", 4e9), cand("b", 1e9), cand("c", 2e9)])
    cluster.settle()
    assert cluster.agreed() == ("a", 1)
    cluster.kill("c")
    cluster.restart("c", knows={"b"})  # mDNS has not shown it "a" yet: it stands, "b" refuses
    cluster.settle(rounds=4)
    cluster.discover_all()
    cluster.settle()
    leader, epoch = cluster.agreed()
    assert leader == "a" and epoch > 1


@settings(max_examples=150, deadline=None)
@given(caps=capabilities, seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 150),
       kill_at=st.integers(0, 150), restart_at=st.integers(0, 150))
def test_one_leader_per_epoch_and_everyone_ends_up_agreeing_on_the_best(caps, seed, steps,
                                                                      kill_at, restart_at):
    rng = random.Random(seed)
    cluster = Cluster(caps)
    killed_epoch, restarted = None, False
    for step in range(steps):
        if step == kill_at and len(cluster.alive) > 1:
            leader = cluster.nodes[sorted(cluster.alive)[0]].leader
            if leader in cluster.alive:
                killed_epoch = cluster.nodes[leader].epoch
                cluster.kill(leader)
        if step == restart_at and len(cluster.alive) > 1:
            # It knows at least one live peer: one that knows nobody is a partition.
            peer, first = rng.sample(sorted(cluster.alive), 2)
            cluster.kill(peer)
            cluster.restart(peer, knows={first} | {p for p in cluster.caps if rng.random() < 0.5})
            restarted = True
        roll = rng.random()
        if roll < 0.15:
            cluster.tick(rng.choice([0.1, 0.5, 1.2]))
        elif roll < 0.25:
            cluster.heartbeats()
        elif cluster.in_flight:
            sender, peer, event = cluster.in_flight.pop(rng.randrange(len(cluster.in_flight)))
            if rng.random() > 0.1:  # one message in ten is lost
                cluster.deliver(peer, event, sender)
    cluster.discover_all()
    cluster.settle()
    assert all(len(leaders) <= 1 for leaders in cluster.won.values()), cluster.won
    leader, epoch = cluster.agreed()
    top = best(cluster.caps[p] for p in cluster.alive)
    if restarted:
        # A peer back from a restart finds a leader elected while it was away; it takes over
        # only if it outranks that leader by the challenge margin. And a fresh peer may
        # reuse the epoch of a leader it never knew.
        assert leader in cluster.alive
        assert not challenges(top, cluster.caps[leader], TIMING.challenge_margin)
    else:
        assert leader == top.id
        assert killed_epoch is None or epoch > killed_epoch


# -- partitions, heals and peers that sleep ----------------------------------------------------

# a is the best but not by the challenge margin: once another peer leads, a keeps out of it
WITHIN_MARGIN = [cand("a", 2.0e9), cand("b", 1.5e9), cand("c", 1.4e9)]


def test_a_cut_off_peer_that_wins_alone_does_not_keep_the_lead_after_the_heal():
    cluster = Cluster(WITHIN_MARGIN)
    cluster.settle()
    assert cluster.agreed() == ("a", 1)
    cluster.partition([{"a", "b"}, {"c"}])
    cluster.settle(rounds=8)
    cut_off = cluster.nodes["c"]
    assert (cut_off.leader, cut_off.epoch, cut_off.alone) == ("c", 2, True)
    assert (cluster.nodes["a"].leader, cluster.nodes["a"].epoch) == ("a", 1)
    cluster.heal()
    cluster.settle()
    leader, epoch = cluster.agreed()
    # Following c's higher epoch, as before, would have left the slowest peer leading.
    assert leader == "a" and not cluster.nodes["a"].alone


def test_the_survivor_of_two_leads_alone_and_the_best_leads_again_when_the_other_wakes():
    cluster = Cluster([cand("a", 3e9), cand("b", 2.5e9)])
    cluster.settle()
    assert cluster.agreed() == ("a", 1)
    cluster.freeze("a")
    cluster.settle(rounds=8)
    assert (cluster.nodes["b"].leader, cluster.nodes["b"].alone) == ("b", True)
    cluster.thaw("a", noticed=True)
    cluster.settle()
    assert cluster.agreed()[0] == "a"


def test_a_follower_that_noticed_its_own_stall_wakes_as_a_follower_of_the_same_epoch():
    cluster = Cluster(WITHIN_MARGIN)
    cluster.settle()
    cluster.freeze("c")
    cluster.settle(rounds=60)  # 15 s
    cluster.thaw("c", noticed=True)
    cluster.settle()
    assert cluster.agreed() == ("a", 1)


def test_a_follower_that_wakes_seeing_nobody_wins_alone_then_abdicates():
    cluster = Cluster(WITHIN_MARGIN)
    cluster.settle()
    cluster.freeze("c")
    cluster.settle(rounds=60)
    cluster.thaw("c", noticed=False)
    assert (cluster.nodes["c"].leader, cluster.nodes["c"].alone) == ("c", True)
    cluster.settle()
    leader, epoch = cluster.agreed()
    assert leader == "a" and epoch > 1


SETTLE_ROUNDS = 20  # 5 s of heartbeats: the bound on converging after the last heal (8 pass)


@settings(max_examples=150, deadline=None)
@given(caps=capabilities, seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 200))
def test_partitions_freezes_and_heals_never_give_one_ballot_two_leaders_and_end_in_one(
    caps, seed, steps
):
    """A ballot is (epoch, candidate): only its candidate can win it, and no peer grants
    two candidates in one epoch, so two winners of one epoch number had disjoint voters.
    After the last heal and thaw, one leader and one epoch everywhere within the bound,
    won with votes (not alone) where there are others, and no live peer challenges it."""
    rng = random.Random(seed)
    cluster = Cluster(caps)
    peers = sorted(cluster.caps)
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.03:
            cut = {p for p in peers if rng.random() < 0.5}
            cluster.partition([cut, set(peers) - cut])
        elif roll < 0.05:
            cluster.heal()
        elif roll < 0.07 and len(cluster.running()) > 1:
            cluster.freeze(rng.choice(sorted(cluster.running())))
        elif roll < 0.10 and cluster.frozen:
            cluster.thaw(rng.choice(sorted(cluster.frozen)), noticed=rng.random() < 0.7)
        elif roll < 0.25:
            cluster.tick(rng.choice([0.1, 0.5, 1.2, 3.0]))
        elif roll < 0.35:
            cluster.heartbeats()
        elif cluster.in_flight:
            sender, peer, event = cluster.in_flight.pop(rng.randrange(len(cluster.in_flight)))
            if rng.random() > 0.1:  # one message in ten is lost
                cluster.deliver(peer, event, sender)
        assert all(len(to) <= 1 for to in cluster.granted.values()), cluster.granted
    for peer in sorted(cluster.frozen):
        cluster.thaw(peer, noticed=rng.random() < 0.7)
    cluster.heal()
    cluster.settle(rounds=SETTLE_ROUNDS)
    leader, _ = cluster.agreed()
    assert leader is not None and leader in cluster.alive
    assert len(cluster.alive) == 1 or not cluster.nodes[leader].alone
    assert not any(challenges(cluster.caps[p], cluster.caps[leader], TIMING.challenge_margin)
                   for p in cluster.alive)
