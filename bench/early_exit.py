"""Early exit (CE-CoLLM) and speculative decoding over three daemons on slow links, one run.

Three daemons, each in its own network namespace (tests/netns.py), each namespace's egress
shaped with `tc ... tbf` to `--mbit` (default 10 Mbit/s), every peer with a
`--memory-budget` under which no two of them hold the model, so the plan has three stages
and the first holds the exit layer. Each row restarts the cluster with that row's flags
(every peer gets the same ones; only the plan's head uses them) and asks the head for
greedy answers to a few prompts, after one warm-up answer:

  full model (no flags), --early-exit 0.5, 0.8, 0.9, --speculative 2, 4

all with `--exit-layer 2`. Columns, medians over the prompts where a figure is per answer:
decode ms per token (1000 / the chat stats' tokens_per_second) and total ms per token (the
answer's total_s over its tokens, prefill included), each with the full model's of the
same run over the row's (speed-up); exit rate (exited / generated tokens); the exit's
agreement with the full model (the exit stats' agreed / checked: exited tokens the full
model chose too given the same prefix); answers equal to the full-model row's and the share
of positions equal; for speculative rows, acceptance (accepted / drafted) and tokens per
full-model check ((accepted + checks) / checks).

Why 10 Mbit/s: one position's hidden state (hidden 512, float32: 2 KiB with framing) takes
about 1.7 ms a hop there, so a decode step's hand-offs (stage to stage, the token back to
the head, the residual messages) cost a few ms: the same order as a stage's compute on
this machine, as on a home Wi-Fi link with a busy neighbour. A faster link makes the hops
vanish against compute (what the exit saves is then only the later stages' compute, which
they still spend, on the same two cores); a much slower one makes every answer a transfer
benchmark. A speculative check carries N + 1 positions, so the link prices checks too.

Two models, both 12 layers, hidden 512, intermediate 1408, 8 heads (4 K/V), vocab 32000,
float32 (70 M parameters; tens of ms per token across the three peers on 2 cores):
  (1) a random Llama (bench.llama_checkpoint): its exit is rarely confident;
  (2) a constructed checkpoint (bench.exit_model) whose first layers already decide the
      next token, so exits after layer 2 are confident: the best case for the exit.

The checkpoints and their units are kept under `--dir`, so a rerun skips writing and
sharding them. Every peer is given the model with its units already in its shard cache (one
shared cache, linked), so no units cross the slow links. The daemons run with
`--no-rebalance`. Timings on a shared two-core machine are noisy: the load average is
printed beside each model's table.

    .venv/bin/python -m bench.early_exit [--dir DIR] [--tokens 32] [--mbit 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.llama_checkpoint import LlamaShape, reusable_llama
from bench.namespaced import (
    load_average,
    netns,
    note,
    run_bench,
    serving,
    shard_once,
)
from peerd.commands.chat import stream_answer
from peerd.commands.local_cluster import budget_for
from shards.manifest import Manifest

SHAPE = LlamaShape(layers=12, hidden=512, intermediate=1408, heads=8, kv_heads=4, vocab=32000)
EXIT_LAYER = 2
PEERS = 3
PROMPTS = [[1, 17, 42, 99, 7, 250, 31, 64], [5, 900, 33, 12, 4000], [300, 301, 302, 7, 6, 2500]]
WARM_UP = [11, 12, 13]
EXIT = ("--exit-layer", str(EXIT_LAYER))
ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("full model", ()),
    ("--early-exit 0.5", ("--early-exit", "0.5", *EXIT)),
    ("--early-exit 0.8", ("--early-exit", "0.8", *EXIT)),
    ("--early-exit 0.9", ("--early-exit", "0.9", *EXIT)),
    ("--speculative 2", ("--speculative", "2", *EXIT)),
    ("--speculative 4", ("--speculative", "4", *EXIT)),
]


@dataclass
class Row:
    label: str
    answers: list[dict]  # the done events, one per prompt

    @property
    def tokens(self) -> list[list[int]]:
        return [a["token_ids"] for a in self.answers]

    def median(self, figure: Callable[[dict], float | None]) -> float | None:
        values = [v for v in (figure(a["stats"]) for a in self.answers) if v is not None]
        return statistics.median(values) if values else None

    def exit_total(self, key: str) -> int:
        return sum((a["stats"]["exit"] or {}).get(key, 0) for a in self.answers)


@dataclass
class Model:
    label: str
    directory: Path


def main() -> int:
    args = _parser().parse_args()
    return run_bench("bench.early_exit", args.dir, lambda root: _bench(root, args))


def _bench(root: Path, args: argparse.Namespace) -> None:
    print(f"early exit over {PEERS} daemons in network namespaces, each one's egress shaped "
          f"to {args.mbit} Mbit/s (tbf); {len(PROMPTS)} greedy prompts of "
          f"{args.tokens} new tokens per row, medians; exit after layer {EXIT_LAYER}")
    for model in _models(root):
        note(f"== {model.label}")
        manifest, budget, dirs = _prepare(root, model)
        load_before = load_average()
        rows = [_measure(row, dirs, model, budget, args) for row in ROWS]
        _table(model, manifest, budget, rows, load_before)


def _models(root: Path) -> list[Model]:
    from bench.exit_model import write_exit_checkpoint

    random_dir = reusable_llama(root, SHAPE, note)
    exit_dir = root / f"exit-{SHAPE.layers}x{SHAPE.hidden}-at{EXIT_LAYER}"
    if not (exit_dir / "config.json").exists():
        note(f"writing the constructed early-exit checkpoint {exit_dir}")
        exit_dir = write_exit_checkpoint(
            exit_dir, layers=SHAPE.layers, hidden=SHAPE.hidden, intermediate=SHAPE.intermediate,
            heads=SHAPE.heads, kv_heads=SHAPE.kv_heads, vocab=SHAPE.vocab,
            exit_layer=EXIT_LAYER, seed=0)
    shape = (f"{SHAPE.layers} layers, hidden {SHAPE.hidden}, intermediate {SHAPE.intermediate}, "
             f"{SHAPE.heads} heads ({SHAPE.kv_heads} K/V), vocab {SHAPE.vocab}, float32")
    return [
        Model(f"model (1): random Llama, {shape} (exits rare)", random_dir),
        Model(f"model (2): CONSTRUCTED early-exit checkpoint (bench.exit_model), {shape}, "
              f"made for confident exits after layer {EXIT_LAYER}", exit_dir),
    ]


def _prepare(root: Path, model: Model) -> tuple[Manifest, str, list[Path]]:
    manifest, dirs = shard_once(root, model.directory, PEERS)
    return manifest, budget_for(manifest, PEERS), dirs


def _measure(row: tuple[str, tuple[str, ...]], dirs: list[Path], model: Model, budget: str,
             args: argparse.Namespace) -> Row:
    label, flags = row
    extra = {i: ["--memory-budget", budget, "--model", str(model.directory), *flags]
             for i in range(PEERS)}
    note(f"row {label}: starting the cluster")
    started = time.monotonic()
    with netns.cluster(dirs, extra, dict.fromkeys(range(PEERS), args.mbit)) as (_, peers):
        head, plan = serving(peers)
        note(f"  serving after {time.monotonic() - started:.0f}s; stages (units): "
              f"{_stages(plan, peers)}; head peer{head.index}")
        stream_answer(head.state_dir, _request(WARM_UP, 4))
        answers = [stream_answer(head.state_dir, _request(p, args.tokens)) for p in PROMPTS]
    result = Row(label, answers)
    decode = result.median(_decode_ms)
    note(f"  decode {decode or float('nan'):.1f} ms/token, exit rate "
          f"{_share(result.exit_total('exited'), _generated(result))}")
    return result


def _stages(plan: dict, peers: list[netns.Peer]) -> str:
    names = {p.id: f"peer{p.index}" for p in peers}
    return " | ".join(f"{names[s['peer']]} {s['units'][0]}-{s['units'][-1]}"
                      for s in plan["stages"])


def _request(prompt: list[int], tokens: int) -> dict:
    return {"prompt_ids": prompt, "max_tokens": tokens, "temperature": 0.0}


def _decode_ms(stats: dict) -> float | None:
    tps = stats["tokens_per_second"]
    return 1e3 / tps if tps else None


def _total_ms(stats: dict) -> float | None:
    count = stats["generated_tokens"]
    return stats["total_s"] * 1e3 / count if count else None


def _generated(row: Row) -> int:
    return sum(len(t) for t in row.tokens)


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%} ({part}/{whole})" if whole else "-"


def _same(row: Row, full: Row) -> tuple[str, str]:
    """Answers equal to the full model's, and the share of positions equal."""
    equal = sum(a == b for a, b in zip(row.tokens, full.tokens, strict=True))
    positions = sum(max(len(a), len(b)) for a, b in zip(row.tokens, full.tokens, strict=True))
    agree = sum(x == y for a, b in zip(row.tokens, full.tokens, strict=True)
                for x, y in zip(a, b, strict=False))
    return f"{equal}/{len(row.tokens)}", f"{agree / positions:.0%}" if positions else "-"


def _speculation(row: Row) -> tuple[str, str]:
    drafted, accepted, checks = (row.exit_total(k) for k in ("drafted", "accepted", "checks"))
    if not checks:
        return "-", "-"
    return f"{accepted / drafted:.0%}" if drafted else "-", f"{(accepted + checks) / checks:.2f}"


def _layers(row: Row) -> str:
    layers = {a["stats"]["exit"]["layer"] for a in row.answers if a["stats"]["exit"]}
    return ",".join(map(str, sorted(layers))) or "-"


HEADER = (f"{'row':<17} {'decode':>7} {'speed':>6} {'total':>7} {'speed':>6} {'exit':>5} "
          f"{'exit rate':>14} {'agreed/checked':>15} {'same':>5} {'pos.':>5} {'accept':>6} "
          f"{'tok/check':>9}")
UNITS = (f"{'':<17} {'ms/tok':>7} {'-up':>6} {'ms/tok':>7} {'-up':>6} {'layer':>5} "
         f"{'':>14} {'(exit vs full)':>15} {'ans.':>5} {'equal':>5} {'rate':>6} {'':>9}")


def _table(model: Model, manifest: Manifest, budget: str, rows: list[Row],
           load_before: str) -> None:
    full = rows[0]
    full_decode, full_total = full.median(_decode_ms), full.median(_total_ms)
    print(f"\n{model.label}\n  {len(manifest.units)} units; --memory-budget "
          f"{int(budget) / 1e6:.0f} MB per peer; load average before {load_before}, "
          f"after {load_average()}")
    print(HEADER)
    print(UNITS)
    for row in rows:
        decode, total = row.median(_decode_ms), row.median(_total_ms)
        same, positions = _same(row, full)
        accept, per_check = _speculation(row)
        checked = row.exit_total("checked")
        agreed = _share(row.exit_total("agreed"), checked) if checked else "-"
        print(f"{row.label:<17} {_ms(decode):>7} {_ratio(full_decode, decode):>6} "
              f"{_ms(total):>7} {_ratio(full_total, total):>6} {_layers(row):>5} "
              f"{_share(row.exit_total('exited'), _generated(row)):>14} {agreed:>15} "
              f"{same:>5} {positions:>5} {accept:>6} {per_check:>9}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(full: float | None, row: float | None) -> str:
    return "-" if not full or not row else f"x{full / row:.2f}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per answer")
    parser.add_argument("--mbit", type=float, default=10.0,
                        help="each namespace's egress rate in Mbit/s (tbf)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
