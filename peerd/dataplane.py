"""This peer's part in running the deployed model over the network.

Every peer in the plan runs one `StageWorker` (peerd/pipeline.py) for its stage; the source
peer, which holds unit 0, is also the head: it admits requests, runs their first stage, and
receives the sampled tokens from the last stage. Messages travel on the transport's data
channel: `StageData` along the routes (sequential to the next stage, residuals straight to
their consumers), `SequenceOpen` from the head to the last stage before a sequence starts,
`SequenceToken` back to the head, `SequenceDrop` to every stage when a sequence ends, and
`SequenceFailed` to the head when a stage cannot run a step.

Units run on one compute thread per peer, so the event loop keeps serving heartbeats and
messages of other sequences while a step runs. Everything else happens on the event loop; a
step that finishes after its sequence ended has its fresh K/V dropped at once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from peerd.pipeline import Generation, StageWorker, TokenSampler
from peerd.protocol import (
    SequenceDrop,
    SequenceFailed,
    SequenceOpen,
    SequenceOpened,
    SequenceToken,
    StageData,
)
from peerd.routing import routes
from peerd.transport import Transport, TransportError
from shards.executor import StageExecutor
from shards.manifest import Manifest
from shards.sampling import SamplingParams

log = logging.getLogger("peerd.dataplane")

# Sequences that ended recently: late messages for them are ignored rather than reviving K/V.
_ENDED_MEMORY = 4096


class GenerationError(Exception):
    """A sequence that could not be completed; the message is one line for the client."""


class Busy(GenerationError):
    """Every slot is taken and the waiting line is full."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]


@dataclass
class _Running:
    generation: Generation
    on_token: Callable[[int], None]
    done: asyncio.Future


@dataclass(frozen=True)
class Limits:
    max_sequences: int = 8  # running at once
    max_waiting: int = 32  # admitted to wait for a slot; beyond that, Busy
    send_timeout_s: float = 10.0


class DataPlane:
    def __init__(
        self,
        self_id: str,
        transport: Transport,
        stages: list[tuple[str, int, int]],
        manifest: Manifest,
        executor: StageExecutor,
        fp16_wire: bool = False,
        limits: Limits | None = None,
    ) -> None:
        self.peers = [peer for peer, _, _ in stages]
        self.stage = self.peers.index(self_id)
        stage_routes = routes(manifest, [(first, last) for _, first, last in stages])
        self.worker = StageWorker(self.stage, executor, stage_routes[self.stage], fp16_wire)
        self.transport = transport
        self.limits = limits or Limits()
        self.sampler = TokenSampler()
        self._running: dict[str, _Running] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{self.stage}")
        self._tasks: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(self.limits.max_sequences)
        self._waiting = 0

    @property
    def is_head(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.peers) - 1

    # -- the head's side ---------------------------------------------------------------------
    async def generate(self, request: Request, on_token: Callable[[int], None]) -> list[int]:
        """Run one request to completion, calling `on_token` with each new token.

        Cancelling the calling task ends the sequence on every peer.
        """
        if not self.is_head:
            raise GenerationError("this peer is not the head of the plan")
        if self._waiting >= self.limits.max_waiting:
            raise Busy(
                f"busy: {self.limits.max_sequences} answers running and "
                f"{self._waiting} waiting; try again shortly"
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._generate(request, on_token)
        finally:
            self._slots.release()

    async def _generate(self, request: Request, on_token: Callable[[int], None]) -> list[int]:
        seq_id = uuid.uuid4().hex
        generation = Generation(seq_id, request.prompt, request.max_tokens, request.stop_ids)
        running = _Running(generation, on_token, asyncio.get_running_loop().create_future())
        self._running[seq_id] = running
        try:
            await self._open(seq_id, request.params)
            self._start_step(generation)
            await running.done
            return generation.tokens
        finally:
            self._running.pop(seq_id, None)
            self._end(seq_id)

    async def _open(self, seq_id: str, params: SamplingParams) -> None:
        if self.is_last:
            self.sampler.open(seq_id, params)
            return
        ask = SequenceOpen(0, seq_id, params.temperature, params.top_k, params.top_p, params.seed)
        try:
            answer = await self.transport.request(self.peers[-1], ask, self.limits.send_timeout_s)
        except TransportError as exc:
            raise GenerationError(f"the last stage did not answer: {exc}") from None
        if answer.error:
            raise GenerationError(answer.error)

    def _start_step(self, generation: Generation) -> None:
        step, inputs = generation.step_inputs()
        self._spawn(self._run(generation.seq_id, step, inputs))

    def _on_token(self, seq_id: str, step: int, token: int) -> None:
        running = self._running.get(seq_id)
        if running is None:
            return  # cancelled meanwhile
        try:
            finished = running.generation.record(step, token)
        except ValueError as exc:
            self._fail(seq_id, str(exc))
            return
        running.on_token(token)
        if finished:
            running.done.set_result(None)
        else:
            self._start_step(running.generation)

    def _fail(self, seq_id: str, reason: str) -> None:
        running = self._running.get(seq_id)
        if running is not None and not running.done.done():
            running.done.set_exception(GenerationError(reason))

    def _end(self, seq_id: str) -> None:
        """Free the sequence here and on every other stage."""
        self._forget(seq_id)
        for peer in self.peers[1:]:
            self.transport.send(peer, SequenceDrop(seq_id))

    # -- every stage's side ------------------------------------------------------------------
    def handle(self, sender: str, message: Any, reply: Callable[[Any], None]) -> None:
        """A data-plane message from `sender` (a peer id the transport authenticated)."""
        if sender not in self.peers:
            log.warning("dropped %s from %s: not in the current plan", message.KIND, sender)
            return
        if isinstance(message, SequenceOpen):
            self._on_open(message, reply)
        elif getattr(message, "seq_id", None) in self._ended:
            return
        elif isinstance(message, StageData):
            self._on_stage_data(self.peers.index(sender), message)
        elif isinstance(message, SequenceToken) and self.is_head:
            self._on_token(message.seq_id, message.step, message.token)
        elif isinstance(message, SequenceFailed) and self.is_head:
            self._fail(message.seq_id, message.reason)
        elif isinstance(message, SequenceDrop):
            self._forget(message.seq_id)
        else:
            log.warning("dropped %s from %s: not for stage %d", message.KIND, sender, self.stage)

    def _on_open(self, message: SequenceOpen, reply: Callable[[Any], None]) -> None:
        try:
            params = SamplingParams(message.temperature, message.top_k, message.top_p, message.seed)
        except ValueError as exc:
            reply(SequenceOpened(message.req, error=str(exc)))
            return
        if not self.is_last:
            reply(SequenceOpened(message.req, error=f"stage {self.stage} does not sample"))
            return
        self.sampler.open(message.seq_id, params)
        reply(SequenceOpened(message.req))

    def _on_stage_data(self, source: int, message: StageData) -> None:
        try:
            inputs = self.worker.accept(source, message)
        except ValueError as exc:
            log.warning("dropped stage data: %s", exc)
            self._spawn(self._report_failure(message.seq_id, str(exc)))
            return
        if inputs is not None:
            self._spawn(self._run(message.seq_id, message.step, inputs))

    async def _run(self, seq_id: str, step: int, inputs: dict) -> None:
        loop = asyncio.get_running_loop()
        try:
            done = await loop.run_in_executor(self._compute, self.worker.run, seq_id, step, inputs)
        except Exception as exc:  # ONNX Runtime's errors derive from Exception alone
            await self._report_failure(seq_id, f"stage {self.stage}, step {step}: {exc}")
            return
        if seq_id in self._ended:
            self.worker.drop(seq_id)
            return
        try:
            for out in done.outgoing:
                await self.transport.deliver(
                    self.peers[out.target], out.message, self.limits.send_timeout_s
                )
        except TransportError as exc:
            await self._report_failure(seq_id, f"stage {self.stage}, step {step}: {exc}")
            return
        if done.logits is not None:
            await self._emit_token(seq_id, step, self.sampler.sample(seq_id, done.logits))

    async def _emit_token(self, seq_id: str, step: int, token: int) -> None:
        if self.is_head:
            self._on_token(seq_id, step, token)
            return
        message = SequenceToken(seq_id, step, token)
        try:
            await self.transport.deliver(self.peers[0], message, self.limits.send_timeout_s)
        except TransportError as exc:
            log.warning("could not return a token of %s: %s", seq_id, exc)

    async def _report_failure(self, seq_id: str, reason: str) -> None:
        log.warning("sequence %s failed: %s", seq_id, reason)
        if self.is_head:
            self._fail(seq_id, reason)
            return
        self.transport.send(self.peers[0], SequenceFailed(seq_id, reason))

    def _forget(self, seq_id: str) -> None:
        self._ended[seq_id] = None
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        self.sampler.close(seq_id)
        self.worker.drop(seq_id)

    # -- lifetime ----------------------------------------------------------------------------
    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for running in self._running.values():
            if not running.done.done():
                running.done.set_exception(GenerationError("the plan changed; retry"))
        self._compute.shutdown(wait=True)
