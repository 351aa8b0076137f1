"""Memory through a rebalance: three daemons serving the quantised bench model, one of them
then put on battery, each daemon's resident memory sampled every 100 ms through the change.

The model (24 layers, hidden 1024 by default) is sharded at `--quant` (int4 by default) and
every peer gets a memory budget under which only all three together hold it (LocalCluster's
default share, of the quantised units). A client asks for answers back to back, so answers
cross the change and their K/V moves. Then peer 1's battery file says it is unplugged at 50%,
and peer 1 becomes a slow device: its threads are pinned to the last core, where a busy
process spins from then on. The battery penalty alone is not always worth a new plan (the
leader re-plans when one is predicted 15% faster, and on this machine that depends on the
measured speeds); with peer 1's measured unit times doubled as well it is, so the leader
moves units off it, which changes the range of every peer. Sampling runs from before the
battery change until every peer has retired the old plan's plane and 3 s more.

Printed per peer: its units before and after (with the movable copies it holds, the overlap
plan's, which count as its units), the highest RSS sampled before the battery change
(steady) and through it (max), the bound (old units + new units, their union's weights,
+ K/V + 200 MB) and pass/fail; then how much the RSS rose through the change beside
the weights of the units it gained and of its whole new stage (what loading the new stage
beside the old one adds), and the union's weights beside old + new, each counted. K/V: the
longest answer's tokens at every unit of the union, twice (while it moves the old and the new
stage both hold it).

    python -m bench.rebalance_memory [--dir DIR] [--quant int4] [--layers 24 --hidden 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from bench.memory import peak_rss
from bench.shards import shard_cache
from bench.workdir import run_in
from peerd.cluster.monitor import write_battery_file
from peerd.commands.client import chat_events
from peerd.commands.local_cluster import LocalCluster
from peerd.errors import PeerdError
from shards.manifest import Manifest, Quant

PEERS = 3
ON_BATTERY = 1  # the peer whose battery runs down
SAMPLE_S = 0.1
OVERHEAD = 200 * 2**20
PROMPT = [1, 5, 9, 2, 7]
ANSWER_TOKENS = 48
BASELINE_S = 5.0
CHANGE_S = 180.0  # the longest wait for the leader's new plan, and for the old one to retire
AFTER_S = 3.0


@dataclass
class Answers:
    """Answers asked back to back on the head until stopped; (resumed, kv_moved) of each
    answer that crossed a plan change."""

    state_dir: Path
    crossed: list[tuple[int, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        request = {"prompt_ids": PROMPT, "max_tokens": ANSWER_TOKENS}
        while not self.stop.is_set():
            try:
                for event in chat_events(self.state_dir, request, timeout=120):
                    stats = event.get("stats") or {}
                    if stats.get("resumed"):
                        self.crossed.append((stats["resumed"], stats["kv_moved"]))
            except PeerdError as exc:  # between plans: ask again
                print(f"answer failed: {exc}", file=sys.stderr)
                time.sleep(0.5)


def units_by_peer(cluster: LocalCluster) -> list[tuple[int, ...]]:
    """Each peer's units in the plan its head serves."""
    ids = [cluster.status(i)["self"] for i in range(cluster.count)]
    plan = cluster.status(0)["plan"]
    held = {s["peer"]: tuple(s["units"]) for s in plan["stages"]}
    return [held.get(peer, ()) for peer in ids]


def copies_by_peer(cluster: LocalCluster) -> list[tuple[int, ...]]:
    """The movable copies each peer holds now."""
    return [tuple(((cluster.status(i) or {}).get("deployment") or {}).get("copies", []))
            for i in range(cluster.count)]


def served_plan(cluster: LocalCluster) -> str | None:
    return ((cluster.status(0) or {}).get("dataplane") or {}).get("plan")


def planes_retired(cluster: LocalCluster) -> bool:
    """Every peer serves one plane only (the old plan's retired)."""
    return all(len(((cluster.status(i) or {}).get("dataplane") or {}).get("plans", [0, 0])) <= 1
               for i in range(cluster.count))


@contextlib.contextmanager
def slowed(pid: int) -> Iterator[None]:
    """The daemon `pid` (every thread of it) pinned to the last core, beside a process that
    spins there."""
    core = max(os.sched_getaffinity(0))
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), {core})
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def wait(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    return value


def run(root: Path, model_dir: Path, quant: Quant) -> dict:
    battery = root / "battery.json"
    write_battery_file(battery, 100, True)
    peer_args: list[list[str]] = [[] for _ in range(PEERS)]
    peer_args[ON_BATTERY] = ["--battery-file", str(battery)]
    with LocalCluster(root / "cluster", model_dir, PEERS, peer_args=peer_args, quant=quant,
                      shard_cache=shard_cache(root),
                      progress=lambda line: print(line, file=sys.stderr)) as cluster:
        manifest = cluster.manifest
        assert manifest is not None  # set on entering
        before, plan = units_by_peer(cluster), served_plan(cluster)
        pids = [cluster.pid(i) for i in range(PEERS)]
        answers = Answers(cluster.dirs[0])
        client = threading.Thread(target=answers.run, daemon=True)
        with peak_rss(pids, SAMPLE_S) as rss:
            client.start()
            try:
                time.sleep(BASELINE_S)
                steady = [rss.peak[pid] for pid in pids]
                copied = copies_by_peer(cluster)
                write_battery_file(battery, 50, False)
                with slowed(pids[ON_BATTERY]):
                    changed = wait(lambda: served_plan(cluster) not in (plan, None), CHANGE_S)
                    retired = changed and wait(lambda: planes_retired(cluster), CHANGE_S)
                    time.sleep(AFTER_S)
            finally:
                answers.stop.set()
        after = units_by_peer(cluster)
        copied = [old + new for old, new in zip(copied, copies_by_peer(cluster), strict=True)]
        client.join(130)
    return {"manifest": manifest, "before": before, "after": after, "copies": copied,
            "steady": steady,
            "peak": [rss.peak[pid] for pid in pids], "samples": rss.samples,
            "changed": bool(changed), "retired": bool(retired), "crossed": answers.crossed}


def weights(manifest: Manifest, units: set[int]) -> int:
    return sum(manifest.units[u].weight_bytes for u in units)


def kv_bound(manifest: Manifest, units: set[int]) -> int:
    tokens = len(PROMPT) + ANSWER_TOKENS
    return 2 * tokens * sum(manifest.units[u].kv_bytes_per_token for u in units)


def report(result: dict) -> bool:
    manifest: Manifest = result["manifest"]
    mb = 2**20
    print(f"{result['samples']} samples of every peer's RSS, every {SAMPLE_S * 1000:.0f} ms; "
          f"the plan {'changed' if result['changed'] else 'did NOT change'}, old planes "
          f"{'retired' if result['retired'] else 'NOT retired'}")
    print("peer  units before -> after  steady RSS  max RSS  bound   result   rise   gained"
          "  new stage  (union  old+new)  copies held")
    passed = True
    for i, (old, new) in enumerate(zip(result["before"], result["after"], strict=True)):
        copies = set(result["copies"][i])
        union = set(old) | set(new) | copies
        bound = weights(manifest, union) + kv_bound(manifest, union) + OVERHEAD
        both = weights(manifest, set(old)) + weights(manifest, set(new))
        steady, peak = result["steady"][i], result["peak"][i]
        passed &= peak <= bound
        print(f"peer{i}  {_range(old):>5} -> {_range(new):<5}  {steady / mb:7.0f} MB"
              f"  {peak / mb:4.0f} MB  {bound / mb:4.0f} MB  {'pass' if peak <= bound else 'FAIL'}"
              f"  {(peak - steady) / mb:4.0f} MB"
              f"  {weights(manifest, union - set(old)) / mb:4.0f} MB"
              f"  {weights(manifest, set(new)) / mb:6.0f} MB  ({weights(manifest, union) / mb:4.0f}"
              f"  {both / mb:5.0f} MB)  {_listed(copies)}")
    crossed = result["crossed"]
    print(f"answers that crossed the change: {len(crossed)}, with their K/V moved: "
          f"{sum(kv for _, kv in crossed)}")
    return passed and result["changed"]


def _listed(units: set[int]) -> str:
    return ",".join(map(str, sorted(units))) or "none"


def _range(units: tuple[int, ...]) -> str:
    return f"{units[0]}-{units[-1]}" if units else "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--quant", choices=[q.value for q in Quant], default=Quant.INT4.value)
    parser.add_argument("--dir", help="keep the model and state here (reruns, and bench.quant "
                        "with the same --dir, reuse its units)")
    args = parser.parse_args(argv)
    return 0 if run_in(args.dir, lambda root: _bench(root, args)) else 1


def _bench(root: Path, args: argparse.Namespace) -> bool:
    model_dir = reusable_llama(root, shape_from(args), lambda line: print(line, file=sys.stderr))
    print(f"model: random Llama, {args.layers} layers, hidden {args.hidden}, --quant "
          f"{args.quant}; {PEERS} daemons, each with memory for 1/{PEERS - 0.6:g} of it; "
          f"peer{ON_BATTERY} goes on battery and slows down")
    return report(run(root, model_dir, Quant(args.quant)))


if __name__ == "__main__":
    sys.exit(main())
