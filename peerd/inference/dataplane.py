"""This peer's part in running one deployed plan over the network.

Every peer in the plan runs one `StageWorker` (peerd/inference/pipeline.py) for its stage; the
source peer, which holds unit 0, is also the head: it runs each answer's `Generation` step by step
and receives the sampled tokens from the last stage. Messages travel on the transport's data
channel: `StageData` along the routes (sequential to the next stage, residuals straight to their
consumers), `SequenceOpen` from the head to the last stage before a sequence starts, `SequenceToken`
back to the head, `SequenceStatsRequest` to every stage as an answer ends, `SequenceDrop` to every
stage when a sequence ends, and `SequenceFailed` to the head when a stage cannot run a step.

A plane serves one plan. During a plan change the old and the new plane serve side by side
(each message names its plan). When the head retires the old plane for a new one, each
answer running on it pauses at its next token boundary and its K/V moves: the head asks
every stage of the old plan (`SequenceMove`) to send the K/V of its units to the peers that
hold those units in the new plan (`SequenceState`, stored under a fresh sequence id), and
once every stage has answered (`SequenceMoved`) the answer continues on the new plane with
its next decode step (`Moved`). Where that cannot be done (a peer of the old plan is gone,
the answer had not run a step yet) the answer gets `PlaneClosed` and re-prefills on the new
plane (peerd/inference/answers.py). A retired plane frees every sequence's K/V it held.

Units run on one compute thread per plane, so the event loop keeps serving heartbeats and
messages of other sequences while a step runs. Answers in flight at once share each pass
over a stage's weights (decoding on a CPU is bound by reading them, so a batch of 4 steps
costs little more than one):
- The steps whose inputs arrive while the thread is busy wait for it together and run as
  one batch (continuous batching: nothing waits for a straggler).
- The head runs its answers' next steps as one wave: an answer whose token came back
  waits for the others of the wave still in flight, a step at most. Without it answers
  that started apart stay apart, each stage running one at a time: 4 answers over three
  daemons on the 2-core development machine ran 256 steps in 218 batches.
- A stage's messages name the batch they ran in (`StageData.batch`), and the next stage
  runs that batch's steps once they have all come, rather than the first to arrive alone.
Everything else happens on the event loop; a step that finishes after its sequence ended
has its fresh K/V dropped at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from peerd.cluster.unit_clock import UnitClock
from peerd.inference.answer_clock import AnswerClock
from peerd.inference.groups import GroupLead
from peerd.inference.pipeline import (
    Drafts,
    Generation,
    NewToken,
    StageWorker,
    Step,
    StepDone,
    TokenLogprobs,
    TokenSampler,
    draft,
    drafts_wanted,
    exit_token,
)
from peerd.inference.prefixes import MIN_REUSE, PrefixCache
from peerd.inference.routing import routes
from peerd.wire.protocol import (
    Asks,
    Message,
    SequenceDrop,
    SequenceFailed,
    SequenceFork,
    SequenceForked,
    SequenceMove,
    SequenceMoved,
    SequenceOpen,
    SequenceOpened,
    SequenceState,
    SequenceStats,
    SequenceStatsRequest,
    SequenceToken,
    StageData,
)
from peerd.wire.transport import Transport, TransportError
from shards.early_exit import EXIT_COUNTS, ExitSettings
from shards.executor import StageExecutor
from shards.manifest import Manifest
from shards.sampling import SamplingParams

log = logging.getLogger("peerd.inference.dataplane")

# Sequences that ended recently: late messages for them are ignored rather than reviving K/V.
_ENDED_MEMORY = 4096
STATS_TIMEOUT_S = 2.0
# A batch's steps arrive within a fraction of a millisecond of each other; one that never
# comes (its sequence ended at the sender) holds the others no longer than this
GATHER_S = 0.05
# The full model's tokens of exited steps come within a few steps' time; past this an
# answer handed over to a new plan re-prefills there rather than waiting on
CHECKS_ON_HANDOVER_S = 2.0


# The answers that say only whether a request about a sequence's K/V was done
_Done = TypeVar("_Done", SequenceMoved, SequenceForked)

# Called with each new token of an answer; returning True ends the answer after it (its text
# reached a stop string), at once on every stage.
OnToken = Callable[[NewToken], bool | None]


class GenerationError(Exception):
    """A sequence that could not be completed; the message is one line for the client."""


class PlaneClosed(Exception):
    """The plane was retired while the answer ran on it: continue on the next plan."""


class PlanBroken(PlaneClosed):
    """A peer of the plan cannot be reached: continue on the next plan, which the leader
    makes once it notices the peer gone."""


class Moved(PlaneClosed):
    """The answer's K/V moved to `plane` under `seq_id`: continue there, no re-prefill."""

    def __init__(self, plane: DataPlane, seq_id: str) -> None:
        super().__init__(f"moved to plan {plane.plan}")
        self.plane, self.seq_id = plane, seq_id


@dataclass(frozen=True)
class Limits:
    max_sequences: int = 8  # running at once
    max_waiting: int = 32  # admitted to wait for a slot; beyond that, Busy
    send_timeout_s: float = 10.0
    stall_s: float = 60.0  # no token for this long ends an answer: the plan stopped working
    resume_wait_s: float = 60.0  # an answer whose plan went away waits this long for the next


@dataclass
class _Running:
    generation: Generation
    on_token: OnToken
    done: asyncio.Future
    active_at: float
    params: SamplingParams
    paused: bool = False  # stopped at a token boundary, to move to the handover plane
    last_token_at: float | None = None  # on this plane
    drafts: Drafts = field(default_factory=Drafts)  # what the step under way checks
    deciding: int | None = None  # the step whose exit is being computed
    held: tuple | None = None  # the full model's token for it, come meanwhile (_on_token args)
    checked: asyncio.Event = field(default_factory=asyncio.Event)  # no exited step unchecked


@dataclass
class _Gathering:
    """The steps of one batch of another stage that have arrived, waiting for the rest."""

    size: int
    steps: list[tuple[Step, float]]  # (step, ready_at)
    timer: asyncio.TimerHandle


@dataclass
class _Ready:
    """A step whose inputs are all here, waiting for the compute thread."""

    step: Step
    done: asyncio.Future[StepDone]


@dataclass
class _SequenceCost:
    """What one sequence cost this stage (answered to the head's SequenceStatsRequest)."""

    steps: int = 0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    sequential_bytes: int = 0
    residual_bytes: int = 0

    def add(self, done: StepDone) -> None:
        self.steps += 1
        self.compute_s += done.compute_s
        self.sequential_bytes += done.sequential_bytes
        self.residual_bytes += done.residual_bytes


class DataPlane:
    def __init__(
        self,
        self_id: str,
        transport: Transport,
        stages: list[tuple[str, int, int]],
        manifest: Manifest,
        executor: StageExecutor | GroupLead,
        fp16_wire: bool = False,
        limits: Limits | None = None,
        plan: str = "local",
        siblings: Mapping[str, DataPlane] | None = None,
        unit_clock: UnitClock | None = None,
        exits: ExitSettings | None = None,
    ) -> None:
        """`unit_clock` records how long each unit of this stage takes per decode step;
        `exits` is what the head does with the exit of its executor, where it has one."""
        self.plan = plan
        self.model = manifest.key
        self.peers = [peer for peer, _, _ in stages]
        self.ranges = [(first, last) for _, first, last in stages]
        self.me = self_id
        self.stage = self.peers.index(self_id)
        stage_routes = routes(manifest, [(first, last) for _, first, last in stages])
        self.worker = StageWorker(self.stage, executor, stage_routes[self.stage], fp16_wire, plan)
        self.transport = transport
        self.limits = limits or Limits()
        self.sampler = TokenSampler()
        self.exits = exits or ExitSettings()
        self.exit_sampler = TokenSampler()  # the head's, for the exit's tokens
        self.unit_clock = unit_clock or UnitClock()
        self.answer_clock = AnswerClock()  # the head's answers on this plan
        self.closed = False
        self._running: dict[str, _Running] = {}
        self._live: set[str] = set()  # sequences whose K/V this plane may hold
        self._costs: dict[str, _SequenceCost] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{self.stage}")
        self._tasks: set[asyncio.Task] = set()
        # this peer's planes by plan key, where K/V moving here is stored
        self._siblings = {} if siblings is None else siblings
        self._handover: DataPlane | None = None  # the head's plane answers move to
        self._quiet = asyncio.Event()  # set whenever an answer or a sequence ends here
        self._computing: set[str] = set()  # sequences with a step on the compute thread
        self._ready: list[_Ready] = []  # steps waiting for the compute thread
        self._computes = False  # a task is running the ready steps
        self._gathering: dict[tuple[int, str], _Gathering] = {}  # by (source stage, batch)
        self._wave: list[_Running] = []  # the head's answers waiting to step together
        self._in_flight: set[str] = set()  # the head's answers with a step under way
        self.prefixes = PrefixCache()  # the head's ended answers whose K/V the stages keep
        self._exit_totals: Counter[str] = Counter()  # what the exit did for ended answers

    @property
    def is_head(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.peers) - 1

    def owns(self, seq_id: str) -> bool:
        """Whether this plane runs, or holds state of, the sequence."""
        return seq_id in self._running or seq_id in self._live or seq_id in self.sampler

    # -- the head's side ---------------------------------------------------------------------
    async def run(
        self, generation: Generation, params: SamplingParams, on_token: OnToken
    ) -> list[SequenceStats]:
        """Run `generation` until it finishes, calling `on_token` with each new token; the
        stages' costs of the sequence come back.

        Raises PlaneClosed when the plane is retired first, GenerationError when a stage
        fails or no token comes for `stall_s`. Cancelling the caller ends the sequence on
        every peer.
        """
        if not self.is_head:
            raise GenerationError("this peer is not the head of the plan")
        if self.closed:
            raise PlaneClosed
        await self._reuse(generation)
        seq_id = generation.seq_id
        loop = asyncio.get_running_loop()
        running = _Running(generation, on_token, loop.create_future(), time.monotonic(), params)
        self.answer_clock.begin(running.active_at, idle=not self._running)
        self._running[seq_id] = running
        self.exit_sampler.open(seq_id, params, len(generation.tokens))
        kept = False
        try:
            await self._open(seq_id, params, len(generation.tokens))
            if not running.done.done():
                self._next_step(running)
            await self._until_done(running)
            await self._until_checked(running)
            stats = generation.exit_stats
            self._exit_totals.update({name: stats[name] for name in EXIT_COUNTS},
                                     tokens=len(generation.tokens))
            if running.paused:
                raise await self._move(generation)
            costs = await self._costs_of(seq_id)
            kept = self._keep(generation)
            return costs
        finally:
            self._running.pop(seq_id, None)
            self.exit_sampler.close(seq_id)
            self._landed(seq_id)
            if not kept:
                self._end(seq_id)
            self._quiet.set()

    async def _reuse(self, generation: Generation) -> None:
        """Start a new answer from the K/V of an ended one whose tokens its prompt begins
        with (the previous turn of its conversation), where one is kept: every stage hands
        it over to the new sequence (`SequenceFork`, then the kept one is dropped), and
        the answer prefills only the rest of its prompt."""
        if generation.cached or generation.tokens:
            return
        reuse = self.prefixes.take(generation.prompt)
        if reuse is None:
            return
        ask = SequenceFork(0, self.plan, reuse.seq_id, generation.seq_id, reuse.length)
        errors = [e for e in await asyncio.gather(*(self._fork_at(p, ask) for p in self.peers))
                  if e]
        self._end(reuse.seq_id)
        if errors:
            log.warning("answer %s prefills its whole prompt: %s", generation.seq_id,
                        "; ".join(errors))
            self._end(generation.seq_id)  # where it did fork
            generation.restart(uuid.uuid4().hex)
            return
        generation.reuse(reuse.length)

    async def _fork_at(self, peer: str, fork: SequenceFork) -> str | None:
        return self._forked_here(fork) if peer == self.me else await self._asked(peer, fork)

    @property
    def exit_executor(self) -> StageExecutor | None:
        """The head's stage, where it has an exit: what answers alone when the stages
        behind it are gone (standalone)."""
        return self._with_exit if self.is_head else None

    @property
    def _with_exit(self) -> StageExecutor | None:
        """This stage's executor where it has an exit (a group stage has none)."""
        executor = self.worker.executor
        return executor if isinstance(executor, StageExecutor) and executor.exit else None

    def exit_status(self) -> dict | None:
        """The exit of this plane's head, and what it did for the answers so far (status)."""
        totals = self._exit_totals
        return self._exit_figures({name: totals[name] for name in ("tokens", *EXIT_COUNTS)})

    def exit_stats(self, generation: Generation) -> dict | None:
        """What the exit did for an answer, where this plane's head has one."""
        return self._exit_figures(generation.exit_stats)

    def _exit_figures(self, figures: dict) -> dict | None:
        executor = self.exit_executor
        if executor is None or executor.exit is None:
            return None
        return self.exits.figures(executor.exit, figures)

    def _keep(self, generation: Generation) -> bool:
        """Keep a finished answer's K/V on the stages for its conversation's next turn;
        False where the plane is going away or there is too little to reuse."""
        if self.closed or self._handover is not None or generation.cached <= MIN_REUSE:
            return False
        context = [*generation.prompt, *generation.tokens][: generation.cached]
        for gone in self.prefixes.keep(generation.seq_id, context):
            self._end(gone)
        return True

    def keep_within(self, tokens: int, sparing: Sequence[int] = ()) -> None:
        """Give up kept K/V, least recently used first, until it holds at most `tokens`
        positions (the room the running answers leave in the plan's K/V reserve), sparing
        what the admitted prompt `sparing` will take over (its answer's room holds it)."""
        for gone in self.prefixes.within(max(tokens, 0), sparing):
            self._end(gone)

    async def _open(self, seq_id: str, params: SamplingParams, skip: int) -> None:
        if self.is_last:
            self.sampler.open(seq_id, params, skip)
            return
        ask = SequenceOpen(0, self.plan, seq_id, params.temperature, params.top_k, params.top_p,
                           params.seed, skip, params.logprobs)
        try:
            answer = await self.transport.request(self.peers[-1], ask, self.limits.send_timeout_s)
        except TransportError as exc:
            raise PlanBroken(f"the last stage did not answer: {exc}") from None
        if answer.error:
            raise GenerationError(answer.error)

    async def _until_done(self, running: _Running) -> None:
        stall = self.limits.stall_s
        if not await _while_heard(running, lambda: asyncio.shield(running.done), stall):
            raise GenerationError(
                f"no token for {stall:.0f}s: a peer of the plan stopped answering")

    async def _until_checked(self, running: _Running) -> None:
        """Wait for the full model's tokens of the steps the exit answered: the stages
        behind the exit have then run every step (their K/V is whole, to keep or move).
        An answer paused for a handover waits `CHECKS_ON_HANDOVER_S` at most: a stage
        that retired its plane before a step reached it never answers, and the answer
        re-prefills on the next plane instead of moving its K/V (`_move`)."""
        limit = CHECKS_ON_HANDOVER_S if running.paused else self.limits.stall_s
        while running.generation.unchecked:
            running.checked.clear()
            if await _while_heard(running, running.checked.wait, limit):
                continue
            if running.paused:
                return
            raise GenerationError("the stages behind the exit stopped answering")

    def _next_step(self, running: _Running) -> None:
        self._wave.append(running)
        self._start_wave()

    def _start_wave(self) -> None:
        """Run the waiting answers' next steps, once no answer of the last wave is still
        in flight; while the plane hands its answers over, pause them there instead."""
        if self._in_flight:
            return
        wave, self._wave = self._wave, []
        for running in wave:
            if not running.done.done():
                self._step_or_pause(running)

    def _step_or_pause(self, running: _Running) -> None:
        if self._handover is not None:
            running.paused = True
            running.done.set_result(None)
        else:
            self._step_now(running)

    def _step_now(self, running: _Running) -> None:
        self._in_flight.add(running.generation.seq_id)
        # a decode step is under way from its token's arrival: streaming it counts
        ready_at = running.last_token_at
        self._spawn(self._advance(running, time.monotonic() if ready_at is None else ready_at))

    async def _advance(self, running: _Running, ready_at: float) -> None:
        """Run the answer's next step, with the exit's drafts where it drafts."""
        running.drafts = await self._drafts(running)
        await self._run(running.generation.next_step(running.drafts), ready_at)

    async def _drafts(self, running: _Running) -> Drafts:
        """The exit's guesses of the next tokens for the full model to check (speculative
        decoding: answers that ask no log-probabilities, once they have a token)."""
        generation, executor = running.generation, self._with_exit
        count = drafts_wanted(self.exits, generation, running.params)
        if count == 0 or executor is None:
            return Drafts()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compute, draft, executor, generation, count,
                                          running.params)

    def _landed(self, seq_id: str) -> None:
        """The answer's step is no longer under way: its token came, or it ended."""
        self._in_flight.discard(seq_id)
        self._wave = [r for r in self._wave if r.generation.seq_id != seq_id]
        self._start_wave()

    def _on_token(self, seq_id: str, step: int, token: int,
                  logprobs: TokenLogprobs | None, checks: tuple[int, ...] = ()) -> None:
        running = self._running.get(seq_id)
        if running is None:
            return  # cancelled or retired meanwhile
        generation = running.generation
        if generation.check(step, token):  # the full model's token of a step the exit gave
            running.active_at = time.monotonic()
            if not generation.unchecked:
                running.checked.set()
            return
        if running.done.done():
            return
        if running.deciding == step:  # the exit decides first: its answer must not race
            running.held = (seq_id, step, token, logprobs, checks)
            return
        self._in_flight.discard(seq_id)
        try:
            if running.drafts.tokens or checks:
                new = generation.verified(step, running.drafts.tokens, checks, token)
            else:
                generation.record(step, token)
                new = [token]
        except ValueError as exc:
            self._fail(seq_id, str(exc))
            return
        self._tell(running, new, logprobs)
        if running.done.done():
            self._start_wave()
        else:
            self._next_step(running)

    def _on_exit(self, running: _Running, step: int, token: int) -> None:
        """The exit answered the step: the token streams now, and the answer's next step
        starts without waiting for the stages behind the exit, which run this one still."""
        generation = running.generation
        self._in_flight.discard(generation.seq_id)
        try:
            generation.record(step, token, exited=True)
        except ValueError as exc:
            self._fail(generation.seq_id, str(exc))
            return
        self._tell(running, [token], None)
        self._start_wave()  # the answers that waited for this one
        if not running.done.done():
            self._step_or_pause(running)

    def _tell(self, running: _Running, tokens: list[int],
              logprobs: TokenLogprobs | None) -> None:
        """Stream an answer's new tokens; it is done once finished (or stopped by its
        caller)."""
        generation = running.generation
        now = running.active_at = time.monotonic()
        last, running.last_token_at = running.last_token_at, now
        # tokens a speculative check gives together share the time since the last one
        each = None if last is None else (now - last) / len(tokens)
        for index, token in enumerate(tokens):
            self.answer_clock.token(now, each, alone=len(self._running) == 1)
            final = generation.finished and index == len(tokens) - 1
            if running.on_token(NewToken(token, logprobs, final)) and not final:
                generation.stop_after(len(generation.tokens) - len(tokens) + index + 1)
                break
        if generation.finished:
            running.done.set_result(None)

    def _fail(self, seq_id: str, reason: str) -> None:
        running = self._running.get(seq_id)
        if running is not None and not running.done.done():
            running.done.set_exception(GenerationError(reason))

    async def _costs_of(self, seq_id: str) -> list[SequenceStats]:
        """Each stage's cost of the sequence, in stage order (empty where one did not say)."""
        asks = [self._stage_cost(peer, seq_id) for peer in self.peers[1:]]
        others = await asyncio.gather(*asks)
        return [self._cost_here(0, seq_id), *(s for s in others if s is not None)]

    async def _stage_cost(self, peer: str, seq_id: str) -> SequenceStats | None:
        try:
            return await self.transport.request(
                peer, SequenceStatsRequest(0, seq_id), STATS_TIMEOUT_S
            )
        except TransportError as exc:
            log.info("no statistics of %s from %s: %s", seq_id, peer, exc)
            return None

    def _cost_here(self, req: int, seq_id: str) -> SequenceStats:
        cost = self._costs.get(seq_id, _SequenceCost())
        return SequenceStats(req, cost.steps, cost.compute_s, cost.transfer_s,
                             cost.sequential_bytes, cost.residual_bytes, self.worker.fp16_wire)

    async def _move(self, generation: Generation) -> PlaneClosed:
        """Move a paused answer's K/V to the handover plane: Moved, or PlaneClosed (the
        answer re-prefills) when that fails."""
        target = self._handover
        if target is None or generation.cached == 0:
            return PlaneClosed()  # no K/V yet: the new plane's first step is the prefill
        if generation.unchecked:
            return PlaneClosed()  # stages behind the exit lack steps: their K/V is not whole
        ask = SequenceMove(0, self.plan, generation.seq_id, target.plan, uuid.uuid4().hex,
                           target.holders())
        moves = [self.send_state(ask) if peer == self.me else self._asked(peer, ask)
                 for peer in self.peers]
        errors = [e for e in await asyncio.gather(*moves) if e]
        if errors:
            log.warning("answer %s re-prefills on plan %s: %s", generation.seq_id, target.plan,
                        "; ".join(errors))
            target._end(ask.to_seq_id)  # free what did arrive
            return PlaneClosed()
        return Moved(target, ask.to_seq_id)

    async def _asked(self, peer: str, request: Asks[_Done]) -> str | None:
        """Ask `peer` to move, store or fork a sequence's K/V: None, or why it could not."""
        try:
            answer = await self.transport.request(peer, request, self.limits.send_timeout_s)
        except TransportError as exc:
            return str(exc)
        return answer.error

    def _end(self, seq_id: str) -> None:
        """Free the sequence here and on every other stage."""
        self._forget(seq_id)
        for peer in self.peers[1:]:
            self.transport.send(peer, SequenceDrop(seq_id))

    # -- every stage's side ------------------------------------------------------------------
    def handle(self, sender: str, message: Message, reply: Callable[[Message], None]) -> None:
        """A data-plane message from `sender` (a peer id the transport authenticated)."""
        if sender not in self.peers and not isinstance(message, SequenceState):
            # K/V may come from a peer that leaves the plan along with its units
            log.warning("dropped %s from %s: not in plan %s", message.KIND, sender, self.plan)
            return
        plan = getattr(message, "plan", self.plan)
        if plan != self.plan:
            log.warning("dropped %s of plan %s: this is plan %s", message.KIND, plan, self.plan)
            return
        match message:
            case SequenceOpen():
                self._on_open(message, reply)
            case SequenceStatsRequest(req=req, seq_id=seq_id):
                reply(self._cost_here(req, seq_id))
            case SequenceMove():
                self._spawn(self._on_move(message, reply))
            case SequenceState():
                reply(SequenceMoved(message.req, self.store_state(message)))
            case SequenceFork():
                reply(SequenceForked(message.req, self._forked_here(message)))
            case StageData() | SequenceToken() | SequenceFailed() | SequenceDrop():
                if message.seq_id not in self._ended:  # late traffic of an ended sequence
                    self._on_sequence(sender, message)
            case _:
                self._not_for_this_stage(sender, message)

    def _on_sequence(self, sender: str,
                     message: StageData | SequenceToken | SequenceFailed | SequenceDrop) -> None:
        """A step's inputs, a token, a failure or a drop, of a sequence not ended here."""
        match message:
            case StageData():
                self._on_stage_data(self.peers.index(sender), message)
            case SequenceDrop(seq_id=seq_id):
                self._forget(seq_id)
            case SequenceToken() | SequenceFailed() if self.is_head:
                self._at_head(message)
            case _:
                self._not_for_this_stage(sender, message)

    def _at_head(self, message: SequenceToken | SequenceFailed) -> None:
        """The last stage's token for an answer's step, or a stage's failure to run one."""
        if message.seq_id not in self._running:
            self._end(message.seq_id)  # a sequence no answer runs: free it on every stage
            return
        match message:
            case SequenceToken():
                self._on_token(message.seq_id, message.step, message.token, _logprobs(message),
                               message.checks)
            case SequenceFailed():
                self._fail(message.seq_id, message.reason)

    def _not_for_this_stage(self, sender: str, message: Message) -> None:
        log.warning("dropped %s from %s: not for stage %d", message.KIND, sender, self.stage)

    async def _on_move(self, message: SequenceMove, reply: Callable[[Message], None]) -> None:
        reply(SequenceMoved(message.req, await self.send_state(message)))

    async def send_state(self, move: SequenceMove) -> str | None:
        """Send this stage's K/V of the sequence to the peers that hold the same units in
        the plan it moves to: None, or why that could not be done."""
        executor = self.worker.executor
        if executor.last >= len(move.holders):
            return f"stage {self.stage}: plan {move.to_plan} has fewer units"
        parts: dict[str, tuple[list[int], dict]] = {}
        try:
            for unit in range(executor.first, executor.last + 1):
                units, tensors = parts.setdefault(move.holders[unit], ([], {}))
                units.append(unit)
                tensors.update(executor.export_state(move.seq_id, unit))
        except KeyError as exc:
            return f"stage {self.stage}: {exc.args[0]}"
        states = [(peer, SequenceState(0, move.to_plan, move.to_seq_id, (*units,), tensors))
                  for peer, (units, tensors) in parts.items()]
        errors = [e for e in await asyncio.gather(*(self._store_at(*s) for s in states)) if e]
        return "; ".join(errors) or None

    async def _store_at(self, peer: str, state: SequenceState) -> str | None:
        if peer != self.me:
            return await self._asked(peer, state)
        target = self._siblings.get(state.plan)
        if target is None:
            return f"plan {state.plan} is not loaded on {peer}"
        return target.store_state(state)

    def holders(self) -> tuple[str, ...]:
        """The peer that runs each unit in this plan, by unit index."""
        return tuple(peer for peer, (first, last) in zip(self.peers, self.ranges, strict=True)
                     for _ in range(first, last + 1))

    def store_state(self, state: SequenceState) -> str | None:
        """Install K/V moved here from another plan; None, or why it was refused."""
        if self.closed or state.seq_id in self._ended:
            return f"stage {self.stage} of plan {self.plan} no longer runs {state.seq_id}"
        executor = self.worker.executor
        try:
            for unit in state.units:
                executor.import_state(state.seq_id, unit, state.tensors)
        except (KeyError, ValueError) as exc:
            self.worker.drop(state.seq_id)
            return f"stage {self.stage}: {exc}"
        self._live.add(state.seq_id)
        return None

    def _forked_here(self, fork: SequenceFork) -> str | None:
        """Start a sequence from a kept one's K/V on this stage; None, or why not."""
        if self.closed:
            return f"stage {self.stage} of plan {self.plan} is closed"
        try:
            self.worker.executor.fork(fork.source, fork.seq_id, fork.length)
        except (KeyError, ValueError) as exc:
            return f"stage {self.stage}: {exc.args[0]}"
        self._live.add(fork.seq_id)
        return None

    def _on_open(self, message: SequenceOpen, reply: Callable[[Message], None]) -> None:
        try:
            params = SamplingParams(message.temperature, message.top_k, message.top_p,
                                    message.seed, message.logprobs)
            if message.skip < 0:
                raise ValueError(f"skip must be >= 0, not {message.skip}")
        except ValueError as exc:
            reply(SequenceOpened(message.req, error=str(exc)))
            return
        if not self.is_last:
            reply(SequenceOpened(message.req, error=f"stage {self.stage} does not sample"))
            return
        self.sampler.open(message.seq_id, params, message.skip)
        reply(SequenceOpened(message.req))

    def _on_stage_data(self, source: int, message: StageData) -> None:
        if self.closed:
            return
        try:
            ask = self.worker.accept(source, message)
        except ValueError as exc:
            log.warning("dropped stage data: %s", exc)
            self._spawn(self._report_failure(message.seq_id, str(exc)))
            return
        if ask is None:
            return
        step = (ask, time.monotonic())
        if message.batch_size == 1:
            self._spawn(self._run(*step))
            return
        key = (source, message.batch)
        gathering = self._gathering.get(key)
        if gathering is None:
            timer = asyncio.get_running_loop().call_later(GATHER_S, self._gathered, key)
            gathering = self._gathering[key] = _Gathering(message.batch_size, [], timer)
        gathering.steps.append(step)
        if len(gathering.steps) >= gathering.size:
            self._gathered(key)

    def _gathered(self, key: tuple[int, str]) -> None:
        """Run a batch's steps that have come (all of them, or those there at the deadline):
        started in one go, they reach the compute thread together."""
        gathering = self._gathering.pop(key, None)
        if gathering is None or self.closed:
            return
        gathering.timer.cancel()
        for step in gathering.steps:
            self._spawn(self._run(*step))

    async def _run(self, ask: Step, ready_at: float) -> None:
        """Run a step whose inputs were all here at `ready_at` (monotonic seconds)."""
        seq_id, step = ask.seq_id, ask.step
        self._live.add(seq_id)
        self._computing.add(seq_id)
        try:
            done = await self._computed(ask)
        except TransportError as exc:  # a member of this group stage is gone
            self._lost_peer(seq_id, f"stage {self.stage}, step {step}: {exc}")
            return
        except Exception as exc:  # ONNX Runtime's errors derive from Exception alone
            await self._report_failure(seq_id, f"stage {self.stage}, step {step}: {exc}")
            return
        finally:
            self._computing.discard(seq_id)
        if seq_id in self._ended or self.closed:
            self.worker.drop(seq_id)
            return
        cost = self._costs.setdefault(seq_id, _SequenceCost())
        cost.add(done)
        started = time.perf_counter()
        try:
            for out in done.outgoing:
                await self.transport.deliver(
                    self.peers[out.target], out.message, self.limits.send_timeout_s
                )
        except TransportError as exc:
            self._lost_peer(seq_id, f"stage {self.stage}, step {step}: {exc}")
            return
        cost.transfer_s += time.perf_counter() - started
        if done.exit_hidden is not None:
            await self._try_exit(seq_id, step, done.exit_hidden)
        if done.logits is not None:
            if seq_id not in self.sampler:  # a step of a sequence the head never opened
                self.worker.drop(seq_id)
                await self._report_failure(seq_id, f"stage {self.stage}: {seq_id} was not opened")
                return
            try:
                checks, token = self.sampler.tokens(seq_id, done.logits, done.rows,
                                                    done.draft_probs)
            except ValueError as exc:
                await self._report_failure(seq_id, f"stage {self.stage}, step {step}: {exc}")
                return
            await self._emit_token(seq_id, step, token,
                                   self.sampler.logprobs(seq_id, done.logits, token), checks)
        if step > 0:  # the planner prices decode steps; step 0 is the prefill
            outside = time.monotonic() - ready_at - sum(done.unit_s.values())
            self.unit_clock.record(self.model, done.unit_s, outside)

    async def _try_exit(self, seq_id: str, step: int, hidden) -> None:
        """The exit's token for the step, where it is sure enough and the full model's did
        not come first. It runs once the step's messages are on their way: the stages behind
        start at once, and a step the exit cannot answer costs them no wait (on the bench
        model's first stage the LM head is as much work as 3 of its 12 layers)."""
        running = self._running.get(seq_id)
        executor = self._with_exit
        if self.exits.threshold is None or running is None or running.done.done() or (
                executor is None):
            return
        running.deciding = step
        try:
            loop = asyncio.get_running_loop()
            logits = await loop.run_in_executor(self._compute, executor.exit_logits, hidden)
            token = exit_token(self.exits, self.exit_sampler, seq_id, logits)
            if token is not None and not running.done.done():
                self._on_exit(running, step, token)
        finally:
            running.deciding, held = None, running.held
            running.held = None
            if held is not None:  # now a check of the exit's token, or the step's token
                self._on_token(*held)

    async def _computed(self, step: Step) -> StepDone:
        """The step, run on the compute thread together with every other step ready when
        the thread takes it (of each sequence, the next in order)."""
        ready = _Ready(step, asyncio.get_running_loop().create_future())
        self._ready.append(ready)
        if not self._computes:
            self._computes = True
            self._spawn(self._compute_ready())
        return await ready.done

    async def _compute_ready(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch, self._ready = self.worker.due(self._ready, lambda ready: ready.step)
                if not batch:
                    return
                steps = [ready.step for ready in batch]
                outcomes = await loop.run_in_executor(self._compute, self.worker.run_many, steps)
                for ready, outcome in zip(batch, outcomes, strict=True):
                    if ready.done.done():
                        continue
                    if isinstance(outcome, Exception):
                        ready.done.set_exception(outcome)
                    else:
                        ready.done.set_result(outcome)
        finally:
            self._computes = False

    async def _emit_token(self, seq_id: str, step: int, token: int,
                          logprobs: TokenLogprobs | None, checks: tuple[int, ...]) -> None:
        if self.is_head:
            self._on_token(seq_id, step, token, logprobs, checks)
            return
        message = _token_message(seq_id, step, token, logprobs, checks)
        try:
            await self.transport.deliver(self.peers[0], message, self.limits.send_timeout_s)
        except TransportError as exc:
            log.warning("could not return a token of %s: %s", seq_id, exc)

    def _lost_peer(self, seq_id: str, reason: str) -> None:
        """A peer of the plan is unreachable: the answer waits for the next plan rather
        than failing (on another stage it stalls until the head moves it over)."""
        log.warning("sequence %s: %s", seq_id, reason)
        running = self._running.get(seq_id)
        if running is not None and not running.done.done():
            running.done.set_exception(PlanBroken(reason))

    async def _report_failure(self, seq_id: str, reason: str) -> None:
        if self.closed:
            return
        log.warning("sequence %s failed: %s", seq_id, reason)
        if self.is_head:
            self._fail(seq_id, reason)
            return
        self.transport.send(self.peers[0], SequenceFailed(seq_id, reason))

    def _forget(self, seq_id: str) -> None:
        self._ended[seq_id] = None
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        self._live.discard(seq_id)
        self._costs.pop(seq_id, None)
        self.sampler.close(seq_id)
        self.worker.drop(seq_id)
        for ready in [r for r in self._ready if r.step.seq_id == seq_id]:
            self._ready.remove(ready)
            ready.done.cancel()  # a step waiting for an earlier one that will not come
        self._quiet.set()

    # -- lifetime ----------------------------------------------------------------------------
    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def retire(self, handover: DataPlane | None, wait_s: float) -> None:
        """Close the plane once its answers and sequences are done, waiting at most
        `wait_s`. On the head, running answers stop at their next token boundary and move
        with their K/V to `handover` (None: they re-prefill on the next plan)."""
        self._handover = handover if self.is_head else None
        for kept in self.prefixes.clear():
            self._end(kept)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while self._running or self._live:
                    self._quiet.clear()
                    await self._quiet.wait()
        await self.close()

    async def close(self) -> None:
        """Retire the plane: running answers get PlaneClosed, and every sequence's state
        here is freed (the executor may live on in the next plan's plane)."""
        if self.closed:
            return
        self.closed = True
        # a step cancelled below still finishes on the compute thread and stores K/V, even
        # for a sequence already dropped: drop those again once the thread is done
        computing = set(self._computing)
        for gathering in self._gathering.values():
            gathering.timer.cancel()
        self._gathering.clear()
        for running in self._running.values():
            if not running.done.done():
                running.done.set_exception(PlaneClosed())
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._compute.shutdown, True)
        for seq_id in list(self._live | set(self._running) | computing):
            self._forget(seq_id)



async def _while_heard(running: _Running, wait: Callable[[], Awaitable[object]],
                       limit: float) -> bool:
    """Await `wait()` while the answer hears from its stages: False once it has heard
    nothing for `limit` seconds (`active_at`, which each token and check moves on)."""
    while True:
        waited = time.monotonic() - running.active_at
        try:
            await asyncio.wait_for(wait(), max(limit - waited, 0.0))
            return True
        except TimeoutError:
            if time.monotonic() - running.active_at >= limit:
                return False


def _token_message(seq_id: str, step: int, token: int, logprobs: TokenLogprobs | None,
                   checks: tuple[int, ...]) -> SequenceToken:
    if logprobs is None:
        return SequenceToken(seq_id, step, token, checks=checks)
    return SequenceToken(seq_id, step, token, logprobs.logprob,
                         tuple(i for i, _ in logprobs.top), tuple(lp for _, lp in logprobs.top),
                         checks)


def _logprobs(message: SequenceToken) -> TokenLogprobs | None:
    if message.logprob is None:
        return None
    top = list(zip(message.top_ids, message.top_logprobs, strict=True))
    return TokenLogprobs(message.logprob, top)
