"""`peerd chat` as a person uses it, against real daemons on loopback.

The interactive session runs under a pseudo-terminal that is its controlling terminal, so
Ctrl-C is the terminal's own: the test types the ^C character and the terminal sends SIGINT
to the session, and the up arrow is the bytes a terminal sends for it. Answers are compared
with transformers' greedy answer to the whole conversation so far, turned into ids by the
model's chat template as the head does. The model is a 2-layer BLOOM: ALiBi leaves room (2048
positions) for an answer long enough to stop half-way, and the test session has sharded it
already. It never makes its end-of-sequence token; the test that needs one gives the same
weights another.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sharding import reference, seed_shard_cache
from streaming import only_kept
from terminal import Terminal

from peerd.commands.chat import HISTORY_NAME, PROMPT, STOPPED
from peerd.commands.local_cluster import LocalCluster
from shards.config import read_checkpoint_config
from shards.text_stream import TextStream
from shards.tokenizer import Tokenizer

PEERD = [sys.executable, "-m", "peerd"]
SHORT, LONG = 24, 2000  # new tokens: turns compared with transformers; the answer stopped
ANSWER_S = 120
FREED_S = 10
UP = b"\x1b[A"  # the up arrow, as a terminal sends it
OLD_DEFAULT = 32  # the new tokens an answer stopped at before it ran to its end by default
QUESTION = "one two three"  # the BLOOM's answer makes a new token after OLD_DEFAULT of them


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint) -> Path:
    return hf_checkpoint("bloom")


def _cluster(root: Path, model_dir: Path, peers: int) -> LocalCluster:
    """A cluster whose model peer (LocalCluster's peer0) finds the model sharded already."""
    seed_shard_cache(root / "peer0", model_dir)
    return LocalCluster(root, model_dir, peers=peers, progress=lambda line: None,
                        extra=["--no-rebalance"])  # the tests count one plane's steps


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with _cluster(tmp_path_factory.mktemp("chat"), model_dir, peers=2) as cluster:
        yield cluster


def _answer(session: Terminal) -> str:
    """The answer printed after the last prompt, once the next prompt is shown."""
    return session.read_until("\n" + PROMPT).removesuffix("\n" + PROMPT)


def _chat(state_dir: Path, *args: str) -> list[str]:
    return [*PEERD, "chat", "--state-dir", str(state_dir), *args]


def _expected(model_dir: Path, messages: list[dict[str, str]], new_tokens: int) -> str:
    """The text of transformers' greedy answer to the conversation, as the head streams it."""
    return _text(model_dir, _greedy(model_dir, messages, new_tokens))


def _printed(model_dir: Path, messages: list[dict[str, str]], max_tokens: int) -> str:
    """What the session prints for that answer when asked with `--max-tokens`: its text and,
    when it stopped there rather than at an end-of-sequence token, a notice saying so."""
    tokens = _greedy(model_dir, messages, max_tokens)
    ended = tokens[-1] in read_checkpoint_config(model_dir).eos_token_ids
    notice = "" if ended else f"\n[stopped at --max-tokens {max_tokens}]"
    return _text(model_dir, tokens) + notice


def _greedy(model_dir: Path, messages: list[dict[str, str]], new_tokens: int) -> list[int]:
    prompt = tuple(Tokenizer.from_dir(model_dir).conversation_ids(messages))
    return reference(model_dir, prompt, new_tokens, stop_at_eos=True)[0]


def _text(model_dir: Path, tokens: list[int]) -> str:
    text = TextStream(Tokenizer.from_dir(model_dir))
    for token in tokens:
        text.add(token)
    return text.text


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _dataplanes(cluster: LocalCluster) -> list[dict]:
    return [cluster.status(i)["dataplane"] for i in range(cluster.count)]


def _wait_for(condition, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.mark.cluster
def test_a_terminal_session_is_one_conversation_until_reset(cluster, model_dir):
    first, second, third = "hello world", "how are you today?", "tell me about the fox"
    session = Terminal(_chat(cluster.dirs[1], "--max-tokens", str(SHORT)))
    try:
        session.read_until(PROMPT)
        session.type(f"{first}\n".encode())
        assert _answer(session) == _printed(model_dir, [_user(first)], SHORT)

        session.type(f"{second}\n".encode())
        answer = _expected(model_dir, [_user(first)], SHORT)
        conversation = [_user(first), {"role": "assistant", "content": answer}, _user(second)]
        expected = _printed(model_dir, conversation, SHORT)
        assert expected != _printed(model_dir, [_user(second)], SHORT), "the history matters"
        assert _answer(session) == expected

        session.type(b"/reset\n")
        assert "cleared" in session.read_until(PROMPT)
        session.type(f"{third}\n".encode())
        assert _answer(session) == _printed(model_dir, [_user(third)], SHORT)

        session.type(b"\x03")  # Ctrl-C at the prompt leaves
        assert session.process.wait(timeout=10) == 0
    finally:
        session.close()


@pytest.mark.cluster
def test_the_up_arrow_asks_an_earlier_question_again_in_this_session_and_the_next(
    cluster, model_dir
):
    question = "hello world"
    history = cluster.dirs[0] / HISTORY_NAME
    history.unlink(missing_ok=True)  # the other sessions here run on peer1
    expected = _printed(model_dir, [_user(question)], SHORT)
    session = Terminal(_chat(cluster.dirs[0], "--max-tokens", str(SHORT)))
    try:
        session.read_until(PROMPT)
        session.type(f"{question}\n".encode())
        assert _answer(session) == expected
        session.type(b"/reset\n")
        assert "cleared" in session.read_until(PROMPT)
        session.type(UP + UP + b"\n")  # past /reset to the question
        assert _answer(session) == expected, "the same question, asked afresh"
        session.type(b"\x04")
        assert session.process.wait(timeout=10) == 0
    finally:
        session.close()
    assert history.read_text().splitlines() == [question, "/reset", question]

    session = Terminal(_chat(cluster.dirs[0], "--max-tokens", str(SHORT)))
    try:
        session.read_until(PROMPT)
        session.type(UP + b"\n")
        assert _answer(session) == expected
        session.type(b"\x03")
        assert session.process.wait(timeout=10) == 0
    finally:
        session.close()


@pytest.mark.cluster
def test_ctrl_c_stops_the_answer_on_every_peer_and_the_session_goes_on(cluster):
    before = [plane["steps"] for plane in _dataplanes(cluster)]
    session = Terminal(_chat(cluster.dirs[1], "--max-tokens", str(LONG)))
    try:
        session.read_until(PROMPT)
        session.type(b"tell me a long story about the sea\n")
        session.wait_for_output()
        session.type(b"\x03")
        assert STOPPED in session.read_until(PROMPT)
        _wait_for(lambda: only_kept(_dataplanes(cluster)),
                  "every peer to free the stopped answer", FREED_S)
        ran = [p["steps"] - b for p, b in zip(_dataplanes(cluster), before, strict=True)]
        assert all(0 < steps < LONG // 2 for steps in ran), (
            f"steps of the stopped answer per peer: {ran}; it ran on every peer, not to its end"
        )

        session.type(b"/help\n")
        assert "/reset" in session.read_until(PROMPT)
        session.type(b"\x04")  # Ctrl-D: end of input
        assert session.process.wait(timeout=10) == 0
    finally:
        session.close()


@pytest.mark.cluster
def test_piped_lines_are_one_conversation_with_the_sampling_flags_on_every_turn(
    cluster, model_dir
):
    head = cluster.dirs[0]
    flags = ["--max-tokens", str(SHORT), "--temperature", "1.5", "--top-k", "50", "--seed", "11"]
    lines = b"hello world\nand the fox?\n/exit\nnot asked\n"
    piped = subprocess.run(_chat(head, *flags), input=lines, capture_output=True,
                           timeout=ANSWER_S)
    assert piped.returncode == 0, piped.stderr
    tokenizer = Tokenizer.from_dir(model_dir)

    def once(messages: list[dict[str, str]], *args: str) -> str:
        ids = ",".join(map(str, tokenizer.conversation_ids(messages)))
        done = subprocess.run(_chat(head, "--prompt-ids", ids, "--json", *args),
                              capture_output=True, timeout=ANSWER_S)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["text"]

    first = once([_user("hello world")], *flags)
    conversation = [_user("hello world"), {"role": "assistant", "content": first},
                    _user("and the fox?")]
    second = once(conversation, *flags)
    assert second != once(conversation, "--max-tokens", str(SHORT)), "sampling matters"
    assert piped.stdout.decode() == f"{first}\n{second}\n"
    assert piped.stderr.decode().count(PROMPT) == 3  # none after /exit


@pytest.mark.cluster
def test_a_model_without_a_tokenizer_asks_for_token_ids(model_dir, tmp_path):
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with _cluster(tmp_path / "cluster", bare, peers=1) as cluster:
        state_dir = cluster.dirs[0]
        interactive = subprocess.run(_chat(state_dir), input=b"hello\n", capture_output=True,
                                     timeout=ANSWER_S)
        once = subprocess.run(_chat(state_dir, "--prompt", "hello"), capture_output=True,
                              timeout=ANSWER_S)
        for done in (interactive, once):
            assert done.returncode == 1
            last = done.stderr.decode().splitlines()[-1]  # after the prompt, if any
            assert "peerd: the model has no tokenizer" in last and "--prompt-ids" in last
        assert len(once.stderr.decode().splitlines()) == 1
        ids = subprocess.run(
            _chat(state_dir, "--prompt-ids", "5,6,7", "--max-tokens", str(SHORT), "--json"),
            capture_output=True, timeout=ANSWER_S,
        )
        assert ids.returncode == 0, ids.stderr
        expected, _ = reference(bare, (5, 6, 7), SHORT, stop_at_eos=True)
        assert json.loads(ids.stdout)["token_ids"] == expected


@pytest.fixture(scope="module")
def eos_model(hf_checkpoint, model_dir) -> Path:
    """The module's BLOOM (the same weights) with, as its end-of-sequence token, the first
    token its greedy answer to QUESTION makes anew after OLD_DEFAULT tokens: an answer that
    runs to its end makes more than the old default."""
    tokens = _greedy(model_dir, [_user(QUESTION)], 2 * OLD_DEFAULT)
    end = next(i for i in range(OLD_DEFAULT, len(tokens)) if tokens[i] not in tokens[:i])
    eos_dir = hf_checkpoint("bloom", eos_token_id=tokens[end])
    assert _greedy(eos_dir, [_user(QUESTION)], 2 * OLD_DEFAULT) == tokens[: end + 1]
    return eos_dir


@pytest.mark.cluster
def test_an_answer_runs_to_its_end_unless_max_tokens_cuts_it_which_is_said(eos_model, tmp_path):
    expected = _greedy(eos_model, [_user(QUESTION)], 2 * OLD_DEFAULT)
    with _cluster(tmp_path / "cluster", eos_model, peers=1) as cluster:
        whole = subprocess.run(_chat(cluster.dirs[0], "--prompt", QUESTION, "--json"),
                               capture_output=True, timeout=ANSWER_S)
        assert whole.returncode == 0, whole.stderr
        done = json.loads(whole.stdout)
        assert done["token_ids"] == expected and len(expected) > OLD_DEFAULT
        assert done["finish_reason"] == "stop"

        printed = subprocess.run(_chat(cluster.dirs[0], "--prompt", QUESTION),
                                 capture_output=True, timeout=ANSWER_S)
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout.decode() == _text(eos_model, expected) + "\n"
        assert printed.stderr == b""

        cut = subprocess.run(_chat(cluster.dirs[0], "--prompt", QUESTION, "--max-tokens", "8"),
                             capture_output=True, timeout=ANSWER_S)
        assert cut.returncode == 0, cut.stderr
        assert cut.stdout.decode() == _text(eos_model, expected[:8]) + "\n"
        assert cut.stderr.decode() == "[stopped at --max-tokens 8]\n"


def test_a_session_without_a_daemon_fails_before_the_first_prompt(tmp_path):
    done = subprocess.run(_chat(tmp_path), input=b"hello\n", capture_output=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.decode().startswith("peerd: no daemon is running")
    assert len(done.stderr.splitlines()) == 1 and PROMPT not in done.stderr.decode()
