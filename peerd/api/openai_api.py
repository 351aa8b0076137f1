"""The OpenAI-compatible HTTP endpoint (`peerd start --openai [HOST:]PORT`, off by default).

`GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`, streamed or not, so
existing OpenAI clients and web UIs can use the cluster. Every answer goes through the local
API's `chat` op (peerd/inference/serving.py), so it works on any peer: the head answers, any other
peer forwards to it. Requests map onto that op: `messages` (chat template) or `prompt` (plain text,
or token ids), `max_completion_tokens`/`max_tokens`, `temperature`, `top_p`, `seed` and the
extension `top_k`; `n` must be 1; other fields (`stop`, penalties, `logprobs`, tools...) are
ignored. Each choice carries the extension field `token_ids`. There is no authentication.
"""

from __future__ import annotations

import ipaddress
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from peerd.api.http_server import HttpError, HttpRequest, HttpServer, Responder
from peerd.api.local_api import Op
from peerd.control.deploy import Deployment
from peerd.errors import PeerdError
from peerd.inference.serving import parse_chat

log = logging.getLogger("peerd.openai")

DEFAULT_HOST = "127.0.0.1"
# OpenAI's default is "until the context is full"; the chat op needs a number.
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ServedModel:
    name: str
    eos_ids: frozenset[int]


def served_model(deployment: Deployment) -> ServedModel | None:
    """The model the cluster serves under the plan this peer holds, None while there is none."""
    plan, manifest = deployment.assignment, deployment.manifest
    if plan is None or not plan.stages or plan.model is None or manifest is None:
        return None
    return ServedModel(plan.model, frozenset(manifest.model.eos_token_ids))


def parse_address(text: str) -> tuple[str, int]:
    """`--openai`'s HOST:PORT (``[v6]:PORT`` for IPv6), or PORT alone for 127.0.0.1:PORT."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else DEFAULT_HOST
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise PeerdError(f"--openai {text!r} is not [HOST:]PORT")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise PeerdError(f"--openai {text!r}: the host must be an IP address") from None
    return host, int(port)


@dataclass(frozen=True)
class Flavour:
    """How one kind of completion looks on the wire."""

    prefix: str  # of the completion's id
    object: str
    chunk_object: str
    opening: dict[str, Any] | None  # the first streamed choice, before any text
    piece: Callable[[str], dict[str, Any]]  # a streamed choice's text
    whole: Callable[[str], dict[str, Any]]  # a complete answer's text


CHAT = Flavour(
    "chatcmpl", "chat.completion", "chat.completion.chunk",
    {"delta": {"role": "assistant", "content": ""}},
    lambda text: {"delta": {"content": text}},
    lambda text: {"message": {"role": "assistant", "content": text}},
)
TEXT = Flavour(
    "cmpl", "text_completion", "text_completion", None,
    lambda text: {"text": text}, lambda text: {"text": text},
)


@dataclass(frozen=True)
class Ask:
    """One completion request mapped onto the chat op."""

    flavour: Flavour
    chat: dict[str, Any]  # the chat op's request, less "op"
    stream: bool
    include_usage: bool
    model: str  # as the client named it


def chat_ask(body: Any) -> Ask:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, '"messages" must be a non-empty list', "invalid_messages")
    return _ask(CHAT, body, {"messages": [_message(m) for m in messages]})


def text_ask(body: Any) -> Ask:
    body = _object(body)
    return _ask(TEXT, body, _prompt(body.get("prompt")))


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object", "invalid_request")
    return body


def _message(message: Any) -> dict[str, str]:
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise HttpError(400, 'each message needs a string "role"', "invalid_messages")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(_text_part(part) for part in content)
    if not isinstance(content, str):
        raise HttpError(400, 'each message needs text "content"', "invalid_messages")
    return {"role": message["role"], "content": content}


def _text_part(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise HttpError(400, "only text content parts are supported", "unsupported_content")


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"prompt_ids": prompt}
    raise HttpError(400, '"prompt" must be a string or a list of token ids, one prompt per '
                    "request", "invalid_prompt")


def _ask(flavour: Flavour, body: dict[str, Any], prompt: dict[str, Any]) -> Ask:
    if _given(body, "n", 1) != 1:
        raise HttpError(400, '"n" must be 1: one answer per request', "unsupported_n")
    stream = _given(body, "stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, '"stream" must be true or false', "invalid_request")
    options = _given(body, "stream_options", {})
    chat = {
        **prompt,
        "max_tokens": _given(body, "max_completion_tokens",
                             _given(body, "max_tokens", DEFAULT_MAX_TOKENS)),
        "temperature": _given(body, "temperature", 1.0),
        "top_p": _given(body, "top_p", 1.0),
        "top_k": _given(body, "top_k", 0),
        "seed": _given(body, "seed", 0),
    }
    try:
        parse_chat(chat)
    except PeerdError as exc:
        raise HttpError(400, str(exc), "invalid_request") from None
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return Ask(flavour, chat, stream, include_usage, str(body.get("model") or ""))


def _given(body: dict[str, Any], key: str, default: Any) -> Any:
    """The field, or `default` where it is absent or null."""
    value = body.get(key)
    return default if value is None else value


class OpenAiApi:
    def __init__(self, chat: Op, model: Callable[[], ServedModel | None]) -> None:
        self._chat = chat
        self._model = model
        self._http = HttpServer(self._route)
        self._routes: dict[tuple[str, str], Callable[[HttpRequest, Responder], Awaitable]] = {
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): lambda r, o: self._complete(chat_ask(r.json()), o),
            ("POST", "/v1/completions"): lambda r, o: self._complete(text_ask(r.json()), o),
        }

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port; the port bound."""
        try:
            port = await self._http.start(host, port)
        except OSError as exc:
            raise PeerdError(f"--openai: cannot listen on {host}:{port}: {exc.strerror}") from None
        shown = f"[{host}]" if ":" in host else host
        log.info("OpenAI-compatible endpoint on http://%s:%d/v1", shown, port)
        if not ipaddress.ip_address(host).is_loopback:
            log.warning("the OpenAI-compatible endpoint on %s has no authentication: anyone "
                        "who can reach it can use the cluster", shown)
        return port

    async def close(self) -> None:
        await self._http.close()

    async def _route(self, request: HttpRequest, respond: Responder) -> None:
        handler = self._routes.get((request.method, request.path))
        if handler is not None:
            await handler(request, respond)
        elif any(path == request.path for _, path in self._routes):
            raise HttpError(405, f"{request.method} is not allowed on {request.path}",
                            "method_not_allowed")
        else:
            raise HttpError(404, f"no such endpoint: {request.method} {request.path}",
                            "not_found")

    async def _models(self, request: HttpRequest, respond: Responder) -> None:
        served = self._model()
        models = [] if served is None else [
            {"id": served.name, "object": "model", "created": 0, "owned_by": "peerd"}
        ]
        await respond.json(200, {"object": "list", "data": models})

    async def _complete(self, ask: Ask, respond: Responder) -> None:
        served = self._model()
        header = {"id": f"{ask.flavour.prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                  "model": served.name if served else ask.model}
        eos_ids = served.eos_ids if served else frozenset()
        if ask.stream:
            await self._stream(ask, header, eos_ids, respond)
            return
        done = await self._answer(ask.chat)
        choice = {"index": 0, **ask.flavour.whole(done["text"]), "logprobs": None,
                  "finish_reason": _finish_reason(done, ask, eos_ids),
                  "token_ids": done["token_ids"]}
        await respond.json(200, {**header, "object": ask.flavour.object, "choices": [choice],
                                 "usage": _usage(done)})

    async def _stream(self, ask: Ask, header: dict[str, Any], eos_ids: frozenset[int],
                      respond: Responder) -> None:
        def chunk(choice: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            return {**header, "object": ask.flavour.chunk_object, "choices": [
                {"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}
            ]}

        async def on_token(event: dict[str, Any]) -> None:
            if not respond.streaming and ask.flavour.opening is not None:
                await respond.event(chunk(ask.flavour.opening))
            await respond.event(chunk({**ask.flavour.piece(event["text"]),
                                       "token_ids": [event["token"]]}))

        # The status line waits for the first token, so a cluster that cannot answer at
        # all gets an error status rather than an event stream holding only an error.
        done = await self._answer(ask.chat, on_token)
        await respond.event(chunk(ask.flavour.piece(""), _finish_reason(done, ask, eos_ids)))
        if ask.include_usage:
            await respond.event({**header, "object": ask.flavour.chunk_object, "choices": [],
                                 "usage": _usage(done)})
        await respond.event("[DONE]")

    async def _answer(
        self, chat: dict[str, Any],
        on_token: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> dict[str, Any]:
        """The chat op's done event, handing it each token event on the way."""
        done: dict[str, Any] = {}

        async def send(event: dict[str, Any]) -> None:
            if event.get("ok") is False:  # an error relayed from the head
                raise HttpError(503, event.get("error", "the cluster could not answer"),
                                "cluster_error")
            if event.get("event") == "token" and on_token is not None:
                await on_token(event)
            elif event.get("event") == "done":
                done.update(event)

        try:
            await self._chat({"op": "chat", **chat}, send)
        except PeerdError as exc:
            raise HttpError(503, str(exc), "cluster_error") from None
        return done


def _finish_reason(done: dict[str, Any], ask: Ask, eos_ids: frozenset[int]) -> str:
    """The finish reason: "stop" when the answer ended with an end-of-sequence token, else
    "length".

    An answer shorter than max_tokens can only have ended at one, which also covers a peer
    that has not learnt the model's EOS ids yet."""
    tokens = done["token_ids"]
    ended = bool(tokens) and (tokens[-1] in eos_ids or len(tokens) < ask.chat["max_tokens"])
    return "stop" if ended else "length"


def _usage(done: dict[str, Any]) -> dict[str, int]:
    # The ids, not stats["generated_tokens"]: an answer resumed on a new head counts there
    # only the tokens that head made.
    prompt, completion = done["stats"]["prompt_tokens"], len(done["token_ids"])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
