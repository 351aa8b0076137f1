"""The network data plane: three stages on three real transports over loopback (toy units)."""

import asyncio
import contextlib

import numpy as np
import pytest
from toy_units import ToyModel, write_toy

from peerd import protocol
from peerd.dataplane import Busy, DataPlane, GenerationError, Limits, Request
from peerd.identity import ClusterSecret, KeyPair
from peerd.transport import Endpoint, Transport, TransportError
from shards.executor import StageExecutor
from shards.sampling import SamplingParams

SECRET = ClusterSecret(b"d" * 32)
HOST = "127.0.0.1"
STAGES = [("a", 0, 0), ("b", 1, 1), ("c", 2, 2)]
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 0], [3, 3], [2], [7, 1], [9, 9, 9]]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("toy")
    model = ToyModel()
    return model, write_toy(directory, model), directory


class Peer:
    def __init__(self, peer_id: str):
        self.id = peer_id
        self.keys = KeyPair.generate()
        self.transport = Transport(self.keys, SECRET, self._handle, HOST)
        self.ports = self.transport.start()
        self.plane: DataPlane | None = None
        self.names: dict[str, str] = {}

    def _handle(self, incoming) -> None:
        if isinstance(incoming.msg, protocol.Ping):
            incoming.reply(protocol.Pong(incoming.msg.req))
            return
        self.plane.handle(self.names[incoming.sender_key], incoming.msg, incoming.reply)

    async def reach(self, other: str) -> None:
        """Wait until the CURVE handshake with `other` is done and it answers."""
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            try:
                await self.transport.request(other, protocol.Ping(req=0), 0.2)
                return
            except TransportError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.02)

    def endpoint(self) -> Endpoint:
        return Endpoint(HOST, self.ports.control, self.ports.data, self.keys.public)


@pytest.fixture
async def ring(toy):
    _, manifest, directory = toy
    peers = [Peer(peer_id) for peer_id, _, _ in STAGES]
    for peer in peers:
        for other in peers:
            if other is not peer:
                peer.transport.admit(other.keys.public)
                peer.transport.connect(other.id, other.endpoint())
                peer.names[other.keys.public] = other.id
    for peer, (_, first, last) in zip(peers, STAGES, strict=True):
        executor = StageExecutor(manifest, directory, first, last)
        limits = Limits(max_sequences=8, max_waiting=2, send_timeout_s=5.0)
        peer.plane = DataPlane(peer.id, peer.transport, STAGES, manifest, executor, limits=limits)
    await asyncio.gather(*(p.reach(o.id) for p in peers for o in peers if o is not p))
    yield peers
    for peer in peers:
        await peer.plane.close()
        await peer.transport.close()


def _reference(model: ToyModel, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    return ids[len(prompt):]


def _request(prompt, max_tokens=10, **sampling) -> Request:
    return Request(prompt, SamplingParams(**sampling), max_tokens, frozenset())


async def _eventually(condition, what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_eight_concurrent_generations_are_exact_and_free_their_state(toy, ring):
    model = toy[0]
    head = ring[0].plane
    streamed = {i: [] for i in range(len(PROMPTS))}
    results = await asyncio.wait_for(
        asyncio.gather(
            *(head.generate(_request(p), streamed[i].append) for i, p in enumerate(PROMPTS))
        ),
        timeout=30,
    )
    for i, prompt in enumerate(PROMPTS):
        assert results[i] == streamed[i] == _reference(model, prompt, 10)
    await _eventually(
        lambda: all(p.plane.worker.executor.sequence_count == 0 for p in ring), "K/V freed"
    )


async def test_residuals_reach_only_the_stage_that_consumes_them(ring):
    await ring[0].plane.generate(_request([1, 2, 3], max_tokens=4), lambda t: None)
    head, middle, last = (p.plane.worker.counters for p in ring)
    assert set(head.residual_bytes_by_target) == {2}
    assert middle.residual_bytes == 0 and last.residual_bytes == 0


async def test_cancelling_one_answer_leaves_the_others_exact_and_frees_its_state(toy, ring):
    model = toy[0]
    head = ring[0].plane
    first_token = asyncio.Event()
    victim = asyncio.create_task(
        head.generate(_request([4, 4], max_tokens=10_000), lambda t: first_token.set())
    )
    others = [asyncio.create_task(head.generate(_request(p), lambda t: None)) for p in PROMPTS[:3]]
    await asyncio.wait_for(first_token.wait(), 10)
    victim.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await victim
    results = await asyncio.wait_for(asyncio.gather(*others), 30)
    assert results == [_reference(model, p, 10) for p in PROMPTS[:3]]
    await _eventually(
        lambda: all(p.plane.worker.executor.sequence_count == 0 for p in ring), "K/V freed"
    )


async def test_beyond_the_waiting_line_requests_are_refused_as_busy(ring):
    head = ring[0].plane
    long = [
        asyncio.create_task(head.generate(_request([1], max_tokens=200), lambda t: None))
        for _ in range(8 + 2)
    ]
    await _eventually(lambda: head._waiting == 2, "two waiting")
    with pytest.raises(Busy, match="busy"):
        await head.generate(_request([1]), lambda t: None)
    for task in long:
        task.cancel()
    await asyncio.gather(*long, return_exceptions=True)


async def test_a_sequence_open_with_bad_settings_is_answered_with_the_reason(ring):
    bad = protocol.SequenceOpen(0, "s", temperature=1.0, top_k=0, top_p=0.0, seed=0)
    answer = await ring[0].transport.request("c", bad, 5)
    assert "top-p" in answer.error
    wrong_stage = protocol.SequenceOpen(0, "s", 0.0, 0, 1.0, 0)
    answer = await ring[0].transport.request("b", wrong_stage, 5)
    assert answer.error == "stage 1 does not sample"


async def test_a_stage_that_cannot_run_a_step_fails_the_answer_with_the_reason(ring, monkeypatch):
    executor = ring[1].plane.worker.executor
    real_step = executor.step

    def wrong_shape(seq_id, inputs):
        return real_step(seq_id, {**inputs, "hidden0": np.zeros((1, 1, 3), np.float32)})

    monkeypatch.setattr(executor, "step", wrong_shape)
    with pytest.raises(GenerationError, match="stage 1, step 0: .*hidden0"):
        await asyncio.wait_for(ring[0].plane.generate(_request([1]), lambda t: None), 10)
