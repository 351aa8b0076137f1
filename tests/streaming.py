"""Chats streamed from real daemons' sockets in background threads, and the model set-up
that the survival and rebalancing tests share: every peer's cache pre-sharded, and answers
long enough to be interrupted.

A test that needs an answer in flight when something happens to the cluster asks for one
far longer than the event takes and ends it itself (`Answer.end`) once it has seen what it
waited for, rather than hoping that a fixed number of tokens outlasts the cluster's clock."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import netns
from sharding import seed_shard_cache

from peerd.commands.client import chat_events
from peerd.commands.local_cluster import budget_for
from shards.manifest import Manifest

SHARDED_S, DEPLOYED_S, ANSWER_S = 240, 120, 180
NEW_TOKENS = 240  # long enough to be mid-answer when a plan changes
PROMPTS = [[1, 5, 9, 2], [7], [3, 3, 3], [10, 20, 30, 40, 50]]


class Answer(threading.Thread):
    """One chat streamed from a peer's socket: its tokens so far and how it ended."""

    def __init__(self, peer: netns.Peer, prompt: list[int], max_tokens: int = NEW_TOKENS):
        super().__init__(daemon=True)
        self.peer, self.prompt, self.max_tokens = peer, prompt, max_tokens
        self.tokens: list[int] = []
        self.done: dict | None = None
        self.error: str | None = None
        self.ended_at: float | None = None
        self._end = threading.Event()
        self.start()

    def run(self) -> None:
        request = {"prompt_ids": self.prompt, "max_tokens": self.max_tokens}
        try:
            with contextlib.closing(chat_events(self.peer.state_dir, request, ANSWER_S)) as chat:
                for event in chat:
                    if event.get("event") == "token":
                        self.tokens.append(event["token"])
                    else:
                        self.done, self.error = event, event.get("error")
                    if self._end.is_set():
                        break  # closing the connection ends the answer on every peer
        except Exception as exc:  # noqa: BLE001 - the test reports whatever ended the answer
            self.error = f"{type(exc).__name__}: {exc}"
        self.ended_at = time.monotonic()

    @property
    def in_flight(self) -> bool:
        return self.ended_at is None

    def end(self) -> None:
        """Stop reading at the next token (the daemon ends the answer) and wait for that."""
        self._end.set()
        self.join(ANSWER_S)
        assert not self.is_alive(), "the answer did not end after its client left"


def shard_into_caches(model_dir: Path, dirs: list[Path]) -> Manifest:
    for state_dir in dirs:
        manifest = seed_shard_cache(state_dir, model_dir)
    return manifest


def every_peer_with_the_model(model_dir: Path, root: Path, name: str, holders: int):
    """State dirs and `peerd start` arguments for three peers that each serve the model
    (pre-sharded into every cache), with budgets under which `holders` peers hold it."""
    dirs = netns.make_state_dirs(root / name, 3)
    manifest = shard_into_caches(model_dir, dirs)
    # the largest slack that still leaves one peer fewer short: attention units are big
    budget = budget_for(manifest, holders, spare=0.9)
    args = {i: ["--memory-budget", budget, "--model", str(model_dir)] for i in range(3)}
    return dirs, args


def all_in_flight(askers, prompts, expected, attempts: int = 5) -> list[Answer]:
    """Answers to every prompt, all streaming at once. An answer can run to its end before
    the last one starts (a fast machine, a chat forwarded to the head): such an answer must
    still be exact, and the round is asked again, since it shows nothing about a kill."""
    for _ in range(attempts):
        answers = [Answer(askers[i % len(askers)], p) for i, p in enumerate(prompts)]
        netns.wait_for(lambda a=answers: all(len(x.tokens) >= 3 or x.done for x in a),
                       ANSWER_S, "every answer streaming")
        ended = [a for a in answers if a.done]
        if not ended:
            return answers
        for answer in answers:
            answer.end()
        for answer in ended:
            assert answer.error is None, answer.error
            assert answer.tokens == expected[tuple(answer.prompt)]
    raise AssertionError(f"in {attempts} rounds, an answer always ended before the last began")


def only_kept(dataplanes: list[dict]) -> bool:
    """No peer holds K/V but that of the ended answers the head keeps for their
    conversations' next turns (`kept`, counted on the head alone)."""
    kept = sum(d["kept"] for d in dataplanes)
    return all(d["sequences"] == kept for d in dataplanes)


def head_of(peers: list[netns.Peer]) -> netns.Peer | None:
    """The peer that admits the answers of the serving plan (it counts their moves)."""
    return next((p for p in peers if ((p.status() or {}).get("dataplane") or {}).get("head")),
                None)


def serving_plan(peers: list[netns.Peer]) -> dict | None:
    plan = netns.deployed_plan(peers)
    heads = [(p.status() or {}).get("dataplane", {}).get("head") for p in peers]
    return plan if plan and any(heads) else None


@contextlib.contextmanager
def split_cluster(root: Path, model: Path, budget: str, extra: tuple[str, ...] = ()):
    """Three namespaced daemons, the model (a directory or GGUF file) on the first, each
    offering `budget` of memory so that no one holds it and started with `extra` too: yields
    the peers once the model is sharded, a plan of two or more stages is deployed and its
    head accepts chats."""
    dirs = netns.make_state_dirs(root, 3)
    seed_shard_cache(dirs[0], model)
    args = {i: ["--memory-budget", budget, *extra] for i in range(3)}
    args[0] += ["--model", str(model)]
    with netns.cluster(dirs, args) as (_, peers), netns.logs_on_failure(peers):
        netns.wait_for(lambda: netns.sharded_model(peers[0]), SHARDED_S, "the model sharded")
        plan = netns.wait_for(lambda: netns.deployed_plan(peers), DEPLOYED_S, "a deployed plan")
        assert len(plan["stages"]) >= 2
        netns.wait_for(lambda: head_of(peers), DEPLOYED_S, "the head to accept chats")
        yield peers
