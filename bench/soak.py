"""Soak: many chats while a peer is killed and restarted at random intervals.

Three daemons on loopback serve the built-in model; any two of them can hold it, so every
answer in flight when a peer dies should resume on the survivors and finish exactly. Chats
are spread evenly over the run, a few at a time; a chaos thread SIGKILLs peer 1 or 2 at
random moments and restarts it a little later. Every answer is compared with `peerd
generate` run locally on the same prompt. Printed: answers completed exactly, failed with a
clear error, and wrong or lost (target: 0), how many plan changes the exact answers crossed
with their K/V moved or re-prefilled, and the time to recover after each kill (from the
kill to the next token any client received).

    python -m bench.soak [--minutes 10] [--chats 200] [--concurrency 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peerd.commands.client import chat_events
from peerd.commands.local_cluster import LocalCluster
from shards.builtin import write_builtin_model

MAX_TOKENS = 40
PROMPTS = [[random.Random(i).randrange(3, 400) for _ in range(1 + i % 6)] for i in range(16)]


def _reference(model_dir: Path, state_dir: Path, prompt: list[int]) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-m", "peerd", "generate", str(model_dir), "--prompt-ids",
         ",".join(map(str, prompt)), "--max-tokens", str(MAX_TOKENS), "--json"],
        capture_output=True, text=True, check=True,
        env={**os.environ, "PEERD_STATE_DIR": str(state_dir)},
    )
    return json.loads(done.stdout)["token_ids"]


class Soak:
    def __init__(self, cluster: LocalCluster, expected: dict[tuple, list[int]]):
        self.cluster, self.expected = cluster, expected
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.moves: Counter[str] = Counter()  # plan changes answers crossed, and how
        self.token_times: list[float] = []
        self.kills: list[float] = []
        self.done = threading.Event()
        self._lock = threading.Lock()

    def chat(self, number: int, at: float) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        prompt = PROMPTS[number % len(PROMPTS)]
        asked_on = self.cluster.dirs[0]  # the model peer: the chaos never kills it
        tokens, final = [], None
        try:
            request = {"prompt_ids": prompt, "max_tokens": MAX_TOKENS}
            for event in chat_events(asked_on, request, timeout=180):
                if event.get("event") == "token":
                    tokens.append(event["token"])
                    with self._lock:
                        self.token_times.append(time.monotonic())
                else:
                    final = event
        except Exception as exc:  # noqa: BLE001 - a lost answer is what the soak counts
            final = {"lost": f"{type(exc).__name__}: {exc}"}
        self._record(prompt, tokens, final)

    def _record(self, prompt, tokens, final) -> None:
        with self._lock:
            if final is None or "lost" in final:
                self.outcomes["lost"] += 1
                self.errors[(final or {}).get("lost", "connection closed")] += 1
            elif final.get("ok") is False:
                self.outcomes["failed with a clear error"] += 1
                self.errors[final.get("error", "?")] += 1
            elif tokens == final["token_ids"] == self.expected[tuple(prompt)]:
                self.outcomes["completed exactly"] += 1
                stats = final["stats"]
                self.moves["answers"] += bool(stats["resumed"])
                self.moves["with K/V"] += stats["kv_moved"]
                self.moves["re-prefilled"] += stats["resumed"] - stats["kv_moved"]
            else:
                self.outcomes["wrong"] += 1

    def chaos(self, rng: random.Random) -> None:
        while not self.done.wait(rng.uniform(20, 50)):
            victim = rng.choice([1, 2])
            self.cluster.kill(victim)
            with self._lock:
                self.kills.append(time.monotonic())
            if self.done.wait(rng.uniform(5, 20)):
                break
            self.cluster.restart(victim)

    def recovery_s(self) -> list[float]:
        times = sorted(self.token_times)
        recovered = []
        for kill in self.kills:
            after = next((t for t in times if t > kill), None)
            if after is not None:
                recovered.append(after - kill)
        return recovered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--chats", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", help="keep the model and state here")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="peerd-soak-"))
    model_dir = write_builtin_model(root / "builtin-model")
    with LocalCluster(root, model_dir, holders=2,
                      progress=lambda line: print(line, file=sys.stderr)) as cluster:
        expected = {tuple(p): _reference(model_dir, cluster.dirs[0], p) for p in PROMPTS}
        soak = Soak(cluster, expected)
        chaos = threading.Thread(target=soak.chaos, args=(random.Random(args.seed),),
                                 daemon=True)
        start = time.monotonic()
        spacing = args.minutes * 60 / args.chats
        chaos.start()
        with ThreadPoolExecutor(args.concurrency) as pool:
            for number in range(args.chats):
                pool.submit(soak.chat, number, start + number * spacing)
        soak.done.set()
        chaos.join()
        elapsed = time.monotonic() - start
    recovered = soak.recovery_s()
    print(f"{args.chats} chats in {elapsed / 60:.1f} min, {len(soak.kills)} peer kills")
    for outcome in ("completed exactly", "failed with a clear error", "wrong", "lost"):
        print(f"  {outcome:27s} {soak.outcomes[outcome]}")
    print(f"wrong or lost: {soak.outcomes['wrong'] + soak.outcomes['lost']}  (target 0)")
    moves = soak.moves
    print(f"exact answers that crossed a plan change: {moves['answers']}; moves with their "
          f"K/V {moves['with K/V']}, re-prefilled {moves['re-prefilled']}")
    for error, count in soak.errors.most_common():
        print(f"  error x{count}: {error}")
    if recovered:
        print(f"time to recover after a kill: min {min(recovered):.1f} s, median "
              f"{statistics.median(recovered):.1f} s, max {max(recovered):.1f} s "
              f"(n={len(recovered)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
