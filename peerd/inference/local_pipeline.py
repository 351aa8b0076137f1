"""All stages of a split model in one process, every message through the wire codec.

This is what `peerd generate --parts K` runs: the same `StageWorker`s, `TokenSampler` and
`Generation` logic as the daemon, with a FIFO of encoded frames standing in for the network,
so each stage receives exactly the bytes a peer would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from peerd.inference.pipeline import Generation, StageWorker, TokenSampler
from peerd.wire import protocol
from shards.sampling import SamplingParams


class LocalPipeline:
    def __init__(self, workers: list[StageWorker]) -> None:
        self.workers = workers
        self.sampler = TokenSampler()
        self.wire_bytes = 0

    def generate(self, requests: Iterable[tuple[Generation, SamplingParams]]) -> None:
        """Run every request to completion, their steps interleaved; tokens land in each."""
        running: dict[str, Generation] = {}
        ready: deque[str] = deque()
        wire: deque[tuple[int, int, list[bytes]]] = deque()  # (target, source, frames)
        for generation, params in requests:
            running[generation.seq_id] = generation
            self.sampler.open(generation.seq_id, params)
            ready.append(generation.seq_id)
        while ready or wire:
            if ready:
                generation = running[ready.popleft()]
                stage, (step, inputs) = 0, generation.step_inputs()
                seq_id = generation.seq_id
            else:
                stage, source, frames = wire.popleft()
                message = protocol.decode(frames)
                if not isinstance(message, protocol.StageData):  # stages send nothing else
                    raise TypeError(f"stage {source} sent {message.KIND}")
                inputs = self.workers[stage].accept(source, message)
                if inputs is None:
                    continue
                seq_id, step = message.seq_id, message.step
            done = self.workers[stage].run(seq_id, step, inputs)
            for out in done.outgoing:
                frames = [bytes(f) for f in protocol.encode(out.message)]
                self.wire_bytes += sum(len(f) for f in frames)
                wire.append((out.target, stage, frames))
            if done.logits is not None:
                token = self.sampler.sample(seq_id, done.logits)
                if running[seq_id].record(step, token):
                    self._close(seq_id)
                else:
                    ready.append(seq_id)

    def _close(self, seq_id: str) -> None:
        self.sampler.close(seq_id)
        for worker in self.workers:
            worker.drop(seq_id)
