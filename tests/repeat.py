"""Run tests N times in a row and print failures per test: the tool that shows a test is not
flaky, on a quiet machine and on a loaded one.

    python tests/repeat.py                       # the daemon tests (-m cluster), 5 runs
    python tests/repeat.py --runs 3 --busy-core 0 tests/clusters/test_cluster_rebalance.py
    python tests/repeat.py --runs 10 -- -m "not cluster" -k planner

Each run is one `pytest` process writing a JUnit XML report; the table lists every test that
failed at least once (with the first line of its failure) and each run's duration. With
`--busy-core N` a process spinning on core N (pinned with `taskset`'s system call) runs for
the whole time, as a machine busy with other work would. Exit status: 0 when no test failed
in any run, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@dataclass
class Outcome:
    runs: int = 0
    failures: list[str] = field(default_factory=list)  # first line of each failure
    durations: list[float] = field(default_factory=list)


def parse_report(path: Path) -> dict[str, tuple[bool, float, str]]:
    """test id -> (failed, seconds, first line of the failure) from a JUnit XML report."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("skipped") is not None:
            continue
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        message = "" if problem is None else (problem.get("message") or "").splitlines()
        results[name] = (problem is not None, float(case.get("time", 0.0)),
                         message[0][:160] if message else "")
    return results


@contextlib.contextmanager
def busy(core: int | None) -> Iterator[None]:
    """A process spinning on `core` for the duration (nothing when `core` is None)."""
    if core is None:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", SPIN, str(core)])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def run_once(pytest_args: list[str], report: Path) -> tuple[int, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", *pytest_args],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        # A shell runs background jobs with SIGINT ignored, and children inherit that:
        # the tests must see a terminal's Ctrl-C as they would in the foreground.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    return done.returncode, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/repeat.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=5, help="runs in a row (default 5)")
    parser.add_argument("--busy-core", type=int, metavar="N",
                        help="keep a busy process pinned to core N during the runs")
    parser.add_argument("pytest_args", nargs="*",
                        help="what to run, as pytest takes it (default: -m cluster)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.busy_core is not None and args.busy_core not in os.sched_getaffinity(0):
        parser.error(f"--busy-core {args.busy_core}: no such core here")
    pytest_args = args.pytest_args or ["-m", "cluster"]

    outcomes: dict[str, Outcome] = defaultdict(Outcome)
    codes = []
    load = f", a busy process on core {args.busy_core}" if args.busy_core is not None else ""
    print(f"{args.runs} runs of pytest {' '.join(pytest_args)}{load}", flush=True)
    with tempfile.TemporaryDirectory() as scratch, busy(args.busy_core):
        for run in range(1, args.runs + 1):
            report = Path(scratch) / f"run{run}.xml"
            code, seconds = run_once(pytest_args, report)
            results = parse_report(report) if report.exists() else {}
            for name, (failed, duration, message) in results.items():
                outcome = outcomes[name]
                outcome.runs += 1
                outcome.durations.append(duration)
                if failed:
                    outcome.failures.append(message)
            failed_now = [name for name, (failed, _, _) in results.items() if failed]
            codes.append(code)
            print(f"run {run}: {len(results)} tests, {len(failed_now)} failed, exit {code}, "
                  f"{seconds:.0f} s", flush=True)
            for name in failed_now:
                print(f"    failed: {name}", flush=True)
    return report_table(outcomes, codes)


def report_table(outcomes: dict[str, Outcome], codes: list[int]) -> int:
    flaky = {name: o for name, o in outcomes.items() if o.failures}
    print(f"\n{len(outcomes)} tests; {len(flaky)} failed at least once")
    for name, outcome in sorted(flaky.items()):
        print(f"  {len(outcome.failures)}/{outcome.runs}  {name}")
        for message in dict.fromkeys(outcome.failures):
            print(f"        {message}")
    slowest = sorted(outcomes.items(), key=lambda item: -max(item[1].durations))[:10]
    print("\nslowest tests (min / max seconds over the runs):")
    for name, outcome in slowest:
        print(f"  {min(outcome.durations):7.1f} / {max(outcome.durations):7.1f}  {name}")
    # exit 5 (no tests collected) and other pytest errors count as failures too
    return 0 if not flaky and all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
