"""Early exit, speculative decoding and standalone answers on the network data plane: three
stages of a real 4-layer Llama on three real transports over loopback, the head's stage
holding the exit, checked against transformers."""

from __future__ import annotations

import asyncio

import pytest
import torch
from ring import Peer, link, load, reachable, running_ring
from sharding import _transformers_model, exit_head, exit_reference, reference, sharded

from peerd.inference.answers import Request
from peerd.inference.dataplane import Limits
from peerd.inference.pipeline import NewToken
from shards.early_exit import ExitSettings
from shards.executor import StageExecutor
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
        assert answer.tokens == exit_reference(model, 2, prompt, NEW_TOKENS)
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


def _expected_along(model_dir, prompt, tokens, degraded: set[int]) -> list[int]:
    """Token by token, what the answer should hold: the exit's argmax (after layer 2) where
    it was degraded, the full model's elsewhere, each given the tokens before it."""
    model = _transformers_model(model_dir)
    head = exit_head(model_dir)
    ids, expected = list(prompt), []
    with torch.no_grad():
        for index in range(len(tokens)):
            out = model(torch.tensor([ids]), output_hidden_states=True)
            row = head(out.hidden_states[2][0, -1]) if index in degraded else out.logits[0, -1]
            expected.append(int(row.argmax()))
            ids.append(tokens[index])
    return expected


async def test_standalone_answers_from_the_exit_while_the_later_peers_are_gone(model):
    """The peers behind the exit vanish mid-answer and no plan serves: the answer goes on
    from the exit, each token marked degraded; two peers take their stages in a new plan:
    the answer continues at full depth, re-prefilled there."""
    result = sharded(model)
    manifest, directory = result.manifest, result.directory
    exits = ExitSettings(threshold=1.5, layer=2)  # no exit while the cluster serves
    limits = Limits(send_timeout_s=5.0)
    async with running_ring(manifest, directory, limits, stages=STAGES, exits=exits,
                            standalone=True) as peers:
        head = peers[0]
        streamed: list[NewToken] = []
        chores: list[asyncio.Task] = []

        behind = peers[1:]

        async def vanish() -> None:
            for peer in behind:
                await peer.transport.close()
            # as the daemon hears it: the leader's plan without stages, then the plane closes
            head.answers.use(None, problem="the model does not fit the peers left")
            await head.retire("1.1")

        # the peers that come back, ready before the answer starts: the test, not the
        # clock, decides when the answer sees them
        stages = [("a", 0, 4), ("b2", 5, 7), ("c2", 8, 9)]
        new = [Peer(peer_id, limits) for peer_id, _, _ in stages[1:]]
        peers.extend(new)  # closed with the others
        link([head, *new])
        for peer, (_, first, last) in zip(new, stages[1:], strict=True):
            load(peer, manifest, directory, first, last)
            peer.add_plane("1.2", manifest, stages)
        back = head.add_plane("1.2", manifest, stages, exits=exits)
        await reachable([head, *new])

        def on_token(new: NewToken) -> None:
            streamed.append(new)
            degraded = sum(t.degraded for t in streamed)
            if len(streamed) == 4:
                chores.append(asyncio.create_task(vanish()))
            elif new.degraded and degraded == 6:
                head.answers.use(back)

        request = Request([1, 17, 42, 99, 7], SamplingParams(), 40, frozenset())
        answer = await asyncio.wait_for(head.answers.generate(request, on_token), 60)
        await asyncio.gather(*chores)
    flags = [t.degraded for t in streamed]
    assert answer.tokens == [t.id for t in streamed]
    shown = "".join("D" if flag else "." for flag in flags)
    assert shown.startswith("....") and shown.endswith("."), shown
    assert answer.degraded == sum(flags) >= 6
    degraded = {i for i, flag in enumerate(flags) if flag}
    assert answer.tokens == _expected_along(model, request.prompt, answer.tokens, degraded)


@pytest.mark.parametrize("stages_retire", ["after the answer", "at once"])
async def test_answers_that_exit_move_to_a_new_plan_and_stay_exact(model, stages_retire):
    """A plan change mid-answer. Where the stages behind the exit serve on until the answer
    left, it pauses at a token boundary once they have run every step it exited, its K/V
    moves, and it goes on exiting. Where every peer retires its old plane at once, those
    stages perhaps before the answer's first step reached them, the answer cannot wait for
    those steps' tokens: it re-prefills on the new plan (or moves, where they came). Either
    way the answer is exact."""
    result = sharded(model)
    manifest, directory = result.manifest, result.directory
    exits = ExitSettings(threshold=0.0, layer=2)
    async with running_ring(manifest, directory, Limits(send_timeout_s=5.0), stages=STAGES,
                            exits=exits) as peers:
        a, b, c = peers
        new_split = [("a", 0, 4), ("c", 5, 9)]  # b leaves: its units' K/V moves to c
        c.add_plane("1.2", manifest, new_split, StageExecutor(manifest, directory, 5, 9,
                                                              shelf=c.shelf))
        moved_to = a.add_plane("1.2", manifest, new_split, exits=exits)
        handovers = [(a, moved_to), (b, None), (c, None)]
        now, later = (handovers, []) if stages_retire == "at once" else (handovers[:1],
                                                                        handovers[1:])
        retiring: list[asyncio.Task] = []

        def on_token(new: NewToken) -> None:
            if not retiring:
                a.answers.use(moved_to)
                retiring.extend(asyncio.create_task(peer.planes["1.1"].retire(handover, 10))
                                for peer, handover in now)

        prompt = PROMPTS[0]
        request = Request(list(prompt), SamplingParams(), 40, frozenset())
        answer = await asyncio.wait_for(a.answers.generate(request, on_token), 60)
        await asyncio.gather(*retiring, *(peer.planes["1.1"].retire(None, 10)
                                          for peer, _ in later))
    assert answer.tokens == exit_reference(model, 2, prompt, 40)
    assert answer.resumed == 1
    if later:
        assert answer.kv_moved == 1
        assert answer.exits is not None
        assert answer.exits["exited"] == 40 == answer.exits["checked"]
