"""Waiting in async tests: on a condition with a deadline, never on a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from peerd.wire import protocol
from peerd.wire.transport import Transport, TransportError


async def eventually(condition: Callable[[], Any], what: str, timeout: float = 5.0) -> Any:
    """The first truthy value of `condition()`, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return value


async def answered(transport: Transport, peer: str, timeout: float = 5.0,
                   msg: Any = None) -> Any:
    """The answer to `msg` (a ping: the control channel) sent to `peer`, retried until the
    CURVE handshake of the message's channel is done (a socket sends nothing before)."""
    msg = protocol.Ping(req=0) if msg is None else msg
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await transport.request(peer, msg, 0.5)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
