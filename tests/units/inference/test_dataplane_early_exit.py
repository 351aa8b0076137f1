"""Early exit, speculative decoding and standalone answers on the network data plane: three
stages of a real 4-layer Llama on three real transports over loopback, the head's stage
holding the exit, checked against transformers."""

from __future__ import annotations

import asyncio
import re

import pytest
from ring import Peer, link, load, reachable, running_ring
from sharding import exit_reference, expected_along, reference, sharded
from waiting import eventually

from peerd.inference.answers import HeadMoved, Request
from peerd.inference.dataplane import Limits
from peerd.inference.pipeline import NewToken
from peerd.inference.serving import ANSWER_BUFFER, parse_chat
from shards.early_exit import ExitSettings
from shards.executor import StageExecutor
from shards.sampling import SamplingParams

PROMPTS = [(1, 17, 42, 99, 7), (250, 3), (64, 8, 8, 30, 2, 11), (5,)]
NEW_TOKENS = 16
# units: embed, layer0.attn, layer0.mlp, layer1.attn, layer1.mlp, ..., head
STAGES = [("a", 0, 4), ("b", 5, 7), ("c", 8, 9)]
STANDALONE = ExitSettings(threshold=1.5, layer=2)  # no exit while the cluster serves
HELD_AFTER = 3  # degraded tokens the client takes before it stops reading


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return hf_checkpoint("llama", layers=4)


GREEDY = SamplingParams()


async def _answers(model_dir, exits: ExitSettings, params=GREEDY, prompts=PROMPTS):
    result = sharded(model_dir)
    limits = Limits(max_sequences=8, send_timeout_s=5.0)
    async with running_ring(result.manifest, result.directory, limits, stages=STAGES,
                            exits=exits) as peers:
        head = peers[0].answers
        streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        answered = await asyncio.wait_for(asyncio.gather(*(
            head.generate(Request(list(p), params, NEW_TOKENS, frozenset()),
                          lambda t, i=i: streamed[i].append(t.id))
            for i, p in enumerate(prompts))), 60)
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


async def _vanishing(peers: list[Peer], manifest, directory, limits: Limits,
                     exits: ExitSettings):
    """(vanish, back): `vanish()` takes the peers behind the head away as the daemon hears
    it (the leader's plan without stages, then the plane closes); `back` is the head's plane
    of plan 1.2, whose new peers b2 and c2 hold those stages, ready before the answer starts:
    the test, not the clock, decides when the answer sees them."""
    head, behind = peers[0], peers[1:]

    async def vanish() -> None:
        for peer in behind:
            await peer.transport.close()
        head.answers.use(None, problem="the model does not fit the peers left")
        await head.retire("1.1")

    stages = [("a", 0, 4), ("b2", 5, 7), ("c2", 8, 9)]
    new = [Peer(peer_id, limits) for peer_id, _, _ in stages[1:]]
    peers.extend(new)  # closed with the others
    link([head, *new])
    for peer, (_, first, last) in zip(new, stages[1:], strict=True):
        load(peer, manifest, directory, first, last)
        peer.add_plane("1.2", manifest, stages)
    back = head.add_plane("1.2", manifest, stages, exits=exits)
    await reachable([head, *new])
    return vanish, back


async def test_sampled_speculative_answers_at_a_near_zero_temperature_are_greedy(model):
    """At temperature 1e-4 sampling is the argmax, for the exit's drafts and the full
    model's tokens alike: speculative sampling gives the full model's greedy answer, the
    drafts' distributions travelling down the ring with each check."""
    answered = await _answers(model, ExitSettings(speculative=3, layer=1),
                              SamplingParams(temperature=1e-4, seed=5))
    for prompt, answer in zip(PROMPTS, answered, strict=True):
        assert answer.tokens == reference(model, prompt, NEW_TOKENS)[0]
        assert answer.exits is not None and answer.exits["drafted"] > 0


async def test_a_seeded_sampled_speculative_answer_repeats(model):
    """The same seed gives the same tokens (the drafts' streams are seeded too), with drafts
    both kept and replaced on the way."""
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    answered = await _answers(model, ExitSettings(speculative=2, layer=2), params,
                              [PROMPTS[0]] * 2 + [PROMPTS[2]] * 2)
    assert answered[0].tokens == answered[1].tokens != answered[2].tokens == answered[3].tokens
    exits = [answer.exits for answer in answered]
    assert all(e is not None and e["drafted"] > 0 for e in exits)
    assert 0 < sum(e["accepted"] for e in exits if e) < sum(e["drafted"] for e in exits if e)


STANDALONE_PROMPT = [1, 17, 42, 99, 7]


async def _standalone_answer(
    model, degraded: int, then,
) -> tuple[asyncio.Task, list[NewToken], int]:
    """A standalone answer whose later peers vanish after 4 tokens (`_vanishing`); once it
    has `degraded` tokens from the exit alone, `then(head, back)` runs. Returns the answer's
    ended task, the tokens it streamed and the sequences its head's stage still holds."""
    result = sharded(model)
    limits = Limits(send_timeout_s=5.0)
    async with running_ring(result.manifest, result.directory, limits, stages=STAGES,
                            exits=STANDALONE, standalone=True) as peers:
        head = peers[0]
        vanish, back = await _vanishing(peers, result.manifest, result.directory, limits,
                                        STANDALONE)
        streamed: list[NewToken] = []
        chores: list[asyncio.Task] = []

        def on_token(new: NewToken) -> None:
            streamed.append(new)
            if len(streamed) == 4:
                chores.append(asyncio.create_task(vanish()))
            elif new.degraded and sum(t.degraded for t in streamed) == degraded:
                then(head, back)

        request = Request(STANDALONE_PROMPT, SamplingParams(), 40, frozenset())
        answering = asyncio.create_task(head.answers.generate(request, on_token))
        await asyncio.wait({answering}, timeout=60)
        await asyncio.gather(*chores)
        assert answering.done(), "the answer ended within 60 s"
        return answering, streamed, head.executor.sequence_count


async def test_standalone_answers_from_the_exit_while_the_later_peers_are_gone(model):
    """The peers behind the exit vanish mid-answer and no plan serves: the answer goes on
    from the exit, each token marked degraded; two peers take their stages in a new plan:
    the answer continues at full depth, re-prefilled there."""
    answering, streamed, _ = await _standalone_answer(
        model, 6, lambda head, back: head.answers.use(back))
    answer = answering.result()
    flags = [t.degraded for t in streamed]
    assert answer.tokens == [t.id for t in streamed]
    shown = "".join("D" if flag else "." for flag in flags)
    assert shown.startswith("....") and shown.endswith("."), shown
    assert answer.degraded == sum(flags) >= 6
    degraded = {i for i, flag in enumerate(flags) if flag}
    assert answer.tokens == expected_along(model, 2, tuple(STANDALONE_PROMPT), answer.tokens,
                                           degraded)


async def test_a_standalone_answer_ends_with_head_moved_once_another_peer_is_the_head(model):
    """An answer from the exit alone stops there once a plan puts the head on another peer
    (which resumes it, peerd/inference/serving.py), and leaves no K/V behind."""
    answering, streamed, held = await _standalone_answer(
        model, 3, lambda head, _: head.answers.use(None, moved_to="c2"))
    with pytest.raises(HeadMoved) as moved:
        answering.result()
    assert moved.value.peer == "c2"
    shown = "".join("D" if t.degraded else "." for t in streamed)
    assert shown.startswith("....") and shown.endswith(".DDD") and shown.count("D") == 3
    assert held == 0


async def test_a_standalone_answer_pauses_while_its_client_stops_reading(model):
    """Flow control: an answer from the exit alone computes a token only once its client
    has room for it. The client takes HELD_AFTER degraded tokens and stops: the answer
    pauses with ANSWER_BUFFER events waiting for it (the head's status counts it), and a
    plan serves again meanwhile. Once the client reads on, the events that waited are
    degraded and every token after them is the full model's: none was computed while it
    held."""
    result = sharded(model)
    limits = Limits(send_timeout_s=5.0)
    async with running_ring(result.manifest, result.directory, limits, max_positions=256,
                            stages=STAGES, exits=STANDALONE, standalone=True) as peers:
        head = peers[0]
        vanish, back = await _vanishing(peers, result.manifest, result.directory, limits,
                                        STANDALONE)
        sent: list[dict] = []
        chores: list[asyncio.Task] = []
        reading = asyncio.Event()

        async def client(event: dict) -> None:
            sent.append(event)
            if len(sent) == 4:
                chores.append(asyncio.create_task(vanish()))
            if sum(e.get("degraded", False) for e in sent) == HELD_AFTER:
                await reading.wait()  # the client stops reading

        prompt = (1, 17, 42, 99, 7)
        body = parse_chat({"prompt_ids": list(prompt), "max_tokens": 100})
        answering = asyncio.create_task(head.chat.answer(body, client))
        await eventually(lambda: head.answers.status()["waiting_for_client"] == 1,
                         "the answer to pause for its client", 60)
        head.answers.use(back)
        reading.set()
        await asyncio.wait_for(answering, 60)
        await asyncio.gather(*chores)
    *events, done = sent
    tokens = [event["token"] for event in events]
    shown = "".join("D" if event.get("degraded") else "." for event in events)
    held = HELD_AFTER + ANSWER_BUFFER
    assert re.fullmatch(rf"\.{{4,}}D{{{held}}}\.+", shown), shown
    assert done["degraded"] is True and done["stats"]["degraded_tokens"] == held
    assert done["token_ids"] == tokens and len(tokens) == 100
    degraded = {i for i, flag in enumerate(shown) if flag == "D"}
    assert tokens == expected_along(model, 2, prompt, tokens, degraded)


EXITING = (ExitSettings(threshold=0.0, layer=2), SamplingParams())
# sampled at a temperature where sampling is the argmax: the answer is the full model's greedy
DRAFTING = (ExitSettings(speculative=3, layer=1), SamplingParams(temperature=1e-4, seed=2))


@pytest.mark.parametrize("stages_retire", ["after the answer", "at once"])
@pytest.mark.parametrize(("exits", "params"), [EXITING, DRAFTING],
                         ids=["exits", "speculative sampling"])
async def test_answers_with_an_exit_move_to_a_new_plan_and_stay_exact(model, stages_retire, exits,
                                                                    params):
    """A plan change mid-answer. Where the stages behind the exit serve on until the answer
    left, it pauses at a token boundary once they have run every step it exited, its K/V
    moves, and it goes on exiting. Where every peer retires its old plane at once, those
    stages perhaps before the answer's first step reached them, the answer cannot wait for
    those steps' tokens: it re-prefills on the new plan (or moves, where they came). Either
    way the answer is exact; so is a sampled speculative one, which resumes its streams."""
    result = sharded(model)
    manifest, directory = result.manifest, result.directory
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
        request = Request(list(prompt), params, 40, frozenset())
        answer = await asyncio.wait_for(a.answers.generate(request, on_token), 60)
        await asyncio.gather(*retiring, *(peer.planes["1.1"].retire(None, 10)
                                          for peer, _ in later))
    assert answer.resumed == 1
    assert answer.exits is not None
    if exits.speculative:
        assert answer.tokens == reference(model, prompt, 40)[0]
        assert answer.exits["drafted"] > 0
    else:
        assert answer.tokens == exit_reference(model, 2, prompt, 40)
    if later:
        assert answer.kv_moved == 1
        if not exits.speculative:
            assert answer.exits["exited"] == 40 == answer.exits["checked"]
