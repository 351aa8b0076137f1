"""Waiting in async tests: on a condition with a deadline, never on a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from peerd import protocol
from peerd.transport import Transport, TransportError


async def eventually(condition: Callable[[], Any], what: str, timeout: float = 5.0) -> Any:
    """The first truthy value of `condition()`, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return value


async def answered(transport: Transport, peer: str, timeout: float = 5.0) -> Any:
    """The answer to a ping to `peer`, retried until its CURVE handshake is done."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await transport.request(peer, protocol.Ping(req=0), 0.5)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
