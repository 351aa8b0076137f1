"""The daemon side of a group stage without daemons: a lead and a member on real CURVE
transports over loopback, each running its share's schedule on its own thread, their
ShareData going peer to peer. They give exactly what the same shares give in one process,
a member that goes away fails the lead's step as a lost peer (a TransportError), and a
share whose data cannot be sent fails its step at its next wait."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from ring import HOST, SECRET
from sharding import sharded, share_units
from waiting import answered, eventually

from peerd.inference.groups import GroupLead, GroupLost, GroupMember
from peerd.inference.pipeline import Generation
from peerd.inference.shares import ShareRunner, ShareStage
from peerd.wire import protocol
from peerd.wire.identity import KeyPair
from peerd.wire.transport import Endpoint, Transport

pytestmark = pytest.mark.slow  # exports share units

PLAN = "1.1"
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]
STEPS = 4


class _Peer:
    def __init__(self, peer_id: str) -> None:
        self.id = peer_id
        self.keys = KeyPair.generate()
        self.transport = Transport(self.keys, SECRET, self._handle, HOST)
        self.ports = self.transport.start()
        self.names: dict[str, str] = {}
        self.group: GroupLead | GroupMember | None = None

    def _handle(self, incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, protocol.Ping):
            incoming.reply(protocol.Pong(msg.req))
        elif isinstance(msg, protocol.SequenceStatsRequest):  # the data channel is up
            incoming.reply(protocol.SequenceStats(msg.req, 0, 0.0, 0.0, 0, 0, False))
        elif self.group is not None:
            self.group.handle(self.names[incoming.sender_key], msg)

    def endpoint(self) -> Endpoint:
        return Endpoint(HOST, self.ports.control, self.ports.data, self.keys.public)


@contextlib.asynccontextmanager
async def _linked(*peers: _Peer):
    for peer in peers:
        for other in peers:
            if other is not peer:
                peer.transport.admit(other.keys.public)
                peer.transport.connect(other.id, other.endpoint())
                peer.names[other.keys.public] = other.id
    ready = protocol.SequenceStatsRequest(0, "ready")
    await asyncio.gather(*(answered(p.transport, o.id, msg=m) for p in peers for o in peers
                           if o is not p for m in (None, ready)))
    try:
        yield
    finally:
        for peer in peers:
            if peer.group is not None:
                peer.group.close()
            await peer.transport.close()


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    model_dir = hf_checkpoint("llama", heads=4, kv_heads=2)
    result = sharded(model_dir)
    return result, share_units(model_dir, (1.0, 1.0))


def _runner(llama, index: int) -> ShareRunner:
    result, units = llama
    last = len(result.manifest.units) - 1
    return ShareRunner(result.manifest, result.directory, 0, last, units, index, plan=PLAN)


def _steps(stage, count: int) -> list[np.ndarray]:
    """Greedy logits of `count` steps of the prompt through `stage` (a step_many runner)."""
    generation = Generation("s", PROMPT, count, frozenset())
    logits = []
    for _ in range(count):
        step = generation.next_step()
        (outputs,) = stage.step_many([(step.seq_id, step.inputs)])
        assert not isinstance(outputs, Exception), outputs
        logits.append(next(iter(outputs.values())))
        generation.record(step.step, int(np.argmax(logits[-1][0, -1])))
    return logits


async def test_a_lead_and_a_member_give_what_shares_in_one_process_give(llama):
    result, units = llama
    last = len(result.manifest.units) - 1
    expected = _steps(ShareStage(result.manifest, result.directory, 0, last, units), STEPS)
    lead, member = _Peer("a"), _Peer("b")
    async with _linked(lead, member):
        group = lead.group = GroupLead(_runner(llama, 0), ("a", "b"), lead.transport, PLAN)
        member.group = GroupMember(_runner(llama, 1), ("a", "b"), member.transport, PLAN)
        got = await asyncio.to_thread(_steps, group, STEPS)
        for mine, theirs in zip(got, expected, strict=True):
            np.testing.assert_array_equal(mine, theirs)
        assert member.group.sequence_count == 1  # its heads' K/V stays with it
        group.drop("s")
        await eventually(lambda: member.group is not None and member.group.sequence_count == 0,
                         "the member to drop the sequence")


async def test_a_member_gone_fails_the_step_as_a_lost_peer(llama):
    lead, member = _Peer("a"), _Peer("b")
    async with _linked(lead, member):
        group = lead.group = GroupLead(_runner(llama, 0), ("a", "b"), lead.transport, PLAN,
                                       timeout_s=1.0)
        step = Generation("s", PROMPT, 1, frozenset()).next_step()
        (outcome,) = await asyncio.to_thread(group.step_many, [(step.seq_id, step.inputs)])
        assert isinstance(outcome, GroupLost)
        assert "sent no gather" in str(outcome)


async def test_a_share_whose_data_cannot_be_sent_fails_its_step_without_waiting_it_out(
    llama, caplog
):
    lead, member = _Peer("a"), _Peer("b")
    async with _linked(lead, member):
        group = lead.group = GroupLead(_runner(llama, 0), ("a", "b"), lead.transport, PLAN,
                                       timeout_s=1.0)
        member.group = GroupMember(_runner(llama, 1), ("a", "b"), member.transport, PLAN,
                                   timeout_s=600.0)
        member.transport.disconnect("a")  # the lead's steps still come; its data cannot go
        step = Generation("s", PROMPT, 1, frozenset()).next_step()
        (outcome,) = await asyncio.to_thread(group.step_many, [(step.seq_id, step.inputs)])
        assert isinstance(outcome, GroupLost)
        await eventually(lambda: "share's data was not sent: a is not reachable" in caplog.text,
                         "the member's step to fail well before its 600 s wait", timeout=60.0)
