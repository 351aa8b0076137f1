"""Parsing cluster and units files (the planner's own format and a manifest) and the plan JSON."""

from __future__ import annotations

import copy

import pytest

from planner.errors import InvalidInput
from planner.io import cluster_from_dict, plan_to_dict, workload_from_dict
from planner.model import Battery
from planner.solve import solve

CLUSTER = {
    "source": "desk",
    "beta": 0.6,
    "context": 1024,
    "battery_min_percent": 25,
    "battery_penalty": 0.4,
    "devices": [
        {"id": "desk", "flops": 2e10, "memory_available": 2e9, "load": 0.1, "battery": None},
        {"id": "lap", "flops": 1e10, "memory_available": 1e9,
         "battery": {"percent": 80, "plugged": False}},
    ],
    "links": [{"from": "desk", "to": "lap", "latency_s": 0.002, "bandwidth_Bps": 5e7}],
}

UNITS = {
    "return_bytes": 8,
    "units": [
        {"flops": 1e8, "weight_bytes": 5e8, "kv_bytes_per_token": 0,
         "outputs": [{"bytes": 4096, "consumers": [1]}, {"bytes": 512, "consumers": [2]}]},
        {"flops": 4e9, "weight_bytes": 4e8, "kv_bytes_per_token": 2048,
         "outputs": [{"bytes": 4096, "consumers": [2]}]},
        {"flops": 4e9, "weight_bytes": 4e8, "kv_bytes_per_token": 2048, "outputs": []},
    ],
}


def manifest() -> dict:
    """The same units as a `peerd shard` manifest (docs/architecture.md)."""
    units = []
    for i, unit in enumerate(UNITS["units"]):
        units.append({
            "index": i, "name": f"u{i}", "files": [{"name": f"u{i}.onnx", "sha256": "0" * 64,
                                                    "bytes": 1}], "inputs": [], "state": [],
            "outputs": [{"name": f"o{i}{j}", "dtype": "float32", "bytes_per_token": o["bytes"],
                         "consumers": o["consumers"]} for j, o in enumerate(unit["outputs"])],
            "flops_per_token": {"prefill": 3 * unit["flops"], "decode": unit["flops"]},
            "weight_bytes": unit["weight_bytes"], "kv_bytes_per_token": unit["kv_bytes_per_token"],
        })
    return {"format": 3, "model": {"architecture": "llama"},
            "options": {"quant": "none", "granularity": "half"}, "return_bytes": 8, "units": units}


def test_cluster_fields_and_defaults():
    cluster = cluster_from_dict(CLUSTER)
    assert (cluster.source, cluster.beta, cluster.context) == ("desk", 0.6, 1024)
    assert cluster.device("lap").battery == Battery(80.0, False)
    assert cluster.device("lap").load == 0.0
    assert cluster.link("lap", "desk") == cluster.link("desk", "lap")  # measured one way only
    bare = cluster_from_dict({"source": "x", "devices": [
        {"id": "x", "flops": 1, "memory_available": 1}]})
    assert (bare.beta, bare.context, bare.battery_min_percent, bare.battery_penalty) == (
        0.7, 2048, 20, 0.5)
    assert bare.links == ()


def edited(base: dict, path: list, value) -> dict:
    data = copy.deepcopy(base)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(("path", "value", "complaint"), [
    (["devices", 0, "flops"], -1, r"devices\[0\]\.flops must be a positive number, got -1"),
    (["devices", 0, "flops"], True, "must be a positive number, got True"),
    (["devices", 1, "load"], 1.5, r"devices\[1\]\.load must be a number >= 0 and <= 1"),
    (["devices", 1, "battery"], {"percent": 50}, "lacks 'plugged'"),
    (["devices", 1, "id"], "desk", "repeats id 'desk'"),
    (["links", 0, "to"], "phone", r"links\[0\] names unknown peer 'phone'"),
    (["links", 0, "to"], "desk", "links 'desk' to itself"),
    (["links", 0, "bandwidth_Bps"], 0, "bandwidth_Bps must be a positive number"),
    (["source"], "phone", "source 'phone' is not one of the devices"),
    (["context"], 10.5, "context must be a whole number"),
    (["beta"], 0, "beta must be a positive number"),
    (["devices"], [], "devices is empty"),
    (["devices", 0, "unit_s"], [0.1], r"devices\[0\]\.unit_s must be an object"),
    (["devices", 0, "unit_s"], {"first": 0.1}, "keys must be unit indices, got 'first'"),
    (["devices", 0, "unit_s"], {"1": 0}, r"unit_s\.1 must be a positive number, got 0"),
])
def test_bad_cluster_fields_are_named(path, value, complaint):
    with pytest.raises(InvalidInput, match=complaint):
        cluster_from_dict(edited(CLUSTER, path, value))


def test_measured_unit_times_are_read_by_unit_index_and_must_name_units_of_the_model():
    cluster = cluster_from_dict(edited(CLUSTER, ["devices", 1, "unit_s"], {"0": 0.5, "2": 2}))
    assert cluster.device("lap").unit_s == {0: 0.5, 2: 2.0}
    assert cluster.device("desk").unit_s == {}
    stray = cluster_from_dict(edited(CLUSTER, ["devices", 1, "unit_s"], {"3": 0.5}))
    with pytest.raises(InvalidInput, match="'lap' has a measured time for unit 3; the model "
                                           "has units 0-2"):
        solve(stray, workload_from_dict(UNITS))


def test_the_same_ordered_link_twice_is_refused():
    data = edited(CLUSTER, ["links"], CLUSTER["links"] * 2)
    with pytest.raises(InvalidInput, match="same ordered pair twice"):
        cluster_from_dict(data)


def test_units_file_and_manifest_give_the_same_workload():
    with_prefill = copy.deepcopy(UNITS)
    for unit in with_prefill["units"]:
        unit["prefill_flops"] = 3 * unit["flops"]
    plain = workload_from_dict(with_prefill)
    assert plain == workload_from_dict(manifest())
    assert plain.return_bytes == 8
    assert plain.units[0].outputs[1].consumers == (2,)
    assert plain.units[1].flops == 4e9  # the manifest's decode FLOPs, not prefill
    assert plain.units[1].flops_per_prompt_token == 12e9
    assert workload_from_dict(UNITS).units[1].flops_per_prompt_token == 4e9  # default: decode


@pytest.mark.parametrize(("path", "value", "complaint"), [
    (["units", 1, "outputs", 0, "consumers"], [1], r"consumers must be unit indices after 1"),
    (["units", 1, "outputs", 0, "consumers"], [3], "and below 3, got 3"),
    (["units", 1, "outputs", 0, "consumers"], [2, 2], "repeats a unit"),
    (["units", 0, "weight_bytes"], -5, r"units\[0\]\.weight_bytes must be a number >= 0"),
    (["units"], [], "the units list is empty"),
    (["return_bytes"], "8", "return_bytes must be a number >= 0"),
])
def test_bad_units_are_named(path, value, complaint):
    with pytest.raises(InvalidInput, match=complaint):
        workload_from_dict(edited(UNITS, path, value))


def test_a_manifest_of_another_format_or_without_work_is_refused():
    with pytest.raises(InvalidInput, match="manifest format 2 is not 3"):
        workload_from_dict(edited(manifest(), ["format"], 2))
    idle = copy.deepcopy(UNITS)
    for unit in idle["units"]:
        unit["flops"] = 0
    with pytest.raises(InvalidInput, match="every unit has 0 flops"):
        workload_from_dict(idle)


def test_plan_json_has_the_documented_shape():
    plan = solve(cluster_from_dict(CLUSTER), workload_from_dict(UNITS), "throughput", "milp")
    data = plan_to_dict(plan)
    assert set(data) == {"stages", "objective", "solver", "predicted", "solve_s", "movable"}
    assert set(data["predicted"]) == {"latency_s", "throughput_tps", "bottleneck_s"}
    assert data["stages"][0]["peer"] == "desk"
    covered = [u for stage in data["stages"] for u in stage["units"]]
    assert covered == [0, 1, 2]
    assert [m["peer"] for m in data["movable"]] == [s["peer"] for s in data["stages"]]
    assert data["predicted"]["throughput_tps"] == pytest.approx(
        1 / data["predicted"]["bottleneck_s"])


def test_the_unit_the_request_reads_costs_a_prompt_one_row():
    head = edited(manifest(), ["units", 2, "outputs"], [
        {"name": "logits", "dtype": "float32", "bytes_per_token": 64, "consumers": [-1]}])
    units = workload_from_dict(head).units
    assert [unit.sampled for unit in units] == [False, False, True]
    assert units[2].step_flops(512) == units[2].flops == 4e9
    assert units[1].step_flops(512) == 512 * 12e9
    flagged = edited(UNITS, ["units", 2, "sampled"], True)
    assert workload_from_dict(flagged).units[2].sampled
    with pytest.raises(InvalidInput, match=r"units\[2\].sampled must be true or false"):
        workload_from_dict(edited(UNITS, ["units", 2, "sampled"], "yes"))


def test_only_a_manifest_may_name_the_request_as_a_consumer():
    units = {"return_bytes": 8, "units": [
        {"flops": 1.0, "weight_bytes": 1, "kv_bytes_per_token": 0,
         "outputs": [{"bytes": 4, "consumers": [-1]}]}]}
    with pytest.raises(InvalidInput, match="consumers"):
        workload_from_dict(units)
