"""Sharding throughput: every unit exported with torch.onnx against later layers built from
the first layer's graph, on one checkpoint in one run.

Prints, for each path, the seconds and the MB of float32 weights written per second, and
their ratio (issue 15's target: the new path at least 4x the old). Both paths write the same
units (each checked against torch as it is written); the model is a random Llama-format
checkpoint (default 24 layers, hidden 1024) or `--model DIR|FILE.gguf`.

    .venv/bin/python -m bench.shard_speed [--layers 24 --hidden 1024] [--model PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from shards.cache import ShardOptions
from shards.export import export_units
from shards.source import open_model

MB = 1e6


def main() -> None:
    args = _parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="peerd-bench-") as root:
        model = Path(args.model) if args.model else _random_model(Path(root), args)
        pace = {reuse: _shard(model, Path(root) / f"reuse-{reuse}", reuse)
                for reuse in (False, True)}
    old, new = pace[False], pace[True]
    print(f"{'path':<36} {'seconds':>8} {'MB/s':>8}")
    print(f"{'every unit exported (old)':<36} {old[0]:8.1f} {old[1] / old[0] / MB:8.1f}")
    print(f"{'layers from the first graph (new)':<36} {new[0]:8.1f} {new[1] / new[0] / MB:8.1f}")
    print(f"new / old throughput: {old[0] / new[0]:.2f}x (target >= 4x)")


def _shard(model: Path, out: Path, reuse_graphs: bool) -> tuple[float, int]:
    """Seconds to shard `model` into `out`, and the bytes of float32 weights written."""
    source = open_model(model)
    started = time.perf_counter()
    manifest = export_units(source, source.config(), out, ShardOptions(), _note, "bench",
                            source.digest(), reuse_graphs=reuse_graphs)
    return time.perf_counter() - started, sum(u.weight_bytes for u in manifest.units)


def _random_model(root: Path, args: argparse.Namespace) -> Path:
    shape = shape_from(args)
    print(f"model: {shape}, float32, std 0.02")
    return reusable_llama(root, shape, _note)


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint directory or GGUF file to shard "
                        "(default: a random Llama of the shape below)")
    add_shape_arguments(parser)
    return parser


if __name__ == "__main__":
    main()
