"""`peerd demo` as a new user runs it: the first run shards the built-in model into the
user's cache directory and the second reuses those units as they are, starting no `peerd
shard` at all; nothing of either is left in the temporary directory, nor after Ctrl-C or
SIGTERM mid-demo, nor any daemon.

Each run gets its own cache directory (PEERD_CACHE_DIR) and temporary directory (TMPDIR).
Every Python process a run starts records its command line (a sitecustomize module on
PYTHONPATH), so the test sees which children it started. How much faster the second run is,
is bench/demo_cache.py's to measure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerd.commands.demo import CACHE_SUBDIR

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

DEMO = [sys.executable, "-m", "peerd", "demo"]
DEMO_S = 600
STARTED_S = 300
LEFT_S = 60  # for an ending demo to stop its daemons and remove its directory
# sitecustomize.py: every Python process appends its command line to $PEERD_TEST_COMMANDS
RECORD_COMMAND = """
import os, sys
if "PEERD_TEST_COMMANDS" in os.environ:
    with open(os.environ["PEERD_TEST_COMMANDS"], "a") as log:
        log.write(" ".join(sys.orig_argv) + "\\n")
"""


class Demo:
    """The environment of a user's `peerd demo`: a cache and a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.cache = root / "cache"
        self.tmp = root / "tmp"
        self.tmp.mkdir(parents=True)
        probe = root / "probe"
        probe.mkdir()
        (probe / "sitecustomize.py").write_text(RECORD_COMMAND)
        self.commands = root / "commands"
        path = os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PEERD_CACHE_DIR": str(self.cache), "TMPDIR": str(self.tmp),
                    "PYTHONPATH": path, "PEERD_TEST_COMMANDS": str(self.commands)}
        self.first = ""  # what the first run printed
        self.first_commands: list[str] = []  # the Python processes it started

    def run(self) -> str:
        self.commands.unlink(missing_ok=True)
        done = subprocess.run(DEMO, env=self.env, capture_output=True, text=True,
                              timeout=DEMO_S)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def python_commands(self) -> list[str]:
        """The command lines of the Python processes the last run started, itself first."""
        return self.commands.read_text().splitlines()

    def start(self) -> subprocess.Popen:
        """A demo in a session of its own, as a terminal's foreground job is."""
        return subprocess.Popen(DEMO, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def units(self) -> dict[str, tuple[int, int]]:
        """Every file in the demo's shard cache: its inode and modification time."""
        root = self.cache / CACHE_SUBDIR
        return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
                for p in root.rglob("*") if p.is_file()}

    def leftovers(self) -> list[Path]:
        return sorted(self.tmp.glob("peerd-demo-*"))


def _demo_dir(output: str) -> str:
    return re.search(r"^demo directory: (\S+)$", output, re.MULTILINE).group(1)


def _processes_in(directory: str) -> list[str]:
    """Command lines of the processes that name `directory` (a daemon names its state dir)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # the process ended meanwhile
        if directory in text:
            found.append(text)
    return found


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A user's demo environment after a first run: the units in its cache."""
    demo = Demo(tmp_path_factory.mktemp("demo"))
    demo.first = demo.run()
    demo.first_commands = demo.python_commands()
    return demo


def _shards(commands: list[str]) -> list[str]:
    return [c for c in commands if re.search(r" -m peerd shard ", c)]


def test_the_second_demo_reuses_the_units_the_first_made_and_both_leave_no_trace(demo):
    assert re.search(r"made 18 units in [\d.]+s: " + re.escape(str(demo.cache)), demo.first)
    made = demo.units()
    assert any(name.endswith("manifest.json") for name in made)
    assert demo.leftovers() == []

    assert _shards(demo.first_commands), "the first run sharded in a `peerd shard` child"

    second = demo.run()
    assert f"reused the 18 units in {demo.cache / CACHE_SUBDIR}" in second
    assert "made 18 units" not in second
    started = demo.python_commands()
    assert len([c for c in started if " -m peerd start " in c]) == 3, started
    assert _shards(started) == [], "neither the demo nor the model peer started `peerd shard`"
    assert demo.units() == made, "the second run wrote no unit file"
    assert "peer2> " in second and "24 tokens" in second
    assert demo.leftovers() == []
    assert _processes_in(_demo_dir(second)) == []


@pytest.mark.parametrize("ending", ["ctrl-c", "sigterm"])
def test_a_demo_ended_mid_way_stops_its_daemons_and_removes_its_directory(demo, ending):
    process = demo.start()
    try:
        lines = []
        deadline = time.monotonic() + STARTED_S
        while not any("peers; " in line for line in lines):  # the daemons are up
            assert time.monotonic() < deadline, "".join(lines)
            line = process.stdout.readline()
            assert line, "the demo ended early:\n" + "".join(lines)
            lines.append(line)
        if ending == "ctrl-c":  # the terminal signals its whole foreground job
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGTERM)
        process.communicate(timeout=LEFT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == (130 if ending == "ctrl-c" else 128 + signal.SIGTERM)
    assert demo.leftovers() == []
    assert _processes_in(_demo_dir("".join(lines))) == []
