"""Acceptance: a stage served by a group of peers (tensor parallel) on a three-namespace
cluster of daemons gives transformers' greedy answer.

Every peer starts with `--tensor-parallel N` (the leader's counts): Llama with grouped-query
attention (6 heads over 3 KV heads) at N = 3 (one group of all three) and N = 2 (a group of
two, as planner.groups places it), and GPT-2 (biases on the row-split projections) at N = 2
and N = 3.
The plan, as `peerd status --json` shows it, lists each group stage's peers and shares; the
members hold their share of the stage's units.
"""

from __future__ import annotations

import json
import subprocess

import netns
import pytest
from sharding import reference, seed_shard_cache
from streaming import head_of

pytestmark = [pytest.mark.cluster, netns.needs_namespaces]

SHARDED_S, DEPLOYED_S, ANSWER_S = 240, 240, 120
NEW_TOKENS = 16
PROMPT = (1, 17, 42, 99, 7, 250, 3, 64)
CASES = {
    "llama-3": ("llama", {"heads": 6, "kv_heads": 3, "hidden": 48}, 3),
    "llama-2": ("llama", {"heads": 6, "kv_heads": 3, "hidden": 48}, 2),
    "gpt2-2": ("gpt2", {"heads": 6, "hidden": 48}, 2),
    "gpt2-3": ("gpt2", {"heads": 6, "hidden": 48}, 3),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def cluster(request, hf_checkpoint, tmp_path_factory):
    family, overrides, size = CASES[request.param]
    model_dir = hf_checkpoint(family, **overrides)
    dirs = netns.make_state_dirs(tmp_path_factory.mktemp(f"groups-{request.param}"), 3)
    seed_shard_cache(dirs[0], model_dir)
    args = {i: ["--tensor-parallel", str(size)] for i in range(3)}
    args[0] += ["--model", str(model_dir)]
    with netns.cluster(dirs, args) as (_, peers), netns.logs_on_failure(peers):
        netns.wait_for(lambda: netns.sharded_model(peers[0]), SHARDED_S, "the model sharded")
        plan = netns.wait_for(lambda: netns.deployed_plan(peers), DEPLOYED_S, "a deployed plan")
        netns.wait_for(lambda: head_of(peers), DEPLOYED_S, "the head to accept chats")
        yield size, model_dir, peers, plan


def _chat(peer: netns.Peer) -> dict:
    done = subprocess.run(
        [*netns.PEERD, "chat", "--state-dir", str(peer.state_dir), "--prompt-ids",
         ",".join(map(str, PROMPT)), "--max-tokens", str(NEW_TOKENS), "--json"],
        capture_output=True, text=True, timeout=ANSWER_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_group_answers_exactly(cluster):
    size, model_dir, peers, plan = cluster
    groups = [stage for stage in plan["stages"] if stage["shares"]]
    assert groups and all(len(stage["shares"]) == size for stage in groups), plan
    for peer in peers[:2]:
        answer = _chat(peer)
        assert answer["token_ids"] == reference(model_dir, PROMPT, NEW_TOKENS)[0]


def test_status_lists_a_groups_peers_and_shares(cluster):
    size, _, peers, plan = cluster
    group = next(stage for stage in plan["stages"] if stage["shares"])
    assert group["shares"][0]["peer"] == group["peer"]
    assert sum(share["fraction"] for share in group["shares"]) == pytest.approx(1.0)
    members = {share["peer"] for share in group["shares"]}
    shares = [p.status()["dataplane"]["share"] for p in peers if p.id in members]
    assert sorted(s["index"] for s in shares) == list(range(size))
    assert all(s["group"] == [share["peer"] for share in group["shares"]] for s in shares)
