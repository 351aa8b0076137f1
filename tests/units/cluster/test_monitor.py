"""Local readings: sizes, memory caps, CPU load of other processes, battery."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from netns import wait_for

from peerd.cluster.monitor import (
    MAX_LOAD,
    BatterySource,
    CpuSample,
    CpuSampler,
    LoadMeter,
    Monitor,
    on_mains,
    parse_size,
    read_memory,
)
from peerd.errors import PeerdError
from peerd.wire.protocol import Battery


@pytest.mark.parametrize(
    "text, size",
    [
        ("300MB", 300_000_000),
        ("2GiB", 2 * 2**30),
        ("1048576", 1048576),
        ("1.5GB", 1_500_000_000),
        (" 2 gib ", 2 * 2**30),
        ("512KiB", 512 * 1024),
        ("64k", 64_000),
        ("1TB", 10**12),
    ],
)
def test_sizes_parse_in_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "abc", "10XB", "-5MB", "0", "0.0001B", "1.2.3GB"])
def test_bad_sizes_are_refused_with_an_example(text):
    with pytest.raises(PeerdError, match="size"):
        parse_size(text)


def test_memory_budget_caps_both_figures():
    uncapped = read_memory(None)
    assert 0 < uncapped.available <= uncapped.total
    capped = read_memory(1000)
    assert capped.total == 1000 and capped.available == min(1000, uncapped.available)


class FakeCpu:
    def __init__(self, *samples):
        self.samples = list(samples)

    def __call__(self) -> CpuSample:
        return self.samples.pop(0)


def test_load_counts_only_other_processes_cpu_time():
    meter = LoadMeter(FakeCpu(
        CpuSample(busy_s=100.0, peerd_s={1: 10.0}, wall_s=0.0),
        CpuSample(busy_s=103.0, peerd_s={1: 11.0}, wall_s=2.0),  # 3 s busy, 1 of them ours
        CpuSample(busy_s=103.5, peerd_s={1: 11.5}, wall_s=3.0),  # all of it ours
        CpuSample(busy_s=110.0, peerd_s={1: 11.5}, wall_s=4.0),  # more than the machine: clamped
        CpuSample(busy_s=111.0, peerd_s={1: 11.5, 2: 0.5}, wall_s=5.0),  # a new peerd process
    ), cpus=2)
    assert meter.read() == pytest.approx(0.5)
    assert meter.read() == pytest.approx(0.0)
    assert meter.read() == MAX_LOAD, "a busy peer is slow, never unusable"
    assert meter.read() == pytest.approx(0.25)


def test_cpu_samples_see_this_process_working():
    sample = CpuSampler()
    before = sample()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    after = sample()
    assert after.peerd_s[os.getpid()] - before.peerd_s[os.getpid()] >= 0.15
    assert after.busy_s - before.busy_s >= 0.15
    assert 0.0 <= LoadMeter().read() <= 1.0


def test_a_child_that_has_ended_counts_as_this_daemon_s_work():
    """A shard child's seconds are peerd's while it runs and after it has been reaped."""
    sample = CpuSampler()
    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    before = sample()
    subprocess.run([sys.executable, "-c", busy], check=True)
    after = sample()
    ours = sum(s - before.peerd_s.get(pid, 0.0) for pid, s in after.peerd_s.items())
    assert ours >= 0.25


BUSY = "while True: pass"


def test_children_started_after_a_reading_count_as_this_daemon_s_work_and_theirs_too():
    """The sampler remembers the processes it has seen; one started since, and its own
    child, are still found."""
    sample = CpuSampler()
    sample()
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        f"subprocess.run([sys.executable, '-c', {BUSY!r}])")])
    try:
        wait_for(lambda: psutil.Process(parent.pid).children(), 60, "the grandchild to start")
        grandchild = psutil.Process(parent.pid).children()[0]
        wait_for(lambda: grandchild.cpu_times().user >= 0.2, 60, "the grandchild to run")
        assert {parent.pid, grandchild.pid} <= set(sample().peerd_s)
    finally:
        for process in psutil.Process(parent.pid).children(recursive=True):
            process.kill()
        parent.kill()
        parent.wait()


def _orphan(script: Path) -> psutil.Process:
    """Run `script` in a process whose parent has ended: not this process's descendant."""
    started = subprocess.run([sys.executable, "-c", (
        "import subprocess, sys\n"
        f"print(subprocess.Popen([sys.executable, {str(script)!r}],"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")],
        check=True, capture_output=True, text=True)
    return psutil.Process(int(started.stdout))


@pytest.mark.parametrize("name, counted", [("peerd", True), ("other-program", False)])
def test_another_process_counts_as_peerd_s_by_its_command_line(tmp_path, name, counted):
    script = tmp_path / name
    script.write_text(BUSY)
    sample = CpuSampler()
    sample()
    process = _orphan(script)
    try:
        wait_for(lambda: process.cpu_times().user >= 0.1, 60, "the process to run")
        assert (process.pid in sample().peerd_s) is counted
        assert (process.pid in sample().peerd_s) is counted, "and once it is known"
    finally:
        process.kill()


def _write(path, **content):
    path.write_text(json.dumps(content))


def test_battery_file_is_re_read_and_a_bad_update_keeps_the_last_good_value(tmp_path):
    path = tmp_path / "battery.json"
    _write(path, percent=80, plugged=True)
    source = BatterySource(str(path))
    assert source.read() == Battery(80.0, True)
    _write(path, percent=15.5, plugged=False)
    assert source.read() == Battery(15.5, False)
    path.write_text("{not json")
    assert source.read() == Battery(15.5, False)


@pytest.mark.parametrize(
    "content",
    ['{"percent": 120, "plugged": true}', '{"percent": 50, "plugged": "yes"}', '{"percent": 5}',
     "[]", "nonsense"],
)
def test_a_bad_battery_file_at_start_is_a_clear_error(tmp_path, content):
    path = tmp_path / "battery.json"
    path.write_text(content)
    with pytest.raises(PeerdError, match="--battery-file"):
        BatterySource(str(path))


def test_missing_battery_file_is_a_clear_error(tmp_path):
    with pytest.raises(PeerdError, match="--battery-file"):
        BatterySource(str(tmp_path / "absent.json"))


def test_power_source():
    assert on_mains(None) and on_mains(Battery(10, True)) and not on_mains(Battery(90, False))


async def test_figures_combine_every_reading(tmp_path):
    path = tmp_path / "battery.json"
    _write(path, percent=42, plugged=False)
    monitor = Monitor("p1", 123_000, str(path), "tiny-model")
    figures = await monitor.figures()
    assert figures.id == "p1" and figures.flops > 0
    assert figures.memory_total == 123_000 and figures.memory_available <= 123_000
    assert figures.battery == Battery(42.0, False) and figures.model == "tiny-model"
    assert 0 <= figures.load <= 1 and figures.units == ()
