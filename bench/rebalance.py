"""Live rebalancing under real competing load: three peers on this machine, one of them
sharing its core with a busy process started after generation begins.

Peers 0 and 1 are pinned to core 0, peer 2 to core 1; any two of them can hold the model.
A client asks for answers back to back and timestamps every token. After a baseline, a busy
process pinned to core 1 starts. The run is made twice: with `--no-rebalance` (the plan
stays, peer 2's stage runs at about half speed) and with rebalancing on (the leader moves
the work off peer 2). Printed: tokens/s before the load, under load without and with
rebalancing, their ratio (target >= 1.25), seconds from load onset to the new plan taking
effect on the head (target <= 10 s), the longest pause in the token stream around the
transition (target <= 1 s), and how many answers crossed the change with their K/V moved
rather than re-prefilled. Before the load starts, each run waits up to 30 s for a plan that
gives peer 2 work (without it the load has nothing to move; the output says so).

    python -m bench.rebalance [--layers 8 --hidden 512] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.llama_checkpoint import LlamaShape, write_llama
from peerd.client import call, chat_events
from peerd.local_cluster import LocalCluster

PINS = [[0], [0], [1]]
LOADED_CORE = 1
LOADED_PEER = "peer2"  # the peer pinned to LOADED_CORE
PROMPT = [1, 5, 9, 2, 7]
ANSWER_TOKENS = 48


@dataclass
class TokenLog:
    """Every token's arrival time, from answers asked back to back."""

    times: list[float] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)  # (resumed, kv_moved) per answer
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, state_dir: Path) -> None:
        while not self.stop.is_set():
            request = {"prompt_ids": PROMPT, "max_tokens": ANSWER_TOKENS}
            for event in chat_events(state_dir, request, timeout=120):
                if event.get("event") == "token":
                    self.times.append(time.monotonic())
                elif event.get("event") == "done":
                    stats = event["stats"]
                    self.moves.append((stats["resumed"], stats["kv_moved"]))

    def rate(self, start: float, end: float) -> float:
        """Decode tokens/s between two instants."""
        return sum(start <= t < end for t in self.times) / (end - start)

    def longest_gap(self, start: float, end: float) -> float:
        inside = [t for t in self.times if start <= t <= end]
        return max((b - a for a, b in zip(inside, inside[1:], strict=False)), default=0.0)


def _busy_on(core: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, [core]))


def _head_plan(cluster: LocalCluster) -> str | None:
    status = cluster.status(0) or {}
    return status.get("dataplane", {}).get("plan")


def _wait(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return value


def run(root: Path, model_dir: Path, rebalance: bool, baseline_s: float, loaded_s: float):
    extra = () if rebalance else ("--no-rebalance",)
    with LocalCluster(root, model_dir, holders=2, cpus=PINS, extra=extra,
                      progress=lambda line: print(line, file=sys.stderr)) as cluster:
        plan = _wait(lambda: _head_plan(cluster), 60)
        names = {p["id"]: p["name"] for p in cluster.status(0)["peers"]}
        if _wait(lambda: LOADED_PEER in _stages(cluster, names), 30):
            plan = _head_plan(cluster)
        before = _stages(cluster, names)
        log = TokenLog()
        client = threading.Thread(target=log.run, args=(cluster.dirs[0],), daemon=True)
        client.start()
        _wait(lambda: len(log.times) > ANSWER_TOKENS, 120)
        started = time.monotonic()
        time.sleep(baseline_s)
        loaded_at = time.monotonic()
        busy = _busy_on(LOADED_CORE)
        try:
            moved = _wait(lambda: _head_plan(cluster) not in (plan, None), 30 if rebalance else 0)
            effect_s = time.monotonic() - loaded_at if moved else None
            settled = time.monotonic()
            time.sleep(loaded_s)
            end = time.monotonic()
        finally:
            busy.kill()
            log.stop.set()
        after = _stages(cluster, names)
        client.join(60)
    return {
        "before": log.rate(started, loaded_at),
        "under_load": log.rate(settled, end),
        "effect_s": effect_s,
        "pause_s": log.longest_gap(loaded_at, settled + 2.0),
        "plans": (before, after),
        "moves": [m for m in log.moves if m[0]],
    }


def _stages(cluster: LocalCluster, names: dict[str, str]) -> str:
    stages = call(cluster.dirs[0], {"op": "status"})["status"]["plan"]["stages"]
    return ", ".join(f"{names[s['peer']]} {s['units'][0]}-{s['units'][-1]}" for s in stages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds before the load")
    parser.add_argument("--loaded", type=float, default=15.0, help="seconds measured under load")
    parser.add_argument("--dir", help="keep the model and state here (reruns reuse shards)")
    args = parser.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        print("needs two cores", file=sys.stderr)
        return 1
    root = Path(args.dir or tempfile.mkdtemp(prefix="peerd-rebalance-"))
    shape = LlamaShape(args.layers, args.hidden, args.hidden * 11 // 4, args.hidden // 64,
                       args.hidden // 64)
    model_dir = root / f"llama-{args.layers}x{args.hidden}"
    if not (model_dir / "config.json").is_file():
        write_llama(model_dir, shape)
    print(f"model: random Llama, {args.layers} layers, hidden {args.hidden}; peers pinned "
          f"to cores {PINS}; busy process on core {LOADED_CORE}")
    without = run(root / "fixed", model_dir, False, args.baseline, args.loaded)
    with_ = run(root / "live", model_dir, True, args.baseline, args.loaded)
    print(f"fixed plan:                    {without['plans'][0]}")
    print(f"live plan before / after load: {with_['plans'][0]} / {with_['plans'][1]}")
    if LOADED_PEER not in with_["plans"][0]:
        print(f"note: {LOADED_PEER} held no units before the load (its core was busy with "
              "other work when measured), so the load had nothing to move")
    print(f"tokens/s before the load:      {with_['before']:.1f} "
          f"(fixed-plan run: {without['before']:.1f})")
    print(f"tokens/s under load, fixed:    {without['under_load']:.1f}")
    print(f"tokens/s under load, rebalanced: {with_['under_load']:.1f}")
    print(f"ratio rebalanced / fixed:      {with_['under_load'] / without['under_load']:.2f}"
          "  (target >= 1.25)")
    effect = with_["effect_s"]
    print(f"load onset -> new plan on the head: "
          f"{'never' if effect is None else f'{effect:.1f} s'}  (target <= 10 s)")
    print(f"longest pause in the token stream: {with_['pause_s']:.2f} s  (target <= 1 s)")
    moves = with_["moves"]
    print(f"answers that crossed a plan change: {len(moves)}; moves that took the K/V along: "
          f"{sum(kv for _, kv in moves)} of {sum(resumed for resumed, _ in moves)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
