"""One ONNX Runtime session per stage against one per unit, side by side in one process.

A daemon runs each of its units in a session of its own, on a thread pool of its own with
spinning off (shards/executor.py says why), so every unit's run wakes its pool's worker.
This bench joins the bench model's units into one graph (each unit's inner names prefixed
by its index, the weights read from the units' own data files) and times a one-token decode
step from empty K/V three ways, interleaved step by step so the machine's pace hits each
alike: the `StageExecutor` over all units with the daemons' options; the joined session,
spinning off; the joined session with its workers spinning until its run ends
(`session.force_spinning_stop`). It prints each one's median, their ratios to the unit
sessions, and whether the joined session's logits equal the executor's bit for bit.

The joined graph is written beside the units for the run (ONNX Runtime reads external data
relative to the model file only) and removed at the end.

    .venv/bin/python -m bench.stage_session [--dir DIR] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from bench.shards import shard_units
from bench.workdir import run_in
from shards.executor import StageExecutor, session_options
from shards.manifest import Manifest, Quant, Unit

JOINED_NAME = "joined-stage.onnx"
WARM_UP_STEPS = 3


def main() -> None:
    args = _parser().parse_args()
    run_in(args.dir, lambda root: _bench(root, args))


def _bench(root: Path, args: argparse.Namespace) -> None:
    model = reusable_llama(root, shape_from(args), _note)
    sharded = shard_units(model, root, Quant.NONE, cached=True)
    manifest, directory = sharded.manifest, sharded.directory
    joined = (directory / manifest.units[0].model_file.name).parent / JOINED_NAME
    onnx.save(join_units(manifest, directory), str(joined))
    try:
        _compare(manifest, directory, joined, args.steps)
    finally:
        joined.unlink()


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def join_units(manifest: Manifest, directory: Path) -> onnx.ModelProto:
    """The manifest's units as one graph: the stage's inputs and state in, the logits and
    the new state out; names between units are the manifest's, which are unique."""
    nodes, initializers, inputs, outputs = [], [], [], []
    produced: set[str] = set()
    opsets: dict[str, int] = {}
    ir_version = 0
    for unit in manifest.units:
        graph_model = onnx.load(str(directory / unit.model_file.name), load_external_data=False)
        for opset in graph_model.opset_import:
            opsets[opset.domain] = max(opsets.get(opset.domain, 0), opset.version)
        ir_version = max(ir_version, graph_model.ir_version)
        graph = graph_model.graph
        _prefix_inner_names(graph, unit)
        nodes += graph.node
        initializers += graph.initializer
        inputs += [i for i in graph.input if i.name not in produced]
        outputs += [o for o in graph.output if o.name in _joined_outputs(manifest, unit)]
        produced |= {o.name for o in graph.output}
    graph = onnx.helper.make_graph(nodes, "stage", inputs, outputs, initializers)
    joined = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    joined.ir_version = ir_version
    return joined


def _joined_outputs(manifest: Manifest, unit: Unit) -> set[str]:
    last = manifest.units[-1]
    return {s.output for s in unit.state} | ({o.name for o in unit.outputs}
                                              if unit is last else set())


def _prefix_inner_names(graph: onnx.GraphProto, unit: Unit) -> None:
    """Units exported from one template share inner names: give them the unit's own."""
    outer = set(unit.graph_inputs) | set(unit.graph_outputs)

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


def _compare(manifest: Manifest, directory: Path, joined: Path, steps: int) -> None:
    executor = StageExecutor(manifest, directory, 0, len(manifest.units) - 1)
    inputs = {"input_ids": np.array([[5]], np.int64), "position_ids": np.array([[0]], np.int64)}
    state = {s.input: np.zeros(s.shape, s.dtype) for u in manifest.units for s in u.state}
    ways: dict[str, Callable[[], np.ndarray]] = {
        "unit sessions (the daemons')": lambda: _executor_step(executor, inputs),
        "one joined session": _joined_run(joined, False, {**inputs, **state}),
        "joined, spinning in its run": _joined_run(joined, True, {**inputs, **state}),
    }
    for _ in range(WARM_UP_STEPS - 1):
        for way in ways.values():
            way()
    logits = {name: way() for name, way in ways.items()}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(steps):
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - started)
    _print(manifest, times, logits, steps)


def _executor_step(executor: StageExecutor, inputs: dict[str, np.ndarray]) -> np.ndarray:
    try:
        return executor.step("bench", inputs)["logits"]
    finally:
        executor.drop("bench")


def _joined_run(path: Path, spinning: bool,
                feeds: dict[str, np.ndarray]) -> Callable[[], np.ndarray]:
    options = session_options(spinning=spinning)  # the executor's threading
    options.add_session_config_entry("session.force_spinning_stop", str(int(spinning)))
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    given = {name: value for name, value in feeds.items() if name in wanted}
    return lambda: np.asarray(session.run(["logits"], given)[0])


def _print(manifest: Manifest, times: dict[str, list[float]],
           logits: dict[str, np.ndarray], steps: int) -> None:
    print(f"one-token decode step over {len(manifest.units)} units, {steps} steps each way, "
          f"interleaved; medians")
    base_name = next(iter(times))
    base = statistics.median(times[base_name])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        same = np.array_equal(logits[name], logits[base_name])
        print(f"  {name:30s} {median * 1e3:7.2f} ms  x{median / base:4.2f}  "
              f"logits {'bit-identical' if same else 'DIFFER'}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps each way")
    add_shape_arguments(parser)
    return parser


if __name__ == "__main__":
    main()
