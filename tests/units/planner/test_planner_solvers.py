"""Solvers on hand-made clusters: baselines, EdgeShard's DP, the exact methods, the overlap
plan, solve()'s errors."""

from __future__ import annotations

import pytest

from planner import milp
from planner.baselines import proportional_counts
from planner.cost import critical_path_s, simulate, stage_compute_s
from planner.deadline import Deadline
from planner.errors import Infeasible, InvalidInput, PlannerError
from planner.incumbent import Incumbent
from planner.model import Cluster, Device, Link, Output, Stage, Unit, Workload
from planner.overlap import movable_units
from planner.paths import path_model
from planner.reach import least_compute_bottleneck
from planner.search import settle_latency
from planner.solve import solve

MB, MS = 1e6, 1e-3


def full_mesh(devices: tuple[Device, ...], latency: float = MS, bandwidth: float = 1e9,
              special: dict | None = None) -> tuple[Link, ...]:
    special = special or {}
    return tuple(Link(a.id, b.id, special.get((a.id, b.id), latency), bandwidth)
                 for a in devices for b in devices if a != b)


def uniform(count: int, weight: float = 100 * MB, flops: float = 1e9) -> Workload:
    return Workload(tuple(
        Unit(flops, weight, 0, (Output(1000, (u + 1,)),) if u + 1 < count else ())
        for u in range(count)
    ), return_bytes=8)


def peers(*memories: float, flops: float = 1e10) -> tuple[Device, ...]:
    return tuple(Device(f"p{i}", flops, m / 0.7) for i, m in enumerate(memories))


def test_even_split_gives_equal_counts_in_cluster_order():
    devices = peers(1e9, 1e9, 1e9)
    cluster = Cluster("p1", devices, full_mesh(devices))
    plan = solve(cluster, uniform(5), "throughput", "even")
    assert [(s.peer, s.start, s.stop) for s in plan.stages] == [
        ("p1", 0, 2), ("p0", 2, 4), ("p2", 4, 5)]


def test_memory_split_follows_memory_largest_first_after_the_source():
    devices = peers(300 * MB, 900 * MB, 600 * MB)
    cluster = Cluster("p0", devices, full_mesh(devices))
    plan = solve(cluster, uniform(6), "throughput", "memory")
    assert [(s.peer, len(s.units)) for s in plan.stages] == [("p0", 1), ("p1", 3), ("p2", 2)]


@pytest.mark.parametrize(("weights", "total"), [
    ([1, 1, 1], 7), ([100, 1, 1, 1], 4), ([0.3, 0.9, 0.6], 6), ([5, 0.001], 3), ([0, 0], 2)])
def test_proportional_counts_hand_out_every_item_and_one_each(weights, total):
    counts = proportional_counts(weights, total)
    assert sum(counts) == total and min(counts) >= 1
    share = [w / sum(weights) * total if sum(weights) else total / len(weights) for w in weights]
    assert all(abs(c - s) < 1 + 1e-9 or c == 1 for c, s in zip(counts, share, strict=True))


def test_a_baseline_that_breaks_memory_says_so():
    devices = peers(150 * MB, 1000 * MB)
    cluster = Cluster("p0", devices, full_mesh(devices))
    with pytest.raises(Infeasible, match="the even split does not fit: peer 'p0' needs"):
        solve(cluster, uniform(4), "throughput", "even")
    assert len(solve(cluster, uniform(4), "throughput", "milp").stages[0].units) == 1


def test_dp_refuses_more_peers_than_it_can_enumerate():
    devices = peers(*[1e9] * 11)
    cluster = Cluster("p0", devices, full_mesh(devices))
    with pytest.raises(PlannerError, match="at most 10 usable peers .*has 11.*milp"):
        solve(cluster, uniform(12), "throughput", "dp")


def late_residual() -> tuple[Cluster, Workload]:
    """a (source) holds only u0; b, c, d hold one big unit each. u0's 1 kB residual for u2
    reaches c over a 500 ms link but d over a 50 ms one; d computes twice as slowly."""
    devices = (Device("a", 1e9, 50 * MB / 0.7), Device("b", 1e10, 1.2e9 / 0.7),
               Device("c", 1e10, 1.2e9 / 0.7), Device("d", 5e9, 1.2e9 / 0.7))
    links = full_mesh(devices, special={("a", "c"): 500 * MS, ("a", "d"): 50 * MS})
    units = (Unit(1e6, 10 * MB, 0, (Output(1000, (1,)), Output(1000, (2,)))),
             Unit(1e9, 1e9, 0, (Output(1000, (2,)),)),
             Unit(1e9, 1e9, 0))
    return Cluster("a", devices, links, context=0), Workload(units, return_bytes=8)


def test_milp_latency_counts_the_wait_for_a_late_residual():
    cluster, workload = late_residual()
    via_c = [Stage("a", 0, 1), Stage("b", 1, 2), Stage("c", 2, 3)]
    via_d = [Stage("a", 0, 1), Stage("b", 1, 2), Stage("d", 2, 3)]
    # Without the wait, c looks best; with it, d is.
    assert critical_path_s(cluster, workload, via_c) < critical_path_s(cluster, workload, via_d)
    assert simulate(cluster, workload, via_d).latency_s < simulate(
        cluster, workload, via_c).latency_s
    plan = solve(cluster, workload, "latency", "milp")
    assert list(plan.stages) == via_d
    assert plan.predicted.latency_s == pytest.approx(0.304, rel=1e-3)
    # EdgeShard's DP sees sequential hops only, picks c, and is scored with the wait.
    dp = solve(cluster, workload, "latency", "dp")
    assert list(dp.stages) == via_c
    assert dp.predicted.latency_s > plan.predicted.latency_s


def search_latency(cluster: Cluster, workload: Workload, best: Incumbent) -> None:
    settle_latency(path_model(cluster, workload), best, Deadline())


def milp_latency(cluster: Cluster, workload: Workload, best: Incumbent) -> None:
    milp.milp_latency(cluster, workload, best, Deadline())


@pytest.mark.parametrize("method", [search_latency, milp_latency])
def test_both_exact_latency_methods_count_the_wait(method):
    """solve() takes the search here (residuals come from unit 0 only); the MILP, which
    handles any residuals, must agree."""
    cluster, workload = late_residual()
    best = Incumbent(cluster, workload, "latency")
    method(cluster, workload, best)
    assert [s.peer for s in best.stages] == ["a", "b", "d"]
    assert best.value == pytest.approx(0.304, rel=1e-3)


def test_the_model_with_waits_finds_the_same_plan(monkeypatch):
    monkeypatch.setattr(milp, "ROUNDS", 0)  # skip scoring critical-path plans one by one
    cluster, workload = late_residual()
    best = Incumbent(cluster, workload, "latency")
    milp_latency(cluster, workload, best)
    assert [s.peer for s in best.stages] == ["a", "b", "d"]
    assert best.value == pytest.approx(0.304, rel=1e-3)


def slow_link() -> tuple[Cluster, Workload]:
    """Four units of 0.1 s on a and c; b computes four times faster, but every link to it
    carries a unit's 4 MB output at 10 MB/s (0.4 s); a and c are linked at 1 GB/s."""
    devices = (Device("a", 1e10, 1.2e9 / 0.7), Device("b", 4e10, 1.2e9 / 0.7),
               Device("c", 1e10, 1.2e9 / 0.7))
    links = (Link("a", "b", MS, 1e7), Link("a", "c", MS, 1e9), Link("b", "c", MS, 1e7))
    return Cluster("a", devices, links, context=0), uniform_with(4, output=4 * MB)


def uniform_with(count: int, output: float) -> Workload:
    return Workload(tuple(
        Unit(1e9, 100 * MB, 0, (Output(output, (u + 1,)),) if u + 1 < count else ())
        for u in range(count)
    ), return_bytes=8)


def test_the_compute_bound_sees_compute_and_memory_alone():
    cluster, workload = slow_link()
    found = least_compute_bottleneck(cluster, workload)
    # the source holds unit 0 (0.1 s); b takes the rest in 0.075 s: no split computes faster
    assert found.bottleneck == pytest.approx(0.1)
    assert max(stage_compute_s(cluster, workload, s) for s in found.stages) == \
        pytest.approx(0.1)
    assert "b" in [s.peer for s in found.stages]
    assert simulate(cluster, workload, found.stages).bottleneck_s == pytest.approx(0.4)


def test_a_link_the_compute_bound_cannot_see_is_settled_by_the_milp():
    cluster, workload = slow_link()
    plan = solve(cluster, workload, "throughput", "milp")
    assert [(s.peer, len(s.units)) for s in plan.stages] == [("a", 2), ("c", 2)]
    assert plan.predicted.bottleneck_s == pytest.approx(0.2)
    assert plan.solver == "milp"


def overlap_case(memories: tuple[float, ...], stages: int = 2) -> tuple:
    devices = peers(*memories)
    cluster = Cluster("p0", devices, full_mesh(devices), context=0)
    return cluster, uniform(2 * stages)


def test_overlap_keeps_neighbours_boundary_units_within_memory():
    cluster, workload = overlap_case((400 * MB, 300 * MB))
    stages = (Stage("p0", 0, 2), Stage("p1", 2, 4))
    assert movable_units(cluster, workload, stages) == ((2,), (1,))
    cluster, workload = overlap_case((400 * MB, 200 * MB))
    assert movable_units(cluster, workload, stages) == ((2,), ())


def test_overlap_never_copies_a_stage_empty():
    cluster, workload = overlap_case((1e9, 1e9, 1e9), stages=3)
    stages = (Stage("p0", 0, 2), Stage("p1", 2, 4), Stage("p2", 4, 6))
    movable = movable_units(cluster, workload, stages)
    copied_from_middle = [u for s in (0, 2) for u in movable[s] if 2 <= u < 4]
    assert len(copied_from_middle) == 1
    assert movable[1] == (1, 4)


@pytest.mark.parametrize(("objective", "solver", "complaint"), [
    ("speed", "milp", "objective must be one of latency, throughput"),
    ("latency", "magic", "solver must be one of milp, dp, even, memory"),
])
def test_solve_names_an_unknown_objective_or_solver(objective, solver, complaint):
    devices = peers(1e9)
    with pytest.raises(InvalidInput, match=complaint):
        solve(Cluster("p0", devices), uniform(2), objective, solver)


def test_every_solver_reports_the_shortfall_before_solving():
    devices = peers(150 * MB, 150 * MB)
    cluster = Cluster("p0", devices, full_mesh(devices))
    for solver in ("milp", "dp", "even", "memory"):
        with pytest.raises(Infeasible, match=r"model needs 400\.0 MB at beta 0\.7; usable peers "
                                             r"offer 300\.0 MB"):
            solve(cluster, uniform(4), "throughput", solver)
