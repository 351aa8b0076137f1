"""Property tests of the planner on random small clusters, against exhaustive search.

The oracle enumerates every plan: each sequence of distinct usable peers starting at the
source, and each way to cut the units into that many contiguous non-empty ranges.
Workloads come in two kinds: any residual outputs (the MILP settles latency), and sharded
models' shape, residuals from unit 0 only (the search over peer sets settles latency).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from planner.bounds import lower_bound
from planner.constraints import violations
from planner.cost import (
    capacity,
    critical_path_s,
    memory_need,
    simulate,
    stage_compute_s,
    usable_devices,
)
from planner.deadline import Deadline
from planner.errors import Infeasible
from planner.lagrange import relax, tighten
from planner.model import (
    OBJECTIVES,
    Battery,
    Cluster,
    Device,
    Link,
    Output,
    Stage,
    Unit,
    Workload,
)
from planner.paths import path_model
from planner.reach import least_compute_bottleneck
from planner.solve import SOLVERS, solve

PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batteries(draw) -> Battery | None:
    if draw(st.integers(0, 2)) > 0:
        return None
    return Battery(percent=draw(st.floats(0, 100)), plugged=draw(st.booleans()))


@st.composite
def links(draw, devices: tuple[Device, ...]) -> tuple[Link, ...]:
    """Three kinds of network: some pairs unlinked; every pair fast (only compute matters);
    every pair linked with latencies spread 10^4-fold (residual messages arrive late)."""
    kind = draw(st.sampled_from(["partial", "fast", "spread"]))
    if kind == "partial":
        latency, bandwidth, present = st.floats(1e-4, 2e-2), st.floats(1e6, 1e9), 8
    elif kind == "fast":
        latency, bandwidth, present = st.floats(0, 1e-5), st.floats(1e11, 1e12), 10
    else:
        latency, bandwidth, present = st.floats(1e-5, 1e-1), st.floats(1e6, 1e9), 10
    return tuple(
        Link(a.id, b.id, draw(latency), draw(bandwidth))
        for a, b in itertools.permutations(devices, 2)
        if draw(st.integers(0, 9)) < present
    )


@st.composite
def clusters(draw) -> Cluster:
    count = draw(st.integers(1, 5))
    devices = tuple(
        Device(
            id=f"d{i}",
            flops=draw(st.floats(1e9, 1e11)),
            memory_available=draw(st.floats(1e8, 3e9)),
            load=draw(st.sampled_from([0.0, 0.0, 0.3, 0.6, 0.95])),
            battery=draw(batteries()),
        )
        for i in range(count)
    )
    return Cluster(
        source="d0",
        devices=devices,
        links=draw(links(devices)),
        beta=draw(st.floats(0.4, 1.0)),
        context=draw(st.integers(0, 4096)),
        battery_min_percent=draw(st.floats(0, 40)),
        battery_penalty=draw(st.floats(0, 2)),
    )


@st.composite
def workloads(draw) -> Workload:
    count = draw(st.integers(1, 12))
    units = []
    for u in range(count):
        outputs = []
        later = list(range(u + 1, count))
        if later and draw(st.integers(0, 9)) < 9:
            outputs.append(Output(draw(st.floats(0, 2e6)), (u + 1,)))
        if later and draw(st.booleans()):
            consumers = draw(st.lists(st.sampled_from(later), min_size=1, max_size=4, unique=True))
            outputs.append(Output(draw(st.floats(0, 2e6)), tuple(sorted(consumers))))
        units.append(_unit(draw, outputs))
    return Workload(tuple(units), return_bytes=draw(st.floats(0, 1e5)))


def _unit(draw, outputs: list[Output]) -> Unit:
    return Unit(
        flops=draw(st.floats(1e6, 2e10)),
        weight_bytes=draw(st.floats(0, 5e8)),
        kv_bytes_per_token=draw(st.floats(0, 5e4)),
        outputs=tuple(outputs),
    )


@st.composite
def sharded_workloads(draw) -> Workload:
    """A sharded model's shape: each unit hands its output to the next; only unit 0 sends
    outputs further (rotary tables, masks), to any later units."""
    count = draw(st.integers(1, 12))
    units = []
    for u in range(count):
        outputs = []
        if u + 1 < count and draw(st.integers(0, 9)) < 9:
            outputs.append(Output(draw(st.floats(0, 2e6)), (u + 1,)))
        for _ in range(draw(st.integers(0, 2)) if u == 0 and count > 1 else 0):
            consumers = draw(st.lists(st.integers(1, count - 1), min_size=1, max_size=4,
                                      unique=True))
            outputs.append(Output(draw(st.floats(0, 2e6)), tuple(sorted(consumers))))
        units.append(_unit(draw, outputs))
    return Workload(tuple(units), return_bytes=draw(st.floats(0, 1e5)))


@st.composite
def measured(draw, kind=workloads) -> tuple[Cluster, Workload]:
    """A cluster whose peers measured some units and, some of them, their stage overhead:
    each measured time is the unit's FLOP price there times a factor from 0.05 to 20 (units
    cheaper or dearer than their FLOPs say, differently on each peer)."""
    cluster, workload = draw(clusters()), draw(kind())
    devices = tuple(
        replace(device, unit_s={
            u: unit.flops / device.flops * draw(st.floats(0.05, 20))
            for u, unit in enumerate(workload.units) if draw(st.booleans())
        }, stage_overhead_s=draw(st.sampled_from([0.0, 1e-4, 0.01, 0.5])))
        for device in cluster.devices
    )
    return replace(cluster, devices=devices), workload


def every_plan(cluster: Cluster, workload: Workload):
    count = len(workload.units)
    others = [d.id for d in usable_devices(cluster) if d.id != cluster.source]
    for n in range(1, min(len(others) + 1, count) + 1):
        for peers in itertools.permutations(others, n - 1):
            for cuts in itertools.combinations(range(1, count), n - 1):
                bounds = (0, *cuts, count)
                ring = (cluster.source, *peers)
                yield [Stage(p, a, b) for p, a, b in zip(ring, bounds, bounds[1:], strict=False)]


def exhaustive(cluster: Cluster, workload: Workload) -> dict[str, float | None]:
    """The best objective value of every valid plan, per objective (None: no valid plan)."""
    best: dict[str, float | None] = dict.fromkeys(OBJECTIVES)
    for stages in every_plan(cluster, workload):
        if violations(cluster, workload, stages):
            continue
        predicted = simulate(cluster, workload, stages)
        for objective in OBJECTIVES:
            value = predicted.objective(objective)
            if best[objective] is None or value < best[objective]:
                best[objective] = value
    return best


def sequential_only(workload: Workload) -> Workload:
    """The workload EdgeShard's DP sees: every output keeps only its consumer u + 1."""
    return replace(workload, units=tuple(
        replace(unit, outputs=tuple(Output(o.bytes, (u + 1,)) for o in unit.outputs
                                    if u + 1 in o.consumers))
        for u, unit in enumerate(workload.units)
    ))


def overlap_problems(cluster: Cluster, workload: Workload, plan) -> list[str]:
    """What breaks the overlap plan's rules (docs/planner.md); empty when it is sound."""
    found = []
    stages = plan.stages
    copied = [u for movable in plan.movable for u in movable]
    if len(copied) != len(set(copied)):
        found.append("a unit is copied by two neighbours")
    for s, (stage, movable) in enumerate(zip(stages, plan.movable, strict=True)):
        neighbours = set()
        for t in (s - 1, s + 1):
            if 0 <= t < len(stages):
                neighbours |= set(stages[t].units)
        if not set(movable) <= neighbours:
            found.append(f"stage {s} copies units that are not its neighbours'")
        held = sorted(set(stage.units) | set(movable))
        if held != list(range(held[0], held[-1] + 1)):
            found.append(f"stage {s} holds a non-contiguous range")
        need = sum(memory_need(cluster, workload.units[u]) for u in held)
        if need > capacity(cluster, cluster.device(stage.peer)) * (1 + 1e-9):
            found.append(f"stage {s} cannot fit its copies")
        if set(stage.units) <= set(copied):
            found.append(f"every unit of stage {s} is copied away")
    return found


def least_compute(cluster: Cluster, workload: Workload) -> float | None:
    """The least largest stage compute over the plans that fit memory (links ignored)."""
    return min((max(stage_compute_s(cluster, workload, s) for s in stages)
                for stages in every_plan(cluster, workload) if fits(cluster, workload, stages)),
               default=None)


def fits(cluster: Cluster, workload: Workload, stages: list[Stage]) -> bool:
    return all(sum(memory_need(cluster, workload.units[u]) for u in stage.units)
               <= capacity(cluster, cluster.device(stage.peer)) * (1 + 1e-9) for stage in stages)


@pytest.mark.slow
@PROPERTY
@given(clusters(), workloads())
def test_milp_equals_exhaustive_search_for_both_objectives(cluster, workload):
    assert_milp_optimal(cluster, workload)


@pytest.mark.slow
@PROPERTY
@given(clusters(), sharded_workloads())
def test_milp_equals_exhaustive_search_on_sharded_models(cluster, workload):
    assert_milp_optimal(cluster, workload)


@pytest.mark.slow
@settings(PROPERTY, max_examples=100)
@given(measured())
def test_milp_equals_exhaustive_search_with_measured_unit_times(drawn):
    assert_milp_optimal(*drawn)


@pytest.mark.slow
@settings(PROPERTY, max_examples=100)
@given(measured(sharded_workloads))
def test_milp_equals_exhaustive_search_on_sharded_models_with_measured_unit_times(drawn):
    assert_milp_optimal(*drawn)


def assert_milp_optimal(cluster: Cluster, workload: Workload) -> None:
    best = exhaustive(cluster, workload)
    for objective in OBJECTIVES:
        if best[objective] is None:
            event("no valid plan")
            with pytest.raises(Infeasible):
                solve(cluster, workload, objective, "milp")
            continue
        plan = solve(cluster, workload, objective, "milp")
        event(f"{objective}: the optimum has {len(plan.stages)} stage(s)")
        if critical_path_s(cluster, workload, plan.stages) < plan.predicted.latency_s * (1 - 1e-9):
            event(f"{objective}: the optimum waits for a residual message")
        assert violations(cluster, workload, plan.stages) == []
        assert plan.predicted == simulate(cluster, workload, plan.stages)
        assert plan.predicted.objective(objective) == pytest.approx(best[objective], rel=1e-6)
        assert plan.solver == "milp"


@pytest.mark.slow
@PROPERTY
@given(clusters(), sharded_workloads())
def test_the_exact_methods_bounds_hold(cluster, workload):
    assert_bounds_hold(cluster, workload)


@pytest.mark.slow
@settings(PROPERTY, max_examples=100)
@given(measured(sharded_workloads))
def test_the_bounds_hold_with_measured_unit_times(drawn):
    cluster, workload = drawn
    assert_bounds_hold(cluster, workload)
    best = exhaustive(cluster, workload)
    for objective in OBJECTIVES:
        if best[objective] is not None:
            assert lower_bound(cluster, workload, objective) <= best[objective] * (1 + 1e-9)


def assert_bounds_hold(cluster: Cluster, workload: Workload) -> None:
    """The compute-only bottleneck is the least over the plans that fit memory, and the
    latency's relaxation bounds the least latency from below, tightened (peers made critical
    until its optimum uses none twice) or not."""
    if cluster.device(cluster.source) not in usable_devices(cluster):
        return  # solve() refuses such a cluster before any method runs
    compute = least_compute(cluster, workload)
    found = least_compute_bottleneck(cluster, workload)
    assert (found is None) == (compute is None)
    if found is not None:
        assert found.bottleneck == pytest.approx(compute, rel=1e-9)
        assert max(stage_compute_s(cluster, workload, s) for s in found.stages) == \
            pytest.approx(compute, rel=1e-9)
    latency = exhaustive(cluster, workload)["latency"]
    if latency is not None:
        model = path_model(cluster, workload)
        relaxed = relax(model, latency, lambda blocks: latency, Deadline())
        tightened = tighten(relaxed, model, math.inf, lambda blocks: math.inf, Deadline())
        assert relaxed.bound <= tightened.bound <= latency * (1 + 1e-9)


@pytest.mark.slow
@PROPERTY
@given(clusters(), workloads())
def test_dp_is_optimal_for_its_sequential_model(cluster, workload):
    sequential = sequential_only(workload)
    best = exhaustive(cluster, sequential)
    for objective in OBJECTIVES:
        if best[objective] is None:
            with pytest.raises(Infeasible):
                solve(cluster, sequential, objective, "dp")
            continue
        plan = solve(cluster, sequential, objective, "dp")
        assert plan.predicted.objective(objective) == pytest.approx(best[objective], rel=1e-9)


@pytest.mark.slow
@PROPERTY
@given(clusters(), workloads(), st.sampled_from(OBJECTIVES))
def test_every_returned_plan_satisfies_every_constraint(cluster, workload, objective):
    plans = {}
    for solver in SOLVERS:
        try:
            plans[solver] = solve(cluster, workload, objective, solver)
        except Infeasible:
            continue
        assert violations(cluster, workload, plans[solver].stages) == [], solver
        assert overlap_problems(cluster, workload, plans[solver]) == [], solver
    if plans:
        assert "milp" in plans, "another solver found a valid plan the milp did not"
        best = plans["milp"].predicted.objective(objective)
        for solver, plan in plans.items():
            assert best <= plan.predicted.objective(objective) * (1 + 1e-6), solver
