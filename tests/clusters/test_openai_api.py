"""The OpenAI-compatible endpoint, driven by the official `openai` client.

Two real daemons on loopback: peer0 serves the small test Llama (pre-sharded into its cache)
and is the head; peer1 runs `--openai`, so every answer it gives is forwarded to the head.
Its answers must equal `peerd chat --json` asked on peer0 for the same prompt and seed.
Bad requests get OpenAI-shaped errors and the daemon keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import json
import logging
import re
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns import wait_for
from openai import BadRequestError, OpenAI
from sharding import reference, seed_shard_cache

from peerd.api.http_server import MAX_BODY_BYTES
from peerd.api.openai_api import OpenAiApi, parse_address
from peerd.commands import client
from peerd.errors import PeerdError
from peerd.inference.serving import ChatService
from peerd.wire import identity
from shards.tokenizer import Tokenizer

PEERD = [sys.executable, "-m", "peerd"]
READY_S, ANSWER_S = 180, 60
PROMPT = "hello world! how are you today?"
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
MAX_TOKENS = 24


@dataclass(frozen=True)
class Cluster:
    model_dir: Path
    dirs: list[Path]
    host: str
    port: int

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"http://{self.host}:{self.port}/v1", api_key="unused",
                      max_retries=0, timeout=ANSWER_S)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _state_dirs(root: Path, count: int) -> list[Path]:
    secret = identity.ClusterSecret(secrets.token_bytes(identity.SECRET_BYTES))
    dirs = []
    for i in range(count):
        state_dir = root / f"peer{i}"
        state_dir.mkdir()
        identity.ensure_identity(state_dir, f"peer{i}")
        identity.store_secret(state_dir, secret)
        dirs.append(state_dir)
    return dirs


def _status(state_dir: Path) -> dict | None:
    try:
        return client.call(state_dir, {"op": "status"})["status"]
    except PeerdError:
        return None


def _plan_active(state_dir: Path) -> bool:
    """Whether this peer sees every stage of its plan loaded (so it can forward chats)."""
    status = _status(state_dir) or {}
    stages = (status.get("plan") or {}).get("stages")
    units = {p["id"]: p["units"] for p in status.get("peers", [])}
    return bool(stages) and all(units.get(s["peer"]) == s["units"] for s in stages)


@contextlib.contextmanager
def _daemon(state_dir: Path, *extra: str):
    log = state_dir / "daemon.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [*PEERD, "start", "--state-dir", str(state_dir), "--interface", "127.0.0.1", *extra],
            stdout=output, stderr=subprocess.STDOUT,
        )
    try:
        yield process
    except BaseException:
        print(f"--- {log}\n{log.read_text()}")
        raise
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(hf_checkpoint, tmp_path_factory):
    model_dir = hf_checkpoint("llama")
    dirs = _state_dirs(tmp_path_factory.mktemp("openai"), 2)
    seed_shard_cache(dirs[0], model_dir)
    port = _free_port()
    with _daemon(dirs[0], "--model", str(model_dir)):
        hello = wait_for(lambda: (_status(dirs[0]) or {}).get("ports", {}).get("hello"),
                         READY_S, "peer0 to start")
        with _daemon(dirs[1], "--peer", f"127.0.0.1:{hello}", "--openai", str(port)):
            wait_for(lambda: _plan_active(dirs[1]), READY_S, "peer1 to see the plan loaded")
            yield Cluster(model_dir, dirs, "127.0.0.1", port)


@pytest.fixture(scope="module")
def peerd_chat(cluster) -> dict:
    """`peerd chat --json` on the head, with PROMPT and SAMPLING."""
    done = subprocess.run(
        [*PEERD, "chat", "--state-dir", str(cluster.dirs[0]), "--prompt", PROMPT, "--json",
         "--max-tokens", str(MAX_TOKENS), "--temperature", str(SAMPLING["temperature"]),
         "--top-p", str(SAMPLING["top_p"]), "--seed", str(SAMPLING["seed"])],
        capture_output=True, text=True, timeout=ANSWER_S,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _finish_reason(token_ids: list[int], model_dir: Path) -> str:
    eos = Tokenizer.from_dir(model_dir).eos_token_id
    return "stop" if token_ids[-1] == eos else "length"


def _request(cluster: Cluster, method: str, path: str, body: bytes | None = None):
    connection = http.client.HTTPConnection(cluster.host, cluster.port, timeout=ANSWER_S)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.getheader("Content-Type"), json.loads(answer.read())
    finally:
        connection.close()


@pytest.mark.cluster
def test_a_streamed_chat_completion_equals_peerd_chat_json(cluster, peerd_chat):
    stream = cluster.client().chat.completions.create(
        model="anything", messages=[{"role": "user", "content": PROMPT}], stream=True,
        max_tokens=MAX_TOKENS, stream_options={"include_usage": True}, **SAMPLING,
    )
    chunks = list(stream)
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant"
    text = "".join(c.delta.content or "" for c in choices)
    token_ids = [t for c in choices for t in (c.model_extra.get("token_ids") or [])]
    assert token_ids == peerd_chat["token_ids"] and text == peerd_chat["text"]
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + [
        _finish_reason(token_ids, cluster.model_dir)
    ]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == peerd_chat["stats"]["prompt_tokens"]
    assert usage.completion_tokens == len(token_ids)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].model == cluster.model_dir.name


@pytest.mark.cluster
def test_a_chat_completion_without_streaming_is_the_same_answer(cluster, peerd_chat):
    answer = cluster.client().chat.completions.create(
        model="anything", messages=[{"role": "user", "content": PROMPT}],
        max_completion_tokens=MAX_TOKENS, **SAMPLING,
    )
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == peerd_chat["text"]
    assert choice.model_extra["token_ids"] == peerd_chat["token_ids"]
    assert choice.finish_reason == _finish_reason(peerd_chat["token_ids"], cluster.model_dir)
    assert answer.usage.total_tokens == peerd_chat["stats"]["prompt_tokens"] + len(
        peerd_chat["token_ids"]
    )


@pytest.mark.cluster
def test_completions_encode_plain_text_without_the_chat_template(cluster):
    openai = cluster.client()
    text = "the quick brown fox"
    ids = Tokenizer.from_dir(cluster.model_dir).encode(text)
    by_text = openai.completions.create(model="m", prompt=text, max_tokens=12, temperature=0)
    by_ids = openai.completions.create(model="m", prompt=ids, max_tokens=12, temperature=0)
    streamed = list(openai.completions.create(model="m", prompt=text, max_tokens=12,
                                              temperature=0, stream=True))
    assert by_text.usage.prompt_tokens == len(ids) == by_ids.usage.prompt_tokens
    answer = by_text.choices[0]
    assert answer.model_extra["token_ids"] == by_ids.choices[0].model_extra["token_ids"]
    assert answer.text == by_ids.choices[0].text == "".join(c.choices[0].text for c in streamed)
    assert streamed[-1].choices[0].finish_reason == answer.finish_reason


@pytest.mark.cluster
def test_finish_reason_is_stop_exactly_when_the_answer_ends_with_eos(cluster):
    ended = reference(cluster.model_dir, (7,), 40, stop_at_eos=True)[0]
    assert ended[-1] == Tokenizer.from_dir(cluster.model_dir).eos_token_id, "an answer that ends"
    for max_tokens, reason in [(len(ended), "stop"), (len(ended) - 1, "length")]:
        answer = cluster.client().completions.create(
            model="m", prompt=[7], max_tokens=max_tokens, temperature=0).choices[0]
        assert answer.model_extra["token_ids"] == ended[:max_tokens]
        assert answer.finish_reason == reason


@pytest.mark.cluster
def test_models_lists_the_served_model(cluster):
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [cluster.model_dir.name]


@pytest.mark.cluster
@pytest.mark.parametrize(
    "method, path, body, status, code",
    [
        ("POST", "/v1/chat/completions", b'{"model": "m", "messages": [', 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b'{"model": "m"}', 400, "invalid_messages"),
        ("POST", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "unsupported_n"),
        ("POST", "/v1/completions", b'{"prompt": ["a", "b"]}', 400, "invalid_prompt"),
        ("POST", "/v1/completions", b'{"prompt": "a", "max_tokens": 0}', 400,
         "invalid_request"),
        ("GET", "/v1/nothing", None, 404, "not_found"),
        ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(cluster, method, path, body, status, code):
    answer = _request(cluster, method, path, body)
    assert answer[:2] == (status, "application/json")
    error = answer[2]["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert error["message"]
    assert _request(cluster, "GET", "/v1/models")[0] == 200, "the endpoint keeps answering"


@pytest.mark.cluster
def test_the_openai_client_raises_on_a_bad_request(cluster):
    with pytest.raises(BadRequestError, match='"n" must be 1'):
        cluster.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], n=2)


# -- without a cluster ------------------------------------------------------------------------


@pytest.fixture
async def lone_endpoint():
    """The endpoint on a peer that has no model: the real chat service, with no head."""
    api = OpenAiApi(ChatService(transport=None).op_chat, lambda: None)
    port = await api.start("127.0.0.1", 0)
    yield Cluster(Path(), [], "127.0.0.1", port)
    await api.close()


async def test_without_a_model_there_are_no_models_and_chats_are_unavailable(lone_endpoint):
    loop = asyncio.get_running_loop()
    models = await loop.run_in_executor(None, _request, lone_endpoint, "GET", "/v1/models")
    assert models == (200, "application/json", {"object": "list", "data": []})
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, answer = await loop.run_in_executor(
        None, _request, lone_endpoint, "POST", "/v1/chat/completions", body)
    assert status == 503 and answer["error"]["type"] == "server_error"
    assert "no model is deployed" in answer["error"]["message"]


async def test_a_client_leaving_a_stream_ends_its_answer():
    ended = asyncio.Event()

    async def endless_chat(request, send):
        try:
            for token in itertools.count():
                await send({"event": "token", "token": token, "text": "x"})
                await asyncio.sleep(0.01)
        finally:
            ended.set()

    api = OpenAiApi(endless_chat, lambda: None)
    port = await api.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": "hi", "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    assert b"text/event-stream" in await reader.readuntil(b"\r\n\r\n")
    assert (await reader.readuntil(b"\n\n")).startswith(b"data: {")
    writer.close()
    await asyncio.wait_for(ended.wait(), 10)
    await api.close()


async def test_a_body_over_the_limit_is_refused_before_it_is_read(lone_endpoint):
    body = b"x" * (MAX_BODY_BYTES + 1)
    status, _, answer = await asyncio.get_running_loop().run_in_executor(
        None, _request, lone_endpoint, "POST", "/v1/completions", body)
    assert status == 413 and answer["error"]["code"] == "body_too_large"


async def test_a_non_loopback_address_is_served_with_a_warning(caplog):
    api = OpenAiApi(ChatService(transport=None).op_chat, lambda: None)
    with caplog.at_level(logging.WARNING, "peerd.openai"):
        await api.start("0.0.0.0", 0)
    await api.close()
    assert "no authentication" in caplog.text


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
