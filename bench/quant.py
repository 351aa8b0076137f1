"""Quantised units against float32, measured side by side in one run: bytes, speed, agreement.

One random Llama of a small home LLM's proportions (default 24 layers, hidden 1024, vocab
32000, the shape of bench.pipeline; weights drawn like a freshly initialised model, normal
with std 0.02, by bench.llama_checkpoint) is sharded three times with the real CLI:
`--quant none`, `int8` and `int4`. Then:

1. the units' weight bytes (what the planner budgets memory by) and file bytes per quant,
   and their ratio to float32 (target for int4: <= 0.16);
2. decode tokens/s of the whole model in one process (`peerd generate --parts 1`'s path),
   the three quantisations taking turns, one answer each per round, so load from other
   processes hits all alike; the best and the median over the rounds, and the ratio to
   float32 (target for int4: >= 3);
3. resident memory of one process per quantisation holding all its units in a StageExecutor
   (bench.executor_worker, the executor's default options) while the K/V of a
   `--tokens` answer is held, against those units' weight bytes + that K/V: the ratio, and
   whether it stays within the target of + 200 MB;
4. the same over three daemons on loopback (peerd/commands/local_cluster.py, `peerd start
   --quant Q --no-rebalance`, memory budgets under which only all three together hold the
   units, so the plan has three stages), one cluster per quantisation, all up at once: decode
   tokens/s of chat answers through the local API (`--cluster-rounds` rounds, the clusters
   taking turns), and each daemon's peak RSS while they answer (psutil, every 100 ms)
   against the weight bytes of its plan's units and of the movable copies it holds beside
   them + the K/V of one whole answer on its units;
5. against float32, teacher-forced on float32's own greedy sequence of `--agreement-tokens`
   tokens: how often the quantised model's top-1 token is float32's, and the mean KL
   divergence KL(float32 || quantised) of the next-token distributions, in nats.

What random weights can and cannot show. They show that the quantised units compute the same
function as float32 up to quantisation noise: agreement far above chance (1 / vocab), int4
noisier than int8, and the size of that noise against the spread of the logits. They cannot
show how a trained model fares. Trained weights have outlier channels that a single int8
scale per tensor or one scale per 32 values handles differently from Gaussian draws, and a
trained model's next-token distribution is peaked, with large top-1 margins: a random
model's logits are nearly flat (the float32 top-2 margin is printed), so its top-1 flips at
the slightest noise, which makes the agreement here a pessimistic figure, while the KL of
two nearly flat distributions is small in absolute terms and not comparable with the
published perplexity costs of quantising real models.

`--model` measures a given checkpoint directory or GGUF file instead (its units are made from
it as `peerd shard` makes them, into a shard cache the daemons share). The model and its
units are kept under `--dir`, so a rerun with the same directory skips writing and sharding
them and the daemons' copies of them (sharding alone is about 7 minutes of a first run on
the 2-core machine; a rerun took about 4 minutes).

    .venv/bin/python -m bench.quant [--dir DIR] [--model DIR|FILE.gguf] [--tokens 64]
        [--repeats 5] [--cluster-rounds 3] [--agreement-tokens 256]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bench.executor_worker import Worker
from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from bench.memory import peak_rss
from bench.rebalance_memory import copies_by_peer
from bench.shards import onnx_runner, round_robin, shard_cache, shard_units
from bench.workdir import run_in
from peerd.commands.chat import stream_answer
from peerd.commands.generate import build_pipeline, generate
from peerd.commands.local_cluster import LocalCluster
from shards.cache import ShardResult
from shards.executor import StageExecutor
from shards.manifest import Quant
from shards.sampling import SamplingParams

PROMPT = [1, 17, 42, 99, 7, 250, 31, 64]
BYTES_TARGET, SPEED_TARGET = 0.16, 3.0  # int4 against float32
OVERHEAD_TARGET = 200e6  # bytes of RSS beyond units + K/V
PEERS = 3
MB = 1e6


def main() -> None:
    args = _parser().parse_args()
    run_in(args.dir, lambda root: _bench(root, args))


def _bench(root: Path, args: argparse.Namespace) -> None:
    model = Path(args.model) if args.model else _random_model(root, args)
    results = {quant: shard_units(model, root, quant, cached=True) for quant in Quant}
    print("the machine is shared with other work: speeds are noisy, ratios are of turns taken "
          "in the same run")
    _bytes(results)
    _speed(results, args.tokens, args.repeats)
    _one_process_memory(results, args.tokens)
    _clusters(root, model, results, args.tokens, args.cluster_rounds)
    _agreement(results, args.agreement_tokens)


def _random_model(root: Path, args: argparse.Namespace) -> Path:
    shape = shape_from(args)
    model_dir = reusable_llama(root, shape, lambda line: print(line, file=sys.stderr, flush=True))
    print(f"model: {shape}, float32, std 0.02")
    return model_dir


def _bytes(results: dict[Quant, ShardResult]) -> None:
    weights = {q: sum(u.weight_bytes for u in r.manifest.units) for q, r in results.items()}
    files = {q: sum(u.file_bytes for u in r.manifest.units) for q, r in results.items()}
    largest = {q: max(u.weight_bytes for u in r.manifest.units) for q, r in results.items()}
    print("\nunit bytes        weights   ratio      files   ratio   largest unit")
    for quant in results:
        print(f"  {quant.value:<8} {weights[quant] / 1e6:9.1f} MB  {_ratio(weights, quant)}  "
              f"{files[quant] / 1e6:9.1f} MB  {_ratio(files, quant)}  "
              f"{largest[quant] / 1e6:9.1f} MB")
    verdict = "meets" if weights[Quant.INT4] <= BYTES_TARGET * weights[Quant.NONE] else "MISSES"
    print(f"  int4 weights / float32 (target <= {BYTES_TARGET}): {verdict}")


def _ratio(values: dict[Quant, float], quant: Quant) -> str:
    return f"x{values[quant] / values[Quant.NONE]:.3f}"


def _speed(results: dict[Quant, ShardResult], tokens: int, repeats: int) -> None:
    runners = {q: onnx_runner(r, 1, PROMPT, tokens) for q, r in results.items()}
    for runner in runners.values():  # first runs allocate and fault in the weights
        runner()
    best = round_robin(runners, repeats)
    base = best[Quant.NONE]
    print(f"\ndecode, one process, {tokens} tokens, {repeats} rounds taking turns")
    for quant, run in best.items():
        print(f"  {quant.value:<8} {run['decode_tps']:7.1f} tokens/s best "
              f"(x{run['decode_tps'] / base['decode_tps']:.2f}), "
              f"{run['decode_tps_median']:7.1f} median "
              f"(x{run['decode_tps_median'] / base['decode_tps_median']:.2f})")
    ratio = best[Quant.INT4]["decode_tps_median"] / base["decode_tps_median"]
    verdict = "meets" if ratio >= SPEED_TARGET else "MISSES"
    print(f"  int4 / float32 median (target >= {SPEED_TARGET}): {ratio:.2f}, {verdict}")


def _one_process_memory(results: dict[Quant, ShardResult], tokens: int) -> None:
    print(f"\nresident memory of one process holding all units, the K/V of a {tokens}-token "
          f"answer held (target: <= units + K/V + {OVERHEAD_TARGET / MB:.0f} MB)")
    for quant, result in results.items():
        with Worker(result.directory) as worker:
            worker.answer(len(PROMPT), 2)  # first runs fault in and pre-pack
            held = worker.answer(len(PROMPT), tokens)
        _memory_line(f"{quant.value:<8}", held["rss"], worker.loaded["weight_bytes"],
                     held["kv_bytes"])


def _memory_line(label: str, rss: int, weights: int, kv: int) -> None:
    over = rss - weights - kv
    verdict = "meets" if over <= OVERHEAD_TARGET else "MISSES"
    print(f"  {label} RSS {rss / MB:7.1f} MB   units {weights / MB:7.1f} + K/V {kv / MB:5.1f} MB"
          f"   ratio x{rss / (weights + kv):.2f}   over {over / MB:+6.1f} MB: {verdict}")


def _clusters(root: Path, model: Path, results: dict[Quant, ShardResult], tokens: int,
              rounds: int) -> None:
    with contextlib.ExitStack() as stack:
        clusters = {quant: stack.enter_context(_cluster(root, model, quant, result))
                    for quant, result in results.items()}
        daemons = {quant: _daemons(cluster) for quant, cluster in clusters.items()}
        for cluster in clusters.values():  # first answers fault in and pre-pack
            stream_answer(cluster.dirs[0], {"prompt_ids": PROMPT, "max_tokens": 2})
        with peak_rss([pid for peers in daemons.values() for pid in peers.values()]) as rss:
            speeds: dict[Quant, list[float]] = {quant: [] for quant in clusters}
            for _ in range(rounds):
                for quant, cluster in clusters.items():
                    done = stream_answer(cluster.dirs[0], {"prompt_ids": PROMPT,
                                                           "max_tokens": tokens})
                    speeds[quant].append(done["stats"]["tokens_per_second"])
        _print_cluster_speed(speeds, tokens)
        context = len(PROMPT) + tokens
        print(f"\npeak RSS of each daemon while answering, against its units + the K/V of a "
              f"{context}-token context (target: <= + {OVERHEAD_TARGET / MB:.0f} MB)")
        for quant, cluster in clusters.items():
            units = _units_by_peer(cluster)
            copies = dict(zip(daemons[quant], copies_by_peer(cluster), strict=True))
            for peer, pid in daemons[quant].items():
                manifest = results[quant].manifest
                held = [manifest.units[u] for u in units.get(peer, [])]
                copied = [manifest.units[u] for u in copies.get(peer, [])]
                _memory_line(f"{quant.value:<5} {peer[:6]} units {_span(held)}"
                             f" + {len(copied)} copies", rss.peak[pid],
                             sum(u.weight_bytes for u in held + copied),
                             context * sum(u.kv_bytes_per_token for u in held))


@contextlib.contextmanager
def _cluster(root: Path, model: Path, quant: Quant, result: ShardResult) -> Iterator[LocalCluster]:
    """Three daemons serving `quant` units, with budgets that need all three to hold them."""
    cluster = LocalCluster(root / f"cluster-{quant.value}", model, peers=PEERS,
                           progress=lambda line: print(line, file=sys.stderr, flush=True),
                           extra=("--no-rebalance",), shard_cache=shard_cache(root),
                           quant=quant)
    with cluster:
        stages = _status(cluster, 0)["plan"]["stages"]
        print(f"cluster ({quant.value}): {len(stages)} stages, units "
              + ", ".join(f"{s['units'][0]}-{s['units'][-1]}" for s in stages))
        yield cluster


def _status(cluster: LocalCluster, i: int) -> dict:
    status = cluster.status(i)
    if status is None:
        raise SystemExit(f"peer {i} of the cluster does not answer")
    return status


def _daemons(cluster: LocalCluster) -> dict[str, int]:
    """Each daemon's process id, by its peer id."""
    return {_status(cluster, i)["self"]: cluster.pid(i) for i in range(cluster.count)}


def _units_by_peer(cluster: LocalCluster) -> dict[str, list[int]]:
    stages = _status(cluster, 0)["plan"]["stages"]
    return {stage["peer"]: stage["units"] for stage in stages}


def _span(units: list) -> str:
    return f"{units[0].index}-{units[-1].index}" if units else "none"


def _print_cluster_speed(speeds: dict[Quant, list[float]], tokens: int) -> None:
    base = statistics.median(speeds[Quant.NONE])
    print(f"\ndecode over {PEERS} daemons, {tokens} tokens, {len(speeds[Quant.NONE])} rounds "
          "taking turns")
    for quant, runs in speeds.items():
        median = statistics.median(runs)
        print(f"  {quant.value:<8} {max(runs):7.1f} tokens/s best, {median:7.1f} median "
              f"(x{median / base:.2f})")


def _agreement(results: dict[Quant, ShardResult], count: int) -> None:
    fp32 = results[Quant.NONE]
    reference = generate(build_pipeline(fp32.manifest, fp32.directory, 1), fp32.manifest,
                         PROMPT, count, SamplingParams(), stop_at_eos=False).token_ids
    sequence = [*PROMPT, *reference[:-1]]
    logits = {q: _teacher_forced(r, sequence)[len(PROMPT) - 1 :] for q, r in results.items()}
    base = logits[Quant.NONE]
    top2 = np.sort(base, axis=-1)[:, -2:]
    print(f"\nagreement with float32 over {count} tokens, teacher-forced on its greedy sequence"
          f" (float32 top-2 logit margin: median {np.median(top2[:, 1] - top2[:, 0]):.4f}, "
          f"logit std {base.std(axis=-1).mean():.4f})")
    for quant in (Quant.INT8, Quant.INT4):
        agree = (logits[quant].argmax(-1) == base.argmax(-1)).mean()
        print(f"  {quant.value:<8} top-1 {agree:.3f}   mean KL {_kl(base, logits[quant]):.5f} nats")


def _teacher_forced(result: ShardResult, sequence: list[int]) -> np.ndarray:
    """The logits of every position, in one prefill step over the whole sequence."""
    manifest = result.manifest
    stage = StageExecutor(manifest, result.directory, 0, len(manifest.units) - 1)
    ids = np.array([sequence])
    step = {"input_ids": ids, "position_ids": np.arange(ids.shape[1])[None]}
    return stage.step("s", step)["logits"][0].astype(np.float64)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    log_p, log_q = _log_softmax(p_logits), _log_softmax(q_logits)
    return float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--model", help="a checkpoint directory or GGUF file to measure "
                        "(default: a random Llama of the shape below)")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per answer")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (best and median)")
    parser.add_argument("--cluster-rounds", type=int, default=3,
                        help="answers per three-daemon cluster (best and median)")
    parser.add_argument("--agreement-tokens", type=int, default=256)
    add_shape_arguments(parser)
    return parser


if __name__ == "__main__":
    main()
