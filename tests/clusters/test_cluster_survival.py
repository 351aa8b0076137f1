"""Acceptance: answers survive a peer or the leader vanishing mid-answer, and when the rest
cannot hold the model every client hears why, promptly.

Three namespaces; every peer serves the model (pre-sharded into each cache), so whichever
peer survives can be the head. With budgets under which any two peers hold the model, four
answers streaming when a peer is SIGKILLed all finish with exactly transformers' tokens;
the peer comes back under its own id and reuses its cached units; then the leader is
killed, with the same result. With budgets under which all three are needed, killing one
ends every answer with the planner's reason (not the data plane's stall timeout); the
daemons stay up, and once the peer is back the next chat is exact again.
"""

from __future__ import annotations

import time

import netns
import pytest
from streaming import (
    ANSWER_S,
    DEPLOYED_S,
    Answer,
    all_in_flight,
    every_peer_with_the_model,
    serving_plan,
)

from peerd.inference.dataplane import Limits

pytestmark = [pytest.mark.cluster, netns.needs_namespaces]


def _leader(peers: list[netns.Peer]) -> str:
    return netns.wait_for(lambda: (peers[0].status() or {}).get("leader"), 10, "a leader")


def _answers_survive(peers, victim_index: int, prompts, expected) -> None:
    victim = peers[victim_index]
    askers = [p for p in peers if p is not victim]
    answers = all_in_flight(askers, prompts, expected)
    victim.kill()
    for answer in answers:
        answer.join(ANSWER_S)
        assert answer.error is None, answer.error
        assert answer.tokens == answer.done["token_ids"] == expected[tuple(answer.prompt)]


def test_answers_survive_a_peer_and_then_the_leader_vanishing(long_answers):
    model_dir, root, expected, prompts = long_answers
    dirs, args = every_peer_with_the_model(model_dir, root, "two-hold", holders=2)
    with netns.cluster(dirs, args) as (network, peers):
        netns.wait_for(lambda: serving_plan(peers), DEPLOYED_S, "a serving plan")
        leader = _leader(peers)
        plan = netns.deployed_plan(peers)
        followers = [i for i, p in enumerate(peers) if p.id != leader]
        stage_peers = {s["peer"] for s in plan["stages"]}
        victim = next((i for i in followers if peers[i].id in stage_peers), followers[0])
        _answers_survive(peers, victim, prompts, expected)

        cached = {p.name for p in (dirs[victim] / "shards").iterdir()}
        peers[victim] = network.start_peer(victim, dirs[victim], *args[victim])
        ids = [p.id for p in peers]
        netns.wait_for(lambda: netns.agreement([p.status() for p in peers], ids), DEPLOYED_S,
                       "the peer back under its own id, no duplicate")
        assert {p.name for p in (dirs[victim] / "shards").iterdir()} == cached
        netns.wait_for(lambda: serving_plan(peers), DEPLOYED_S, "serving again")

        leader_index = ids.index(_leader(peers))
        _answers_survive(peers, leader_index, prompts, expected)


def test_when_the_rest_cannot_hold_the_model_every_client_hears_why(long_answers):
    model_dir, root, expected, prompts = long_answers
    dirs, args = every_peer_with_the_model(model_dir, root, "three-hold", holders=3)
    with netns.cluster(dirs, args) as (network, peers):
        netns.wait_for(lambda: serving_plan(peers), DEPLOYED_S, "a serving plan")
        plan = netns.deployed_plan(peers)
        assert len(plan["stages"]) == 3
        victim = next(i for i, p in enumerate(peers) if p.id == plan["stages"][-1]["peer"])
        askers = [p for p in peers if p is not peers[victim]]
        answers = all_in_flight(askers, prompts, expected)
        peers[victim].kill()
        killed_at = time.monotonic()
        for answer in answers:
            answer.join(ANSWER_S)
            assert answer.error and "needs" in answer.error, answer.error
            # told the planner's reason, not left to the data plane's stall timeout
            assert answer.ended_at - killed_at < Limits().stall_s
        assert all(p.running() for p in askers)

        peers[victim] = network.start_peer(victim, dirs[victim], *args[victim])
        netns.wait_for(lambda: serving_plan(peers), DEPLOYED_S, "serving again")
        again = Answer(askers[0], prompts[0])
        again.join(ANSWER_S)
        assert again.error is None and again.tokens == expected[tuple(prompts[0])]
