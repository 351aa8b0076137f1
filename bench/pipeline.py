"""What the network path costs, measured side by side in one run on this machine.

1. Decode tokens/s of the built-in model run whole in one process (`peerd generate
   --parts 1` path) and split over three real daemons on loopback (separate processes,
   CURVE-encrypted ZeroMQ, chat through the local socket), and their ratio (target >= 0.9).
2. Aggregate tokens/s with 1, 2, 4 and 8 sequences in flight at once.
3. What direct residual messages save over piggybacking them along the ring: the bytes the
   stages in between would have relayed, and the time per token those relays would cost on
   the measured links (LinguaLinked: 0.011 s residual hop vs 0.25 s relayed).

Note: the three daemons share this machine's cores, so the split figure is pessimistic.

    .venv/bin/python -m bench.pipeline [--tokens 64] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from peerd.chat import stream_answer
from peerd.generate import build_pipeline, generate
from peerd.local_cluster import LocalCluster
from shards.builtin import write_builtin_model
from shards.sampling import SamplingParams

PROMPT = [1, 17, 42, 99, 7, 250, 31, 64]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per answer")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--dir", help="working directory (default: a temporary one)")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="peerd-bench-"))
    model_dir = write_builtin_model(root / "builtin-model")
    with LocalCluster(root, model_dir, peers=3, progress=lambda line: None) as cluster:
        shard_dir = cluster.dirs[0] / "shards" / cluster.manifest.key
        whole = _median(args.repeats, lambda: _whole(cluster.manifest, shard_dir, args.tokens))
        split = _median(args.repeats, lambda: _split(cluster.dirs[0], args.tokens))
        print("decode tokens/s (built-in model, 8 layers, hidden 256)")
        print(f"  whole, one process      {whole:9.1f}")
        print(f"  split over 3 daemons    {split:9.1f}")
        print(f"  ratio split / whole     {split / whole:9.2f}   (target >= 0.9)")
        print("\naggregate tokens/s with N sequences in flight (3 daemons)")
        for count in (1, 2, 4, 8):
            print(f"  N={count}  {_concurrent(cluster.dirs, count, args.tokens):9.1f}")
        _residuals(cluster)


def _median(repeats: int, measure) -> float:
    return statistics.median(measure() for _ in range(repeats))


def _whole(manifest, shard_dir: Path, tokens: int) -> float:
    pipeline = build_pipeline(manifest, shard_dir, 1)
    run = generate(pipeline, manifest, PROMPT, tokens, SamplingParams(), stop_at_eos=False)
    return run.stats["decode_tokens_per_second"]


def _split(state_dir: Path, tokens: int) -> float:
    done = stream_answer(state_dir, {"prompt_ids": PROMPT, "max_tokens": tokens})
    return done["stats"]["tokens_per_second"]


def _concurrent(dirs: list[Path], count: int, tokens: int) -> float:
    produced = []

    def ask(i: int) -> None:
        prompt = [*PROMPT[: 3 + i % 5], i + 2]
        done = stream_answer(dirs[i % len(dirs)], {"prompt_ids": prompt, "max_tokens": tokens})
        produced.append(len(done["token_ids"]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(produced) / (time.perf_counter() - started)


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


if __name__ == "__main__":
    main()
