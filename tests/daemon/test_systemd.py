"""The systemd units and sd_notify.

The units pass `systemd-analyze verify` with the ExecStart binary pointed at this
environment's `peerd`, and the system unit's sandbox rates "OK" in `systemd-analyze security`.
A real `peerd start`, with $NOTIFY_SOCKET naming a datagram socket the test binds (standing in
for systemd), reports ready once its local API answers, feeds a 1 s watchdog every half second
and says it is stopping on `peerd stop`.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerd.commands import client
from peerd.daemon.sd_notify import Notifier, parse_address, parse_watchdog
from peerd.errors import PeerdError

REPO = Path(__file__).resolve().parents[2]
SYSTEM_UNIT = REPO / "systemd" / "peerd.service"
USER_UNIT = REPO / "systemd" / "user" / "peerd.service"
PEERD = [sys.executable, "-m", "peerd"]
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
MAX_EXPOSURE = 20  # systemd-analyze's tenths: 2.0 is within its "OK" band

needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (.ci/run installs it)"
)


# -- the unit files ---------------------------------------------------------------------------


def installed_copy(unit: Path, directory: Path) -> Path:
    """A copy of ``unit`` whose ExecStart runs this environment's `peerd` entry point, as an
    installation would; the rest of the unit is unchanged."""
    peerd = shutil.which("peerd", path=str(Path(sys.executable).parent))
    assert peerd, "the peerd entry point is not installed next to this Python"
    text, count = re.subn(
        r"^ExecStart=\S+/peerd start ", f"ExecStart={peerd} start ", unit.read_text(),
        flags=re.MULTILINE,
    )
    assert count == 1, f"{unit} has no ExecStart=.../peerd start line"
    directory.mkdir(exist_ok=True)
    copy = directory / unit.name
    copy.write_text(text)
    return copy


def analyze(*args: str, runtime_dir: Path) -> subprocess.CompletedProcess:
    # A --user run needs $XDG_RUNTIME_DIR; no user manager runs here.
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)}
    return subprocess.run(
        [SYSTEMD_ANALYZE, *args], capture_output=True, text=True, env=env, timeout=60
    )


def verify_problems(unit: Path, tmp_path: Path, *scope: str) -> list[str]:
    """What `systemd-analyze verify` says about the unit file itself (its exit status and
    every line naming the file); empty when it passes cleanly."""
    runtime_dir = tmp_path / "runtime"
    runtime_dir.mkdir(mode=0o700, exist_ok=True)
    result = analyze(*scope, "verify", str(unit), runtime_dir=runtime_dir)
    problems = [line for line in result.stderr.splitlines() if unit.name in line]
    if result.returncode != 0:
        problems.append(f"exit status {result.returncode}: {result.stderr.strip()}")
    return problems


@needs_systemd_analyze
@pytest.mark.parametrize(
    "unit, scope", [(SYSTEM_UNIT, ()), (USER_UNIT, ("--user",))], ids=["system", "user"]
)
def test_the_units_pass_systemd_analyze_verify(tmp_path, unit, scope):
    copy = installed_copy(unit, tmp_path / "units")
    assert verify_problems(copy, tmp_path, *scope) == []


@needs_systemd_analyze
@pytest.mark.parametrize(
    "setting, broken, reported",
    [("ProtectSystem=", "ProtectSystems=", "ProtectSystems"),
     ("LimitNOFILE=65536", "LimitNOFILE=lots", "lots")],
)
def test_verify_reports_a_broken_unit(tmp_path, setting, broken, reported):
    copy = installed_copy(SYSTEM_UNIT, tmp_path / "units")
    copy.write_text(copy.read_text().replace(setting, broken))
    assert any(reported in line for line in verify_problems(copy, tmp_path))


@needs_systemd_analyze
def test_the_system_unit_is_sandboxed(tmp_path):
    copy = installed_copy(SYSTEM_UNIT, tmp_path / "units")
    result = analyze(
        "security", "--offline=yes", f"--threshold={MAX_EXPOSURE}", "--no-pager", str(copy),
        runtime_dir=tmp_path,
    )
    assert result.returncode == 0, result.stdout.splitlines()[-1:]


def test_both_units_wait_for_readiness_and_keep_the_watchdog():
    for unit in (SYSTEM_UNIT, USER_UNIT):
        lines = set(unit.read_text().splitlines())
        assert {"Type=notify", "NotifyAccess=main", "Restart=on-failure"} <= lines, unit
        assert any(line.startswith("WatchdogSec=") for line in lines), unit


def test_both_units_raise_the_open_file_limit():
    """systemd's default soft limit, 1024, is less than the HTTP connection cap plus the
    daemon's own sockets need; the verify tests above check that systemd accepts the value."""
    for unit in (SYSTEM_UNIT, USER_UNIT):
        assert "LimitNOFILE=65536" in unit.read_text().splitlines(), unit


# -- sd_notify ---------------------------------------------------------------------------------


class ServiceManager:
    """The test's stand-in for systemd's end of $NOTIFY_SOCKET."""

    def __init__(self, address: str):
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(address)
        self.received: list[tuple[float, dict[str, str]]] = []
        self.service: subprocess.Popen | None = None  # whose exit ends every wait

    def next(self, deadline: float) -> dict[str, str]:
        """The next notification; fails at the deadline, or once the daemon has exited and
        everything it sent has been read."""
        while True:
            exited = self.service is not None and self.service.poll() is not None
            left = deadline - time.monotonic()
            self.socket.settimeout(0 if exited else max(0, min(left, 0.5)))
            try:
                data = self.socket.recv(4096)
                break
            except (TimeoutError, BlockingIOError):
                if exited:
                    raise AssertionError(f"the daemon exited; got {self.received}") from None
                if left <= 0:
                    raise AssertionError(f"no notification in time; got {self.received}") from None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.received.append((time.monotonic(), fields))
        return fields

    def wait_for(self, name: str, timeout: float) -> dict[str, str]:
        """The next notification that sets ``name``."""
        deadline = time.monotonic() + timeout
        while name not in (fields := self.next(deadline)):
            pass
        return fields

    def times_of(self, name: str) -> list[float]:
        return [at for at, fields in self.received if name in fields]

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def manager(tmp_path):
    manager = ServiceManager(str(tmp_path / "notify"))
    yield manager
    manager.close()


@pytest.fixture
def state_dir(tmp_path):
    state_dir = tmp_path / "state"
    init = subprocess.run(
        [*PEERD, "init", "--state-dir", str(state_dir), "--name", "unit"],
        capture_output=True, text=True, timeout=60,
    )
    assert init.returncode == 0, init.stderr
    return state_dir


def start_under(manager: ServiceManager, state_dir: Path, **env: str) -> subprocess.Popen:
    """`peerd start` as systemd runs it: $WATCHDOG_PID is the daemon's own pid (the shell
    execs it), plus ``env``."""
    with (state_dir / "daemon.log").open("w") as log:
        manager.service = subprocess.Popen(
            ["sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh", *PEERD, "start", "--state-dir",
             str(state_dir), "--interface", "127.0.0.1"],
            env={**os.environ, "NOTIFY_SOCKET": manager.socket.getsockname(), **env},
            stdout=log, stderr=subprocess.STDOUT,
        )
    return manager.service


@pytest.mark.cluster
def test_the_daemon_notifies_ready_feeds_the_watchdog_and_notifies_stopping(manager, state_dir):
    daemon = start_under(manager, state_dir, WATCHDOG_USEC="1000000")
    try:
        ready = manager.wait_for("READY", timeout=60)
        assert ready["READY"] == "1" and "unit ready" in ready["STATUS"]
        # READY comes only once the local API answers: no retry needed here.
        assert client.call(state_dir, {"op": "status"})["status"]["name"] == "unit"

        deadline = time.monotonic() + 30
        while len(manager.times_of("WATCHDOG")) < 6:
            manager.next(deadline)
        pings = manager.times_of("WATCHDOG")
        gaps = [later - earlier for earlier, later in itertools.pairwise(pings)]
        assert 0.4 <= statistics.median(gaps) <= 0.9, gaps  # half of the 1 s timeout

        stop = subprocess.run([*PEERD, "stop", "--state-dir", str(state_dir)],
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert manager.wait_for("STOPPING", timeout=30)["STOPPING"] == "1"
        assert daemon.wait(timeout=30) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=10)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "env, reason",
    [
        ({"NOTIFY_SOCKET": "relative/notify"}, "NOTIFY_SOCKET='relative/notify' is not supported"),
        ({"WATCHDOG_USEC": "soon"}, "WATCHDOG_USEC='soon' is not a positive number"),
    ],
)
def test_bad_notify_settings_fail_the_start_with_one_line(manager, state_dir, env, reason):
    daemon = start_under(manager, state_dir, **env)
    assert daemon.wait(timeout=60) == 1
    output = (state_dir / "daemon.log").read_text().strip()
    assert reason in output and len(output.splitlines()) == 1, output


def test_an_abstract_socket_receives_the_notifications():
    name = f"peerd-test-{os.getpid()}"
    manager = ServiceManager("\0" + name)
    try:
        notifier = Notifier(parse_address("@" + name))
        notifier.ready("up")
        notifier.stopping()
        assert manager.wait_for("READY", timeout=5) == {"READY": "1", "STATUS": "up"}
        assert manager.wait_for("STOPPING", timeout=5)["STOPPING"] == "1"
    finally:
        manager.close()


def test_the_notify_variables_are_taken_out_of_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = Notifier.from_environment()
    assert notifier == Notifier(str(tmp_path / "notify"), 3.0)
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(os.environ)


def test_without_a_notify_socket_there_is_no_watchdog(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    assert Notifier.from_environment() == Notifier(None, None)


@pytest.mark.parametrize(
    "usec, pid, expected",
    [("", "", None), ("2000000", "", 2.0), ("2000000", "42", 2.0), ("2000000", "43", None),
     ("500", "42", 0.0005)],
)
def test_the_watchdog_timeout_is_for_this_process_only(usec, pid, expected):
    assert parse_watchdog(usec, pid, my_pid=42) == expected


@pytest.mark.parametrize("usec", ["0", "-5", "1e6", "²"])
def test_a_malformed_watchdog_timeout_is_refused(usec):
    with pytest.raises(PeerdError, match="WATCHDOG_USEC"):
        parse_watchdog(usec, "", my_pid=42)
