"""Finding members: mDNS (python-zeroconf, asyncio API) and static peers (authenticated hello).

mDNS: each daemon advertises ``_peerd._tcp.local.`` under a name unique to its run, with its
signed record (peerd/cluster/records.py) as the TXT record, and browses for the others. A service
whose record does not verify (another cluster, a forgery, another protocol version) is
ignored and counted. A goodbye (service removed) is reported as a departure; silence is the
failure detector's job (peerd/cluster/membership.py).

Static peers (``--peer HOST:PORT``, for networks that block multicast): the daemon sends its
signed record to HOST's hello socket (PORT is that daemon's ``--port``) and verifies the
record in the answer, retrying until it gets one and repeating now and then to notice
restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable

import psutil
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from peerd.cluster.records import PeerRecord, RecordError, verify
from peerd.errors import PeerdError
from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret
from peerd.wire.transport import Transport, TransportError

log = logging.getLogger("peerd.cluster.discovery")

SERVICE_TYPE = "_peerd._tcp.local."
RESOLVE_TIMEOUT_MS = 3000
HELLO_TIMEOUT_S = 2.0
HELLO_RETRY_S = 1.0
HELLO_REFRESH_S = 5.0

OnRecord = Callable[[PeerRecord, str], None]
OnDeparture = Callable[[str, str], None]


def advertised_addresses(interface: str | None) -> list[str]:
    """The chosen interface; otherwise every non-loopback IPv4 address (loopback only on a
    machine that has nothing else)."""
    if interface:
        return [interface]
    ipv4 = [
        address.address
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
        if address.family == socket.AF_INET
    ]
    lan = [a for a in ipv4 if not ipaddress.ip_address(a).is_loopback]
    return lan or ["127.0.0.1"]


def service_name(record: PeerRecord) -> str:
    return f"peerd-{record.id}-{record.instance}.{SERVICE_TYPE}"


class MdnsDiscovery:
    def __init__(
        self,
        record: PeerRecord,
        secret: ClusterSecret,
        interface: str | None,
        on_record: OnRecord,
        on_departure: OnDeparture,
    ):
        self._record = record
        self._secret = secret
        self._interface = interface
        self._on_record = on_record
        self._on_departure = on_departure
        self._own_name = service_name(record)
        self._members: dict[str, tuple[str, str]] = {}  # service name -> (id, instance)
        self._rejected: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._zeroconf: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None

    @property
    def ignored(self) -> int:
        """Services seen whose record did not verify."""
        return len(self._rejected)

    async def start(self) -> None:
        addresses = advertised_addresses(self._interface)
        interfaces = [self._interface] if self._interface else InterfaceChoice.All
        try:
            self._zeroconf = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        except OSError as exc:
            raise PeerdError(f"cannot start mDNS on {self._interface or 'all'}: {exc}") from None
        info = AsyncServiceInfo(
            SERVICE_TYPE,
            self._own_name,
            addresses=[socket.inet_aton(a) for a in addresses],
            port=self._record.control_port,
            properties=self._record.signed(self._secret),
            server=f"peerd-{self._record.id}-{self._record.instance}.local.",
        )
        await self._zeroconf.async_register_service(info)
        self._browser = AsyncServiceBrowser(
            self._zeroconf.zeroconf, [SERVICE_TYPE], handlers=[self._changed]
        )
        log.info("advertising %s on %s", SERVICE_TYPE, ", ".join(addresses))

    def _changed(
        self, zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if name == self._own_name:
            return
        if state_change is ServiceStateChange.Removed:
            member = self._members.pop(name, None)
            if member is not None:
                self._on_departure(*member)
            return
        task = asyncio.create_task(self._resolve(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        assert self._zeroconf is not None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._zeroconf.zeroconf, RESOLVE_TIMEOUT_MS):
            return
        try:
            record = verify(info.properties, self._secret)
        except RecordError as exc:
            if name not in self._rejected:
                self._rejected.add(name)
                log.warning("ignoring mDNS service %s: %s", name, exc)
            return
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not addresses:
            return
        lan = [a for a in addresses if not ipaddress.ip_address(a).is_loopback]
        self._members[name] = (record.id, record.instance)
        self._on_record(record, (lan or addresses)[0])

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zeroconf is not None:
            with contextlib.suppress(Exception):  # goodbyes are best effort at shutdown
                await self._zeroconf.async_unregister_all_services()
            await self._zeroconf.async_close()


def parse_peer(text: str) -> tuple[str, int]:
    """HOST:PORT (``[v6]:PORT`` for IPv6) from --peer."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PeerdError(f"--peer {text!r} is not HOST:PORT")
    return host, int(port)


class StaticPeers:
    """Hellos to --peer addresses: our signed record out, theirs back and verified."""

    def __init__(
        self,
        peers: list[tuple[str, int]],
        record: PeerRecord,
        secret: ClusterSecret,
        transport: Transport,
        on_record: OnRecord,
    ):
        self._peers = peers
        self._hello = protocol.Hello(record=record.signed(secret))
        self._secret = secret
        self._transport = transport
        self._on_record = on_record

    async def run(self) -> None:
        await asyncio.gather(*(self._keep_in_touch(host, port) for host, port in self._peers))

    async def _keep_in_touch(self, host: str, port: int) -> None:
        while True:
            answered = await self.introduce(host, port)
            await asyncio.sleep(HELLO_REFRESH_S if answered else HELLO_RETRY_S)

    async def introduce(self, host: str, port: int) -> bool:
        """One hello; True if the answer carried a record that verifies."""
        try:
            answer = await self._transport.hello(host, port, self._hello, HELLO_TIMEOUT_S)
            record = verify(answer.record, self._secret)
        except (TransportError, RecordError) as exc:
            log.info("static peer %s:%d: %s", host, port, exc)
            return False
        self._on_record(record, host)
        return True
