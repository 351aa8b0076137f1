"""`peerd generate`: run a model split into K stages in this process, no daemon.

The model is sharded (or its cached shards reused), its units are split into K contiguous
stages of near-equal unit counts, and generation runs through `peerd.inference.local_pipeline`: the
same stage logic as the daemon, every inter-stage message encoded and decoded by
`peerd.wire.protocol`, exactly as the network would carry it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from peerd.errors import PeerdError
from peerd.inference.local_pipeline import LocalPipeline
from peerd.inference.pipeline import Generation, StageWorker
from peerd.inference.routing import routes
from peerd.inference.shares import ShareStage
from shards.cache import ShardOptions
from shards.cli import shard_or_reuse
from shards.early_exit import ExitSettings, stage_exit
from shards.errors import ModelError, NoTokenizer
from shards.executor import ExecutorOptions, StageExecutor
from shards.joined import JOIN_WHOLE
from shards.manifest import Manifest, Quant
from shards.sampling import SamplingParams
from shards.share_layout import ShareUnits
from shards.share_split import ShareError
from shards.text_stream import TextStream
from shards.tokenizer import Tokenizer

# `peerd generate` is a foreground process that has the cores to itself, and its stages never
# change: the shared pool, and each stage joined whole (ExecutorOptions says why daemons do
# neither, or only where their memory allows)
GENERATE_OPTIONS = ExecutorOptions(shared_pool=True, join_bytes=JOIN_WHOLE)


def cmd_generate(args: argparse.Namespace) -> int:
    model_dir = Path(args.model_dir)
    params = _sampling(args)
    if args.max_tokens < 1:
        raise PeerdError(f"--max-tokens must be at least 1, not {args.max_tokens}")
    exits = exit_settings(args)
    _check_tensor_parallel(args, exits)
    prompt = _prompt_ids(args, model_dir)
    shards = shard_or_reuse(model_dir, None, ShardOptions(quant=args.quant))
    manifest = shards.manifest
    with tempfile.TemporaryDirectory(prefix="peerd-shares-") as scratch:
        shares = None if args.tensor_parallel is None else _share_units(
            model_dir, manifest, args.tensor_parallel, Path(scratch))
        pipeline = build_pipeline(manifest, shards.directory, args.parts, args.fp16_wire,
                                  GENERATE_OPTIONS, exits, shares)
        run = generate(pipeline, manifest, prompt, args.max_tokens, params)
    text = _decode(model_dir, run.token_ids)
    stats = {**run.stats, "parts": args.parts, "units": len(manifest.units),
             "quant": manifest.options.quant.value,
             "stages": [[w.executor.first, w.executor.last] for w in pipeline.workers],
             "shard_seconds": round(shards.seconds, 3), "sharded_now": shards.exported}
    if shares is not None:
        stats |= share_stats(pipeline, shares)
    if args.json:
        print(json.dumps({"token_ids": run.token_ids, "text": text, "stats": stats}))
    else:
        print(text if text else " ".join(map(str, run.token_ids)))
    if shares is not None:
        print(_shares_line(shares), file=sys.stderr)
    return 0


def _check_tensor_parallel(args: argparse.Namespace, exits: ExitSettings) -> None:
    """--tensor-parallel N, and the flags it does not run with yet."""
    count = args.tensor_parallel
    if count is None:
        return
    if count < 1:
        raise PeerdError(f"--tensor-parallel must be at least 1, not {count}")
    if exits.enabled:
        raise PeerdError("--tensor-parallel does not run with --early-exit or --speculative yet")
    if args.quant is not Quant.NONE:
        raise PeerdError("--tensor-parallel exports float32 share units: drop --quant")


def _share_units(model_dir: Path, manifest: Manifest, count: int, directory: Path) -> ShareUnits:
    from shards.share_units import shares_for  # torch: only where shares are asked for

    try:
        return shares_for(model_dir, manifest, [1.0] * count, directory)
    except ShareError as exc:
        raise PeerdError(f"--tensor-parallel {count}: {exc}") from None


def share_stats(pipeline: LocalPipeline, shares: ShareUnits) -> dict:
    """The shares of every layer and the bytes they exchanged, for --json."""
    return {
        "tensor_parallel": len(shares.shares),
        "shares": [{"share": s.index, "weight": w, "kv_heads": [s.kv_heads.start, s.kv_heads.stop],
                    "heads": [s.heads.start, s.heads.stop],
                    "mlp_columns": [s.columns.start, s.columns.stop]}
                   for s, w in zip(shares.shares, shares.weights, strict=True)],
        "share_wire_bytes": sum(w.executor.wire_bytes for w in pipeline.workers),
    }


def _shares_line(shares: ShareUnits) -> str:
    return f"{len(shares.shares)} tensor-parallel shares per stage: " + "; ".join(
        f"share {s.index}: heads {s.heads.start}-{s.heads.stop - 1} "
        f"(KV heads {s.kv_heads.start}-{s.kv_heads.stop - 1}), "
        f"MLP columns {s.columns.start}-{s.columns.stop - 1}" for s in shares.shares)


def split_units(unit_count: int, parts: int) -> list[tuple[int, int]]:
    """K contiguous, non-empty unit ranges whose sizes differ by at most one."""
    if not 1 <= parts <= unit_count:
        raise PeerdError(f"--parts must be between 1 and {unit_count} (the number of units)")
    bounds = np.linspace(0, unit_count, parts + 1).round().astype(int)
    return [(int(a), int(b) - 1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def exit_settings(args: argparse.Namespace) -> ExitSettings:
    """--early-exit, --exit-layer and --speculative, checked."""
    try:
        return ExitSettings(args.early_exit, args.speculative, args.exit_layer)
    except ValueError as exc:
        raise PeerdError(str(exc)) from None


def build_pipeline(
    manifest: Manifest, directory: Path, parts: int, fp16_wire: bool = False,
    options: ExecutorOptions | None = None, exits: ExitSettings | None = None,
    shares: ShareUnits | None = None,
) -> LocalPipeline:
    """The K stages of the manifest's units, each a StageExecutor, or with `shares`, each
    run as those tensor-parallel shares (ShareStage)."""
    exits = exits or ExitSettings()
    ranges = split_units(len(manifest.units), parts)
    point = None
    if exits.enabled:
        try:
            point = stage_exit(manifest, ranges[0][1], exits.layer)
        except ValueError as exc:
            raise PeerdError(f"{exc}; give a smaller --exit-layer or fewer --parts") from None
    stage_routes = routes(manifest, ranges)
    if shares is not None:
        return LocalPipeline([
            StageWorker(stage, ShareStage(manifest, directory, a, b, shares, options),
                        stage_routes[stage], fp16_wire)
            for stage, (a, b) in enumerate(ranges)])
    return LocalPipeline([
        StageWorker(stage, StageExecutor(manifest, directory, a, b, options,
                                         exit=point if stage == 0 else None),
                    stage_routes[stage], fp16_wire)
        for stage, (a, b) in enumerate(ranges)], exits)


@dataclass
class Run:
    token_ids: list[int]
    logits: list[np.ndarray]  # the row each token was sampled from
    stats: dict = field(default_factory=dict)


@dataclass
class _Recorder:
    """Every new token's logits row, and when it came."""

    rows: list[np.ndarray] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def __call__(self, generation: Generation, tokens: list[int], rows: np.ndarray) -> None:
        now = time.perf_counter()
        for row in rows[: len(tokens)]:
            self.rows.append(np.array(row))
            self.times.append(now)


def generate(
    pipeline: LocalPipeline,
    manifest: Manifest,
    prompt: list[int],
    max_tokens: int,
    params: SamplingParams,
    stop_at_eos: bool = True,
) -> Run:
    """One generation through the pipeline; stops after max_tokens or at an EOS token."""
    _check_lengths(manifest, prompt, max_tokens)
    recorder = pipeline.on_tokens = _Recorder()
    stops = frozenset(manifest.model.eos_token_ids) if stop_at_eos else frozenset()
    generation = Generation("generate", list(prompt), max_tokens, stops)
    started = time.perf_counter()
    wire_before = pipeline.wire_bytes
    pipeline.generate([(generation, params)])
    prefill = recorder.times[0] - started
    decode = recorder.times[-1] - recorder.times[0]
    decoded = len(recorder.times) - 1
    stats = {
        "prompt_tokens": len(prompt),
        "generated_tokens": len(generation.tokens),
        "prefill_seconds": round(prefill, 6),
        "decode_seconds": round(decode, 6),
        "decode_tokens_per_second": round(decoded / decode, 3) if decoded and decode else None,
        "wire_bytes": pipeline.wire_bytes - wire_before,
    }
    if pipeline.exits.enabled:
        stats["exit"] = exit_stats(pipeline, generation)
    return Run(generation.tokens, recorder.rows, stats)


def exit_stats(pipeline: LocalPipeline, generation: Generation) -> dict:
    point = pipeline.workers[0].executor.exit
    assert point is not None  # build_pipeline places one wherever exits are enabled
    return pipeline.exits.figures(point, generation.exit_stats)


def _check_lengths(manifest: Manifest, prompt: list[int], max_tokens: int) -> None:
    if not prompt:
        raise PeerdError("the prompt is empty")
    vocab = manifest.model.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise PeerdError(f"prompt token ids must be in 0..{vocab - 1}")
    limit = manifest.model.max_positions
    if len(prompt) + max_tokens > limit:
        raise PeerdError(
            f"{len(prompt)} prompt tokens + {max_tokens} new tokens exceed the model's "
            f"{limit} positions"
        )


def _sampling(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as exc:
        raise PeerdError(str(exc)) from None


def _prompt_ids(args: argparse.Namespace, model_dir: Path) -> list[int]:
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    try:
        return Tokenizer.from_model(model_dir).prompt_ids(args.prompt)
    except ModelError as exc:
        raise PeerdError(str(exc)) from None


def _decode(model_dir: Path, token_ids: list[int]) -> str:
    """The answer's text as the daemon streams it (shards.text_stream.TextStream)."""
    try:
        text = TextStream(Tokenizer.from_model(model_dir))
    except NoTokenizer:
        return ""
    except ModelError as exc:
        raise PeerdError(str(exc)) from None
    for token in token_ids:
        text.add(token)
    return text.text
