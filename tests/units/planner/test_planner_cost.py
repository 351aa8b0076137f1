"""The cost model on hand-computed examples, the constraint checker and the shortfall messages."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.constraints import require_feasible, violations
from planner.cost import critical_path_s, messages, seconds_per_flop, simulate, stage_compute_s
from planner.errors import Infeasible
from planner.model import Battery, Cluster, Device, Link, Output, Stage, Unit, Workload
from planner.solve import solve

MS = 1e-3


def three_peers(**overrides) -> Cluster:
    """a (source, 1 GFLOP/s), b (2 GFLOP/s at half load), c (1 GFLOP/s on battery, +50%)."""
    devices = (
        Device("a", flops=1e9, memory_available=1e9),
        Device("b", flops=2e9, memory_available=1e9, load=0.5),
        Device("c", flops=1e9, memory_available=1e9, battery=Battery(50, plugged=False)),
    )
    links = (
        Link("a", "b", 1 * MS, 1e6),
        Link("b", "c", 2 * MS, 1e6),
        Link("a", "c", 10 * MS, 1e6),
        Link("c", "a", 3 * MS, 1e6),
        Link("b", "a", 4 * MS, 2e6),
    )
    return Cluster(**{"source": "a", "devices": devices, "links": links,
                      "battery_penalty": 0.5, **overrides})


def chain() -> Workload:
    """u0 sends 1000 B to u1 and a 500 B residual to u2; u1 sends 2000 B to u2."""
    return Workload(
        units=(
            Unit(1e6, 1e6, 0, (Output(1000, (1,)), Output(500, (2,)))),
            Unit(2e6, 1e6, 0, (Output(2000, (2,)),)),
            Unit(3e6, 1e6, 0),
        ),
        return_bytes=100,
    )


RING = [Stage("a", 0, 1), Stage("b", 1, 2), Stage("c", 2, 3)]


def test_compute_counts_load_and_the_battery_penalty():
    cluster = three_peers()
    assert seconds_per_flop(cluster, cluster.device("a")) == pytest.approx(1e-9)
    assert seconds_per_flop(cluster, cluster.device("b")) == pytest.approx(1e-9)
    assert seconds_per_flop(cluster, cluster.device("c")) == pytest.approx(1.5e-9)


def test_a_measured_unit_costs_its_measured_time_and_the_others_their_flops():
    cluster = three_peers()
    measured = Cluster(cluster.source, tuple(
        replace(d, unit_s={0: 5 * MS, 2: 7 * MS}) if d.id in ("a", "c") else d
        for d in cluster.devices), cluster.links, battery_penalty=0.5)
    # a: unit 0 measured (5 ms), unit 1 by its FLOPs at 1 GFLOP/s (2 ms)
    assert stage_compute_s(measured, chain(), Stage("a", 0, 2)) == pytest.approx(7 * MS)
    # b measured nothing: 1 + 2 + 3 MFLOP at 1 GFLOP/s effective
    assert stage_compute_s(measured, chain(), Stage("b", 0, 3)) == pytest.approx(6 * MS)
    # c is on battery: its measured time takes the penalty too
    assert stage_compute_s(measured, chain(), Stage("c", 2, 3)) == pytest.approx(10.5 * MS)
    # and a stage adds its peer's overhead per step
    busy = replace(measured, devices=tuple(replace(d, stage_overhead_s=MS)
                                           for d in measured.devices))
    assert stage_compute_s(busy, chain(), Stage("c", 2, 3)) == pytest.approx(12 * MS)
    assert stage_compute_s(busy, chain(), Stage("a", 0, 2)) == pytest.approx(8 * MS)


def test_a_unit_measured_slow_on_its_peer_moves_to_another():
    cluster = Cluster("a", (Device("a", 1e9, 1e9), Device("b", 1e9, 1e9)),
                      (Link("a", "b", 0.1 * MS, 1e9),))
    units = Workload(tuple(Unit(1e6, 1e6, 0, (Output(10, (u + 1,)),) if u < 3 else ())
                           for u in range(4)), 8)
    even = solve(cluster, units, "throughput")
    assert [(s.peer, s.start, s.stop) for s in even.stages] == [("a", 0, 2), ("b", 2, 4)]
    slow_on_b = replace(cluster, devices=(cluster.devices[0],
                                          replace(cluster.devices[1], unit_s={2: 5 * MS})))
    for objective in ("throughput", "latency"):
        moved = solve(slow_on_b, units, objective)
        assert next(s.peer for s in moved.stages if 2 in s.units) == "a", objective
    assert solve(slow_on_b, units, "throughput").predicted.bottleneck_s == pytest.approx(3 * MS)


def test_a_late_residual_delays_its_consumer_stage():
    # a finishes at 1 ms; the hop a->b lands at 1 + 1 + 1 = 3 ms; b finishes at 5 ms.
    # The hop b->c lands at 5 + 2 + 2 = 9 ms, the residual a->c at 1 + 10 + 0.5 = 11.5 ms,
    # so c starts at 11.5 ms, finishes at 16 ms; the return adds 3 + 0.1 ms.
    predicted = simulate(three_peers(), chain(), RING)
    assert predicted.latency_s == pytest.approx(19.1 * MS)
    assert critical_path_s(three_peers(), chain(), RING) == pytest.approx(16.6 * MS)


def test_bottleneck_is_the_slowest_stage_or_link():
    predicted = simulate(three_peers(), chain(), RING)
    assert predicted.bottleneck_s == pytest.approx(4.5 * MS)  # c computes 3 MFLOP at 1.5 ns
    assert predicted.throughput_tps == pytest.approx(1 / (4.5 * MS))
    slow = three_peers(links=(Link("a", "b", 0, 1e5), Link("b", "c", 0, 1e6),
                              Link("a", "c", 0, 1e6), Link("c", "a", 0, 1e6)))
    # 1000 B at 100 kB/s
    assert simulate(slow, chain(), RING).bottleneck_s == pytest.approx(10 * MS)


def test_an_output_goes_once_to_each_stage_that_consumes_it():
    workload = Workload((Unit(1, 0, 0, (Output(7, (1, 2)),)), Unit(1, 0, 0), Unit(1, 0, 0)))
    assert messages(workload, [Stage("a", 0, 1), Stage("b", 1, 3)]) == {(0, 1): 7}
    assert messages(workload, RING) == {(0, 1): 7, (0, 2): 7, (1, 2): 0}
    assert messages(workload, [Stage("a", 0, 3)]) == {}


def test_one_stage_has_no_hops_and_no_return():
    predicted = simulate(three_peers(), chain(), [Stage("a", 0, 3)])
    assert predicted.latency_s == pytest.approx(6 * MS)
    assert predicted.bottleneck_s == pytest.approx(6 * MS)


def test_a_link_measured_one_way_serves_both_ways():
    cluster = three_peers(links=(Link("a", "b", 1 * MS, 1e6),))
    stages = [Stage("a", 0, 2), Stage("b", 2, 3)]
    assert violations(cluster, chain(), stages) == []
    # compute 3 ms + hop (1 ms + 2500 B) + b's 3 ms + return over b -> a (1 ms + 100 B)
    assert simulate(cluster, chain(), stages).latency_s == pytest.approx(10.6 * MS)


@pytest.mark.parametrize(("stages", "complaint"), [
    ([Stage("b", 0, 1), Stage("a", 1, 3)], "not the source"),
    ([Stage("a", 0, 1), Stage("a", 1, 3)], "more than one stage"),
    ([Stage("a", 0, 1), Stage("b", 2, 3)], "do not cover"),
    ([Stage("a", 0, 1), Stage("x", 1, 3)], "unknown peer"),
    ([Stage("a", 0, 1), Stage("b", 1, 1), Stage("c", 1, 3)], "holds no units"),
])
def test_violations_name_a_broken_shape(stages, complaint):
    assert any(complaint in v for v in violations(three_peers(), chain(), stages))


def test_violations_name_memory_battery_and_missing_links():
    cluster = three_peers(links=(Link("a", "b", 0, 1e6),), battery_min_percent=60)
    found = violations(cluster, chain(), RING)
    assert any("'c' is on battery at 50%" in v for v in found)
    assert any("no link 'b' -> 'c'" in v for v in found)
    tight = three_peers(beta=0.0015)  # 1.5 MB per peer; a stage of two units needs 2 MB
    found = violations(tight, chain(), [Stage("a", 0, 2), Stage("b", 2, 3)])
    assert found == ["peer 'a' needs 2.0 MB for units 0-1 but offers 1.5 MB at beta 0.0015"]
    assert violations(three_peers(), chain(), RING) == []


def test_the_kv_cache_for_the_context_counts_as_memory():
    workload = Workload((Unit(1, 1e6, 1000),))
    cluster = Cluster("a", (Device("a", 1e9, 3e6 / 0.7),), context=2048)
    assert violations(cluster, workload, [Stage("a", 0, 1)])  # 1 MB + 2.048 MB > 3 MB
    roomy = Cluster("a", (Device("a", 1e9, 3e6 / 0.7),), context=1000)
    assert violations(roomy, workload, [Stage("a", 0, 1)]) == []


def test_shortfall_names_need_and_offer():
    workload = Workload(tuple(Unit(1, 1.3e9, 0) for _ in range(7)))  # 9.1 GB
    cluster = Cluster("a", (Device("a", 1e9, 4.5e9), Device("b", 1e9, 4.5e9)))
    with pytest.raises(Infeasible, match=r"^model needs 9\.1 GB at beta 0\.7; usable peers "
                                         r"offer 6\.3 GB$"):
        require_feasible(cluster, workload)


def test_peers_below_the_battery_threshold_offer_nothing():
    low = Battery(10, plugged=False)
    cluster = Cluster("a", (Device("a", 1e9, 1e9), Device("b", 1e9, 1e9, battery=low)))
    with pytest.raises(Infeasible, match="usable peers offer 700.0 MB"):
        require_feasible(cluster, Workload((Unit(1, 6e8, 0), Unit(1, 6e8, 0))))
    drained = Cluster("a", (Device("a", 1e9, 1e9, battery=low), Device("b", 1e9, 1e9)))
    with pytest.raises(Infeasible, match="source peer 'a' is on battery at 10%.*hold unit 0"):
        require_feasible(drained, Workload((Unit(1, 1, 0),)))
    everyone = Cluster("a", (Device("a", 1e9, 1e9, battery=low),))
    with pytest.raises(Infeasible, match="no usable peers"):
        require_feasible(everyone, Workload((Unit(1, 1, 0),)))


def test_a_unit_bigger_than_every_peer_is_named():
    cluster = Cluster("a", (Device("a", 1e9, 1e9), Device("b", 1e9, 1e9)))
    with pytest.raises(Infeasible, match="unit 1 needs 800.0 MB; the largest usable peer offers"):
        require_feasible(cluster, Workload((Unit(1, 1e8, 0), Unit(1, 8e8, 0))))
