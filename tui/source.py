"""The dashboard's connection to its local daemon (the local API's Unix socket, asyncio).

`DaemonSource` sends one request per connection and reads the answer lines: `status` (the
status document), `subscribe` (the event stream) and `chat` (token events, then done).
`Feed` keeps the dashboard current without polling: one subscription, and a status fetch
whenever an event says that something changed (fetches coalesce while one is running). A
subscription starts with the daemon's recent events; after a reconnection those already
passed on are skipped (by their publication time). When the daemon goes away the feed says
why and connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

from peerd import statedir
from peerd.errors import PeerdError

ANSWER_LIMIT = 64 * 2**20  # the longest answer line read (a status document of many peers)
RECONNECT_S = 1.0

Document = dict[str, Any]


class DaemonSource:
    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.path = statedir.socket_path(state_dir)

    async def answers(self, request: Document) -> AsyncGenerator[Document, None]:
        """Send `request` on a new connection and yield its answer lines until the daemon
        closes it; leaving the loop early closes the connection (which cancels a chat)."""
        reader, writer = await self._connect()
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            while line := await reader.readline():
                yield json.loads(line)
        except (ConnectionError, ValueError) as exc:
            raise PeerdError(f"lost the daemon at {self.path}: {exc}") from None
        finally:
            writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_unix_connection(str(self.path), limit=ANSWER_LIMIT)
        except (FileNotFoundError, ConnectionRefusedError):
            raise PeerdError(
                f"no daemon is running for {self.state_dir} (start one: peerd start)"
            ) from None
        except OSError as exc:
            raise PeerdError(f"cannot reach the daemon at {self.path}: {exc.strerror}") from None

    async def status(self) -> Document:
        async with contextlib.aclosing(self.answers({"op": "status"})) as answers:
            async for answer in answers:
                return _accepted(answer)["status"]
        raise PeerdError("the daemon closed the connection without answering")

    async def events(self) -> AsyncIterator[Document]:
        """The daemon's events as they happen; ends when the daemon closes the stream."""
        async with contextlib.aclosing(self.answers({"op": "subscribe"})) as answers:
            if (first := await anext(answers, None)) is None:
                raise PeerdError("the daemon closed the connection without answering")
            _accepted(first)
            async for event in answers:
                yield event

    async def chat(self, request: Document) -> AsyncIterator[Document]:
        """The token events of one answer, then its done event; an error answer raises."""
        async with contextlib.aclosing(self.answers({"op": "chat", **request})) as answers:
            async for event in answers:
                yield _accepted(event)
                if event.get("event") == "done":
                    return
        raise PeerdError("the daemon closed the connection before the answer was complete")


def _accepted(answer: Document) -> Document:
    if answer.get("ok") is False:
        raise PeerdError(answer.get("error", "the daemon refused the request"))
    return answer


class Feed:
    """Calls `on_status(document)` and `on_event(event)` as the daemon's state changes, and
    `on_trouble(reason)` while the daemon cannot be reached."""

    def __init__(
        self,
        source: DaemonSource,
        on_status: Callable[[Document], object],
        on_event: Callable[[Document], object],
        on_trouble: Callable[[str], object],
    ):
        self.source = source
        self.on_status = on_status
        self.on_event = on_event
        self.on_trouble = on_trouble
        self._stale = asyncio.Event()
        self._last_at = 0.0  # when the newest event passed on was published

    def changed(self) -> None:
        """Fetch the status again (something this client did changed it)."""
        self._stale.set()

    async def run(self) -> None:
        while True:
            try:
                await self._follow()
            except* PeerdError as trouble:
                self.on_trouble(str(trouble.exceptions[0]))
            await asyncio.sleep(RECONNECT_S)

    async def _follow(self) -> None:
        self._stale.set()  # a fresh connection starts with a fresh status
        async with asyncio.TaskGroup() as group:
            group.create_task(self._listen())
            group.create_task(self._refresh())

    async def _listen(self) -> None:
        async for event in self.source.events():
            at = event.get("at")
            if isinstance(at, int | float):
                if at <= self._last_at:
                    continue  # kept history already passed on before a reconnection
                self._last_at = at
            self.on_event(event)
            self._stale.set()
        raise PeerdError("the daemon closed the event stream")

    async def _refresh(self) -> None:
        while True:
            await self._stale.wait()
            self._stale.clear()
            self.on_status(await self.source.status())
