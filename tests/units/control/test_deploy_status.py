"""How a plan and the model show in `peerd status`: the JSON contract and the table."""

from __future__ import annotations

from pathlib import Path

from toy_units import ToyModel, write_toy

from peerd.api import status
from peerd.cluster import election, membership
from peerd.control.coordinator import ModelStatus
from peerd.control.deploy import Deployment
from peerd.control.unit_store import UnitStore
from peerd.wire.protocol import PlanAssignment, PlanFigures, PlanShare, PlanStage

ME = status.SelfInfo("aaaa", "desk", "i1", "c0ffee00", "10.0.0.1",
                     {"hello": 7000, "control": 7001, "data": 7002})


def _document(plan: dict | None, model: dict | None) -> dict:
    state = election.Election(me=election.Candidate("aaaa", True, 2e10), epoch=2, leader="aaaa",
                              role=election.Role.LEADER)
    return status.build(ME, membership.Membership("aaaa", "i1"), state, None,
                        status.Counters(0, 0, 0), plan, model)


async def test_a_plan_shows_its_stages_prediction_and_the_model(tmp_path: Path):
    manifest = write_toy(tmp_path / "toy", ToyModel())
    deployment = Deployment("aaaa", UnitStore(tmp_path / "store"), lambda peer: None,
                            lambda report: None)
    assert deployment.plan_document() is None
    deployment.assign(PlanAssignment(
        2, 5, (PlanStage("bbbb", 0, 1), PlanStage("cccc", 2, 2)), "toy", "bbbb",
        manifest.to_dict(), "throughput", "milp", PlanFigures(0.0042, 310.0, 0.0032), None))
    await deployment.close()
    model = ModelStatus("bbbb", "toy", "ready", "3 units", manifest).document()
    document = _document(deployment.plan_document(), model)

    assert document["plan"] == {
        "id": 5, "epoch": 2, "stages": [
            {"peer": "bbbb", "units": [0, 1], "copies": [], "shares": []},
            {"peer": "cccc", "units": [2], "copies": [], "shares": []}],
        "objective": "throughput", "solver": "milp",
        "predicted": {"latency_s": 0.0042, "throughput_tps": 310.0, "bottleneck_s": 0.0032},
        "predicted_at_planning": {"latency_s": 0.0042, "throughput_tps": 310.0,
                                  "bottleneck_s": 0.0032},
        "measured": None,
        "model": "toy", "model_peer": "bbbb", "problem": None,
    }
    assert document["model"] == {"name": "toy", "peer": "bbbb", "state": "ready",
                                 "detail": "3 units", "architecture": "Toy", "units": 3,
                                 "key": "toy", "quant": "none"}
    text = status.render(document)
    assert "model   toy on bbbb: ready, 3 units (Toy), quant none" in text
    assert "plan    5 of epoch 2 (throughput, milp): predicted 310.0 tokens/s, 4.20 ms" in text
    assert "        measured  - (no answer on this plan yet)" in text
    assert "units 0-1 on bbbb" in text and "units 2-2 on cccc" in text
    document["plan"]["measured"] = {"latency_s": 0.0061, "throughput_tps": 162.5, "tokens": 90}
    assert ("        measured  162.5 tokens/s, 6.10 ms per token (over 90 tokens)"
            in status.render(document))


def test_no_plan_and_an_impossible_plan_say_so():
    assert "plan    none yet" in status.render(_document(None, None))
    sharding = ModelStatus("bbbb", "toy", "sharding", "[2/9] layer0.attn").document()
    impossible = {"id": 3, "epoch": 2, "stages": [], "objective": "throughput",
                  "solver": "milp", "predicted": None, "model": "toy", "model_peer": "bbbb",
                  "problem": "model needs 1.1 MB at beta 0.7; usable peers offer 0.7 MB"}
    text = status.render(_document(impossible, sharding))
    assert "model   toy on bbbb: sharding" in text
    assert "plan    none: model needs 1.1 MB at beta 0.7; usable peers offer 0.7 MB" in text


async def test_a_group_stage_lists_its_peers_and_shares(tmp_path: Path):
    manifest = write_toy(tmp_path / "toy", ToyModel())
    deployment = Deployment("dddd", UnitStore(tmp_path / "store"), lambda peer: None,
                            lambda report: None)
    group = (PlanShare("bbbb", 3.0), PlanShare("cccc", 1.0))
    deployment.assign(PlanAssignment(
        2, 5, (PlanStage("bbbb", 0, 2, shares=group),), "toy", "bbbb", manifest.to_dict(),
        "first-token", "groups", PlanFigures(0.0042, 310.0, 0.0032), None))
    await deployment.close()
    document = _document(deployment.plan_document(), None)
    assert document["plan"]["stages"] == [{
        "peer": "bbbb", "units": [0, 1, 2], "copies": [],
        "shares": [{"peer": "bbbb", "weight": 3.0, "fraction": 0.75},
                   {"peer": "cccc", "weight": 1.0, "fraction": 0.25}]}]
    assert "units 0-2 on bbbb 75% + cccc 25%" in status.render(document)
