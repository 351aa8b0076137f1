"""Handing freed heap memory back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


def trim() -> None:
    """Hand freed heap pages back to the system. glibc keeps them otherwise, and a process's
    resident memory stays at its last peak: a unit's export, a prefill's activations, the
    FLOP/s measurement."""
    release = _malloc_trim()
    if release is not None:
        release(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
