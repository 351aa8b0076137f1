"""Encrypted ZeroMQ messaging between members.

Every daemon binds three ROUTER sockets, all CURVE servers, one per channel:

  hello    (--port N)      static peers introduce themselves. Its server key pair is derived
                           from the cluster secret and the ZAP handler admits only the client
                           key also derived from it, so only members can even connect.
  control  (N + 1)         heartbeats, election, measurement requests: small messages.
  data     (N + 2)         bulk: bandwidth probes, tensors (and later unit transfers).

For each member it opens one DEALER per channel (CURVE clients, server key = the member's
public key); the member's ZAP handler admits only keys of members. Control and data use
separate sockets, TCP connections, queues and libzmq I/O threads, so a heartbeat or a vote
never waits behind a bulk transfer.

A request is a message with a ``req`` field; the answer comes back over the same connection
(ROUTER to DEALER) with the same ``req``, of a kind that answers it (``protocol.Asks``).
Everything received is decoded by peerd.wire.protocol; a malformed message, or one on the
wrong channel, is logged, counted and dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import zmq
import zmq.asyncio

from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret, KeyPair
from peerd.wire.protocol import CONTROL, DATA, HELLO, Asks, Message, ProtocolError
from peerd.wire.zap import ZapHandler

log = logging.getLogger("peerd.wire.transport")
Answer = TypeVar("Answer")

# Largest single frame each channel's sockets accept; a bigger one drops the connection.
FRAME_LIMITS = {
    HELLO: 64 * 1024,
    CONTROL: protocol.MAX_HEADER_BYTES,
    DATA: protocol.MAX_MESSAGE_BYTES,
}
SEND_HWM = {HELLO: 16, CONTROL: 1000, DATA: 64}
# libzmq I/O thread bitmask per channel: data has its own thread.
AFFINITY = {HELLO: 1, CONTROL: 1, DATA: 2}
RECONNECT_MS, RECONNECT_MAX_MS = 100, 1000
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class TransportError(Exception):
    """A request that could not be delivered or answered in time."""


@dataclasses.dataclass(frozen=True)
class Ports:
    hello: int
    control: int
    data: int


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where a member listens, and the key its sockets prove."""

    address: str
    control_port: int
    data_port: int
    public_key: str

    def url(self, channel: str) -> str:
        port = self.control_port if channel == CONTROL else self.data_port
        return f"tcp://{_host(self.address)}:{port}"


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


@dataclasses.dataclass(frozen=True)
class Incoming:
    """A decoded message, who sent it (their authenticated key), and how to answer it."""

    channel: str
    sender_key: str
    peer_address: str
    msg: Message
    reply: Callable[[Message], None]


class _Dealer:
    """One DEALER to a member's channel. libzmq never retries a connection whose handshake
    was refused (the member had not admitted our key yet: it may learn of us a moment after
    we learn of it), so a refused socket is replaced, after a growing delay."""

    def __init__(self, transport: Transport, channel: str, endpoint: Endpoint):
        self._transport = transport
        self._channel = channel
        self._endpoint = endpoint
        self.socket: zmq.asyncio.Socket | None = None
        self._open()
        self.task = asyncio.create_task(self._keep(), name=f"dealer-{channel}")

    def _open(self) -> None:
        socket = self._transport.dealer(self._channel, self._endpoint.public_key)
        # Watch before connecting: a refusal that came before the monitor would go unseen,
        # and the socket would never be replaced (seen in CI under load).
        self._monitor = socket.get_monitor_socket(HANDSHAKE_FAILED)
        socket.connect(self._endpoint.url(self._channel))
        self.socket = socket
        self._replies = asyncio.create_task(self._transport.receive_replies(socket))

    def _shut(self, socket: zmq.asyncio.Socket) -> None:
        self._replies.cancel()
        socket.disable_monitor()
        self._monitor.close(linger=0)
        socket.close(linger=0)
        self.socket = None

    async def _keep(self) -> None:
        delay = RECONNECT_MS / 1000
        try:
            while True:
                await self._monitor.recv_multipart()
                if self.socket is not None:
                    self._shut(self.socket)
                log.info("handshake with %s refused; retrying in %.1fs",
                         self._endpoint.address, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_MS / 1000)
                self._open()
        finally:
            if self.socket is not None:
                self._shut(self.socket)


class _Link:
    """The DEALER sockets to one member, one per channel."""

    def __init__(self, transport: Transport, endpoint: Endpoint):
        self.endpoint = endpoint
        self._dealers = {c: _Dealer(transport, c, endpoint) for c in (CONTROL, DATA)}

    def socket(self, channel: str) -> zmq.asyncio.Socket | None:
        return self._dealers[channel].socket

    def close(self) -> list[asyncio.Task]:
        """Stop the sockets; the returned tasks finish once they are closed."""
        for dealer in self._dealers.values():
            dealer.task.cancel()
        return [dealer.task for dealer in self._dealers.values()]


class Transport:
    def __init__(
        self,
        keys: KeyPair,
        secret: ClusterSecret,
        on_message: Callable[[Incoming], None],
        interface: str | None = None,
        port: int = 0,
    ):
        self._keys = keys
        self._hello_server = secret.hello_server_keys()
        self._hello_client = secret.hello_client_keys()
        self._on_message = on_message
        self._interface = interface
        self._port = port
        self._context = zmq.asyncio.Context()
        self._context.io_threads = 2
        self.zap = ZapHandler(self._context)
        self._routers: dict[str, zmq.asyncio.Socket] = {}
        self._links: dict[str, _Link] = {}
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._tasks: list[asyncio.Task] = []
        self._requests = itertools.count(1)
        self.malformed = 0
        self.ports: Ports | None = None

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> Ports:
        self.zap.start()
        self.zap.allow(HELLO, self._hello_client.public)
        offsets = {HELLO: 0, CONTROL: 1, DATA: 2}
        bound = {}
        for channel in (HELLO, CONTROL, DATA):
            keys = self._hello_server if channel == HELLO else self._keys
            sock = self._router(channel, keys)
            bound[channel] = self._bind(sock, self._port + offsets[channel] if self._port else 0)
            self._routers[channel] = sock
            self._tasks.append(asyncio.create_task(self._serve(channel, sock), name=channel))
        self.ports = Ports(**bound)
        return self.ports

    async def close(self) -> None:
        closing = [task for link in self._links.values() for task in link.close()]
        self._links.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*closing, *self._tasks, return_exceptions=True)
        for future in self._pending.values():
            future.cancel()
        await self.zap.close()
        self._context.destroy(linger=0)

    def _router(self, channel: str, keys: KeyPair) -> zmq.asyncio.Socket:
        sock = self._socket(zmq.ROUTER, channel, keys)
        sock.curve_server = True
        sock.zap_domain = channel.encode()
        sock.router_mandatory = True
        return sock

    def _socket(self, kind: int, channel: str, keys: KeyPair) -> zmq.asyncio.Socket:
        sock = self._context.socket(kind)
        sock.linger = 0
        sock.affinity = AFFINITY[channel]
        sock.maxmsgsize = FRAME_LIMITS[channel]
        sock.sndhwm = SEND_HWM[channel]
        sock.curve_publickey = keys.public.encode("ascii")
        sock.curve_secretkey = keys.secret.encode("ascii")
        return sock

    def _bind(self, sock: zmq.asyncio.Socket, port: int) -> int:
        host = _host(self._interface) if self._interface else "*"
        try:
            if port:
                sock.bind(f"tcp://{host}:{port}")
                return port
            return sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot listen on {host}:{port or 'any'}: {exc}") from None

    def dealer(self, channel: str, server_key: str) -> zmq.asyncio.Socket:
        """A CURVE client socket for one member's ROUTER, to be connected by the caller."""
        keys = self._hello_client if channel == HELLO else self._keys
        sock = self._socket(zmq.DEALER, channel, keys)
        sock.curve_serverkey = server_key.encode("ascii")
        # Queue only on finished handshakes: heartbeats to a peer that is down are dropped.
        sock.immediate = channel != HELLO
        sock.reconnect_ivl = RECONNECT_MS
        sock.reconnect_ivl_max = RECONNECT_MAX_MS
        return sock

    # -- membership of the allowlist and the links -------------------------------------------

    def admit(self, public_key: str) -> None:
        for channel in (CONTROL, DATA):
            self.zap.allow(channel, public_key)

    def revoke(self, public_key: str) -> None:
        for channel in (CONTROL, DATA):
            self.zap.forbid(channel, public_key)

    def connect(self, peer_id: str, endpoint: Endpoint) -> None:
        """Open (or re-open, if the endpoint changed) the sockets to a member."""
        link = self._links.get(peer_id)
        if link is not None and link.endpoint == endpoint:
            return
        if link is not None:
            link.close()
        self._links[peer_id] = _Link(self, endpoint)

    def disconnect(self, peer_id: str) -> None:
        link = self._links.pop(peer_id, None)
        if link is not None:
            link.close()

    def connected(self) -> list[str]:
        return list(self._links)

    # -- sending ------------------------------------------------------------------------------

    def send(self, peer_id: str, msg: Message) -> bool:
        """Queue a message without waiting; False if the member is not reachable now."""
        link = self._links.get(peer_id)
        sock = link.socket(msg.CHANNEL) if link is not None else None
        return sock is not None and _send_now(sock, protocol.encode(msg))

    async def deliver(self, peer_id: str, msg: Message, timeout: float) -> None:
        """Send, waiting while the member's queue is full (data must not be dropped)."""
        link = self._links.get(peer_id)
        sock = link.socket(msg.CHANNEL) if link is not None else None
        if sock is None:
            raise TransportError(f"{peer_id} is not reachable")
        sending = _sent(sock, protocol.encode(msg))
        if sending.done():  # queued at once, as almost always: no timer, no loop iteration
            sending.result()
            return
        try:
            await asyncio.wait_for(sending, timeout)
        except TimeoutError:
            raise TransportError(f"{peer_id} took no {msg.KIND} for {timeout}s") from None

    async def request(self, peer_id: str, msg: Asks[Answer], timeout: float) -> Answer:
        """Send a request with a fresh ``req`` and wait for the answer carrying it, which
        must be of a kind that answers this request."""
        req = next(self._requests)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[req] = future
        try:
            if not self.send(peer_id, dataclasses.replace(msg, req=req)):
                raise TransportError(f"{peer_id} is not reachable")
            answer = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise TransportError(f"{peer_id} did not answer {msg.KIND} in {timeout}s") from None
        finally:
            self._pending.pop(req, None)
        if not isinstance(answer, protocol.answer_kinds(type(msg))):
            raise TransportError(f"{peer_id} answered {msg.KIND} with {answer.KIND}")
        return cast(Answer, answer)  # answer_kinds(type(msg)) are the classes Answer names

    async def hello(
        self, host: str, port: int, msg: protocol.Hello, timeout: float
    ) -> protocol.Hello:
        """Introduce ourselves to a static peer's hello socket and return its answer."""
        url = f"tcp://{_host(host)}:{port}"
        sock = self.dealer(HELLO, self._hello_server.public)
        sock.connect(url)
        try:
            await asyncio.wait_for(_sent(sock, protocol.encode(msg)), timeout)
            frames = await asyncio.wait_for(sock.recv_multipart(copy=False), timeout)
            answer = protocol.decode(frames)
        except (TimeoutError, ProtocolError) as exc:
            reason = str(exc) or "no answer in time"
            raise TransportError(f"no valid hello from {host}:{port}: {reason}") from None
        finally:
            sock.close(linger=0)
        if not isinstance(answer, protocol.Hello):
            raise TransportError(f"no valid hello from {host}:{port}: {answer.KIND} instead")
        return answer

    # -- receiving ----------------------------------------------------------------------------

    async def _serve(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            self._dispatch(channel, sock, frames)

    def _dispatch(self, channel: str, sock: zmq.asyncio.Socket, frames: list) -> None:
        if len(frames) < 2:
            self._drop(channel, "no payload")
            return
        routing_id = frames[0].bytes
        try:
            msg = protocol.decode(frames[1:])
        except ProtocolError as exc:
            self._drop(channel, str(exc))
            return
        if channel != msg.CHANNEL:
            self._drop(channel, f"{msg.KIND} does not belong on this channel")
            return
        incoming = Incoming(
            channel=channel,
            sender_key=frames[1].get("User-Id"),
            peer_address=frames[1].get("Peer-Address"),
            msg=msg,
            reply=lambda answer: self._reply(sock, routing_id, answer),
        )
        try:
            self._on_message(incoming)
        except Exception:  # a handler bug must not take the receive loop down
            log.exception("handling %s from %s failed", msg.KIND, incoming.peer_address)

    def _reply(self, sock: zmq.asyncio.Socket, routing_id: bytes, answer: Message) -> None:
        if not _send_now(sock, [routing_id, *protocol.encode(answer)]):
            log.info("could not answer with %s: the asker is gone", answer.KIND)

    async def receive_replies(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                msg = protocol.decode(frames)
            except ProtocolError as exc:
                self._drop("reply", str(exc))
                continue
            req = getattr(msg, "req", None)
            future = self._pending.get(req) if isinstance(req, int) else None
            if future is not None and not future.done():
                future.set_result(msg)

    def _drop(self, channel: str, reason: str) -> None:
        self.malformed += 1
        if _worth_logging(self.malformed):
            log.warning("dropped a malformed %s message: %s (%d so far)", channel, reason,
                        self.malformed)


def _worth_logging(count: int) -> bool:
    """The first ten of a kind of event, then every hundredth: a flood cannot fill the log."""
    return count <= 10 or count % 100 == 0


def _sent(sock: zmq.asyncio.Socket, frames: list[Any], flags: int = 0) -> asyncio.Future[Any]:
    """The send's future: pyzmq's asyncio socket returns one, which its hints call only an
    Awaitable (ensure_future hands a future back unchanged)."""
    return asyncio.ensure_future(sock.send_multipart(frames, flags=flags, copy=False))


def _send_now(sock: zmq.asyncio.Socket, frames: list[Any]) -> bool:
    future = _sent(sock, frames, zmq.NOBLOCK)
    if not future.done():  # queued behind another send: it finishes later on its own
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return True
    return future.exception() is None
