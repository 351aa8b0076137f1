"""Three peers on real CURVE transports over loopback, each running one stage of the toy
units (tests/toy_units.py) with DataPlanes and a ChatService, like daemons in a plan."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
from toy_units import ToyModel
from waiting import answered

from peerd.inference.answers import Answers
from peerd.inference.dataplane import DataPlane, Limits
from peerd.inference.serving import ChatService, Head, plane_of
from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret, KeyPair
from peerd.wire.transport import Endpoint, Transport
from shards.early_exit import ExitSettings, stage_exit
from shards.executor import SessionShelf, StageExecutor

SECRET = ClusterSecret(b"d" * 32)
HOST = "127.0.0.1"
STAGES = [("a", 0, 0), ("b", 1, 1), ("c", 2, 2)]
CHAT_MESSAGES = (protocol.ChatRequest, protocol.ChatEvent, protocol.ChatCancel)


class Peer:
    def __init__(self, peer_id: str, limits: Limits, fp16_wire: bool = False):
        self.id = peer_id
        self.keys = KeyPair.generate()
        self.transport = Transport(self.keys, SECRET, self._handle, HOST)
        self.ports = self.transport.start()
        self.limits = limits
        self.fp16_wire = fp16_wire
        self.planes: dict[str, DataPlane] = {}
        self.executor: StageExecutor | None = None
        self.shelf = SessionShelf()  # its executors share their units' sessions, as a daemon's
        self.answers = Answers(limits)
        self.chat = ChatService(self.transport)
        self.names: dict[str, str] = {}

    @property
    def plane(self) -> DataPlane:
        return next(reversed(self.planes.values()))

    def _handle(self, incoming) -> None:
        msg, sender = incoming.msg, self.names[incoming.sender_key]
        if isinstance(msg, protocol.Ping):
            incoming.reply(protocol.Pong(msg.req))
        elif isinstance(msg, CHAT_MESSAGES):
            self.chat.handle(sender, msg)
        elif (plane := plane_of(self.planes, msg)) is not None:
            plane.handle(sender, msg, incoming.reply)

    def endpoint(self) -> Endpoint:
        return Endpoint(HOST, self.ports.control, self.ports.data, self.keys.public)

    def add_plane(self, plan: str, manifest, stages=STAGES, executor=None,
                  exits: ExitSettings | None = None) -> DataPlane:
        plane = DataPlane(self.id, self.transport, stages, manifest, executor or self.executor,
                          self.fp16_wire, self.limits, plan, self.planes, exits=exits)
        self.planes[plan] = plane
        return plane

    async def retire(self, plan: str) -> None:
        await self.planes.pop(plan).close()


@contextlib.asynccontextmanager
async def running_ring(manifest, unit_dir, limits: Limits, max_positions: int = 64,
                       fp16_wire: bool = False, stages=STAGES,
                       exits: ExitSettings | None = None, standalone: bool = False):
    """The peers of `stages` (peer, first unit, last unit); with `exits`, the head's stage
    exits early (and with `standalone`, its answers go on from the exit without a plane)."""
    peers = [Peer(peer_id, limits, fp16_wire) for peer_id, _, _ in stages]
    peers[0].answers.standalone = standalone
    link(peers)
    for peer, (_, first, last) in zip(peers, stages, strict=True):
        load(peer, manifest, unit_dir, first, last, exits)
        peer.add_plane("1.1", manifest, stages, exits=exits)
        peer.chat.head_peer = "a"
    peers[0].answers.use(peers[0].plane)
    peers[0].chat.head = Head(peers[0].answers, None, frozenset(), max_positions,
                              manifest.model.vocab_size)
    await reachable(peers)
    try:
        yield peers
    finally:
        for peer in peers:
            await peer.chat.close()
            for plan in list(peer.planes):
                await peer.retire(plan)
            await peer.transport.close()


def link(peers: list[Peer]) -> None:
    """Make the peers known to each other."""
    for peer in peers:
        for other in peers:
            if other is not peer:
                peer.transport.admit(other.keys.public)
                peer.transport.connect(other.id, other.endpoint())
                peer.names[other.keys.public] = other.id


async def reachable(peers: list[Peer]) -> None:
    """Wait until each peer reaches every other on both channels, its plane answering: a
    data socket whose handshake was refused (its peer had not admitted the key yet) is
    replaced after a delay, and until then a plane cannot send there."""
    data_ready = protocol.SequenceStatsRequest(0, "ready")
    await asyncio.gather(
        *(answered(p.transport, o.id, msg=msg) for p in peers for o in peers if o is not p
          for msg in (None, data_ready))
    )


def load(peer: Peer, manifest, unit_dir, first: int, last: int,
         exits: ExitSettings | None = None) -> None:
    """The peer's executor of units first..last, with the exit where `exits` want one and
    it holds the first stage."""
    point = stage_exit(manifest, last, exits.layer) if exits is not None and first == 0 else None
    peer.executor = StageExecutor(manifest, unit_dir, first, last, shelf=peer.shelf, exit=point)


def reference(model: ToyModel, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    return ids[len(prompt):]
