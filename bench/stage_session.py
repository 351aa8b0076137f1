"""Units joined into sessions against one session per unit, side by side in one process.

Units can run joined, one ONNX Runtime session per block of at most
`ExecutorOptions.join_bytes` of weights (shards/joined.py): `peerd generate` joins whole, a
daemon whole or by blocks as its memory allows, and with `join_bytes=0` (a daemon short of
memory) each unit runs in a session of its own. This bench times a one-token decode step
from empty K/V over all the bench model's units three ways, interleaved step by step so the
machine's pace hits each alike: each unit alone; joined by JOIN_BYTES blocks; the whole
model as one joined session (and its LM head). All three use the daemons' threading
otherwise. It prints each one's median, its ratio to the units alone, how many sessions a
step runs, and whether the logits equal those of the units alone bit for bit.

    .venv/bin/python -m bench.stage_session [--dir DIR] [--steps 40]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from bench.shards import shard_units
from bench.workdir import run_in
from shards.executor import ExecutorOptions, StageExecutor
from shards.joined import JOIN_BYTES, JOIN_WHOLE
from shards.manifest import Quant

WARM_UP_STEPS = 3


def main() -> None:
    args = _parser().parse_args()
    run_in(args.dir, lambda root: _bench(root, args))


def _bench(root: Path, args: argparse.Namespace) -> None:
    model = reusable_llama(root, shape_from(args), _note)
    sharded = shard_units(model, root, Quant.NONE, cached=True)
    manifest, directory = sharded.manifest, sharded.directory
    last = len(manifest.units) - 1
    executors = {
        "each unit alone (join_bytes=0)": ExecutorOptions(join_bytes=0),
        f"joined by {JOIN_BYTES >> 20} MiB blocks": ExecutorOptions(join_bytes=JOIN_BYTES),
        "joined whole": ExecutorOptions(join_bytes=JOIN_WHOLE),
    }
    ways = {name: StageExecutor(manifest, directory, 0, last, options)
            for name, options in executors.items()}
    inputs = {"input_ids": np.array([[5]], np.int64), "position_ids": np.array([[0]], np.int64)}
    steps: dict[str, Callable[[], np.ndarray]] = {
        name: functools.partial(_step, executor, inputs) for name, executor in ways.items()}
    for _ in range(WARM_UP_STEPS - 1):
        for step in steps.values():
            step()
    logits = {name: step() for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    print(f"one-token decode step over {len(manifest.units)} units, {args.steps} steps each "
          f"way, interleaved; medians")
    base_name = next(iter(times))
    base = statistics.median(times[base_name])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        same = np.array_equal(logits[name], logits[base_name])
        print(f"  {name:32s} {len(ways[name].sessions):3d} sessions {median * 1e3:7.2f} ms  "
              f"x{median / base:4.2f}  logits {'bit-identical' if same else 'DIFFER'}")


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _step(executor: StageExecutor, inputs: dict[str, np.ndarray]) -> np.ndarray:
    try:
        return executor.step("bench", inputs)["logits"]
    finally:
        executor.drop("bench")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps each way")
    add_shape_arguments(parser)
    return parser


if __name__ == "__main__":
    main()
