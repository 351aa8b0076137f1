"""What the network path costs, measured side by side in one run on this machine.

1. Decode tokens/s of one model run whole in one process (the `peerd generate --parts 1`
   path, with its options: the process-wide thread pool, the units joined) and split over
   three real daemons on loopback (separate `peerd start` processes, CURVE-encrypted
   ZeroMQ, chat through the local socket), and their ratio (target >= 0.95).
   The two alternate, one answer each per round, so load from other processes on the
   machine hits both alike; the figures are medians over the rounds. The split's time per
   token is divided into the stages' compute (each stage's own figures for the answer,
   with the prefill step taken out by a one-token answer) and the rest: hops and hand-offs.
2. Aggregate tokens/s with 1, 2, 4 and 8 answers in flight at once, over the three daemons
   and whole in one process, and each against one in flight (targets: x2.5 with 4 and x3.5
   with 8). Each answer has a prompt of its own length, prefill included in the time.
3. A chat of five turns over the daemons, each turn sending the whole conversation again
   (a 300-token first message, 100-token answers, 200-token messages: 1,500 tokens of
   history by the 5th turn): each turn's time to first token and the prompt tokens it
   reused from the turn before, the 5th turn's against the 1st (target <= 1.2), and a
   1,500-token prompt with nothing to reuse beside them.
4. What direct residual messages save over piggybacking them along the ring: the bytes the
   stages in between would have relayed, and the time per token those relays would cost on
   the measured links (LinguaLinked: 0.011 s residual hop vs 0.25 s relayed).

The model is a random Llama of a small home LLM's proportions (default 24 layers, hidden
1024, vocab 32000: 1.3 GB of float32 weights, tens of ms per decoded token on a 2-core CPU);
`--small` runs the built-in 8-layer, hidden-256 model instead, whose ~2.5 ms per token
magnifies the per-hop overhead. The model and its units are kept under `--dir`, so a rerun
with the same directory skips writing and sharding them. The daemons run with
`--no-rebalance`: the whole-model rounds load the same cores, and a plan change in the
middle of a measurement would measure the change instead.

    .venv/bin/python -m bench.pipeline [--tokens 64] [--repeats 5] [--dir DIR] [--small]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from bench.workdir import run_in
from peerd.commands.chat import stream_answer
from peerd.commands.generate import GENERATE_OPTIONS, build_pipeline, generate
from peerd.commands.local_cluster import LocalCluster
from peerd.inference.local_pipeline import LocalPipeline
from peerd.inference.pipeline import Generation, TokenSampler
from shards.builtin import write_builtin_model
from shards.manifest import Manifest
from shards.sampling import SamplingParams

PROMPT = [1, 17, 42, 99, 7, 250, 31, 64]
TARGET = 0.95
IN_FLIGHT = {1: None, 2: None, 4: 2.5, 8: 3.5}  # answers at once: target against one
CHAT_TURNS = [(300, 100), (200, 100), (200, 100), (200, 100), (200, 1)]  # (said, answered)
TURN_TARGET = 1.2
PEERS = 3


@dataclass
class Round:
    whole_tps: float
    split_tps: float
    stage_compute_s: float | None  # per decode step, summed over the stages


def main() -> None:
    args = _parser().parse_args()
    run_in(args.dir, lambda root: _bench(root, args))


def _bench(root: Path, args: argparse.Namespace) -> None:
    model_dir, label = _model(root, args)
    started = time.monotonic()
    with LocalCluster(root, model_dir, peers=PEERS, progress=_note,
                      extra=("--no-rebalance",)) as cluster:
        _note(f"cluster ready after {time.monotonic() - started:.0f}s; measuring")
        weights = _weights_mb(cluster.manifest)
        print(f"model: {label}; {weights:.0f} MB of weights ({weights / 4:.0f} M parameters) "
              f"in {len(cluster.manifest.units)} units")
        print(f"plan: {_plan(cluster)}")
        print(f"load average before: {_load()}")
        whole = _whole_vs_split(cluster, args.tokens, args.repeats)
        _in_flight(cluster, whole, args.tokens)
        _chat_turns(cluster.dirs[0])
        _residuals(cluster)
        print(f"\nload average after: {_load()}")


def _whole_vs_split(cluster: LocalCluster, tokens: int, repeats: int) -> LocalPipeline:
    manifest, head_dir = cluster.manifest, cluster.dirs[0]
    whole = build_pipeline(manifest, head_dir / "shards" / manifest.key, 1,
                           options=GENERATE_OPTIONS)
    _warm_up(whole, manifest, head_dir)
    _print_ratio([_round(whole, manifest, head_dir, tokens) for _ in range(repeats)], tokens)
    return whole


def _in_flight(cluster: LocalCluster, whole: LocalPipeline, tokens: int) -> None:
    print(f"\naggregate tokens/s with N answers in flight, {tokens} tokens each "
          f"(x: against N=1)")
    print("         3 daemons            whole, one process")
    split_one = whole_one = 0.0
    for count in IN_FLIGHT:
        split = _concurrent(cluster.dirs, count, tokens)
        alone = _whole_concurrent(whole, count, tokens)
        split_one, whole_one = split_one or split, whole_one or alone
        target = f"   (target x{IN_FLIGHT[count]})" if IN_FLIGHT[count] else ""
        print(f"  N={count}  {split:9.1f} x{split / split_one:4.2f}      "
              f"{alone:9.1f} x{alone / whole_one:4.2f}{target}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per answer")
    parser.add_argument("--repeats", type=int, default=5, help="whole/split rounds (median)")
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--small", action="store_true",
                        help="the built-in 8-layer, hidden-256 model instead")
    add_shape_arguments(parser)
    return parser


def _model(root: Path, args: argparse.Namespace) -> tuple[Path, str]:
    if args.small:
        return write_builtin_model(root / "builtin-model"), "built-in, 8 layers, hidden 256"
    shape = shape_from(args)
    model_dir = reusable_llama(root, shape, _note)
    return model_dir, (f"random Llama, {shape.layers} layers, hidden {shape.hidden}, "
                       f"intermediate {shape.intermediate}, {shape.heads} heads "
                       f"({shape.kv_heads} K/V), vocab {shape.vocab}, float32")


def _weights_mb(manifest: Manifest) -> float:
    return sum(unit.weight_bytes for unit in manifest.units) / 1e6


def _plan(cluster: LocalCluster) -> str:
    stages = cluster.status(0)["plan"]["stages"]
    return ", ".join(f"units {s['units'][0]}-{s['units'][-1]}" for s in stages)


def _warm_up(whole: LocalPipeline, manifest: Manifest, head_dir: Path) -> None:
    """One short answer each way: first runs allocate and fault in the weights."""
    generate(whole, manifest, PROMPT, 4, SamplingParams(), stop_at_eos=False)
    stream_answer(head_dir, {"prompt_ids": PROMPT, "max_tokens": 4})


def _round(whole: LocalPipeline, manifest: Manifest, head_dir: Path, tokens: int) -> Round:
    run = generate(whole, manifest, PROMPT, tokens, SamplingParams(), stop_at_eos=False)
    done = _ask(head_dir, tokens)
    prefill = _ask(head_dir, 1)  # the prefill step alone, to take out of the stages' compute
    return Round(run.stats["decode_tokens_per_second"], done["tokens_per_second"],
                 _decode_compute_s(done["stages"], prefill["stages"]))


def _ask(head_dir: Path, tokens: int) -> dict:
    return stream_answer(head_dir, {"prompt_ids": PROMPT, "max_tokens": tokens})["stats"]


def _decode_compute_s(answer: list[dict], prefill: list[dict]) -> float | None:
    """Seconds of compute per decode step, summed over the stages; None when a stage did
    not report its costs."""
    by_stage = {s["stage"]: s for s in prefill}
    if {s["stage"] for s in answer} != set(by_stage) or len(by_stage) < PEERS:
        return None
    return sum((s["compute_s"] - by_stage[s["stage"]]["compute_s"]) / (s["steps"] - 1)
               for s in answer)


def _print_ratio(rounds: list[Round], tokens: int) -> None:
    whole = 1e3 / statistics.median(r.whole_tps for r in rounds)
    split = 1e3 / statistics.median(r.split_tps for r in rounds)
    measured = [(r.split_tps, r.stage_compute_s) for r in rounds
                if r.stage_compute_s is not None]
    print(f"\ndecode, {tokens} tokens per answer, median of {len(rounds)} alternating rounds")
    print(f"  whole, one process      {1e3 / whole:9.1f} tokens/s  {whole:7.2f} ms/token")
    print(f"  split over 3 daemons    {1e3 / split:9.1f} tokens/s  {split:7.2f} ms/token")
    if measured:  # each round's compute against its own split time: the pace moves between rounds
        compute = statistics.median(c for _, c in measured) * 1e3
        rest = statistics.median(1e3 / tps - c * 1e3 for tps, c in measured)
        print(f"    stages computing                         {compute:7.2f} ms/token "
              f"({compute - whole:+.2f} against whole)")
        print(f"    hops and hand-offs                       {rest:7.2f} ms/token")
    print(f"  network path cost                          {split - whole:7.2f} ms/token")
    verdict = "meets" if whole / split >= TARGET else "MISSES"
    print(f"  ratio split / whole     {whole / split:9.2f}   (target >= {TARGET}: {verdict})")
    print("  rounds (whole / split tokens/s): "
          + ", ".join(f"{r.whole_tps:.1f}/{r.split_tps:.1f}" for r in rounds))


def _prompt(i: int) -> list[int]:
    return [*PROMPT[: 3 + i % 5], i + 2]


def _whole_concurrent(whole: LocalPipeline, count: int, tokens: int) -> float:
    whole.sampler = TokenSampler()
    answers = [Generation(f"in-flight-{i}", _prompt(i), tokens, frozenset())
               for i in range(count)]
    started = time.perf_counter()
    whole.generate((answer, SamplingParams()) for answer in answers)
    return sum(len(a.tokens) for a in answers) / (time.perf_counter() - started)


def _concurrent(dirs: list[Path], count: int, tokens: int) -> float:
    produced = []

    def ask(i: int) -> None:
        prompt = _prompt(i)
        done = stream_answer(dirs[i % len(dirs)], {"prompt_ids": prompt, "max_tokens": tokens})
        produced.append(len(done["token_ids"]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(produced) / (time.perf_counter() - started)


def _chat_turns(head_dir: Path) -> None:
    rng = random.Random(5)

    def message(length: int) -> list[int]:
        return [rng.randrange(3, 30000) for _ in range(length)]

    print(f"\na chat of {len(CHAT_TURNS)} turns, the whole conversation sent each turn")
    conversation: list[int] = []
    firsts = []
    for turn, (said, answer) in enumerate(CHAT_TURNS, 1):
        conversation += message(said)
        done = stream_answer(head_dir, {"prompt_ids": conversation, "max_tokens": answer})
        stats = done["stats"]
        firsts.append(stats["time_to_first_token_s"])
        print(f"  turn {turn}: {stats['prompt_tokens']:5d} prompt tokens, "
              f"{stats['reused_prompt_tokens']:5d} reused, first token after "
              f"{firsts[-1] * 1e3:7.1f} ms")
        conversation += done["token_ids"]
    alone = stream_answer(head_dir, {"prompt_ids": message(len(conversation)), "max_tokens": 1})
    print(f"  a {len(conversation)}-token prompt with nothing to reuse: first token after "
          f"{alone['stats']['time_to_first_token_s'] * 1e3:7.1f} ms")
    ratio = firsts[-1] / firsts[0]
    verdict = "meets" if ratio <= TURN_TARGET else "MISSES"
    print(f"  turn {len(firsts)} / turn 1: {ratio:.2f} (target <= {TURN_TARGET}: {verdict})")


def _residuals(cluster: LocalCluster) -> None:
    """Bytes and time of the residual messages sent, against relaying them hop by hop."""
    statuses = [cluster.status(i) for i in range(len(cluster.dirs))]
    plan = statuses[0]["plan"]["stages"]
    peer_of_stage = [stage["peer"] for stage in plan]
    links = {(s["self"], link["target"]): link for s in statuses
             for p in s["peers"] if p["id"] == s["self"] for link in p.get("links", [])}
    head = next(s for s in statuses if s["dataplane"]["stage"] == 0)["dataplane"]
    tokens = head["steps"]
    direct_bytes = relayed_bytes = direct_s = relayed_s = 0.0
    for status in statuses:
        plane = status["dataplane"]
        for target, sent in plane["residual_bytes_by_target"].items():
            source, target = plane["stage"], int(target)
            per_token = sent / tokens
            direct_bytes += per_token
            relayed_bytes += per_token * (target - source)
            direct_s += _hop_s(links, peer_of_stage[source], peer_of_stage[target], per_token)
            relayed_s += sum(
                _hop_s(links, peer_of_stage[hop], peer_of_stage[hop + 1], per_token)
                for hop in range(source, target)
            )
    print(f"\nresidual messages per token, over {tokens} steps")
    print(f"  sent directly           {direct_bytes:9.0f} bytes  {direct_s * 1e3:7.3f} ms")
    print(f"  piggybacked on the ring {relayed_bytes:9.0f} bytes  {relayed_s * 1e3:7.3f} ms")
    print(f"  saved                   {relayed_bytes - direct_bytes:9.0f} bytes  "
          f"{(relayed_s - direct_s) * 1e3:7.3f} ms  (links as measured by the leader)")


def _hop_s(links: dict, source: str, target: str, size: float) -> float:
    link = links[(source, target)]
    return link["latency_s"] + size / link["bandwidth_Bps"]


def _load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg()) + " (1, 5, 15 min)"


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
