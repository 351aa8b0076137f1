"""sd_notify without libsystemd: tell the service manager (a `Type=notify` unit) that the
daemon is ready, what it is doing and that it is stopping, and keep the unit's watchdog fed.

The protocol: each notification is one datagram of newline-separated ``VAR=value`` lines sent
to the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract
socket). ``$WATCHDOG_USEC`` asks for ``WATCHDOG=1`` at least that often; ``$WATCHDOG_PID``,
when set, names the process it is meant for. Without ``$NOTIFY_SOCKET`` nothing is sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket

from peerd.errors import PeerdError

log = logging.getLogger("peerd.daemon.sd_notify")

VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclasses.dataclass(frozen=True)
class Notifier:
    address: str | None = None  # as the socket module takes it: abstract names start with NUL
    watchdog_s: float | None = None  # the service manager's watchdog timeout

    @classmethod
    def from_environment(cls) -> Notifier:
        """The notifier the environment asks for. The variables are removed from the
        environment, so that child processes (sharding) do not take them as theirs."""
        values = {name: os.environ.pop(name, "") for name in VARIABLES}
        address = parse_address(values["NOTIFY_SOCKET"])
        watchdog_s = parse_watchdog(values["WATCHDOG_USEC"], values["WATCHDOG_PID"], os.getpid())
        return cls(address, watchdog_s if address else None)

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def stopping(self) -> None:
        self._send("STOPPING=1\nSTATUS=stopping")

    async def feed_watchdog(self) -> None:
        """Send WATCHDOG=1 every half watchdog timeout until cancelled. It runs on the daemon's
        event loop on purpose: a hung loop stops the pings, and the service manager then
        restarts the daemon."""
        if self.watchdog_s is None:
            return
        while True:
            self._send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)

    def _send(self, message: str) -> None:
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(message.encode(), self.address)
        except OSError as exc:
            # Never fatal: the daemon works on without a service manager listening.
            log.warning("cannot notify the service manager at %r: %s", self.address, exc)


def parse_address(value: str) -> str | None:
    """The socket address in ``$NOTIFY_SOCKET``; None when it is empty."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    raise PeerdError(
        f"NOTIFY_SOCKET={value!r} is not supported: it must be an absolute path or an "
        "@abstract socket name"
    )


def parse_watchdog(usec: str, pid: str, my_pid: int) -> float | None:
    """The watchdog timeout in seconds from ``$WATCHDOG_USEC``, or None when there is none
    or it is meant for another process (``$WATCHDOG_PID``)."""
    if not usec:
        return None
    if pid and pid != str(my_pid):
        return None
    if not (usec.isascii() and usec.isdigit()) or int(usec) == 0:
        raise PeerdError(f"WATCHDOG_USEC={usec!r} is not a positive number of microseconds")
    return int(usec) / 1e6
