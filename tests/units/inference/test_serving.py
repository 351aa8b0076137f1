"""Chats served on the head and forwarded from other peers, over real transports."""

import asyncio
import dataclasses
import weakref

import pytest
from ring import reference, running_ring
from waiting import eventually

from peerd.control.deploy import LoadedStage
from peerd.control.plan_live import PlanLive, StageLoaded
from peerd.errors import PeerdError
from peerd.inference.dataplane import Limits
from peerd.inference.serving import Serving, parse_chat
from peerd.wire.identity import ClusterSecret, KeyPair
from peerd.wire.protocol import ChatEvent, PlanAssignment, PlanFigures, PlanStage
from peerd.wire.transport import Transport
from shards.executor import SessionShelf, StageExecutor
from shards.text_stream import TextStream
from shards.tokenizer import Tokenizer

PROMPT = [1, 2, 3]


@pytest.fixture
async def ring(toy):
    _, manifest, directory = toy
    async with running_ring(manifest, directory, Limits(send_timeout_s=5.0)) as peers:
        yield peers


class Client:
    """Collects the events a local-API client would read."""

    def __init__(self, leave_after: int | None = None):
        self.events: list[dict] = []
        self.leave_after = leave_after

    async def send(self, event: dict) -> None:
        if self.leave_after is not None and len(self.events) >= self.leave_after:
            raise ConnectionResetError("client went away")
        self.events.append(event)


@pytest.mark.parametrize("asked_on", [0, 2], ids=["head", "forwarded"])
async def test_a_chat_streams_every_token_then_the_exact_answer(toy, ring, asked_on):
    client = Client()
    request = {"op": "chat", "prompt_ids": PROMPT, "max_tokens": 9}
    await asyncio.wait_for(ring[asked_on].chat.op_chat(request, client.send), 20)
    expected = reference(toy[0], PROMPT, 9)
    *tokens, done = client.events
    assert [e["token"] for e in tokens] == expected
    assert done["event"] == "done" and done["token_ids"] == expected
    stats = done["stats"]
    assert stats["generated_tokens"] == 9 and [s["steps"] for s in stats["stages"]] == [9] * 3
    head, middle, last = stats["stages"]
    assert head["sequential_bytes"] > 0 and head["residual_bytes"] > 0
    assert middle["sequential_bytes"] > 0 and middle["residual_bytes"] == 0
    assert last["sequential_bytes"] == last["residual_bytes"] == 0
    assert stats["residual_bytes"] == head["residual_bytes"] and not stats["fp16_wire"]
    assert all(s["compute_s"] > 0 for s in stats["stages"])


async def test_float16_on_the_wire_halves_the_activation_bytes_and_says_so(toy, ring):
    _, manifest, directory = toy
    request = {"op": "chat", "prompt_ids": PROMPT, "max_tokens": 5}
    client = Client()
    await asyncio.wait_for(ring[0].chat.op_chat(request, client.send), 20)
    full = client.events[-1]["stats"]
    async with running_ring(manifest, directory, Limits(send_timeout_s=5.0),
                            fp16_wire=True) as halves:
        client = Client()
        await asyncio.wait_for(halves[0].chat.op_chat(request, client.send), 20)
    half = client.events[-1]["stats"]
    assert half["fp16_wire"] and not full["fp16_wire"]
    assert half["sequential_bytes"] * 2 == full["sequential_bytes"]
    assert half["residual_bytes"] * 2 == full["residual_bytes"]


async def test_a_forwarded_chat_whose_client_leaves_ends_on_every_peer(ring):
    client = Client(leave_after=2)
    request = {"op": "chat", "prompt_ids": PROMPT, "max_tokens": 60}
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(ring[1].chat.op_chat(request, client.send), 20)
    await eventually(lambda: not ring[0].chat._forwarded, "the head ended the answer")
    await eventually(
        lambda: all(p.plane.worker.executor.sequence_count == 0 for p in ring), "K/V freed"
    )


async def test_a_chat_forwarded_before_the_head_knows_it_is_the_head_waits_for_it(toy, ring):
    head, _, asker = ring
    role, head.chat.head, head.chat.head_peer = head.chat.head, None, None
    client = Client()
    request = {"op": "chat", "prompt_ids": PROMPT, "max_tokens": 9}
    asked = asyncio.ensure_future(asker.chat.op_chat(request, client.send))
    await eventually(lambda: head.chat._forwarded, "the chat reached the head-to-be")
    assert not client.events
    head.chat.head = role
    head.chat.set_head_peer("a")
    await asyncio.wait_for(asked, 20)
    assert client.events[-1]["token_ids"] == reference(toy[0], PROMPT, 9)


HEAD_ON_C = [("c", 0, 0), ("a", 1, 1), ("b", 2, 2)]  # plan 1.2: c is its head
ASKED = {"op": "chat", "prompt_ids": PROMPT, "max_tokens": 40}


def _plan_with_the_head_on_c(ring, manifest, directory) -> None:
    """Plan 1.2 loaded on every peer of the ring, serving on c."""
    for peer, (_, first, last) in zip(ring, sorted(HEAD_ON_C), strict=True):
        executor = StageExecutor(manifest, directory, first, last, shelf=peer.shelf)
        peer.add_plane("1.2", manifest, HEAD_ON_C, executor)
    a, _, c = ring
    c.answers.use(c.planes["1.2"])
    c.chat.head = dataclasses.replace(a.chat.head, answers=c.answers)


async def _the_head_moves_to_c(ring, told: list) -> None:
    """What `Serving._serve` does on the peers in `told` when plan 1.2 goes live, with the
    old head "a" among them; the old plane retires on every peer."""
    a = ring[0]
    a.chat.head = None
    a.answers.use(None, moved_to="c")
    for peer in told:
        peer.chat.set_head_peer("c")
    for peer in ring:
        await peer.retire("1.1")


async def test_an_answer_asked_at_the_head_goes_on_at_the_next_head(toy, ring):
    model, manifest, directory = toy
    expected = reference(model, PROMPT, 40)
    _plan_with_the_head_on_c(ring, manifest, directory)
    client = Client()

    async def send(event: dict) -> None:
        await client.send(event)
        if len(client.events) == 3:
            await _the_head_moves_to_c(ring, ring)

    await asyncio.wait_for(ring[0].chat.op_chat(ASKED, send), 20)
    *tokens, done = client.events
    assert [e.get("token") for e in tokens] == expected
    assert done["event"] == "done" and done["token_ids"] == expected
    assert ring[2].planes["1.2"].worker.counters.steps > 0, "c answered the rest"


async def test_a_relayed_answer_goes_on_at_the_next_head_when_the_old_head_learns_first(
    toy, ring,
):
    """The old head "a" is told of plan 1.2 first, and b, where the client asked, only once
    it has relayed every event "a" sent: "a" must send no error, b resumes on c."""
    model, manifest, directory = toy
    a, b, _ = ring
    expected = reference(model, PROMPT, 40)
    _plan_with_the_head_on_c(ring, manifest, directory)
    client = Client()
    sent_by_a = []
    deliver = a.transport.deliver

    async def counted(peer, msg, timeout):
        if isinstance(msg, ChatEvent):
            sent_by_a.append(msg.event)
        await deliver(peer, msg, timeout)

    a.transport.deliver = counted
    learned = []

    async def b_learns_last() -> None:
        await eventually(lambda: not a.chat._forwarded, "a's answer ended", 20)
        await eventually(lambda: asked.done() or len(client.events) == len(sent_by_a),
                         "b relayed every event a sent", 20)
        b.chat.set_head_peer("c")

    async def send(event: dict) -> None:
        await client.send(event)
        if len(client.events) == 3:
            await _the_head_moves_to_c(ring, [a, ring[2]])
            learned.append(asyncio.ensure_future(b_learns_last()))

    asked = asyncio.ensure_future(b.chat.op_chat(ASKED, send))
    await asyncio.wait_for(asked, 30)
    await learned[0]
    *tokens, done = client.events
    assert [e.get("token") for e in tokens] == expected
    assert done["event"] == "done" and done["token_ids"] == expected
    assert 3 <= len(sent_by_a) < 40 and all(e["event"] == "token" for e in sent_by_a)


@pytest.mark.parametrize("asked_on", [0, 2], ids=["head", "forwarded"])
async def test_an_answer_its_resume_ids_already_end_gets_only_its_done_event(toy, ring,
                                                                            asked_on):
    """A head that died between an answer's last token and its done event: the next head
    is asked to resume with every token, and computes none."""
    ended = reference(toy[0], PROMPT, 5)
    client = Client()
    request = {"prompt_ids": PROMPT, "max_tokens": 5, "resume_ids": ended}
    await asyncio.wait_for(ring[asked_on].chat.op_chat(request, client.send), 20)
    [done] = client.events
    assert done["token_ids"] == ended and done["finish_reason"] == "length"
    assert done["stats"]["generated_tokens"] == 0
    assert ring[0].plane.worker.counters.steps == 0


async def test_errors_on_the_head_reach_a_forwarding_client_as_error_events(ring):
    client = Client()
    request = {"op": "chat", "prompt_ids": PROMPT, "max_tokens": 100}  # 3 + 100 > 64 positions
    await asyncio.wait_for(ring[2].chat.op_chat(request, client.send), 20)
    assert client.events == [
        {"ok": False, "error": "3 prompt tokens + 100 new tokens exceed the model's 64 positions",
         "kind": "prompt_too_long"}
    ]


@pytest.mark.parametrize("asked_on", [0, 2], ids=["head", "forwarded"])
async def test_without_max_tokens_an_answer_runs_to_the_context_limit(toy, ring, asked_on):
    positions = ring[0].chat.head.max_positions
    client = Client()
    await asyncio.wait_for(ring[asked_on].chat.op_chat({"prompt_ids": PROMPT}, client.send), 20)
    done = client.events[-1]
    assert done["token_ids"] == reference(toy[0], PROMPT, positions - len(PROMPT))
    assert done["finish_reason"] == "length"


async def test_the_plans_kv_reserve_is_the_context_limit_when_smaller(toy, ring):
    head = ring[0]
    head.answers.use(head.plane, kv_tokens=20)
    client = Client()
    await asyncio.wait_for(head.chat.op_chat({"prompt_ids": PROMPT}, client.send), 20)
    assert client.events[-1]["token_ids"] == reference(toy[0], PROMPT, 20 - len(PROMPT))
    with pytest.raises(PeerdError, match="20 prompt tokens leave no room in the context of 20"):
        await head.chat.op_chat({"prompt_ids": [1] * 20}, Client().send)


async def test_an_answer_that_ends_with_an_end_of_sequence_token_says_so(toy, ring):
    expected = reference(toy[0], PROMPT, 5)
    head = ring[0].chat
    head.head = dataclasses.replace(head.head, stop_ids=frozenset({expected[0]}))
    for request in ({"prompt_ids": PROMPT}, {"prompt_ids": PROMPT, "max_tokens": 5}):
        client = Client()
        await asyncio.wait_for(head.op_chat(request, client.send), 20)
        done = client.events[-1]
        assert done["token_ids"] == expected[:1] and done["finish_reason"] == "stop"


async def test_text_prompts_need_a_tokenizer(ring):
    with pytest.raises(PeerdError, match="no tokenizer"):
        await ring[0].chat.op_chat({"messages": [{"role": "user", "content": "hi"}]}, Client().send)


@pytest.mark.parametrize(
    "request_, reason",
    [
        ({}, "exactly one of"),
        ({"prompt_ids": [1], "messages": []}, "exactly one of"),
        ({"prompt_ids": []}, "non-empty list of integers"),
        ({"prompt_ids": ["1"]}, "non-empty list of integers"),
        ({"messages": [{"role": "user"}]}, '"role", "content"'),
        ({"prompt_ids": [1], "max_tokens": 0}, "max_tokens"),
        ({"prompt_ids": [1], "max_tokens": True}, "max_tokens"),
        ({"prompt_ids": [1], "top_p": 2}, "top-p"),
        ({"prompt_ids": [1], "temperature": "hot"}, "sampling"),
        ({"prompt_ids": [1], "max_tokens": 2, "resume_ids": [1, 2, 3]}, "resume_ids"),
    ],
)
def test_malformed_chat_requests_are_refused_with_the_reason(request_, reason):
    with pytest.raises(PeerdError, match=reason):
        parse_chat(request_)


def test_text_is_streamed_in_whole_characters_and_an_answer_cut_inside_one_ends_before_it(
    hf_checkpoint,
):
    tokenizer = Tokenizer.from_dir(hf_checkpoint("llama"))
    ids = tokenizer.encode("a猫", add_special_tokens=False)
    cut = ids[:-1]  # the last byte of 猫 is missing
    assert len(ids) >= 3 and tokenizer.decode(cut).endswith("\ufffd")
    stream = TextStream(tokenizer)
    pieces = [stream.add(token) for token in cut]
    assert "".join(pieces) == stream.text == "a"


async def test_a_rebalanced_stage_shares_the_units_it_keeps_and_frees_the_old_stage(toy):
    """Peer "a" goes from units 1-2 to unit 2 alone: while both planes serve, unit 2 runs in
    one session counted once; once the old plane retires, its executor and unit 1 are gone."""
    _, manifest, directory = toy
    shelf = SessionShelf()
    transport = Transport(KeyPair.generate(), ClusterSecret(b"s" * 32), lambda _: None,
                          "127.0.0.1")
    transport.start()
    serving = Serving("a", transport, None)
    weights = [u.weight_bytes for u in manifest.units]
    try:
        old_plan = _plan(manifest, 1, (PlanStage("m", 0, 0), PlanStage("a", 1, 2)))
        old = StageExecutor(manifest, directory, 1, 2, shelf=shelf)
        serving.on_plan(StageLoaded(old_plan, LoadedStage(manifest, 1, 2, old)))
        new_plan = _plan(manifest, 2, (PlanStage("m", 0, 1), PlanStage("a", 2, 2)))
        new = StageExecutor(manifest, directory, 2, 2, shelf=shelf)
        serving.on_plan(StageLoaded(new_plan, LoadedStage(manifest, 2, 2, new)))
        assert new.session(2) is old.session(2)
        assert serving.memory_bytes(new) == weights[1] + weights[2]
        gone, lost = weakref.ref(old), weakref.ref(old.session(1))
        del old

        serving.on_plan(PlanLive(new_plan, LoadedStage(manifest, 2, 2, new),
                                 frozenset({"m", "a"})))
        await eventually(lambda: list(serving.planes) == [new_plan.key], "the old plane retired")

        assert gone() is None and lost() is None, "the old stage and the unit it lost are freed"
        assert serving.memory_bytes(new) == weights[2]
    finally:
        await serving.close()
        await transport.close()


def _plan(manifest, plan_id: int, stages: tuple[PlanStage, ...]) -> PlanAssignment:
    return PlanAssignment(1, plan_id, stages, "toy", "m", manifest.to_dict(), "throughput",
                          "milp", PlanFigures(0.1, 10.0, 0.1), None)
