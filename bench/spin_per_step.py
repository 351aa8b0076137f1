"""Could a stage choose, step by step, whether its workers spin? What two sessions would cost.

A stage whose workers spin between operators until each run ends computes faster on idle
cores and twice as slowly beside a busy process (docs/architecture.md, "Measured and left as
it is"). ONNX Runtime fixes spinning when it builds a session, so a stage that spun only
when the cores were free would hold two sessions of its units, one spinning and one not.
They cannot share prepacked weights from Python; without prepacking they would map the
same weight files. This bench builds the bench model's middle third of units (joined whole,
the daemons' options) four ways, prepacked (what peerd runs) and unprepacked, each sleeping
and spinning, and times them interleaved, every step after 30 ms idle as a stage idles
between tokens: a one-token decode, four sequences' decode in one batch, and a 64-token
prefill (every fourth round); then the same again beside a busy process pinned to one
core (where the process may run on two or more). Each in a process of its own, it also
measures the memory the stage's sessions hold (proportional set size): one prepacked
session, two prepacked, two unprepacked.

    .venv/bin/python -m bench.spin_per_step [--dir DIR] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import psutil

from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from bench.rebalance import Load
from bench.ring_ceiling import thirds, token_inputs
from bench.shards import shard_units
from bench.workdir import run_in
from shards.executor import ExecutorOptions, StageExecutor
from shards.joined import JOIN_WHOLE
from shards.manifest import Manifest, Quant

WAYS = {
    "prepacked, sleeping": ExecutorOptions(join_bytes=JOIN_WHOLE),
    "prepacked, spinning": ExecutorOptions(join_bytes=JOIN_WHOLE, spinning=True),
    "unprepacked, sleeping": ExecutorOptions(join_bytes=JOIN_WHOLE, prepacking=False),
    "unprepacked, spinning": ExecutorOptions(join_bytes=JOIN_WHOLE, prepacking=False,
                                             spinning=True),
}
HOLDINGS = {
    "one session, prepacked": ["prepacked, sleeping"],
    "two sessions, prepacked": ["prepacked, sleeping", "prepacked, spinning"],
    "two sessions, unprepacked": ["unprepacked, sleeping", "unprepacked, spinning"],
}
IDLE_S = 0.03  # a middle stage idles about two thirds of each token
BATCH = 4
PREFILL = 64
PREFILL_EVERY = 4  # rounds; a prefill step takes five times a decode step
MIDDLE = 1  # of the three stages


Steps = list[tuple[str, dict[str, np.ndarray]]]


def main() -> None:
    args = _parser().parse_args()
    if args.holding:
        print(json.dumps(_held_mb(Path(args.units), HOLDINGS[args.holding])), flush=True)
    else:
        run_in(args.dir, lambda root: _bench(root, args))


def _bench(root: Path, args: argparse.Namespace) -> None:
    model = reusable_llama(root, shape_from(args), _note)
    units = shard_units(model, root, Quant.NONE, cached=True).directory
    manifest = Manifest.load(units)
    first, last = thirds(manifest)[MIDDLE]
    _note("measuring the memory of one and of two sessions, each in a process of its own")
    # before this process maps the weight files itself, which would halve the children's share
    held = {holding: _held_in_child(units, holding) for holding in HOLDINGS}
    _note(f"building units {first}-{last} four ways")
    executors = {name: StageExecutor(manifest, units, first, last, options)
                 for name, options in WAYS.items()}
    for executor in executors.values():
        executor.warm_up()
    one, prompt = _inputs(manifest, units, first, next(iter(executors.values())).inputs)
    kinds: dict[str, tuple[Steps, int]] = {  # the steps, and every how many rounds
        "decode 1": ([("one", one)], 1),
        f"decode {BATCH}": ([(f"batch{i}", one) for i in range(BATCH)], 1),
        f"prefill {PREFILL}": ([("prompt", prompt)], PREFILL_EVERY),
    }
    same = _same_outputs(executors, kinds["decode 1"][0])
    print(f"units {first}-{last} of {len(manifest.units)} joined whole, {args.rounds} rounds "
          f"interleaved, each step after {IDLE_S * 1e3:.0f} ms idle; medians, ms")
    _print_times(_times(executors, kinds, args.rounds), same)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("beside a busy process: not measured, this process may run on one core only")
    else:
        print(f"the same, beside a process busy on core {cores[0]}")
        load = Load(cores[0], 1)
        load.start()
        try:
            _print_times(_times(executors, kinds, args.rounds), same)
        finally:
            load.stop()
    print("memory the stage's sessions hold (proportional set size), each in a process of its own")
    for holding, mb in held.items():
        print(f"  {holding:28s} {mb:6.0f} MB")


def _inputs(manifest: Manifest, units: Path, first: int,
            wanted: Iterable[str]) -> tuple[dict, dict]:
    """A one-token and a PREFILL-token input of the stage that starts at unit `first`, as
    the stage before it sends them."""
    before = StageExecutor(manifest, units, 0, first - 1, ExecutorOptions(join_bytes=JOIN_WHOLE))

    def sent(tokens: int) -> dict[str, np.ndarray]:
        out = before.step("sent", token_inputs(list(range(1, tokens + 1)), 0))
        before.drop("sent")
        return {name: out[name] for name in wanted}

    return sent(1), sent(PREFILL)


def _times(executors: dict[str, StageExecutor], kinds: dict[str, tuple[Steps, int]],
           rounds: int) -> dict[str, dict[str, list[float]]]:
    times = {name: {kind: [] for kind in kinds} for name in executors}
    for number in range(rounds):
        for name, executor in executors.items():
            for kind, (steps, every) in kinds.items():
                if number % every:
                    continue
                time.sleep(IDLE_S)
                started = time.perf_counter()
                _run(executor, steps)
                times[name][kind].append(time.perf_counter() - started)
    return times


def _run(executor: StageExecutor, steps: Steps) -> list[dict[str, np.ndarray]]:
    try:
        outcomes = executor.step_many(steps)
    finally:
        for seq_id, _ in steps:
            executor.drop(seq_id)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return [outcome for outcome in outcomes if isinstance(outcome, dict)]


def _same_outputs(executors: dict[str, StageExecutor], steps: Steps) -> dict[str, str]:
    """Each way's outputs of a step against the first way's."""
    outputs = {name: _run(executor, steps)[0] for name, executor in executors.items()}
    base = next(iter(outputs.values()))
    same = {}
    for name, out in outputs.items():
        diff = max(float(np.max(np.abs(out[key] - base[key]))) for key in base)
        same[name] = "bit-identical" if diff == 0 else f"differ by {diff:.1e}"
    return same


def _print_times(times: dict[str, dict[str, list[float]]], same: dict[str, str]) -> None:
    first = next(iter(times.values()))
    print(f"  {'way':24s}" + "".join(f"{kind:>18s}" for kind in first) + "  outputs")
    base = {kind: statistics.median(seconds) for kind, seconds in first.items()}
    for name, by_kind in times.items():
        cells = ""
        for kind, seconds in by_kind.items():
            median = statistics.median(seconds)
            cells += f"{median * 1e3:11.2f} x{median / base[kind]:4.2f}"
        print(f"  {name:24s}{cells}  {same[name]}")


def _held_in_child(units: Path, holding: str) -> float:
    command = [sys.executable, "-m", "bench.spin_per_step", "--units", str(units),
               "--holding", holding]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def _held_mb(units: Path, ways: list[str]) -> float:
    """Proportional set size in MB the sessions of `ways` add to this process once each has
    run: a page of a weight file two sessions map counts once, unlike in the RSS."""
    manifest = Manifest.load(units)
    first, last = thirds(manifest)[MIDDLE]
    before = psutil.Process().memory_full_info().pss
    executors = [StageExecutor(manifest, units, first, last, WAYS[way]) for way in ways]
    for executor in executors:
        executor.warm_up()
    return (psutil.Process().memory_full_info().pss - before) / 2**20


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds")
    parser.add_argument("--units", help=argparse.SUPPRESS)
    parser.add_argument("--holding", choices=list(HOLDINGS), help=argparse.SUPPRESS)
    add_shape_arguments(parser)
    return parser


if __name__ == "__main__":
    main()
