"""The planner's plain data: frozen dataclasses, validated on construction by `planner.io`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

OBJECTIVES = ("latency", "throughput")


@dataclass(frozen=True)
class Battery:
    percent: float
    plugged: bool


@dataclass(frozen=True)
class Device:
    id: str
    flops: float  # effective FLOP/s on the unit executor, one row (decode-shaped)
    memory_available: float  # bytes
    load: float = 0.0  # fraction of the CPU taken by other processes, in [0, 1]
    battery: Battery | None = None  # None: mains-powered, no battery
    # Measured seconds per decode token of units this device ran, by unit index: where
    # present they price the unit instead of its FLOPs / `flops` (planner.cost).
    unit_s: Mapping[int, float] = field(default_factory=dict, hash=False)
    # Measured seconds per token a stage on this device spends outside its units (taking
    # tensors in and sending them on, scheduling, sampling): added to every stage it holds.
    stage_overhead_s: float = 0.0
    # effective FLOP/s on a prompt's rows (compute-bound, several times `flops`); 0: `flops`
    prompt_flops: float = 0.0

    @property
    def on_battery(self) -> bool:
        return self.battery is not None and not self.battery.plugged


@dataclass(frozen=True)
class Link:
    src: str
    dst: str
    latency_s: float
    bandwidth_Bps: float

    def transfer_s(self, nbytes: float) -> float:
        """Time for one message: latency plus serialisation."""
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class Cluster:
    source: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...] = ()
    beta: float = 0.7
    context: int = 2048
    battery_min_percent: float = 20.0
    battery_penalty: float = 0.5
    _by_id: dict[str, Device] = field(init=False, repr=False, compare=False)
    _links: dict[tuple[str, str], Link] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {d.id: d for d in self.devices})
        given = {(link.src, link.dst): link for link in self.links}
        # A pair measured in one direction only is taken as symmetric (LAN links are).
        both = {(b, a): link for (a, b), link in given.items()} | given
        object.__setattr__(self, "_links", both)

    def device(self, device_id: str) -> Device:
        return self._by_id[device_id]

    def link(self, src: str, dst: str) -> Link | None:
        """The link src -> dst, or dst -> src when only that was measured; None if neither."""
        return self._links.get((src, dst))


@dataclass(frozen=True)
class Output:
    bytes: float  # per decode token
    consumers: tuple[int, ...]  # unit indices; i+1 is sequential, any later index residual


@dataclass(frozen=True)
class Unit:
    flops: float  # per decode token
    weight_bytes: float
    kv_bytes_per_token: float
    outputs: tuple[Output, ...] = ()
    prefill_flops: float | None = None  # per prompt token; None: as `flops`
    # How many peers of a group can each take a share of the unit (a layer half: its KV-head
    # groups or MLP column blocks); 0 or 1: it runs whole on one peer (planner.groups).
    share_grains: int = 0
    # It runs on the rows whose tokens are drawn (the LM head): one row of a prompt.
    sampled: bool = False

    @property
    def flops_per_prompt_token(self) -> float:
        return self.flops if self.prefill_flops is None else self.prefill_flops

    def step_flops(self, tokens: int) -> float:
        """Its flops in a step of `tokens` new tokens (1: a decode step)."""
        return self.flops if tokens == 1 or self.sampled else tokens * self.flops_per_prompt_token


@dataclass(frozen=True)
class Workload:
    """The model as the planner sees it: units in order plus the per-token result size."""

    units: tuple[Unit, ...]
    return_bytes: float = 0.0  # last stage -> source, per token


@dataclass(frozen=True)
class Stage:
    peer: str
    start: int  # first unit
    stop: int  # one past the last unit

    @property
    def units(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True)
class Prediction:
    latency_s: float
    throughput_tps: float
    bottleneck_s: float

    def objective(self, objective: str) -> float:
        """The value a solver minimises for `objective`."""
        return self.latency_s if objective == "latency" else self.bottleneck_s


@dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    objective: str
    solver: str
    predicted: Prediction
    solve_s: float
    movable: tuple[tuple[int, ...], ...] = ()  # per stage: neighbours' units kept as copies
