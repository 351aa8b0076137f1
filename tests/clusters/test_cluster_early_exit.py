"""Acceptance: early exit and speculative decoding on a three-namespace cluster of daemons.

Every peer starts with the same flags (only the head of the plan, which holds the first
stage, uses them). With `--speculative N`, N from 1 to 4, a chat's answer is exactly
transformers' greedy answer; with `--early-exit 0` every token comes from the exit after
layer 1, each equal to transformers' argmax of lm_head(norm(hidden_states[1])) for the
tokens before it, and the stages behind the exit still ran every step (with `--standalone`
too, which changes nothing while the cluster serves: no token is degraded). With
`--speculative 4` a sampled answer drafts too (speculative sampling; at temperature 1e-4,
where sampling is the argmax, it is the greedy answer). `peerd status --json` shows the
head's exit.
"""

from __future__ import annotations

import json
import subprocess

import netns
import pytest
from sharding import exit_reference, reference
from streaming import head_of, split_cluster

pytestmark = [pytest.mark.cluster, netns.needs_namespaces]

ANSWER_S = 120
NEW_TOKENS = 24
PROMPT = (1, 17, 42, 99, 7, 250, 3, 64)
FLAGS = {**{f"speculative-{n}": ("--speculative", str(n), "--exit-layer", "1")
            for n in range(1, 5)},
         "exit": ("--early-exit", "0", "--exit-layer", "1", "--standalone")}
SAMPLED_ON = "speculative-4"  # the cluster that answers a sampled request too


@pytest.fixture(scope="module", params=sorted(FLAGS))
def cluster(request, hf_checkpoint, tmp_path_factory):
    model_dir = hf_checkpoint("llama", layers=4)
    root = tmp_path_factory.mktemp(f"exit-{request.param}")
    with split_cluster(root, model_dir, "1MB", FLAGS[request.param]) as peers:
        yield request.param, model_dir, peers


def _chat(peer: netns.Peer, *sampling: str) -> dict:
    done = subprocess.run(
        [*netns.PEERD, "chat", "--state-dir", str(peer.state_dir), "--prompt-ids",
         ",".join(map(str, PROMPT)), "--max-tokens", str(NEW_TOKENS), "--json", *sampling],
        capture_output=True, text=True, timeout=ANSWER_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_answers_with_the_exit_are_exact_on_every_peer(cluster):
    mode, model_dir, peers = cluster
    for peer in peers:
        answer = _chat(peer)
        exits = answer["stats"]["exit"]
        assert exits is not None and exits["layer"] == 1, answer["stats"]
        if mode.startswith("speculative"):
            assert answer["token_ids"] == reference(model_dir, PROMPT, NEW_TOKENS)[0]
            assert exits["checks"] < NEW_TOKENS and exits["drafted"] > 0
        else:
            assert answer["token_ids"] == exit_reference(model_dir, 1, PROMPT, NEW_TOKENS)
            assert exits["exited"] == exits["checked"] == NEW_TOKENS
            assert [stage["steps"] for stage in answer["stats"]["stages"]][1:] == [
                NEW_TOKENS] * (len(answer["stats"]["stages"]) - 1)
        assert answer["degraded"] is False
    if mode == SAMPLED_ON:
        sampled = _chat(peers[0], "--temperature", "0.0001", "--seed", "3")
        assert sampled["token_ids"] == reference(model_dir, PROMPT, NEW_TOKENS)[0]
        assert sampled["stats"]["exit"]["drafted"] > 0


def test_status_shows_the_heads_exit(cluster):
    mode, _, peers = cluster
    _chat(peers[0])
    head = head_of(peers)
    exit_status = head.status()["dataplane"]["exit"]
    assert exit_status["layer"] == 1
    assert exit_status["tokens"] >= NEW_TOKENS
    if mode == "exit":
        assert exit_status["exited"] == exit_status["tokens"]
    else:
        assert exit_status["speculative"] == int(mode.split("-")[1])
        assert exit_status["drafted"] > 0
