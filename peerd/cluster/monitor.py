"""Local readings a peer reports about itself: memory, CPU load of others, battery."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psutil

from peerd.cluster.benchmark import SpeedMeter
from peerd.errors import PeerdError
from peerd.wire.protocol import Battery, PeerFigures

log = logging.getLogger("peerd.cluster.monitor")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in a size such as ``300MB`` (powers of 1000), ``2GiB`` (1024) or ``4096``."""
    match = _SIZE.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise PeerdError(f"not a size: {text!r} (examples: 300MB, 2GiB, 1048576)")
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise PeerdError(f"size must be positive: {text!r}")
    return size


@dataclasses.dataclass(frozen=True)
class Memory:
    total: int
    available: int


def read_memory(budget: int | None) -> Memory:
    """Physical memory, both figures capped by the --memory-budget."""
    vm = psutil.virtual_memory()
    cap = budget if budget is not None else vm.total
    return Memory(total=min(vm.total, cap), available=min(vm.available, cap))


@dataclasses.dataclass(frozen=True)
class CpuSample:
    busy_s: float  # CPU seconds spent on the cores this daemon may run on
    peerd_s: dict[int, float]  # per pid: CPU seconds of peerd's processes on those cores
    wall_s: float


class _Seen(NamedTuple):
    process: psutil.Process
    peerd: bool  # its command line is peerd's
    parent: int


class CpuSampler:
    """Readings of the cores in this process's CPU affinity: how busy they were, and how
    much of that was peerd (this daemon, its children, other daemons pinned there).

    What never changes about a process, its command line and its parent, is read once, when
    the process is first seen; each reading then reads the times of peerd's processes only.
    Reading every process's command line, affinity and times took 6.4 ms of the daemon's
    event loop every second with 65 processes on the development machine, 0.25 ms this way
    (a home laptop runs hundreds), and on a 2-core machine the three daemons' readings took
    CPU from the stage computing at the time."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._seen: dict[int, _Seen] = {}

    def __call__(self) -> CpuSample:
        cores = _cores()
        per_core = psutil.cpu_times(percpu=True)
        busy = sum(_busy(per_core[i]) for i in cores if i < len(per_core))
        return CpuSample(busy, self._peerd_cpu_s(set(cores)), time.monotonic())

    def _peerd_cpu_s(self, cores: set[int]) -> dict[int, float]:
        """CPU seconds of this process (with the children it has reaped), of its live
        descendants (a shard or share-export child) and of every peerd process confined to
        `cores`. Without the reaped children's seconds, a child's last seconds before it
        ended counted as another program's load."""
        times = self._me.cpu_times()
        seconds = {self._me.pid: times.user + times.system
                   + times.children_user + times.children_system}
        self._refresh()
        for pid, seen in self._seen.items():
            if pid == self._me.pid:
                continue
            try:
                if self._descends(pid) or (seen.peerd and _confined(seen.process, cores)):
                    own = seen.process.cpu_times()
                    seconds[pid] = own.user + own.system
            except psutil.Error:  # it ended meanwhile, or is not ours to read
                continue
        return seconds

    def _refresh(self) -> None:
        live: dict[int, _Seen] = {}
        for process in psutil.process_iter():  # psutil keeps a pid's Process between calls
            seen = self._seen.get(process.pid)
            if seen is None or seen.process is not process:
                seen = _first_look(process)
            if seen is not None:
                live[process.pid] = seen
        self._seen = live

    def _descends(self, pid: int) -> bool:
        for _ in range(len(self._seen)):  # a chain of parents is no longer than that
            seen = self._seen.get(pid)
            if seen is None:
                return False
            if seen.parent == self._me.pid:
                return True
            pid = seen.parent
        return False


def _first_look(process: psutil.Process) -> _Seen | None:
    try:
        return _Seen(process, _is_peerd(process.cmdline()), process.ppid())
    except psutil.AccessDenied:  # another user's, under a /proc that hides it: not peerd
        return _Seen(process, False, 0)
    except psutil.Error:  # it ended meanwhile
        return None


def _confined(process: psutil.Process, cores: set[int]) -> bool:
    return set(process.cpu_affinity()) <= cores


def _cores() -> list[int]:
    try:
        return psutil.Process().cpu_affinity()
    except (AttributeError, psutil.Error):
        return list(range(psutil.cpu_count() or 1))


def _busy(times) -> float:
    return sum(getattr(times, field, 0.0)
               for field in ("user", "nice", "system", "irq", "softirq", "steal"))


def _is_peerd(cmdline: list[str]) -> bool:
    """`peerd ...`, `python .../peerd ...` or `python -m peerd ...`."""
    return any(Path(arg).name == "peerd" for arg in cmdline[:3])


# The most load a reading reports. Cores busy with other work still give peerd its fair
# share of time, so a busy peer is slow, not unusable (the planner excludes load 1).
MAX_LOAD = 0.9


class LoadMeter:
    """Fraction (0..MAX_LOAD) of the cores this daemon may run on used by processes other
    than peerd's, averaged since the previous reading."""

    def __init__(self, sample: Callable[[], CpuSample] | None = None, cpus: int | None = None):
        self._sample = sample or CpuSampler()
        self._cpus = cpus or len(_cores())
        self._last = self._sample()

    def read(self) -> float:
        now = self._sample()
        last, self._last = self._last, now
        wall = now.wall_s - last.wall_s
        if wall <= 0:
            return 0.0
        peerd = sum(s - last.peerd_s.get(pid, 0.0) for pid, s in now.peerd_s.items())
        others = (now.busy_s - last.busy_s) - peerd
        return min(MAX_LOAD, max(0.0, others / (wall * self._cpus)))


def parse_battery(text: str) -> Battery:
    try:
        content = json.loads(text)
        percent, plugged = content["percent"], content["plugged"]
    except (ValueError, KeyError, TypeError):
        raise ValueError('expected {"percent": P, "plugged": true|false}') from None
    if type(percent) not in (int, float) or not 0 <= percent <= 100:
        raise ValueError("percent must be a number from 0 to 100")
    if type(plugged) is not bool:
        raise ValueError("plugged must be true or false")
    return Battery(percent=float(percent), plugged=plugged)


def write_battery_file(path: Path, percent: float, plugged: bool) -> None:
    """Write a --battery-file the way a battery source should: whole, by rename, so the
    daemon never reads half a document."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"percent": percent, "plugged": plugged}))
    temporary.replace(path)


class BatterySource:
    """The battery from --battery-file (re-read at every reading) or from the sensor.

    A file that becomes unreadable while running keeps the last good value, with a warning.
    """

    def __init__(self, path: str | None):
        self._path = Path(path) if path else None
        self._last: Battery | None = None
        if self._path is not None:
            try:
                self._last = parse_battery(self._path.read_text())
            except (OSError, ValueError) as exc:
                raise PeerdError(f"--battery-file {self._path}: {exc}") from None

    def read(self) -> Battery | None:
        if self._path is None:
            return _sensor_battery()
        try:
            self._last = parse_battery(self._path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("keeping the last battery reading: %s: %s", self._path, exc)
        return self._last


def _sensor_battery() -> Battery | None:
    sensors = getattr(psutil, "sensors_battery", None)
    reading = sensors() if sensors else None
    if reading is None:
        return None
    return Battery(percent=min(100.0, max(0.0, float(reading.percent))),
                   plugged=bool(reading.power_plugged))


def on_mains(battery: Battery | None) -> bool:
    return battery is None or battery.plugged


class Monitor:
    """Everything this peer reports about itself when the leader asks."""

    def __init__(
        self,
        peer_id: str,
        memory_budget: int | None,
        battery_file: str | None,
        model: str | None,
    ):
        self._peer_id = peer_id
        self._memory_budget = memory_budget
        self.battery = BatterySource(battery_file)
        self.speeds = SpeedMeter()
        self._load = LoadMeter()
        self._model = model

    async def figures(self) -> PeerFigures:
        speeds = await self.speeds.current()
        memory = read_memory(self._memory_budget)
        return PeerFigures(
            id=self._peer_id,
            flops=speeds.decode,
            prompt_flops=speeds.prompt,
            memory_total=memory.total,
            memory_available=memory.available,
            load=self._load.read(),
            battery=self.battery.read(),
            model=self._model,
            units=(),
        )
