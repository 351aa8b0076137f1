"""Resident memory of processes, sampled while a benchmark runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

SAMPLE_S = 0.1


@dataclass
class PeakRss:
    """The highest RSS of each process so far, by pid, and how many samples were taken."""

    peak: dict[int, int] = field(default_factory=dict)
    samples: int = 0


@contextmanager
def peak_rss(pids: list[int], every_s: float = SAMPLE_S) -> Iterator[PeakRss]:
    """Sample the RSS of the processes `pids` every `every_s` while inside."""
    processes = [psutil.Process(pid) for pid in pids]
    log = PeakRss({p.pid: p.memory_info().rss for p in processes})
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            for process in processes:
                log.peak[process.pid] = max(log.peak[process.pid], process.memory_info().rss)
            log.samples += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield log
    finally:
        stop.set()
        sampler.join()
