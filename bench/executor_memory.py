"""ONNX Runtime's session options against resident memory and decode speed, side by side.

The bench model of bench.quant (a random Llama, 24 layers, hidden 1024, by default) is
sharded with `--quant none`, `int8` and `int4`. For each quantisation, one StageExecutor
holding all its units runs in a process of its own per variant of `ExecutorOptions`:

  * defaults: what the executor uses (pre-packing on, the process's one memory arena,
    handed back at the end of every step);
  * no-arena: ONNX Runtime's CPU memory arena off, so every allocation goes to the system;
  * no-prepack: pre-packing off, so MatMul reads the memory-mapped weights as they are.

The variants of one quantisation take turns answering (`--rounds` answers of `--tokens`
tokens after an 8-token prompt each), so load from other processes hits them alike. Printed
per variant: resident memory (RSS, and how much of it is file-backed: memory-mapped weights)
after loading and after the short answers, against the units' weight bytes; decode tokens/s,
best and median and the median's ratio to the defaults; then `LONG_ROUNDS` answers to a
`--long-prompt`-token prompt, in turns: the fastest prefill and its speed against the defaults',
and the RSS the last one leaves behind.

int4 without pre-packing is not run: ONNX Runtime's MatMulNBits then dequantises its weights
on every call (0.2 tokens/s against 32 with pre-packing, measured once on this model).

Each executor runs in a process of bench.executor_worker, which bench.quant uses too.

    .venv/bin/python -m bench.executor_memory [--dir DIR] [--rounds 3] [--tokens 32]
        [--long-prompt 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.executor_worker import VARIANTS, Worker
from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from bench.shards import shard_units
from bench.workdir import run_in
from shards.manifest import Quant

SKIPPED = {(Quant.INT4, "no-prepack")}  # see the module's docstring
SHORT_PROMPT = 8
LONG_ROUNDS = 2  # a prompt length's first run is ONNX Runtime's slowest
MB = 1e6


# -- the benchmark --------------------------------------------------------------------------


def main() -> None:
    args = _parser().parse_args()
    run_in(args.dir, lambda root: _bench(root, args))


def _bench(root: Path, args: argparse.Namespace) -> None:
    shape = shape_from(args)
    model = reusable_llama(root, shape, lambda line: print(line, file=sys.stderr, flush=True))
    print(f"model: {shape}, float32, std 0.02; the machine is shared with other work, so "
          "speeds are noisy (ratios are of rounds taking turns)")
    for quant in Quant:
        result = shard_units(model, root, quant, cached=True)
        variants = [v for v in VARIANTS if (quant, v) not in SKIPPED]
        _compare(result.directory, quant, variants, args)


def _compare(units: Path, quant: Quant, variants: list[str], args: argparse.Namespace) -> None:
    workers = {}
    try:
        for variant in variants:  # one at a time: loading is what some variants change
            workers[variant] = Worker(units, variant)
            workers[variant].answer(SHORT_PROMPT, 2)  # first runs fault in and pre-pack
        short: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant, worker in workers.items():
                short[variant].append(worker.answer(SHORT_PROMPT, args.tokens))
        long: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(LONG_ROUNDS):
            for variant, worker in workers.items():
                long[variant].append(worker.answer(args.long_prompt, 2))
    finally:
        for worker in workers.values():
            worker.close()
    _print(quant, {v: w.loaded for v, w in workers.items()}, short, long, args)


def _print(quant: Quant, loaded: dict[str, dict], short: dict[str, list[dict]],
           long: dict[str, list[dict]], args: argparse.Namespace) -> None:
    weights = next(iter(loaded.values()))["weight_bytes"]
    base = statistics.median(r["decode_tps"] for r in short["defaults"])
    prefill = {v: min(r["prefill_s"] for r in runs) for v, runs in long.items()}
    print(f"\n{quant.value}: {weights / MB:.1f} MB of weights; MB resident (of which "
          f"file-backed); decode {args.tokens} tokens, {args.rounds} rounds taking turns; "
          f"then a {args.long_prompt}-token prompt")
    print(f"  {'variant':<11} {'loaded':>13} {'answered':>13} {'- weights':>9}  "
          f"{'decode best':>11} {'median':>7}  {'ratio':>5}  {'prefill':>8} {'ratio':>5} "
          f"{'RSS after':>10}")
    for variant, runs in short.items():
        last, median = runs[-1], statistics.median(r["decode_tps"] for r in runs)
        print(f"  {variant:<11} {_mb(loaded[variant])} {_mb(last)} "
              f"{(last['rss'] - weights) / MB:+9.0f}  "
              f"{max(r['decode_tps'] for r in runs):11.1f} {median:7.1f}  x{median / base:4.2f}  "
              f"{prefill[variant]:7.2f}s x{prefill['defaults'] / prefill[variant]:4.2f} "
              f"{long[variant][-1]['rss'] / MB:10.0f}")


def _mb(memory: dict) -> str:
    return f"{memory['rss'] / MB:6.0f} ({memory['rss_file'] / MB:4.0f})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--rounds", type=int, default=3, help="short answers per variant")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per answer")
    parser.add_argument("--long-prompt", type=int, default=1024,
                        help="prompt tokens of the last answer")
    add_shape_arguments(parser)
    return parser


if __name__ == "__main__":
    main()
