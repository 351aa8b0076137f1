"""Torch eager vs the exported ONNX units, chained through the wire codec, on one model.

One run, one random Llama-format model (default 12 layers, hidden 512): decode tokens/s and
the time of a 128-token prefill, for the whole model in torch eager and for its exported
units split into K stages in one process (every inter-stage message encoded and decoded by
peerd.wire.protocol), side by side with their ratio (ONNX / torch: above 1 means ONNX is
faster). How int8 and int4 units agree with float32 is measured by bench.quant.

    .venv/bin/python -m bench.shards [--layers 12 --hidden 512 ...] [--parts 1,4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.llama_checkpoint import LlamaShape, write_llama
from peerd.commands.generate import GENERATE_OPTIONS, build_pipeline, generate
from shards.arch import empty_cache
from shards.cache import ShardResult
from shards.checkpoint import load_model
from shards.cli import SHARDS_SUBDIR
from shards.manifest import Manifest, Quant
from shards.sampling import SamplingParams

Run = tuple[float, float, list[int]]  # prefill seconds, decode tokens/s, tokens


def main() -> None:
    args = _parser().parse_args()
    shape = LlamaShape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads,
                       args.vocab)
    with tempfile.TemporaryDirectory(prefix="peerd-bench-") as work:
        model_dir = write_llama(Path(work) / "model", shape)
        print(f"model: {shape}; ONNX Runtime threads: its default (one per core)")
        fp32 = shard_units(model_dir, Path(work), Quant.NONE)
        int8 = shard_units(model_dir, Path(work), Quant.INT8)
        prompt = np.random.default_rng(0).integers(3, args.vocab, args.prefill).tolist()
        runners = _contenders(model_dir, fp32, int8, prompt, args)
        _print_results(round_robin(runners, args.repeats))


def _contenders(model_dir: Path, fp32: ShardResult, int8: ShardResult, prompt: list[int],
                args: argparse.Namespace) -> dict[str, Callable[[], Run]]:
    threads = torch.get_num_threads()
    runners = {
        f"torch eager, {n} threads": _torch_eager(model_dir, prompt, args.decode, n)
        for n in sorted({threads, 1}, reverse=True)
    }
    for parts in map(int, args.parts.split(",")):
        runners[f"onnx K={parts}"] = onnx_runner(fp32, parts, prompt, args.decode)
    runners["onnx int8 K=1"] = onnx_runner(int8, 1, prompt, args.decode)
    return runners


def round_robin(runners: dict[str, Callable[[], Run]], repeats: int) -> dict[str, dict]:
    """Round-robin, so that load from other processes hits every contender alike."""
    runs: dict[str, list[Run]] = {label: [] for label in runners}
    for _ in range(repeats):
        for label, runner in runners.items():
            runs[label].append(runner())
    return {label: _best(measured) for label, measured in runs.items()}


def _print_results(best: dict[str, dict]) -> None:
    torch_runs = [b for label, b in best.items() if label.startswith("torch")]
    eager = {
        "prefill_s": min(b["prefill_s"] for b in torch_runs),
        "decode_tps": max(b["decode_tps"] for b in torch_runs),
    }
    print("ratios (x...) are against the better torch eager configuration for each measure")
    for label, result in best.items():
        same = ""
        if label.startswith("onnx K"):
            agree = result["tokens"] == torch_runs[0]["tokens"]
            same = " (same tokens)" if agree else " (TOKENS DIFFER)"
        _report(label + same, result, eager)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prefill", type=int, default=128, help="prompt tokens")
    p.add_argument("--decode", type=int, default=64, help="decode steps timed")
    p.add_argument("--parts", default="1,4", help="stage counts K to run")
    p.add_argument("--repeats", type=int, default=5, help="runs per contender (best kept)")
    return p


def shard_units(model_dir: Path, work: Path, quant: Quant, cached: bool = False) -> ShardResult:
    """Shard with the real CLI, in a subprocess (which also reports its peak RSS), into
    `work/units-QUANT`, or with `cached` into the shard cache `shard_cache(work)` (where a
    LocalCluster given that cache finds them); a complete earlier result there is reused."""
    command = [sys.executable, "-m", "peerd", "shard", str(model_dir), "--json",
               "--quant", quant.value]
    env = None
    if cached:
        env = {**os.environ, "PEERD_STATE_DIR": str(shard_cache(work).parent)}
    else:
        command += ["--out", str(work / f"units-{quant.value}")]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    result = json.loads(done.stdout)
    stats, out = result["stats"], Path(result["directory"])
    manifest = Manifest.load(out)
    done_as = "sharded" if stats["exported"] else "found sharded"
    print(f"{done_as} ({quant.value}): {len(manifest.units)} units in "
          f"{stats['seconds']:.1f}s, peak RSS {stats['peak_rss_bytes'] / 2**20:.0f} MB")
    return ShardResult(manifest, out, stats["exported"], stats["seconds"])


def shard_cache(work: Path) -> Path:
    """The shard cache `shard_units(..., cached=True)` fills: a state directory's `shards`."""
    return work / "shard-state" / SHARDS_SUBDIR


def _torch_eager(
    model_dir: Path, prompt: list[int], steps: int, threads: int
) -> Callable[[], Run]:
    config, model = load_model(model_dir)

    @torch.inference_mode()
    def run() -> Run:
        torch.set_num_threads(threads)
        ids = torch.tensor([prompt])
        started = time.perf_counter()
        logits, *cache = model(ids, torch.arange(len(prompt))[None], *empty_cache(config))
        tokens = [int(logits[0, -1].argmax())]
        prefilled = time.perf_counter()
        for position in range(len(prompt), len(prompt) + steps):
            logits, *cache = model(torch.tensor([[tokens[-1]]]), torch.tensor([[position]]),
                                   *cache)
            tokens.append(int(logits[0, -1].argmax()))
        return prefilled - started, steps / (time.perf_counter() - prefilled), tokens

    return run


def onnx_runner(
    result: ShardResult, parts: int, prompt: list[int], steps: int
) -> Callable[[], Run]:
    pipeline = build_pipeline(result.manifest, result.directory, parts,
                              options=GENERATE_OPTIONS)

    def run() -> Run:
        done = generate(pipeline, result.manifest, prompt, steps + 1, SamplingParams(),
                        stop_at_eos=False)
        stats = done.stats
        return stats["prefill_seconds"], stats["decode_tokens_per_second"], done.token_ids

    return run


def _best(runs: list[Run]) -> dict:
    return {
        "prefill_s": min(r[0] for r in runs),
        "decode_tps": max(r[1] for r in runs),
        "decode_tps_median": statistics.median(r[1] for r in runs),
        "tokens": runs[0][2],
    }


def _report(label: str, run: dict, eager: dict) -> None:
    print(
        f"{label:<36} prefill {run['prefill_s'] * 1000:8.1f} ms "
        f"(x{eager['prefill_s'] / run['prefill_s']:.2f})   "
        f"decode {run['decode_tps']:7.1f} tok/s (median {run['decode_tps_median']:.1f}; "
        f"x{run['decode_tps'] / eager['decode_tps']:.2f})"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
