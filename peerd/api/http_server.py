"""A small, strict HTTP/1.1 server on asyncio streams (for the OpenAI-compatible endpoint).

One request per connection: every answer says ``Connection: close``. A request body needs
``Content-Length`` (no chunked bodies) and at most ``MAX_BODY_BYTES``; the request line and
headers at most ``MAX_HEAD_BYTES``, all of it within ``READ_TIMEOUT_S``. An answer is one
JSON document, or server-sent events (``text/event-stream``, ``data: ...`` per event) that
end when the connection closes. Errors are JSON ``{"error": {"message", "type", "code"}}``
(the shape OpenAI's clients read); one raised after events have started goes out as a last
event.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("peerd.http")

MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 1024 * 1024
READ_TIMEOUT_S = 30.0
LINGER_S = 2.0


class HttpError(Exception):
    """An answer with an error status: `code` is a short machine-readable name."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def document(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code}}


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str  # without the query string
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, ValueError):
            raise HttpError(400, "the request body is not valid JSON", "invalid_json") from None


class Responder:
    """The answer to one request: a JSON document, or a stream of server-sent events."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self.streaming = False

    async def json(self, status: int, document: dict[str, Any]) -> None:
        body = _encode(document)
        self._head(status, "application/json", f"Content-Length: {len(body)}\r\n")
        self._writer.write(body)
        await self._writer.drain()

    async def event(self, data: dict[str, Any] | str) -> None:
        """One event: a JSON document, or a literal such as ``[DONE]``."""
        if not self.streaming:
            self._head(200, "text/event-stream", "Cache-Control: no-cache\r\n")
            self.streaming = True
        payload = data.encode() if isinstance(data, str) else _encode(data)
        self._writer.write(b"data: " + payload + b"\n\n")
        await self._writer.drain()

    async def error(self, error: HttpError) -> None:
        if self.streaming:
            await self.event(error.document())
        else:
            await self.json(error.status, error.document())

    def _head(self, status: int, content_type: str, extra: str) -> None:
        phrase = http.HTTPStatus(status).phrase
        self._writer.write(
            f"HTTP/1.1 {status} {phrase}\r\nContent-Type: {content_type}\r\n{extra}"
            "Connection: close\r\n\r\n".encode()
        )


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]


class HttpServer:
    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port; the port bound (useful when `port` is 0)."""
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_HEAD_BYTES
        )
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        respond = Responder(writer)
        try:
            await self._answer(reader, writer, respond)
            await _linger(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client left
        finally:
            self._connections.discard(task)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      respond: Responder) -> None:
        try:
            try:
                async with asyncio.timeout(READ_TIMEOUT_S):
                    request = await _read_request(reader, writer)
            except TimeoutError:
                raise HttpError(408, "the request was not complete in time", "timeout") from None
            await self._handler(request, respond)
        except HttpError as exc:
            await respond.error(exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception:  # a bug in one answer must not take the endpoint down
            log.exception("answering an HTTP request failed")
            await respond.error(HttpError(500, "internal error", "internal_error"))


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> HttpRequest:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HttpError(431, f"request head over {MAX_HEAD_BYTES} bytes",
                        "head_too_large") from None
    method, path, headers = _parse_head(head)
    if "transfer-encoding" in headers:
        raise HttpError(411, "send the body with Content-Length, not chunked", "length_required")
    length = _content_length(headers.get("content-length", "0"))
    if headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = await reader.readexactly(length)
    return HttpRequest(method, path, headers, body)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then read what the client still sends: closing with data unread makes the
    kernel reset the connection, which can destroy the answer before the client reads it
    (a 413 to a client still sending its body)."""
    writer.write_eof()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while await reader.read(64 * 1024):
                pass


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    try:
        lines = head.decode("latin-1").split("\r\n")[:-2]
        method, target, version = lines[0].split(" ")
        headers = {}
        for line in lines[1:]:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    except ValueError:
        raise HttpError(400, "malformed HTTP request", "malformed_request") from None
    if not version.startswith("HTTP/1."):
        raise HttpError(505, f"{version} is not supported; use HTTP/1.1", "http_version")
    return method, target.split("?", 1)[0], headers


def _content_length(text: str) -> int:
    if not text.isdigit():
        raise HttpError(400, f"bad Content-Length {text!r}", "malformed_request")
    length = int(text)
    if length > MAX_BODY_BYTES:
        raise HttpError(413, f"request body over {MAX_BODY_BYTES} bytes", "body_too_large")
    return length


def _encode(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
