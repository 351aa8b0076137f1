"""Live rebalancing under real competing load: three peers on this machine, one of them
sharing its core with a busy process started while generation runs.

A small device and two big ones: peer 0 (the model peer) has memory for 35% of the model,
peers 1 and 2 for 71% each. A client asks for answers back to back (one at a time) and
timestamps every token; the cluster plans for that (`--objective latency`: each token's
time through every stage), which puts most of the model on one big peer. That peer is then
pinned alone to core 1, the other two to core 0 (with one answer at a time they never
compute at once). One cluster, one plan to start from, three phases:

1. baseline, no load;
2. a busy process pinned to core 1 (`--busy N`: N of them), rebalancing switched off on
   every peer (the local API's `rebalance` op): the plan stays and the loaded peer's stage
   runs at about half speed;
3. the load removed, rebalancing on again, then the busy process again: the leader moves
   the work to the other big peer.

Both loaded phases start from the same plan, so their ratio measures the rebalancing alone;
each is measured from 2 s after its change (the busy process starting; the new plan taking
effect, whose cost the pause figure reports).
Printed: tokens/s before the load, under load without and with rebalancing, their ratio
(target >= 1.25), seconds from load onset to the new plan taking effect on the head (target
<= 10 s), the longest pause in the token stream around the transition (target <= 1 s), and
how many answers crossed the change with their K/V moved rather than re-prefilled.

    python -m bench.rebalance [--layers 16 --hidden 512] [--busy 1] [--dir DIR]
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
from peerd.commands.client import call, chat_events
from peerd.commands.local_cluster import LocalCluster

START_PINS = [[0], [0], [1]]  # until the first plan says which peer to put on LOADED_CORE
SHARES = [0.35, 0.71, 0.71]  # of the model's memory need, per peer
LOADED_CORE = 1
PROMPT = [1, 5, 9, 2, 7]
# A loaded phase is measured from this long after its change: the busy process starting,
# or the new plan taking effect (the transition itself is what the pause figure reports).
SETTLE_S = 2.0
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


class Load:
    """`count` busy processes pinned to `core` while started."""

    def __init__(self, core: int, count: int) -> None:
        self.core, self.count = core, count
        self.processes: list[subprocess.Popen] = []

    def start(self) -> None:
        self.processes = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda: os.sched_setaffinity(0, [self.core]))
            for _ in range(self.count)
        ]

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
        self.processes = []


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


def _set_rebalance(cluster: LocalCluster, enabled: bool) -> None:
    for state_dir in cluster.dirs:
        call(state_dir, {"op": "rebalance", "enabled": enabled})


def _load_of(cluster: LocalCluster, peer: str) -> float:
    status = cluster.status(0) or {"peers": []}
    return next((p["load"] or 0.0 for p in status["peers"] if p["name"] == peer), 1.0)


def run(root: Path, model_dir: Path, baseline_s: float, loaded_s: float, busy: int) -> dict:
    with LocalCluster(root, model_dir, shares=SHARES, cpus=START_PINS,
                      extra=["--objective", "latency"],
                      progress=lambda line: print(line, file=sys.stderr)) as cluster:
        loaded = _isolate_the_bulk_holder(cluster)
        plan, start = _head_plan(cluster), _stages(cluster)
        log = TokenLog()
        client = threading.Thread(target=log.run, args=(cluster.dirs[0],), daemon=True)
        client.start()
        _wait(lambda: len(log.times) > ANSWER_TOKENS, 120)
        load = Load(LOADED_CORE, busy)
        try:
            before = _phase(log, baseline_s)
            _set_rebalance(cluster, False)
            load.start()
            time.sleep(SETTLE_S)
            fixed = _phase(log, loaded_s)
            load.stop()
            held = _head_plan(cluster) == plan
            _wait(lambda: _load_of(cluster, loaded) < 0.2, 30)
            _set_rebalance(cluster, True)
            unmoved = _head_plan(cluster) == plan
            loaded_at = time.monotonic()
            load.start()
            moved = _wait(lambda: _head_plan(cluster) not in (plan, None), 30)
            effect_s = time.monotonic() - loaded_at if moved else None
            settled = time.monotonic()
            time.sleep(SETTLE_S)
            rebalanced = _phase(log, loaded_s)
        finally:
            load.stop()
            log.stop.set()
        after = _stages(cluster)
        client.join(60)
    return {
        "loaded": loaded, "before": before, "fixed": fixed, "rebalanced": rebalanced,
        "effect_s": effect_s, "pause_s": log.longest_gap(loaded_at, settled + SETTLE_S),
        "plans": (start, after), "held": held and unmoved,
        "moves": [m for m in log.moves if m[0]],
    }


def _isolate_the_bulk_holder(cluster: LocalCluster) -> str:
    """Pin the peer computing most of each token alone on LOADED_CORE, the others on the
    other core; its name. Not the model peer (the first stage): it keeps unit 0 whatever
    its load."""
    units = cluster.manifest.units
    stages = _plan(cluster)["stages"]
    bulk = max(stages[1:] or stages, key=lambda stage: sum(
        units[u].flops_per_token.decode for u in stage["units"]))["peer"]
    index = _peer_ids(cluster).index(bulk)
    for i in range(cluster.count):
        cluster.pin(i, [LOADED_CORE] if i == index else [1 - LOADED_CORE])
    return f"peer{index}"


def _phase(log: TokenLog, seconds: float) -> float:
    """Decode tokens/s over the next `seconds`."""
    start = time.monotonic()
    time.sleep(seconds)
    return log.rate(start, time.monotonic())


def _plan(cluster: LocalCluster) -> dict:
    return cluster.status(0)["plan"]


def _peer_ids(cluster: LocalCluster) -> list[str]:
    """Peer i's id, by i."""
    return [cluster.status(i)["self"] for i in range(cluster.count)]


def _stages(cluster: LocalCluster) -> str:
    ids = _peer_ids(cluster)
    return ", ".join(f"peer{ids.index(s['peer'])} {s['units'][0]}-{s['units'][-1]}"
                     for s in _plan(cluster)["stages"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 16 layers: the vocabulary head is one unit costing about five layers of hidden 512,
    # and with fewer layers it, not the layers, decides how the plan splits the model
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds before the load")
    parser.add_argument("--loaded", type=float, default=15.0,
                        help="seconds measured in each loaded phase")
    parser.add_argument("--busy", type=int, default=1,
                        help="busy processes on the loaded core (default 1: the stage there "
                        "runs at about half speed; 2: about a third)")
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
    print(f"model: random Llama, {args.layers} layers, hidden {args.hidden}; peers with "
          f"memory for {SHARES} of it; plans for latency; {args.busy} busy process(es)")
    result = run(root / "cluster", model_dir, args.baseline, args.loaded, args.busy)
    print(f"loaded: {result['loaded']}, alone on core {LOADED_CORE}; the others on core "
          f"{1 - LOADED_CORE}")
    print(f"plan before / after the load:  {result['plans'][0]} / {result['plans'][1]}")
    if not result["held"]:
        print("note: the plan changed before the rebalanced phase began; the phases did not "
              "start from the same plan")
    print(f"tokens/s before the load:      {result['before']:.1f}")
    print(f"tokens/s under load, fixed:    {result['fixed']:.1f}")
    print(f"tokens/s under load, rebalanced: {result['rebalanced']:.1f}")
    print(f"ratio rebalanced / fixed:      {result['rebalanced'] / result['fixed']:.2f}"
          "  (target >= 1.25)")
    effect = result["effect_s"]
    print(f"load onset -> new plan on the head: "
          f"{'never' if effect is None else f'{effect:.1f} s'}  (target <= 10 s)")
    print(f"longest pause in the token stream: {result['pause_s']:.2f} s  (target <= 1 s)")
    moves = result["moves"]
    print(f"answers that crossed a plan change: {len(moves)}; moves that took the K/V along: "
          f"{sum(kv for _, kv in moves)} of {sum(resumed for resumed, _ in moves)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
