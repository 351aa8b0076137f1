"""Sharded test models, exported once per test session and shared by every test module.

Exporting takes seconds per model, so results live in one state directory for the test run
(`state_dir()`, laid out as `peerd` lays out its own: `<state>/shards/<key>`), which lets
subprocess runs of the real CLI reuse them through PEERD_STATE_DIR. Under pytest it is the
run's (tests/run_state.py), shared by both xdist workers: a worker that needs a model the
other is exporting waits for it. Treat them as read-only.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import run_state
import torch
import transformers

from shards.cache import ShardOptions, ShardResult, shard, shard_key
from shards.cli import SHARDS_SUBDIR
from shards.manifest import Manifest, Quant
from shards.source import open_model


@cache
def state_dir() -> Path:
    shared = run_state.shared()
    if shared is not None:
        return shared
    path = Path(tempfile.mkdtemp(prefix="peerd-test-state-"))
    atexit.register(shutil.rmtree, path, True)
    return path


@cache
def sharded(model_dir: Path, quant: Quant = Quant.NONE, granularity: str = "half") -> ShardResult:
    options = ShardOptions(quant, granularity)
    with _alone(shard_key(open_model(model_dir).digest(), options)):
        return shard(model_dir, None, shard_root=state_dir() / SHARDS_SUBDIR, options=options)


@contextlib.contextmanager
def _alone(key: str) -> Iterator[None]:
    """Held while this process shards the result `key`: another worker that needs it waits,
    then finds it done."""
    locks = state_dir() / "test-locks"
    locks.mkdir(exist_ok=True)
    with (locks / key).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def seed_shard_cache(state_dir: Path, model: Path) -> Manifest:
    """Copy the session's sharded `model` into a daemon's state directory, where its model
    host (or `LocalCluster`'s `peerd shard`) finds it ready, as on a device that sharded the
    model before: the daemon tests are about the cluster, and exporting again in every one
    of them costs seconds each. A copy, not links: some tests damage the files they get."""
    result = sharded(model)
    target = state_dir / SHARDS_SUBDIR / result.directory.name
    if not target.exists():
        shutil.copytree(result.directory, target)
    return result.manifest


@cache
def _transformers_model(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()


@cache
def reference(model_dir: Path, prompt: tuple[int, ...], new_tokens: int, stop_at_eos=False):
    """transformers' greedy tokens and the logits rows they came from (float32, eager)."""
    model = _transformers_model(model_dir)
    ids = torch.tensor([prompt])
    eos = {} if stop_at_eos else {"eos_token_id": None}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **eos)
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :]
    return out[0, len(prompt) :].tolist(), logits.numpy().astype(np.float32)


@cache
def logits_along(model_dir: Path, ids: tuple[int, ...]) -> np.ndarray:
    """transformers' logits rows (float32, eager) at every position of `ids`, one forward."""
    model = _transformers_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)


def exit_head(model_dir: Path):
    """transformers' final norm and LM head of the model: the early exit, as a function of
    a hidden state."""
    model = _transformers_model(model_dir)
    body = model.model if hasattr(model, "model") else model.transformer
    norm = body.norm if hasattr(body, "norm") else body.ln_f
    return lambda hidden: model.lm_head(norm(hidden))


@cache
def exit_reference(model_dir: Path, layer: int, prompt: tuple[int, ...],
                   new_tokens: int) -> list[int]:
    """Greedy tokens, each transformers' argmax of lm_head(norm(hidden_states[layer])) for
    the tokens before it."""
    model, head = _transformers_model(model_dir), exit_head(model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer]
            ids.append(int(head(hidden[0, -1]).argmax()))
    return ids[len(prompt):]


def expected_along(model_dir: Path, layer: int, prompt: tuple[int, ...], tokens: list[int],
                   degraded: set[int]) -> list[int]:
    """Token by token, what an answer of `tokens` should hold, each given the tokens before
    it: the exit's argmax after `layer` layers at the indices in `degraded`, the full
    model's elsewhere (transformers, float32, one forward over the whole answer)."""
    model, head = _transformers_model(model_dir), exit_head(model_dir)
    ids = torch.tensor([[*prompt, *tokens[:-1]]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        rows = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))
        exits = head(out.hidden_states[layer][0, rows.start:rows.stop])
        full = out.logits[0, rows.start:rows.stop]
    return [int((exits if index in degraded else full)[index].argmax())
            for index in range(len(tokens))]


@cache
def share_units(model_dir: Path, weights: tuple[float, ...]):
    """The model's tensor-parallel share units for `weights`, exported once per session."""
    from shards.share_units import shares_for

    directory = Path(tempfile.mkdtemp(prefix="shares-", dir=state_dir()))
    return shares_for(model_dir, sharded(model_dir).manifest, weights, directory)


def off_by_one(apply):
    """`shards.template.Template.apply` (given as `apply`), with every weight it writes off
    by one: a reused graph that computes otherwise than its torch module."""

    def corrupted(self, names, module, directory, relative):
        written = apply(self, names, module, directory, relative)
        weights = np.memmap(directory / written.files[1].name, dtype=np.float32, mode="r+")
        weights += 1
        weights.flush()
        return written

    return corrupted
