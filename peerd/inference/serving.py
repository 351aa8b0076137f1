"""Serving chats: the local API's `chat` op, answered on the head or forwarded to it.

The head (the peer holding unit 0 and the tokenizer) turns a chat request into prompt ids
(the chat template for `messages`, or `prompt_ids` as given), runs it through its
`Answers` (peerd/inference/answers.py), and streams one event per token, then a `done` event with
the token ids, the text, why it ended and the answer's statistics. A chat may name stop
strings: its text ends before the first that appears (peerd/inference/stops.py; text that may
begin one is held back until decided) and the answer ends there on every peer at once. A chat
may ask for log-probabilities: each token event then carries the token's and the most likely
tokens' (computed on the last stage from the raw logits, see shards.sampling.token_logprobs).

A request typed on any other peer's socket is forwarded to the head (`ChatRequest`) and its
events relayed back (`ChatEvent`); if that client goes away the head is told (`ChatCancel`)
and the answer ends on every peer. If the head changes mid-answer (it went away, or a new plan
put the head elsewhere), the peer the client asked, the old head included, asks the next
head to resume it: the same request with the tokens already streamed (`resume_ids`), which
the new head re-prefills and continues from.

`Serving` keeps one `DataPlane` per plan this peer has loaded a stage of, and follows the
events of peerd/control/plan_live.py: on `StageLoaded` it builds the new plan's plane while the
old one keeps answering; on `PlanLive` (the leader's report shows every stage of the new plan
loaded) the head moves its answers over and every peer retires the older planes
(peerd/inference/answers.py says how answers move). Reading its status changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peerd.cluster.membership import Member
from peerd.cluster.peers import Handler
from peerd.cluster.unit_clock import UnitClock
from peerd.control.deploy import LoadedStage
from peerd.control.plan_live import PlanEvent, PlanLive, StageLoaded
from peerd.control.planning import context_for
from peerd.errors import ErrorKind, PeerdError, invalid
from peerd.inference.answers import Answered, Answers, Busy, HeadMoved, Request
from peerd.inference.dataplane import DataPlane, GenerationError, Limits
from peerd.inference.groups import GroupLead, GroupMember
from peerd.inference.pipeline import NewToken, TokenLogprobs
from peerd.inference.shares import ShareRunner
from peerd.inference.stops import StopStrings
from peerd.wire import protocol
from peerd.wire.protocol import (
    AnswerFigures,
    ChatCancel,
    ChatEvent,
    ChatRequest,
    PlanAssignment,
)
from peerd.wire.transport import Incoming, Transport, TransportError
from shards.early_exit import ExitSettings
from shards.errors import ModelError, NoTokenizer
from shards.executor import HeldUnit, StageExecutor, held_bytes
from shards.manifest import Manifest
from shards.sampling import MAX_TOP_LOGPROBS, SamplingParams
from shards.text_stream import TextStream

if TYPE_CHECKING:
    from shards.tokenizer import Tokenizer

log = logging.getLogger("peerd.inference.serving")

Send = Callable[[dict[str, Any]], Awaitable[None]]

# A forwarded chat whose head sends nothing for this long is ended with an error.
HEAD_SILENCE_S = 60.0
# A peer may forward a chat here as soon as the leader's report names this peer the head,
# before that report reaches this peer; the chat waits this long for it.
HEAD_TAKEOVER_S = 10.0
RELAY_TIMEOUT_S = 10.0
# A retired plan's plane keeps serving this long at most while its answers move to the new
# plan with their K/V (each at its next token boundary).
HANDOVER_S = 10.0
MAX_CHAT_TOKENS = 8192
# Events of one answer that may wait for its client while the answer computes from the exit
# alone: enough that a client reading along never waits for the exit's next step, few enough
# that an answer whose client stops reading runs only that far past what the socket buffers.
ANSWER_BUFFER = 16
MAX_TOKEN_ID = 2**31 - 1  # beyond any vocabulary; the model refuses ids past its own
MAX_SEED = 2**64 - 1  # the largest seed SequenceOpen carries (msgpack integers)
MAX_STOPS = 4  # stop strings of one chat, as OpenAI allows
CHAT_KINDS = (ChatRequest, ChatEvent, ChatCancel)
SHARE_KINDS = (protocol.ShareData, protocol.ShareStep, protocol.ShareDrop)
PLANE_KINDS = (
    protocol.StageData, protocol.SequenceOpen, protocol.SequenceToken, protocol.SequenceDrop,
    protocol.SequenceFailed, protocol.SequenceStatsRequest, protocol.SequenceMove,
    protocol.SequenceState, protocol.SequenceFork,
)


@dataclass(frozen=True)
class ChatBody:
    """A validated chat request."""

    prompt_ids: list[int] | None
    messages: list[dict[str, str]] | None
    prompt: str | None  # plain text, encoded without the chat template
    max_tokens: int | None  # None: up to the end-of-sequence token or the context limit
    params: SamplingParams
    produced: tuple[int, ...] = ()  # resume_ids: tokens an earlier head already streamed
    stops: tuple[str, ...] = ()  # the text ends before the first of these that appears


def parse_chat(request: dict[str, Any]) -> ChatBody:
    """The chat request in `request`, or PeerdError naming what is wrong with it."""
    prompt_ids, messages = request.get("prompt_ids"), request.get("messages")
    prompt = request.get("prompt")
    if [prompt_ids, messages, prompt].count(None) != 2:
        raise invalid('a chat needs exactly one of "prompt_ids", "messages" and "prompt"')
    if prompt is not None and not (isinstance(prompt, str) and prompt):
        raise invalid('"prompt" must be a non-empty string')
    if prompt_ids is not None and not (prompt_ids and _token_ids(prompt_ids)):
        raise invalid('"prompt_ids" must be a non-empty list of integers, token ids >= 0')
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise invalid('"messages" must be a non-empty list of {"role", "content"} strings')
    max_tokens = request.get("max_tokens")
    if max_tokens is not None and (
        type(max_tokens) is not int or not 1 <= max_tokens <= MAX_CHAT_TOKENS
    ):
        raise invalid(f'"max_tokens" must be an integer from 1 to {MAX_CHAT_TOKENS}')
    try:
        params = SamplingParams(
            float(request.get("temperature", 0.0)),
            int(request.get("top_k", 0)),
            float(request.get("top_p", 1.0)),
            int(request.get("seed", 0)),
            _logprobs_asked(request.get("logprobs")),
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise invalid(f"bad sampling settings: {exc}") from None
    if not 0 <= params.seed <= MAX_SEED:
        raise invalid(f"bad sampling settings: seed must be from 0 to {MAX_SEED}")
    produced = request.get("resume_ids", [])
    if not _token_ids(produced):
        raise invalid('"resume_ids" must be a list of integers, token ids >= 0')
    if max_tokens is not None and len(produced) > max_tokens:
        raise invalid('"resume_ids" must not be longer than "max_tokens"')
    return ChatBody(prompt_ids, messages, prompt, max_tokens, params, tuple(produced),
                    _stops(request.get("stop")))


def _logprobs_asked(value: Any) -> int | None:
    if value is not None and type(value) is not int:
        raise ValueError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} or null")
    return value


def _stops(value: Any) -> tuple[str, ...]:
    """"stop": a string or a list of up to MAX_STOPS strings, none empty (or null)."""
    stops = [value] if isinstance(value, str) else [] if value is None else value
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(stop, str) and stop for stop in stops)):
        raise invalid(f'"stop" must be a non-empty string or a list of up to {MAX_STOPS} of them')
    return tuple(stops)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value
    )


class AnswerEvents:
    """One answer's events on their way to its client, first in first out.

    The data plane's tokens go in without waiting: one slow client must not hold up the steps
    its answer shares with others (its events wait here, at most max_tokens of them). An
    answer from the exit alone (standalone) has nothing else to pace it, so it computes its
    next token only once fewer than `bound` events wait (`room`): when its client stops
    reading, the socket's buffers fill, the events stop being taken, and the answer pauses.
    """

    def __init__(self, bound: int = ANSWER_BUFFER) -> None:
        self._events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._bound = bound
        self._taken = asyncio.Event()

    def __len__(self) -> int:
        return self._events.qsize()

    def put(self, event: dict[str, Any] | None) -> None:
        self._events.put_nowait(event)

    async def get(self) -> dict[str, Any] | None:
        event = await self._events.get()
        self._taken.set()
        return event

    async def room(self) -> None:
        """Return once fewer than `bound` events wait."""
        while len(self) >= self._bound:
            self._taken.clear()
            await self._taken.wait()


@dataclass(frozen=True)
class Head:
    """What the head needs to answer: its answers and the model's tokenizer and limits."""

    answers: Answers
    tokenizer: Tokenizer | None
    stop_ids: frozenset[int]
    max_positions: int
    vocab_size: int  # token ids are in [0, vocab_size)
    model_key: str = ""


class ChatService:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.head: Head | None = None  # set on the head peer while a plan is deployed
        self.head_peer: str | None = None  # where to forward chats typed here
        self.problem: str | None = None  # why no plan serves, when the leader says so
        self.head_changed = asyncio.Event()  # set (and replaced) when head_peer or problem change
        self._forwarded: dict[str, asyncio.Task] = {}  # on the head: chats asked by peers
        self._asked: dict[str, asyncio.Queue] = {}  # here: events of chats we forwarded

    # -- the local API op --------------------------------------------------------------------
    async def op_chat(self, request: dict[str, Any], send: Send) -> None:
        body = {key: value for key, value in request.items() if key != "op"}
        parse_chat(body)  # a malformed request is refused here, before it reaches any peer
        if self.head is None and self.head_peer is None:
            raise PeerdError(self.problem or "no model is deployed yet (see peerd status)",
                             ErrorKind.UNAVAILABLE)
        await self._chat(body, send)

    async def answer(self, body: ChatBody, send: Send) -> None:
        """Answer on this peer, the head; streams token events, then the done event."""
        head = self.head
        if head is None:
            raise PeerdError("this peer is no longer the head; ask again", ErrorKind.UNAVAILABLE)
        prompt = self._prompt_ids(head, body)
        max_tokens = _answer_limit(head, body.max_tokens, len(prompt))
        text, stops = TextStream(head.tokenizer), StopStrings(body.stops)
        for token in body.produced:  # handed out by an earlier head, as this one would have
            stops.add(text.add(token))
        events = AnswerEvents()
        token_times: list[float] = []
        started = time.perf_counter()

        def on_token(new: NewToken) -> bool:
            token_times.append(time.perf_counter())
            piece = stops.add(text.add(new.id))
            if new.last:
                piece += stops.end()
            event: dict[str, Any] = {"event": "token", "token": new.id, "text": piece}
            if new.degraded:
                event["degraded"] = True
            if new.logprobs is not None:
                event["logprobs"] = _logprobs_entry(head.tokenizer, new.id, new.logprobs)
            events.put(event)
            return stops.stopped

        request = Request(prompt, body.params, max_tokens, head.stop_ids, body.produced,
                          stops.stopped)
        generation = asyncio.create_task(head.answers.generate(request, on_token, events.room))
        generation.add_done_callback(lambda _: events.put(None))
        try:
            while (event := await events.get()) is not None:
                await send(event)
            answered = generation.result()
        except Busy as exc:
            raise PeerdError(str(exc), ErrorKind.BUSY) from None
        except GenerationError as exc:
            raise PeerdError(str(exc), ErrorKind.UNAVAILABLE) from None
        finally:
            generation.cancel()
        stats = _stats(answered, len(prompt), started, token_times)
        await send({"event": "done", "ok": True, "token_ids": answered.tokens,
                    "text": stops.text, "finish_reason": _finish_reason(head, answered, stops),
                    "degraded": answered.degraded > 0, "stats": stats})

    def _prompt_ids(self, head: Head, body: ChatBody) -> list[int]:
        if body.prompt_ids is not None:
            prompt = body.prompt_ids
            _check_vocabulary(prompt, head.vocab_size)
        elif head.tokenizer is None:
            raise PeerdError("this model has no tokenizer: send prompt_ids", ErrorKind.NO_TOKENIZER)
        elif body.prompt is not None:
            prompt = head.tokenizer.encode(body.prompt)
            if not prompt:
                raise invalid("the prompt encodes to no tokens")
        else:
            assert body.messages is not None  # parse_chat: exactly one of the three
            try:
                prompt = head.tokenizer.conversation_ids(body.messages)
            except ModelError as exc:
                raise invalid(str(exc)) from None
        return prompt

    # -- forwarding --------------------------------------------------------------------------
    def set_head_peer(self, peer: str | None, problem: str | None = None) -> None:
        """Where chats typed here go from now on (None: nowhere, `problem` says why)."""
        if (peer, problem) != (self.head_peer, self.problem):
            self.head_peer, self.problem = peer, problem
            self.head_changed.set()
            self.head_changed = asyncio.Event()

    async def _chat(self, body: dict[str, Any], send: Send) -> None:
        """Answer here while this peer is the head, else relay the head's answer; if the head
        changes mid-answer, the next head resumes it from the tokens already streamed."""
        streamed = list(body.get("resume_ids", []))

        async def counted(event: dict[str, Any]) -> None:
            if event.get("event") == "token":
                streamed.append(event["token"])
            await send(event)

        while True:
            asked = {**body, "resume_ids": list(streamed)}
            if self.head is not None:
                ended = await self._answer_here(parse_chat(asked), counted)
            elif (head := self.head_peer) is not None:
                ended = await self._ask_head(head, asked, counted)
            else:
                raise PeerdError(self.problem or "the head went away and no plan replaced it",
                                 ErrorKind.UNAVAILABLE)
            if ended:
                return
            log.info("the head moved to %s; resuming after %d tokens", self.head_peer,
                     len(streamed))

    async def _answer_here(self, body: ChatBody, send: Send) -> bool:
        """Answer on this peer, the head; False when another peer became the head before
        the answer ended."""
        try:
            await self.answer(body, send)
        except HeadMoved:
            return False
        return True

    async def _ask_head(self, head: str, body: dict[str, Any], send: Send) -> bool:
        """Relay one head's events; False when that head was replaced before the answer
        ended."""
        chat_id = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._asked[chat_id] = queue
        finished = False
        try:
            try:
                await self.transport.deliver(head, ChatRequest(chat_id, body), RELAY_TIMEOUT_S)
            except TransportError as exc:
                raise PeerdError(f"cannot reach the head: {exc}", ErrorKind.UNAVAILABLE) from None
            while not finished:
                event = await self._next_event(queue, head)
                if event is None:
                    return False
                finished = event.get("event") == "done" or event.get("ok") is False
                await send(event)
            return True
        finally:
            self._asked.pop(chat_id, None)
            if not finished:
                self.transport.send(head, ChatCancel(chat_id))

    async def _next_event(self, queue: asyncio.Queue, head: str) -> dict[str, Any] | None:
        """The head's next event, or None once another head replaced it."""
        deadline = time.monotonic() + HEAD_SILENCE_S
        while self.head_peer == head:
            changed = asyncio.ensure_future(self.head_changed.wait())
            get = asyncio.ensure_future(queue.get())
            left = deadline - time.monotonic()
            await asyncio.wait({changed, get}, timeout=max(left, 0),
                               return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if get.done():
                return get.result()
            get.cancel()
            if time.monotonic() >= deadline:
                raise PeerdError(f"the head sent nothing for {HEAD_SILENCE_S:.0f}s",
                                 ErrorKind.UNAVAILABLE)
        if self.head_peer is None:
            raise PeerdError(self.problem or "the head went away and no plan replaced it",
                                 ErrorKind.UNAVAILABLE)
        return None

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
                await self._until_head(HEAD_TAKEOVER_S)
                await self.answer(parse_chat(message.body), relay)
            except HeadMoved:
                pass  # the asking peer resumes the answer on the new head once it learns of it
            except PeerdError as exc:
                with contextlib.suppress(TransportError):
                    await relay(exc.answer())
            except TransportError:
                pass  # the asking peer is gone; its answer ended with the cancellation above
            finally:
                self._forwarded.pop(message.chat_id, None)

        self._forwarded[message.chat_id] = asyncio.get_running_loop().create_task(run())

    async def _until_head(self, wait_s: float) -> None:
        """Return once this peer is the head, or after `wait_s` (answer() then says why)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while self.head is None:
                    await self.head_changed.wait()

    async def close(self) -> None:
        tasks = list(self._forwarded.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _logprobs_entry(tokenizer: Tokenizer | None, token: int,
                    logprobs: TokenLogprobs) -> dict[str, Any]:
    """A token's log-probabilities in the shape of OpenAI's `logprobs.content[]`, plus the
    ids (`token_id`)."""
    return {**_token_entry(tokenizer, token, logprobs.logprob), "top_logprobs": [
        _token_entry(tokenizer, top, logprob) for top, logprob in logprobs.top]}


def _token_entry(tokenizer: Tokenizer | None, token: int, logprob: float) -> dict[str, Any]:
    # A token's own text (a model without a tokenizer: its id); a token that is part of a
    # character reads as U+FFFD.
    text = (f"token_id:{token}" if tokenizer is None
            else tokenizer.decode([token], skip_special_tokens=False))
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "token_id": token}


def _answer_limit(head: Head, max_tokens: int | None, prompt_tokens: int) -> int:
    """The most tokens the answer may have: `max_tokens` if given, else as many as the
    context holds after the prompt (the model's positions, at most the plan's K/V reserve)."""
    if max_tokens is not None:
        if prompt_tokens + max_tokens > head.max_positions:
            raise PeerdError(
                f"{prompt_tokens} prompt tokens + {max_tokens} new tokens exceed the "
                f"model's {head.max_positions} positions", ErrorKind.PROMPT_TOO_LONG
            )
        return max_tokens
    context = min(head.max_positions, head.answers.kv_reserve_tokens or head.max_positions)
    if prompt_tokens >= context:
        raise PeerdError(f"{prompt_tokens} prompt tokens leave no room in the context of "
                         f"{context} tokens", ErrorKind.PROMPT_TOO_LONG)
    return context - prompt_tokens


def _finish_reason(head: Head, answered: Answered, stops: StopStrings) -> str:
    """"stop" when the answer ended with a stop string or an end-of-sequence token, else
    "length" (max_tokens or the context limit)."""
    ended = bool(answered.tokens) and answered.tokens[-1] in head.stop_ids
    return "stop" if stops.stopped or ended else "length"


def _check_vocabulary(prompt: list[int], vocab_size: int) -> None:
    """Refuse ids the model has no embedding for, before they reach any peer."""
    outside = [token for token in prompt if token >= vocab_size]
    if outside:
        raise invalid(f"token id {outside[0]} is outside the model's vocabulary: ids are 0 to "
                      f"{vocab_size - 1} (vocabulary size {vocab_size})")


def _stats(answered: Answered, prompt_tokens: int, started: float, times: list[float]) -> dict:
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    stages = [
        {"stage": index, **{k: v for k, v in dataclasses.asdict(cost).items() if k != "req"}}
        for index, cost in enumerate(answered.stages)
    ]
    return {
        "prompt_tokens": prompt_tokens,
        "reused_prompt_tokens": answered.reused,
        "exit": answered.exits,
        "degraded_tokens": answered.degraded,
        "generated_tokens": len(times),
        "time_to_first_token_s": round(times[0] - started, 6) if times else None,
        "tokens_per_second": round((len(times) - 1) / decode_s, 3) if decode_s else None,
        "total_s": round(time.perf_counter() - started, 6),
        "resumed": answered.resumed,
        "kv_moved": answered.kv_moved,
        "fp16_wire": any(stage["fp16_wire"] for stage in stages),
        "sequential_bytes": sum(stage["sequential_bytes"] for stage in stages),
        "residual_bytes": sum(stage["residual_bytes"] for stage in stages),
        "stages": stages,
    }


def plane_of(planes: dict[str, DataPlane], message: Any) -> DataPlane | None:
    """The plane a data message belongs to: the one its plan names, else the one that runs
    its sequence, else the newest."""
    plan = getattr(message, "plan", None)
    if plan is not None:
        return planes.get(plan)
    seq_id = getattr(message, "seq_id", None)
    owner = next((p for p in planes.values() if seq_id is not None and p.owns(seq_id)), None)
    return owner or next(reversed(planes.values()), None)


class Serving:
    """The data planes and chat service of the plans this peer has a stage in."""

    def __init__(self, me: str, transport: Transport, model_dir: Path | None,
                 limits: Limits | None = None, fp16_wire: bool = False,
                 unit_clock: UnitClock | None = None, exits: ExitSettings | None = None,
                 standalone: bool = False) -> None:
        self.me = me
        self.exits = exits or ExitSettings()
        self.unit_clock = unit_clock or UnitClock()
        self.transport = transport
        self.model_dir = model_dir
        self.limits = limits or Limits()
        self.fp16_wire = fp16_wire
        self.chat = ChatService(transport)
        self.answers = Answers(self.limits, standalone)
        self.planes: dict[str, DataPlane] = {}  # by plan key, oldest first
        self.groups: dict[str, GroupLead | GroupMember] = {}  # this peer's shares, by plan
        self._retired: set[asyncio.Task] = set()
        self._retiring: set[str] = set()  # plan keys of planes closing once answers moved
        self._stage_mark: tuple[str, int, float] | None = None
        self._stage_s: float | None = None

    @property
    def plane(self) -> DataPlane | None:
        """The newest plane."""
        return next(reversed(self.planes.values()), None)

    def on_plan(self, event: PlanEvent) -> None:
        match event:
            case StageLoaded(plan=plan, loaded=loaded):
                self._plane_for(plan, loaded)
            case PlanLive(plan=plan) if not plan.stages:
                self._retire_all_but(None)
                self._close_groups_but(None)
                self.chat.head = None
                self.chat.set_head_peer(None, plan.problem)
                self.answers.use(None, problem=plan.problem)
            case PlanLive(plan=plan, loaded=loaded, alive=alive):
                self._serve(plan, loaded, alive)

    def _serve(self, plan: PlanAssignment, loaded: LoadedStage | None,
               alive: frozenset[str]) -> None:
        """Answer on `plan` from now on: the head's answers move to its plane."""
        plane = self.planes.get(plan.key)
        self._close_groups_but(plan.key)
        self.chat.set_head_peer(plan.stages[0].peer)
        if plane is not None and plane.is_head and loaded is not None:
            self.answers.use(plane, context_for(loaded.manifest))
            if self.chat.head is None or self.chat.head.model_key != loaded.manifest.key:
                self.chat.head = self._head(loaded.manifest)
        else:
            self.chat.head = None
            self.answers.use(None, moved_to=plan.stages[0].peer)
        self._retire_all_but(plane, set(alive))

    def _plane_for(self, plan: PlanAssignment, loaded: LoadedStage) -> None:
        """This peer's plane of `plan`, built once its stage's units are loaded; a member of
        a group stage that is not its lead has no plane, only its share."""
        if plan.key in self.planes or plan.key in self.groups:
            return
        executor = loaded.executor
        if isinstance(executor, ShareRunner):
            if loaded.group[0] != self.me:
                self.groups[plan.key] = GroupMember(executor, loaded.group, self.transport,
                                                    plan.key)
                return
            executor = self.groups[plan.key] = GroupLead(executor, loaded.group,
                                                         self.transport, plan.key)
        ring = [(s.peer, s.first, s.last) for s in plan.stages]
        self.planes[plan.key] = DataPlane(
            self.me, self.transport, ring, loaded.manifest, executor, self.fp16_wire,
            self.limits, plan.key, self.planes, self.unit_clock, self.exits)

    def _close_groups_but(self, keep: str | None) -> None:
        """Close the shares of other plans than `keep` where no plane of theirs serves on
        (a lead's closes with its plane)."""
        for key in [k for k in self.groups if k != keep and k not in self.planes]:
            self.groups.pop(key).close()

    def _head(self, manifest: Manifest) -> Head:
        model = manifest.model
        return Head(self.answers, self._load_tokenizer(), frozenset(model.eos_token_ids),
                    model.max_positions, model.vocab_size, manifest.key)

    def _load_tokenizer(self) -> Tokenizer | None:
        if self.model_dir is None:
            return None
        # Imported here: the tokenizer libraries cost every peer without the model 10 MB.
        from shards.tokenizer import Tokenizer

        try:
            return Tokenizer.from_model(self.model_dir)
        except NoTokenizer as exc:
            log.info("%s", exc)
            return None

    def _retire_all_but(self, keep: DataPlane | None, alive: set[str] | None = None) -> None:
        """Retire every plane but `keep`. Where every peer of a plane is alive, it serves
        on while its answers move to `keep` with their K/V; otherwise it closes at once."""
        for key, plane in list(self.planes.items()):
            if plane is keep or key in self._retiring:
                continue
            handover = keep if keep is not None and keep.is_head else None
            moving = alive is not None and set(plane.peers) <= alive and (
                handover is not None or not plane.is_head
            )
            self._retiring.add(key)
            task = asyncio.get_running_loop().create_task(
                self._retire(key, plane, handover, HANDOVER_S if moving else 0.0)
            )
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)

    async def _retire(self, key: str, plane: DataPlane, handover: DataPlane | None,
                      wait_s: float) -> None:
        try:
            await plane.retire(handover, wait_s)
        finally:
            self.planes.pop(key, None)
            self._retiring.discard(key)
            group = self.groups.pop(key, None)
            if group is not None:
                group.close()

    def handlers(self) -> dict[type, Handler]:
        """The kinds answered here: chats, and data messages for the plane of their plan."""
        return dict.fromkeys((*PLANE_KINDS, *CHAT_KINDS, *SHARE_KINDS), self._message)

    def _message(self, member: Member, message: Any, incoming: Incoming) -> None:
        self.handle(member.id, message, incoming.reply)

    def handle(self, sender: str, message: Any, reply: Callable[[Any], None]) -> None:
        if isinstance(message, CHAT_KINDS):
            self.chat.handle(sender, message)
            return
        if isinstance(message, SHARE_KINDS):
            group = self.groups.get(message.plan)
            if group is not None:
                group.handle(sender, message)
            else:
                log.info("dropped %s from %s: no share of plan %s here", message.KIND, sender,
                         message.plan)
            return
        plane = plane_of(self.planes, message)
        if plane is not None:
            plane.handle(sender, message, reply)
        else:
            log.info("dropped %s from %s: no plane of it here", message.KIND, sender)

    def stage_seconds(self) -> float | None:
        """Seconds per step of this peer's stage since the last call (the last figure when
        no step ran since); None before any."""
        plane = self.plane
        if plane is None:
            return None
        counters = plane.worker.counters
        mark = (plane.plan, counters.steps, counters.compute_s)
        last = self._stage_mark
        if last is not None and last[0] == mark[0] and mark[1] > last[1]:
            self._stage_s = (mark[2] - last[2]) / (mark[1] - last[1])
        elif (last is None or last[0] != mark[0]) and mark[1]:
            self._stage_s = mark[2] / mark[1]
        self._stage_mark = mark
        return self._stage_s

    def answer_figures(self) -> AnswerFigures | None:
        """What the answers measured on the plane this head answers on; None elsewhere."""
        plane = self.answers.plane
        return plane.answer_clock.figures(plane.plan) if plane is not None else None

    def status(self) -> dict[str, Any]:
        """What `peerd status` shows of the data plane on this peer."""
        plane = self.plane
        answers = self.answers.status()
        held = [*self._executors().values(), *(g.runner for g in self.groups.values())]
        sequences = sum(e.sequence_count for e in held)
        kv_bytes = sum(e.kv_bytes() for e in held)
        if plane is None:
            return {"stage": None, "plans": [], "sequences": sequences, "kv_bytes": kv_bytes,
                    "share": self._share(), **answers}
        counters = plane.worker.counters
        return {
            "stage": plane.stage,
            "plan": plane.plan,
            "plans": list(self.planes),
            "share": self._share(),
            "head": self.chat.head is not None,
            "sequences": sequences,
            "kv_bytes": kv_bytes,
            "kept": len(self.answers.plane.prefixes) if self.answers.plane else 0,
            "exit": plane.exit_status(),
            **answers,
            **dataclasses.asdict(counters),
        }

    def _share(self) -> dict[str, Any] | None:
        """This peer's share of the newest group stage it serves in, if any."""
        group = next(reversed(self.groups.values()), None)
        if group is None:
            return None
        return {"plan": group.plan, "index": group.runner.index,
                "group": list(group.share.group)}

    def memory_bytes(self, loaded: StageExecutor | ShareRunner | None,
                     copies: Iterable[HeldUnit] = ()) -> int:
        """Bytes the weights and K/V of every stage this peer holds occupy: its planes' (an
        old plane's too, until it retires) and `loaded`, the newest, even before its plane,
        with the movable `copies` it holds beside them; a unit the old and the new stage
        share runs in one session, counted once. Of a group's share, its K/V."""
        executors = self._executors()
        if isinstance(loaded, StageExecutor):
            executors[id(loaded)] = loaded
        shares = sum(g.runner.kv_bytes() for g in self.groups.values())
        return held_bytes(executors.values(), copies) + shares

    def _executors(self) -> dict[int, StageExecutor]:
        """The stage executors of this peer's planes, once each (planes may share one); a
        group's lead runs its share instead."""
        return {id(p.worker.executor): p.worker.executor for p in self.planes.values()
                if isinstance(p.worker.executor, StageExecutor)}

    async def close(self) -> None:
        await self.chat.close()
        self._retire_all_but(None)
        await asyncio.gather(*(plane.close() for plane in list(self.planes.values())))
        await asyncio.gather(*self._retired, return_exceptions=True)
        self._close_groups_but(None)
