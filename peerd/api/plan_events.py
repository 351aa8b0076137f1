"""What a member tells its local subscribers (the dashboard) about a plan it was given: a
`rebalance` event when load or battery moved work, then the `plan` event with why the
leader made the plan, its stages, prediction and residual links. Every member publishes
them, so a dashboard shows the same log on any peer, not only on the leader."""

from __future__ import annotations

import dataclasses
from typing import Any

from peerd.inference.routing import routes
from peerd.wire.protocol import PlanAssignment
from shards.manifest import Manifest


def plan_events(plan: PlanAssignment) -> list[dict[str, Any]]:
    moved = plan.rebalance
    rebalance = [] if moved is None else [{
        "event": "rebalance", "reason": moved.reason, "gain": moved.gain, "full": moved.full,
        "plan_id": plan.plan_id,
    }]
    return [*rebalance, plan_event(plan)]


def plan_event(plan: PlanAssignment) -> dict[str, Any]:
    """The `plan` event: the plan, why it was made, and its residual links (tensors a stage
    sends straight to a later, non-adjacent stage)."""
    predicted = dataclasses.asdict(plan.predicted) if plan.predicted else None
    return {
        "event": "plan",
        "plan_id": plan.plan_id,
        "epoch": plan.epoch,
        "reason": plan.reason,
        "stages": [{"peer": s.peer, "first": s.first, "last": s.last,
                    "shares": [{"peer": x.peer, "weight": x.weight} for x in s.shares]}
                   for s in plan.stages],
        "predicted": predicted,
        "problem": plan.problem,
        "residuals": _residual_links(plan),
    }


def _residual_links(plan: PlanAssignment) -> list[dict[str, Any]]:
    if not plan.stages or plan.manifest is None:
        return []
    stage_routes = routes(Manifest.from_dict(plan.manifest),
                          [(s.first, s.last) for s in plan.stages])
    return [
        {"from": plan.stages[i].peer, "to": plan.stages[route.target].peer,
         "tensors": list(route.names)}
        for i, stage in enumerate(stage_routes)
        for route in stage.sends
        if route.target != i + 1
    ]
