"""Plain dicts (parsed JSON) to planner dataclasses and back; every bad field is one clear error.

Formats: docs/planner.md. A units dict is either the planner's own
`{"return_bytes", "units": [{"flops", "weight_bytes", "kv_bytes_per_token", "outputs"}]}`
or a model manifest from `peerd shard` (recognised by its "format" key).
"""

from __future__ import annotations

import math
from typing import Any

from planner.errors import InvalidInput
from planner.groups import Shape
from planner.model import Battery, Cluster, Device, Link, Output, Plan, Unit, Workload

MANIFEST_FORMAT = 3
# A manifest output consumed by the request itself (the logits, sampled on the stage that
# computes them) is no message between stages; its trip back is the manifest's return_bytes.
MANIFEST_REQUEST = -1


def _field(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise InvalidInput(f"{where} must be an object")
    if key not in obj:
        raise InvalidInput(f"{where} lacks {key!r}")
    return obj[key]


def _number(obj: Any, key: str, where: str, *, positive: bool = False, upper: float = math.inf,
            default: float | None = None) -> float:
    if default is not None and isinstance(obj, dict) and key not in obj:
        return default
    value = _field(obj, key, where)
    bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    if bad or value < 0 or (positive and value == 0) or value > upper:
        bound = "a positive number" if positive else "a number >= 0"
        if upper < math.inf:
            bound += f" and <= {upper:g}"
        raise InvalidInput(f"{where}.{key} must be {bound}, got {value!r}")
    return float(value)


def _list(obj: Any, key: str, where: str, *, default: list | None = None) -> list:
    if default is not None and isinstance(obj, dict) and key not in obj:
        return default
    value = _field(obj, key, where)
    if not isinstance(value, list | tuple):  # JSON gives lists; dataclasses.asdict, tuples
        raise InvalidInput(f"{where}.{key} must be a list")
    return list(value)


def _text(obj: Any, key: str, where: str) -> str:
    value = _field(obj, key, where)
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def _battery(raw: Any, where: str) -> Battery | None:
    if raw is None:
        return None
    plugged = _field(raw, "plugged", where)
    if not isinstance(plugged, bool):
        raise InvalidInput(f"{where}.plugged must be true or false, got {plugged!r}")
    return Battery(percent=_number(raw, "percent", where, upper=100), plugged=plugged)


def _device(raw: Any, where: str) -> Device:
    return Device(
        id=_text(raw, "id", where),
        flops=_number(raw, "flops", where, positive=True),
        prompt_flops=_number(raw, "prompt_flops", where, default=0.0),
        memory_available=_number(raw, "memory_available", where),
        load=_number(raw, "load", where, upper=1, default=0.0),
        battery=_battery(raw.get("battery"), f"{where}.battery"),
        unit_s=_unit_times(raw.get("unit_s", {}), f"{where}.unit_s"),
        stage_overhead_s=_number(raw, "stage_overhead_s", where, default=0.0),
    )


def _unit_times(raw: Any, where: str) -> dict[int, float]:
    """{"unit index": seconds per decode token}: JSON keys are strings."""
    if not isinstance(raw, dict):
        raise InvalidInput(f"{where} must be an object of unit index -> seconds")
    times = {}
    for key in raw:
        text = str(key)
        if not text.isdigit():
            raise InvalidInput(f"{where} keys must be unit indices, got {key!r}")
        times[int(text)] = _number(raw, key, where, positive=True)
    return times


def _link(raw: Any, where: str, ids: set[str]) -> Link:
    src, dst = _text(raw, "from", where), _text(raw, "to", where)
    for end in (src, dst):
        if end not in ids:
            raise InvalidInput(f"{where} names unknown peer {end!r}")
    if src == dst:
        raise InvalidInput(f"{where} links {src!r} to itself")
    return Link(
        src=src,
        dst=dst,
        latency_s=_number(raw, "latency_s", where),
        bandwidth_Bps=_number(raw, "bandwidth_Bps", where, positive=True),
    )


def cluster_from_dict(raw: Any) -> Cluster:
    devices = tuple(
        _device(d, f"devices[{i}]") for i, d in enumerate(_list(raw, "devices", "cluster"))
    )
    if not devices:
        raise InvalidInput("cluster.devices is empty")
    ids = [d.id for d in devices]
    duplicate = sorted({i for i in ids if ids.count(i) > 1})
    if duplicate:
        raise InvalidInput(f"cluster.devices repeats id {duplicate[0]!r}")
    links = tuple(
        _link(item, f"links[{i}]", set(ids))
        for i, item in enumerate(_list(raw, "links", "cluster", default=[]))
    )
    pairs = [(link.src, link.dst) for link in links]
    if len(set(pairs)) < len(pairs):
        raise InvalidInput("cluster.links gives the same ordered pair twice")
    source = _text(raw, "source", "cluster")
    if source not in ids:
        raise InvalidInput(f"cluster.source {source!r} is not one of the devices")
    context = _number(raw, "context", "cluster", default=2048)
    if context != int(context):
        raise InvalidInput(f"cluster.context must be a whole number of tokens, got {context:g}")
    return Cluster(
        source=source,
        devices=devices,
        links=links,
        beta=_number(raw, "beta", "cluster", positive=True, upper=1, default=0.7),
        context=int(context),
        battery_min_percent=_number(raw, "battery_min_percent", "cluster", upper=100, default=20),
        battery_penalty=_number(raw, "battery_penalty", "cluster", default=0.5),
    )


def _consumers(raw: Any, where: str, unit: int, count: int, manifest: bool) -> tuple[int, ...]:
    consumers = _list(raw, "consumers", where)
    if manifest:
        consumers = [c for c in consumers if c != MANIFEST_REQUEST]
    for c in consumers:
        if isinstance(c, bool) or not isinstance(c, int) or not unit < c < count:
            raise InvalidInput(
                f"{where}.consumers must be unit indices after {unit} and below {count}, got {c!r}"
            )
    if len(set(consumers)) < len(consumers):
        raise InvalidInput(f"{where}.consumers repeats a unit")
    return tuple(sorted(consumers))


def _unit(raw: Any, where: str, index: int, count: int, manifest: bool) -> Unit:
    if manifest:
        per_token = _field(raw, "flops_per_token", where)
        flops = _number(per_token, "decode", f"{where}.flops_per_token")
        prefill = _number(per_token, "prefill", f"{where}.flops_per_token")
    else:
        flops = _number(raw, "flops", where)
        prefill = _number(raw, "prefill_flops", where, default=flops)
    size_key = "bytes_per_token" if manifest else "bytes"
    outputs = []
    for j, out in enumerate(_list(raw, "outputs", where, default=[])):
        at = f"{where}.outputs[{j}]"
        consumers = _consumers(out, at, index, count, manifest)
        outputs.append(Output(_number(out, size_key, at), consumers))
    return Unit(
        flops=flops,
        weight_bytes=_number(raw, "weight_bytes", where),
        kv_bytes_per_token=_number(raw, "kv_bytes_per_token", where),
        outputs=tuple(outputs),
        prefill_flops=prefill,
        share_grains=_grains(raw, where),
        sampled=_sampled(raw, where, manifest),
    )


def _sampled(raw: Any, where: str, manifest: bool) -> bool:
    """Whether the unit runs on the drawn rows alone: in a manifest, the unit whose output
    the request reads (the logits); in a units file, its "sampled" flag."""
    if manifest:
        return any(MANIFEST_REQUEST in _list(out, "consumers", where)
                   for out in _list(raw, "outputs", where, default=[]))
    sampled = raw.get("sampled", False)
    if not isinstance(sampled, bool):
        raise InvalidInput(f"{where}.sampled must be true or false, got {sampled!r}")
    return sampled


def _grains(raw: Any, where: str) -> int:
    grains = raw.get("share_grains", 0)
    if isinstance(grains, bool) or not isinstance(grains, int) or grains < 0:
        raise InvalidInput(f"{where}.share_grains must be a whole number >= 0, got {grains!r}")
    return grains


def workload_from_dict(raw: Any) -> Workload:
    """The planner's units format, or a model manifest.json (docs/architecture.md)."""
    manifest = isinstance(raw, dict) and "format" in raw
    if manifest and raw["format"] != MANIFEST_FORMAT:
        raise InvalidInput(f"manifest format {raw['format']!r} is not {MANIFEST_FORMAT}")
    items = _list(raw, "units", "units file")
    if not items:
        raise InvalidInput("the units list is empty")
    units = tuple(
        _unit(item, f"units[{i}]", i, len(items), manifest) for i, item in enumerate(items)
    )
    if sum(unit.flops for unit in units) == 0:
        raise InvalidInput("every unit has 0 flops; the cost model needs work to place")
    return Workload(units=units, return_bytes=_number(raw, "return_bytes", "units file"))


def _stage_list(plan: Plan, units: tuple[tuple[int, ...], ...]) -> list[dict]:
    return [{"peer": s.peer, "units": list(u)} for s, u in zip(plan.stages, units, strict=True)]


def plan_to_dict(plan: Plan) -> dict:
    """The plan JSON of `peerd plan --json`."""
    return {
        "stages": _stage_list(plan, tuple(tuple(stage.units) for stage in plan.stages)),
        "objective": plan.objective,
        "solver": plan.solver,
        "predicted": {
            "latency_s": plan.predicted.latency_s,
            "throughput_tps": plan.predicted.throughput_tps,
            "bottleneck_s": plan.predicted.bottleneck_s,
        },
        "solve_s": plan.solve_s,
        "movable": _stage_list(plan, plan.movable),
    }


def shape_to_dict(shape: Shape) -> dict:
    """A shape as `peerd plan --shapes --json` prints it: each stage's peers and shares."""
    p = shape.predicted
    return {
        "kind": shape.kind.value,
        "objective": shape.objective,
        "prompt_tokens": shape.prompt_tokens,
        "stages": [{"peers": [{"peer": share.peer, "share": share.fraction}
                              for share in stage.shares],
                    "units": list(stage.units)} for stage in shape.stages],
        "predicted": {"first_token_s": p.first_token_s, "latency_s": p.latency_s,
                      "throughput_tps": p.throughput_tps, "bottleneck_s": p.bottleneck_s},
    }
