"""Cluster benchmark on real processes in network namespaces (needs root and iproute2).

Prints, measured in this run:
  * time from starting three daemons to a cluster that agrees on a leader and has measured
    every peer and link (several rounds);
  * time from SIGKILL of the leader to the survivors agreeing on a new leader;
  * measured vs shaped bandwidth on links limited with `tc qdisc ... tbf` (target: within 15%).

Usage: sudo .venv/bin/python -m bench.cluster [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import netns  # noqa: E402

SHAPED_MBIT = {0: 20, 1: 80}  # namespace -> egress rate; namespace 2 is left unshaped
ERROR_TARGET = 0.15


def form(peers, timeout: float = 60) -> tuple[dict, float]:
    start = time.monotonic()
    agreed = netns.wait_for(
        lambda: netns.agreement([p.status() for p in peers], [p.id for p in peers]),
        timeout=timeout, what="the cluster to form",
    )
    return agreed, time.monotonic() - start


def re_elect(peers, agreed: dict) -> float:
    leader = next(p for p in peers if p.id == agreed["leader"])
    survivors = [p for p in peers if p is not leader]
    leader.kill()
    start = time.monotonic()

    def new_leader():
        views = {(s["leader"], s["epoch"]) if s else None for s in (p.status() for p in survivors)}
        if len(views) != 1:
            return False
        view = views.pop()
        return view is not None and view[0] not in (None, leader.id) and view[1] > agreed["epoch"]

    netns.wait_for(new_leader, timeout=30, what="a new leader")
    return time.monotonic() - start


def timing_round(root: Path) -> tuple[float, float]:
    dirs = netns.make_state_dirs(root, 3)
    started = time.monotonic()
    with netns.cluster(dirs) as (_, peers):
        agreed, _ = form(peers)
        formed = time.monotonic() - started
        return formed, re_elect(peers, agreed)


def bandwidth_round(root: Path) -> list[tuple[str, float | None, float]]:
    dirs = netns.make_state_dirs(root, 3)
    with netns.cluster(dirs, shaped_mbit=SHAPED_MBIT) as (_, peers):
        form(peers, timeout=120)
        names = {p.id: f"peer{p.index}" for p in peers}
        rows = []
        for entry in peers[0].status()["peers"]:
            index = int(names[entry["id"]][4:])
            for link in entry["links"]:
                label = f"{names[entry['id']]} -> {names[link['target']]}"
                rows.append((label, SHAPED_MBIT.get(index), link["bandwidth_Bps"] * 8 / 1e6))
        return sorted(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="formation/election rounds")
    args = parser.parse_args()
    reason = netns.unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    with tempfile.TemporaryDirectory(prefix="peerd-bench-") as tmp:
        rounds = [timing_round(Path(tmp) / f"round{i}") for i in range(args.rounds)]
        formation = [r[0] for r in rounds]
        election = [r[1] for r in rounds]
        print(f"cluster formation (3 peers, start to measured): "
              f"median {statistics.median(formation):.2f}s, "
              f"all {', '.join(f'{t:.2f}' for t in formation)} (acceptance: <= 15 s)")
        print(f"re-election after SIGKILL of the leader: "
              f"median {statistics.median(election):.2f}s, "
              f"all {', '.join(f'{t:.2f}' for t in election)} (acceptance: <= 5 s)")
        print("bandwidth, measured vs shaped (tbf on the sender's egress):")
        worst = 0.0
        for label, shaped, measured in bandwidth_round(Path(tmp) / "bandwidth"):
            if shaped is None:
                print(f"  {label}: {measured:9.1f} Mbit/s  (unshaped veth)")
                continue
            error = measured / shaped - 1
            worst = max(worst, abs(error))
            print(f"  {label}: {measured:9.1f} Mbit/s  shaped {shaped} Mbit/s  "
                  f"ratio {measured / shaped:.3f}  error {error:+.1%}")
        verdict = "within" if worst <= ERROR_TARGET else "OUTSIDE"
        print(f"worst bandwidth error {worst:.1%}: {verdict} the {ERROR_TARGET:.0%} target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
