"""Serving chats: the local API's `chat` op, answered on the head or forwarded to it.

The head (the peer holding unit 0 and the tokenizer) turns a chat request into prompt ids
(the chat template for `messages`, or `prompt_ids` as given), runs it through its
`DataPlane`, and streams one event per token, then a `done` event with the token ids, the
text and the answer's statistics. A request typed on any other peer's socket is forwarded
to the head (`ChatRequest`) and its events relayed back (`ChatEvent`); if that client goes
away the head is told (`ChatCancel`) and the answer ends on every peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peerd.dataplane import DataPlane, GenerationError, Limits, Request
from peerd.deploy import LoadedStage
from peerd.errors import PeerdError
from peerd.protocol import (
    ChatCancel,
    ChatEvent,
    ChatRequest,
    PeerFigures,
    PlanAssignment,
    PlanStage,
)
from peerd.transport import Transport, TransportError
from shards.errors import ModelError
from shards.manifest import Manifest
from shards.sampling import SamplingParams
from shards.tokenizer import Tokenizer

log = logging.getLogger("peerd.serving")

Send = Callable[[dict[str, Any]], Awaitable[None]]

# A forwarded chat whose head sends nothing for this long is ended with an error.
HEAD_SILENCE_S = 60.0
RELAY_TIMEOUT_S = 10.0
MAX_CHAT_TOKENS = 8192


@dataclass(frozen=True)
class ChatBody:
    """A validated chat request."""

    prompt_ids: list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int
    params: SamplingParams


def parse_chat(request: dict[str, Any]) -> ChatBody:
    """The chat request in `request`, or PeerdError naming what is wrong with it."""
    prompt_ids, messages = request.get("prompt_ids"), request.get("messages")
    if (prompt_ids is None) == (messages is None):
        raise PeerdError('a chat needs exactly one of "prompt_ids" and "messages"')
    if prompt_ids is not None and not (
        isinstance(prompt_ids, list) and prompt_ids and all(type(t) is int for t in prompt_ids)
    ):
        raise PeerdError('"prompt_ids" must be a non-empty list of integers')
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise PeerdError('"messages" must be a non-empty list of {"role", "content"} strings')
    max_tokens = request.get("max_tokens", 32)
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_CHAT_TOKENS:
        raise PeerdError(f'"max_tokens" must be an integer from 1 to {MAX_CHAT_TOKENS}')
    try:
        params = SamplingParams(
            float(request.get("temperature", 0.0)),
            int(request.get("top_k", 0)),
            float(request.get("top_p", 1.0)),
            int(request.get("seed", 0)),
        )
    except (TypeError, ValueError) as exc:
        raise PeerdError(f"bad sampling settings: {exc}") from None
    return ChatBody(prompt_ids, messages, max_tokens, params)


class TextStream:
    """Text of the tokens so far, handed out in pieces as tokens arrive.

    A token may end in the middle of a multi-byte character; its piece is held back until
    the character is complete, so every piece is valid text.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        self._tokens.append(token)
        if self._tokenizer is None:
            return ""
        text = self._tokenizer.decode(self._tokens)
        if text.endswith("\ufffd"):
            return ""
        piece, self.text = text[len(self.text) :], text
        return piece


@dataclass(frozen=True)
class Head:
    """What the head needs to answer: its data plane and the model's tokenizer and limits."""

    plane: DataPlane
    tokenizer: Tokenizer | None
    stop_ids: frozenset[int]
    max_positions: int


class ChatService:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.head: Head | None = None  # set on the head peer while a plan is deployed
        self.head_peer: str | None = None  # where to forward chats typed here
        self._forwarded: dict[str, asyncio.Task] = {}  # on the head: chats asked by peers
        self._asked: dict[str, asyncio.Queue] = {}  # here: events of chats we forwarded

    # -- the local API op --------------------------------------------------------------------
    async def op_chat(self, request: dict[str, Any], send: Send) -> None:
        body = parse_chat(request)
        if self.head is not None:
            await self.answer(body, send)
        elif self.head_peer is not None:
            await self._forward({k: v for k, v in request.items() if k != "op"}, send)
        else:
            raise PeerdError("no model is deployed yet (see peerd status)")

    async def answer(self, body: ChatBody, send: Send) -> None:
        """Answer on this peer, the head; streams token events, then the done event."""
        head = self.head
        if head is None:
            raise PeerdError("this peer is no longer the head; ask again")
        prompt = self._prompt_ids(head, body)
        text = TextStream(head.tokenizer)
        events: asyncio.Queue = asyncio.Queue()
        token_times: list[float] = []
        started = time.perf_counter()

        def on_token(token: int) -> None:
            token_times.append(time.perf_counter())
            events.put_nowait({"event": "token", "token": token, "text": text.add(token)})

        request = Request(prompt, body.params, body.max_tokens, head.stop_ids)
        generation = asyncio.create_task(head.plane.generate(request, on_token))
        generation.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while (event := await events.get()) is not None:
                await send(event)
            tokens = generation.result()
        except GenerationError as exc:
            raise PeerdError(str(exc)) from None
        finally:
            generation.cancel()
        stats = _stats(head.plane, len(prompt), started, token_times)
        await send({"event": "done", "ok": True, "token_ids": tokens, "text": text.text,
                    "stats": stats})

    def _prompt_ids(self, head: Head, body: ChatBody) -> list[int]:
        if body.prompt_ids is not None:
            prompt = body.prompt_ids
        elif head.tokenizer is None:
            raise PeerdError("this model has no tokenizer: send prompt_ids")
        else:
            try:
                prompt = head.tokenizer.conversation_ids(body.messages)
            except ModelError as exc:
                raise PeerdError(str(exc)) from None
        if len(prompt) + body.max_tokens > head.max_positions:
            raise PeerdError(
                f"{len(prompt)} prompt tokens + {body.max_tokens} new tokens exceed the "
                f"model's {head.max_positions} positions"
            )
        return prompt

    # -- forwarding --------------------------------------------------------------------------
    async def _forward(self, body: dict[str, Any], send: Send) -> None:
        chat_id = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._asked[chat_id] = queue
        finished = False
        try:
            try:
                await self.transport.deliver(
                    self.head_peer, ChatRequest(chat_id, body), RELAY_TIMEOUT_S
                )
            except TransportError as exc:
                raise PeerdError(f"cannot reach the head: {exc}") from None
            while not finished:
                try:
                    event = await asyncio.wait_for(queue.get(), HEAD_SILENCE_S)
                except TimeoutError:
                    raise PeerdError(f"the head sent nothing for {HEAD_SILENCE_S:.0f}s") from None
                finished = event.get("event") == "done" or event.get("ok") is False
                await send(event)
        finally:
            self._asked.pop(chat_id, None)
            if not finished:
                self.transport.send(self.head_peer, ChatCancel(chat_id))

    def handle(self, sender: str, message: Any) -> None:
        """A chat message from peer `sender`."""
        if isinstance(message, ChatRequest):
            self._answer_for(sender, message)
        elif isinstance(message, ChatEvent):
            queue = self._asked.get(message.chat_id)
            if queue is not None:
                queue.put_nowait(message.event)
        elif isinstance(message, ChatCancel):
            task = self._forwarded.get(message.chat_id)
            if task is not None:
                task.cancel()

    def _answer_for(self, sender: str, message: ChatRequest) -> None:
        async def relay(event: dict[str, Any]) -> None:
            await self.transport.deliver(sender, ChatEvent(message.chat_id, event),
                                         RELAY_TIMEOUT_S)

        async def run() -> None:
            try:
                await self.answer(parse_chat(message.body), relay)
            except PeerdError as exc:
                with contextlib.suppress(TransportError):
                    await relay({"ok": False, "error": str(exc)})
            except TransportError:
                pass  # the asking peer is gone; its answer ended with the cancellation above
            finally:
                self._forwarded.pop(message.chat_id, None)

        self._forwarded[message.chat_id] = asyncio.get_running_loop().create_task(run())

    async def close(self) -> None:
        tasks = list(self._forwarded.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _stats(plane: DataPlane, prompt_tokens: int, started: float, times: list[float]) -> dict:
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    counters = plane.worker.counters
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": len(times),
        "time_to_first_token_s": round(times[0] - started, 6) if times else None,
        "tokens_per_second": round((len(times) - 1) / decode_s, 3) if decode_s else None,
        "total_s": round(time.perf_counter() - started, 6),
        "stages": len(plane.peers),
        "fp16_wire": plane.worker.fp16_wire,
        "head_compute_s": round(counters.compute_s, 6),
    }


def plan_active(
    stages: tuple[PlanStage, ...], figures: tuple[PeerFigures, ...] | None
) -> bool:
    """Whether the leader's latest report shows every stage peer with exactly its units."""
    if not stages or figures is None:
        return False
    loaded = {f.id: f.units for f in figures}
    return all(loaded.get(s.peer) == tuple(range(s.first, s.last + 1)) for s in stages)


class Serving:
    """The data plane and chat service of whatever plan this peer has deployed.

    The plane is rebuilt when the plan or the loaded executor changes (answers running on
    the old plane end with an error the client sees); the head accepts chats once the
    leader's report shows every stage loaded.
    """

    def __init__(self, me: str, transport: Transport, model_dir: Path | None,
                 limits: Limits | None = None) -> None:
        self.me = me
        self.transport = transport
        self.model_dir = model_dir
        self.limits = limits or Limits()
        self.chat = ChatService(transport)
        self.plane: DataPlane | None = None
        self._built_for: tuple | None = None
        self._retired: set[asyncio.Task] = set()

    def refresh(self, plan: PlanAssignment | None, loaded: LoadedStage | None,
                figures: tuple[PeerFigures, ...] | None) -> None:
        stages = plan.stages if plan else ()
        key = (plan.epoch, plan.plan_id, id(loaded.executor)) if plan and loaded else None
        if key != self._built_for:
            self._retire()
            if key is not None:
                ring = [(s.peer, s.first, s.last) for s in stages]
                self.plane = DataPlane(self.me, self.transport, ring, loaded.manifest,
                                       loaded.executor, limits=self.limits)
            self._built_for = key
        active = plan_active(stages, figures)
        self.chat.head_peer = stages[0].peer if active else None
        if active and self.plane is not None and self.plane.is_head:
            if self.chat.head is None or self.chat.head.plane is not self.plane:
                self.chat.head = self._head(self.plane, loaded.manifest)
        else:
            self.chat.head = None

    def _head(self, plane: DataPlane, manifest: Manifest) -> Head:
        tokenizer = None
        if self.model_dir is not None and (self.model_dir / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_dir(self.model_dir)
        model = manifest.model
        return Head(plane, tokenizer, frozenset(model.eos_token_ids), model.max_positions)

    def _retire(self) -> None:
        if self.plane is not None:
            task = asyncio.get_running_loop().create_task(self.plane.close())
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)
        self.plane = None
        self.chat.head = None

    def handle(self, sender: str, message: Any, reply: Callable[[Any], None]) -> None:
        if isinstance(message, (ChatRequest, ChatEvent, ChatCancel)):
            self.chat.handle(sender, message)
        elif self.plane is not None:
            self.plane.handle(sender, message, reply)
        else:
            log.info("dropped %s from %s: no stage is loaded here", message.KIND, sender)

    def status(self) -> dict[str, Any]:
        """What `peerd status` shows of the data plane on this peer."""
        if self.plane is None:
            return {"stage": None, "sequences": 0, "kv_bytes": 0}
        counters = self.plane.worker.counters
        executor = self.plane.worker.executor
        return {
            "stage": self.plane.stage,
            "head": self.chat.head is not None,
            "sequences": executor.sequence_count,
            "kv_bytes": executor.kv_bytes(),
            **dataclasses.asdict(counters),
        }

    async def close(self) -> None:
        await self.chat.close()
        self._retire()
        await asyncio.gather(*self._retired, return_exceptions=True)
