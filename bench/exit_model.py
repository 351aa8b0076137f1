"""A random Llama-format checkpoint whose early layers already predict the next token, for
benchmarking early exit (CE-CoLLM style: the exit after decoder layer N reads
`lm_head(norm(hidden_states[N]))` and answers when its top softmax probability reaches θ).

Plain random weights give a near-uniform softmax at every layer, so no exit ever happens.
This checkpoint is built instead, from seeded draws (no downloads), as follows:

- Every token t has a random unit *code* c(t) (coordinate 0 left out), and the tokens form
  one random cycle: t's successor is next(t). lm_head's row for next(t) is c(t) scaled so
  that a residual stream pointing exactly along c(t) gives a logit of
  `sharpness * ln(vocab)`; bos and eos get zero rows, so a greedy run never stops.
- t's embedding is `signal(t) * c(t) + sqrt(1 - signal(t)^2) * x(t)` (x(t) another random
  unit vector), scaled to unit RMS, with `signal(t)` drawn uniformly in [signal_min, 1]:
  the share of the stream that points at next(t), hence the exit's confidence at t.
  Coordinate 0 carries a mark, +0.25 for a `fragile` share of the tokens and -0.25 for the
  others (RMS units).
- Decoder layers are drawn as bench/llama_checkpoint.py draws them, then rescaled to
  unit-variance outputs: the writes (o_proj, down_proj) of the layers before `exit_layer`
  are scaled by `early_scale`, so they only blur the codes a little; from `exit_layer` on,
  attention writes are scaled by `late_scale`, and the MLPs are gated by the mark (every
  row of gate_proj reads coordinate 0): shut at ordinary tokens, wide open at fragile ones,
  where they drown the code in noise so that the full model disagrees with the exit.

So the exit's confidence is set per token by `signal` and `sharpness` (the exit rate at θ
is the share of visited tokens with enough signal), and the full model agrees with the
exit at every token but the fragile ones (and the rare ones where late attention tips a
near tie). The defaults are tuned for the bench shape (24 layers, hidden 1024, vocab 32000,
exit after layer 8); small shapes need a larger `sharpness` (codes in few dimensions overlap
more: hidden 64, vocab 512 wants about 2). Layers before the exit are as confident as the
exit itself: the construction makes no claim that confidence grows with depth. No tokenizer
is written: use `--prompt-ids`.

    .venv/bin/python -m bench.exit_model OUT [--layers 24 --exit-layer 8 ...] [--measure]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from bench.llama_checkpoint import LlamaShape, _config, _layer, add_shape_arguments, shape_from

MARK = 0.25  # coordinate 0 of an embedding, in RMS units: + fragile, - ordinary
GATE = 32.0  # the late MLPs' gate at a marked token: silu(32) = 32, silu(-32) = -4e-13
DRAW_STD = 0.02  # the std bench/llama_checkpoint.py draws weights with
PROMPT = (1, 17, 42, 99, 256, 311, 7, 73)  # --measure's prompt (ids below 512)
THRESHOLDS = (0.5, 0.8, 0.9)


@dataclass(frozen=True)
class ExitKnobs:
    sharpness: float = 1.6  # lm_head's largest logit, in units of ln(vocab)
    signal_min: float = 0.5  # each token's signal is uniform in [signal_min, 1]
    fragile: float = 0.05  # share of tokens whose late layers overturn the exit
    early_scale: float = 0.1  # writes of the layers before the exit
    late_scale: float = 0.1  # attention writes of the layers from the exit on


@dataclass(frozen=True)
class ExitFigures:
    threshold: float
    exit_rate: float  # share of steps whose exit confidence is >= threshold
    agreement: float  # share of those steps where exit and full model pick the same token


def write_exit_checkpoint(out: Path, layers: int = 24, hidden: int = 1024,
                          intermediate: int = 2816, heads: int = 16, kv_heads: int = 4,
                          vocab: int = 32000, exit_layer: int = 8, seed: int = 0,
                          **knobs: float) -> Path:
    """Write the checkpoint (one safetensors file per layer, as bench/llama_checkpoint.py
    does) with config.json and generation_config.json into `out`; `knobs` are ExitKnobs'."""
    shape = LlamaShape(layers, hidden, intermediate, heads, kv_heads, vocab)
    config = _config(shape, "float32")
    special = (config["bos_token_id"], config["eos_token_id"])
    rng = np.random.default_rng(seed)
    settings = ExitKnobs(**knobs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    groups = _groups(shape, exit_layer, settings, special, rng)
    index = {"metadata": {}, "weight_map": _save(out, groups, layers + 1)}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    generation = {"bos_token_id": special[0], "eos_token_id": special[1]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _save(out: Path, groups: Iterator[dict[str, torch.Tensor]], files: int) -> dict[str, str]:
    """Each group into its own safetensors file, one at a time: the index's weight map."""
    weight_map = {}
    for number, tensors in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{files:05d}.safetensors"
        save_file(tensors, str(out / name))
        weight_map.update(dict.fromkeys(tensors, name))
    return weight_map


def _groups(shape: LlamaShape, exit_layer: int, knobs: ExitKnobs, special: Sequence[int],
            rng: np.random.Generator) -> Iterator[dict[str, torch.Tensor]]:
    embedding, lm_head = _token_tables(shape, knobs, special, rng)
    yield {"model.embed_tokens.weight": torch.from_numpy(embedding),
           "model.norm.weight": torch.ones(shape.hidden),
           "lm_head.weight": torch.from_numpy(lm_head)}
    for index in range(shape.layers):
        yield _decoder_layer(shape, index, index >= exit_layer, knobs, rng)


def _token_tables(shape: LlamaShape, knobs: ExitKnobs, special: Sequence[int],
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The embedding and lm_head of the module docstring."""
    root = math.sqrt(shape.hidden)
    codes = _unit_rows(rng, shape.vocab, shape.hidden)
    signal = rng.uniform(knobs.signal_min, 1.0, size=(shape.vocab, 1)).astype(np.float32)
    embedding = signal * codes + np.sqrt(1 - signal**2) * _unit_rows(rng, *codes.shape)
    embedding *= root
    fragile = rng.random(shape.vocab) < knobs.fragile
    embedding[:, 0] = np.where(fragile, MARK, -MARK) * root
    cycle = rng.permutation(shape.vocab)
    lm_head = np.empty_like(codes)
    lm_head[np.roll(cycle, -1)] = codes[cycle] * (knobs.sharpness * math.log(shape.vocab))
    lm_head[list(special)] = 0
    return embedding, lm_head / root


def _unit_rows(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """Random unit vectors with coordinate 0 (the mark's) at zero."""
    vectors = rng.standard_normal(size=(rows, width), dtype=np.float32)
    vectors[:, 0] = 0
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def _decoder_layer(shape: LlamaShape, index: int, late: bool, knobs: ExitKnobs,
                rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """bench/llama_checkpoint.py's layer, rescaled to unit-variance outputs, its writes
    scaled, and from the exit on its MLP gated by the mark."""
    tensors = _layer(shape, index, rng, torch.from_numpy)
    weight = {name.split(".")[-2]: tensor for name, tensor in tensors.items()
              if name.endswith("proj.weight")}
    for name in ("v_proj", "gate_proj", "up_proj"):
        weight[name] /= DRAW_STD * math.sqrt(shape.hidden)
    weight["o_proj"] *= (knobs.late_scale if late else knobs.early_scale) / (
        DRAW_STD * math.sqrt(shape.hidden))
    weight["down_proj"] *= (1.0 if late else knobs.early_scale) / (
        DRAW_STD * math.sqrt(shape.intermediate))
    if late:
        weight["gate_proj"].zero_()
        weight["gate_proj"][:, 0] = GATE / (MARK * math.sqrt(shape.hidden))
    return tensors


def exit_figures(exit_logits_rows: np.ndarray, full_logits_rows: np.ndarray,
                 thresholds: Sequence[float]) -> list[ExitFigures]:
    """Per threshold θ, from one row of logits per step (the exit's and the full model's):
    the share of steps whose exit confidence (top softmax probability) is >= θ, and the
    share of those where the exit's argmax is the full model's (nan where none exits).
    θ = 0 gives the overall agreement."""
    exit_rows = np.asarray(exit_logits_rows, dtype=np.float64)
    shifted = exit_rows - exit_rows.max(axis=1, keepdims=True)
    confidence = 1 / np.exp(shifted).sum(axis=1)
    agree = exit_rows.argmax(axis=1) == np.asarray(full_logits_rows).argmax(axis=1)
    return [_figures(theta, confidence >= theta, agree) for theta in thresholds]


def _figures(threshold: float, exits: np.ndarray, agree: np.ndarray) -> ExitFigures:
    agreement = float(agree[exits].mean()) if exits.any() else math.nan
    return ExitFigures(threshold, float(exits.mean()), agreement)


def measure(model_dir: Path, exit_layer: int, steps: int = 64,
            prompt: Sequence[int] = PROMPT) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding of `steps` tokens after `prompt` with transformers: the exit's and
    the full model's logits at each step (one row each)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(  # pyright: ignore[reportAttributeAccessIssue] (its self-type)
            torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=steps,
            eos_token_id=None)
        output = model(input_ids=ids[:, :-1], output_hidden_states=True)
        steps_of = slice(len(prompt) - 1, None)
        exits = model.lm_head(model.model.norm(output.hidden_states[exit_layer][0, steps_of]))
    return exits.numpy(), output.logits[0, steps_of].numpy()


def main() -> None:
    args = _parser().parse_args()
    shape = shape_from(args)
    exit_layer = args.exit_layer if args.exit_layer is not None else shape.layers // 3
    knobs = {field.name: getattr(args, field.name) for field in fields(ExitKnobs)}
    out = write_exit_checkpoint(args.out, shape.layers, shape.hidden, shape.intermediate,
                                shape.heads, shape.kv_heads, shape.vocab, exit_layer,
                                args.seed, **knobs)
    print(f"wrote {out}: {shape}, exit after layer {exit_layer}, {knobs}")
    if args.measure:
        rows = exit_figures(*measure(out, exit_layer, args.steps), (0.0, *THRESHOLDS))
        print(f"{'θ':>5} {'exit rate':>10} {'agreement':>10}")
        for row in rows:
            label = "all" if row.threshold == 0 else f"{row.threshold:.2f}"
            print(f"{label:>5} {row.exit_rate:10.3f} {row.agreement:10.3f}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.exit_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    add_shape_arguments(parser)
    parser.add_argument("--exit-layer", type=int, help="default: a third of the layers")
    parser.add_argument("--seed", type=int, default=0)
    for field in fields(ExitKnobs):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=float,
                            default=field.default)
    parser.add_argument("--measure", action="store_true",
                        help="greedy-decode with transformers and print exit rates")
    parser.add_argument("--steps", type=int, default=64, help="decoding steps of --measure")
    return parser


if __name__ == "__main__":
    main()
