"""`peerd demo`: the whole job on this one machine, with the built-in model.

It writes the built-in checkpoint (random weights: the answer is gibberish, the machinery is
real), starts three real daemons on loopback under memory budgets that only all three
together can hold the model under (peerd/commands/local_cluster.py), waits while the leader plans
and deploys it, shows the cluster, and streams an answer asked on a peer that does not hold
the model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from peerd.api import status
from peerd.commands.chat import stream_answer
from peerd.commands.client import call
from peerd.commands.local_cluster import LocalCluster
from shards.builtin import write_builtin_model


def cmd_demo(args: argparse.Namespace) -> int:
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="peerd-demo-"))
    print(f"demo directory: {root}")
    model_dir = write_builtin_model(root / "builtin-model")
    print(f"built-in model written to {model_dir} (random weights: expect gibberish)")
    with LocalCluster(root, model_dir, peers=3, progress=_say) as cluster:
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
    return 0


def _say(text: str, end: str = "\n") -> None:
    print(text, end=end, flush=True)
