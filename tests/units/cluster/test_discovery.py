"""Signed records, mDNS discovery on loopback, and static peers introduced by hello."""

import asyncio
import dataclasses

import pytest
from waiting import eventually

from peerd.cluster.discovery import MdnsDiscovery, StaticPeers, advertised_addresses, parse_peer
from peerd.cluster.records import PeerRecord, RecordError, verify
from peerd.errors import PeerdError
from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret, KeyPair, peer_id_for
from peerd.wire.transport import Transport

SECRET = ClusterSecret(b"k" * 32)
OTHER = ClusterSecret(b"o" * 32)


def make_record(name: str = "desk", port: int = 7000) -> PeerRecord:
    keys = KeyPair.generate()
    return PeerRecord(peer_id_for(keys.public), name, name[:4] + "0001", keys.public,
                      port, port + 1, port + 2)


def test_a_signed_record_verifies_from_text_or_bytes():
    record = make_record()
    pairs = record.signed(SECRET)
    assert verify(pairs, SECRET) == record
    as_bytes = {k.encode(): v.encode() for k, v in pairs.items()}
    assert verify(as_bytes, SECRET) == record


@pytest.mark.parametrize("key", ["v", "id", "name", "inst", "pk", "hp", "cp", "dp"])
def test_changing_any_field_breaks_the_mac(key):
    pairs = make_record().signed(SECRET)
    pairs[key] = pairs[key][:-1] + ("1" if pairs[key][-1] != "1" else "2")
    with pytest.raises(RecordError, match="mac"):
        verify(pairs, SECRET)


def test_records_of_another_cluster_or_without_mac_are_refused():
    pairs = make_record().signed(OTHER)
    with pytest.raises(RecordError, match="mac does not verify"):
        verify(pairs, SECRET)
    del pairs["mac"]
    with pytest.raises(RecordError, match="no mac"):
        verify(pairs, SECRET)


def _resign(record: PeerRecord, **changes) -> dict:
    pairs = {**record.fields(), **changes}
    return {**pairs, "mac": _mac_of(pairs)}


def _mac_of(pairs):
    canonical = "\n".join(f"{k}={pairs[k]}" for k in sorted(pairs))
    return SECRET.mac(canonical.encode()).hex()


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"v": "99"}, "protocol"),
        ({"id": "0123456789abcdef"}, "does not match its public key"),
        ({"pk": "short"}, "does not match its public key"),
        ({"cp": "70000"}, "bad port"),
        ({"dp": "x"}, "bad port"),
    ],
)
def test_a_member_cannot_sign_a_nonsense_record(changes, reason):
    with pytest.raises(RecordError, match=reason):
        verify(_resign(make_record(), **changes), SECRET)


def test_a_record_missing_fields_is_refused():
    pairs = make_record().fields()
    del pairs["hp"]
    with pytest.raises(RecordError, match="lacks"):
        verify({**pairs, "mac": _mac_of(pairs)}, SECRET)


@pytest.mark.parametrize(
    "text, expected",
    [("10.0.0.1:7000", ("10.0.0.1", 7000)), ("[fe80::1]:7000", ("fe80::1", 7000)),
     ("desk.local:1", ("desk.local", 1))],
)
def test_static_peer_addresses(text, expected):
    assert parse_peer(text) == expected


@pytest.mark.parametrize("text", ["desk", "desk:", ":7000", "desk:0", "desk:abc", "d:70000"])
def test_bad_static_peer_addresses(text):
    with pytest.raises(PeerdError, match="HOST:PORT"):
        parse_peer(text)


def test_loopback_is_never_advertised_next_to_a_lan_address():
    assert advertised_addresses("10.1.2.3") == ["10.1.2.3"]
    automatic = advertised_addresses(None)
    assert automatic == ["127.0.0.1"] or not any(a.startswith("127.") for a in automatic)


class Seen:
    def __init__(self):
        self.records, self.departures = [], []

    def record(self, record, address):
        self.records.append((record, address))

    def departure(self, peer_id, instance):
        self.departures.append((peer_id, instance))


@pytest.mark.slow
@pytest.mark.mdns
async def test_mdns_finds_members_ignores_and_counts_strangers_and_notices_goodbyes():
    seen = Seen()
    me, member, stranger = make_record("me"), make_record("member"), make_record("stranger")
    watcher = MdnsDiscovery(me, SECRET, "127.0.0.1", seen.record, seen.departure)
    friend = MdnsDiscovery(member, SECRET, "127.0.0.1", Seen().record, Seen().departure)
    foreign = MdnsDiscovery(stranger, OTHER, "127.0.0.1", Seen().record, Seen().departure)
    for discovery in (watcher, friend, foreign):
        await discovery.start()
    try:
        await eventually(lambda: any(r == member for r, _ in seen.records), "the member", 15)
        await eventually(lambda: watcher.ignored >= 1, "the stranger to be ignored", 15)
        assert all(r.id != stranger.id for r, _ in seen.records)
        assert ("127.0.0.1") in {address for r, address in seen.records if r == member}
        await friend.close()
        await eventually(lambda: (member.id, member.instance) in seen.departures, "goodbye", 15)
    finally:
        for discovery in (watcher, foreign):
            await discovery.close()


def _hello_server(secret: ClusterSecret, answer_signed_with: ClusterSecret):
    record = make_record("server")
    received = []

    def handle(incoming):
        received.append(verify(incoming.msg.record, secret))
        incoming.reply(protocol.Hello(record=record.signed(answer_signed_with)))

    transport = Transport(KeyPair.generate(), secret, handle, "127.0.0.1")
    ports = transport.start()
    return transport, dataclasses.replace(record, hello_port=ports.hello), received


async def test_static_peers_exchange_verified_records_by_hello():
    server, server_record, received = _hello_server(SECRET, SECRET)
    client = Transport(KeyPair.generate(), SECRET, lambda incoming: None, "127.0.0.1")
    client.start()
    seen = Seen()
    mine = make_record("client")
    task = asyncio.create_task(
        StaticPeers([("127.0.0.1", server_record.hello_port)], mine, SECRET, client,
                    seen.record).run()
    )
    try:
        await eventually(lambda: seen.records, "the server's record", 10)
        record, address = seen.records[0]
        assert (record.id, address) == (server_record.id, "127.0.0.1")
        assert received[0] == mine
    finally:
        task.cancel()
        await client.close()
        await server.close()


async def test_a_hello_answer_that_does_not_verify_is_not_believed():
    server, server_record, received = _hello_server(SECRET, OTHER)
    client = Transport(KeyPair.generate(), SECRET, lambda incoming: None, "127.0.0.1")
    client.start()
    seen = Seen()
    peers = StaticPeers([("127.0.0.1", server_record.hello_port)], make_record("client"),
                        SECRET, client, seen.record)
    try:
        assert await peers.introduce("127.0.0.1", server_record.hello_port) is False
        assert received and seen.records == []
    finally:
        await client.close()
        await server.close()
