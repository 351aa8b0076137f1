"""Peak resident memory of `peerd shard` on a model far larger than any one unit.

Writes a random Llama-format checkpoint (default 24 layers, hidden 1024, float16 on disk),
runs the real `peerd shard --json` in a subprocess, and compares its peak RSS with the
target: below twice the largest unit's weights plus 600 MB (the whole model never in memory).

    .venv/bin/python -m bench.shard_memory [--layers 24 --hidden 1024 ...] [--quant int4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.llama_checkpoint import LlamaShape, write_llama
from shards.manifest import Quant

MB = 1024 * 1024


def main() -> None:
    args = _parser().parse_args()
    shape = LlamaShape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads,
                       args.vocab)
    with tempfile.TemporaryDirectory(prefix="peerd-bench-") as work:
        model_dir = write_llama(Path(work) / "model", shape, dtype=args.dtype)
        command = [sys.executable, "-m", "peerd", "shard", str(model_dir),
                   "--out", str(Path(work) / "units"), "--json", "--quant", args.quant]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    stats = json.loads(done.stdout)["stats"]
    total, largest, peak = (stats[k] for k in
                            ("total_weight_bytes", "largest_unit_weight_bytes", "peak_rss_bytes"))
    # sharding runs every unit in float32 before quantising it, so that is what it holds
    largest_float32 = 4 * _largest_unit_parameters(shape)
    target = 2 * largest_float32 + 600 * MB
    print(f"model: {shape}, {args.dtype} on disk, quant {args.quant}")
    print(f"units: {len(json.loads(done.stdout)['units'])}, exported in {stats['seconds']:.0f}s")
    print(f"weights of all units as written: {total / MB:8.0f} MB")
    print(f"largest unit as written:         {largest / MB:8.0f} MB")
    print(f"largest unit in float32:         {largest_float32 / MB:8.0f} MB")
    print(f"peak RSS of peerd shard:         {peak / MB:8.0f} MB")
    verdict = "meets" if peak < target else "MISSES"
    print(f"target 2 x largest float32 unit + 600 MB: {target / MB:.0f} MB -> {verdict}")


def _largest_unit_parameters(shape: LlamaShape) -> int:
    kv = shape.kv_heads * shape.hidden // shape.heads
    attention = shape.hidden * (2 * shape.hidden + 2 * kv) + shape.hidden
    mlp = 3 * shape.hidden * shape.intermediate + shape.hidden
    return max(shape.vocab * shape.hidden + shape.hidden, attention, mlp)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float16", help="dtype of the weights on disk")
    p.add_argument("--quant", choices=[q.value for q in Quant], default=Quant.NONE.value,
                   help="quantise the units (default none)")
    return p


if __name__ == "__main__":
    main()
