"""The leader's planning: planner inputs from measurements, the solver fallback, and the
coordinator deciding when to re-plan and whom to send a plan."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from daemon_objects import unstarted_daemon
from toy_units import ToyModel, write_toy

from peerd.api.plan_events import plan_events
from peerd.commands.cli import build_parser
from peerd.control.coordinator import Coordinator, Shapes
from peerd.control.planning import (
    cluster_from_report,
    context_for,
    solve_plan,
    workload_from_manifest,
)
from peerd.control.rebalance import Policy
from peerd.daemon.start import options_from_args
from peerd.errors import PeerdError
from peerd.wire.protocol import (
    Battery,
    ClusterReport,
    DeployReport,
    LinkFigures,
    ManifestOffer,
    PeerFigures,
    PlanAssignment,
    UnitTimes,
)
from peerd.wire.transport import TransportError
from planner.errors import Infeasible
from shards.manifest import Manifest

UNIT_BYTES = 100_000


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    """The toy model with 100 kB of weights per unit: 300 kB plus 1 kB of KV in all."""
    toy = write_toy(tmp_path_factory.mktemp("toy"), ToyModel())
    units = tuple(dataclasses.replace(u, weight_bytes=UNIT_BYTES) for u in toy.units)
    return dataclasses.replace(toy, key="k" * 64, units=units)


def figures(peer: str, memory: int = 10**6, flops: float = 1e9, model: str | None = None,
            battery: Battery | None = None) -> PeerFigures:
    return PeerFigures(peer, flops, memory, memory, 0.1, battery, model, ())


def report(*peers: PeerFigures, epoch: int = 1) -> ClusterReport:
    ids = [p.id for p in peers]
    links = tuple(LinkFigures(a, b, 1e-4, 1e8) for a in ids for b in ids if a != b)
    return ClusterReport(epoch, peers, links)


# -- planner inputs -------------------------------------------------------------------------------


def test_the_cluster_holds_measured_peers_their_links_and_the_model_peer_as_source():
    measured = report(
        figures("b", memory=5000, model="toy"),
        figures("a", battery=Battery(40.0, False)),
        figures("c", flops=0.0),  # not measured yet
    )
    cluster = cluster_from_report(measured, "b", context=64)
    assert cluster.source == "b" and cluster.context == 64
    assert [d.id for d in cluster.devices] == ["a", "b"]
    assert cluster.device("b").memory_available == 5000
    assert cluster.device("a").on_battery and cluster.device("a").battery.percent == 40
    assert {(link.src, link.dst) for link in cluster.links} == {("a", "b"), ("b", "a")}
    with pytest.raises(Infeasible, match="model peer c has not been measured"):
        cluster_from_report(measured, "c", context=64)


def timed(peer: PeerFigures, model: str, seconds: dict[int, float],
          overhead_s: float | None = None) -> PeerFigures:
    """The peer's figures with these measured seconds per decode token for `model`'s units
    (and per step outside them)."""
    times = UnitTimes(model, tuple(seconds), tuple(seconds.values()), overhead_s)
    return dataclasses.replace(peer, unit_times=times)


def test_units_are_priced_by_own_times_else_others_scaled_by_speed_else_flops():
    measured = report(
        timed(figures("a", model="toy"), "key", {0: 0.002, 1: 0.004}, overhead_s=0.001),
        timed(figures("b", flops=2e9), "key", {1: 0.001, 7: 0.5}),  # 7: not a unit of it
        timed(figures("c"), "another model", {2: 9.0}),
    )
    devices = {d.id: d for d in cluster_from_report(measured, "a", 64, "key", 3).devices}
    assert devices["a"].unit_s == {0: 0.002, 1: 0.004}  # unit 2: nobody ran it, FLOPs
    assert devices["b"].unit_s == pytest.approx({0: 0.001, 1: 0.001})  # 2x a's speed
    # c ran nothing of this model: a's times as they are, b's at half b's speed, the median
    assert devices["c"].unit_s == pytest.approx({0: 0.002, 1: 0.003})
    overheads = {peer: d.stage_overhead_s for peer, d in devices.items()}
    assert overheads == pytest.approx({"a": 0.001, "b": 0.0005, "c": 0.001})
    assert all(not d.unit_s for d in cluster_from_report(measured, "a", 64).devices)


async def test_a_unit_measured_slower_on_its_peer_moves_to_another_in_the_next_plan(manifest):
    """Every peer ran every unit at 1 ms; then the last unit takes 50 ms on its peer: the
    rebalancer, on the same prices as the planner, moves it away."""
    leader = Leader(manifest)
    peers = [figures("a", SMALL, model="toy"), figures("b", SMALL), figures("c", SMALL)]
    even = {u: 0.001 for u in range(3)}
    first = await leader.step(report(*(timed(f, manifest.key, even) for f in peers)))
    _deploy(leader)
    slow = first.stages[-1].peer
    slowed = report(*(timed(f, manifest.key, {**even, 2: 0.05} if f.id == slow else even)
                      for f in peers))
    leader.now = 100.0
    assert await leader.step(slowed) is first
    leader.now = 103.5
    moved = await leader.step(slowed)
    assert moved.plan_id == first.plan_id + 1
    assert next(s.peer for s in moved.stages if s.last == 2) != slow
    assert moved.rebalance is not None and moved.rebalance.gain > 10  # 50 ms -> at most 2 ms
    assert moved.predicted.bottleneck_s <= 0.002 + 1e-9


def test_the_workload_is_the_manifest_with_the_requests_own_outputs_left_out(manifest):
    workload = workload_from_manifest(manifest)
    assert len(workload.units) == 3 and workload.return_bytes == manifest.return_bytes
    assert workload.units[0].outputs[1].consumers == (1, 2)
    assert workload.units[2].outputs[0].consumers == ()  # the logits: consumed by the request
    assert context_for(manifest) == manifest.model.max_positions == 64


async def test_a_failing_solver_falls_back_to_the_dp(manifest, caplog):
    cluster = cluster_from_report(report(figures("a", model="toy"), figures("b")), "a", 64)
    workload = workload_from_manifest(manifest)
    assert (await solve_plan(cluster, workload)).solver == "milp"
    with caplog.at_level(logging.WARNING, "peerd.control.planning"):
        plan = await solve_plan(cluster, workload, time_limit_s=0)
    assert plan.solver == "dp"
    assert "solver milp failed (no answer in 0s); solving with dp instead" in caplog.text
    assert plan.stages[0].peer == "a" and plan.stages[-1].stop == 3


async def test_a_model_that_does_not_fit_is_infeasible_with_the_planners_reason(manifest):
    cluster = cluster_from_report(report(figures("a", memory=1000, model="toy")), "a", 64)
    with pytest.raises(Infeasible, match="model needs"):
        await solve_plan(cluster, workload_from_manifest(manifest))


# -- the coordinator ------------------------------------------------------------------------------


class Leader:
    """A coordinator whose messages land in `sent`, asking a model peer that has `manifest`."""

    def __init__(self, manifest: Manifest | None, state: str = "ready", settle_s: float = 0.0,
                 objective: str = "throughput"):
        self.manifest = manifest
        self.state = state
        self.asked: list[tuple[str, str | None]] = []
        self.sent: list[tuple[str, PlanAssignment]] = []
        self.now = 0.0
        self.unreachable = False
        self.coordinator = Coordinator(self.ask_manifest, lambda p, m: self.sent.append((p, m)),
                                       objective, settle_s=settle_s, clock=lambda: self.now,
                                       name_of=str.upper)

    async def ask_manifest(self, peer: str, have: str | None) -> ManifestOffer:
        self.asked.append((peer, have))
        if self.unreachable:
            raise TransportError(f"{peer} did not answer manifest-request in 10.0s")
        if self.state != "ready":
            return ManifestOffer(0, "toy", self.state, "[1/3] embed", None, None)
        key = self.manifest.key
        return ManifestOffer(0, "toy", "ready", "", key,
                             None if have == key else self.manifest.to_dict())

    async def step(self, measured: ClusterReport, members=("a", "b", "c")) -> PlanAssignment:
        self.sent.clear()
        await self.coordinator.step(measured.epoch, measured, members)
        return self.coordinator.plan


def ready(plan: PlanAssignment, peer: str) -> DeployReport:
    stage = next((s for s in plan.stages if s.peer == peer), None)
    units = tuple(range(stage.first, stage.last + 1)) if stage else ()
    return DeployReport(plan.epoch, plan.plan_id, "ready", units, 0, 0, "")


SMALL = 300_000  # 210 kB at beta 0.7: two units (201 kB with KV), never all three (301 kB)


async def test_a_plan_spreads_over_peers_goes_to_every_member_and_completes(manifest):
    leader = Leader(manifest)
    measured = report(figures("a", SMALL, model="toy"), figures("b", SMALL), figures("c", SMALL))
    plan = await leader.step(measured)
    assert plan.plan_id == 1 and plan.problem is None
    assert len(plan.stages) >= 2 and plan.stages[0].peer == "a"
    assert Manifest.from_dict(plan.manifest) == manifest
    assert sorted(peer for peer, _ in leader.sent) == ["a", "b", "c"]

    coordinator = leader.coordinator
    done = [coordinator.on_report(s.peer, ready(plan, s.peer)) for s in plan.stages]
    assert done == [False] * (len(plan.stages) - 1) + [True]
    assert coordinator.deployed


async def test_peerd_start_objective_decides_what_the_leaders_plans_optimise(
    manifest, tmp_path
):
    for argv, objective in (([], "throughput"), (["--objective", "latency"], "latency")):
        args = build_parser().parse_args(["start", "--state-dir", str(tmp_path), *argv])
        async with unstarted_daemon(tmp_path, options_from_args(args)) as daemon:
            assert daemon.plans.coordinator.objective == objective
    measured = report(figures("a", SMALL, model="toy"), figures("b", SMALL, flops=2e9),
                      figures("c", SMALL, flops=3e9))
    plans = {o: await Leader(manifest, objective=o).step(measured)
             for o in ("throughput", "latency")}
    assert {o: p.objective for o, p in plans.items()} == {o: o for o in plans}
    latency, throughput = (plans[o].predicted for o in ("latency", "throughput"))
    assert latency.latency_s < throughput.latency_s  # one stage and hop fewer
    assert throughput.throughput_tps >= latency.throughput_tps


async def test_an_unchanged_cluster_is_not_replanned_and_only_silent_members_get_it_again(
    manifest,
):
    leader = Leader(manifest)
    measured = report(figures("a", SMALL, model="toy"), figures("b", SMALL), figures("c", SMALL))
    plan = await leader.step(measured)
    coordinator = leader.coordinator
    coordinator.on_report("a", ready(plan, "a"))
    coordinator.on_report("b", dataclasses.replace(ready(plan, "b"), state="failed"))
    stale = dataclasses.replace(ready(plan, "c"), plan_id=plan.plan_id + 7)
    assert not coordinator.on_report("c", stale)

    remeasured = report(figures("a", SMALL, model="toy"), figures("b", SMALL, flops=2e9),
                        figures("c", SMALL))
    again = await leader.step(remeasured)
    assert again is plan, "new figures alone do not re-plan"
    assert sorted(peer for peer, _ in leader.sent) == ["b", "c"]
    assert leader.asked[-1] == ("a", manifest.key), "the held manifest is not sent again"


async def test_a_dead_peer_a_new_epoch_or_no_room_each_make_a_new_plan(manifest):
    leader = Leader(manifest)
    first = await leader.step(report(figures("a", SMALL, model="toy"), figures("b", SMALL),
                                     figures("c", SMALL)))
    without_c = await leader.step(report(figures("a", SMALL, model="toy"), figures("b", SMALL)),
                                  members=("a", "b"))
    assert without_c.plan_id == first.plan_id + 1
    assert {s.peer for s in without_c.stages} == {"a", "b"}

    next_epoch = await leader.step(report(figures("a", SMALL, model="toy"), figures("b", SMALL),
                                          epoch=2), members=("a", "b"))
    assert next_epoch.epoch == 2 and next_epoch.plan_id == without_c.plan_id + 1

    alone = await leader.step(report(figures("a", SMALL, model="toy"), epoch=2), members=("a",))
    assert alone.stages == () and alone.problem.startswith("peer B (units ")
    assert "stopped answering; model needs" in alone.problem
    assert leader.sent == [("a", alone)]


async def test_a_stage_peer_that_stops_answering_is_named_with_its_units(manifest):
    leader = Leader(manifest)
    first = await leader.step(report(figures("a", SMALL, model="toy"), figures("b", SMALL),
                                     figures("c", SMALL)))
    gone = next(s for s in first.stages if s.peer != "a")
    rest = [figures(p, SMALL, model="toy" if p == "a" else None)
            for p in "abc" if p != gone.peer]
    replanned = await leader.step(report(*rest))
    cause = f"peer {gone.peer.upper()} (units {gone.first}–{gone.last}) stopped answering"
    assert replanned.stages and replanned.reason.startswith(f"{cause}; re-planning (left: ")
    model_gone = next(s for s in replanned.stages if s.peer == "a")
    nothing = await leader.step(report(*(f for f in rest if f.id != "a")))
    assert nothing.stages == () and nothing.problem == (
        f"peer A (units {model_gone.first}–{model_gone.last}) stopped answering; "
        "no other peer serves the model")


async def test_without_a_ready_model_members_learn_why_there_is_no_plan(manifest):
    nobody = Leader(None)
    plan = await nobody.step(report(figures("a"), figures("b")))
    assert plan.stages == () and "no peer serves a model" in plan.problem
    assert nobody.asked == []

    sharding = Leader(manifest, state="sharding")
    plan = await sharding.step(report(figures("a"), figures("b", model="toy")))
    assert plan.problem == "model toy on peer b is sharding"
    assert sharding.coordinator.model.document()["detail"] == "[1/3] embed"
    sharding.state = "ready"
    plan = await sharding.step(report(figures("a"), figures("b", model="toy")))
    assert plan.stages[0].peer == "b" and plan.problem is None
    assert sharding.coordinator.model.document()["units"] == 3


async def test_a_change_that_leaves_the_plan_runnable_waits_to_settle(manifest):
    leader = Leader(manifest, settle_s=10.0)
    two = (figures("a", SMALL, model="toy"), figures("b", SMALL))
    plan = await leader.step(report(*two))
    assert {s.peer for s in plan.stages} == {"a", "b"}

    leader.now = 1.0
    assert await leader.step(report(*two, figures("c", SMALL))) is plan, "c just joined"
    leader.now = 5.0
    assert await leader.step(report(*two)) is plan, "and left again"
    leader.now = 6.0
    assert await leader.step(report(*two, figures("c", SMALL))) is plan, "back: settling anew"
    leader.now = 16.0
    settled = await leader.step(report(*two, figures("c", SMALL)))
    assert settled.plan_id == plan.plan_id + 1

    leader.now = 16.5
    dead = settled.stages[-1].peer
    everyone = (*two, figures("c", SMALL))
    broken = await leader.step(report(*(f for f in everyone if f.id != dead)))
    assert broken.plan_id == settled.plan_id + 1, "a stage's peer died: re-planned at once"
    assert dead not in {s.peer for s in broken.stages}


async def test_a_manifest_request_that_times_out_keeps_the_plan(manifest):
    leader = Leader(manifest)
    measured = report(figures("a", SMALL, model="toy"), figures("b", SMALL))
    plan = await leader.step(measured)
    leader.unreachable = True
    assert await leader.step(measured) is plan
    assert leader.coordinator.model.manifest == manifest


def _deploy(leader: Leader) -> PlanAssignment:
    plan = leader.coordinator.plan
    for stage in plan.stages:
        leader.coordinator.on_report(stage.peer, ready(plan, stage.peer))
    assert leader.coordinator.deployed
    return plan


async def test_a_stage_peer_dropping_below_the_battery_threshold_is_rebalanced_off_at_once(
    manifest,
):
    leader = Leader(manifest)
    peers = [figures("a", SMALL, model="toy"), figures("b", SMALL), figures("c", SMALL)]
    first = await leader.step(report(*peers))
    _deploy(leader)
    loser = first.stages[-1].peer
    low = [dataclasses.replace(f, battery=Battery(15, False)) if f.id == loser else f
           for f in peers]
    moved = await leader.step(report(*low))
    assert moved.plan_id == first.plan_id + 1 and loser not in {s.peer for s in moved.stages}
    assert moved.rebalance is not None and moved.rebalance.gain is None  # the plan broke
    assert moved.reason == f"rebalance: {moved.rebalance.reason}"
    rebalance, plan = plan_events(moved)
    assert "on battery at 15%" in rebalance["reason"] and rebalance["plan_id"] == moved.plan_id
    assert plan["event"] == "plan" and plan["reason"] == moved.reason


async def _deployed_then_one_stage_loaded(manifest):
    """A leader with a deployed plan over three slow peers (compute, not the links, bounds
    the pipeline), the plan, and a report in which its last stage's peer is 90% loaded."""
    leader = Leader(manifest)
    peers = [figures("a", SMALL, 1e3, model="toy"), figures("b", SMALL, 1e3),
             figures("c", SMALL, 1e3)]
    first = await leader.step(report(*peers))
    _deploy(leader)
    busy = first.stages[-1].peer
    loaded = report(*(dataclasses.replace(f, load=0.9) if f.id == busy else f for f in peers))
    return leader, first, loaded


async def test_a_better_plan_is_taken_only_after_it_held_for_the_sustain_time(manifest):
    leader, first, loaded = await _deployed_then_one_stage_loaded(manifest)
    leader.now = 100.0
    assert await leader.step(loaded) is first
    leader.now = 102.0
    assert await leader.step(loaded) is first, "not sustained for 3 s yet"
    leader.now = 103.5
    moved = await leader.step(loaded)
    assert moved.plan_id == first.plan_id + 1
    assert first.stages[-1].peer not in {s.peer for s in moved.stages}


async def test_the_log_says_when_a_better_plan_starts_and_stops_waiting(manifest, caplog):
    leader, first, loaded = await _deployed_then_one_stage_loaded(manifest)
    calm = dataclasses.replace(
        loaded, peers=tuple(dataclasses.replace(f, load=0.1) for f in loaded.peers))
    caplog.set_level(logging.INFO, "peerd.control.coordinator")
    for now, measured in ((100.0, loaded), (101.0, loaded), (102.0, calm), (103.0, calm)):
        leader.now = now
        assert await leader.step(measured) is first
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rebalance:")]
    assert len(said) == 2, said
    assert "faster; moving if it holds for 3 s (and 10 s after the last change)" in said[0]
    assert "is no longer 15% faster" in said[1]


async def test_rebalancing_switched_off_holds_the_plan_and_back_on_judges_afresh(manifest):
    leader, first, loaded = await _deployed_then_one_stage_loaded(manifest)
    leader.now = 99.0
    assert await leader.step(loaded) is first  # the better plan is first seen
    leader.coordinator.set_policy(None)
    for leader.now in (100.0, 110.0, 120.0):
        assert await leader.step(loaded) is first, "held while rebalancing is off"
    leader.coordinator.set_policy(Policy())
    leader.now = 121.0
    assert await leader.step(loaded) is first, "the load seen while off does not count"
    leader.now = 124.5
    moved = await leader.step(loaded)
    assert first.stages[-1].peer not in {s.peer for s in moved.stages}


async def test_rebalancing_switched_off_while_the_leader_looks_is_not_a_crash(manifest):
    leader, first, loaded = await _deployed_then_one_stage_loaded(manifest)
    looking = leader.coordinator._look

    async def look_then_switch_off(*args):
        seen = await looking(*args)
        leader.coordinator.set_policy(None)
        return seen

    leader.coordinator._look = look_then_switch_off
    assert await leader.step(loaded) is first


async def test_with_no_room_the_leader_tries_again_as_figures_change(manifest):
    leader = Leader(manifest)
    full = report(figures("a", SMALL, model="toy"),
                  dataclasses.replace(figures("b", SMALL), load=1.0))
    stuck = await leader.step(full, members=("a", "b"))
    assert stuck.stages == ()
    assert await leader.step(full, members=("a", "b")) is stuck, "same problem: no new plan"
    eased = await leader.step(report(figures("a", SMALL, model="toy"), figures("b", SMALL)),
                              members=("a", "b"))
    assert eased.stages and eased.plan_id > stuck.plan_id


# -- groups (tensor parallel) ---------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "problem"), [
    (["--tensor-parallel", "1"], "--tensor-parallel 1: a group has 2 peers or more"),
    (["--tensor-parallel", "2", "--shapes"], "give one"),
    (["--shapes", "--early-exit", "0.8"], "do not run on groups yet"),
    (["--tensor-parallel", "2", "--quant", "int8"], "groups run unquantised share units"),
    (["--objective", "first-token"], "give --shapes or --tensor-parallel N too"),
])
def test_group_flags_that_cannot_work_are_refused_at_start(tmp_path, argv, problem):
    args = build_parser().parse_args(["start", "--state-dir", str(tmp_path), *argv])
    with pytest.raises(PeerdError, match=problem):
        options_from_args(args)


def _layered(manifest: Manifest, kv_heads: int) -> Manifest:
    """The toy model as if its middle unit were a layer's attention of `kv_heads` KV heads."""
    units = list(manifest.units)
    units[1] = dataclasses.replace(units[1], name="layer0.attn")
    model = dataclasses.replace(manifest.model, num_heads=kv_heads, num_kv_heads=kv_heads,
                                head_dim=4, intermediate_size=64)
    return dataclasses.replace(manifest, model=model, units=tuple(units))


async def test_the_leader_plans_groups_of_the_size_asked_or_says_why_not(manifest):
    measured = report(figures("a", model="toy"), figures("b"), figures("c"))
    leader = Leader(_layered(manifest, kv_heads=2))
    leader.coordinator.shapes = Shapes(2)
    plan = await leader.step(measured)
    assert plan.solver == "groups" and plan.problem is None
    (group,) = [s for s in plan.stages if s.shares]
    assert len(group.shares) == 2 and group.shares[0].peer == group.peer == "a"
    assert set(plan.peers) <= {"a", "b", "c"}
    (event,) = plan_events(plan)
    assert [s["shares"] for s in event["stages"] if s["shares"]] == [
        [{"peer": x.peer, "weight": x.weight} for x in group.shares]]
    cases = [(_layered(manifest, 2), 3, "the model's layers split 2 ways at most"),
             (_layered(manifest, 8), 4, "--tensor-parallel 4 needs 4 peers; 3 can take work"),
             (manifest, 2, "the model's manifest predates groups")]
    for served, size, problem in cases:
        leader = Leader(served)
        leader.coordinator.shapes = Shapes(size)
        assert problem in ((await leader.step(measured)).problem or "")
