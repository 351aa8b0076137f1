"""The local API socket, its clients (`peerd status`, `peerd stop`), and the status document."""

import argparse
import asyncio
import json
import logging
import socket
import stat
import struct
import time

import pytest
import uvloop

from peerd import statedir
from peerd.api import status
from peerd.api.local_api import MAX_LINE_BYTES, EventBus, LocalApi
from peerd.api.ops import LocalOps
from peerd.cluster import election, membership
from peerd.cluster.records import PeerRecord
from peerd.commands import chat, client
from peerd.errors import PeerdError
from peerd.wire.protocol import Battery, ClusterReport, LinkFigures, PeerFigures

ME = status.SelfInfo("aaaa", "desk", "i1", "c0ffee00", "10.0.0.1",
                     {"hello": 7000, "control": 7001, "data": 7002})


def sample_status() -> dict:
    members = membership.Membership("aaaa", "i1")
    for peer, name in (("bbbb", "laptop"), ("cccc", "tablet")):
        record = PeerRecord(peer, name, "i9", f"key-{peer}", 1, 2, 3)
        members, _ = membership.apply(members, membership.Discovered(record, "10.0.0.9", 0.0))
    members, _ = membership.apply(members, membership.HeartbeatSeen("bbbb", "i9", True, 1, 0.1))
    state = election.Election(me=election.Candidate("aaaa", True, 2e10), epoch=3, leader="aaaa",
                              role=election.Role.LEADER)
    report = ClusterReport(3, (
        PeerFigures("aaaa", 2e10, 16 << 30, 8 << 30, 0.25, None, "tiny", ()),
        PeerFigures("bbbb", 1e10, 8 << 30, 2 << 30, 0.5, Battery(40, False), None, (1, 2)),
    ), (LinkFigures("aaaa", "bbbb", 0.0005, 5e7), LinkFigures("bbbb", "aaaa", 0.0004, 4e7)))
    return status.build(ME, members, state, report, status.Counters(2, 1, 0))


def test_status_document_has_the_contract_fields():
    document = sample_status()
    assert {"self", "leader", "epoch", "peers", "plan", "model"} <= set(document)
    assert (document["self"], document["leader"], document["epoch"]) == ("aaaa", "aaaa", 3)
    peers = {p["id"]: p for p in document["peers"]}
    assert list(peers) == ["aaaa", "bbbb", "cccc"]
    for peer in peers.values():
        assert {"id", "name", "address", "state", "flops", "memory_available", "memory_used",
                "load", "battery", "units", "links"} <= set(peer)
    assert peers["bbbb"]["state"] == "alive" and peers["cccc"]["state"] == "suspect"
    assert peers["bbbb"]["battery"] == {"percent": 40.0, "plugged": False}
    assert peers["bbbb"]["units"] == [1, 2]
    assert peers["aaaa"]["links"] == [{"target": "bbbb", "latency_s": 0.0005,
                                       "bandwidth_Bps": 5e7}]
    assert peers["cccc"]["flops"] is None and peers["cccc"]["links"] == []
    assert document["plan"] is None
    assert document["security"] == {"ignored_records": 2, "refused_handshakes": 1,
                                    "malformed_messages": 0}
    json.dumps(document)


def test_status_renders_as_a_readable_table():
    text = status.render(sample_status())
    assert "leader  desk   epoch 3" in text
    lines = text.splitlines()
    laptop = next(line for line in lines if line.startswith("laptop"))
    assert "alive" in laptop and "10.0" in laptop and "40%" in laptop and "1,2" in laptop
    assert any(line.startswith("desk") and "laptop" in line and "50.0 MB/s" in line
               for line in lines)
    assert "refused 2 foreign records, 1 handshakes" in text


class Server:
    def __init__(self, state_dir, history: int = 200):
        self.bus = EventBus(history)
        self.stopped = asyncio.Event()
        ops = LocalOps(sample_status, self.bus, self.op_fail, lambda enabled: None,
                       self.stopped.set)
        self.api = LocalApi(statedir.socket_path(state_dir), {
            "status": self.op_status, "stop": self.op_stop, "subscribe": ops.subscribe,
            "fail": self.op_fail, "crash": self.op_crash,
        })

    async def op_status(self, request, send):
        await send({"ok": True, "status": sample_status()})

    async def op_stop(self, request, send):
        await send({"ok": True})
        self.stopped.set()
        await self.api.close()

    async def op_fail(self, request, send):
        raise PeerdError("that did not work")

    async def op_crash(self, request, send):
        raise RuntimeError("a bug")


@pytest.fixture
async def server(tmp_path):
    server = Server(tmp_path)
    await server.api.start()
    yield server
    await server.api.close()


async def _exchange(path, *lines: bytes) -> list[dict]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    answers = []
    for line in lines:
        writer.write(line)
        await writer.drain()
        answers.append(json.loads(await asyncio.wait_for(reader.readline(), 5)))
    writer.close()
    return answers


async def test_the_socket_is_private(server):
    assert stat.S_IMODE(server.api.path.stat().st_mode) == 0o600


async def test_bad_requests_get_errors_and_the_connection_keeps_working(server):
    answers = await _exchange(
        server.api.path,
        b"not json\n",
        b"[1, 2]\n",
        b'{"op": 5}\n',
        b'{"op": "dance"}\n',
        b'{"op": "fail"}\n',
        b'{"op": "crash"}\n',
        b'{"op": "status", "pad": "' + b"x" * (2 * MAX_LINE_BYTES) + b'"}\n',
        b'{"op": "status"}\n',
    )
    errors = [a.get("error", "") for a in answers[:-1]]
    assert [a["ok"] for a in answers] == [False] * 7 + [True]
    assert "not JSON" in errors[0] and "object" in errors[1] and "object" in errors[2]
    assert "unknown op 'dance'" in errors[3] and errors[4] == "that did not work"
    assert "internal error" in errors[5] and "longer than" in errors[6]
    assert answers[-1]["status"]["self"] == "aaaa"


async def test_subscribers_receive_published_events(server):
    reader, writer = await asyncio.open_unix_connection(str(server.api.path))
    writer.write(b'{"op": "subscribe"}\n')
    assert json.loads(await reader.readline()) == {"ok": True, "subscribed": True}
    server.bus.publish({"event": "leader", "leader": "aaaa", "epoch": 4})
    server.bus.publish({"event": "peer", "id": "bbbb", "state": "dead"})
    got = [json.loads(await asyncio.wait_for(reader.readline(), 5)) for _ in range(2)]
    assert [e["event"] for e in got] == ["leader", "peer"]
    writer.close()


async def test_a_slow_subscriber_loses_its_oldest_events():
    bus = EventBus()
    with bus.subscription() as (_, queue):
        for i in range(queue.maxsize + 5):
            bus.publish({"n": i})
        assert queue.qsize() == queue.maxsize and queue.get_nowait()["n"] == 5


def test_the_bus_keeps_the_latest_events_stamped_with_their_time():
    bus = EventBus(history=200)
    before = time.time()
    for i in range(250):
        bus.publish({"event": "tick", "n": i})
    with bus.subscription() as (past, queue):
        assert [e["n"] for e in past] == list(range(50, 250)), "the latest 200, oldest first"
        assert before <= past[0]["at"] <= past[-1]["at"] <= time.time()
        assert queue.empty(), "the kept events are not queued again"
        bus.publish({"event": "tick", "n": 250})
        assert queue.get_nowait()["n"] == 250


async def test_a_subscriber_gets_the_history_then_live_events_without_gap_or_repeat(tmp_path):
    """Events published all the while a client subscribes over the real socket: what it
    reads is one unbroken run, the kept history first, up to the last event published."""
    server = Server(tmp_path, history=50)
    await server.api.start()
    published = 0

    async def publish(until: int) -> None:
        nonlocal published
        while published < until:
            server.bus.publish({"event": "tick", "n": published})
            published += 1
            await asyncio.sleep(0)

    try:
        await publish(120)
        publishing = asyncio.create_task(publish(600))
        reader, writer = await asyncio.open_unix_connection(str(server.api.path))
        writer.write(b'{"op": "subscribe"}\n')
        assert json.loads(await reader.readline()) == {"ok": True, "subscribed": True}
        subscribed_after = published
        seen = [json.loads(await asyncio.wait_for(reader.readline(), 5))["n"]]
        while seen[-1] < 599:
            seen.append(json.loads(await asyncio.wait_for(reader.readline(), 5))["n"])
        await publishing
        writer.close()
    finally:
        await server.api.close()
    assert seen == list(range(seen[0], 600)), "no event missing, none twice"
    # the history was taken after the first 120 events and before the answer was read
    assert 120 - 50 <= seen[0] <= subscribed_after - 50, "it starts with the 50 kept events"


def _args(state_dir, **extra) -> argparse.Namespace:
    return argparse.Namespace(state_dir=str(state_dir), **extra)


async def test_peerd_status_prints_json_or_a_table(server, tmp_path, capsys):
    assert await asyncio.to_thread(client.cmd_status, _args(tmp_path, json=True)) == 0
    assert json.loads(capsys.readouterr().out)["epoch"] == 3
    await asyncio.to_thread(client.cmd_status, _args(tmp_path, json=False))
    assert "laptop" in capsys.readouterr().out


async def test_peerd_stop_waits_until_the_daemon_is_gone(server, tmp_path, capsys):
    assert await asyncio.to_thread(client.cmd_stop, _args(tmp_path)) == 0
    assert server.stopped.is_set() and not server.api.path.exists()
    assert "stopped" in capsys.readouterr().out


async def test_client_events_iterator(server, tmp_path):
    def first_event():
        return next(client.events(tmp_path))

    task = asyncio.create_task(asyncio.to_thread(first_event))
    while not server.bus.subscribers:
        await asyncio.sleep(0.01)
    server.bus.publish({"event": "measurements", "epoch": 1})
    assert (await asyncio.wait_for(task, 5))["event"] == "measurements"


def test_clients_explain_that_no_daemon_is_running(tmp_path):
    with pytest.raises(PeerdError, match="no daemon is running"):
        client.cmd_status(_args(tmp_path, json=False))
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(statedir.socket_path(tmp_path)))
    stale.close()
    with pytest.raises(PeerdError, match="no daemon is running"):
        client.cmd_stop(_args(tmp_path))


def test_chat_explains_that_no_daemon_is_running(tmp_path):
    args = _args(tmp_path, prompt=None, prompt_ids=[1, 2], max_tokens=4, temperature=0.0,
                 top_k=0, top_p=1.0, seed=0, json=True)
    with pytest.raises(PeerdError, match="no daemon is running"):
        chat.cmd_chat(args)


def test_an_over_long_socket_path_is_refused(tmp_path):
    with pytest.raises(PeerdError, match="too long"):
        LocalApi(tmp_path / ("d" * 120) / "peerd.sock", {})


def test_an_answer_to_a_client_that_reset_its_connection_ends_quietly_on_uvloop(tmp_path, caplog):
    """On the daemon's loop (uvloop), an op streaming to a client that is gone ends with a
    ConnectionError and nothing is logged as an error. (Under load a uvloop transport was
    also seen closed before an op's next write, which then raised RuntimeError and logged a
    traceback; `send` now checks for a closing transport first. That timing is not
    reproduced here.)"""
    ended: list[BaseException] = []

    async def chatty(request, send):
        try:
            for token in range(200):
                await send({"event": "token", "token": token})
                await asyncio.sleep(0.005)
        except BaseException as exc:
            ended.append(exc)
            raise

    async def main() -> None:
        api = LocalApi(statedir.socket_path(tmp_path), {"chat": chatty})
        await api.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(api.path))
            writer.write(b'{"op": "chat"}\n')
            await reader.readline()  # the first token: the answer is streaming
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # gone at once, without reading another line
            deadline = asyncio.get_running_loop().time() + 10
            while not ended and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
        finally:
            await api.close()

    with caplog.at_level(logging.ERROR), asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        r.run(main())
    assert ended and isinstance(ended[0], ConnectionError), ended
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
