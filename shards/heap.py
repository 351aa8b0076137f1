"""Handing memory a process no longer needs back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable, Iterable
from pathlib import Path

MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now, as memory pressure would


def trim() -> None:
    """Hand freed heap pages back to the system. glibc keeps them otherwise, and a process's
    resident memory stays at its last peak: a unit's export, a prefill's activations, the
    FLOP/s measurement."""
    release = _malloc_trim()
    if release is not None:
        release(0)


def page_out(files: Iterable[Path]) -> int:
    """Hand back the resident pages of this process's mappings of `files`, and return the
    bytes of the mappings advised (0 where the system has no /proc/self/maps or no
    MADV_PAGEOUT). Nothing is lost: a page read again is read back from its file."""
    advise = _madvise()
    if advise is None:
        return 0
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return 0
    wanted = {os.path.realpath(f) for f in files}
    advised = 0
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5] not in wanted:
            continue
        start, end = (int(address, 16) for address in fields[0].split("-"))
        if advise(start, end - start, MADV_PAGEOUT) == 0:
            advised += end - start
    return advised


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return getattr(_libc(), "malloc_trim", None)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    advise = getattr(_libc(), "madvise", None)
    if advise is not None:
        advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return advise
