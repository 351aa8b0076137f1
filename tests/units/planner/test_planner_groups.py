"""Galaxy's groups in the planner: shares by speed and memory, the collectives' cost, and a
search that picks groups where they pay and pipelines where the links are slow."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cost import simulate
from planner.errors import Infeasible, InvalidInput
from planner.groups import (
    FIRST_TOKEN,
    MORE_PEERS_GAIN,
    GroupStage,
    ShapeKind,
    Share,
    best_by_kind,
    best_shape,
    collective_s,
    fastest,
    galaxy_shares,
    groupings,
    member_needs,
    predict,
)
from planner.io import workload_from_dict
from planner.model import Cluster, Device, Link, Output, Stage, Unit, Workload

HIDDEN_BYTES = 4096 * 4
PROMPT = 512


def _workload(layers: int = 8, grains: int = 8) -> Workload:
    """Embedding, `layers` x (attention, MLP) halves that split into `grains` shares, head."""
    def unit(flops: float, index: int, last: bool = False, shareable: bool = True) -> Unit:
        outputs = () if last else (Output(HIDDEN_BYTES, (index + 1,)),)
        return Unit(flops=flops, weight_bytes=flops, kv_bytes_per_token=1e3, outputs=outputs,
                    share_grains=grains if shareable else 0)

    halves = 2 * layers
    units = [unit(1e6, 0, shareable=False)]
    units += [unit(1e7, i) for i in range(1, halves + 1)]
    units.append(unit(1e6, halves + 1, last=True, shareable=False))
    return Workload(tuple(units), return_bytes=8)


def _cluster(count: int, latency_s: float, bandwidth_Bps: float = 1e9,
             flops: tuple[float, ...] = (), memory: tuple[float, ...] = ()) -> Cluster:
    devices = tuple(Device(f"p{i}", flops=flops[i] if flops else 1e10,
                           memory_available=memory[i] if memory else 1e12)
                    for i in range(count))
    links = tuple(Link(f"p{i}", f"p{j}", latency_s, bandwidth_Bps)
                  for i in range(count) for j in range(i + 1, count))
    return Cluster("p0", devices, links)


def test_shares_follow_speed_when_memory_allows():
    assert galaxy_shares([3.0, 1.0], [1e9, 1e9], 100.0) == pytest.approx((0.75, 0.25))


def test_a_member_short_of_memory_keeps_what_fits_and_the_rest_moves_by_speed():
    fractions = galaxy_shares([2.0, 1.0, 1.0], [10.0, 100.0, 100.0], 100.0)
    assert fractions == pytest.approx((0.10, 0.45, 0.45))
    assert sum(fractions) == pytest.approx(1.0)


def test_members_that_cannot_hold_the_units_together_are_refused():
    with pytest.raises(Infeasible, match="offer 30 bytes for 100 bytes"):
        galaxy_shares([1.0, 1.0], [10.0, 20.0], 100.0)


def test_a_ring_collective_takes_n_minus_1_rounds_of_a_1_over_n_slice():
    cluster = _cluster(3, latency_s=1e-3, bandwidth_Bps=1e6)
    assert collective_s(cluster, ["p0", "p1", "p2"], 3e3) == pytest.approx(2 * (1e-3 + 1e-3))
    assert collective_s(cluster, ["p0"], 3e3) == 0.0


def test_stages_of_one_peer_each_are_priced_as_the_pipeline_simulator_prices_them():
    cluster, workload = _cluster(2, latency_s=1e-3), _workload()
    stages = [GroupStage((Share("p0", 1.0),), 0, 9), GroupStage((Share("p1", 1.0),), 9, 18)]
    predicted = predict(cluster, workload, stages, 1)
    simulated = simulate(cluster, workload, [Stage("p0", 0, 9), Stage("p1", 9, 18)])
    assert predicted.latency_s == pytest.approx(simulated.latency_s)
    assert predicted.bottleneck_s == pytest.approx(simulated.bottleneck_s)


def test_a_group_divides_the_shared_units_and_adds_two_collectives_each():
    cluster, workload = _cluster(2, latency_s=1e-3), _workload(layers=1)
    alone = predict(cluster, workload, [GroupStage((Share("p0", 1.0),), 0, 4)], 1)
    pair = predict(cluster, workload,
                   [GroupStage((Share("p0", 0.5), Share("p1", 0.5)), 0, 4)], 1)
    half_of_the_layer = 0.5 * (2e7 / 1e10)
    collectives = 2 * 2 * collective_s(cluster, ["p0", "p1"], HIDDEN_BYTES)
    assert alone.latency_s - pair.latency_s == pytest.approx(half_of_the_layer - collectives)


def test_fast_links_make_a_group_the_fastest_first_token():
    cluster, workload = _cluster(2, latency_s=1e-5), _workload()
    kinds = best_by_kind(cluster, workload, FIRST_TOKEN, PROMPT)
    assert best_shape(cluster, workload, FIRST_TOKEN, PROMPT).kind is ShapeKind.GROUP
    alone = kinds[ShapeKind.ALONE].predicted.first_token_s
    assert alone / kinds[ShapeKind.GROUP].predicted.first_token_s > 1.6
    ungrouped = [shape.predicted.first_token_s for kind, shape in kinds.items()
                 if kind in (ShapeKind.ALONE, ShapeKind.PIPELINE)]
    assert min(ungrouped) == alone  # a pipeline only adds hops to one answer's prompt


def test_slow_links_make_one_peer_or_a_pipeline_the_fastest_decode():
    cluster, workload = _cluster(2, latency_s=5e-3), _workload()
    assert best_shape(cluster, workload, "latency", PROMPT).kind is not ShapeKind.GROUP
    fast = _cluster(2, latency_s=1e-6)
    assert best_shape(fast, workload, "latency", PROMPT).kind is ShapeKind.GROUP


def test_a_peer_that_reads_a_little_faster_does_not_take_the_layers_off_the_source():
    """Two cores alike read 9% apart: a pipeline of the embedding alone on the source and
    every layer on the other is predicted a little faster than the source alone, but not by
    MORE_PEERS_GAIN, so the source keeps the model; a peer clearly faster takes the layers."""
    workload = _workload()
    slow_link = _cluster(2, latency_s=2e-4, bandwidth_Bps=12.5e6, flops=(1e10, 1.09e10))
    kinds = best_by_kind(slow_link, workload, FIRST_TOKEN, PROMPT)
    alone, pipeline = kinds[ShapeKind.ALONE], kinds[ShapeKind.PIPELINE]
    assert [s.units for s in pipeline.stages] == [range(0, 1), range(1, 18)]
    gain = alone.predicted.first_token_s / pipeline.predicted.first_token_s - 1
    assert 0 < gain < MORE_PEERS_GAIN
    assert fastest(kinds.values(), gain=0.0) == pipeline
    assert best_shape(slow_link, workload, FIRST_TOKEN, PROMPT) == alone
    faster = _cluster(2, latency_s=2e-4, bandwidth_Bps=12.5e6, flops=(1e10, 1.5e10))
    assert best_shape(faster, workload, FIRST_TOKEN, PROMPT).kind is ShapeKind.PIPELINE


def test_throughput_prefers_a_pipeline_which_exchanges_nothing_inside_a_stage():
    cluster, workload = _cluster(4, latency_s=1e-3), _workload()
    assert best_shape(cluster, workload, "throughput", PROMPT).kind is ShapeKind.PIPELINE


def test_a_slower_peer_gets_the_smaller_share():
    cluster = _cluster(2, latency_s=1e-6, flops=(3e10, 1e10))
    shape = best_shape(cluster, _workload(), FIRST_TOKEN, PROMPT)
    assert shape.kind is ShapeKind.GROUP
    assert [share.fraction for share in shape.stages[0].shares] == pytest.approx([0.75, 0.25])


def test_memory_moves_shares_off_a_fast_peer_that_cannot_hold_its_part():
    workload = _workload()
    total = sum(u.weight_bytes + 2048 * u.kv_bytes_per_token for u in workload.units)
    small = 0.4 * total / 0.7  # the planner fills 0.7 of what a peer offers
    cluster = _cluster(2, latency_s=1e-6, flops=(3e10, 1e10), memory=(small, 1e12))
    shape = best_shape(cluster, workload, FIRST_TOKEN, PROMPT)
    stage = next(s for s in shape.stages if len(s.shares) > 1)
    needs = member_needs(cluster, workload, stage)
    assert needs["p0"] <= 0.7 * small * (1 + 1e-9)
    assert stage.shares[0].fraction < 0.75


def test_units_that_cannot_be_shared_leave_only_pipelines():
    workload = _workload(grains=0)
    assert all(len(group) == 1 for cut in groupings(_cluster(3, 1e-3), workload)
               for group in cut)
    shape = best_shape(_cluster(3, latency_s=1e-6), workload, FIRST_TOKEN, PROMPT)
    assert shape.kind in (ShapeKind.ALONE, ShapeKind.PIPELINE)


def test_groups_are_no_larger_than_the_units_split():
    cuts = list(groupings(_cluster(4, 1e-3), _workload(grains=2)))
    assert len(cuts) == 10  # of the 15 partitions of 4 peers, those without a block over 2
    assert max(len(group) for cut in cuts for group in cut) == 2
    assert all(group[0] == "p0" for cut in cuts for group in cut if "p0" in group)


def test_bad_objectives_and_prompts_are_refused_in_one_line():
    cluster, workload = _cluster(2, 1e-3), _workload()
    with pytest.raises(InvalidInput, match="objective must be one of"):
        best_shape(cluster, workload, "fastest", PROMPT)
    with pytest.raises(InvalidInput, match="at least 1 token"):
        best_shape(cluster, workload, FIRST_TOKEN, 0)


def test_units_files_say_how_far_a_unit_splits():
    raw = {"units": [{"flops": 1, "weight_bytes": 1, "kv_bytes_per_token": 0,
                      "share_grains": 4, "prefill_flops": 3}], "return_bytes": 0}
    unit = workload_from_dict(raw).units[0]
    assert (unit.share_grains, unit.flops_per_prompt_token) == (4, 3.0)
    raw["units"][0]["share_grains"] = -1
    with pytest.raises(InvalidInput, match="share_grains must be a whole number"):
        workload_from_dict(raw)


def test_a_group_size_keeps_only_shapes_of_such_groups():
    cluster, workload = _cluster(4, latency_s=5e-3), _workload()
    shape = best_shape(cluster, workload, "latency", PROMPT, group_size=2)
    assert {len(stage.shares) for stage in shape.stages} == {2}
    with pytest.raises(Infeasible, match="no groups of 5 peers can hold the model"):
        best_shape(cluster, workload, "latency", PROMPT, group_size=5)


def test_a_prompt_is_priced_at_the_peers_prompt_speed():
    """Over a 100 Mbit/s link, priced at decode speed a prompt's compute looks so long that
    sharing it pays for moving its rows; at the prompt speed (14x here) it does not, and one
    peer is the fastest to the first token."""
    workload = _workload()
    slow = _cluster(2, latency_s=5e-4, bandwidth_Bps=12.5e6, flops=(1e9, 1.05e9))
    assert best_shape(slow, workload, FIRST_TOKEN, PROMPT).kind is not ShapeKind.ALONE
    measured = Cluster("p0", tuple(replace(d, prompt_flops=14 * d.flops) for d in slow.devices),
                       slow.links)
    alone = best_shape(measured, workload, FIRST_TOKEN, PROMPT)
    assert alone.kind is ShapeKind.ALONE
    prompt_flops = PROMPT * sum(unit.flops for unit in workload.units)
    assert alone.predicted.first_token_s == pytest.approx(prompt_flops / 14e9)
