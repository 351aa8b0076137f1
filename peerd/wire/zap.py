"""The ZAP handler: libzmq asks it whether a CURVE client may finish its handshake.

Each socket names a ZAP domain (its channel). A client is admitted when its public key is on
that domain's allowlist; the reply's user id is the key in Z85, which the transport reads
back from every message (the ``User-Id`` property) to know who sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio
from zmq.utils import z85

log = logging.getLogger("peerd.wire.zap")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"


class ZapHandler:
    def __init__(self, context: zmq.asyncio.Context):
        self._context = context
        self._allowed: dict[str, set[str]] = {}
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self.denied = 0

    def allow(self, domain: str, public_key: str) -> None:
        self._allowed.setdefault(domain, set()).add(public_key)

    def forbid(self, domain: str, public_key: str) -> None:
        self._allowed.get(domain, set()).discard(public_key)

    def is_allowed(self, domain: str, public_key: str) -> bool:
        return public_key in self._allowed.get(domain, ())

    def start(self) -> None:
        """Bind before any CURVE server socket exists: libzmq admits everyone without one."""
        self._socket = self._context.socket(zmq.REP)
        self._socket.linger = 0
        self._socket.bind(ZAP_ENDPOINT)
        self._task = asyncio.create_task(self._serve(), name="zap")

    async def _serve(self) -> None:
        assert self._socket is not None
        while True:
            request = await self._socket.recv_multipart()
            await self._socket.send_multipart(self.answer(request))

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply frames for one request (RFC 27)."""
        request_id = request[1] if len(request) > 1 else b""
        if len(request) < 7 or request[0] != ZAP_VERSION or request[5] != b"CURVE":
            return self._deny(request_id, "unsupported request", b"")
        domain = request[2].decode("utf-8", "replace")
        client_key = request[6]
        if len(client_key) != 32:
            return self._deny(request_id, "bad key", request[3])
        key = z85.encode(client_key).decode("ascii")
        if not self.is_allowed(domain, key):
            return self._deny(request_id, "not a member", request[3])
        return [ZAP_VERSION, request_id, b"200", b"OK", key.encode("ascii"), b""]

    def _deny(self, request_id: bytes, reason: str, address: bytes) -> list[bytes]:
        self.denied += 1
        if self.denied <= 10 or self.denied % 100 == 0:  # a flood cannot fill the log
            log.warning(
                "refused a CURVE handshake from %s: %s (%d refused so far)",
                address.decode("ascii", "replace") or "?", reason, self.denied,
            )
        return [ZAP_VERSION, request_id, b"400", reason.encode(), b"", b""]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._socket is not None:
            self._socket.close(linger=0)
