"""The local socket of a real daemon under abuse: malformed and over-long requests, bad chat
settings, a client that disconnects in the middle of an answer, 100 subscribers and 200
status clients connecting in one burst, and closing with clients still connected.

One `peerd start --model` on loopback serves a small model alone (a one-stage plan). Every
bad request gets one JSON error line and the same connection keeps working; afterwards the
daemon still answers exactly transformers' tokens, holds no sequence state, and has logged
no traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from netns import wait_for
from sharding import reference, seed_shard_cache
from streaming import only_kept

from peerd import statedir
from peerd.api.local_api import MAX_LINE_BYTES, LocalApi
from peerd.commands.chat import stream_answer
from peerd.commands.client import call
from peerd.commands.local_cluster import LocalCluster

PROMPT, NEW_TOKENS = [3, 1, 4, 1, 5], 10
CLIENTS = 100


@pytest.fixture(scope="module")
def daemon(hf_checkpoint, tmp_path_factory):
    model_dir = hf_checkpoint("llama", layers=2)
    expected = reference(model_dir, tuple(PROMPT), NEW_TOKENS, stop_at_eos=True)[0]
    root = tmp_path_factory.mktemp("api-abuse")
    seed_shard_cache(root / "peer0", model_dir)
    with LocalCluster(root, model_dir, 1, progress=lambda line: None) as cluster:
        yield cluster.dirs[0], expected


def _raw(state_dir: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(statedir.socket_path(state_dir)))
    return sock


def _lines(sock: socket.socket) -> Callable[[], dict]:
    stream = sock.makefile("rb")
    return lambda: json.loads(stream.readline())


def _log(state_dir: Path) -> str:
    return (state_dir / "daemon.log").read_text(errors="replace")


def _healthy(state_dir: Path, expected: list[int], logged: int) -> None:
    """Exact answers, no sequence left behind, nothing raised since the log was `logged` long."""
    done = stream_answer(state_dir, {"prompt_ids": PROMPT, "max_tokens": NEW_TOKENS})
    assert done["token_ids"] == expected
    wait_for(lambda: _idle(state_dir), 15, "every sequence to be freed")
    assert "Traceback" not in _log(state_dir)[logged:]


def _idle(state_dir: Path) -> bool:
    """Its only peer holds no K/V but what it keeps for conversations' next turns."""
    return only_kept([call(state_dir, {"op": "status"})["status"]["dataplane"]])


BAD_REQUESTS = [
    (b"not json\n", "not JSON"),
    (b"\xff\xfe\x00garbage\n", "not JSON"),
    (b"[" * 30000 + b"]" * 30000 + b"\n", "nested too deeply"),
    (b"[1, 2]\n", "object"),
    (b'"status"\n', "object"),
    (b"{}\n", "object"),
    (b'{"op": 5}\n', "object"),
    (b'{"op": "dance"}\n', "unknown op 'dance'"),
    (b'{"op": "status", "pad": "' + b"x" * (3 * MAX_LINE_BYTES) + b'"}\n', "longer than"),
    (b'{"op": "chat"}\n', "exactly one of"),
    (b'{"op": "chat", "prompt_ids": []}\n', "prompt_ids"),
    (b'{"op": "chat", "prompt_ids": [1, "2"]}\n', "prompt_ids"),
    (b'{"op": "chat", "prompt_ids": [1], "max_tokens": 0}\n', "max_tokens"),
    (b'{"op": "chat", "prompt_ids": [1], "max_tokens": 100000}\n', "max_tokens"),
    (b'{"op": "chat", "prompt_ids": [1], "max_tokens": 300}\n', "positions"),
    (b'{"op": "chat", "prompt_ids": [1], "temperature": -1}\n', "temperature"),
    (b'{"op": "chat", "prompt_ids": [1], "temperature": "hot"}\n', "sampling"),
    (b'{"op": "chat", "prompt_ids": [1], "top_p": 0}\n', "top-p"),
    (b'{"op": "chat", "prompt_ids": [1], "top_k": -1}\n', "top-k"),
    (b'{"op": "chat", "prompt_ids": [1], "top_k": 1e400}\n', "sampling"),
    (b'{"op": "chat", "prompt_ids": [1], "seed": -1}\n', "seed"),
    (b'{"op": "chat", "prompt_ids": [1], "seed": 18446744073709551616}\n', "seed"),
    (b'{"op": "chat", "prompt_ids": [-5]}\n', "prompt_ids"),
    (b'{"op": "chat", "prompt_ids": [1180591620717411303424]}\n', "prompt_ids"),
    (b'{"op": "chat", "prompt_ids": [1], "resume_ids": [-1], "max_tokens": 3}\n', "resume_ids"),
    (b'{"op": "chat", "messages": [{"role": 1}]}\n', "messages"),
]


@pytest.mark.cluster
def test_bad_requests_get_one_json_error_each_and_the_connection_keeps_working(daemon):
    state_dir, expected = daemon
    logged = len(_log(state_dir))
    with _raw(state_dir) as sock:
        read = _lines(sock)
        for request, reason in BAD_REQUESTS:
            sock.sendall(request)
            answer = read()
            assert answer["ok"] is False and reason in answer["error"], (request[:60], answer)
            assert "\n" not in answer["error"] and "internal error" not in answer["error"]
        sock.sendall(b'{"op": "status"}\n')
        assert read()["ok"] is True
    _healthy(state_dir, expected, logged)


@pytest.mark.cluster
def test_a_client_that_leaves_mid_answer_frees_its_sequence(daemon):
    state_dir, expected = daemon
    logged = len(_log(state_dir))
    for _ in range(3):
        with _raw(state_dir) as sock:
            read = _lines(sock)
            sock.sendall(json.dumps({"op": "chat", "prompt_ids": PROMPT,
                                     "max_tokens": 200}).encode() + b"\n")
            assert read()["event"] == "token", "the answer had started"
    _healthy(state_dir, expected, logged)


@pytest.mark.cluster
def test_a_client_that_leaves_before_its_answer_is_read_or_mid_request(daemon):
    state_dir, expected = daemon
    logged = len(_log(state_dir))
    with _raw(state_dir) as sock:
        sock.sendall(b'{"op": "chat", "prompt_ids": [1, 2], "max_tokens": 50}\n')
    with _raw(state_dir) as sock:
        sock.sendall(b'{"op": "status", "pad": "' + b"x" * (2 * MAX_LINE_BYTES))
    with _raw(state_dir) as sock:
        sock.sendall(b'{"op": "stat')
    _healthy(state_dir, expected, logged)


@pytest.mark.cluster
def test_a_hundred_clients_at_once_are_all_answered(daemon):
    """100 subscribers and 200 status requests whose connections all arrive in one burst,
    before the daemon accepts any (a short listen queue would refuse most of them)."""
    state_dir, expected = daemon
    logged = len(_log(state_dir))
    requests = [{"op": "subscribe"}] * CLIENTS + [{"op": "status"}] * (2 * CLIENTS)
    sockets = [_burst_connect(state_dir) for _ in requests]
    for sock, request in zip(sockets, requests, strict=True):
        sock.setblocking(True)
        sock.settimeout(30)
        sock.sendall(json.dumps(request).encode() + b"\n")
    for sock, request in zip(sockets, requests, strict=True):
        with sock:
            read = _lines(sock)
            if request["op"] == "subscribe":
                assert read() == {"ok": True, "subscribed": True}
                assert "event" in read()  # the next measurement round, within seconds
            else:
                assert read()["status"]["self"]
    _healthy(state_dir, expected, logged)


def _burst_connect(state_dir: Path) -> socket.socket:
    """A connection that does not wait to be accepted: refused when the queue is full."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.connect(str(statedir.socket_path(state_dir)))
    return sock


async def test_closing_with_clients_still_connected_logs_no_error(tmp_path, caplog):
    """What a daemon stopping under a connected dashboard does (no daemon needed)."""
    async def subscribe(request, send):
        await send({"ok": True})
        await asyncio.Event().wait()

    api = LocalApi(statedir.socket_path(tmp_path), {"subscribe": subscribe})
    await api.start()
    reader, writer = await asyncio.open_unix_connection(str(api.path))
    writer.write(b'{"op": "subscribe"}\n')
    assert json.loads(await reader.readline()) == {"ok": True}
    await api.close()
    assert await asyncio.wait_for(reader.read(), 5) == b"", "the daemon closed the connection"
    writer.close()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
