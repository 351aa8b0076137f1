"""Early exit and speculative decoding on the network data plane: three stages of a real
4-layer Llama on three real transports over loopback, the head's stage ending after layer 1
with the exit, checked against transformers."""

from __future__ import annotations

import asyncio

import pytest
from ring import running_ring
from sharding import reference, sharded
from test_early_exit import _exit_answer

from peerd.inference.answers import Request
from peerd.inference.dataplane import Limits
from shards.early_exit import ExitSettings
from shards.sampling import SamplingParams

PROMPTS = [(1, 17, 42, 99, 7), (250, 3), (64, 8, 8, 30, 2, 11), (5,)]
NEW_TOKENS = 16
# units: embed, layer0.attn, layer0.mlp, layer1.attn, layer1.mlp, ..., head
STAGES = [("a", 0, 4), ("b", 5, 7), ("c", 8, 9)]


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return hf_checkpoint("llama", layers=4)


async def _answers(model_dir, exits: ExitSettings):
    result = sharded(model_dir)
    limits = Limits(max_sequences=8, send_timeout_s=5.0)
    async with running_ring(result.manifest, result.directory, limits, stages=STAGES,
                            exits=exits) as peers:
        head = peers[0].answers
        streamed: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
        answered = await asyncio.wait_for(asyncio.gather(*(
            head.generate(Request(list(p), SamplingParams(), NEW_TOKENS, frozenset()),
                          lambda t, i=i: streamed[i].append(t.id))
            for i, p in enumerate(PROMPTS))), 60)
        for i, answer in enumerate(answered):
            assert answer.tokens == streamed[i]
        return answered


async def test_an_always_confident_exit_answers_from_its_layer_at_once(model):
    answered = await _answers(model, ExitSettings(threshold=0.0, layer=2))
    for prompt, answer in zip(PROMPTS, answered, strict=True):
        assert answer.tokens == _exit_answer(model, 2, NEW_TOKENS, prompt)
        assert answer.exits is not None
        assert answer.exits["layer"] == 2
        assert answer.exits["exited"] == NEW_TOKENS == answer.exits["checked"]
        # the stages behind the exit ran every step: the prefill and each token but the last
        assert [s.steps for s in answer.stages] == [NEW_TOKENS] * 3


async def test_an_exit_never_confident_enough_changes_nothing(model):
    answered = await _answers(model, ExitSettings(threshold=1.5))
    for prompt, answer in zip(PROMPTS, answered, strict=True):
        assert answer.tokens == reference(model, prompt, NEW_TOKENS)[0]
        assert answer.exits is not None and answer.exits["exited"] == 0


@pytest.mark.parametrize("drafts", [1, 4])
async def test_speculative_answers_are_the_full_models(model, drafts):
    answered = await _answers(model, ExitSettings(speculative=drafts, layer=1))
    for prompt, answer in zip(PROMPTS, answered, strict=True):
        assert answer.tokens == reference(model, prompt, NEW_TOKENS)[0]
        assert answer.exits is not None and answer.exits["checks"] < NEW_TOKENS
