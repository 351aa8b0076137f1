"""`peerd plan` end to end, as a user runs it: files in, a plan (or one clear line) out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLUSTER = {
    "source": "desk",
    "devices": [
        {"id": "desk", "flops": 2e10, "memory_available": 1.2e9, "load": 0.1, "battery": None},
        {"id": "laptop", "flops": 1e10, "memory_available": 2e9,
         "battery": {"percent": 80, "plugged": False}},
        {"id": "mini", "flops": 8e9, "memory_available": 2e9},
    ],
    "links": [
        {"from": "desk", "to": "laptop", "latency_s": 0.002, "bandwidth_Bps": 3e7},
        {"from": "desk", "to": "mini", "latency_s": 0.0005, "bandwidth_Bps": 1.2e8},
        {"from": "laptop", "to": "mini", "latency_s": 0.002, "bandwidth_Bps": 3e7},
    ],
}


def units(count: int = 12) -> dict:
    return {"return_bytes": 8, "units": [
        {"flops": 2e9, "weight_bytes": 2e8, "kv_bytes_per_token": 4096,
         "outputs": [{"bytes": 8192, "consumers": [u + 1]}] if u + 1 < count else []}
        for u in range(count)]}


def plan(tmp_path: Path, cluster: dict | str, units_data: dict | str, *args: str):
    for name, content in (("cluster.json", cluster), ("units.json", units_data)):
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return subprocess.run(
        [sys.executable, "-m", "peerd", "plan", "--cluster", str(tmp_path / "cluster.json"),
         "--units", str(tmp_path / "units.json"), *args],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_json_plan_covers_every_unit_from_the_source(tmp_path, objective):
    done = plan(tmp_path, CLUSTER, units(), "--objective", objective, "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)  # stdout holds the plan and nothing else
    assert data["objective"] == objective and data["solver"] == "milp"
    assert data["stages"][0]["peer"] == "desk"
    assert [u for s in data["stages"] for u in s["units"]] == list(range(12))
    assert len(data["movable"]) == len(data["stages"])


def test_every_solver_answers(tmp_path):
    for solver in ("dp", "even", "memory"):
        done = plan(tmp_path, CLUSTER, units(), "--solver", solver, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["solver"] == solver


def test_the_table_names_each_stage(tmp_path):
    done = plan(tmp_path, CLUSTER, units())
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("milp plan for throughput:") and "tokens/s" in lines[0]
    assert lines[1].split()[:4] == ["stage", "peer", "units", "compute"]
    assert lines[2].split()[:2] == ["0", "desk"]


def test_an_infeasible_cluster_ends_with_the_shortfall(tmp_path):
    done = plan(tmp_path, CLUSTER, units(40))
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "peerd: model needs 8.3 GB at beta 0.7; usable peers offer 3.6 GB")


def test_bad_input_is_one_line_on_stderr(tmp_path):
    broken = dict(CLUSTER, links=[{"from": "desk", "to": "phone", "latency_s": 0,
                                   "bandwidth_Bps": 1}])
    done = plan(tmp_path, broken, units())
    assert done.returncode == 1
    assert done.stderr.strip().endswith("cluster.json: links[0] names unknown peer 'phone'")
    done = plan(tmp_path, CLUSTER, "{not json")
    assert done.returncode == 1
    assert "units.json is not valid JSON" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_missing_file_and_a_bad_flag(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "peerd", "plan", "--cluster", str(tmp_path / "nope.json"),
         "--units", str(tmp_path / "nope.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("peerd: cannot read cluster file")
    done = plan(tmp_path, CLUSTER, units(), "--solver", "magic")
    assert done.returncode == 2


def test_a_real_manifest_plans_with_its_request_outputs_left_to_the_return_hop(tmp_path, toy):
    _, manifest, _ = toy
    logits = manifest.units[-1].outputs[0]
    assert logits.consumers == (-1,), "the premise: the logits are consumed by the request"
    done = plan(tmp_path, CLUSTER, manifest.to_dict(), "--json")
    assert done.returncode == 0, done.stderr
    stages = json.loads(done.stdout)["stages"]
    assert [u for s in stages for u in s["units"]] == list(range(len(manifest.units)))


def shareable_units(count: int = 12, grains: int = 4) -> dict:
    data = units(count)
    for unit in data["units"][1:-1]:
        unit["share_grains"] = grains
    return data


def test_shapes_weigh_groups_against_pipelines(tmp_path):
    done = plan(tmp_path, CLUSTER, shareable_units(), "--shapes", "--objective", "first-token",
                "--prompt-tokens", "256", "--json")
    assert done.returncode == 0, done.stderr
    shapes = json.loads(done.stdout)
    best = shapes["best"]
    assert best["objective"] == "first-token" and best["prompt_tokens"] == 256
    assert best["kind"] in shapes["by_kind"]
    assert best["predicted"]["first_token_s"] == min(
        shape["predicted"]["first_token_s"] for shape in shapes["by_kind"].values())
    for stage in best["stages"]:
        assert sum(peer["share"] for peer in stage["peers"]) == pytest.approx(1.0)
    covered = [u for stage in best["stages"] for u in stage["units"]]
    assert covered == list(range(12))


def test_the_shapes_table_lists_a_groups_peers_with_their_shares(tmp_path):
    fast = {**CLUSTER, "links": [{**link, "latency_s": 1e-6, "bandwidth_Bps": 1e10}
                                 for link in CLUSTER["links"]]}
    done = plan(tmp_path, fast, shareable_units(), "--shapes", "--objective", "first-token")
    assert done.returncode == 0, done.stderr
    first, *rest = done.stdout.splitlines()
    assert first.startswith("best shape for first-token: group")
    assert "%)" in rest[1]  # "desk (45%), laptop (...)": a group stage names its shares
    assert any(line.startswith("pipeline ") for line in rest)


def test_first_token_needs_shapes(tmp_path):
    done = plan(tmp_path, CLUSTER, units(), "--objective", "first-token")
    assert done.returncode == 1
    assert done.stderr.strip() == "peerd: --objective first-token weighs shapes: add --shapes"
