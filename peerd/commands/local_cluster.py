"""Several real daemons on this machine, on loopback, serving one model together.

Used by `peerd demo` and the benchmarks. The model is sharded first into the model peer's
shard cache (which that peer's daemon then finds ready); that cache may be a directory that
outlives the cluster (`shard_cache`: the model peer's `shards` is then a link to it), where
the units of an earlier run with the same key are reused without starting `peerd shard`.
Every peer gets a memory budget (by default one under which only all of them together can
hold the model); the non-model peers find the model peer as a static `--peer`, since
multicast on the loopback interface is not something to count on. The model peer's ports
are chosen beforehand, so that all the daemons start at once. Entering the context returns
once the cluster has settled: every peer in and agreeing on a leader that none of them
outranks enough to challenge, no re-plan pending, and the leader's plan deployed on every
stage and served by the head. Leaving it terminates the daemons.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from peerd.cluster.election import Candidate, Timing, challenges
from peerd.commands.client import call
from peerd.control.planning import context_for
from peerd.errors import PeerdError
from peerd.wire import identity
from peerd.wire.states import DeployState, ModelState
from planner.model import Cluster
from shards.cache import ShardOptions, cached
from shards.cli import SHARDS_SUBDIR
from shards.manifest import Manifest, Quant

BETA = Cluster(source="", devices=()).beta  # the share of its budget a peer offers
READY_S = 600.0
# The model peer's ports (PORT..PORT+2) are drawn from below Linux's ephemeral range, where
# no outgoing connection takes one between the draw and the daemon's bind.
PORTS = range(20000, 32000)
PORT_TRIES = 3  # model peers started, each on ports drawn afresh, before giving up
SPARE = 0.6  # how far short of one more peer's room the default budgets are (see holder_share)


class LocalCluster:
    def __init__(self, root: Path, model_dir: Path, peers: int = 3,
                 progress: Callable[[str], None] = print, holders: int | None = None,
                 cpus: Sequence[Sequence[int]] | None = None, extra: Sequence[str] = (),
                 peer_args: Sequence[Sequence[str]] = (),
                 shares: Sequence[float] | None = None,
                 shard_cache: Path | None = None, quant: Quant = Quant.NONE) -> None:
        """`holders`: how many peers it takes to hold the model (default: all of them);
        `shares`: instead, per peer, the fraction of the model it has memory for;
        `cpus`: per peer, the cores its daemon is pinned to; `extra`: more `peerd start`
        arguments for every peer, `peer_args`: for peer i, its own; `shard_cache`: where
        the model peer's shard cache is kept; `quant`: the units' weights (the model peer's
        `--quant`; the default budgets are shares of those units)."""
        self.root, self.model_dir, self.count = Path(root), Path(model_dir), peers
        self.progress = progress
        self.shares = list(shares or [holder_share(holders or peers)] * peers)
        self.cpus = cpus
        self.extra = tuple(extra)
        self.peer_args = [tuple(a) for a in peer_args]
        self._args: dict[int, tuple] = {}
        self.dirs: list[Path] = []
        self.shard_cache = shard_cache
        self.quant = quant
        self.manifest: Manifest | None = None
        self._processes: list[subprocess.Popen] = []

    def __enter__(self) -> LocalCluster:
        self.dirs = _cluster_dirs(self.root, self.count)
        if self.shard_cache is not None:
            _link_shard_cache(self.dirs[0], self.shard_cache)
        self.manifest = _shard(self.model_dir, self.dirs[0], self.quant, self.progress)
        try:
            self._start_all([budget_share(self.manifest, share) for share in self.shares])
            _wait_for_deployment(self.dirs, self._processes, self.progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self, budgets: list[str]) -> None:
        """Start every daemon at once, the others pointed at the model peer's hello port; on
        other ports when the model peer could not take those (someone took them meanwhile)."""
        for _ in range(PORT_TRIES):
            port = free_ports(3)
            self._start(0, budgets[0], "--model", str(self.model_dir), "--quant",
                        self.quant.value, "--port", str(port))
            for i in range(1, self.count):
                self._start(i, budgets[i], "--peer", f"127.0.0.1:{port}")
            if _wait(functools.partial(self._model_peer_up, port), "peer0 to start") == "up":
                return
            self.stop()
        raise PeerdError(f"peer0 did not start (see {self.dirs[0] / 'daemon.log'})")

    def _model_peer_up(self, port: int) -> str | None:
        """"up" once the model peer answers on `port`, "exited" if it exited first."""
        if self._processes[0].poll() is not None:
            return "exited"
        return "up" if _hello_port(self.dirs[0]) == port else None

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, i: int, budget: str, *args: str) -> None:
        cores = self.cpus[i] if self.cpus else None
        own = self.peer_args[i] if i < len(self.peer_args) else ()
        self._args[i] = (budget, cores, *args, *self.extra, *own)
        self._processes.append(_start(self.dirs[i], *self._args[i]))

    def kill(self, i: int) -> None:
        """SIGKILL peer i's daemon (a device that vanishes)."""
        process = self._processes[i]
        process.kill()
        process.wait(timeout=30)

    def restart(self, i: int) -> None:
        """Start peer i's daemon again, as it was started."""
        self._processes[i] = _start(self.dirs[i], *self._args[i])

    def pid(self, i: int) -> int:
        """The process id of peer i's daemon."""
        return self._processes[i].pid

    def pin(self, i: int, cores: Sequence[int]) -> None:
        """Move peer i's running daemon, every thread of it, onto `cores`."""
        for thread in os.listdir(f"/proc/{self.pid(i)}/task"):
            os.sched_setaffinity(int(thread), cores)

    def status(self, i: int = 0) -> dict | None:
        return _status(self.dirs[i])

    def detach(self) -> None:
        """Leave the daemons running after the context ends."""
        self._processes.clear()

    def stop(self) -> None:
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()  # its log says which shutdown step hung
                process.wait()
        self._processes.clear()


def _cluster_dirs(root: Path, count: int) -> list[Path]:
    secret = identity.ClusterSecret(secrets.token_bytes(identity.SECRET_BYTES))
    dirs = []
    for i in range(count):
        state_dir = root / f"peer{i}"
        state_dir.mkdir(parents=True, exist_ok=True)
        identity.ensure_identity(state_dir, f"peer{i}")
        if not identity.has_secret(state_dir):
            identity.store_secret(state_dir, secret)
        dirs.append(state_dir)
    return dirs


def _link_shard_cache(state_dir: Path, cache: Path) -> None:
    """Make `cache` the shard cache of the peer at `state_dir`, unless it has one of its own."""
    link = state_dir / SHARDS_SUBDIR
    cache.mkdir(parents=True, exist_ok=True)
    if not link.exists() and not link.is_symlink():
        link.symlink_to(cache.resolve(), target_is_directory=True)


def _shard(model_dir: Path, state_dir: Path, quant: Quant,
           progress: Callable[[str], None]) -> Manifest:
    """Find the units in the model peer's cache from an earlier run, or shard into it with
    progress on stderr; the manifest."""
    progress("the model's ONNX units: made once, then reused")
    found = cached(model_dir, state_dir / SHARDS_SUBDIR, ShardOptions(quant))
    if found is None:
        return _shard_in_child(model_dir, state_dir, quant, progress)
    progress(f"  reused the {len(found.manifest.units)} units in {found.directory.resolve()}")
    return found.manifest


def _shard_in_child(model_dir: Path, state_dir: Path, quant: Quant,
                    progress: Callable[[str], None]) -> Manifest:
    """`peerd shard` into the model peer's cache (a child: exporting imports torch)."""
    done = subprocess.run(
        [sys.executable, "-m", "peerd", "shard", str(model_dir), "--json", "--quant",
         quant.value],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PEERD_STATE_DIR": str(state_dir)},
    )
    if done.returncode != 0:
        raise PeerdError("sharding the model failed (see above)")
    result = json.loads(done.stdout)
    directory, stats = Path(result["directory"]).resolve(), result["stats"]
    if stats["exported"]:
        progress(f"  made {len(result['units'])} units in {stats['seconds']:.1f}s: {directory}")
    else:
        progress(f"  reused the {len(result['units'])} units in {directory}")
    return Manifest.load(directory)


def free_ports(count: int) -> int:
    """A port P such that P..P+count-1 are free on loopback now."""
    while True:
        first = random.choice(PORTS[:-count])
        with contextlib.ExitStack() as sockets:
            try:
                for port in range(first, first + count):
                    sockets.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue  # taken
        return first


def budget_for(manifest: Manifest, peers: int, spare: float = SPARE) -> str:
    """The budget of `holder_share`: `peers` of them hold the model."""
    return budget_share(manifest, holder_share(peers, spare))


def holder_share(peers: int, spare: float = SPARE) -> float:
    """Each of `peers` offers the model's need divided by (peers - spare): one peer fewer
    falls short (spare < 1), all of them have room to spare for splitting the units
    contiguously (more of it as `spare` nears 1)."""
    return 1 / (peers - spare)


def budget_share(manifest: Manifest, share: float) -> str:
    """The `--memory-budget` under which a peer offers `share` of the model's need."""
    context = context_for(manifest)
    need = sum(u.weight_bytes + context * u.kv_bytes_per_token for u in manifest.units)
    return f"{int(need * share / BETA)}"


def _start(state_dir: Path, budget: str, cores: Sequence[int] | None,
           *extra: str) -> subprocess.Popen:
    log = (state_dir / "daemon.log").open("w")
    command = [sys.executable, "-m", "peerd", "start", "--state-dir", str(state_dir),
               "--interface", "127.0.0.1", "--memory-budget", budget, *extra]
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin)


def _status(state_dir: Path) -> dict | None:
    try:
        return call(state_dir, {"op": "status"})["status"]
    except PeerdError:
        return None


def _hello_port(state_dir: Path) -> int | None:
    document = _status(state_dir)
    return None if document is None else document["ports"]["hello"]


def _wait_for_deployment(dirs: list[Path], processes: list[subprocess.Popen],
                         progress: Callable[[str], None]) -> None:
    shown = None

    def ready() -> bool:
        nonlocal shown
        for i, process in enumerate(processes):
            if process.poll() is not None:
                raise PeerdError(f"the daemon of peer{i} exited with status "
                                 f"{process.returncode} (see {dirs[i] / 'daemon.log'})")
        statuses = [_status(d) for d in dirs]
        line = _progress(statuses[0])
        if line != shown:
            progress(f"  {line}")
            shown = line
        return _settled(statuses)

    _wait(ready, "the model to be deployed")


def _settled(statuses: list[dict | None]) -> bool:
    """Every peer in, all following one leader that none of them would challenge, no re-plan
    waiting (a peer that joined late), and the leader's plan deployed on every stage and
    served by the head: nothing left that would change the plan."""
    if any(s is None for s in statuses):
        return False
    documents = [s for s in statuses if s is not None]
    leader = next((s for s in documents if s["role"] == "leader"), None)
    if leader is None or _alive(leader) != len(documents) or any(
        (s["epoch"], s["leader"], s["replan_pending"]) != (leader["epoch"], leader["self"], False)
        for s in documents
    ):
        return False
    key = _plan_key(leader)
    heads = [s["dataplane"]["plan"] for s in documents if s["dataplane"].get("head")]
    return (key is not None and heads == [key] and _unchallenged(leader)
            and _deployed(leader["plan"], {s["self"]: s for s in documents}))


def _unchallenged(leader: dict) -> bool:
    """No peer is measured so much faster than the leader, or on mains where it is not, that
    it would stand against it (peerd/cluster/election.py)."""
    candidates = {p["id"]: Candidate(p["id"], p["battery"] is None or p["battery"]["plugged"],
                                     p["flops"] or 0.0) for p in leader["peers"]}
    if not all(c.measured for c in candidates.values()):
        return False
    ruling = candidates[leader["self"]]
    return not any(challenges(c, ruling, Timing().challenge_margin)
                   for c in candidates.values() if c is not ruling)


def _deployed(plan: dict, by_peer: dict[str, dict]) -> bool:
    """Every stage's peer has loaded its units of `plan`."""
    loaded = (plan["id"], plan["epoch"], DeployState.READY)
    return all(
        stage["peer"] in by_peer and loaded == tuple(
            by_peer[stage["peer"]]["deployment"][k] for k in ("plan_id", "epoch", "state"))
        for stage in plan["stages"]
    )


def _plan_key(document: dict) -> str | None:
    plan = document.get("plan") or {}
    return f"{plan['epoch']}.{plan['id']}" if plan.get("stages") else None


def _alive(document: dict) -> int:
    return sum(1 for p in document["peers"] if p["state"] == "alive")


def _progress(document: dict | None) -> str:
    if document is None:
        return "waiting for peer0"
    model, plan = document.get("model"), document.get("plan")
    members = _alive(document)
    if not model or model.get("state") != ModelState.READY:
        detail = (model or {}).get("detail") or "starting"
        return f"{members} peers; model: {detail}"
    if not plan or not plan["stages"]:
        return f"{members} peers; model sharded; planning" + (
            f" ({plan['problem']})" if plan and plan.get("problem") else ""
        )
    stages = ", ".join(f"{s['peer'][:6]}: units {s['units'][0]}-{s['units'][-1]}"
                       for s in plan["stages"])
    return f"{members} peers; plan {plan['id']}: {stages}; loading"


def _wait(condition, what: str):
    deadline = time.monotonic() + READY_S
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise PeerdError(f"timed out after {READY_S:.0f}s waiting for {what}")
        time.sleep(0.25)
    return value
