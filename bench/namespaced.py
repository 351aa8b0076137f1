"""What the benches of daemons in network namespaces share: one sharded model every peer
links to, waiting for a cluster to serve, notes on stderr and the load average."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402  # pyright: ignore[reportMissingImports] (tests/ is on sys.path)
from streaming import head_of  # noqa: E402  # pyright: ignore[reportMissingImports]

from bench.workdir import run_in  # noqa: E402
from shards.cli import SHARDS_SUBDIR  # noqa: E402
from shards.manifest import Manifest  # noqa: E402

SHARDED_S, DEPLOYED_S = 300, 300


def run_bench(name: str, directory: str | None, bench: Callable[[Path], None]) -> int:
    """Run `bench` in `directory` (a temporary one when None), or say in one line why
    namespaces cannot be had here (exit 2). The daemons and `peerd shard` run this
    checkout's code, wherever peerd is installed; a SIGTERM or SIGHUP unwinds, removing
    namespaces and daemons."""
    reason = netns.unavailable_reason()
    if reason:
        print(f"{name}: cannot run: {reason}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda number, _frame: sys.exit(128 + number))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    run_in(directory, bench)
    return 0


def shard_once(root: Path, model_dir: Path, peers: int) -> tuple[Manifest, list[Path]]:
    """Shard the model once into a cache (reused by later runs), and `peers` fresh state
    dirs whose shard caches link to it, so no units cross the links."""
    manifest, cache = shard_cache(root, model_dir)
    return manifest, linked_state_dirs(root / f"{model_dir.name}-peers{peers}", cache, peers)


def shard_cache(root: Path, model_dir: Path) -> tuple[Manifest, Path]:
    """The model's units in a state directory under `root` (sharded by the first run, reused
    by later ones), and that state directory."""
    cache = root / f"{model_dir.name}-state"
    note(f"sharding {model_dir.name} (reused when an earlier run left its units)")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "peerd", "shard", str(model_dir), "--json"],
        stdout=subprocess.PIPE, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PEERD_STATE_DIR": str(cache)})
    result = json.loads(done.stdout)
    note(f"  {len(result['units'])} units, {'made' if result['stats']['exported'] else 'reused'}"
         f" in {time.monotonic() - started:.0f}s")
    return Manifest.load(Path(result["directory"])), cache


def linked_state_dirs(peers_root: Path, cache: Path, peers: int) -> list[Path]:
    """`peers` fresh state dirs of one new cluster under `peers_root`, their shard caches
    linked to `cache`'s."""
    shutil.rmtree(peers_root, ignore_errors=True)
    dirs = netns.make_state_dirs(peers_root, peers)
    for state_dir in dirs:
        (state_dir / SHARDS_SUBDIR).symlink_to(cache / SHARDS_SUBDIR, target_is_directory=True)
    return dirs


def serving(peers: list[netns.Peer]) -> tuple[netns.Peer, dict]:
    """The head and the deployed plan, once the cluster serves."""
    netns.wait_for(lambda: netns.sharded_model(peers[0]), SHARDED_S, "the model ready",
                   interval=0.5)
    plan = netns.wait_for(lambda: netns.deployed_plan(peers), DEPLOYED_S, "a deployed plan",
                          interval=0.5)
    head = netns.wait_for(lambda: head_of(peers), DEPLOYED_S, "the head to accept chats",
                          interval=0.5)
    return head, plan


def load_average() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
