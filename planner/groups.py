"""Galaxy's groups: a stage served by several peers at once (docs/planner.md, "Groups").

A group splits each unit that can be shared (`Unit.share_grains`: a layer half, whose
attention splits by KV-head groups and whose MLP splits by column blocks) over its members
by their `Share.fraction`s. Before such a unit the members AllGather the step's rows of the
hidden state, and after it they ReduceScatter their partial sums: two ring collectives of
N - 1 rounds, each round sending 1/N of the rows over every link of the ring. A unit with
fewer grains than members runs whole on the group's lead, its first member.

Costs, for a step of T tokens (T = 1: a decode step; T = the prompt: the first token):
- a member's time for a unit: its measured decode seconds when T = 1 and it measured the
  unit, else T x the unit's FLOPs per token (per prompt token when T > 1) x its seconds per
  FLOP (planner.cost, battery penalty included);
- a shared unit: the slowest member's fraction of its own time, plus both collectives;
- stages and the messages between them as in planner.cost, from each group's lead.
A decode step moves one hidden vector per collective, so every shared layer half costs
2 (N - 1) link latencies: on slow links a pipeline wins, and only pricing both shapes the
same way lets the search see it.

`best_shape` tries every way to cut the usable peers into groups (every set partition up to
MAX_PARTITIONED peers; beyond, each peer alone and all together), prices each group as one
device whose unit times are the group's at speed-proportional shares, lets the pipeline DP
place units over those devices, then sizes each stage's shares by Galaxy's Algorithm 1
(`galaxy_shares`) and scores the shape.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from planner.cost import (
    battery_factor,
    capacity,
    fits,
    link,
    memory_need,
    messages,
    seconds_per_flop,
    usable_devices,
)
from planner.dp import solve_dp
from planner.errors import Infeasible, InvalidInput
from planner.model import OBJECTIVES, Cluster, Device, Link, Output, Stage, Unit, Workload

FIRST_TOKEN = "first-token"
SHAPE_OBJECTIVES = (*OBJECTIVES, FIRST_TOKEN)
MAX_PARTITIONED = 6  # 203 set partitions of 6 peers, each a DP over at most 6 devices
# A shape on more peers is chosen over one on fewer only when predicted this much faster
# (current / new - 1, as the rebalancer's margin): a first plan is priced by FLOP/s
# readings, and two identical cores, each a daemon pinned to its own, read up to 9% apart,
# enough to make a pipeline of the embedding alone on one and every layer on the other look
# faster than either alone.
MORE_PEERS_GAIN = 0.15


@dataclass(frozen=True)
class Share:
    peer: str
    fraction: float  # of every shared unit of the stage


@dataclass(frozen=True)
class GroupStage:
    shares: tuple[Share, ...]  # the lead first: it runs the units that cannot be shared
    start: int
    stop: int

    @property
    def lead(self) -> str:
        return self.shares[0].peer

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(share.peer for share in self.shares)

    @property
    def units(self) -> range:
        return range(self.start, self.stop)


class ShapeKind(enum.Enum):
    ALONE = "one peer"
    PIPELINE = "pipeline"
    GROUP = "group"
    HYBRID = "pipeline of groups"


@dataclass(frozen=True)
class ShapePrediction:
    first_token_s: float  # the prompt through every stage, and the first token back
    latency_s: float  # one decode token through every stage
    bottleneck_s: float  # the busiest stage or link per decode token

    @property
    def throughput_tps(self) -> float:
        return 1 / self.bottleneck_s

    def objective(self, objective: str) -> float:
        """The value a search minimises for `objective`."""
        if objective == FIRST_TOKEN:
            return self.first_token_s
        return self.latency_s if objective == "latency" else self.bottleneck_s


@dataclass(frozen=True)
class Shape:
    stages: tuple[GroupStage, ...]
    objective: str
    prompt_tokens: int
    predicted: ShapePrediction

    @property
    def kind(self) -> ShapeKind:
        grouped = any(len(stage.shares) > 1 for stage in self.stages)
        if len(self.stages) == 1:
            return ShapeKind.GROUP if grouped else ShapeKind.ALONE
        return ShapeKind.HYBRID if grouped else ShapeKind.PIPELINE


# -- shares ------------------------------------------------------------------------------------
def galaxy_shares(speeds: Sequence[float], capacities: Sequence[float],
                  need: float) -> tuple[float, ...]:
    """Galaxy's Algorithm 1: fractions of `need` bytes in proportion to `speeds`, except that
    a member whose fraction would not fit its capacity is held at what fits, and the rest
    is shared again among the others by speed. Infeasible when the capacities fall short."""
    if need <= 0:
        total = sum(speeds)
        return tuple(speed / total for speed in speeds)
    fractions = [0.0] * len(speeds)
    free, left = set(range(len(speeds))), 1.0
    while free:
        total = sum(speeds[i] for i in free)
        trial = {i: left * speeds[i] / total for i in free}
        over = [i for i in free if not fits(trial[i] * need, capacities[i])]
        if not over:
            for i, fraction in trial.items():
                fractions[i] = fraction
            return tuple(fractions)
        for i in over:
            fractions[i] = max(capacities[i], 0.0) / need
            left -= fractions[i]
            free.discard(i)
    offered = sum(max(room, 0.0) for room in capacities)
    raise Infeasible(f"the group's members offer {offered:.0f} bytes for {need:.0f} bytes "
                     f"of shared units")


# -- costs -------------------------------------------------------------------------------------
def member_unit_s(cluster: Cluster, device: Device, index: int, unit: Unit,
                  tokens: int) -> float:
    """Seconds `device` takes for the whole of unit `index` in a step of `tokens` tokens."""
    rows = tokens > 1 and not unit.sampled  # else the work of one row, as in a decode step
    if not rows and index in device.unit_s:
        return device.unit_s[index] * battery_factor(cluster, device)
    return unit.step_flops(tokens) * seconds_per_flop(cluster, device, prompt=rows)


def hidden_bytes(workload: Workload, index: int) -> float:
    """Bytes per token of the hidden state unit `index` hands on: the output the next unit
    reads (the last unit: its largest output)."""
    outputs = workload.units[index].outputs
    handed = [o.bytes for o in outputs if index + 1 in o.consumers]
    return max(handed or [o.bytes for o in outputs] or [0.0])


def collective_s(cluster: Cluster, peers: Sequence[str], nbytes: float) -> float:
    """A ring AllGather or ReduceScatter of `nbytes` over `peers`, in their order."""
    count = len(peers)
    if count == 1:
        return 0.0
    ring = zip(peers, [*peers[1:], peers[0]], strict=True)
    return (count - 1) * max(link(cluster, a, b).transfer_s(nbytes / count) for a, b in ring)


def shared(unit: Unit, members: int) -> bool:
    return members > 1 and unit.share_grains >= members


def group_unit_s(cluster: Cluster, workload: Workload, shares: Sequence[Share], index: int,
                 tokens: int) -> float:
    """Seconds the group takes for unit `index` in a step of `tokens` tokens."""
    unit = workload.units[index]
    if not shared(unit, len(shares)):
        return member_unit_s(cluster, cluster.device(shares[0].peer), index, unit, tokens)
    compute = max(share.fraction * member_unit_s(cluster, cluster.device(share.peer), index,
                                                 unit, tokens) for share in shares)
    peers = [share.peer for share in shares]
    return compute + 2 * collective_s(cluster, peers, tokens * hidden_bytes(workload, index))


def stage_s(cluster: Cluster, workload: Workload, stage: GroupStage, tokens: int) -> float:
    lead = cluster.device(stage.lead)
    overhead = lead.stage_overhead_s * battery_factor(cluster, lead)
    return overhead + sum(group_unit_s(cluster, workload, stage.shares, u, tokens)
                          for u in stage.units)


def predict(cluster: Cluster, workload: Workload, stages: Sequence[GroupStage],
            prompt_tokens: int) -> ShapePrediction:
    first_token, _ = _through(cluster, workload, stages, prompt_tokens)
    latency, link_loads = _through(cluster, workload, stages, 1)
    compute = [stage_s(cluster, workload, stage, 1) for stage in stages]
    return ShapePrediction(first_token, latency, max(compute + link_loads))


def _through(cluster: Cluster, workload: Workload, stages: Sequence[GroupStage],
             tokens: int) -> tuple[float, list[float]]:
    """When a step of `tokens` tokens is done, its result back on the source (only the
    sampled token returns), and each link's seconds of transfer for it."""
    leads = [Stage(stage.lead, stage.start, stage.stop) for stage in stages]
    arrivals: list[list[float]] = [[0.0] for _ in stages]
    link_loads: list[float] = []
    finish = 0.0
    sent = messages(workload, leads)
    for a, stage in enumerate(stages):
        finish = max(arrivals[a]) + stage_s(cluster, workload, stage, tokens)
        for (src, dst), nbytes in sent.items():
            if src == a:
                hop = link(cluster, stage.lead, stages[dst].lead)
                arrivals[dst].append(finish + hop.transfer_s(tokens * nbytes))
                link_loads.append(tokens * nbytes / hop.bandwidth_Bps)
    if stages[-1].lead != cluster.source:
        back = link(cluster, stages[-1].lead, cluster.source)
        finish += back.transfer_s(workload.return_bytes)
        link_loads.append(workload.return_bytes / back.bandwidth_Bps)
    return finish, link_loads


# -- memory ------------------------------------------------------------------------------------
def member_needs(cluster: Cluster, workload: Workload, stage: GroupStage) -> dict[str, float]:
    """Bytes each member holds: its fraction of the shared units, and on the lead the rest."""
    needs = {peer: 0.0 for peer in stage.peers}
    for u in stage.units:
        unit = workload.units[u]
        if shared(unit, len(stage.shares)):
            for share in stage.shares:
                needs[share.peer] += share.fraction * memory_need(cluster, unit)
        else:
            needs[stage.lead] += memory_need(cluster, unit)
    return needs


def shape_violations(cluster: Cluster, workload: Workload,
                     stages: Sequence[GroupStage]) -> list[str]:
    """Every member that does not fit its bytes, as one line each."""
    found = []
    for stage in stages:
        for peer, need in member_needs(cluster, workload, stage).items():
            room = capacity(cluster, cluster.device(peer))
            if not fits(need, room):
                found.append(f"peer {peer!r} needs {need:.0f} bytes of units "
                             f"{stage.start}-{stage.stop - 1} but offers {room:.0f}")
    return found


# -- search ------------------------------------------------------------------------------------
def best_shape(cluster: Cluster, workload: Workload, objective: str, prompt_tokens: int,
               group_size: int | None = None) -> Shape:
    """The fastest shape for `objective` among pipelines, groups and pipelines of groups
    (with `group_size`: only shapes whose every stage is a group of that many peers)."""
    return fastest(best_by_kind(cluster, workload, objective, prompt_tokens,
                                group_size).values())


def fastest(shapes: Iterable[Shape], gain: float = MORE_PEERS_GAIN) -> Shape:
    """The shape best at its objective, where one on more peers replaces one on fewer only
    when it is predicted faster by at least `gain`."""
    fewest_first = sorted(shapes, key=lambda shape: (_peers(shape), _value(shape)))
    chosen = fewest_first[0]
    for shape in fewest_first[1:]:
        if _value(chosen) / _value(shape) - 1 >= gain:
            chosen = shape
    return chosen


def _value(shape: Shape) -> float:
    return shape.predicted.objective(shape.objective)


def _peers(shape: Shape) -> int:
    return sum(len(stage.shares) for stage in shape.stages)


def best_by_kind(cluster: Cluster, workload: Workload, objective: str, prompt_tokens: int,
                 group_size: int | None = None) -> dict[ShapeKind, Shape]:
    """The fastest shape of each kind that holds the model, for `objective` (with
    `group_size`: among shapes whose every stage is a group of that many peers)."""
    if objective not in SHAPE_OBJECTIVES:
        raise InvalidInput(f"objective must be one of {', '.join(SHAPE_OBJECTIVES)}, "
                           f"not {objective!r}")
    if prompt_tokens < 1:
        raise InvalidInput(f"the prompt must have at least 1 token, not {prompt_tokens}")
    best: dict[ShapeKind, Shape] = {}
    source_alone = [(cluster.source,)]  # what the other shapes must beat (`fastest`)
    for groups in (source_alone, *_sized_groupings(cluster, workload, group_size)):
        shape = _placed(cluster, workload, groups, objective, prompt_tokens)
        if shape and group_size and any(len(s.shares) != group_size for s in shape.stages):
            continue
        if shape and (shape.kind not in best
                      or _rank(shape, objective) < _rank(best[shape.kind], objective)):
            best[shape.kind] = shape
    if not best:
        shapes = f"groups of {group_size} peers" if group_size else (
            "pipeline, group or pipeline of groups")
        raise Infeasible(f"no {shapes} can hold the model")
    return best


def _rank(shape: Shape, objective: str) -> tuple[float, int]:
    """By the objective; at a tie, the shape using fewer peers."""
    return shape.predicted.objective(objective), _peers(shape)


def _sized_groupings(cluster: Cluster, workload: Workload,
                     group_size: int | None) -> Iterator[list[tuple[str, ...]]]:
    """`groupings`; with `group_size`, only their groups of that size (the other peers
    left out), where the source is in one, each set of groups once."""
    seen: set[tuple[tuple[str, ...], ...]] = set()
    for groups in groupings(cluster, workload):
        if group_size:
            groups = [g for g in groups if len(g) == group_size]
            key = tuple(sorted(groups))
            if key in seen or not any(cluster.source in g for g in groups):
                continue
            seen.add(key)
        yield groups


def groupings(cluster: Cluster, workload: Workload) -> Iterator[list[tuple[str, ...]]]:
    """Ways to cut the usable peers into groups, each group lead first (the source where it
    is a member, else the fastest), groups no larger than the most grains of any unit."""
    peers = sorted(usable_devices(cluster),
                   key=lambda d: (d.id != cluster.source, -d.flops * (1 - d.load), d.id))
    ids = [device.id for device in peers]
    largest = max(unit.share_grains for unit in workload.units)
    if len(ids) <= MAX_PARTITIONED:
        cuts: Iterator[list[list[str]]] = _partitions(ids)
    else:
        cuts = iter([[[peer] for peer in ids], [ids]])
    for cut in cuts:
        if all(len(group) == 1 or len(group) <= largest for group in cut):
            yield [tuple(group) for group in cut]


def _partitions(items: list[str]) -> Iterator[list[list[str]]]:
    """Every set partition of `items`, each block in the items' order."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1:]]


def _placed(cluster: Cluster, workload: Workload, groups: list[tuple[str, ...]],
            objective: str, prompt_tokens: int) -> Shape | None:
    """The shape the pipeline DP makes of `groups`, or None when they cannot hold the model."""
    tokens = prompt_tokens if objective == FIRST_TOKEN else 1
    by_speed = {group[0]: _speed_shares(cluster, workload, group, tokens) for group in groups}
    virtual = _virtual_cluster(cluster, workload, by_speed, tokens)
    try:
        planned = solve_dp(virtual, _per_step(workload, tokens),
                           "throughput" if objective == "throughput" else "latency")
        stages = [_sized(cluster, workload, by_speed[stage.peer], stage, tokens)
                  for stage in planned]
    except Infeasible:
        return None
    if shape_violations(cluster, workload, stages):
        return None
    return Shape(tuple(stages), objective, prompt_tokens,
                 predict(cluster, workload, stages, prompt_tokens))


def _speeds(cluster: Cluster, workload: Workload, peers: Sequence[str], units: range,
            tokens: int) -> list[float]:
    """Each peer's speed on the shareable units among `units` (all units when none are);
    units that cost nothing (an embedding lookup) leave the peers equally fast."""
    members = len(peers)
    chosen = [u for u in units if shared(workload.units[u], members)] or list(units)
    seconds = [sum(member_unit_s(cluster, cluster.device(peer), u, workload.units[u], tokens)
                   for u in chosen) for peer in peers]
    return [1 / s if s > 0 else 1.0 for s in seconds]


def _speed_shares(cluster: Cluster, workload: Workload, group: tuple[str, ...],
                  tokens: int) -> tuple[Share, ...]:
    speeds = _speeds(cluster, workload, group, range(len(workload.units)), tokens)
    return tuple(Share(peer, speed / sum(speeds)) for peer, speed in zip(group, speeds,
                                                                          strict=True))


def _sized(cluster: Cluster, workload: Workload, shares: tuple[Share, ...], stage: Stage,
           tokens: int) -> GroupStage:
    """The DP's stage on a group, its shares set by speed on the stage's own units and then
    by memory (Algorithm 1)."""
    peers = [share.peer for share in shares]
    whole = GroupStage(shares, stage.start, stage.stop)
    if len(peers) == 1:
        return whole
    lead_alone = sum(memory_need(cluster, workload.units[u]) for u in stage.units
                     if not shared(workload.units[u], len(peers)))
    need = sum(memory_need(cluster, workload.units[u]) for u in stage.units) - lead_alone
    rooms = [capacity(cluster, cluster.device(peer)) for peer in peers]
    rooms[0] -= lead_alone
    fractions = galaxy_shares(_speeds(cluster, workload, peers, stage.units, tokens), rooms,
                              need)
    return replace(whole, shares=tuple(Share(peer, fraction)
                                       for peer, fraction in zip(peers, fractions,
                                                                 strict=True)))


def _virtual_cluster(cluster: Cluster, workload: Workload,
                     groups: dict[str, tuple[Share, ...]], tokens: int) -> Cluster:
    """Each group as one device named after its lead, its unit times the group's (measured,
    so its FLOP rate is never read), its memory its members' together."""
    devices = tuple(
        Device(id=lead, flops=1.0,
               memory_available=sum(cluster.device(share.peer).memory_available
                                    for share in shares),
               unit_s={u: group_unit_s(cluster, workload, shares, u, tokens)
                       for u in range(len(workload.units))},
               stage_overhead_s=(cluster.device(lead).stage_overhead_s
                                 * battery_factor(cluster, cluster.device(lead))))
        for lead, shares in groups.items())
    links = tuple(Link(a, b, found.latency_s, found.bandwidth_Bps)
                  for a in groups for b in groups
                  if a != b and (found := cluster.link(a, b)) is not None)
    source = next(lead for lead, shares in groups.items()
                  if cluster.source in (share.peer for share in shares))
    return replace(cluster, source=source, devices=devices, links=links)


def _per_step(workload: Workload, tokens: int) -> Workload:
    """The workload of one step of `tokens` tokens as the DP sees it: its messages carry
    every token's rows (the result stays one token)."""
    if tokens == 1:
        return workload
    units = tuple(replace(unit, outputs=tuple(Output(tokens * o.bytes, o.consumers)
                                              for o in unit.outputs))
                  for unit in workload.units)
    return replace(workload, units=units)
