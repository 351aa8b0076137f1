"""Acceptance: a three-namespace cluster serves a GGUF file given to the model peer, and a
text chat asked on another peer answers with `peerd generate`'s answer for the same file.

The GGUF is written from a random Llama checkpoint with a SentencePiece-style tokenizer, as
llama.cpp's converter writes one (Q8_0 weights, the vocabulary in its metadata). Only the
model peer has the file; a memory budget keeps any one peer from holding the model, so the
answer crosses peers that received units, never the file.
"""

from __future__ import annotations

import json
import os
import subprocess

import netns
import pytest
from gguf_files import write_gguf
from sharding import state_dir
from streaming import split_cluster

pytestmark = [pytest.mark.cluster, netns.needs_namespaces]

ANSWER_S = 120
NEW_TOKENS = 16
PROMPT = "Héllo, how are the 猫 today?"


@pytest.fixture(scope="module")
def gguf_cluster(hf_checkpoint, tmp_path_factory):
    model_dir = hf_checkpoint("llama", layers=4, tokenizer="spm")
    path = write_gguf(model_dir, tmp_path_factory.mktemp("gguf") / "home-llama.Q8_0.gguf",
                      "Q8_0")
    with split_cluster(tmp_path_factory.mktemp("chat-gguf"), path, "1MB") as peers:
        yield path, peers


def _run(*args: str, env: dict | None = None) -> dict:
    done = subprocess.run([*netns.PEERD, *args, "--max-tokens", str(NEW_TOKENS), "--json"],
                          capture_output=True, text=True, timeout=ANSWER_S, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_text_chat_on_a_peer_without_the_file_equals_peerd_generate(gguf_cluster):
    path, peers = gguf_cluster
    status = peers[0].status()
    assert status["model"]["name"] == "home-llama.Q8_0"
    local = _run("generate", str(path), "--prompt", PROMPT, "--parts", "2",
                 env={**os.environ, "PEERD_STATE_DIR": str(state_dir())})  # the peers' units
    assert local["token_ids"] and local["text"]
    answer = _run("chat", "--state-dir", str(peers[2].state_dir), "--prompt", PROMPT)
    assert answer["token_ids"] == local["token_ids"]
    assert answer["text"] == local["text"]
    for peer in peers[1:]:
        assert not list(peer.state_dir.rglob("*.gguf")), "peers receive units, not the file"
