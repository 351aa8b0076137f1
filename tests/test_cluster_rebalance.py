"""Acceptance: live rebalancing, driven by a peer's battery file, never changes an answer.

Three namespaces; the model on one peer (pre-sharded), budgets under which any two peers
hold it. While four answers stream, a stage peer's battery goes from plugged to 15%
unplugged: within 10 s it holds no units, and every answer is exactly transformers' answer.
Plugged in again, it gets work back.
"""

from __future__ import annotations

import json
import time

import netns
import pytest
from streaming import ANSWER_S, DEPLOYED_S, Answer, serving_plan, shard_into_caches

from peerd.local_cluster import budget_for

pytestmark = pytest.mark.skipif(
    netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason())
)

SHED_S = 10.0
REGAIN_S = 60.0  # the policy's sustain and cooldown, a measurement round and a deployment


def _battery(path, percent: float, plugged: bool) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"percent": percent, "plugged": plugged}))
    temporary.replace(path)


def _units(peers, peer_id: str) -> list[int] | None:
    plan = netns.deployed_plan(peers)
    if plan is None:
        return None
    return next((s["units"] for s in plan["stages"] if s["peer"] == peer_id), [])


def test_a_peer_on_low_battery_sheds_its_units_mid_answer_and_takes_work_back(long_answers):
    model_dir, root, expected, prompts = long_answers
    dirs = netns.make_state_dirs(root / "battery", 3)
    manifest = shard_into_caches(model_dir, dirs[:1])
    batteries = [d / "battery.json" for d in dirs]
    for path in batteries:
        _battery(path, 100, True)
    budget = budget_for(manifest, 2)
    args = {i: ["--memory-budget", budget, "--battery-file", str(batteries[i])]
            for i in range(3)}
    args[0] += ["--model", str(model_dir)]
    with netns.cluster(dirs, args, rebalance=True) as (_, peers):
        plan = netns.wait_for(lambda: serving_plan(peers), DEPLOYED_S, "a serving plan")
        assert len(plan["stages"]) == 3, plan
        shedder = next(i for i, p in enumerate(peers) if p.id == plan["stages"][-1]["peer"])
        answers = [Answer(peers[0], prompt) for prompt in prompts]
        netns.wait_for(lambda: all(len(a.tokens) >= 3 for a in answers), ANSWER_S,
                       "every answer streaming")
        _battery(batteries[shedder], 15, False)
        unplugged = time.monotonic()
        netns.wait_for(lambda: _units(peers, peers[shedder].id) == [], SHED_S,
                       "the peer on low battery to hold no units")
        print(f"shed its units {time.monotonic() - unplugged:.1f}s after unplugging")
        for answer in answers:
            answer.join(ANSWER_S)
            assert answer.error is None, answer.error
            assert answer.tokens == answer.done["token_ids"] == expected[tuple(answer.prompt)]
        assert any(a.done["stats"]["resumed"] for a in answers), "no answer crossed the change"
        assert all(a.done["stats"]["kv_moved"] == a.done["stats"]["resumed"] for a in answers), (
            "an answer re-prefilled though every peer was alive to move its K/V"
        )

        _battery(batteries[shedder], 15, True)
        netns.wait_for(lambda: _units(peers, peers[shedder].id), REGAIN_S,
                       "the peer plugged in again to get work back")
