"""The network data plane: three stages on three real transports over loopback (toy units)."""

import asyncio
import contextlib

import numpy as np
import pytest
from ring import reference, running_ring
from waiting import eventually

from peerd import protocol
from peerd.dataplane import Busy, GenerationError, Limits, Request
from shards.sampling import SamplingParams

PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 0], [3, 3], [2], [7, 1], [9, 9, 9]]


@pytest.fixture
async def ring(toy):
    _, manifest, directory = toy
    limits = Limits(max_sequences=8, max_waiting=2, send_timeout_s=5.0)
    async with running_ring(manifest, directory, limits) as peers:
        yield peers


def _request(prompt, max_tokens=10, **sampling) -> Request:
    return Request(prompt, SamplingParams(**sampling), max_tokens, frozenset())


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
        assert results[i] == streamed[i] == reference(model, prompt, 10)
    await eventually(
        lambda: all(p.plane.worker.executor.sequence_count == 0 for p in ring), "K/V freed"
    )


async def test_residuals_reach_only_the_stage_that_consumes_them(ring):
    await ring[0].plane.generate(_request([1, 2, 3], max_tokens=4), lambda t: None)
    head, middle, last = (p.plane.worker.counters for p in ring)
    assert set(head.residual_bytes_by_target) == {2}
    assert middle.residual_bytes == 0 and last.residual_bytes == 0
    assert set(middle.received_bytes) == {"hidden0", "bias"}
    assert set(last.received_bytes) == {"hidden1", "bias"}
    assert head.received_bytes == {}


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
    assert results == [reference(model, p, 10) for p in PROMPTS[:3]]
    await eventually(
        lambda: all(p.plane.worker.executor.sequence_count == 0 for p in ring), "K/V freed"
    )


async def test_beyond_the_waiting_line_requests_are_refused_as_busy(ring):
    head = ring[0].plane
    long = [
        asyncio.create_task(head.generate(_request([1], max_tokens=200), lambda t: None))
        for _ in range(8 + 2)
    ]
    await eventually(lambda: head._waiting == 2, "two waiting")
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
