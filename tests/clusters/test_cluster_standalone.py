"""Acceptance: with `--standalone`, an answer outlives the peers behind the exit and comes
back to full depth with them, on three daemons in network namespaces.

The model lives on the first peer (the plan's source, so the head of every plan) and each
peer offers a budget under which all three are needed. Every peer starts with
`--early-exit 2 --exit-layer 1 --standalone`: no token is confident enough to exit while
the cluster serves (θ above 1), so the exit serves the answer only when no plan can.

A client on the head's socket reads the first tokens of a long answer (full depth); the two
other peers are killed; the client reads until a degraded token comes and stops reading.
The answer must pause (the head's status counts it waiting for its client) rather than run
on alone: degraded tokens come at the first stage's speed, far faster than a cluster comes
back, so without that pause it would end before the peers return. The peers restart under
their own state dirs; once a plan with every stage serves, the client reads on: the tokens
that waited in the socket's buffers are degraded, every later one is the full model's, and
the done event counts the degraded ones. Each token is checked against transformers given
the tokens before it: the exit's argmax after layer 1 where degraded, the full model's
elsewhere.
"""

from __future__ import annotations

import contextlib
import re

import netns
import pytest
from sharding import expected_along, seed_shard_cache
from streaming import ANSWER_S, DEPLOYED_S, SHARDED_S, head_of

from peerd.commands.client import chat_events
from peerd.commands.local_cluster import budget_for

pytestmark = [pytest.mark.cluster, netns.needs_namespaces]

EXIT_LAYER = 1
FLAGS = ("--early-exit", "2", "--exit-layer", str(EXIT_LAYER), "--standalone")
PROMPT = (1, 17, 42, 99, 7, 250, 3, 64)
CONTEXT = 2048  # the model's positions: the plan's K/V reserve (planning.DEFAULT_CONTEXT)
# The answer runs long enough to outlast what the head's socket buffers for a client that
# stopped reading (about 1300 token events under Linux's default 208 KiB): those tokens are
# computed before the answer pauses.
NEW_TOKENS = CONTEXT - len(PROMPT)
FIRST_TOKENS = 4  # read at full depth before the peers behind the head are killed
# The daemons leave the plan, notice the loss, and later agree, measure, plan and load
# again, on a loaded machine.
RETURN_S = 240


@pytest.fixture
def cluster(hf_checkpoint, tmp_path):
    model_dir = hf_checkpoint("llama", layers=4, max_position_embeddings=CONTEXT,
                              eos_token_id=None)
    dirs = netns.make_state_dirs(tmp_path, 3)
    manifest = seed_shard_cache(dirs[0], model_dir)
    budget = budget_for(manifest, 3, spare=0.9)  # two peers fall short, let alone the head
    args = {i: ["--memory-budget", budget, *FLAGS] for i in range(3)}
    args[0] += ["--model", str(model_dir)]
    with netns.cluster(dirs, args) as (network, peers), netns.logs_on_failure(peers):
        netns.wait_for(lambda: netns.sharded_model(peers[0]), SHARDED_S, "the model sharded")
        plan = netns.wait_for(lambda: netns.deployed_plan(peers), DEPLOYED_S, "a deployed plan")
        assert [stage["peer"] for stage in plan["stages"]][0] == peers[0].id
        assert len(plan["stages"]) == 3, plan
        netns.wait_for(lambda: head_of(peers) is peers[0], DEPLOYED_S, "the head to serve")
        yield model_dir, network, peers, args, plan


def _dataplane(peer: netns.Peer) -> dict:
    return (peer.status() or {}).get("dataplane") or {}


def test_a_standalone_answer_pauses_without_the_later_peers_and_returns_to_full_depth(
        cluster):
    model_dir, network, peers, args, plan = cluster
    head = peers[0]
    request = {"prompt_ids": list(PROMPT), "max_tokens": NEW_TOKENS}
    events: list[dict] = []
    with contextlib.closing(chat_events(head.state_dir, request, ANSWER_S)) as chat:

        def read_until(enough) -> None:
            while not enough():
                events.append(next(chat))
                assert events[-1].get("event") == "token", events[-1]

        read_until(lambda: len(events) >= FIRST_TOKENS)
        assert not any(event.get("degraded") for event in events), events
        for behind in peers[1:]:
            behind.kill()
        read_until(lambda: events[-1].get("degraded"))
        # the client stops reading: the answer pauses once the socket's buffers are full
        netns.wait_for(lambda: _dataplane(head).get("waiting_for_client") == 1, ANSWER_S,
                       "the answer to pause for its client")
        netns.wait_for(lambda: not _dataplane(head).get("head"), RETURN_S,
                       "the head to hear that no plan serves")
        for i in (1, 2):
            peers[i] = network.start_peer(i, peers[i].state_dir, *args[i])
        netns.wait_for(lambda: netns.deployed_plan(peers, old=plan), RETURN_S,
                       "a new plan deployed on the three peers")
        netns.wait_for(lambda: _dataplane(head).get("head"), RETURN_S,
                       "the head to serve the new plan")
        assert _dataplane(head)["waiting_for_client"] == 1  # still held: nothing was read
        events.extend(chat)
    *tokens, done = events
    assert done.get("event") == "done", done
    shown = "".join("D" if event.get("degraded") else "." for event in tokens)
    assert re.fullmatch(rf"\.{{{FIRST_TOKENS},}}D+\.+", shown), (
        f"expected full depth, then degraded, then full depth again: {shown}")
    ids = [event["token"] for event in tokens]
    assert done["token_ids"] == ids and len(ids) == NEW_TOKENS
    degraded = {i for i, flag in enumerate(shown) if flag == "D"}
    assert done["degraded"] is True
    assert done["stats"]["degraded_tokens"] == len(degraded)
    assert ids == expected_along(model_dir, EXIT_LAYER, PROMPT, ids, degraded)
