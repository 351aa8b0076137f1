"""All stages of a split model in one process, every message through the wire codec.

This is what `peerd generate --parts K` runs: the same `StageWorker`s, `TokenSampler` and
`Generation` logic as the daemon, with a FIFO of encoded frames standing in for the network,
so each stage receives exactly the bytes a peer would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from peerd.inference.pipeline import Generation, StageWorker, StepDone, Tensors, TokenSampler
from peerd.wire import protocol
from shards.sampling import SamplingParams

Step = tuple[str, int, Tensors]  # (seq_id, step, complete inputs)


class LocalPipeline:
    def __init__(self, workers: list[StageWorker]) -> None:
        self.workers = workers
        self.sampler = TokenSampler()
        self.wire_bytes = 0

    def generate(self, requests: Iterable[tuple[Generation, SamplingParams]]) -> None:
        """Run every request to completion; tokens land in each. Each stage runs the steps
        of every sequence whose inputs are complete as one call (StageWorker.run_many), so
        the requests share each pass over the weights."""
        running: dict[str, Generation] = {}
        ready: list[list[Step]] = [[] for _ in self.workers]  # complete inputs, per stage
        wire: deque[tuple[int, int, list[bytes]]] = deque()  # (target, source, frames)
        for generation, params in requests:
            running[generation.seq_id] = generation
            self.sampler.open(generation.seq_id, params)
            ready[0].append((generation.seq_id, *generation.step_inputs()))
        while wire or any(ready):
            while wire:
                self._receive(*wire.popleft(), ready)
            stage = next(i for i, steps in enumerate(ready) if steps)
            batch, ready[stage] = ready[stage], []
            for done in self.workers[stage].run_many(batch):
                if isinstance(done, Exception):
                    raise done
                for out in done.outgoing:
                    frames = [bytes(f) for f in protocol.encode(out.message)]
                    self.wire_bytes += sum(len(f) for f in frames)
                    wire.append((out.target, stage, frames))
                if done.logits is not None:
                    self._sampled(running[done.seq_id], done, done.logits, ready[0])

    def _receive(self, stage: int, source: int, frames: list[bytes],
                 ready: list[list[Step]]) -> None:
        message = protocol.decode(frames)
        if not isinstance(message, protocol.StageData):  # stages send nothing else
            raise TypeError(f"stage {source} sent {message.KIND}")
        inputs = self.workers[stage].accept(source, message)
        if inputs is not None:
            ready[stage].append((message.seq_id, message.step, inputs))

    def _sampled(self, generation: Generation, done: StepDone, logits: np.ndarray,
                 first_stage: list[Step]) -> None:
        token = self.sampler.sample(done.seq_id, logits)
        if generation.record(done.step, token):
            self._close(done.seq_id)
        else:
            first_stage.append((done.seq_id, *generation.step_inputs()))

    def _close(self, seq_id: str) -> None:
        self.sampler.close(seq_id)
        for worker in self.workers:
            worker.drop(seq_id)
