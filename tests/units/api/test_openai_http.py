"""The OpenAI-compatible endpoint in this process, without a cluster: the real aiohttp server
and the real chat service, on a peer with no model (chats are unavailable) or with a head whose
answers wait for a plan that never comes (so slots and the waiting line stay taken for as long
as a test needs them). tests/clusters/test_openai_api.py drives it on real daemons."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import logging
import re
import time

import pytest

from peerd.api.http_service import MAX_BODY_BYTES
from peerd.api.openai_api import OpenAiApi, ServedModel, api_error
from peerd.api.openai_settings import (
    Settings,
    parse_address,
    parse_origin,
    read_key,
    settings_from_args,
)
from peerd.errors import ErrorKind, PeerdError
from peerd.inference.answers import Answers
from peerd.inference.dataplane import Limits
from peerd.inference.serving import ChatService, Head

VOCAB = 100
PROMPT_IDS = {"prompt": [1, 2, 3], "max_tokens": 4}


def _request(port: int, method: str, path: str, body: bytes | None = None):
    """(status, headers, JSON body) of one request on its own connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body=body)
        answer = connection.getresponse()
        return answer.status, dict(answer.getheaders()), json.loads(answer.read())
    finally:
        connection.close()


async def _ask(api: OpenAiApi, method: str, path: str, document: dict | None = None):
    body = None if document is None else json.dumps(document).encode()
    return await asyncio.to_thread(_request, api.port, method, path, body)


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


def _head_waiting_for_a_plan(limits: Limits | None = None) -> ChatService:
    """A head whose answers are admitted, then wait for a plane that never comes."""
    service = ChatService(transport=None)
    service.head = Head(Answers(limits or Limits()), tokenizer=None, stop_ids=frozenset(),
                        max_positions=64, vocab_size=VOCAB)
    return service


@pytest.fixture
async def endpoint():
    """`endpoint(chat, settings, **options)`: a started endpoint, closed after the test."""
    started = []

    async def start(chat, settings: Settings | None = None, model: str | None = None,
                    **options) -> OpenAiApi:
        served = None if model is None else ServedModel(model)
        api = OpenAiApi(chat, lambda: served, settings or Settings(), **options)
        await api.start()
        started.append(api)
        return api

    yield start
    for api in started:
        await api.close()


async def _open_request(api: OpenAiApi, document: dict):
    """A request sent on a raw connection, its answer left unread."""
    reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
    body = json.dumps(document).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    return reader, writer


async def test_without_a_model_there_are_no_models_and_chats_are_unavailable(endpoint):
    api = await endpoint(ChatService(transport=None).op_chat)
    assert (await _ask(api, "GET", "/v1/models"))[2] == {"object": "list", "data": []}
    status, _, answer = await _ask(api, "POST", "/v1/chat/completions",
                                   {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and answer["error"]["type"] == "server_error"
    assert answer["error"]["code"] == "unavailable"
    assert "no model is deployed" in answer["error"]["message"]


async def test_head_answers_every_get_endpoint_without_a_body(endpoint):
    api = await endpoint(ChatService(transport=None).op_chat, model="tiny")
    for path in ("/v1/models", "/v1/models/tiny"):
        connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
        try:
            await asyncio.to_thread(connection.request, "HEAD", path)
            answer = await asyncio.to_thread(connection.getresponse)
            assert (answer.status, answer.read()) == (200, b"")
            assert answer.getheader("Content-Type").startswith("application/json")
        finally:
            connection.close()
    assert (await _ask(api, "POST", "/v1/models/tiny"))[0] == 405


async def test_a_model_is_answered_by_its_id_and_others_are_not_found(endpoint):
    api = await endpoint(ChatService(transport=None).op_chat, model="org/tiny-1")
    status, _, model = await _ask(api, "GET", "/v1/models/org/tiny-1")
    assert (status, model) == (200, {"id": "org/tiny-1", "object": "model", "created": 0,
                                     "owned_by": "peerd"})
    status, _, answer = await _ask(api, "GET", "/v1/models/gpt-4o")
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    assert "org/tiny-1" in answer["error"]["message"]
    assert (await _ask(api, "GET", "/v1/models/"))[0] == 404


@pytest.mark.parametrize("path, fields, param, reason", [
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, None, "up to 4"),
    ("/v1/completions", {"stop": ["a", 1]}, None, '"stop"'),
    ("/v1/completions", {"stop": ""}, None, '"stop"'),
    ("/v1/completions", {"logprobs": 6}, "logprobs", "0 to 5"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "0 to 5"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "true or false"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0 to 20"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", '"logprobs": true'),
])
async def test_bad_stop_and_logprobs_fields_get_400(endpoint, path, fields, param, reason):
    api = await endpoint(_head_waiting_for_a_plan().op_chat)
    asked = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {
        "prompt": [1, 2]}
    status, _, answer = await _ask(api, "POST", path, {**asked, **fields})
    assert status == 400 and reason in answer["error"]["message"]
    assert answer["error"]["param"] == param


async def test_a_full_head_answers_429_with_retry_after(endpoint):
    service = _head_waiting_for_a_plan(Limits(max_sequences=1, max_waiting=1))
    api = await endpoint(service.op_chat)
    answers = service.head.answers
    holders = [await _open_request(api, PROMPT_IDS) for _ in range(2)]
    await _until(lambda: answers.status()["running"] == 1 and answers.status()["waiting"] == 1)
    status, headers, answer = await _ask(api, "POST", "/v1/completions", PROMPT_IDS)
    assert status == 429 and headers["Retry-After"] == "1"
    assert answer["error"]["code"] == "rate_limit_exceeded" and "busy" in answer["error"]["message"]
    for _, writer in holders:
        writer.close()


async def test_a_model_without_a_tokenizer_refuses_text_with_400(endpoint):
    api = await endpoint(_head_waiting_for_a_plan().op_chat)
    status, _, answer = await _ask(api, "POST", "/v1/completions", {"prompt": "hello"})
    assert status == 400 and answer["error"]["code"] == "no_tokenizer"


async def test_token_ids_outside_the_vocabulary_get_400_naming_its_size(endpoint):
    api = await endpoint(_head_waiting_for_a_plan().op_chat)
    status, _, answer = await _ask(api, "POST", "/v1/completions", {"prompt": [5, VOCAB]})
    assert status == 400 and answer["error"]["code"] == "invalid_request"
    assert f"token id {VOCAB} is outside" in answer["error"]["message"]
    assert f"vocabulary size {VOCAB}" in answer["error"]["message"]


async def test_a_stream_waiting_for_its_first_token_gets_keep_alive_comments(endpoint):
    api = await endpoint(_head_waiting_for_a_plan().op_chat, keepalive_s=0.2)
    reader, writer = await _open_request(api, {**PROMPT_IDS, "stream": True})
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    comments = [await asyncio.wait_for(reader.readuntil(b"\n\n"), 10) for _ in range(2)]
    # chunked transfer coding: each comment is one chunk ("<size>\r\n: keep-alive\n\n")
    assert all(c.endswith(b": keep-alive\n\n") for c in comments), comments
    writer.close()


async def test_a_bug_is_a_500_with_its_traceback_logged_once(endpoint, caplog):
    async def broken_chat(request, send):
        return {}["no such key"]

    api = await endpoint(broken_chat)
    with caplog.at_level(logging.ERROR, "peerd.http"):
        answers = [await _ask(api, "POST", "/v1/completions", PROMPT_IDS) for _ in range(3)]
    assert [(status, body["error"]["code"]) for status, _, body in answers] == [
        (500, "internal_error")] * 3
    assert len(caplog.records) == 3 and caplog.text.count("Traceback") == 1


async def test_a_client_leaving_a_stream_ends_its_answer(endpoint):
    ended = asyncio.Event()

    async def endless_chat(request, send):
        try:
            for token in itertools.count():
                await send({"event": "token", "token": token, "text": "x"})
                await asyncio.sleep(0.01)
        finally:
            ended.set()

    api = await endpoint(endless_chat)
    reader, writer = await _open_request(api, {"prompt": "hi", "stream": True})
    assert b"text/event-stream" in await reader.readuntil(b"\r\n\r\n")
    assert b"data: {" in await reader.readuntil(b"\n\n")
    writer.close()
    await asyncio.wait_for(ended.wait(), 10)


async def test_a_body_over_the_limit_is_refused_before_it_is_read(endpoint):
    api = await endpoint(ChatService(transport=None).op_chat)
    body = b"x" * (MAX_BODY_BYTES + 1)
    status, _, answer = await asyncio.to_thread(_request, api.port, "POST", "/v1/completions",
                                                body)
    assert status == 413 and answer["error"]["code"] == "body_too_large"


async def test_a_chunked_body_over_the_limit_is_refused(endpoint):
    api = await endpoint(ChatService(transport=None).op_chat)

    def send() -> tuple:
        connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
        chunks = (b"x" * 65536 for _ in range(MAX_BODY_BYTES // 65536 + 1))
        connection.request("POST", "/v1/completions", body=chunks, encode_chunked=True)
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())["error"]["code"]

    assert await asyncio.to_thread(send) == (413, "body_too_large")


async def test_connections_over_the_cap_get_503_and_idle_ones_are_closed(endpoint):
    api = await endpoint(ChatService(transport=None).op_chat,
                         Settings(max_connections=2, idle_timeout_s=0.5))
    held = [await asyncio.open_connection("127.0.0.1", api.port) for _ in range(2)]
    await _until(lambda: api.status()["connections"] == 2)
    reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
    refused = await asyncio.wait_for(reader.read(), 10)  # answered and closed, unasked
    assert refused.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in refused
    writer.close()
    assert api.status() == {"connections": 2, "accepted": 2, "refused": 1, "max_connections": 2}
    started = time.monotonic()
    assert [await asyncio.wait_for(r.read(), 10) for r, _ in held] == [b"", b""]
    assert time.monotonic() - started < 5, "idle connections closed after the idle timeout"
    await _until(lambda: api.status()["connections"] == 0)
    assert (await _ask(api, "GET", "/v1/models"))[0] == 200


async def test_a_non_loopback_address_without_a_key_is_served_with_a_warning(endpoint, caplog):
    with caplog.at_level(logging.WARNING, "peerd.openai"):
        await endpoint(ChatService(transport=None).op_chat, Settings(host="0.0.0.0"))
        await endpoint(ChatService(transport=None).op_chat, Settings(host="0.0.0.0", key="k"))
    assert caplog.text.count("no authentication") == 1


def test_every_error_kind_has_a_status():
    statuses = {kind: api_error(PeerdError("why", kind)).status for kind in ErrorKind}
    assert statuses[ErrorKind.BUSY] == 429 and statuses[ErrorKind.UNAVAILABLE] == 503
    assert {statuses[k] for k in (ErrorKind.INVALID_REQUEST, ErrorKind.NO_TOKENIZER,
                                  ErrorKind.PROMPT_TOO_LONG)} == {400}


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, address",
    [("8080", ("127.0.0.1", 8080)), ("0.0.0.0:80", ("0.0.0.0", 80)),
     ("[::1]:8080", ("::1", 8080))],
)
def test_openai_addresses(text, address):
    assert parse_address(text) == address


@pytest.mark.parametrize(
    "text, reason",
    [("localhost:8080", "must be an IP address"), ("70000", "not [HOST:]PORT"),
     ("127.0.0.1:", "not [HOST:]PORT"), ("8080:x", "not [HOST:]PORT")],
)
def test_bad_openai_addresses_are_refused_with_the_reason(text, reason):
    with pytest.raises(PeerdError, match=re.escape(reason)):
        parse_address(text)


@pytest.mark.parametrize(
    "text, origin",
    [("http://localhost:3000", "http://localhost:3000"), ("https://chat.home/", "https://chat.home"),
     ("http://[::1]:8080", "http://[::1]:8080"), ("*", "*")],
)
def test_cors_origins(text, origin):
    assert parse_origin(text) == origin


@pytest.mark.parametrize("text", ["localhost:3000", "ftp://x", "http://x/chat", "http://",
                                  "http://x:99999", "http://u@x"])
def test_bad_cors_origins_are_refused(text):
    with pytest.raises(PeerdError, match="is not an origin"):
        parse_origin(text)


def test_the_key_file_holds_one_key(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  sk-local-123\n")
    assert read_key(key_file) == "sk-local-123"


@pytest.mark.parametrize(
    "content, reason",
    [(None, "no such file"), ("\n  \n", "is empty"), ("two words", "one word"),
     (b"\xff\xfe", "not UTF-8")],
)
def test_a_bad_key_file_is_a_clear_error(tmp_path, content, reason):
    key_file = tmp_path / "key"
    if isinstance(content, str):
        key_file.write_text(content)
    elif content is not None:
        key_file.write_bytes(content)
    with pytest.raises(PeerdError, match=re.escape(reason)):
        read_key(key_file)


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"openai": None, "openai_cors": [], "openai_key_file": None,
                                 "openai_max_connections": None, **given})


def test_settings_from_the_command_line(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("k\n")
    assert settings_from_args(_args()) is None
    settings = settings_from_args(_args(
        openai="8080", openai_cors=["http://a:1", "http://b"], openai_key_file=str(key_file),
        openai_max_connections=10))
    assert (settings.host, settings.port, settings.cors, settings.key,
            settings.max_connections) == ("127.0.0.1", 8080, ("http://a:1", "http://b"), "k", 10)


@pytest.mark.parametrize(
    "given, reason",
    [({"openai_cors": ["http://a"]}, "--openai-cors needs --openai"),
     ({"openai_key_file": "k"}, "--openai-key-file needs --openai"),
     ({"openai_max_connections": 10}, "--openai-max-connections needs --openai"),
     ({"openai": "8080", "openai_max_connections": 0}, "must be at least 1"),
     ({"openai": "8080", "openai_key_file": "/nonexistent/key"}, "no such file")],
)
def test_inconsistent_openai_options_are_refused(given, reason):
    with pytest.raises(PeerdError, match=re.escape(reason)):
        settings_from_args(_args(**given))

