"""Command-line entry point: the argument contract from DESIGN.md.

Each sub-command names its handler as "module:function"; the module is imported only when
that command runs, so `peerd plan` never imports torch and `peerd status` starts fast.
A handler takes the parsed arguments and returns an exit code. Exit codes: 0 success,
2 usage error (argparse), 1 anything else with a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from peerd.errors import PeerdError
from shards.manifest import Quant


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of token ids: {text!r}"
        ) from None


def _add_early_exit(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument(
        "--early-exit", type=float, metavar="THETA",
        help=f"{who} answers a token itself when the model's own final norm and LM head, "
        "applied after --exit-layer layers, give it a probability of at least THETA (e.g. "
        "0.8; off by default); the later stages still run the step, so their K/V stays the "
        "full model's",
    )
    p.add_argument(
        "--exit-layer", type=int, metavar="N",
        help="decoder layers before the exit (default: all those of the first stage)",
    )
    p.add_argument(
        "--speculative", type=int, default=0, metavar="N",
        help=f"{who} drafts up to N tokens from the exit and the full model checks them in "
        "one step: greedy answers stay exactly the full model's and sampled ones follow its "
        "distribution (speculative sampling), with fewer trips through the stages (off by "
        "default; not for answers that ask log-probabilities)",
    )


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        help="where identity, secret, unit cache and the local socket live "
        "(default: $PEERD_STATE_DIR, else $XDG_STATE_HOME/peerd, else ~/.local/state/peerd)",
    )


def _add_sampling(p: argparse.ArgumentParser, max_tokens_help: str | None = None) -> None:
    """The sampling flags; `max_tokens_help` given: --max-tokens has no default, and says so."""
    if max_tokens_help is None:
        p.add_argument("--max-tokens", type=int, default=32,
                       help="new tokens to generate (default 32)")
    else:
        p.add_argument("--max-tokens", type=int, help=max_tokens_help)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 means greedy (default 0)"
    )
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


def _add_prompt(p: argparse.ArgumentParser, required: bool) -> None:
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("--prompt", help="prompt text (chat template applied for chat models)")
    group.add_argument("--prompt-ids", type=_ids, help="prompt as token ids, e.g. 1,2,3")


class _QuantAction(argparse.Action):
    """`--quant Q` and its alias `--int8` (= `--quant int8`): both may be given when they
    agree; `--quant int4 --int8` is a usage error."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = Quant(self.const or values)
        flag = f"{option_string} {values}" if values else option_string
        given = getattr(namespace, "_quant_given", None)
        if given is not None and given[1] is not value:
            parser.error(f"{flag} conflicts with {given[0]}")
        namespace._quant_given = (flag, value)
        setattr(namespace, self.dest, value)


def _add_quant(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--quant", action=_QuantAction, choices=[q.value for q in Quant], default=Quant.NONE,
        help=f"{what}: none (float32, default), int8 (dynamic quantisation, about 0.25x the "
        "bytes) or int4 (weight-only blocks of 32, about 0.16x)",
    )
    p.add_argument("--int8", action=_QuantAction, nargs=0, const=Quant.INT8.value,
                   dest="quant", help="the same as --quant int8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peerd",
        description="Distributed LLM inference across the trusted devices of one home.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("init", help="create a new cluster secret and this peer's identity")
    _add_state_dir(p)
    p.add_argument("--name", help="human-readable peer name (default: host name)")
    p.set_defaults(handler="peerd.commands.trust_commands:cmd_init")

    p = sub.add_parser("invite", help="print a join token for another device")
    _add_state_dir(p)
    p.set_defaults(handler="peerd.commands.trust_commands:cmd_invite")

    p = sub.add_parser("join", help="join a cluster with a token from `peerd invite`")
    p.add_argument("token")
    _add_state_dir(p)
    p.add_argument("--name", help="human-readable peer name (default: host name)")
    p.set_defaults(handler="peerd.commands.trust_commands:cmd_join")

    p = sub.add_parser("start", help="run the daemon on this device")
    _add_state_dir(p)
    p.add_argument(
        "--model", help="model served by this peer: a checkpoint directory or a GGUF file"
    )
    _add_quant(p, "the weights of the units this peer makes of --model (every peer runs them)")
    p.add_argument("--interface", help="IP address to listen and advertise on")
    p.add_argument("--port", type=int, default=0, help="ZeroMQ port (default: any free port)")
    p.add_argument(
        "--memory-budget", help="cap on memory offered to the planner, e.g. 300MB or 2GiB"
    )
    p.add_argument(
        "--peer", action="append", default=[], metavar="HOST:PORT",
        help="static peer for networks that block multicast (repeatable)",
    )
    p.add_argument(
        "--battery-file",
        help='JSON file {"percent": P, "plugged": B} read instead of a battery sensor',
    )
    p.add_argument(
        "--openai", metavar="[HOST:]PORT",
        help="serve an OpenAI-compatible HTTP API there (off by default; PORT alone means "
        "127.0.0.1:PORT; no key unless --openai-key-file)",
    )
    p.add_argument(
        "--openai-cors", action="append", default=[], metavar="ORIGIN",
        help="let web pages from ORIGIN (e.g. http://localhost:3000, or *) call the OpenAI "
        "endpoint from the browser (repeatable; none by default)",
    )
    p.add_argument(
        "--openai-key-file", metavar="FILE",
        help="require 'Authorization: Bearer KEY' on the OpenAI endpoint, KEY the one line "
        "in FILE",
    )
    p.add_argument(
        "--openai-max-connections", type=int, metavar="N",
        help="open connections the OpenAI endpoint accepts at once; more are answered 503 "
        "(default 256)",
    )
    p.add_argument(
        "--fp16-wire", action="store_true",
        help="send this peer's activations to other stages as float16 (half the bytes)",
    )
    p.add_argument(
        "--objective", choices=["throughput", "latency", "first-token"], default="throughput",
        help="what the leader's plans optimise: throughput (default; many answers at once "
        "run at the slowest stage's pace), latency (the time of one token through every "
        "stage: for answers asked one at a time, e.g. one person chatting) or first-token "
        "(the time to the first token of a 512-token prompt; with --shapes or "
        "--tensor-parallel)",
    )
    p.add_argument(
        "--tensor-parallel", type=int, metavar="N",
        help="as leader, serve every stage by a group of N peers splitting each layer "
        "(tensor parallel; N >= 2, at most the peers and the model's KV-head groups)",
    )
    p.add_argument(
        "--shapes", action="store_true",
        help="as leader, let the planner choose pipelines, groups of peers sharing each "
        "layer, or both, whichever is fastest for --objective (default: pipelines)",
    )
    p.add_argument(
        "--no-rebalance", action="store_true",
        help="as leader, keep a deployed plan when load or battery change (default: move "
        "work when a better plan is predicted 15%% faster for a few seconds)",
    )
    _add_early_exit(p, "this peer, when it holds the plan's first stage,")
    p.add_argument(
        "--standalone", action="store_true",
        help="when the peers behind the exit are gone and no plan can serve, answers in "
        "flight go on from the exit alone, every token marked degraded, and continue at "
        "full depth once the cluster serves again (off by default)",
    )
    p.set_defaults(handler="peerd.daemon.start:cmd_start")

    p = sub.add_parser("stop", help="stop the local daemon cleanly")
    _add_state_dir(p)
    p.set_defaults(handler="peerd.commands.client:cmd_stop")

    p = sub.add_parser("status", help="show the cluster as the local daemon sees it")
    _add_state_dir(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler="peerd.commands.client:cmd_status")

    p = sub.add_parser("chat", help="chat with the cluster through the local daemon")
    _add_state_dir(p)
    _add_prompt(p, required=False)
    _add_sampling(p, max_tokens_help="new tokens at most (default: until the model's "
                  "end-of-sequence token or the context limit)")
    p.add_argument("--json", action="store_true", help="print one JSON object when done")
    p.set_defaults(handler="peerd.commands.chat:cmd_chat")

    p = sub.add_parser(
        "generate", help="run a model split into K parts in this process (no daemon)"
    )
    p.add_argument("model_dir", metavar="MODEL", help="a checkpoint directory or a GGUF file")
    _add_prompt(p, required=True)
    p.add_argument("--parts", type=int, default=1, help="number of stages K (default 1)")
    _add_sampling(p)
    _add_quant(p, "weights of the units")
    p.add_argument("--fp16-wire", action="store_true", help="float16 activations between stages")
    p.add_argument("--tensor-parallel", type=int, metavar="N",
                   help="run every stage as N tensor-parallel shares in this process, every "
                   "exchange through the wire codec (float32; not with --early-exit, "
                   "--speculative or --quant)")
    _add_early_exit(p, "the first stage")
    p.add_argument("--json", action="store_true", help="print one JSON object when done")
    p.set_defaults(handler="peerd.commands.generate:cmd_generate")

    p = sub.add_parser("shard", help="split a model into ONNX units with a manifest")
    p.add_argument("model_dir", metavar="MODEL", help="a checkpoint directory or a GGUF file")
    p.add_argument("--out", help="output directory (default: the shard cache in the state dir)")
    _add_quant(p, "weights of the units")
    p.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    p.set_defaults(handler="shards.cli:cmd_shard")

    p = sub.add_parser("plan", help="solve an assignment of units to peers")
    p.add_argument(
        "--cluster", required=True, metavar="FILE", help="cluster JSON (docs/planner.md)"
    )
    p.add_argument("--units", required=True, metavar="FILE", help="units JSON or a manifest.json")
    p.add_argument("--objective", choices=["latency", "throughput", "first-token"],
                   default="throughput",
                   help="latency: one decode token; throughput: tokens/s of many answers; "
                        "first-token: time to the first token of a --prompt-tokens prompt "
                        "(with --shapes only). Default: throughput")
    p.add_argument("--solver", choices=["milp", "dp", "even", "memory"], default="milp")
    p.add_argument("--shapes", action="store_true",
                   help="also weigh groups (peers sharing each layer, Galaxy's tensor and "
                        "sequence parallelism) against pipelines, and print the best of each "
                        "shape; units need share_grains (docs/planner.md)")
    p.add_argument("--prompt-tokens", type=int, default=512, metavar="N",
                   help="prompt length the first-token figures assume (default 512)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler="peerd.commands.plan_command:cmd_plan")

    p = sub.add_parser(
        "demo",
        help="three peers on this machine serve the built-in model and answer a chat",
        description="Start three daemons on loopback with the built-in model (random "
        "weights: the answer is gibberish, the distributed machinery is real), wait until "
        "the model is sharded, planned and deployed, show the cluster and stream an answer. "
        "The model's units are kept in $PEERD_CACHE_DIR, else $XDG_CACHE_HOME/peerd, else "
        "~/.cache/peerd, so later runs skip sharding.",
    )
    p.add_argument("--dir", help="where to put the model and the peers' state (default: a "
                   "new temporary directory, removed when the demo ends)")
    p.add_argument("--write-model", metavar="DIR", help="only write the built-in checkpoint "
                   "to DIR (new or empty), to start on real devices with peerd start --model DIR")
    p.add_argument("--prompt", default="Hello! Tell me a story about the sea.")
    p.add_argument("--max-tokens", type=int, default=24, help="new tokens (default 24)")
    p.add_argument("--keep", action="store_true", help="leave the daemons running afterwards")
    p.set_defaults(handler="peerd.commands.demo:cmd_demo")

    p = sub.add_parser("dashboard", help="live Textual dashboard of the local daemon")
    _add_state_dir(p)
    p.set_defaults(handler="tui.app:cmd_dashboard")
    return parser


def _resolve(handler: str):
    module_name, function_name = handler.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(_resolve(args.handler)(args) or 0)
    except PeerdError as exc:
        print(f"peerd: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`peerd status | head`): stop quietly. Pointing stdout at
        # /dev/null keeps the interpreter's final flush from complaining a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
