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
from dataclasses import dataclass, field

import numpy as np

from peerd.inference.routing import Route, StageRoutes
from peerd.wire.protocol import StageData
from shards import heap
from shards.executor import StageExecutor
from shards.sampling import Ranked, Sampler, SamplingParams, token_logprobs

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


class StageWorker:
    def __init__(
        self,
        stage: int,
        executor: StageExecutor,
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
        self._pending: dict[tuple[str, int], dict[int, Tensors]] = {}

    def accept(self, source: int, message: StageData) -> Tensors | None:
        """Record a message; the stage's complete inputs once every expected source sent."""
        expected = self.routes.expects.get(source)
        if expected is None:
            raise ValueError(f"stage {self.stage} expects nothing from stage {source}")
        if set(message.tensors) != set(expected):
            raise ValueError(
                f"stage {self.stage}: stage {source} sent {sorted(message.tensors)}, "
                f"expected {sorted(expected)}"
            )
        for name, tensor in message.tensors.items():
            received = self.counters.received_bytes
            received[name] = received.get(name, 0) + tensor.nbytes
        key = (message.seq_id, message.step)
        arrived = self._pending.setdefault(key, {})
        arrived[source] = message.tensors
        if len(arrived) < len(self.routes.expects):
            return None
        del self._pending[key]
        return {name: t for tensors in arrived.values() for name, t in tensors.items()}

    def run(self, seq_id: str, step: int, inputs: Tensors) -> StepDone:
        """Run the stage's units on complete inputs and build the messages to send."""
        done = self.run_many([(seq_id, step, inputs)])[0]
        if isinstance(done, Exception):
            raise done
        return done

    def run_many(self, steps: list[tuple[str, int, Tensors]]) -> list[StepDone | Exception]:
        """Run the steps of several sequences at once (one batch per number of new tokens,
        StageExecutor.step_many) and build each one's messages; a step that failed has its
        exception in its place."""
        started = time.perf_counter()
        unit_s: dict[int, float] = {}
        wanted = self.executor.inputs
        outputs = self.executor.step_many(
            [(seq_id, {n: inputs[n] for n in wanted}) for seq_id, _, inputs in steps], unit_s)
        share = (time.perf_counter() - started) / len(steps)
        if any(step == 0 for _, step, _ in steps):
            heap.trim()  # a prefill's activations: freed, but resident until handed back
        self.counters.batches += 1
        ran = sum(not isinstance(produced, Exception) for produced in outputs)
        batch = Batch(uuid.uuid4().hex[:16], ran) if ran > 1 else Batch()
        return [produced if isinstance(produced, Exception) else
                self._done(seq_id, step, {**inputs, **produced}, share, unit_s, batch)
                for (seq_id, step, inputs), produced in zip(steps, outputs, strict=True)]

    def _done(self, seq_id: str, step: int, available: Tensors, seconds: float,
              unit_s: dict[int, float], batch: Batch) -> StepDone:
        outgoing = [self._message(seq_id, step, route, available, batch)
                    for route in self.routes.sends]
        logits = available[self.routes.returns[0]] if self.routes.returns else None
        sequential = sum(o.nbytes for o in outgoing if o.target == self.stage + 1)
        done = StepDone(self.stage, seq_id, step, outgoing, logits, seconds, sequential,
                        sum(o.nbytes for o in outgoing) - sequential, unit_s)
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
        for key in [k for k in self._pending if k[0] == seq_id]:
            del self._pending[key]

    def _message(self, seq_id: str, step: int, route: Route, available: Tensors,
                 batch: Batch) -> Outgoing:
        tensors = {name: self._wire(available[name]) for name in route.names}
        message = StageData(self.plan, seq_id, step, tensors, batch.name, batch.size)
        return Outgoing(route.target, message, sum(t.nbytes for t in tensors.values()))

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


class TokenSampler:
    """On the last stage: one seeded sampler per open sequence, fed the last logits row."""

    def __init__(self) -> None:
        self._samplers: dict[str, Sampler] = {}

    def open(self, seq_id: str, params: SamplingParams, skip: int = 0) -> None:
        self._samplers[seq_id] = Sampler(params, skip)

    def sample(self, seq_id: str, logits: np.ndarray) -> int:
        return self._samplers[seq_id](logits[0, -1])

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


@dataclass
class Generation:
    """One request as the head sees it.

    `cached` counts the positions whose K/V the stages hold, so a step feeds them what they
    lack: the whole prompt first, then one token at a time. After a plan change or a lost
    peer the K/V is gone: `restart` makes the next step re-prefill the prompt and every
    token so far, under a fresh sequence id, and generation continues where it stopped.
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

    def step_inputs(self) -> tuple[int, Tensors]:
        """The step to run next and its request inputs."""
        context = self.prompt + self.tokens
        positions = np.arange(self.cached, len(context), dtype=np.int64)
        return self.step, {
            "input_ids": np.asarray([context[self.cached :]], dtype=np.int64),
            "position_ids": positions[None, :],
        }

    def record(self, step: int, token: int) -> bool:
        """Add the token sampled at `step`; True when the generation is finished."""
        if step != self.step:
            raise ValueError(f"{self.seq_id}: token for step {step}, expected {self.step}")
        self.cached = len(self.prompt) + len(self.tokens)
        self.tokens.append(token)
        self.step += 1
        return self.finished

    @property
    def finished(self) -> bool:
        return self.stopped or len(self.tokens) >= self.max_tokens or bool(
            self.tokens and self.tokens[-1] in self.stop_ids
        )

    def restart(self, seq_id: str) -> None:
        """Forget the K/V: the next step re-prefills everything under `seq_id`."""
        self.seq_id, self.cached, self.step = seq_id, 0, 0

    def reuse(self, positions: int) -> None:
        """The stages hold K/V of the first `positions` of the prompt (an earlier answer's,
        SequenceFork): the first step prefills only the rest."""
        self.cached = self.reused = positions

    def moved(self, seq_id: str) -> None:
        """The K/V moved to another plan under `seq_id`: the next step continues from it."""
        self.seq_id, self.step = seq_id, 0
