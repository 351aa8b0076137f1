"""The head's answers: admission, and generations that outlive the plan they started on.

Every chat the head accepts becomes one `Generation` here. It waits in a bounded line until
a slot is free and the plan's K/V reserve has room for its tokens (prompt + max_tokens), then
runs on the current data plane. When the plan changes (a rebalance, a new leader), the old
plane is retired: at its next token boundary the answer moves to the new plane with its K/V
(peerd/inference/dataplane.py) and continues there. Where the K/V cannot move (a peer lost), the
answer keeps every token it has, waits for the next plane, and resumes there by re-prefilling its
prompt and those tokens under a fresh sequence id. Where the next plan's head is another peer, the
answer ends here with HeadMoved, and the chat service asks that peer to resume it from the tokens
streamed so far. Either way the client sees one uninterrupted, unchanged answer. When no plan
can serve (the model no longer fits), waiting answers end with the leader's reason.

Standalone (CE-CoLLM): where the head's stage has an early exit and the peer was started with
`--standalone`, an answer whose plan went away keeps going meanwhile from the exit alone, each
token marked degraded, and continues at full depth once a plan serves again, re-prefilling
there (the deeper stages catch up with the degraded tokens' K/V). Nothing but its client
paces such an answer: it computes each token only once its client has room for it
(`ClientRoom`), so an answer whose client stops reading pauses rather than running on alone.
Once another peer is the head, such an answer goes on there, at full depth.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from peerd.inference.dataplane import (
    DataPlane,
    GenerationError,
    Limits,
    Moved,
    OnToken,
    PlaneClosed,
)
from peerd.inference.pipeline import Generation, NewToken
from peerd.wire.protocol import SequenceStats
from shards.early_exit import EXIT_HIDDEN
from shards.executor import StageExecutor
from shards.sampling import Sampler, SamplingParams

log = logging.getLogger("peerd.inference.answers")

# Awaited before each token an answer computes from the exit alone: returns once the answer's
# client has room for one more token (peerd/inference/serving.py, AnswerEvents.room).
ClientRoom = Callable[[], Awaitable[None]]


class Busy(GenerationError):
    """Every slot is taken and the waiting line is full."""


class HeadMoved(Exception):
    """The plan's head is another peer now: the answer goes on there (`ChatService` asks
    it to resume from the tokens already streamed)."""

    def __init__(self, peer: str) -> None:
        super().__init__(f"the head moved to peer {peer}")
        self.peer = peer


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    produced: tuple[int, ...] = ()  # tokens an earlier head already streamed to the client
    stopped: bool = False  # the text of `produced` already reached a stop string

    @property
    def kv_tokens(self) -> int:
        """Positions of K/V the answer may hold at its longest."""
        return len(self.prompt) + self.max_tokens


@dataclass
class Answered:
    tokens: list[int]
    stages: list[SequenceStats]
    resumed: int  # times the answer moved to a new plan
    kv_moved: int = 0  # of those, the moves that took its K/V along (the rest re-prefilled)
    reused: int = 0  # prompt positions whose K/V came from an earlier answer
    exits: dict | None = None  # what the exit did (DataPlane.exit_stats), where there is one
    degraded: int = 0  # tokens from the exit alone, while no plan served (standalone)


@dataclass
class _Serving:
    """What the head serves with now: the plane, its K/V reserve in tokens, or why none:
    the peer the head moved to, or the problem."""

    plane: DataPlane | None = None
    kv_tokens: int = 0
    problem: str | None = None
    moved_to: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class Answers:
    def __init__(self, limits: Limits | None = None, standalone: bool = False) -> None:
        """`standalone`: answers whose plan went away keep going from the head's exit."""
        self.limits = limits or Limits()
        self.standalone = standalone
        self._now = _Serving()
        self._line: collections.deque[object] = collections.deque()
        self._room = asyncio.Condition()
        self._running = 0
        self._reserved = 0  # K/V tokens reserved by running answers
        self._tasks: set[asyncio.Task] = set()
        # answers moved to a new plan since this peer started: with their K/V, re-prefilled
        self._moved_with_kv = 0
        self._re_prefilled = 0
        self._waiting_for_client = 0  # answers from the exit alone, paused for their client

    # -- the plan ----------------------------------------------------------------------------
    def use(self, plane: DataPlane | None, kv_tokens: int = 0, problem: str | None = None,
            moved_to: str | None = None) -> None:
        """Serve with `plane` from now on (None: no plane; `problem` says why, if known, or
        `moved_to` names the peer that is the head now: answers then end with HeadMoved)."""
        current = self._now
        if ((current.plane, current.kv_tokens, current.problem, current.moved_to)
                == (plane, kv_tokens, problem, moved_to)):
            return
        current.changed.set()
        self._now = _Serving(plane, kv_tokens, problem, moved_to)
        task = asyncio.get_running_loop().create_task(self._recheck_room())
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    @property
    def plane(self) -> DataPlane | None:
        return self._now.plane

    @property
    def kv_reserve_tokens(self) -> int:
        """Positions of K/V the plan reserves for all answers together (0: no limit)."""
        return self._now.kv_tokens

    async def _recheck_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    # -- answering ---------------------------------------------------------------------------
    async def generate(self, request: Request, on_token: OnToken,
                       room: ClientRoom | None = None) -> Answered:
        """Run one request to completion, calling `on_token` with each new token (which may
        end it early). Tokens from the exit alone (standalone) wait for `room` first; the
        data plane's never do: they share their steps with other answers."""
        await self._admit(request)
        try:
            return await self._generate(request, on_token, room)
        finally:
            await self._release(request)

    async def _generate(self, request: Request, on_token: OnToken,
                        room: ClientRoom | None) -> Answered:
        generation = Generation(uuid.uuid4().hex, request.prompt, request.max_tokens,
                                request.stop_ids, tokens=list(request.produced),
                                stopped=request.stopped)
        resumed, kv_moved, left, plane = 0, 0, None, None
        while not generation.finished:
            if plane is None:
                plane = await self._plane(avoid=left)
            try:
                stages = await plane.run(generation, request.params, on_token)
                return Answered(generation.tokens, stages, resumed, kv_moved, generation.reused,
                                plane.exit_stats(generation), generation.degraded)
            except Moved as moved:
                log.info("answer %s moved to plan %s with its K/V after %d tokens",
                         generation.seq_id, moved.plane.plan, len(generation.tokens))
                generation.moved(moved.seq_id)
                plane = moved.plane
                kv_moved += 1
                self._moved_with_kv += 1
            except PlaneClosed as closed:
                log.info("answer %s moves to the next plan after %d tokens (%s)",
                         generation.seq_id, len(generation.tokens), closed or "plan retired")
                generation.restart(uuid.uuid4().hex)
                left, plane = plane, None
                self._re_prefilled += 1
                exit_stage = left.exit_executor
                if self.standalone and exit_stage is not None:
                    await self._alone(generation, request.params, on_token, room, exit_stage,
                                      left)
            resumed += 1
        return Answered(generation.tokens, [], resumed, kv_moved, degraded=generation.degraded)

    async def _alone(self, generation: Generation, params: SamplingParams, on_token: OnToken,
                     room: ClientRoom | None, stage: StageExecutor, left: DataPlane) -> None:
        """Answer from the exit of the head's stage alone until a plane other than `left`
        serves (or the answer ends): each token is degraded, computed once the client has
        `room` for it. The sequence re-prefills on the stage once, and its K/V is dropped
        after."""
        if not self._serving_again(left):
            log.warning("answer %s goes on from the exit alone: no plan serves",
                        generation.seq_id)
        sampler = Sampler(params, skip=len(generation.tokens))
        try:
            while not generation.finished:
                if room is not None:
                    await self._paused_for(room)
                if self._serving_again(left):
                    break
                step = generation.next_step()
                outputs = await asyncio.to_thread(stage.step, generation.seq_id, step.inputs)
                logits = await asyncio.to_thread(stage.exit_logits, outputs[EXIT_HIDDEN])
                token = sampler(logits[0, -1])
                generation.record(step.step, token)
                generation.degraded += 1
                if on_token(NewToken(token, None, generation.finished, degraded=True)):
                    generation.stop_after(len(generation.tokens))
        finally:
            stage.drop(generation.seq_id)
        generation.restart(uuid.uuid4().hex)

    async def _paused_for(self, room: ClientRoom) -> None:
        """Wait until the client has room for the next token (counted in status meanwhile)."""
        self._waiting_for_client += 1
        try:
            await room()
        finally:
            self._waiting_for_client -= 1

    def _serving_again(self, left: DataPlane) -> bool:
        """A plane other than `left` serves, here or on the peer the head moved to."""
        plane = self._now.plane
        moved = self._now.moved_to is not None
        return moved or (plane is not None and not plane.closed and plane is not left)

    async def _plane(self, avoid: DataPlane | None = None) -> DataPlane:
        """The plane to run on (not `avoid`, which failed the answer), waiting up to
        `resume_wait_s` for one; HeadMoved where another peer is the head now."""
        deadline = time.monotonic() + self.limits.resume_wait_s
        while True:
            now = self._now
            if now.plane is not None and not now.plane.closed and now.plane is not avoid:
                return now.plane
            if now.moved_to is not None:
                raise HeadMoved(now.moved_to)
            if now.problem is not None:
                raise GenerationError(now.problem)
            left = deadline - time.monotonic()
            if left <= 0:
                raise GenerationError(
                    f"no plan could serve for {self.limits.resume_wait_s:.0f}s; ask again"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await now.changed.wait()

    # -- admission ---------------------------------------------------------------------------
    async def _admit(self, request: Request) -> None:
        """Wait in line for a slot and K/V room; Busy when the line is full."""
        limits = self.limits
        if len(self._line) >= limits.max_waiting:
            raise Busy(f"busy: {self._running} answers running and {len(self._line)} "
                       "waiting; try again shortly")
        ticket = object()
        self._line.append(ticket)
        try:
            async with self._room:
                await self._room.wait_for(lambda: self._turn(ticket, request))
            self._running += 1
            self._reserved += request.kv_tokens
            self._room_for_kept(request.prompt)
        finally:
            self._line.remove(ticket)
            await self._recheck_room()

    def _turn(self, ticket: object, request: Request) -> bool:
        reserve = self._now.kv_tokens
        if reserve and request.kv_tokens > reserve:
            raise GenerationError(
                f"{request.kv_tokens} tokens (prompt + max_tokens) exceed the plan's K/V "
                f"reserve of {reserve} tokens"
            )
        if self._line[0] is not ticket:
            return False
        if reserve:  # admission by K/V room; a count only where the plan has no reserve
            return self._reserved + request.kv_tokens <= reserve
        return self._running < self.limits.max_sequences

    async def _release(self, request: Request) -> None:
        self._running -= 1
        self._reserved -= request.kv_tokens
        self._room_for_kept()
        await self._recheck_room()

    def _room_for_kept(self, admitted: list[int] | None = None) -> None:
        """Ended answers' kept K/V (for their conversations' next turns) may use what of
        the plan's K/V reserve the running answers leave; the kept K/V an `admitted`
        prompt will take over is part of its answer's room."""
        plane, reserve = self._now.plane, self._now.kv_tokens
        if plane is not None and reserve:
            plane.keep_within(reserve - self._reserved, admitted or ())

    def status(self) -> dict[str, int]:
        return {"running": self._running, "waiting": len(self._line),
                "kv_reserved_tokens": self._reserved, "kv_reserve_tokens": self._now.kv_tokens,
                "moved_with_kv": self._moved_with_kv, "re_prefilled": self._re_prefilled,
                "waiting_for_client": self._waiting_for_client}
