"""All stages of a split model in one process, every message through the wire codec.

This is what `peerd generate --parts K` runs: the same `StageWorker`s, `TokenSampler` and
`Generation` logic as the daemon, with a FIFO of encoded frames standing in for the network,
so each stage receives exactly the bytes a peer would. With early exit, the first stage
answers confident steps itself and their messages still go down the stages behind it; with
speculative decoding it drafts tokens before each step (peerd/inference/pipeline.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from peerd.inference.pipeline import (
    Generation,
    StageWorker,
    Step,
    StepDone,
    TokenSampler,
    draft,
    drafts_wanted,
    exit_token,
)
from peerd.wire import protocol
from shards.early_exit import ExitSettings
from shards.sampling import SamplingParams

# Called with an answer's new tokens and the logits rows they came from
OnTokens = Callable[[Generation, list[int], np.ndarray], None]


class LocalPipeline:
    def __init__(self, workers: list[StageWorker], exits: ExitSettings | None = None) -> None:
        self.workers = workers
        self.exits = exits or ExitSettings()
        self.sampler = TokenSampler()
        self.exit_sampler = TokenSampler()  # the first stage's, for the exit's tokens
        self.wire_bytes = 0
        self.on_tokens: OnTokens | None = None
        self._drafts: dict[str, list[int]] = {}  # the drafts each check carries
        self._params: dict[str, SamplingParams] = {}
        self._keep = False

    def generate(self, requests: Iterable[tuple[Generation, SamplingParams]],
                 keep: bool = False) -> None:
        """Run every request to completion; tokens land in each. Each stage runs the steps
        of every sequence whose inputs are complete as one call (StageWorker.run_many), so
        the requests share each pass over the weights. With `keep`, the stages keep each
        finished answer's K/V until `drop`."""
        self._keep = keep
        running: dict[str, Generation] = {}
        ready: list[list[Step]] = [[] for _ in self.workers]  # complete inputs, per stage
        wire: deque[tuple[int, int, list[bytes]]] = deque()  # (target, source, frames)
        for generation, params in requests:
            running[generation.seq_id] = generation
            self.sampler.open(generation.seq_id, params)
            self.exit_sampler.open(generation.seq_id, params)
            self._params[generation.seq_id] = params
            ready[0].append(self._next_step(generation))
        while wire or any(ready):
            while wire:
                self._receive(*wire.popleft(), ready)
            stage = next(i for i, steps in enumerate(ready) if steps)
            batch, ready[stage] = self.workers[stage].due(ready[stage], lambda step: step)
            if not batch:
                raise RuntimeError(f"stage {stage} waits for steps that never come")
            for done in self.workers[stage].run_many(batch):
                if isinstance(done, Exception):
                    raise done
                for out in done.outgoing:
                    frames = [bytes(f) for f in protocol.encode(out.message)]
                    self.wire_bytes += sum(len(f) for f in frames)
                    wire.append((out.target, stage, frames))
                generation = running[done.seq_id]
                if done.exit_hidden is not None and self._exited(generation, done):
                    self._continue(generation, ready[0])
                if done.logits is not None and self._sampled(generation, done):
                    self._continue(generation, ready[0])

    def _next_step(self, generation: Generation) -> Step:
        params = self._params[generation.seq_id]
        count = drafts_wanted(self.exits, generation, params)
        if count == 0:
            return generation.next_step()
        drafts = draft(self.workers[0].executor, generation, count, params)
        self._drafts[generation.seq_id] = drafts.tokens
        return generation.next_step(drafts)

    def _continue(self, generation: Generation, first_stage: list[Step]) -> None:
        if generation.finished:
            if not generation.unchecked:
                self._close(generation.seq_id)
            return
        first_stage.append(self._next_step(generation))

    def _exited(self, generation: Generation, done: StepDone) -> bool:
        """The exit answered the step: True when the answer goes on from its token."""
        if generation.finished or done.exit_hidden is None or self.exits.threshold is None:
            return False
        logits = self.workers[0].executor.exit_logits(done.exit_hidden)
        token = exit_token(self.exits, self.exit_sampler, done.seq_id, logits)
        if token is None:
            return False
        generation.record(done.step, token, exited=True)
        self._tell(generation, [token], logits[0])
        return True

    def _sampled(self, generation: Generation, done: StepDone) -> bool:
        """The full model's token(s) for the step: True when the answer goes on from them
        (or, having ended, has nothing left to check)."""
        assert done.logits is not None
        checks, token = self.sampler.tokens(done.seq_id, done.logits, done.rows,
                                            done.draft_probs)
        if generation.check(done.step, token):
            return generation.finished and not generation.unchecked
        if done.rows > 1:
            drafts = self._drafts.pop(done.seq_id)
            new = generation.verified(done.step, drafts, checks, token)
            self._tell(generation, new, done.logits[0, done.logits.shape[1] - done.rows :])
        else:
            generation.record(done.step, token)
            self._tell(generation, [token], done.logits[0, -1:])
        return True

    def _tell(self, generation: Generation, tokens: list[int], rows: np.ndarray) -> None:
        if self.on_tokens is not None:
            self.on_tokens(generation, tokens, rows)

    def _receive(self, stage: int, source: int, frames: list[bytes],
                 ready: list[list[Step]]) -> None:
        message = protocol.decode(frames)
        if not isinstance(message, protocol.StageData):  # stages send nothing else
            raise TypeError(f"stage {source} sent {message.KIND}")
        step = self.workers[stage].accept(source, message)
        if step is not None:
            ready[stage].append(step)

    def _close(self, seq_id: str) -> None:
        self.sampler.close(seq_id)
        self.exit_sampler.close(seq_id)
        self._params.pop(seq_id, None)
        if not self._keep:
            self.drop(seq_id)

    def drop(self, seq_id: str) -> None:
        """Free the sequence's K/V on every stage."""
        for worker in self.workers:
            worker.drop(seq_id)
