"""Real multi-host test harness: Linux network namespaces joined by a bridge.

Each ``Network`` creates N namespaces with a veth pair each, their outer ends on one bridge,
addresses on a private /24 under 10.77 (only inside these namespaces; the host side carries
no address, so no test traffic leaves the bridge), and ``lo`` up. Names are unique per run so
parallel or aborted runs never collide, and ``close`` always removes the processes, the
namespaces and the bridge. Daemons run as ``ip netns exec NS python -m peerd start ...``;
their local sockets are plain files, so the test process polls their status directly.

Run as a script inside a namespace, this file also provides the attackers used by the
cluster tests (``curve-probe`` and ``garbage``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PEERD = [sys.executable, "-m", "peerd"]
HERE = Path(__file__).resolve()
# Daemons agree on a leader and measure every peer and link within this, on a loaded machine
# (how fast they do it is bench.cluster's to measure, not a test's).
FORMED_S = 60.0


def unavailable_reason() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespace tests need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


needs_namespaces = pytest.mark.skipif(
    unavailable_reason() is not None, reason=str(unavailable_reason())
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1):
    """Poll until ``condition()`` returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


class Network:
    def __init__(self, size: int, rebalance: bool = False):
        """`rebalance`: let the daemons move work as load changes (off by default: the
        load of the test machine itself would move plans under tests of other things)."""
        self.rebalance = rebalance
        self.token = secrets.token_hex(3)
        self.size = size
        self.bridge = f"pdbr{self.token}"
        self.subnet = f"10.77.{secrets.randbelow(250) + 1}"
        self._created: list[str] = []
        self.peers: list[Peer] = []

    def namespace(self, i: int) -> str:
        return f"peerd-{self.token}-{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def device(self, i: int) -> str:
        """The veth end inside namespace i."""
        return f"pd{self.token}{i}n"

    def outer_device(self, i: int) -> str:
        """The veth end on the bridge."""
        return f"pd{self.token}{i}b"

    def __enter__(self) -> Network:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append("bridge")
        _ip("link", "set", self.bridge, "up")
        for i in range(self.size):
            ns, inner, outer = self.namespace(i), self.device(i), self.outer_device(i)
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def exec(self, i: int, command: list[str], **popen) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *command], **popen)

    def run(self, i: int, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace(i), *command],
            capture_output=True, text=True, timeout=timeout,
        )

    def shape(self, i: int, rate_mbit: float) -> None:
        """Limit what namespace i sends to ``rate_mbit`` with a token bucket filter."""
        burst = max(16 * 1024, int(rate_mbit * 1e6 / 8 / 100))
        subprocess.run(
            ["ip", "netns", "exec", self.namespace(i), "tc", "qdisc", "add", "dev",
             self.device(i), "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
             "latency", "200ms"],
            check=True, capture_output=True,
        )

    def cut(self, i: int) -> None:
        """Cut namespace i off the bridge (its cable pulled): a partition."""
        _ip("link", "set", self.outer_device(i), "down")

    def mend(self, i: int) -> None:
        _ip("link", "set", self.outer_device(i), "up")

    def block_multicast(self, i: int) -> None:
        """Stop the bridge from passing multicast (mDNS) to namespace i, as some networks do."""
        subprocess.run(
            ["bridge", "link", "set", "dev", self.outer_device(i), "mcast_flood", "off"],
            check=True, capture_output=True,
        )

    def close(self) -> None:
        for peer in self.peers:
            peer.kill()
        for name in reversed(self._created):
            if name == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._created.clear()

    # -- peers ----------------------------------------------------------------------------------

    def start_peer(self, i: int, state_dir: Path, *extra: str, cores: str | None = None) -> Peer:
        """Peer i's daemon, with `cores` (taskset's list) its CPU affinity from its start."""
        log = (state_dir / "daemon.log").open("w")
        pinned = [] if cores is None else ["taskset", "-c", cores]
        process = self.exec(
            i,
            [*pinned, *PEERD, "start", "--state-dir", str(state_dir),
             "--interface", self.address(i),
             *([] if self.rebalance else ["--no-rebalance"]), *extra],
            stdout=log, stderr=subprocess.STDOUT,
        )
        peer = Peer(self, i, state_dir, process)
        self.peers.append(peer)
        return peer


class Peer:
    def __init__(self, network: Network, index: int, state_dir: Path, process):
        self.network = network
        self.index = index
        self.state_dir = state_dir
        self.process = process
        self.address = network.address(index)
        self.id = json.loads((state_dir / "identity.json").read_text())["id"]

    def running(self) -> bool:
        return self.process.poll() is None

    def status(self) -> dict[str, Any] | None:
        """The daemon's status document, or None while it cannot answer."""
        from peerd.commands.client import call
        from peerd.errors import PeerdError

        try:
            return call(self.state_dir, {"op": "status"})["status"]
        except (PeerdError, OSError, ValueError):
            return None

    def signal(self, signum: int) -> None:
        if self.running():
            self.process.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def log(self) -> str:
        return (self.state_dir / "daemon.log").read_text(errors="replace")


@contextlib.contextmanager
def cluster(
    state_dirs: list[Path],
    extra_args: dict[int, list[str]] | None = None,
    shaped_mbit: dict[int, float] | None = None,
    rebalance: bool = False,
):
    """A network with one namespace and one running daemon per state dir (namespace i's
    egress first limited to ``shaped_mbit[i]``). On failure the daemons' logs are printed
    (pytest shows them); everything is removed in any case."""
    extra_args = extra_args or {}
    with Network(len(state_dirs), rebalance) as network, logs_on_failure(network.peers):
        for i, rate in (shaped_mbit or {}).items():
            network.shape(i, rate)
        yield network, [
            network.start_peer(i, d, *extra_args.get(i, [])) for i, d in enumerate(state_dirs)
        ]


@contextlib.contextmanager
def logs_on_failure(peers: list[Peer]):
    """Print the daemons' logs (pytest shows them) when the block fails."""
    try:
        yield
    except BaseException:
        for peer in peers:
            print(f"----- daemon {peer.index} ({peer.id}) log -----\n{peer.log()}")
        raise


def make_state_dirs(root: Path, count: int, name: str = "peer") -> list[Path]:
    """``count`` state dirs of one new cluster: the first from `peerd init`, the others
    joined with its invite token."""
    dirs = [root / f"{name}{i}" for i in range(count)]
    _peerd("init", "--state-dir", str(dirs[0]), "--name", f"{name}0")
    token = _peerd("invite", "--state-dir", str(dirs[0])).strip()
    for i, state_dir in enumerate(dirs[1:], start=1):
        _peerd("join", token, "--state-dir", str(state_dir), "--name", f"{name}{i}")
    return dirs


def _peerd(*args: str) -> str:
    return subprocess.run([*PEERD, *args], check=True, capture_output=True, text=True).stdout


# -- cluster conditions -----------------------------------------------------------------------


def deployed_plan(peers: list[Peer], old: dict | None = None) -> dict | None:
    """The plan every peer shows, once every stage peer has loaded exactly its units (as every
    status lists them) and the others none; None until then, or while it is still `old`."""
    statuses = [p.status() for p in peers]
    if any(s is None or not s["plan"] or not s["plan"]["stages"] for s in statuses):
        return None
    plans = {(s["plan"]["epoch"], s["plan"]["id"]) for s in statuses}
    if len(plans) != 1 or (old and plans == {(old["epoch"], old["id"])}):
        return None
    plan = statuses[0]["plan"]
    expected = {p.id: [] for p in peers} | {
        peer: s["units"] for s in plan["stages"]
        for peer in [s["peer"], *(share["peer"] for share in s.get("shares", ())[1:])]}
    for status in statuses:
        loaded = {entry["id"]: entry["units"] for entry in status["peers"]}
        if any(loaded.get(peer) != units for peer, units in expected.items()):
            return None
    return plan


def sharded_model(peer: Peer) -> dict | None:
    status = peer.status()
    model = status and status["model"]
    if model and model.get("state") == "failed":
        raise AssertionError(f"the model peer could not shard the model: {model['detail']}")
    return model if model and model.get("state") == "ready" else None


def agreement(statuses: list[dict | None], members: list[str]) -> dict | None:
    """(leader, epoch) when every status lists exactly ``members`` alive and names the same
    leader and epoch, with measured flops for every member and links between every ordered
    pair; None otherwise."""
    if any(s is None for s in statuses):
        return None
    views = {(s["leader"], s["epoch"]) for s in statuses}
    if len(views) != 1 or None in next(iter(views)):
        return None
    for s in statuses:
        listed = {p["id"] for p in s["peers"] if p["state"] == "alive" and not p["duplicate"]}
        if listed != set(members):
            return None
        if not _fully_measured(s, members):
            return None
    leader, epoch = views.pop()
    return {"leader": leader, "epoch": epoch}


def _fully_measured(status: dict, members: list[str]) -> bool:
    peers = {p["id"]: p for p in status["peers"]}
    for member in members:
        peer = peers[member]
        if not peer["flops"] or peer["memory_available"] is None:
            return False
        targets = {link["target"] for link in peer["links"] if link["bandwidth_Bps"] > 0}
        if not set(members) - {member} <= targets:
            return False
    return True


# -- attackers, run inside a namespace --------------------------------------------------------


def curve_probe(address: str, port: int, server_key: str, timeout: float) -> dict[str, Any]:
    """Try a CURVE handshake with a fresh (non-member) key and a ping; report what happened."""
    import zmq

    from peerd.wire import protocol

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = server_key.encode()
    sock.linger = 0
    monitor = sock.get_monitor_socket()
    sock.connect(f"tcp://{address}:{port}")
    sock.send_multipart(protocol.encode(protocol.Ping(req=1)))
    events, answered = [], False
    deadline = time.monotonic() + timeout
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while time.monotonic() < deadline:
        ready = dict(poller.poll(100))
        if sock in ready:
            sock.recv_multipart()
            answered = True
        if monitor in ready:
            from zmq.utils.monitor import recv_monitor_message

            events.append(zmq.Event(recv_monitor_message(monitor)["event"]).name)
    context.destroy(linger=0)
    return {"answered": answered, "events": events}


def garbage(targets: list[dict[str, Any]], member_keys: dict[str, str] | None) -> dict[str, int]:
    """Throw junk at every port of every target: raw TCP bytes, a NULL-mechanism ZeroMQ
    client, and (with a member's keys) malformed messages that pass the handshake."""
    import random
    import socket

    import msgpack
    import zmq

    rng = random.Random(7)
    sent = {"tcp": 0, "zmq_null": 0, "member": 0}
    junk_messages = [
        [rng.randbytes(64)],
        [b"\xc1\xc1\xc1"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"v": 1, "kind": [1]})],
        [msgpack.packb({"v": 99, "kind": "ping", "req": 1})],
        [msgpack.packb({"v": 1, "kind": "no-such-kind"})],
        [msgpack.packb({"v": 1, "kind": "heartbeat", "instance": 5})],
        [msgpack.packb({"v": 1, "kind": "ping", "req": "x"})],
        [msgpack.packb({"v": 1, "kind": "stage", "seq_id": "s", "step": 0,
                        "tensors": [["t", "float32", [4]]]}), b"123"],
        [msgpack.packb({"v": 1, "kind": "vote", "epoch": -3, "granted": True})],
        [msgpack.packb({"v": 1, "kind": "ping", "req": 1}), b"extra frame"],
        [rng.randbytes(2 * 1024 * 1024)],  # over the control channel's frame limit
    ]
    context = zmq.Context()
    for target in targets:
        for port in target["ports"]:
            for payload in (rng.randbytes(4096), b"\xff" + bytes(8) + b"\x7f" + rng.randbytes(100)):
                with socket.create_connection((target["address"], port), timeout=2) as conn:
                    conn.sendall(payload)
                sent["tcp"] += 1
            plain = context.socket(zmq.DEALER)
            plain.linger = 0
            plain.connect(f"tcp://{target['address']}:{port}")
            for frames in junk_messages[:3]:  # queued, then refused at the handshake
                plain.send_multipart(frames)
                sent["zmq_null"] += 1
            plain.close()
        if member_keys:
            for port in target["ports"][1:]:  # control and data admit member keys
                sock = context.socket(zmq.DEALER)
                sock.linger = 1000
                sock.curve_publickey = member_keys["public_key"].encode()
                sock.curve_secretkey = member_keys["secret_key"].encode()
                sock.curve_serverkey = target["public_key"].encode()
                sock.connect(f"tcp://{target['address']}:{port}")
                for frames in junk_messages:
                    sock.send_multipart(frames)
                    sent["member"] += 1
                sock.close()
    context.destroy(linger=2000)
    return sent


def main(argv: list[str]) -> int:
    command, spec = argv[0], json.loads(argv[1])
    if command == "curve-probe":
        result = curve_probe(spec["address"], spec["port"], spec["server_key"], spec["timeout"])
    elif command == "garbage":
        result = garbage(spec["targets"], spec.get("member_keys"))
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
