"""The network data plane: three stages on three real transports over loopback (toy units)."""

import asyncio
import contextlib
import dataclasses
import weakref

import numpy as np
import pytest
from ring import reference, running_ring
from toy_units import HIDDEN
from waiting import eventually

from peerd.inference.answers import Busy, Request
from peerd.inference.dataplane import GenerationError, Limits
from peerd.inference.pipeline import NewToken
from peerd.wire import protocol
from shards.executor import StageExecutor
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
    head = ring[0].answers
    streamed = {i: [] for i in range(len(PROMPTS))}
    results = await asyncio.wait_for(
        asyncio.gather(
            *(head.generate(_request(p), lambda t, i=i: streamed[i].append(t.id))
              for i, p in enumerate(PROMPTS))
        ),
        timeout=30,
    )
    for i, prompt in enumerate(PROMPTS):
        assert results[i].tokens == streamed[i] == reference(model, prompt, 10)
        assert [s.steps for s in results[i].stages] == [10, 10, 10]
    await eventually(
        lambda: all(p.plane.worker.executor.sequence_count == 0 for p in ring), "K/V freed"
    )


SETTINGS = [{}, {"temperature": 0.8, "seed": 1}, {"temperature": 1.3, "top_k": 3, "seed": 2},
            {"temperature": 0.7, "top_p": 0.8, "seed": 3}]


async def test_answers_in_flight_together_share_steps_and_each_equals_its_run_alone(ring):
    head = ring[0].answers
    requests = [_request(prompt, 12, **SETTINGS[i % len(SETTINGS)])
                for i, prompt in enumerate(PROMPTS)]
    together = await asyncio.wait_for(
        asyncio.gather(*(head.generate(r, lambda t: None) for r in requests)), 30)
    for peer in ring:
        counters = peer.plane.worker.counters
        assert counters.steps == 12 * len(PROMPTS)
        assert counters.steps >= 3 * counters.batches, "the answers ran mostly one by one"
    alone = [await asyncio.wait_for(head.generate(r, lambda t: None), 10) for r in requests]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert len({tuple(r.tokens) for r in alone}) > 1


async def test_residuals_reach_only_the_stage_that_consumes_them(ring):
    await ring[0].answers.generate(_request([1, 2, 3], max_tokens=4), lambda t: None)
    head, middle, last = (p.plane.worker.counters for p in ring)
    assert set(head.residual_bytes_by_target) == {2}
    assert middle.residual_bytes == 0 and last.residual_bytes == 0
    assert set(middle.received_bytes) == {"hidden0", "bias"}
    assert set(last.received_bytes) == {"hidden1", "bias"}
    assert head.received_bytes == {}


async def test_cancelling_one_answer_leaves_the_others_exact_and_frees_its_state(toy, ring):
    model = toy[0]
    head = ring[0].answers
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
    assert [r.tokens for r in results] == [reference(model, p, 10) for p in PROMPTS[:3]]
    await eventually(
        lambda: all(p.plane.worker.executor.sequence_count == 0 for p in ring), "K/V freed"
    )


async def test_beyond_the_waiting_line_requests_are_refused_as_busy(ring):
    head = ring[0].answers
    long = [
        asyncio.create_task(head.generate(_request([1], max_tokens=200), lambda t: None))
        for _ in range(8 + 2)
    ]
    await eventually(lambda: head.status()["waiting"] == 2, "two waiting")
    with pytest.raises(Busy, match="busy"):
        await head.generate(_request([1]), lambda t: None)
    for task in long:
        task.cancel()
    await asyncio.gather(*long, return_exceptions=True)


async def test_a_sequence_open_with_bad_settings_is_answered_with_the_reason(ring):
    bad = protocol.SequenceOpen(0, "1.1", "s", temperature=1.0, top_k=0, top_p=0.0, seed=0,
                                skip=0)
    answer = await ring[0].transport.request("c", bad, 5)
    assert "top-p" in answer.error
    wrong_stage = protocol.SequenceOpen(0, "1.1", "s", 0.0, 0, 1.0, 0, 0)
    answer = await ring[0].transport.request("b", wrong_stage, 5)
    assert answer.error == "stage 1 does not sample"


async def test_a_stage_that_cannot_run_a_step_fails_the_answer_with_the_reason(ring, monkeypatch):
    executor = ring[1].plane.worker.executor
    real_step = executor.step

    def wrong_shape(seq_id, inputs, unit_s=None, rows=None):
        return real_step(seq_id, {**inputs, "hidden0": np.zeros((1, 1, 3), np.float32)}, unit_s,
                         rows)

    monkeypatch.setattr(executor, "step", wrong_shape)
    with pytest.raises(GenerationError, match="stage 1, step 0: .*hidden0"):
        await asyncio.wait_for(ring[0].answers.generate(_request([1]), lambda t: None), 10)


async def _after_tokens(head, request, count: int):
    """Start an answer; return its task once it has streamed `count` tokens."""
    seen = asyncio.Event()
    tokens: list[int] = []

    def on_token(token: NewToken) -> None:
        tokens.append(token.id)
        if len(tokens) >= count:
            seen.set()

    task = asyncio.create_task(head.generate(request, on_token))
    streaming = asyncio.ensure_future(seen.wait())
    await asyncio.wait({streaming, task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    streaming.cancel()
    if task.done():
        task.result()  # an answer that ended early says why
    assert seen.is_set(), f"{len(tokens)} of {count} tokens in 10 s"
    return task, tokens


async def test_a_resumed_answer_whose_text_already_stopped_computes_nothing(ring):
    """The tokens an earlier head streamed reached a stop string (`Request.stopped`): the
    answer ends with them, as it would have there."""
    request = dataclasses.replace(_request([4, 2], max_tokens=24), produced=(2, 2),
                                  stopped=True)
    streamed: list[NewToken] = []
    result = await asyncio.wait_for(ring[0].answers.generate(request, streamed.append), 10)
    assert result.tokens == [2, 2] and not streamed
    assert ring[0].plane.worker.counters.steps == 0


async def test_answers_move_to_a_new_plan_mid_answer_and_stay_exact(toy, ring):
    model, manifest, _ = toy
    head = ring[0].answers
    sampled = _request([5, 1], max_tokens=24, temperature=0.9, top_k=5, seed=7)
    uninterrupted = (await head.generate(sampled, lambda t: None)).tokens
    running = [await _after_tokens(head, _request(p, max_tokens=24), 3) for p in PROMPTS[:4]]
    running.append(await _after_tokens(head, sampled, 3))
    for peer in ring:
        peer.add_plane("1.2", manifest)
    head.use(ring[0].planes["1.2"])
    for peer in ring:
        await peer.retire("1.1")
    results = await asyncio.wait_for(asyncio.gather(*(task for task, _ in running)), 30)
    for (prompt, result, (_, streamed)) in zip(PROMPTS[:4], results, running, strict=False):
        assert result.tokens == streamed == reference(model, prompt, 24)
    assert results[-1].tokens == running[-1][1] == uninterrupted
    assert all(r.resumed == 1 for r in results)
    ring[0].planes["1.2"].keep_within(0)  # what it kept for the conversations' next turns
    await eventually(lambda: all(p.executor.sequence_count == 0 for p in ring), "K/V freed")


async def test_answers_move_with_their_k_v_to_a_plan_that_splits_the_units_anew(toy, ring):
    model, manifest, directory = toy
    a, b, c = ring
    head = a.answers
    sampled = _request([5, 1], max_tokens=24, temperature=0.9, top_k=5, seed=7)
    uninterrupted = (await head.generate(sampled, lambda t: None)).tokens
    running = [await _after_tokens(head, _request(p, max_tokens=24), 3) for p in PROMPTS[:4]]
    running.append(await _after_tokens(head, sampled, 3))
    new_split = [("a", 0, 1), ("c", 2, 2)]  # b leaves: its unit's K/V moves to a
    grown = StageExecutor(manifest, directory, 0, 1, shelf=a.shelf)
    assert grown.session(0) is a.executor.session(0), "a keeps unit 0's session"
    a.add_plane("1.2", manifest, new_split, grown)
    c.add_plane("1.2", manifest, new_split)
    head.use(a.planes["1.2"])
    await asyncio.gather(a.planes["1.1"].retire(a.planes["1.2"], 10),
                         b.planes["1.1"].retire(None, 10), c.planes["1.1"].retire(None, 10))
    results = await asyncio.wait_for(asyncio.gather(*(task for task, _ in running)), 30)
    for (prompt, result, (_, streamed)) in zip(PROMPTS[:4], results, running, strict=False):
        assert result.tokens == streamed == reference(model, prompt, 24)
    assert results[-1].tokens == running[-1][1] == uninterrupted
    assert all(r.resumed == r.kv_moved == 1 for r in results)
    assert {k: head.status()[k] for k in ("moved_with_kv", "re_prefilled")} == {
        "moved_with_kv": len(results), "re_prefilled": 0}
    last = c.planes["1.2"].worker.counters
    assert last.received_bytes["hidden1"] == last.steps * HIDDEN * 4, "a step re-prefilled"
    assert b.executor.sequence_count == 0
    retired = [weakref.ref(peer.planes.pop("1.1").worker.executor) for peer in (a, b)]
    a.executor, b.executor = grown, None
    assert [stage() for stage in retired] == [None, None], "nothing holds the old stages"


async def test_an_answer_whose_k_v_cannot_all_move_re_prefills_and_leaves_nothing_behind(
    toy, ring,
):
    model, manifest, directory = toy
    a, b, c = ring
    head = a.answers
    task, _ = await _after_tokens(head, _request([4, 2], max_tokens=24), 3)
    new_split = [("a", 0, 1), ("c", 2, 2)]
    executor = StageExecutor(manifest, directory, 0, 1)
    a.add_plane("1.2", manifest, new_split, executor)
    c.add_plane("1.2", manifest, new_split)

    async def cannot_send(move):
        return "stage 1: the disk holding unit 1 failed"

    b.planes["1.1"].send_state = cannot_send  # a's and c's parts arrive, b's never does
    head.use(a.planes["1.2"])
    await a.planes["1.1"].retire(a.planes["1.2"], 10)
    result = await asyncio.wait_for(task, 30)
    assert result.tokens == reference(model, [4, 2], 24)
    assert (result.resumed, result.kv_moved) == (1, 0)
    assert (head.status()["moved_with_kv"], head.status()["re_prefilled"]) == (0, 1)
    a.planes["1.2"].keep_within(0)  # what it kept for the conversation's next turn
    assert executor.sequence_count == 0, "the part of the K/V that did move was freed"


async def test_an_answer_waits_for_k_v_room_and_one_too_long_is_refused(ring):
    head = ring[0].answers
    head.use(ring[0].plane, kv_tokens=1000)
    first, _ = await _after_tokens(head, _request([1, 2], max_tokens=900), 1)
    second = asyncio.create_task(head.generate(_request([3], max_tokens=200), lambda t: None))
    await eventually(lambda: head.status()["waiting"] == 1, "the second answer waits")
    assert head.status()["kv_reserved_tokens"] == 902
    with pytest.raises(GenerationError, match="1001 tokens .* exceed the plan's K/V reserve"):
        await head.generate(_request([1], max_tokens=1000), lambda t: None)
    first.cancel()
    assert len((await asyncio.wait_for(second, 20)).tokens) == 200
    assert head.status() == {"running": 0, "waiting": 0, "kv_reserved_tokens": 0,
                             "kv_reserve_tokens": 1000, "moved_with_kv": 0, "re_prefilled": 0,
                             "waiting_for_client": 0}


async def test_answers_without_a_next_plan_end_with_the_leaders_reason(ring):
    head = ring[0].answers
    task, _ = await _after_tokens(head, _request([1], max_tokens=500), 2)
    head.use(None)
    await ring[0].retire("1.1")
    head.use(None, problem="model needs 9.1 GB at beta 0.7; usable peers offer 6.3 GB")
    with pytest.raises(GenerationError, match="model needs 9.1 GB"):
        await asyncio.wait_for(task, 10)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


async def test_logprobs_asked_for_travel_from_the_last_stage_with_each_token(toy, ring):
    model = toy[0]
    prompt = [5, 1]
    heard: list[NewToken] = []
    sampled = _request(prompt, max_tokens=6, temperature=0.9, seed=3, logprobs=4)
    result = await ring[0].answers.generate(sampled, heard.append)
    assert [t.id for t in heard] == result.tokens and heard[-1].last
    for i, token in enumerate(heard):
        expected = _log_softmax(model.logits(prompt + result.tokens[:i])[-1])
        assert token.logprobs is not None
        assert token.logprobs.logprob == pytest.approx(expected[token.id], abs=1e-5)
        best = np.argsort(-expected, kind="stable")[:4]
        assert [i for i, _ in token.logprobs.top] == best.tolist()
        assert [lp for _, lp in token.logprobs.top] == pytest.approx(expected[best], abs=1e-5)
    plain: list[NewToken] = []
    await ring[0].answers.generate(_request(prompt, max_tokens=2), plain.append)
    assert [t.logprobs for t in plain] == [None, None], "only when asked"


async def test_an_answer_ended_by_its_token_callback_stops_on_every_stage(ring):
    seen: list[int] = []

    def three_is_enough(token: NewToken) -> bool:
        seen.append(token.id)
        return len(seen) == 3

    result = await ring[0].answers.generate(_request([1, 2], max_tokens=50), three_is_enough)
    assert result.tokens == seen and len(seen) == 3
    assert [s.steps for s in result.stages] == [3, 3, 3], "no step ran past the end"
    await eventually(
        lambda: all(p.plane.worker.executor.sequence_count == 0 for p in ring), "K/V freed"
    )


CONVERSATION = [1, 5, 2, 7, 3, 9, 4, 6, 8, 10, 0, 2, 4, 6]


async def _turns(head, first_max: int = 12):
    request = _request(CONVERSATION, first_max)
    first = await asyncio.wait_for(head.generate(request, lambda t: None), 10)
    return first, [*CONVERSATION, *first.tokens, 3, 1, 4]


async def test_a_next_turn_starts_from_the_kept_k_v_and_equals_a_fresh_run(toy, ring):
    model, head = toy[0], ring[0].answers
    first, follow_up = await _turns(head)
    second = await asyncio.wait_for(head.generate(_request(follow_up, 8), lambda t: None), 10)
    assert second.reused == len(CONVERSATION) + len(first.tokens) - 1
    assert second.tokens == reference(model, follow_up, 8)
    assert [s.steps for s in second.stages] == [8, 8, 8]
    prefilled = len(follow_up) - second.reused  # then 7 decode steps of one token
    assert second.stages[0].sequential_bytes == (prefilled + 7) * (HIDDEN + 1) * 4  # + bias
    # the second turn took the first's K/V over, and is kept for a third
    await eventually(lambda: all(p.executor.sequence_count == 1 for p in ring), "handed over")
    assert len(ring[0].plane.prefixes) == 1
    ring[0].plane.keep_within(0)
    await eventually(lambda: all(p.executor.sequence_count == 0 for p in ring), "K/V freed")


async def test_a_stage_that_lost_the_kept_k_v_makes_the_next_turn_prefill_it_all(toy, ring):
    model, head = toy[0], ring[0].answers
    _, follow_up = await _turns(head)
    kept = next(iter(ring[0].plane.prefixes._kept))
    ring[2].plane.worker.drop(kept)
    second = await asyncio.wait_for(head.generate(_request(follow_up, 8), lambda t: None), 10)
    assert second.reused == 0
    assert second.tokens == reference(model, follow_up, 8)
    assert len(ring[0].plane.prefixes) == 1  # the broken one given up, the new one kept
    await eventually(lambda: ring[1].executor.sequence_count == 1, "the broken one freed")


async def test_kept_k_v_gives_way_to_answers_that_need_the_room_but_not_to_its_own(
        toy, ring):
    model, head = toy[0], ring[0].answers
    head.use(ring[0].plane, kv_tokens=60)
    _, follow_up = await _turns(head)
    assert len(ring[0].plane.prefixes) == 1
    second = await asyncio.wait_for(head.generate(_request(follow_up, 20), lambda t: None), 10)
    assert second.reused and second.tokens == reference(model, follow_up, 20)
    task, _ = await _after_tokens(head, _request([2, 3], max_tokens=50), 1)
    await eventually(lambda: len(ring[0].plane.prefixes) == 0, "kept K/V given up")
    await eventually(lambda: ring[2].executor.sequence_count == 1, "freed on every stage")
    task.cancel()


async def test_admission_counts_k_v_room_not_answers(ring):
    head = ring[0].answers  # Limits(max_sequences=8, max_waiting=2)
    head.use(ring[0].plane, kv_tokens=10 * 40)
    running = [await _after_tokens(head, _request([i % 10], max_tokens=39), 1)
               for i in range(10)]
    assert head.status()["running"] == 10
    waiting = [asyncio.create_task(head.generate(_request([1], 39), lambda t: None))
               for _ in range(2)]
    await eventually(lambda: head.status()["waiting"] == 2, "two wait for room")
    with pytest.raises(Busy, match="busy: 10 answers running and 2 waiting"):
        await head.generate(_request([1], 39), lambda t: None)
    running[0][0].cancel()
    await eventually(lambda: head.status()["waiting"] == 1, "one admitted once room freed")
    for task in [*(t for t, _ in running[1:]), *waiting]:
        task.cancel()


async def test_tokens_of_ended_or_unknown_sequences_free_them_and_stray_ones_are_dropped(
        ring, caplog):
    head, middle, last = ring
    # the head runs no answer for "gone": it ends it on every stage, sending each a drop
    head.plane.handle(last.id, protocol.SequenceToken("gone", 0, 1), lambda answer: None)
    # on the same link, after the drop: a late token for "gone", then one for "stray"; a
    # token is for the head only, so "stray" is dropped with a warning and "gone" silently
    for seq_id in ("gone", "stray"):
        assert head.transport.send(middle.id, protocol.SequenceToken(seq_id, 0, 1))
    stray = f"dropped seq-token from {head.id}: not for stage 1"
    await eventually(lambda: stray in caplog.text, "the stray token dropped")
    assert caplog.text.count("not for stage") == 1
    assert not any(p.plane.owns("gone") or p.plane.owns("stray") for p in ring)
