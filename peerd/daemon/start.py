"""`peerd start`: check the options, load the identity and the cluster secret, refuse a
second daemon on the same state directory, and run the `Daemon` (peerd/daemon/wiring.py)."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path

from peerd import statedir
from peerd.api import openai_settings
from peerd.cluster.discovery import parse_peer
from peerd.cluster.monitor import parse_size
from peerd.control.coordinator import Shapes
from peerd.daemon.wiring import Daemon, Options
from peerd.errors import PeerdError
from peerd.wire.identity import load_identity, load_secret
from planner.groups import FIRST_TOKEN
from shards.early_exit import ExitSettings
from shards.gguf.file import SUFFIX as GGUF_SUFFIX
from shards.gguf.file import is_gguf
from shards.manifest import Quant


def options_from_args(args: argparse.Namespace) -> Options:
    if args.interface:
        try:
            ipaddress.ip_address(args.interface)
        except ValueError:
            raise PeerdError(f"--interface {args.interface!r} is not an IP address") from None
    if not 0 <= args.port <= 65533:
        raise PeerdError(f"--port {args.port} is out of range (it uses PORT..PORT+2)")
    try:
        exits = ExitSettings(args.early_exit, args.speculative, args.exit_layer)
    except ValueError as exc:
        raise PeerdError(str(exc)) from None
    if args.standalone and not exits.enabled:
        raise PeerdError("--standalone answers from the exit: give --early-exit or "
                         "--speculative too")
    shapes = _shapes(args, exits)
    model = Path(args.model) if args.model else None
    if model and not (model.is_dir() or (model.is_file() and is_gguf(model))):
        raise PeerdError(f"--model {args.model} is neither a checkpoint directory nor a "
                         f"{GGUF_SUFFIX} file")
    return Options(
        state_dir=statedir.resolve(args.state_dir),
        interface=args.interface,
        port=args.port,
        memory_budget=parse_size(args.memory_budget) if args.memory_budget else None,
        static_peers=tuple(parse_peer(p) for p in args.peer),
        battery_file=args.battery_file,
        fp16_wire=args.fp16_wire,
        rebalance=not args.no_rebalance,
        objective=args.objective,
        shapes=shapes,
        model=args.model,
        quant=args.quant,
        openai=openai_settings.settings_from_args(args),
        exits=exits,
        standalone=args.standalone,
    )


def _shapes(args: argparse.Namespace, exits: ExitSettings) -> Shapes | None:
    """How this peer plans as leader: --tensor-parallel N or --shapes, else None
    (pipelines)."""
    size = args.tensor_parallel
    if size is not None and size < 2:
        raise PeerdError(f"--tensor-parallel {size}: a group has 2 peers or more")
    if size is not None and args.shapes:
        raise PeerdError("--tensor-parallel fixes the shape; --shapes lets the planner choose "
                         "it: give one")
    grouped = size is not None or args.shapes
    if grouped and exits.enabled:
        raise PeerdError("--early-exit and --speculative do not run on groups yet: leave "
                         "them out with --tensor-parallel or --shapes")
    if grouped and args.quant != Quant.NONE:
        raise PeerdError("groups run unquantised share units: leave --quant out with "
                         "--tensor-parallel or --shapes")
    if args.objective == FIRST_TOKEN and not grouped:
        raise PeerdError("--objective first-token plans shapes: give --shapes or "
                         "--tensor-parallel N too")
    return Shapes(size) if grouped else None


def _refuse_second_daemon(state_dir: Path) -> None:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(statedir.socket_path(state_dir)))
    except OSError:
        return
    finally:
        probe.close()
    raise PeerdError(f"a daemon is already running for {state_dir}")


def _configure_logging(name: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s peerd[{name}] %(levelname)s %(name)s: %(message)s",
    )


def _event_loop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def cmd_start(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    identity = load_identity(options.state_dir)
    secret = load_secret(options.state_dir)
    _refuse_second_daemon(options.state_dir)
    _configure_logging(identity.name)
    os.umask(0o077)
    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        runner.run(Daemon(identity, secret, options).run())
    return 0
