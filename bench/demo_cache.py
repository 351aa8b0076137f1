"""How much the demo's unit cache saves: `peerd demo` twice, the first with an empty cache.

Both runs are whole `peerd demo` commands as a user types them (three daemons, planning,
deployment, a 24-token answer), each timed from start to exit; the cache is a fresh
directory (PEERD_CACHE_DIR), so the first run shards the built-in model and the second finds
its units there. A round is one such pair; rounds alternate cold and warm runs, so load from
other processes hits both alike. Prints, per round, where each run's seconds went (the time
between the lines the demo prints as it gets there), then the median of each and their ratio.

    .venv/bin/python -m bench.demo_cache [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the demo has done by the time it prints a line that matches, in the order it prints
# them; a phase's time is that from the milestone before (the command's start for the first).
MILESTONES = (
    ("interpreter and imports", re.compile(r"demo directory: ")),
    ("built-in checkpoint written", re.compile(r"built-in model written")),
    ("units made or found in the cache", re.compile(r"  (made|reused the) \d+ units")),
    ("model peer answering", re.compile(r"  \d+ peers; ")),
    ("all three peers in", re.compile(r"  3 peers; ")),
    ("plan deployed, cluster settled", re.compile(r"cluster ")),
    ("answer streamed", re.compile(r"\d+ tokens, first after")),
)
EXIT = "daemons stopped, exited"


def timed_demo(env: dict[str, str]) -> dict[str, float]:
    """Run `peerd demo`; the time since its start at which it passed each milestone."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "peerd", "demo"], env=env,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None  # a pipe
    passed: dict[str, float] = {}
    for line in process.stdout:
        for name, pattern in MILESTONES:
            if name not in passed and pattern.match(line):
                passed[name] = time.perf_counter() - started
    if process.wait() != 0:
        raise SystemExit(f"peerd demo failed with exit status {process.returncode}")
    passed[EXIT] = time.perf_counter() - started
    return passed


def phases(passed: dict[str, float]) -> dict[str, float | None]:
    """Each milestone's phase: its time since the milestone passed before it (None when
    the demo printed no line for it)."""
    durations: dict[str, float | None] = {}
    previous = 0.0
    for name in [name for name, _ in MILESTONES] + [EXIT]:
        at = passed.get(name)
        durations[name] = None if at is None else at - previous
        previous = previous if at is None else at
    return durations


def print_round(number: int, cold: dict[str, float], warm: dict[str, float]) -> None:
    print(f"round {number}: seconds per phase          cold     warm")
    for (name, first), second in zip(phases(cold).items(), phases(warm).values(),
                                     strict=True):
        print(f"  {name:<36} {_seconds(first):>6} {_seconds(second):>8}")
    print(f"  {'total':<36} {cold[EXIT]:>6.1f} {warm[EXIT]:>8.1f}")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="cold/warm pairs (default 2)")
    rounds = parser.parse_args().rounds
    print(f"load average before: {os.getloadavg()[0]:.1f} (other processes share the cores)")
    colds, warms = [], []
    for number in range(1, rounds + 1):
        with tempfile.TemporaryDirectory(prefix="peerd-bench-cache-") as cache:
            env = {**os.environ, "PEERD_CACHE_DIR": str(Path(cache)), "PYTHONUNBUFFERED": "1"}
            cold = timed_demo(env)
            warm = timed_demo(env)
        print_round(number, cold, warm)
        colds.append(cold[EXIT])
        warms.append(warm[EXIT])
    first, second = statistics.median(colds), statistics.median(warms)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(f"first run (shards the model): {first:.1f} s (median of {rounds})")
    print(f"second run (units cached):    {second:.1f} s (median of {rounds})")
    print(f"ratio: {first / second:.1f}x")


if __name__ == "__main__":
    main()
