"""One real daemon whose state directory is on a full filesystem (a small tmpfs, filled).

The daemon starts with `--model`, so the one thing it must write is the model's units: the
sharding fails at once with one line naming the full directory, and `peerd chat` says so
within a second instead of hanging; the daemon keeps serving its local API. Once space is
freed it shards again by itself, and the next chat is answered exactly.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from disks import fill, tmpfs
from netns import wait_for
from sharding import reference

from peerd.commands.chat import stream_answer
from peerd.commands.client import call
from peerd.errors import PeerdError

pytestmark = pytest.mark.cluster

PROMPT, NEW_TOKENS = [3, 1, 4, 1, 5], 8
PEERD = [sys.executable, "-m", "peerd"]
FAST_S = 5.0  # generous against the 60 s hang of issue 22; the figure is printed


def _model(state_dir) -> dict:
    try:
        return call(state_dir, {"op": "status"})["status"]["model"] or {}
    except PeerdError:  # not listening yet
        return {}


def _chat_cli(state_dir) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        [*PEERD, "chat", "--state-dir", str(state_dir), "--prompt-ids", "3,1,4,1,5",
         "--max-tokens", str(NEW_TOKENS)],
        capture_output=True, text=True, timeout=120,
    )
    return done, time.monotonic() - started


def _answered(state_dir) -> list[int] | None:
    try:
        return stream_answer(state_dir, {"prompt_ids": PROMPT, "max_tokens": NEW_TOKENS})[
            "token_ids"]
    except PeerdError:
        return None


def test_a_full_state_directory_fails_fast_naming_it_and_recovers_once_freed(
    hf_checkpoint, tmp_path,
):
    model_dir = hf_checkpoint("llama", layers=2)
    expected = reference(model_dir, tuple(PROMPT), NEW_TOKENS, stop_at_eos=True)[0]
    log = tmp_path / "daemon.log"  # off the full disk, so that the test can read all of it
    with tmpfs(tmp_path / "state", "16m") as state_dir:
        assert subprocess.run([*PEERD, "init", "--state-dir", str(state_dir)]).returncode == 0
        ballast = state_dir / "ballast"
        fill(ballast)
        with log.open("w") as output:
            daemon = subprocess.Popen(
                [*PEERD, "start", "--state-dir", str(state_dir), "--interface", "127.0.0.1",
                 "--memory-budget", "300MB", "--model", str(model_dir)],
                stdout=output, stderr=subprocess.STDOUT,
            )
        try:
            failed = wait_for(lambda: _model(state_dir).get("state") == "failed"
                              and _model(state_dir), 120, "the sharding to fail")
            full = f"no space left in {state_dir / 'shards'}"
            assert full in failed["detail"] and "\n" not in failed["detail"]

            chat, seconds = _chat_cli(state_dir)
            print(f"chat on a full disk failed in {seconds:.2f}s: {chat.stderr.strip()}")
            assert chat.returncode == 1 and seconds < FAST_S
            assert full in chat.stderr and len(chat.stderr.strip().splitlines()) == 1
            assert daemon.poll() is None and call(state_dir, {"op": "status"})["ok"]

            ballast.unlink()
            assert wait_for(lambda: _answered(state_dir), 180,
                            "an answer once space was freed") == expected
            assert daemon.poll() is None
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    assert "Traceback" not in log.read_text()
