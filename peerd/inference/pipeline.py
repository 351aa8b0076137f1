"""The data plane's logic, independent of how messages travel.

`StageWorker` is one stage of a split model: it collects, for each (sequence, step), the
tensors every source stage sends it, runs its units once all have arrived, and returns the
messages its routes prescribe. `Head` is the request side on the source peer: it turns a
prompt into step inputs, records the tokens the last stage samples, and decides when a
sequence is finished. The daemon moves these messages over ZeroMQ; `peerd generate` moves
them in one process through the same codec.

Steps of one sequence are strictly sequential (step n+1 needs token n), so messages of
different sequences interleave freely while those of one sequence never race.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np

from peerd.inference.routing import Route, StageRoutes
from peerd.wire.protocol import StageData, draft_probs, read_draft_probs
from shards import heap
from shards.early_exit import EXIT_HIDDEN, ExitSettings, confidence
from shards.executor import Outcome, StageExecutor
from shards.manifest import Manifest
from shards.sampling import (
    Distribution,
    Ranked,
    Sampler,
    SamplingParams,
    distribution,
    draft_stream,
    token_logprobs,
)

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class Batch:
    """The steps a stage ran together, as its messages name them (StageData.batch)."""

    name: str = ""
    size: int = 1


@dataclass(frozen=True)
class Outgoing:
    target: int
    message: StageData
    nbytes: int  # of the tensors it carries


@dataclass
class StageCounters:
    """What one stage did: compute time, bytes sent to the next / later stages, and bytes
    received per tensor name (which shows that residuals reach only their consumers)."""

    steps: int = 0
    batches: int = 0  # runs of the units: one per batch of steps run together
    compute_s: float = 0.0
    sequential_bytes: int = 0
    residual_bytes: int = 0
    residual_bytes_by_target: dict[int, int] = field(default_factory=dict)
    received_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One forward pass of one sequence, as the head asked for it."""

    seq_id: str
    step: int  # forward passes of the sequence before this one
    inputs: Tensors
    past: int | None = None  # K/V positions it continues from: each stage drops any beyond
    rows: int = 1  # positions whose tokens the last stage gives (a speculative check)
    # a sampled answer's check: its drafts and their distributions (StageData.draft_probs)
    draft_probs: Tensors = field(default_factory=dict)


W = TypeVar("W")


class StageRunner(Protocol):
    """What a StageWorker needs of what runs its units: a StageExecutor, or a stage run as
    tensor-parallel shares (peerd.inference.shares.ShareStage)."""

    @property
    def manifest(self) -> Manifest: ...

    @property
    def inputs(self) -> Iterable[str]: ...

    @property
    def holds_state(self) -> bool: ...

    def step_many(self, steps: Sequence[tuple[str, Tensors]],
                  unit_s: dict[int, float] | None = None,
                  rows: Mapping[str, int] | None = None) -> list[Outcome]: ...

    def length(self, seq_id: str) -> int: ...

    def truncate(self, seq_id: str, length: int) -> None: ...

    def drop(self, seq_id: str) -> None: ...


Runner = TypeVar("Runner", bound=StageRunner)


@dataclass
class StepDone:
    stage: int
    seq_id: str
    step: int
    outgoing: list[Outgoing]
    logits: np.ndarray | None  # on the stage that computes them, for the sampler
    compute_s: float  # this step's share of running the units (a batch's time / its steps)
    sequential_bytes: int  # sent to the next stage
    residual_bytes: int  # sent to later stages
    unit_s: dict[int, float] = field(default_factory=dict)  # each unit's seconds, its batch's
    exit_hidden: np.ndarray | None = None  # on the stage with the exit: what it reads
    rows: int = 1  # positions whose tokens the last stage gives
    draft_probs: Tensors = field(default_factory=dict)  # as the step's


class StageWorker(Generic[Runner]):
    def __init__(
        self,
        stage: int,
        executor: Runner,
        routes: StageRoutes,
        fp16_wire: bool = False,
        plan: str = "local",
    ) -> None:
        if len(routes.returns) > 1:
            raise ValueError(f"stage {stage} returns {routes.returns}; expected only the logits")
        self.stage = stage
        self.executor = executor
        self.routes = routes
        self.fp16_wire = fp16_wire
        self.plan = plan  # stamped on every message, see StageData.plan
        self.counters = StageCounters()
        self._pending: dict[tuple[str, int], dict[int, StageData]] = {}
        self._next: dict[str, int] = {}  # the step each sequence runs next

    def accept(self, source: int, message: StageData) -> Step | None:
        """Record a message; the step with its complete inputs once every expected source
        sent."""
        expected = self.routes.expects.get(source)
        if expected is None:
            raise ValueError(f"stage {self.stage} expects nothing from stage {source}")
        if set(message.tensors) != set(expected):
            raise ValueError(
                f"stage {self.stage}: stage {source} sent {sorted(message.tensors)}, "
                f"expected {sorted(expected)}"
            )
        self._check_vocabulary(message.draft_probs)
        for name, tensor in message.tensors.items():
            received = self.counters.received_bytes
            received[name] = received.get(name, 0) + tensor.nbytes
        key = (message.seq_id, message.step)
        arrived = self._pending.setdefault(key, {})
        arrived[source] = message
        if len(arrived) < len(self.routes.expects):
            return None
        del self._pending[key]
        inputs = {name: t for m in arrived.values() for name, t in m.tensors.items()}
        drafts = next((m.draft_probs for m in arrived.values() if m.draft_probs), {})
        return Step(message.seq_id, message.step, inputs, message.past, message.rows, drafts)

    def _check_vocabulary(self, probs: Tensors) -> None:
        vocab = self.executor.manifest.model.vocab_size
        if probs and int(probs["ids"].max()) >= vocab:
            raise ValueError(f"stage {self.stage}: a draft token id beyond the vocabulary "
                             f"({vocab} tokens)")

    def due(self, waiting: list[W], step_of: Callable[[W], Step]) -> tuple[list[W], list[W]]:
        """The waiting steps to run now, and those that wait on: a sequence's steps run in
        order, one per batch (its K/V must hold the previous step's positions). A step the
        sequence has run already is due, and fails (run_many)."""
        due: list[W] = []
        later: list[W] = []
        taken: set[str] = set()
        for item in waiting:
            step = step_of(item)
            if step.step <= self._next.get(step.seq_id, 0) and step.seq_id not in taken:
                taken.add(step.seq_id)
                due.append(item)
            else:
                later.append(item)
        return due, later

    def run(self, step: Step) -> StepDone:
        """Run the stage's units on complete inputs and build the messages to send."""
        done = self.run_many([step])[0]
        if isinstance(done, Exception):
            raise done
        return done

    def run_many(self, steps: list[Step]) -> list[StepDone | Exception]:
        """Run the steps of several sequences at once (one batch per number of new tokens,
        StageExecutor.step_many) and build each one's messages; a step that failed has its
        exception in its place."""
        started = time.perf_counter()
        unit_s: dict[int, float] = {}
        wanted = self.executor.inputs
        refused = {index: exc for index, step in enumerate(steps)
                   if (exc := self._refused(step)) is not None}
        runnable = [step for index, step in enumerate(steps) if index not in refused]
        outputs = iter(self.executor.step_many(
            [(step.seq_id, {n: step.inputs[n] for n in wanted}) for step in runnable], unit_s,
            {step.seq_id: step.rows for step in runnable}))
        share = (time.perf_counter() - started) / len(steps)
        if any(step.step == 0 for step in steps):
            heap.trim()  # a prefill's activations: freed, but resident until handed back
        self.counters.batches += 1
        produced = [refused[index] if index in refused else next(outputs)
                    for index in range(len(steps))]
        ran = sum(not isinstance(outcome, Exception) for outcome in produced)
        batch = Batch(uuid.uuid4().hex[:16], ran) if ran > 1 else Batch()
        results: list[StepDone | Exception] = []
        for step, outcome in zip(steps, produced, strict=True):
            if isinstance(outcome, Exception):
                results.append(outcome)
                continue
            self._next[step.seq_id] = step.step + 1
            results.append(self._done(step, outcome, share, unit_s, batch))
        return results

    def _refused(self, step: Step) -> Exception | None:
        """Why the step cannot run (out of order, K/V it lacks), after dropping K/V beyond
        the positions it continues from; None when it can."""
        expected = self._next.get(step.seq_id, 0)
        if step.step != expected:
            return ValueError(f"{step.seq_id}: step {step.step} comes after step {expected - 1}")
        if step.past is None or not self.executor.holds_state:
            return None
        held = self.executor.length(step.seq_id)
        if step.past > held:
            return ValueError(f"stage {self.stage} holds {held} positions of {step.seq_id}, "
                              f"not {step.past}")
        if step.past < held:
            self.executor.truncate(step.seq_id, step.past)
        return None

    def _done(self, step: Step, produced: Tensors, seconds: float,
              unit_s: dict[int, float], batch: Batch) -> StepDone:
        exit_hidden = produced.pop(EXIT_HIDDEN, None)
        available = {**step.inputs, **produced}
        outgoing = [self._message(step, route, available, batch) for route in self.routes.sends]
        logits = available[self.routes.returns[0]] if self.routes.returns else None
        sequential = sum(o.nbytes for o in outgoing if o.target == self.stage + 1)
        done = StepDone(self.stage, step.seq_id, step.step, outgoing, logits, seconds,
                        sequential, sum(o.nbytes for o in outgoing) - sequential, unit_s,
                        exit_hidden, step.rows, step.draft_probs)
        self._count(done)
        return done

    def _count(self, done: StepDone) -> None:
        counters = self.counters
        counters.steps += 1
        counters.compute_s += done.compute_s
        counters.sequential_bytes += done.sequential_bytes
        counters.residual_bytes += done.residual_bytes
        for out in done.outgoing:
            if out.target != self.stage + 1:
                by_target = counters.residual_bytes_by_target
                by_target[out.target] = by_target.get(out.target, 0) + out.nbytes

    def drop(self, seq_id: str) -> None:
        """Free the sequence's K/V and anything buffered for it."""
        self.executor.drop(seq_id)
        self._next.pop(seq_id, None)
        for key in [k for k in self._pending if k[0] == seq_id]:
            del self._pending[key]

    def _message(self, step: Step, route: Route, available: Tensors, batch: Batch) -> Outgoing:
        tensors = {name: self._wire(available[name]) for name in route.names}
        # the drafts' distributions go down the ring to the last stage, not to residuals
        drafts = step.draft_probs if route.target == self.stage + 1 else {}
        message = StageData(self.plan, step.seq_id, step.step, tensors, batch.name, batch.size,
                            step.past, step.rows, drafts)
        nbytes = sum(t.nbytes for t in (*tensors.values(), *drafts.values()))
        return Outgoing(route.target, message, nbytes)

    def _wire(self, array: np.ndarray) -> np.ndarray:
        if self.fp16_wire and array.dtype == np.float32:
            return array.astype(np.float16)
        return array


@dataclass(frozen=True)
class TokenLogprobs:
    """The model's log-probability of a sampled token, and of the most likely tokens."""

    logprob: float
    top: Ranked


@dataclass(frozen=True)
class NewToken:
    """A token of an answer as the head hands it on."""

    id: int
    logprobs: TokenLogprobs | None  # where the answer asked for them
    last: bool  # the answer ends with it: an end-of-sequence token, or max_tokens reached
    degraded: bool = False  # from the exit alone: the stages behind it were unreachable


class TokenSampler:
    """On the last stage: one seeded sampler per open sequence, fed the last logits row."""

    def __init__(self) -> None:
        self._samplers: dict[str, Sampler] = {}

    def open(self, seq_id: str, params: SamplingParams, skip: int = 0) -> None:
        self._samplers[seq_id] = Sampler(params, skip)

    def sample(self, seq_id: str, logits: np.ndarray) -> int:
        return self._samplers[seq_id](logits[0, -1])

    def tokens(self, seq_id: str, logits: np.ndarray, rows: int,
               probs: Tensors) -> tuple[tuple[int, ...], int]:
        """The full model's tokens for a step: at each of its `rows` - 1 positions before
        the last (a speculative check of drafts) and its token. A greedy answer's checks
        are the most likely tokens; a sampled answer's come of speculative sampling
        against the drafts' distributions `probs` (StageData.draft_probs, Sampler.verify).
        ValueError for a sampled check without them."""
        sampler = self._samplers[seq_id]
        last = logits[0, logits.shape[1] - rows :]
        if rows == 1 or sampler.params.greedy:
            return tuple(int(t) for t in np.argmax(last[:-1], axis=-1)), sampler(last[-1])
        if not probs:
            raise ValueError(f"{seq_id}: a sampled check without its drafts' probabilities")
        return sampler.verify(last, *read_draft_probs(probs))

    def logprobs(self, seq_id: str, logits: np.ndarray, token: int) -> TokenLogprobs | None:
        """What the sequence asked to know of the step that sampled `token`, if anything."""
        top = self._samplers[seq_id].params.logprobs
        if top is None:
            return None
        return TokenLogprobs(*token_logprobs(logits[0, -1], token, top))

    def close(self, seq_id: str) -> None:
        self._samplers.pop(seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._samplers


def exit_token(settings: ExitSettings, sampler: TokenSampler, seq_id: str,
               exit_logits: np.ndarray) -> int | None:
    """The exit's token for the step, where its confidence reaches the threshold."""
    if settings.threshold is None or confidence(exit_logits[0, -1]) < settings.threshold:
        return None
    return sampler.sample(seq_id, exit_logits)


def drafts_wanted(settings: ExitSettings, generation: Generation,
                  params: SamplingParams) -> int:
    """How many tokens the exit drafts for the generation's next step: for answers that ask
    no log-probabilities, once they have a token and the stages hold the K/V of every
    position before it (not on a step that re-prefills, after a plan change, where the
    head's stage has no context to draft from), one more than the last check kept, up to
    --speculative, and no more than the answer has room for after the check's own token.
    Drafting costs a step of the first stage per draft, so where the exit guesses badly it
    drafts one a check (a random 12-layer model over three daemons: x0.40 of the full
    model's speed with 4 drafts a check, none ever kept). Answers that ask log-probabilities
    never draft: a check gives several tokens, and `SequenceToken` carries the
    log-probabilities of one."""
    context = len(generation.prompt) + len(generation.tokens)
    if not generation.tokens or generation.cached < context - 1 or params.logprobs is not None:
        return 0
    wanted = settings.speculative if generation.last_kept is None else generation.last_kept + 1
    room = generation.max_tokens - len(generation.tokens) - 1
    return max(min(wanted, settings.speculative, room), 0)


@dataclass(frozen=True)
class Drafts:
    """The exit's drafts for a check, and for a sampled answer the distribution each was
    drawn from, as the step carries them (StageData.draft_probs; empty for a greedy one)."""

    tokens: list[int] = field(default_factory=list)
    probs: Tensors = field(default_factory=dict)


def draft(executor: StageExecutor, generation: Generation, count: int,
          params: SamplingParams) -> Drafts:
    """The exit's guesses of the generation's next tokens, up to `count`, from the units of
    `executor` alone (it holds unit 0 and the exit): its most likely tokens for a greedy
    answer; for a sampled one, each drawn from the exit's logits processed as the answer's
    sampler processes the full model's (`distribution`), with the check's own random stream
    (`draft_stream`). Its K/V keeps the positions they took: the check that follows
    (`Generation.next_step(drafts)`) drops them."""
    context = [*generation.prompt, *generation.tokens]
    stream = None if params.greedy else draft_stream(params, len(generation.tokens))
    tokens: list[int] = []
    proposals: list[Distribution] = []
    for position in range(len(context) - 1, len(context) - 1 + count):
        token = tokens[-1] if tokens else context[-1]
        inputs = {"input_ids": np.array([[token]], np.int64),
                  "position_ids": np.array([[position]], np.int64)}
        hidden = executor.step(generation.seq_id, inputs)[EXIT_HIDDEN]
        row = executor.exit_logits(hidden)[0, -1]
        if stream is None:
            tokens.append(int(np.argmax(row)))
        else:
            proposals.append(distribution(row, params))
            tokens.append(proposals[-1].draw(stream.random()))
        if tokens[-1] in generation.stop_ids:
            break
    return Drafts(tokens, draft_probs(tokens, proposals) if proposals else {})


@dataclass
class Generation:
    """One request as the head sees it.

    `cached` counts the positions whose K/V the stages hold, so a step feeds them what they
    lack: the whole prompt first, then one token at a time. After a plan change or a lost
    peer the K/V is gone: `restart` makes the next step re-prefill the prompt and every
    token so far, under a fresh sequence id, and generation continues where it stopped.

    With early exit a token may come from the exit before the full model's (`record(...,
    exited=True)`); the full model's token for that step, when it comes, is only compared
    (`check`). With speculative decoding a step carries the exit's drafts after the last
    token, and the full model's tokens for all of them decide how many are kept (`verified`).
    """

    seq_id: str
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    step: int = 0  # forward passes of this seq_id, pairing the messages of one step
    stopped: bool = False  # ended early: its text reached a stop string
    reused: int = 0  # prompt positions whose K/V came from an earlier answer
    exits: list[int] = field(default_factory=list)  # indices of the tokens the exit gave
    unchecked: dict[int, int] = field(default_factory=dict)  # exited steps: their tokens
    agreed: int = 0  # exited tokens the full model gave too
    checked: int = 0  # exited tokens the full model's came back for
    drafted: int = 0  # tokens the exit drafted for checks
    accepted: int = 0  # drafted tokens the full model confirmed
    checks: int = 0  # speculative checks run
    last_kept: int | None = None  # drafts the last check kept
    degraded: int = 0  # tokens from the exit alone, while no plan served (standalone)

    def next_step(self, drafts: Drafts | None = None) -> Step:
        """The step to run next, with the exit's `drafts` after the last token (a check)."""
        drafts = drafts or Drafts()
        context = [*self.prompt, *self.tokens, *drafts.tokens]
        positions = np.arange(self.cached, len(context), dtype=np.int64)
        inputs = {"input_ids": np.asarray([context[self.cached :]], dtype=np.int64),
                  "position_ids": positions[None, :]}
        return Step(self.seq_id, self.step, inputs, self.cached, len(drafts.tokens) + 1,
                    drafts.probs)

    def record(self, step: int, token: int, exited: bool = False) -> bool:
        """Add the token sampled at `step` (by the exit: `exited`); True when the generation
        is finished."""
        if step != self.step:
            raise ValueError(f"{self.seq_id}: token for step {step}, expected {self.step}")
        if exited:
            self.exits.append(len(self.tokens))
            self.unchecked[step] = token
        self._add([token])
        return self.finished

    def check(self, step: int, token: int) -> bool:
        """The full model's token for a step the exit answered; False for any other step."""
        exited = self.unchecked.pop(step, None)
        if exited is None:
            return False
        self.checked += 1
        self.agreed += exited == token
        return True

    def verified(self, step: int, drafts: list[int], checks: tuple[int, ...],
                 token: int) -> list[int]:
        """The full model's tokens for a check of `drafts` came back (`checks` after the
        last token and each draft but the last, `token` after the last): the drafts it
        agrees with and its own next token are the new tokens."""
        if step != self.step or len(checks) != len(drafts):
            raise ValueError(f"{self.seq_id}: a check of step {step} with {len(checks)} "
                             f"tokens; expected step {self.step}, {len(drafts)} tokens")
        full = [*checks, token]
        kept = next((i for i, (d, t) in enumerate(zip(drafts, full, strict=False)) if d != t),
                    len(drafts))
        self.checks += 1
        self.drafted += len(drafts)
        self.accepted += kept
        self.last_kept = kept
        return self._add(full[: kept + 1])

    def _add(self, new: list[int]) -> list[int]:
        """Append what of `new` the answer takes (up to a stop token or max_tokens)."""
        new = new[: self.max_tokens - len(self.tokens)]
        stop = next((end for end, token in enumerate(new, 1) if token in self.stop_ids), None)
        new = new[:stop]
        self.tokens.extend(new)
        self.cached = len(self.prompt) + len(self.tokens) - 1
        self.step += 1
        return new

    def stop_after(self, count: int) -> None:
        """End the answer after its first `count` tokens (its text reached a stop string)."""
        del self.tokens[count:]
        self.cached = min(self.cached, len(self.prompt) + len(self.tokens) - 1)
        self.stopped = True

    @property
    def finished(self) -> bool:
        return self.stopped or len(self.tokens) >= self.max_tokens or bool(
            self.tokens and self.tokens[-1] in self.stop_ids
        )

    @property
    def exit_stats(self) -> dict:
        """What the exit did for this answer (for the --json stats)."""
        return {"exited": len(self.exits), "exited_tokens": list(self.exits),
                "exit_rate": round(len(self.exits) / len(self.tokens), 4) if self.tokens else 0.0,
                "checked": self.checked, "agreed": self.agreed,
                "drafted": self.drafted, "accepted": self.accepted, "checks": self.checks}

    def restart(self, seq_id: str) -> None:
        """Forget the K/V: the next step re-prefills everything under `seq_id`."""
        self.seq_id, self.cached, self.step = seq_id, 0, 0
        self.unchecked.clear()

    def reuse(self, positions: int) -> None:
        """The stages hold K/V of the first `positions` of the prompt (an earlier answer's,
        SequenceFork): the first step prefills only the rest."""
        self.cached = self.reused = positions

    def moved(self, seq_id: str) -> None:
        """The K/V moved to another plan under `seq_id`: the next step continues from it."""
        self.seq_id, self.step = seq_id, 0
