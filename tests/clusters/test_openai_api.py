"""The OpenAI-compatible endpoint on real daemons, driven by the official `openai` client and by
raw HTTP.

Two daemons on loopback: peer0 serves the small test Llama (pre-sharded into its cache) and is
the head; peer1 runs `--openai` with a key file and one allowed CORS origin, so every answer it
gives is forwarded to the head. peer1 starts with an open-file limit of 512 (soft) and 1,024
(hard), which the daemon raises to 1,024 as it starts. Its answers must equal `peerd chat
--json` asked on peer0 for the same prompt and seed. Bad requests get OpenAI-shaped 4xx errors,
nothing in peer1's log is a traceback, and the daemon keeps answering.
"""

from __future__ import annotations

import contextlib
import email.message
import http.client
import json
import math
import resource
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netns import wait_for
from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI
from sharding import logits_along, reference, seed_shard_cache
from streaming import only_kept

from peerd.api.http_service import MAX_BODY_BYTES
from peerd.api.openai_settings import DEFAULT_MAX_CONNECTIONS
from peerd.cluster.membership import Timing
from peerd.commands import client
from peerd.commands.local_cluster import free_ports
from peerd.errors import PeerdError
from peerd.wire import identity
from shards.text_stream import TextStream
from shards.tokenizer import Tokenizer

PEERD = [sys.executable, "-m", "peerd"]
READY_S, ANSWER_S = 180, 60
PROMPT = "hello world! how are you today?"
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
MAX_TOKENS = 24
KEY = "sk-peerd-test-" + secrets.token_hex(8)
ALLOWED_ORIGIN = "http://localhost:3000"
FILE_LIMITS = (512, 1024)  # peer1's open-file limits as started (soft, hard)


@dataclass(frozen=True)
class Cluster:
    model_dir: Path
    dirs: list[Path]
    pids: list[int]
    host: str
    port: int

    @property
    def model(self) -> str:
        return self.model_dir.name

    def client(self, key: str = KEY) -> OpenAI:
        return OpenAI(base_url=f"http://{self.host}:{self.port}/v1", api_key=key,
                      max_retries=0, timeout=ANSWER_S)

    def log(self, peer: int) -> str:
        return (self.dirs[peer] / "daemon.log").read_text()


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


def _settled(dirs: list[Path]) -> tuple[int, float] | None:
    """(plan id, time of the leader's latest report) once the leader has measured every peer,
    no change waits to settle and every peer sees that plan loaded; None before."""
    statuses = [_status(d) or {} for d in dirs]
    leader = next((s for s in statuses if s.get("role") == "leader"), None)
    if leader is None or leader["replan_pending"] or len(leader["peers"]) < len(dirs):
        return None
    plans = {(s.get("plan") or {}).get("id") for s in statuses}
    if not all(p.get("flops") for p in leader["peers"]) or len(plans) != 1:
        return None
    if not all(_plan_active(d) for d in dirs):
        return None
    reports = [e["t"] for entries in leader["history"].values() for e in entries]
    return plans.pop(), max(reports, default=0.0)


def _settled_plan(dirs: list[Path]):
    """A condition: the settled plan's id, once it held over two of the leader's reports (a
    report can land just before the leader notices the change it brings)."""
    first: dict[str, Any] = {}

    def condition() -> int | None:
        now = _settled(dirs)
        if now is None or first.get("plan") != now[0]:
            first.update(plan=now and now[0], at=now and now[1])
            return None
        return now[0] if now[1] > first["at"] else None

    return condition


def _limit_files(limits: tuple[int, int]):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits)


@contextlib.contextmanager
def _daemon(state_dir: Path, *extra: str, preexec_fn=None):
    log = state_dir / "daemon.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [*PEERD, "start", "--state-dir", str(state_dir), "--interface", "127.0.0.1", *extra],
            stdout=output, stderr=subprocess.STDOUT, preexec_fn=preexec_fn,
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
    root = tmp_path_factory.mktemp("openai")
    dirs = _state_dirs(root, 2)
    seed_shard_cache(dirs[0], model_dir)
    key_file = root / "openai.key"
    key_file.write_text(KEY + "\n")
    port = free_ports(1)
    # No rebalancing: the plan must change only where a peer fails (the flood test).
    with _daemon(dirs[0], "--model", str(model_dir), "--no-rebalance") as head:
        hello = wait_for(lambda: (_status(dirs[0]) or {}).get("ports", {}).get("hello"),
                         READY_S, "peer0 to start")
        with _daemon(dirs[1], "--peer", f"127.0.0.1:{hello}", "--no-rebalance",
                     "--openai", str(port),
                     "--openai-cors", ALLOWED_ORIGIN, "--openai-key-file", str(key_file),
                     preexec_fn=_limit_files(FILE_LIMITS)) as endpoint:
            # The first plan may predate peer1's figures; the next follows 10 s later.
            wait_for(_settled_plan(dirs), READY_S, "a plan made with both peers, loaded")
            yield Cluster(model_dir, dirs, [head.pid, endpoint.pid], "127.0.0.1", port)


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


def _config(cluster: Cluster) -> dict:
    return json.loads((cluster.model_dir / "config.json").read_text())


@dataclass(frozen=True)
class Answer:
    status: int
    headers: email.message.Message  # names in any case
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)

    def cors(self) -> set[str]:
        return {name.lower() for name in self.headers if name.lower().startswith("access-control")}


def _request(cluster: Cluster, method: str, path: str, body=None, headers=None,
             key: str | None = KEY, chunked: bool = False) -> Answer:
    connection = http.client.HTTPConnection(cluster.host, cluster.port, timeout=ANSWER_S)
    sent = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    try:
        connection.request(method, path, body=body, headers={**sent, **(headers or {})},
                           encode_chunked=chunked)
        answer = connection.getresponse()
        return Answer(answer.status, answer.headers, answer.read())
    finally:
        connection.close()


def _raw(cluster: Cluster, request: bytes) -> Answer:
    """The answer to bytes sent as they are, on a connection of their own."""
    with socket.create_connection((cluster.host, cluster.port), timeout=ANSWER_S) as sock:
        sock.sendall(request)
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        return Answer(answer.status, answer.headers, answer.read())


def _openai_status(cluster: Cluster) -> dict:
    return _status(cluster.dirs[1])["openai"]


def _completion(cluster: Cluster, prompt) -> dict:
    body = json.dumps({"model": cluster.model, "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    answer = _request(cluster, "POST", "/v1/completions", body)
    assert answer.status == 200, answer.body
    return answer.json()


# -- answers -----------------------------------------------------------------------------------


@pytest.mark.cluster
def test_a_streamed_chat_completion_equals_peerd_chat_json(cluster, peerd_chat):
    stream = cluster.client().chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": PROMPT}], stream=True,
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
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].model == cluster.model


@pytest.mark.cluster
def test_a_chat_completion_without_streaming_is_the_same_answer(cluster, peerd_chat):
    answer = cluster.client().chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": PROMPT}],
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
    asked = {"model": cluster.model, "max_tokens": 12, "temperature": 0}
    by_text = openai.completions.create(prompt=text, **asked)
    by_ids = openai.completions.create(prompt=ids, **asked)
    streamed = list(openai.completions.create(prompt=text, stream=True, **asked))
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
            model=cluster.model, prompt=[7], max_tokens=max_tokens, temperature=0).choices[0]
        assert answer.model_extra["token_ids"] == ended[:max_tokens]
        assert answer.finish_reason == reason


@pytest.mark.cluster
def test_models_lists_the_served_model(cluster):
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [cluster.model]


def _stop_inside(text: str) -> tuple[str, str]:
    """A stop string that first appears in the middle of `text`, and the text before it."""
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and text.find(stop) > 0, f"an answer long enough: {text!r}"
    return stop, text[: text.find(stop)]


def _tokens_to_stop(token_ids: list[int], stop: str, model_dir: Path) -> int:
    """How many of the tokens it takes for their text, as streamed, to hold the stop string."""
    text = TextStream(Tokenizer.from_dir(model_dir))
    for n, token in enumerate(token_ids, 1):
        text.add(token)
        if stop in text.text:
            return n
    raise AssertionError(f"{stop!r} is not in the answer")


def _no_sequence_open(cluster: Cluster) -> bool:
    statuses = [_status(d) for d in cluster.dirs]
    return all(statuses) and only_kept([s["dataplane"] for s in statuses if s])


@pytest.mark.cluster
def test_stop_ends_the_text_before_it_and_the_cluster_stops_computing_there(cluster):
    openai = cluster.client()
    asked = {"model": cluster.model, "prompt": "the quick brown fox", "max_tokens": MAX_TOKENS,
             "temperature": 0}
    full = openai.completions.create(**asked).choices[0]
    stop, before = _stop_inside(full.text)
    needed = _tokens_to_stop(full.model_extra["token_ids"], stop, cluster.model_dir)
    whole = openai.completions.create(**asked, stop=[stop, "never in this text"])
    streamed = list(openai.completions.create(**asked, stop=stop, stream=True))
    answer = whole.choices[0]
    assert answer.text == before == "".join(c.choices[0].text for c in streamed)
    assert answer.finish_reason == "stop" == streamed[-1].choices[0].finish_reason
    assert answer.model_extra["token_ids"] == full.model_extra["token_ids"][:needed]
    assert whole.usage.completion_tokens == needed < MAX_TOKENS, "no token past the stop string"
    wait_for(lambda: _no_sequence_open(cluster), ANSWER_S, "every peer to free the answers")


@pytest.mark.cluster
def test_a_streamed_chat_stops_before_its_stop_string(cluster, peerd_chat):
    stop, before = _stop_inside(peerd_chat["text"])
    chunks = list(cluster.client().chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": PROMPT}], stream=True,
        max_tokens=MAX_TOKENS, stop=[stop], **SAMPLING,
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert sum(len(c.choices[0].model_extra.get("token_ids") or []) for c in chunks) == (
        _tokens_to_stop(peerd_chat["token_ids"], stop, cluster.model_dir))


def _log_softmax(row) -> list[float]:
    top = max(row)
    total = math.log(sum(math.exp(x - top) for x in row))
    return [float(x) - top - total for x in row]


def _reference_logprobs(cluster: Cluster, prompt: list[int], answer: list[int]) -> list[list]:
    """The model's log-softmax at each step of the answer, from transformers."""
    rows = logits_along(cluster.model_dir, tuple(prompt + answer))[len(prompt) - 1 : -1]
    return [_log_softmax(row.tolist()) for row in rows]


@pytest.mark.cluster
def test_chat_logprobs_are_the_log_softmax_of_the_final_logits_at_each_step(cluster):
    answer = cluster.client().chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": PROMPT}],
        max_completion_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3, **SAMPLING,
    )
    choice = answer.choices[0]
    tokens = choice.model_extra["token_ids"]
    prompt = Tokenizer.from_dir(cluster.model_dir).prompt_ids(PROMPT)
    assert answer.usage.prompt_tokens == len(prompt)
    expected = _reference_logprobs(cluster, prompt, tokens)
    content = choice.logprobs.content
    assert [entry.model_extra["token_id"] for entry in content] == tokens
    for entry, token, row in zip(content, tokens, expected, strict=True):
        assert entry.logprob == pytest.approx(row[token], abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        third = sorted(row, reverse=True)[2]
        assert len(entry.top_logprobs) == 3
        for top in entry.top_logprobs:
            assert top.logprob == pytest.approx(row[top.model_extra["token_id"]], abs=1e-4)
            assert top.logprob >= third - 1e-4, "among the three most likely"


@pytest.mark.cluster
def test_streamed_completion_logprobs_are_the_log_softmax_at_each_step(cluster):
    tokens, logits = reference(cluster.model_dir, (7,), 8)
    chunks = list(cluster.client().completions.create(
        model=cluster.model, prompt=[7], max_tokens=8, temperature=0, logprobs=2, stream=True))
    steps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == tokens
    assert len(steps) == len(tokens)
    offsets = [step.text_offset[0] for step in steps]
    assert offsets == [sum(len(s.tokens[0]) for s in steps[:i]) for i in range(len(steps))]
    for step, token, row in zip(steps, tokens, logits, strict=True):
        expected = _log_softmax(row.tolist())
        assert step.token_logprobs[0] == pytest.approx(expected[token], abs=1e-4)
        assert step.token_logprobs[0] == pytest.approx(max(expected), abs=1e-4), "greedy"
        assert len(step.top_logprobs[0]) <= 2


@pytest.mark.cluster
def test_a_model_is_retrieved_by_its_id_and_head_answers_without_a_body(cluster):
    openai = cluster.client()
    assert openai.models.retrieve(cluster.model).id == cluster.model
    with pytest.raises(NotFoundError) as raised:
        openai.models.retrieve("gpt-4o")
    assert raised.value.body["code"] == "model_not_found"
    for path in ("/v1/models", f"/v1/models/{cluster.model}"):
        head = _request(cluster, "HEAD", path)
        assert (head.status, head.body) == (200, b"")


# -- HTTP --------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_twenty_requests_share_one_kept_alive_connection(cluster):
    accepted = _openai_status(cluster)["accepted"]
    with cluster.client() as openai:
        answers = [openai.completions.create(model=cluster.model, prompt=[7, i], max_tokens=2,
                                             temperature=0) for i in range(20)]
    assert all(len(a.choices[0].model_extra["token_ids"]) == 2 for a in answers)
    assert _openai_status(cluster)["accepted"] - accepted == 1


@pytest.mark.cluster
def test_a_chunked_request_body_is_answered(cluster):
    body = json.dumps({"model": cluster.model, "prompt": [7, 8, 9], "max_tokens": 8,
                       "temperature": 0}).encode()
    chunked = _request(cluster, "POST", "/v1/completions", iter([body[:10], body[10:]]),
                       chunked=True)
    assert chunked.status == 200, chunked.body
    assert chunked.json()["choices"][0]["token_ids"] == _completion(cluster, [7, 8, 9])[
        "choices"][0]["token_ids"]


@pytest.mark.cluster
def test_a_cors_preflight_from_an_allowed_origin_is_answered_without_a_key(cluster):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    allowed = _request(cluster, "OPTIONS", "/v1/chat/completions", key=None,
                       headers={"Origin": ALLOWED_ORIGIN, **preflight})
    assert allowed.status == 204
    assert allowed.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert {"POST", "GET"} <= set(allowed.headers["Access-Control-Allow-Methods"].split(", "))
    assert allowed.headers["Access-Control-Allow-Headers"] == "Authorization, Content-Type"
    assert int(allowed.headers["Access-Control-Max-Age"]) > 0

    other = _request(cluster, "OPTIONS", "/v1/chat/completions", key=None,
                     headers={"Origin": "http://elsewhere.example", **preflight})
    assert other.status == 403 and other.cors() == set()


@pytest.mark.cluster
def test_answers_to_an_allowed_origin_carry_its_cors_header_and_others_none(cluster):
    body = json.dumps({"model": cluster.model, "prompt": [7], "max_tokens": 2}).encode()
    for stream in (False, True):
        asked = json.dumps({**json.loads(body), "stream": stream}).encode()
        allowed = _request(cluster, "POST", "/v1/completions", asked,
                           headers={"Origin": ALLOWED_ORIGIN})
        assert allowed.status == 200
        assert allowed.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
        other = _request(cluster, "POST", "/v1/completions", asked,
                         headers={"Origin": "http://elsewhere.example"})
        assert other.status == 200 and other.cors() == set()
    refused = _request(cluster, "GET", "/v1/models", key=None, headers={"Origin": ALLOWED_ORIGIN})
    assert refused.status == 401, "the browser can read why"
    assert refused.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN


# -- status codes ------------------------------------------------------------------------------


@pytest.mark.cluster
def test_no_key_or_a_wrong_key_gets_401(cluster):
    for key in (None, "sk-wrong", KEY + "x", KEY[:-1]):
        answer = _request(cluster, "GET", "/v1/models", key=key)
        assert answer.status == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert answer.headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(AuthenticationError):
        cluster.client(key="sk-wrong").models.list()
    assert _request(cluster, "GET", "/v1/models").status == 200


@pytest.mark.cluster
def test_another_model_than_the_served_one_gets_404(cluster):
    with pytest.raises(NotFoundError) as raised:
        cluster.client().chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert cluster.model in error["message"], "it names the model served"


@pytest.mark.cluster
def test_a_prompt_longer_than_the_model_gets_400_context_length_exceeded(cluster):
    positions = _config(cluster)["max_position_embeddings"]
    with pytest.raises(BadRequestError) as raised:
        cluster.client().completions.create(model=cluster.model, prompt=[7] * positions,
                                            max_tokens=1)
    assert raised.value.code == "context_length_exceeded"
    assert f"{positions} positions" in raised.value.message


@pytest.mark.cluster
def test_token_ids_outside_the_vocabulary_get_400_and_peerd_chat_names_its_size(cluster):
    vocab = _config(cluster)["vocab_size"]
    answer = _request(cluster, "POST", "/v1/completions",
                      json.dumps({"model": cluster.model, "prompt": [999999]}).encode())
    assert answer.status == 400 and answer.json()["error"]["code"] == "invalid_request"
    assert f"vocabulary size {vocab}" in answer.json()["error"]["message"]
    chat = subprocess.run(
        [*PEERD, "chat", "--state-dir", str(cluster.dirs[1]), "--prompt-ids", "999999"],
        capture_output=True, text=True, timeout=ANSWER_S,
    )
    assert chat.returncode == 1
    assert f"vocabulary size {vocab}" in chat.stderr and len(chat.stderr.splitlines()) == 1


@pytest.mark.cluster
@pytest.mark.parametrize(
    "method, path, body, status, code",
    [
        ("POST", "/v1/chat/completions", b'{"model": "m", "messages": [', 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b'{"stream": true}', 400, "invalid_messages"),
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
    assert (answer.status, answer.headers.get_content_type()) == (status, "application/json")
    error = answer.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert error["message"] and set(error) == {"message", "type", "param", "code"}
    assert _request(cluster, "GET", "/v1/models").status == 200, "the endpoint keeps answering"


@pytest.mark.cluster
def test_the_openai_client_raises_on_a_bad_request(cluster):
    with pytest.raises(BadRequestError, match='"n" must be 1'):
        cluster.client().chat.completions.create(
            model=cluster.model, messages=[{"role": "user", "content": "hi"}], n=2)


def _post(body: bytes, *headers: bytes, length: bytes | None = None) -> bytes:
    """A raw POST /v1/completions with the key; `length` in place of the body's length."""
    lines = [b"POST /v1/completions HTTP/1.1", b"Host: peerd", b"Authorization: Bearer "
             + KEY.encode(), b"Content-Type: application/json", b"Connection: close",
             b"Content-Length: " + (length or str(len(body)).encode()), *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@pytest.mark.cluster
@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (_post(b"[" * 100_000 + b"]" * 100_000), 400),  # deeper than Python's parser goes
        (_post(b'{"prompt": "\\ud800"}'), 400),  # a lone surrogate
        (_post(b'{"prompt": "caf\xe9"}'), 400),  # Latin-1, not UTF-8
        (_post(b"{}", length="²".encode()), 400),
        (_post(b"{}", b"Content-Length: 2"), 400),  # Content-Length twice
        (_post(b"{}", b"Content-Length: 3"), 400),  # twice, differing
        (_post(b"x" * (MAX_BODY_BYTES + 1)), 413),
        (b"GET /v1/models HTTP/1.1\r\nHost: peerd\r\nX-Bad: a\x00b\r\n\r\n", 400),
    ],
    ids=["deep-json", "lone-surrogate", "not-utf8", "superscript-length", "two-lengths",
         "two-lengths-differing", "oversized", "nul-in-header"],
)
def test_malformed_requests_get_4xx_json_and_no_traceback(cluster, request_bytes, status):
    answer = _raw(cluster, request_bytes)
    assert (answer.status, answer.headers.get_content_type()) == (status, "application/json")
    assert answer.json()["error"]["message"]
    assert _completion(cluster, [7])["choices"][0]["token_ids"], "the next request is answered"
    log = cluster.log(1)
    assert "Traceback" not in log and " ERROR peerd.http" not in log


# -- resources ---------------------------------------------------------------------------------


def _file_limits(pid: int) -> tuple[int, int]:
    line = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def _plan_and_epoch(state_dir: Path) -> tuple:
    status = _status(state_dir)
    return status["plan"]["id"], status["plan"]["epoch"], status["epoch"], status["leader"]


FLOOD = 1500


@pytest.mark.cluster
def test_1500_idle_connections_change_neither_the_plan_nor_the_answers(cluster, peerd_chat):
    assert _file_limits(cluster.pids[1]) == (FILE_LIMITS[1],) * 2, "raised to the hard limit"
    plans = [_plan_and_epoch(d) for d in cluster.dirs]
    before = _openai_status(cluster)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, FLOOD * 2), hard))
    idle: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            idle.append(socket.create_connection((cluster.host, cluster.port), timeout=30))
        wait_for(lambda: sum(_openai_status(cluster)[k] - before[k]
                             for k in ("accepted", "refused")) >= FLOOD,
                 ANSWER_S, "peer1 to take every connection in")
        flooded = _openai_status(cluster)
        # How many were refused depends on how many idle ones the server closed meanwhile
        # (after 30 s), that is on this machine's speed; that it never held more does not.
        assert flooded["connections"] <= DEFAULT_MAX_CONNECTIONS
        assert flooded["refused"] > before["refused"]
        flooded_at = time.monotonic()
        chat = subprocess.run(
            [*PEERD, "chat", "--state-dir", str(cluster.dirs[1]), "--prompt", PROMPT, "--json",
             "--max-tokens", str(MAX_TOKENS), "--temperature", str(SAMPLING["temperature"]),
             "--top-p", str(SAMPLING["top_p"]), "--seed", str(SAMPLING["seed"])],
            capture_output=True, text=True, timeout=ANSWER_S,
        )
        assert chat.returncode == 0, chat.stderr
        assert json.loads(chat.stdout)["token_ids"] == peerd_chat["token_ids"]
        # The flood lasts past the failure timeout: a peer whose own sockets had failed
        # would by then be declared dead and planned around.
        time.sleep(max(0.0, flooded_at + 2 * Timing().dead_after_s - time.monotonic()))
        assert [_plan_and_epoch(d) for d in cluster.dirs] == plans
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: _openai_status(cluster)["connections"] == 0, ANSWER_S,
             "peer1 to see the idle connections closed")
    answer = cluster.client().chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": PROMPT}],
        max_completion_tokens=MAX_TOKENS, **SAMPLING,
    )
    assert answer.choices[0].model_extra["token_ids"] == peerd_chat["token_ids"]
    assert "Too many open files" not in cluster.log(1) and "Traceback" not in cluster.log(1)
