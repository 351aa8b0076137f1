"""`peerd demo`: the whole job on this one machine, with the built-in model.

It writes the built-in checkpoint (random weights: the answer is gibberish, the machinery is
real), starts three real daemons on loopback under memory budgets that only all three
together can hold the model under (peerd/commands/local_cluster.py), waits while the leader plans
and deploys it, shows the cluster, and streams an answer asked on a peer that does not hold
the model.

The units the model is sharded into are kept in the user's cache directory
(`$PEERD_CACHE_DIR`, else `$XDG_CACHE_HOME/peerd`, else `~/.cache/peerd`) under their
content address (shards/cache.py: the checkpoint's digest, the options and the exporter), so
a second run skips sharding. Everything else lives in a temporary directory that is removed
however the demo ends: at its end, on an error, on Ctrl-C, SIGTERM or SIGHUP. With
`--write-model DIR` it only writes the built-in checkpoint, for `peerd start --model DIR`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from peerd.api import status
from peerd.commands.chat import stream_answer
from peerd.commands.client import call
from peerd.commands.local_cluster import LocalCluster
from peerd.errors import PeerdError
from shards.builtin import write_builtin_model
from shards.cache import export_running

CACHE_SUBDIR = "demo-shards"  # under the cache directory: the built-in model's units
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.write_model is not None:
        return _write_model(Path(args.write_model))
    with _ended_by_signals():
        if args.dir:
            _demo(Path(args.dir), args)
            return 0
        root = Path(tempfile.mkdtemp(prefix="peerd-demo-"))
        kept = False
        try:
            kept = _demo(root, args)
        finally:
            if not kept:
                shutil.rmtree(root, ignore_errors=True)
    return 0


def cache_dir() -> Path:
    """The user's cache directory for peerd."""
    explicit = os.environ.get("PEERD_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "peerd"


def _demo(root: Path, args: argparse.Namespace) -> bool:
    """Run the demo in `root`; True when its daemons are left running there (--keep)."""
    print(f"demo directory: {root}")
    model_dir = write_builtin_model(root / "builtin-model")
    print(f"built-in model written to {model_dir} (random weights: expect gibberish)")
    shard_cache = cache_dir() / CACHE_SUBDIR
    with LocalCluster(root, model_dir, peers=3, progress=_say,
                      shard_cache=shard_cache) as cluster:
        assert cluster.manifest is not None  # set on entering
        _prune(shard_cache, cluster.manifest.key)
        print(status.render(call(cluster.dirs[0], {"op": "status"})["status"]))
        print(f"\nyou> {args.prompt}\npeer2> ", end="", flush=True)
        request = {"messages": [{"role": "user", "content": args.prompt}],
                   "max_tokens": args.max_tokens}
        done = stream_answer(cluster.dirs[2], request, lambda piece: _say(piece, end=""))
        stats = done["stats"]
        print(f"\n\n{stats['generated_tokens']} tokens, first after "
              f"{stats['time_to_first_token_s']:.3f}s, {stats['tokens_per_second']} tokens/s")
        if args.keep:
            print(f"daemons keep running; chat with: peerd chat --state-dir {cluster.dirs[0]}")
            cluster.detach()
    return args.keep


def _prune(shard_cache: Path, key: str) -> None:
    """Remove what earlier runs left beside the units in use: units of another key (made by
    another version of peerd) and exports cut short, whose process is gone."""
    for entry in shard_cache.iterdir():
        if entry.name != key and not export_running(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _ended_by_signals() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP end the demo by an exception, so that its daemons are
    stopped and its directory removed on the way out; once one came, the others are ignored,
    so that a second Ctrl-C cannot cut that short."""

    def end(signum: int, frame: object) -> None:
        for each in ENDING_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    previous = {each: signal.signal(each, end) for each in ENDING_SIGNALS}
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)


def _write_model(directory: Path) -> int:
    if directory.exists() and not (directory.is_dir() and not any(directory.iterdir())):
        raise PeerdError(f"{directory} exists and is not an empty directory; "
                         "name a new or empty one")
    write_builtin_model(directory)
    print(f"built-in model written to {directory} (a Llama-format checkpoint with random "
          "weights: expect gibberish)")
    print(f"serve it from this device with: peerd start --model {directory}")
    print("and on the others: peerd join TOKEN (from peerd invite), then peerd start")
    return 0


def _say(text: str, end: str = "\n") -> None:
    print(text, end=end, flush=True)
