"""The planner's prediction against what answers measure, on a three-peer loopback cluster.

Three real daemons serve the built-in model, as `peerd demo` starts them
(peerd/commands/local_cluster.py). Answers are asked one at a time on the head until a whole
round of them ran on one plan (a rebalance may move work once the units' measured times
reach the leader). Then the head's `peerd status --json` gives, for that plan:

  * `plan.predicted_at_planning`: the prediction the plan was made with;
  * `plan.predicted`: the same plan priced with the units' measured times (issue 23);
  * `plan.measured`: the head's own measurement of its answers.

Also timed at the client, as a cross-check: the median time between two streamed tokens.
Printed: each figure, and predicted / measured per-token latency of a single answer
(target: within +-30%, i.e. a ratio in 0.7..1.3).

    nice python -m bench.calibration [--answers 6] [--tokens 64] [--rounds 6] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from peerd.commands.client import call, chat_events
from peerd.commands.local_cluster import LocalCluster
from shards.builtin import write_builtin_model

PROMPT = [1, 5, 9, 2, 7]
TARGET = 0.30
REPORT_WAIT_S = 3.0  # a measurement round (every second) carries fresh unit times


def answer_intervals(state_dir: Path, tokens: int) -> list[float]:
    """Seconds between consecutive tokens of one answer, as the client receives them."""
    times = []
    request = {"prompt_ids": PROMPT, "max_tokens": tokens}
    for event in chat_events(state_dir, request, timeout=120):
        if event.get("event") == "token":
            times.append(time.monotonic())
        elif event.get("ok") is False:
            raise SystemExit(f"answer failed: {event.get('error')}")
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def plan_of(state_dir: Path) -> dict:
    return call(state_dir, {"op": "status"})["status"]["plan"]


def measure(cluster: LocalCluster, answers: int, tokens: int, rounds: int) -> tuple[dict, list]:
    """The head's plan document after a round of answers that all ran on one plan."""
    head = cluster.dirs[0]
    for attempt in range(1, rounds + 1):
        before = plan_of(head)["id"]
        intervals = [gap for _ in range(answers) for gap in answer_intervals(head, tokens)]
        time.sleep(REPORT_WAIT_S)
        plan = plan_of(head)
        if plan["id"] == before:
            return plan, intervals
        print(f"round {attempt}: the plan changed ({before} -> {plan['id']}: "
              "rebalanced on measured times); measuring again", file=sys.stderr)
    raise SystemExit(f"the plan did not settle within {rounds} rounds")


def describe(plan: dict, names: dict[str, str]) -> str:
    return ", ".join(f"{names.get(s['peer'], s['peer'])} {s['units'][0]}-{s['units'][-1]}"
                     for s in plan["stages"])


def report(plan: dict, intervals: list[float], names: dict[str, str]) -> None:
    planned, predicted, measured = (plan["predicted_at_planning"], plan["predicted"],
                                    plan["measured"])
    client = statistics.median(intervals)
    print(f"plan {plan['id']} ({plan['objective']}, {plan['solver']}): {describe(plan, names)}")
    rows = [("predicted when planned", planned), ("predicted, measured prices", predicted),
            ("measured by the head", measured)]
    for label, figures in rows:
        print(f"  {label:28s} {figures['latency_s'] * 1000:8.2f} ms per token  "
              f"{figures['throughput_tps']:9.1f} tokens/s")
    print(f"  {'measured at the client':28s} {client * 1000:8.2f} ms per token  "
          f"(median of {len(intervals)} intervals)")
    ratio = predicted["latency_s"] / measured["latency_s"]
    print(f"per-token latency, predicted / measured: {ratio:.2f} "
          f"(when planned: {planned['latency_s'] / measured['latency_s']:.3f}; "
          f"against the client: {predicted['latency_s'] / client:.2f}); "
          f"target {1 - TARGET:.1f}..{1 + TARGET:.1f}: "
          f"{'meets' if abs(ratio - 1) <= TARGET else 'misses'}")


def unit_times(cluster: LocalCluster, names: dict[str, str]) -> None:
    for peer in call(cluster.dirs[0], {"op": "status"})["status"]["peers"]:
        times = {int(u): s for u, s in peer["unit_s"].items()}
        shown = " ".join(f"{u}:{times[u] * 1e3:.2f}" for u in sorted(times))
        overhead = peer["stage_overhead_s"]
        links = " ".join(f"{names[link['target']]}:{link['latency_s'] * 1e3:.2f}"
                         for link in peer["links"])
        print(f"  {names[peer['id']]:6s} {peer['flops'] / 1e9:6.1f} GFLOP/s   units "
              f"{sum(times.values()) * 1e3:5.2f} ms + overhead "
              f"{'-' if overhead is None else f'{overhead * 1e3:.2f}'} ms   "
              f"link latency ms {links}")
        print(f"         ms per unit: {shown or '-'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=6, help="answers per round")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--rounds", type=int, default=6, help="rounds to wait for a plan")
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="peerd-calibration-"))
    try:
        model_dir = write_builtin_model(root / "builtin-model")
        with LocalCluster(root, model_dir, peers=3,
                          progress=lambda line: print(line, file=sys.stderr)) as cluster:
            status = call(cluster.dirs[0], {"op": "status"})["status"]
            names = {p["id"]: p["name"] for p in status["peers"]}
            plan, intervals = measure(cluster, args.answers, args.tokens, args.rounds)
            report(plan, intervals, names)
            print("measured unit times (as the leader's report has them):")
            unit_times(cluster, names)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
