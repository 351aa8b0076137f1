"""Consecutive units joined into one ONNX graph, so that a stage runs a few sessions, not one
per unit.

Every session's run costs the same fixed work whatever it computes (ONNX Runtime's run set-up,
its thread pool's wake-up, the call from Python): a one-token decode step of the 24-layer
hidden-1024 float32 model took 45.5 ms over its 50 unit sessions and 40.9 ms as one joined
session, with bit-identical logits (bench/stage_session.py, 2026-11-29).

The units are cut into blocks of at most `join_bytes` of weights, the same blocks for every
stage of a model (`blocks`): a stage runs the blocks it holds, and a block its range cuts as
the part it holds (`segments`). Sessions are shared by block (shards/executor.py,
`SessionShelf`), so a plan change that moves a stage's ends loads again at most the two
blocks it cuts, not the units it keeps: bounded memory while the old and the new stage are
both held, against most of the saving (a 128 MiB block of float32 weights takes ~10 ms to
read, its run's fixed cost ~0.1 ms). `JOIN_WHOLE` makes the whole model one block (the LM
head still alone): `peerd generate` joins whole, and so does a daemon where a second copy of
its stage fits; one with room for two blocks more joins by `JOIN_BYTES`; any other runs each
unit alone (peerd/control/deploy.py, `stage_options`; shards/executor.py, `ExecutorOptions`,
has the figures).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shards.manifest import REQUEST, Manifest, Unit

if TYPE_CHECKING:
    import onnx

JOIN_BYTES = 128 * 2**20
JOIN_WHOLE = 2**62  # join_bytes that joins any stage whole (the LM head still runs alone)


def blocks(manifest: Manifest, join_bytes: int) -> tuple[tuple[int, int], ...]:
    """The model's units as blocks [first, last] of at most `join_bytes` of weights (a unit
    of `join_bytes` or more is a block alone: with 0, every unit). The LM head
    (`Unit.sampled`) is always alone: a step runs it on the sampled rows only."""
    cut: list[tuple[int, int]] = []
    start, weight = 0, 0
    for unit in manifest.units:
        alone = unit.sampled or unit.weight_bytes >= join_bytes
        if unit.index > start and (alone or weight + unit.weight_bytes > join_bytes
                                   or manifest.units[unit.index - 1].sampled):
            cut.append((start, unit.index - 1))
            start, weight = unit.index, 0
        weight += unit.weight_bytes
    cut.append((start, len(manifest.units) - 1))
    return tuple(cut)


def segments(blocks: Iterable[tuple[int, int]], first: int, last: int,
             apart: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """Units [first, last] as the parts of `blocks` they hold, each cut again between two
    units that `apart(unit, next_unit)` keeps apart."""
    parts: list[tuple[int, int]] = []
    for block_first, block_last in blocks:
        start, end = max(first, block_first), min(last, block_last)
        for unit in range(start, end):
            if apart(unit, unit + 1):
                parts.append((start, unit))
                start = unit + 1
        if start <= end:
            parts.append((start, end))
    return parts


def kept_outputs(manifest: Manifest, first: int, last: int) -> frozenset[str]:
    """The outputs of units [first, last] that a unit outside them, or the request, reads."""
    return frozenset(
        out.name for unit in manifest.units[first : last + 1] for out in unit.outputs
        if any(c == REQUEST or not first <= c <= last for c in out.consumers))


@dataclass(frozen=True)
class JoinedUnit:
    """What joining needs of a unit: its model file, and which of its graph's names it
    shares with other units."""

    index: int
    name: str
    path: str
    outer: tuple[str, ...]  # its graph's inputs and outputs (the manifest's names)
    state_outputs: tuple[str, ...]

    @classmethod
    def of(cls, unit: Unit, path: Path) -> JoinedUnit:
        return cls(unit.index, unit.name, str(path), (*unit.graph_inputs, *unit.graph_outputs),
                   tuple(s.output for s in unit.state))


@dataclass(frozen=True)
class Join:
    """Units to join, and the outputs of theirs to keep."""

    units: tuple[JoinedUnit, ...]
    keep: frozenset[str]


def joined_models(joins: Sequence[Join]) -> list[bytes]:
    """Each join's units as one serialised graph (`joined_graph`). A process that has not
    imported the `onnx` package (a daemon: 10 MB resident) has one child process join
    them all."""
    if "onnx" in sys.modules or not joins:
        return [_joined_bytes(join) for join in joins]
    request = json.dumps([{"units": [asdict(u) for u in join.units], "keep": sorted(join.keep)}
                          for join in joins])
    done = subprocess.run([sys.executable, "-m", "shards.joined"], input=request.encode(),
                          capture_output=True, check=False)
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        names = f"{joins[0].units[0].name}-{joins[-1].units[-1].name}"
        raise ValueError(f"cannot join units {names}: {why}")
    return _unframed(done.stdout)


def _joined_bytes(join: Join) -> bytes:
    import onnx

    graphs = [onnx.load(unit.path, load_external_data=False) for unit in join.units]
    return joined_graph(join.units, graphs, join.keep).SerializeToString()


def _framed(models: Iterable[bytes]) -> bytes:
    return b"".join(len(model).to_bytes(8, "little") + model for model in models)


def _unframed(data: bytes) -> list[bytes]:
    models, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at : at + 8], "little")
        models.append(data[at + 8 : at + 8 + size])
        at += 8 + size
    return models


def joined_graph(units: Sequence[JoinedUnit], graphs: Sequence[onnx.ModelProto],
                 keep: Iterable[str]) -> onnx.ModelProto:
    """One graph computing `units` (their graphs, loaded without external data) in order:
    their inputs from outside in, the `keep` outputs and every state output out. Names
    between units are the manifest's, unique in the model; the names inside a unit's graph
    (the same in every unit exported from one template) get the unit's index as prefix. The
    weights stay external data, read from the units' own data files."""
    import onnx

    kept = set(keep)
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    inputs: list[onnx.ValueInfoProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    functions: dict[tuple[str, str, str], onnx.FunctionProto] = {}
    opsets: dict[str, int] = {}
    known: set[str] = set()  # names an earlier unit produced, or the joined graph takes in
    for unit, model in zip(units, graphs, strict=True):
        graph = model.graph
        _prefix_inner_names(graph, unit)
        nodes += graph.node
        initializers += graph.initializer
        inputs += [i for i in graph.input if i.name not in known]
        outputs += [o for o in graph.output if o.name in kept or o.name in unit.state_outputs]
        known |= {i.name for i in graph.input} | {o.name for o in graph.output}
        for opset in model.opset_import:
            opsets[opset.domain] = max(opsets.get(opset.domain, 0), opset.version)
        for function in model.functions:
            functions.setdefault((function.domain, function.name, function.overload), function)
    joined = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, "+".join(u.name for u in units), inputs, outputs,
                               initializers),
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
        functions=list(functions.values()))
    joined.ir_version = max(model.ir_version for model in graphs)
    return joined


def _prefix_inner_names(graph: onnx.GraphProto, unit: JoinedUnit) -> None:
    outer = set(unit.outer)

    def named(name: str) -> str:
        return name if name in outer or not name else f"u{unit.index}/{name}"

    for node in graph.node:
        node.name = named(node.name)
        node.input[:] = [named(n) for n in node.input]
        node.output[:] = [named(n) for n in node.output]
    for tensor in graph.initializer:
        tensor.name = named(tensor.name)
    for info in graph.value_info:
        info.name = named(info.name)


def main() -> None:
    """The child's side of `joined_models`: the joins as JSON on stdin, the models out, each
    after its length."""
    joins = [Join(tuple(JoinedUnit(u["index"], u["name"], u["path"], tuple(u["outer"]),
                                   tuple(u["state_outputs"])) for u in join["units"]),
                  frozenset(join["keep"]))
             for join in json.loads(sys.stdin.buffer.read())]
    sys.stdout.buffer.write(_framed(_joined_bytes(join) for join in joins))


if __name__ == "__main__":
    main()
