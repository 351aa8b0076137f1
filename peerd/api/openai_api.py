"""The OpenAI-compatible HTTP endpoint (`peerd start --openai [HOST:]PORT`, off by default).

`GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions` and `POST /v1/completions`,
streamed or not, so existing OpenAI clients and web UIs can use the cluster; HEAD is answered
wherever GET is. Every answer goes through the local API's `chat` op (peerd/inference/serving.py),
so it works on any peer: the head answers, any other peer forwards to it. Requests map onto that
op: `messages` (chat template) or `prompt` (plain text, or token ids),
`max_completion_tokens`/`max_tokens`, `temperature`, `top_p`, `seed`, `stop` (the op ends the
text before it and stops the cluster there), `logprobs` with `top_logprobs` (chat) or
`logprobs: N` (completions), and the extension `top_k`; `n` must be 1; `model`, where given,
must be the served model's id; other fields (penalties, tools...) are ignored. Each choice
carries the extension field `token_ids`. The chat op's error kinds become OpenAI's status codes
(`api_error`). The HTTP itself (connection cap, CORS, key, body limits) is
peerd/api/http_service.py; the options, peerd/api/openai_settings.py.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from peerd.api.http_service import ApiError, Cors, EventStream, HttpService, read_json
from peerd.api.local_api import Op
from peerd.api.openai_settings import Settings
from peerd.control.deploy import Deployment
from peerd.errors import ErrorKind, PeerdError
from peerd.inference.serving import parse_chat
from shards.sampling import MAX_TOP_LOGPROBS

log = logging.getLogger("peerd.openai")

KEEPALIVE_S = 5.0  # a stream with no token for this long gets a comment (a long prefill)
RETRY_AFTER_S = 1  # told to a client turned away busy
# OpenAI's default is "until the context is full"; the chat op needs a number.
DEFAULT_MAX_TOKENS = 256
MAX_COMPLETION_LOGPROBS = 5  # completions' `logprobs: N`, as OpenAI allows
MODELS = "/v1/models"


@dataclass(frozen=True)
class ServedModel:
    name: str


def served_model(deployment: Deployment) -> ServedModel | None:
    """The model the cluster serves under the plan this peer holds, None while there is none."""
    plan, manifest = deployment.assignment, deployment.manifest
    if plan is None or not plan.stages or plan.model is None or manifest is None:
        return None
    return ServedModel(plan.model)


# The status and OpenAI code of each kind of error the chat op raises.
_STATUS = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request"),
    ErrorKind.NO_TOKENIZER: (400, "no_tokenizer"),
    ErrorKind.PROMPT_TOO_LONG: (400, "context_length_exceeded"),
    ErrorKind.BUSY: (429, "rate_limit_exceeded"),
    ErrorKind.UNAVAILABLE: (503, "unavailable"),
    ErrorKind.FAILED: (503, "cluster_error"),
}


def api_error(exc: PeerdError) -> ApiError:
    """The HTTP answer to an error of the chat op, by its kind."""
    status, code = _STATUS[exc.kind]
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return ApiError(status, str(exc), code, headers=headers)


# The chat op's log-probabilities of each token: OpenAI's `logprobs.content[]` entries.
Entries = list[dict[str, Any]]


@dataclass(frozen=True)
class Flavour:
    """How one kind of completion looks on the wire."""

    prefix: str  # of the completion's id
    object: str
    chunk_object: str
    opening: dict[str, Any] | None  # the first streamed choice, before any text
    piece: Callable[[str], dict[str, Any]]  # a streamed choice's text
    whole: Callable[[str], dict[str, Any]]  # a complete answer's text
    # the chat op's "logprobs" from the request's fields (None: not asked)
    asks_logprobs: Callable[[dict[str, Any]], int | None]
    # a choice's "logprobs" from the entries of its tokens, the first at this text offset
    logprobs: Callable[[Entries, int], dict[str, Any]]


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    asked, top = _given(body, "logprobs", False), _given(body, "top_logprobs", None)
    if not isinstance(asked, bool):
        raise ApiError(400, '"logprobs" must be true or false', "invalid_request", "logprobs")
    if top is not None and not (type(top) is int and 0 <= top <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f'"top_logprobs" must be an integer from 0 to {MAX_TOP_LOGPROBS}',
                       "invalid_request", "top_logprobs")
    if top is not None and not asked:
        raise ApiError(400, '"top_logprobs" needs "logprobs": true', "invalid_request",
                       "top_logprobs")
    return (top or 0) if asked else None


def _text_logprobs(body: dict[str, Any]) -> int | None:
    asked = body.get("logprobs")
    if asked is not None and not (type(asked) is int and 0 <= asked <= MAX_COMPLETION_LOGPROBS):
        raise ApiError(400, f'"logprobs" must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}',
                       "invalid_request", "logprobs")
    return asked


def _text_offsets(entries: Entries, offset: int) -> list[int]:
    """Where each token's text begins, counted as the sum of the tokens' texts before it."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return offsets


CHAT = Flavour(
    "chatcmpl", "chat.completion", "chat.completion.chunk",
    {"delta": {"role": "assistant", "content": ""}},
    lambda text: {"delta": {"content": text}},
    lambda text: {"message": {"role": "assistant", "content": text}},
    _chat_logprobs,
    lambda entries, _: {"content": entries},
)
TEXT = Flavour(
    "cmpl", "text_completion", "text_completion", None,
    lambda text: {"text": text}, lambda text: {"text": text},
    _text_logprobs,
    lambda entries, offset: {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": _text_offsets(entries, offset),
    },
)


@dataclass(frozen=True)
class Ask:
    """One completion request mapped onto the chat op."""

    flavour: Flavour
    chat: dict[str, Any]  # the chat op's request, less "op"
    stream: bool
    include_usage: bool
    model: str | None  # as the client named it


def chat_ask(body: Any) -> Ask:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, '"messages" must be a non-empty list', "invalid_messages", "messages")
    return _ask(CHAT, body, {"messages": [_message(m) for m in messages]})


def text_ask(body: Any) -> Ask:
    body = _object(body)
    return _ask(TEXT, body, _prompt(body.get("prompt")))


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request")
    return body


def _message(message: Any) -> dict[str, str]:
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise ApiError(400, 'each message needs a string "role"', "invalid_messages", "messages")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(_text_part(part) for part in content)
    if not isinstance(content, str):
        raise ApiError(400, 'each message needs text "content"', "invalid_messages", "messages")
    return {"role": message["role"], "content": content}


def _text_part(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise ApiError(400, "only text content parts are supported", "unsupported_content",
                   "messages")


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"prompt_ids": prompt}
    raise ApiError(400, '"prompt" must be a string or a list of token ids, one prompt per '
                   "request", "invalid_prompt", "prompt")


def _ask(flavour: Flavour, body: dict[str, Any], prompt: dict[str, Any]) -> Ask:
    if _given(body, "n", 1) != 1:
        raise ApiError(400, '"n" must be 1: one answer per request', "unsupported_n", "n")
    stream = _given(body, "stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, '"stream" must be true or false', "invalid_request", "stream")
    options = _given(body, "stream_options", {})
    chat = {
        **prompt,
        "max_tokens": _given(body, "max_completion_tokens",
                             _given(body, "max_tokens", DEFAULT_MAX_TOKENS)),
        "temperature": _given(body, "temperature", 1.0),
        "top_p": _given(body, "top_p", 1.0),
        "top_k": _given(body, "top_k", 0),
        "seed": _given(body, "seed", 0),
        "stop": body.get("stop"),
        "logprobs": flavour.asks_logprobs(body),
    }
    try:
        parse_chat(chat)
    except PeerdError as exc:
        raise api_error(exc) from None
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    model = body.get("model")
    if not isinstance(model, str | None):
        raise ApiError(400, '"model" must be a string', "invalid_request", "model")
    return Ask(flavour, chat, stream, include_usage, model)


def _given(body: dict[str, Any], key: str, default: Any) -> Any:
    """The field, or `default` where it is absent or null."""
    value = body.get(key)
    return default if value is None else value


class OpenAiApi:
    def __init__(self, chat: Op, model: Callable[[], ServedModel | None], settings: Settings,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self._chat = chat
        self._model = model
        self.settings = settings
        self._keepalive_s = keepalive_s
        self.port: int | None = None  # bound, once started
        self._http = HttpService(
            self._route, cors=Cors(settings.cors), key=settings.key,
            max_connections=settings.max_connections, idle_timeout_s=settings.idle_timeout_s,
        )
        self._routes: dict[tuple[str, str], Callable[[web.BaseRequest], Awaitable]] = {
            ("GET", MODELS): self._models,
            ("GET", MODELS + "/{id}"): self._model_named,
            ("POST", "/v1/chat/completions"): lambda r: self._complete(r, chat_ask),
            ("POST", "/v1/completions"): lambda r: self._complete(r, text_ask),
        }

    async def start(self) -> int:
        """Listen where the settings say; the port bound."""
        host, port = self.settings.host, self.settings.port
        try:
            port = await self._http.start(host, port)
        except OSError as exc:
            raise PeerdError(f"--openai: cannot listen on {host}:{port}: {exc.strerror}") from None
        self.port = port
        shown = f"[{host}]" if ":" in host else host
        log.info("OpenAI-compatible endpoint on http://%s:%d/v1 (at most %d connections%s)",
                 shown, port, self.settings.max_connections,
                 "; API key required" if self.settings.key else "")
        if self.settings.key is None and not ipaddress.ip_address(host).is_loopback:
            log.warning("the OpenAI-compatible endpoint on %s has no authentication: anyone "
                        "who can reach it can use the cluster (--openai-key-file)", shown)
        return port

    async def close(self) -> None:
        await self._http.close()

    def status(self) -> dict[str, int]:
        """Its connections: open now, accepted and refused (over the cap) since the start."""
        return self._http.status()

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        # HEAD is GET without the body, which aiohttp leaves out of the answer
        method = "GET" if request.method == "HEAD" else request.method
        path = _route_path(request.path)
        handler = self._routes.get((method, path))
        if handler is not None:
            return await handler(request)
        if any(route == path for _, route in self._routes):
            raise ApiError(405, f"{request.method} is not allowed on {request.path}",
                           "method_not_allowed")
        raise ApiError(404, f"no such endpoint: {request.method} {request.path}", "not_found")

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        served = self._model()
        models = [] if served is None else [_model_object(served)]
        return web.json_response({"object": "list", "data": models})

    async def _model_named(self, request: web.BaseRequest) -> web.StreamResponse:
        name, served = request.path.removeprefix(MODELS + "/"), self._model()
        if served is None or name != served.name:
            serving = f"this cluster serves {served.name!r}" if served else "no model is served yet"
            raise ApiError(404, f"the model {name!r} does not exist: {serving}",
                           "model_not_found", "model")
        return web.json_response(_model_object(served))

    async def _complete(self, request: web.BaseRequest,
                        parse: Callable[[Any], Ask]) -> web.StreamResponse:
        ask = parse(await read_json(request))
        served = self._model()
        if served is not None and ask.model is not None and ask.model != served.name:
            raise ApiError(404, f"the model {ask.model!r} does not exist: this cluster serves "
                           f"{served.name!r}", "model_not_found", "model")
        header = {"id": f"{ask.flavour.prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                  "model": served.name if served else ask.model}
        if ask.stream:
            return await self._stream(request, ask, header)
        entries: Entries = []

        async def keep_logprobs(event: dict[str, Any]) -> None:
            if "logprobs" in event:
                entries.append(event["logprobs"])

        try:
            done = await self._answer(ask.chat, keep_logprobs)
        except PeerdError as exc:
            raise api_error(exc) from None
        choice = {"index": 0, **ask.flavour.whole(done["text"]),
                  "logprobs": self._logprobs(ask, entries, 0),
                  "finish_reason": done["finish_reason"], "token_ids": done["token_ids"],
                  "degraded": done["degraded"]}
        return web.json_response({**header, "object": ask.flavour.object, "choices": [choice],
                                  "usage": _usage(done)})

    @staticmethod
    def _logprobs(ask: Ask, entries: Entries, offset: int) -> dict[str, Any] | None:
        """A choice's "logprobs": None where the request did not ask for them."""
        return None if ask.chat["logprobs"] is None else ask.flavour.logprobs(entries, offset)

    async def _stream(self, request: web.BaseRequest, ask: Ask,
                      header: dict[str, Any]) -> web.StreamResponse:
        def chunk(choice: dict[str, Any], finish_reason: str | None = None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return {**header, "object": ask.flavour.chunk_object, "choices": [
                {"index": 0, **choice, "logprobs": logprobs, "finish_reason": finish_reason}
            ]}

        offset = 0  # of the next token's text, for completions' text_offset

        stream = EventStream(request, self._http.cors.headers(request))
        tokens: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        answer = asyncio.create_task(self._answer(ask.chat, tokens.put))
        answer.add_done_callback(lambda _: tokens.put_nowait(None))
        try:
            # The status line waits for the first token (or the first keep-alive), so a
            # cluster that cannot answer gets an error status rather than a stream of one error.
            while (event := await self._next_token(tokens, stream)) is not None:
                if not stream.open and ask.flavour.opening is not None:
                    await stream.event(chunk(ask.flavour.opening))
                entries = [event["logprobs"]] if "logprobs" in event else []
                logprobs = self._logprobs(ask, entries, offset)
                offset += sum(len(entry["token"]) for entry in entries)
                await stream.event(chunk({**ask.flavour.piece(event["text"]),
                                          "token_ids": [event["token"]],
                                          "degraded": event.get("degraded", False)},
                                         logprobs=logprobs))
            done = answer.result()
        except PeerdError as exc:
            if not stream.open:
                raise api_error(exc) from None
            await stream.event(api_error(exc).document())
            return stream.response
        finally:
            answer.cancel()
        await stream.event(chunk(ask.flavour.piece(""), done["finish_reason"]))
        if ask.include_usage:
            await stream.event({**header, "object": ask.flavour.chunk_object, "choices": [],
                                "usage": _usage(done)})
        await stream.event("[DONE]")
        return stream.response

    async def _next_token(self, tokens: asyncio.Queue, stream: EventStream) -> Any:
        """The next token event (None once the answer ended), keeping the stream alive with a
        comment every `keepalive_s` without one: a long prompt's prefill, a full line."""
        while True:
            try:
                async with asyncio.timeout(self._keepalive_s):
                    return await tokens.get()
            except TimeoutError:
                await stream.comment("keep-alive")

    async def _answer(
        self, chat: dict[str, Any],
        on_token: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> dict[str, Any]:
        """The chat op's done event, handing it each token event on the way."""
        done: dict[str, Any] = {}

        async def send(event: dict[str, Any]) -> None:
            if event.get("ok") is False:  # an error relayed from the head
                raise PeerdError(event.get("error", "the cluster could not answer"),
                                 ErrorKind.parse(event.get("kind")))
            if event.get("event") == "token" and on_token is not None:
                await on_token(event)
            elif event.get("event") == "done":
                done.update(event)

        await self._chat({"op": "chat", **chat}, send)
        return done


def _route_path(path: str) -> str:
    """The route a request's path takes: a model's own path is MODELS/{id}."""
    if path.startswith(MODELS + "/") and len(path) > len(MODELS) + 1:
        return MODELS + "/{id}"
    return path


def _model_object(served: ServedModel) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": 0, "owned_by": "peerd"}


def _usage(done: dict[str, Any]) -> dict[str, int]:
    # The ids, not stats["generated_tokens"]: an answer resumed on a new head counts there
    # only the tokens that head made.
    prompt, completion = done["stats"]["prompt_tokens"], len(done["token_ids"])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
