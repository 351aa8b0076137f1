"""One real daemon on loopback (no root needed): it leads itself, answers `peerd status`,
refuses a second daemon on its state dir, switches rebalancing off and on, shrugs off
dashboard subscribers that vanish, and stops cleanly on `peerd stop` or SIGTERM."""

import json
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from netns import FORMED_S

from peerd import statedir
from peerd.commands import client
from peerd.errors import PeerdError

pytestmark = pytest.mark.cluster

PEERD = [sys.executable, "-m", "peerd"]


def _peerd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PEERD, *args], capture_output=True, text=True, timeout=timeout)


def _wait_until_leading(state_dir, process, timeout: float = FORMED_S) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the daemon exited"
        try:
            status = client.call(state_dir, {"op": "status"})["status"]
        except PeerdError:
            status = None
        if status and status["leader"] == status["self"] and status["measured_epoch"]:
            return status
        time.sleep(0.1)
    raise AssertionError("the daemon did not come up as its own leader")


@pytest.fixture
def daemon(tmp_path):
    assert _peerd("init", "--state-dir", str(tmp_path), "--name", "solo").returncode == 0
    log = tmp_path / "daemon.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [*PEERD, "start", "--state-dir", str(tmp_path), "--interface", "127.0.0.1",
             "--memory-budget", "300MB"],
            stdout=output, stderr=subprocess.STDOUT,
        )
    process.log = log
    yield tmp_path, process
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def test_a_lone_daemon_leads_itself_and_reports_its_figures(daemon):
    state_dir, process = daemon
    status = _wait_until_leading(state_dir, process)
    me = status["peers"][0]
    assert me["self"] and me["name"] == "solo" and me["flops"] > 0
    assert me["memory_total"] == 300_000_000 and me["links"] == []
    table = _peerd("status", "--state-dir", str(state_dir))
    assert table.returncode == 0 and "solo" in table.stdout and "leader  solo" in table.stdout


def test_a_second_daemon_on_the_same_state_dir_is_refused(daemon):
    state_dir, process = daemon
    _wait_until_leading(state_dir, process)
    second = _peerd("start", "--state-dir", str(state_dir), "--interface", "127.0.0.1")
    assert second.returncode == 1 and "already running" in second.stderr


def test_rebalancing_is_switched_off_and_on_through_the_local_api(daemon):
    state_dir, process = daemon
    assert _wait_until_leading(state_dir, process)["rebalance"] is True
    assert client.call(state_dir, {"op": "rebalance", "enabled": False})["rebalance"] is False
    assert client.call(state_dir, {"op": "status"})["status"]["rebalance"] is False
    with pytest.raises(PeerdError, match='"enabled" must be true or false'):
        client.call(state_dir, {"op": "rebalance", "enabled": "no"})
    client.call(state_dir, {"op": "rebalance", "enabled": True})
    assert client.call(state_dir, {"op": "status"})["status"]["rebalance"] is True


SUBSCRIBERS = 50


def _subscribed(state_dir) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(statedir.socket_path(state_dir)))
    sock.sendall(b'{"op": "subscribe"}\n')
    assert json.loads(sock.makefile("rb").readline()) == {"ok": True, "subscribed": True}
    return sock


def test_subscribers_that_vanish_leave_no_traceback_and_the_daemon_serves_on(daemon):
    state_dir, process = daemon
    _wait_until_leading(state_dir, process)
    logged = len(process.log.read_text())
    subscribers = [_subscribed(state_dir) for _ in range(SUBSCRIBERS)]
    for sock in subscribers:  # abruptly: a reset, unread events left behind
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    closed = time.time()
    with _subscribed(state_dir) as watcher:
        events = watcher.makefile("rb")
        published_since = 0  # the kept events from before come first
        while published_since < 2:  # two rounds published since: each went to the vanished ones
            published_since += json.loads(events.readline())["at"] > closed
    assert client.call(state_dir, {"op": "status"})["status"]["self"]
    assert process.poll() is None
    since = process.log.read_text()[logged:]
    assert "Traceback" not in since
    assert not [line for line in since.splitlines() if " WARNING " in line or " ERROR " in line]


def test_peerd_stop_ends_the_daemon_cleanly(daemon):
    state_dir, process = daemon
    _wait_until_leading(state_dir, process)
    stop = _peerd("stop", "--state-dir", str(state_dir))
    assert stop.returncode == 0, stop.stderr
    assert process.wait(timeout=15) == 0
    assert not statedir.socket_path(state_dir).exists()
    assert "stopped" in process.log.read_text()


def test_sigterm_ends_the_daemon_cleanly(daemon):
    state_dir, process = daemon
    _wait_until_leading(state_dir, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
    assert not statedir.socket_path(state_dir).exists()


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--interface", "eth0"], "not an IP address"),
        (["--memory-budget", "12XB"], "not a size"),
        (["--peer", "nowhere"], "HOST:PORT"),
        (["--port", "65535"], "out of range"),
        (["--battery-file", "/nonexistent.json"], "--battery-file"),
        (["--standalone"], "give --early-exit or --speculative too"),
        (["--early-exit", "-1"], "--early-exit must be a number >= 0"),
    ],
)
def test_bad_start_options_fail_with_one_line(tmp_path, args, reason):
    _peerd("init", "--state-dir", str(tmp_path))
    result = _peerd("start", "--state-dir", str(tmp_path), *args)
    assert result.returncode == 1
    assert reason in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_start_without_a_cluster_says_how_to_make_one(tmp_path):
    result = _peerd("start", "--state-dir", str(tmp_path))
    assert result.returncode == 1 and "peerd init" in result.stderr
