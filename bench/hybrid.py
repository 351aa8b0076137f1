"""Galaxy's hybrid parallelism on this machine, one run: one device, a 2-stage pipeline and a
2-peer group, on a fast link and on a shaped slow one, beside what the planner predicts.

Each daemon is one "device": its own network namespace (tests/netns.py) and its own core
(started under taskset, so its calibration runs on that core too). The model: a random
Llama (bench.llama_checkpoint) of `SHAPE`, float32, sharded once under `--dir` and linked
into every peer's shard cache.
Rows, each a cluster of its own on a bridge of its own:

  one device   one daemon on core 0
  pipeline     two daemons (cores 0 and 1), each offering memory for about 60% of the
               model, so the plan has two stages
  group        two daemons, `--tensor-parallel 2`: one stage, each layer shared by both

The three clusters serve at once and are measured side by side: each prompt goes to every
row in turn, so a change in the machine's pace (it moves by a third within minutes on the
shared development machine) hits every row alike; measured one row after the other, one
device's first token read 2587 ms in one run and 1860 ms in the next. The rows not answering
idle meanwhile (about 2% of a core each). After warm-up answers (ONNX Runtime's first two
runs of a new prompt length take up to 3x as long, on shares as on whole units; the prompts
of the warm-up are others than the measured ones, so no K/V is reused): time to first token
of `--prompts` prompts of `--prompt-tokens` random token ids (median; the chat stats'
time_to_first_token_s) and decode tokens/s of answers of `--tokens` new tokens (median of
the chat stats' tokens_per_second). A row that fails is printed with the cluster's reason and
counts as the slowest.

Then the planner's choice: two daemons started with `--shapes --objective first-token`, and
again with `--objective latency`: the shape the leader deploys is its predicted winner for
that figure, printed beside the measured winner among the three rows (the planner may pick
one peer alone too). A row whose spread over the prompts (fastest to slowest) reaches into
the winner's is tied with it, and a pick among tied rows agrees: on the slow link one device
and the pipeline, the same cores, measured 2993 and 2955 ms to the first token in one run,
each inside the other's 2621-3026 and 2752-3173 ms.

Everything runs twice: on the bridge as it is, and with every namespace's egress shaped to
`--slow-mbit` (tbf), where the group's collectives (two per layer half, each the step's rows
of the hidden state) cost more than the compute they share.

Targets (issue 19, fast link): time to first token one device / group >= 1.6 and
pipeline / group >= 1.3; on the slow link the planner's predicted winner is the measured
winner.

    .venv/bin/python -m bench.hybrid [--dir DIR] [--prompt-tokens 512] [--slow-mbit 100]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.llama_checkpoint import LlamaShape, reusable_llama
from bench.namespaced import (
    linked_state_dirs,
    load_average,
    netns,
    note,
    run_bench,
    serving,
    shard_cache,
)
from peerd.commands.chat import stream_answer
from peerd.commands.local_cluster import budget_share
from peerd.errors import PeerdError
from shards.manifest import Manifest

SHAPE = LlamaShape(layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=4)
CORES = (0, 1)
WARM_UP_PROMPTS = 2


@dataclass(frozen=True)
class Row:
    label: str
    peers: int
    flags: tuple[str, ...]
    budget_share: float | None  # of the model each peer offers; None: no budget


ROWS = (
    Row("one device", 1, (), None),
    Row("pipeline", 2, (), 0.6),
    Row("group", 2, ("--tensor-parallel", "2"), None),
)
PLANNED = {"first token": ("--shapes", "--objective", "first-token"),
           "decode": ("--shapes", "--objective", "latency")}


@dataclass
class Measured:
    label: str
    shape: str
    first_token_s: float  # inf where the row could not answer
    decode_tps: float  # 0 where the row could not answer
    first_token_spread: tuple[float, float] = (math.inf, math.inf)  # fastest, slowest prompt
    decode_spread: tuple[float, float] = (0.0, 0.0)  # slowest, fastest answer
    failed: str | None = None


def main() -> int:
    args = _parser().parse_args()
    return run_bench("bench.hybrid", args.dir, lambda root: _bench(root, args))


def _bench(root: Path, args: argparse.Namespace) -> None:
    model_dir = reusable_llama(root, SHAPE, note)
    manifest, cache = shard_cache(root, model_dir)
    prompts = _prompts(args)
    print(f"hybrid parallelism: random Llama, {SHAPE.layers} layers, hidden {SHAPE.hidden}, "
          f"{SHAPE.heads} heads ({SHAPE.kv_heads} K/V), float32; each daemon pinned to its own "
          f"core; {len(prompts)} prompts of {args.prompt_tokens} tokens, answers of "
          f"{args.tokens} tokens, each asked of every row in turn; medians")
    for link, mbit in (("fast link (bridge, unshaped)", None),
                       (f"slow link ({args.slow_mbit:g} Mbit/s tbf)", args.slow_mbit)):
        note(f"== {link}")
        before = load_average()
        rows = _measure(root, cache, model_dir, manifest, mbit, prompts, args)
        planner_dirs = linked_state_dirs(root / f"{model_dir.name}-planner", cache, 2)
        predicted = {figure: _planned(flags, planner_dirs, model_dir, mbit)
                     for figure, flags in PLANNED.items()}
        _table(link, rows, predicted, before)


def _prompts(args: argparse.Namespace, seed: int = 0,
             count: int | None = None) -> list[list[int]]:
    draw = random.Random(seed)
    return [[draw.randrange(3, SHAPE.vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.prompts if count is None else count)]


@contextlib.contextmanager
def _devices(dirs: list[Path], extra: dict[int, list[str]],
             mbit: float | None) -> Iterator[list[netns.Peer]]:
    """A cluster of len(dirs) daemons, daemon i pinned to CORES[i] from its start."""
    with netns.Network(len(dirs)) as network, netns.logs_on_failure(network.peers):
        for i in range(len(dirs)):
            if mbit is not None:
                network.shape(i, mbit)
        yield [network.start_peer(i, state_dir, *extra.get(i, []), cores=str(CORES[i]))
               for i, state_dir in enumerate(dirs)]


@dataclass
class _Serving:
    """A row's cluster while it serves: its head and deployed shape, or why it failed."""

    row: Row
    head: netns.Peer | None = None
    shape: str = "none"
    failed: str | None = None
    first_token_s: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)

    def ask(self, prompt: list[int], tokens: int) -> dict | None:
        """The answer's stats, or None once the row has failed (it is asked no more)."""
        if self.head is None or self.failed:
            return None
        try:
            return stream_answer(self.head.state_dir, _request(prompt, tokens))["stats"]
        except PeerdError as exc:
            note(f"  {self.row.label} could not answer: {exc}")
            self.failed = str(exc)
            return None

    def measured(self) -> Measured:
        if self.failed or not self.first_token_s:
            return Measured(self.row.label, self.shape, math.inf, 0.0,
                            failed=self.failed or "not served")
        return Measured(self.row.label, self.shape, statistics.median(self.first_token_s),
                        statistics.median(self.decode_tps),
                        (min(self.first_token_s), max(self.first_token_s)),
                        (min(self.decode_tps, default=0.0), max(self.decode_tps, default=0.0)))


def _measure(root: Path, cache: Path, model_dir: Path, manifest: Manifest, mbit: float | None,
             prompts: list[list[int]], args: argparse.Namespace) -> list[Measured]:
    """Every row's figures, its clusters serving side by side, each prompt asked of every
    row in turn."""
    with contextlib.ExitStack() as clusters:
        rows = [_serve(clusters, root, cache, row, model_dir, manifest, mbit) for row in ROWS]
        for row in rows:
            for warm_up in _prompts(args, seed=1, count=WARM_UP_PROMPTS):
                row.ask(warm_up, 4)
        for prompt in prompts:
            answered = []
            for row in rows:
                stats = row.ask(prompt, 1)
                if stats is not None:
                    row.first_token_s.append(stats["time_to_first_token_s"])
                    answered.append(f"{row.row.label} {row.first_token_s[-1] * 1e3:.0f} ms")
            note("  first token: " + ", ".join(answered))
        for prompt in prompts:
            for row in rows:
                stats = row.ask(prompt[:32], args.tokens)
                if stats is not None:
                    row.decode_tps.append(stats["tokens_per_second"])
    measured = [row.measured() for row in rows]
    for figures in measured:
        note(f"row {figures.label}: first token {figures.first_token_s * 1e3:.0f} ms, decode "
             f"{figures.decode_tps:.1f} tokens/s")
    return measured


def _serve(clusters: contextlib.ExitStack, root: Path, cache: Path, row: Row, model_dir: Path,
           manifest: Manifest, mbit: float | None) -> _Serving:
    """The row's cluster, started in `clusters` and waited for until it serves."""
    note(f"row {row.label}: starting {row.peers} daemon(s)")
    started = time.monotonic()
    dirs = linked_state_dirs(root / f"{model_dir.name}-{row.label.replace(' ', '-')}", cache,
                             row.peers)
    budget = [] if row.budget_share is None else [
        "--memory-budget", budget_share(manifest, row.budget_share)]
    extra = {i: [*budget, *row.flags] for i in range(row.peers)}
    extra[0] += ["--model", str(model_dir)]
    peers = clusters.enter_context(_devices(dirs, extra, mbit))
    try:
        head, plan = serving(peers)
    except AssertionError as exc:  # netns.wait_for's deadline
        note(f"  not serving: {exc}")
        return _Serving(row, failed=str(exc))
    shape = _shape(plan)
    note(f"  serving after {time.monotonic() - started:.0f}s: {shape}")
    return _Serving(row, head, shape)


def _planned(flags: tuple[str, ...], dirs: list[Path], model_dir: Path,
             mbit: float | None) -> str:
    """The shape the leader deploys for two peers started with `flags`."""
    extra = {0: ["--model", str(model_dir), *flags], 1: list(flags)}
    with _devices(dirs, extra, mbit) as peers:
        _, plan = serving(peers)
    shape = _shape(plan)
    note(f"planner with {' '.join(flags)}: {shape}")
    return shape


def _shape(plan: dict) -> str:
    """The row label of a deployed plan's shape."""
    stages = plan["stages"]
    if any(len(stage.get("shares") or ()) > 1 for stage in stages):
        return "group" if len(stages) == 1 else "pipeline of groups"
    return "one device" if len(stages) == 1 else "pipeline"


def _request(prompt: list[int], tokens: int) -> dict:
    return {"prompt_ids": prompt, "max_tokens": tokens, "temperature": 0.0}


def _table(link: str, rows: list[Measured], predicted: dict[str, str], before: str) -> None:
    by = {row.label: row for row in rows}
    print(f"\n{link}; load average before {before}, after {load_average()}")
    print(f"{'row':<12} {'deployed':<12} {'first token':>12} {'decode':>10}")
    for row in rows:
        figures = (f"could not answer: {row.failed}" if row.failed else
                   f"{row.first_token_s * 1e3:>9.0f} ms {row.decode_tps:>6.1f} t/s")
        print(f"{row.label:<12} {row.shape:<12} {figures}")
    group = by["group"].first_token_s
    print(f"first token: one device / group x{by['one device'].first_token_s / group:.2f} "
          f"(target >= 1.6), pipeline / group x{by['pipeline'].first_token_s / group:.2f} "
          f"(target >= 1.3)")
    for figure, shape in predicted.items():
        winner, tied = _winners(rows, figure)
        verdict = "agree" if shape == winner else "DISAGREE"
        if shape != winner and shape in tied:
            verdict = (f"agree, a tie ({', '.join(sorted(tied))}: each within the winner's "
                       f"spread over the prompts)")
        print(f"{figure}: planner predicts {shape}, measured winner {winner}: {verdict}")


def _winners(rows: list[Measured], figure: str) -> tuple[str, set[str]]:
    """The row with the best median of `figure`, and the rows tied with it: those whose
    spread over the prompts (fastest to slowest) reaches into the winner's, a difference
    smaller than the noise between prompts."""
    if figure == "first token":
        best = min(rows, key=lambda r: r.first_token_s)
        return best.label, {r.label for r in rows
                            if r.first_token_spread[0] <= best.first_token_spread[1]}
    best = max(rows, key=lambda r: r.decode_tps)
    return best.label, {r.label for r in rows if r.decode_spread[1] >= best.decode_spread[0]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="tokens of each prompt (default 512)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per row (default 3)")
    parser.add_argument("--tokens", type=int, default=32,
                        help="new tokens of each decode answer (default 32)")
    parser.add_argument("--slow-mbit", type=float, default=100.0,
                        help="each namespace's egress in Mbit/s on the slow link (default 100)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
