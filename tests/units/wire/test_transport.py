"""The encrypted transport on loopback: requests, ZAP admission, malformed input, channels."""

import asyncio
import dataclasses

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from waiting import answered, eventually
from zmq.utils.monitor import parse_monitor_message

from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret, KeyPair
from peerd.wire.transport import Endpoint, Transport, TransportError

SECRET = ClusterSecret(b"s" * 32)
HOST = "127.0.0.1"


class Node:
    """A transport that answers pings and bandwidth probes (and link probes with a pong) and
    remembers what it got."""

    def __init__(self, secret: ClusterSecret = SECRET):
        self.keys = KeyPair.generate()
        self.received = []
        self.transport = Transport(self.keys, secret, self.handle, HOST)
        self.ports = self.transport.start()

    def handle(self, incoming) -> None:
        self.received.append(incoming)
        msg = incoming.msg
        if isinstance(msg, protocol.Ping):
            incoming.reply(protocol.Pong(msg.req))
        elif isinstance(msg, protocol.BandwidthProbe):
            incoming.reply(protocol.BandwidthAck(msg.req, msg.tensors["payload"].nbytes))
        elif isinstance(msg, protocol.Hello):
            incoming.reply(protocol.Hello(record={"answer": "yes"}))
        elif isinstance(msg, protocol.ProbeRequest):  # a kind that does not answer it
            incoming.reply(protocol.Pong(msg.req))
        elif isinstance(msg, protocol.Goodbye):
            raise RuntimeError("a handler bug")

    def endpoint(self) -> Endpoint:
        return Endpoint(HOST, self.ports.control, self.ports.data, self.keys.public)


@pytest.fixture
async def pair():
    a, b = Node(), Node()
    a.transport.admit(b.keys.public)
    b.transport.admit(a.keys.public)
    a.transport.connect("b", b.endpoint())
    b.transport.connect("a", a.endpoint())
    yield a, b
    await a.transport.close()
    await b.transport.close()


async def test_requests_are_answered_and_senders_identified_by_their_key(pair):
    a, b = pair
    answer = await answered(a.transport, "b")
    assert isinstance(answer, protocol.Pong)
    ping = next(i for i in b.received if isinstance(i.msg, protocol.Ping))
    assert ping.sender_key == a.keys.public
    assert ping.peer_address == HOST
    assert ping.channel == protocol.CONTROL


async def test_a_key_that_is_not_admitted_cannot_finish_the_handshake(pair):
    a, b = pair
    outsider = Node()
    try:
        outsider.transport.admit(b.keys.public)
        outsider.transport.connect("b", b.endpoint())
        await eventually(lambda: b.transport.zap.denied >= 1, "a ZAP refusal")
        with pytest.raises(TransportError):
            await outsider.transport.request("b", protocol.Ping(req=0), 0.5)
        assert not any(i.sender_key == outsider.keys.public for i in b.received)
    finally:
        await outsider.transport.close()


async def test_a_peer_refused_before_it_was_admitted_gets_through_once_it_is():
    a, b = Node(), Node()
    try:
        a.transport.admit(b.keys.public)
        a.transport.connect("b", b.endpoint())
        await eventually(lambda: b.transport.zap.denied >= 1, "a refusal")
        b.transport.admit(a.keys.public)  # b learns of a only now
        assert isinstance(await answered(a.transport, "b"), protocol.Pong)
    finally:
        await a.transport.close()
        await b.transport.close()


async def test_hello_needs_the_cluster_secret(pair):
    a, b = pair
    answer = await a.transport.hello(HOST, b.ports.hello, protocol.Hello(record={}), 3.0)
    assert answer == protocol.Hello(record={"answer": "yes"})
    stranger = Node(ClusterSecret(b"t" * 32))
    try:
        with pytest.raises(TransportError, match="no valid hello"):
            await stranger.transport.hello(HOST, b.ports.hello, protocol.Hello(record={}), 1.0)
        assert sum(isinstance(i.msg, protocol.Hello) for i in b.received) == 1
    finally:
        await stranger.transport.close()


def _member_dealer(member: Node, target: Node, port: int) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_publickey = member.keys.public.encode()
    sock.curve_secretkey = member.keys.secret.encode()
    sock.curve_serverkey = target.keys.public.encode()
    sock.connect(f"tcp://{HOST}:{port}")
    return sock


JUNK = [
    [b"\xc1 not msgpack"],
    [msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "ping", "req": "one"})],
    [msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "nope"})],
    [msgpack.packb({"v": protocol.PROTOCOL_VERSION + 1, "kind": "ping", "req": 1})],
    protocol.encode(protocol.BandwidthProbe(req=1, tensors={"payload": np.zeros(8, np.uint8)})),
]


async def test_malformed_and_misrouted_messages_are_dropped_and_counted(pair):
    a, b = pair
    await answered(a.transport, "b")
    sock = _member_dealer(a, b, b.ports.control)
    try:
        for frames in JUNK:  # the last is well-formed but belongs on the data channel
            await sock.send_multipart(frames)
        await eventually(lambda: b.transport.malformed == len(JUNK), "every drop counted")
        assert isinstance(await answered(a.transport, "b"), protocol.Pong)
    finally:
        sock.close()


async def test_a_frame_over_the_channel_limit_drops_only_that_connection(pair):
    a, b = pair
    await answered(a.transport, "b")
    sock = _member_dealer(a, b, b.ports.control)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        await sock.send_multipart([bytes(protocol.MAX_HEADER_BYTES + 1)])
        events = [
            parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 5))["event"]
            for _ in range(2)
        ]
        assert events == [zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED]
        # The dealer reconnects; the same socket is served again.
        await sock.send_multipart(protocol.encode(protocol.Ping(req=99)))
        assert protocol.decode(await asyncio.wait_for(sock.recv_multipart(), 5)).req == 99
        assert b.transport.malformed == 0
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


async def test_a_failing_handler_does_not_stop_the_receive_loop(pair):
    a, b = pair
    await answered(a.transport, "b")
    assert a.transport.send("b", protocol.Goodbye(instance="x"))
    await eventually(lambda: any(isinstance(i.msg, protocol.Goodbye) for i in b.received),
                     "the goodbye")
    assert isinstance(await answered(a.transport, "b"), protocol.Pong)


async def test_control_messages_overtake_a_bulk_transfer(pair):
    a, b = pair
    await answered(a.transport, "b")
    small = protocol.BandwidthProbe(req=0, tensors={"payload": np.zeros(1, np.uint8)})
    await answered(a.transport, "b", msg=small)  # the data channel is connected too
    bulk_probe = protocol.BandwidthProbe(
        req=0, tensors={"payload": np.zeros(protocol.MAX_PROBE_BYTES, np.uint8)}
    )
    bulk = asyncio.create_task(a.transport.request("b", bulk_probe, 60.0))
    await asyncio.sleep(0)  # the bulk message is queued first
    pong = await a.transport.request("b", protocol.Ping(req=0), 10.0)
    assert isinstance(pong, protocol.Pong)
    assert not bulk.done(), "the ping should not have waited for the bulk transfer"
    ack = await bulk
    assert ack.received == protocol.MAX_PROBE_BYTES


async def test_requests_to_unknown_or_silent_peers_fail_cleanly(pair):
    a, b = pair
    with pytest.raises(TransportError, match="not reachable"):
        await a.transport.request("nobody", protocol.Ping(req=0), 0.5)
    await answered(a.transport, "b")
    with pytest.raises(TransportError, match="did not answer"):
        await a.transport.request("b", protocol.MeasureRequest(req=0, epoch=1), 0.3)


async def test_an_answer_of_the_wrong_kind_is_an_error(pair):
    a, b = pair
    await answered(a.transport, "b")
    probe = protocol.ProbeRequest(req=0, epoch=1, targets=("a",), payload_bytes=1)
    with pytest.raises(TransportError, match="^b answered probe with pong$"):
        await a.transport.request("b", probe, 5.0)


def test_every_request_names_registered_answers_that_carry_its_number():
    requests = [c for c in protocol.kinds().values() if issubclass(c, protocol.Asks)]
    assert len(requests) == 13
    for request in requests:
        answers = protocol.answer_kinds(request)
        assert answers and all(protocol.kinds()[a.KIND] is a for a in answers), request
        assert all("req" in {f.name for f in dataclasses.fields(a)} for a in answers), request
    assert protocol.answer_kinds(protocol.UnitChunkRequest) == (
        protocol.UnitChunk, protocol.UnitRefused)
