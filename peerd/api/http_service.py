"""The HTTP ground under the OpenAI-compatible endpoint: aiohttp's low-level server on the
daemon's own loop, made strict and bounded.

- Connections: HTTP/1.1 keep-alive; at most `max_connections` open at once (one over the cap is
  answered 503 at once and closed), and one idle for `idle_timeout_s` is closed, so clients can
  never take the file descriptors the cluster's own sockets need.
- Requests: a body with Content-Length or chunked, at most MAX_BODY_BYTES; JSON, at most as
  deep as Python's parser goes, valid UTF-8 without lone surrogates.
- Errors: JSON in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, also for
  requests aiohttp's parser refuses (a duplicated or malformed Content-Length, a bad request
  line), which are logged as one debug line. A bug in a handler is a 500, its traceback logged
  the first time only.
- CORS for the origins allowed; with a key, every request but a CORS preflight must carry
  ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import json
import logging
import traceback
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("peerd.http")

MAX_BODY_BYTES = 1024 * 1024
CORS_MAX_AGE_S = 600
ALLOWED_METHODS = "GET, HEAD, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type"
SHUTDOWN_S = 1.0  # answers still running when the daemon stops get this long, then end

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An answer with an error status: `code` is a short machine-readable name, `param` the
    request field at fault where there is one."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def document(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=encode(self.document()),
                            content_type="application/json", headers=self.headers)


def encode(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


async def read_json(request: web.BaseRequest) -> Any:
    """The request's body as JSON; ApiError 400 or 413 when it cannot be."""
    body = await _read_body(request)
    try:
        document = json.loads(body)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", "invalid_json") from None
    except ValueError as exc:  # UnicodeDecodeError too
        reason = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else "not valid JSON"
        raise ApiError(400, f"the request body is {reason}", "invalid_json") from None
    if not all(_encodable(text) for text in _strings(document)):
        raise ApiError(400, "the request body holds a lone surrogate (\\ud800-\\udfff)",
                       "invalid_json")
    return document


async def _read_body(request: web.BaseRequest) -> bytes:
    too_large = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", "body_too_large")
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise too_large
    if request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = bytearray()
    try:
        while chunk := await request.content.readany():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise too_large
    except RequestPayloadError as exc:  # a malformed chunked body
        raise ApiError(400, f"malformed request body: {exc}", "malformed_request") from None
    return bytes(body)


def _strings(document: Any) -> Iterable[str]:
    """Every string in a parsed JSON document, keys included (without recursion)."""
    stack = [document]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class EventStream:
    """A streamed answer: server-sent events, opened (status 200) by the first write."""

    def __init__(self, request: web.BaseRequest, headers: dict[str, str]) -> None:
        self._request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )

    @property
    def open(self) -> bool:
        return self.response.prepared

    async def event(self, data: dict[str, Any] | str) -> None:
        """One event: a JSON document, or a literal such as ``[DONE]``."""
        payload = data.encode() if isinstance(data, str) else encode(data)
        await self._write(b"data: " + payload + b"\n\n")

    async def comment(self, text: str) -> None:
        await self._write(f": {text}\n\n".encode())

    async def _write(self, data: bytes) -> None:
        if not self.response.prepared:
            await self.response.prepare(self._request)
        await self.response.write(data)


class Cors:
    """The origins a browser page may call the endpoint from ("*": any)."""

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(origins)

    def headers(self, request: web.BaseRequest) -> dict[str, str]:
        """What an answer to this request carries for the browser: nothing unless its
        Origin is allowed."""
        origin = request.headers.get("Origin")
        if origin is None or not ({origin, "*"} & self.origins):
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def preflight(self, request: web.BaseRequest) -> web.StreamResponse | None:
        """The answer to a CORS preflight, None for any other request."""
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return None
        headers = self.headers(request)
        if not headers:
            return ApiError(403, f"origin {request.headers.get('Origin')!r} is not allowed "
                            "(peerd start --openai-cors ORIGIN)", "origin_not_allowed").response()
        return web.Response(status=204, headers={
            **headers, "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": ALLOWED_HEADERS,
            "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
        })


class HttpService:
    """`handler` behind the connection cap, CORS, the key and OpenAI-shaped errors."""

    def __init__(self, handler: Handler, *, cors: Cors, key: str | None, max_connections: int,
                 idle_timeout_s: float) -> None:
        self._handler = handler
        self.cors = cors
        self._key = None if key is None else f"Bearer {key}".encode()
        self._server = _Server(self._handle, max_connections=max_connections,
                               keepalive_timeout=idle_timeout_s, access_log=None)
        self._runner = web.ServerRunner(self._server, shutdown_timeout=SHUTDOWN_S)
        self._bugs_logged: set[str] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port; the port bound (useful when `port` is 0)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            raise
        return self._runner.addresses[0][1]

    async def close(self) -> None:
        await self._runner.cleanup()

    def status(self) -> dict[str, int]:
        server = self._server
        return {"connections": len(server.connections), "accepted": server.accepted,
                "refused": server.refused, "max_connections": server.max_connections}

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        preflight = self.cors.preflight(request)
        if preflight is not None:
            return preflight
        response = await self._answer(request)
        if not response.prepared:  # a stream got them when it opened
            response.headers.update(self.cors.headers(request))
        return response

    async def _answer(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            self._check_key(request)
            return await self._handler(request)
        except ApiError as exc:
            return exc.response()
        except ConnectionError:
            log.debug("the HTTP client at %s went away", request.remote)
            gone = web.Response()  # aiohttp finds the transport closed and drops it
            gone.force_close()
            return gone
        except Exception as exc:
            self._log_bug(exc)
            return ApiError(500, "internal error", "internal_error").response()

    def _check_key(self, request: web.BaseRequest) -> None:
        if self._key is None:
            return
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self._key):
            raise ApiError(401, "no valid API key: send Authorization: Bearer KEY, the key in "
                           "the daemon's --openai-key-file", "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def _log_bug(self, exc: Exception) -> None:
        """A bug answering a request: its traceback once, one line each time after."""
        where = traceback.extract_tb(exc.__traceback__)[-1]
        signature = f"{type(exc).__name__} at {where.filename}:{where.lineno}"
        if signature in self._bugs_logged:
            log.error("answering an HTTP request failed again: %s: %s", signature, exc)
            return
        self._bugs_logged.add(signature)
        log.error("answering an HTTP request failed (a bug)", exc_info=exc)


class _Server(web.Server):
    """aiohttp's low-level server with a cap on open connections."""

    def __init__(self, handler: Handler, *, max_connections: int, **handler_args: Any) -> None:
        super().__init__(handler, **handler_args)
        self.max_connections = max_connections
        self.accepted = 0
        self.refused = 0
        self._handler_args = handler_args

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, loop=asyncio.get_running_loop(), **self._handler_args)

    def admits(self) -> bool:
        """Whether a new connection is within the cap (counted either way)."""
        if len(self.connections) >= self.max_connections:
            self.refused += 1
            return False
        self.accepted += 1
        return True


def _canned(error: ApiError) -> bytes:
    """A whole HTTP answer, for a connection that gets no handler."""
    body = encode(error.document())
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)),
               **error.headers, "Connection": "close"}
    head = f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode() + body


_OVER_CAP = _canned(ApiError(503, "too many open connections to this endpoint; try again "
                             "shortly", "too_many_connections", headers={"Retry-After": "1"}))


class _Connection(web.RequestHandler):
    def __init__(self, server: _Server, **handler_args: Any) -> None:
        super().__init__(server, **handler_args)
        self._capped_by = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._capped_by.admits():
            super().connection_made(transport)
            return
        # Over the cap: never a handler, so the descriptor is free again at once.
        if isinstance(transport, asyncio.WriteTransport):
            transport.write(_OVER_CAP)
        transport.close()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None) -> web.Response:
        """The answer to a request aiohttp could not hand to the handler: one its parser
        refused (a 4xx) or, which the handler's own catch-all rules out, an error of aiohttp's."""
        lines = (getattr(exc, "message", None) or message or "").splitlines()
        reason = (lines[0] if lines else "").rstrip(": ") or "malformed HTTP request"
        if status < 500:
            log.debug("refused an HTTP request from %s: %s", request.remote, reason)
            error = ApiError(status, reason, "malformed_request")
        else:
            log.error("the HTTP server failed: %s", reason)
            error = ApiError(status, "internal error", "internal_error")
        response = error.response()
        response.force_close()
        return response
