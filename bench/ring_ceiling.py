"""How close a split over three processes can come to the whole model, by shape of data path.

`bench.pipeline` measures the daemons: one answer split over three of them against the
whole model in one process (target >= 0.95). This bench measures what any split can reach
on this machine, with nothing of the daemons but their stages: three processes in a ring,
each holding a third of the bench model's units (joined whole, the daemons' options),
receiving a step's input over CURVE ZeroMQ (`peerd.wire.protocol`'s `StageData`), running
its stage and sending the result on; the last one sends the greedy token back to the
first. Beside them, the whole model in a process of its own with `peerd generate`'s
options. The ways:

  one process  the three stages one after the other in one process: no transport at all
  thread       the compute thread owns its sockets: a blocking receive, the step, a send
  loop         the sockets on an asyncio event loop (uvloop, zmq.asyncio) and the step on
               a compute thread, the daemons' shape
each with workers that sleep between operators, as the daemons' do, and spinning until each
run ends (`ExecutorOptions.spinning`). Every way decodes the same answer, greedy, each run
an 8-token prompt and `--tokens` decode steps; rounds rotate the order of the ways, and the
first round is a warm-up. It prints each way's median ms a token, the stages' compute and
the rest (outside compute), the median over rounds of the whole model's time a token over
this way's (the ratio `bench.pipeline` prints), and whether its tokens equal the whole
model's.

    .venv/bin/python -m bench.ring_ceiling [--dir DIR] [--rounds 10] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zmq
import zmq.asyncio

from bench.llama_checkpoint import add_shape_arguments, reusable_llama, shape_from
from bench.shards import shard_units
from bench.workdir import run_in
from peerd.commands.generate import GENERATE_OPTIONS
from peerd.commands.local_cluster import free_ports
from peerd.wire.protocol import StageData, decode, encode
from shards.executor import ExecutorOptions, StageExecutor
from shards.joined import JOIN_WHOLE
from shards.manifest import Manifest, Quant

PROMPT = [1, 17, 42, 99, 7, 250, 31, 64]
RINGS = ("thread", "loop")
ONE_PROCESS = "one process"
WAYS = [(way, spin) for way in (ONE_PROCESS, *RINGS) for spin in (False, True)]
STAGES = 3
PLAN, END = "ring", "end"  # StageData.plan of a step, and of the message that ends a run
KEYS_ENV = "PEERD_RING_KEYS"  # the ring's CURVE keys, for its stage processes
SocketT = TypeVar("SocketT", bound=zmq.Socket)


@dataclass
class Run:
    ms: float  # a decode step, prompt excluded
    compute_ms: float  # the stages' compute of a decode step
    tokens: list[int]


def main() -> None:
    args = _parser().parse_args()
    if args.role == "whole":
        _serve_whole(Path(args.units))
    elif args.role == "stages":
        _serve_stages(Path(args.units), args.spin)
    elif args.role == "stage":
        _serve_stage(Path(args.units), args.way, args.spin, args.stage)
    else:
        run_in(args.dir, lambda root: _bench(root, args))


# -- the bench process ----------------------------------------------------------------------

def _bench(root: Path, args: argparse.Namespace) -> None:
    model = reusable_llama(root, shape_from(args), _note)
    units = shard_units(model, root, Quant.NONE, cached=True).directory
    bounds = thirds(Manifest.load(units))
    _note("starting the whole model and " + ", ".join(_name(*way) for way in WAYS))
    heads, others = _start(units)
    try:
        results = _rounds(heads, args.rounds, args.tokens)
    finally:
        for process in [*heads.values(), *others]:
            process.kill()
    stages = ", ".join(f"{first}-{last}" for first, last in bounds)
    print(f"one answer, {args.tokens} decode steps a run, {args.rounds} rounds (the order "
          f"rotating), medians; the stages hold units {stages}")
    _print(results)


def _name(way: str, spin: bool) -> str:
    return f"{way}, {'spinning' if spin else 'sleeping'}"


def _start(units: Path) -> tuple[dict[str, subprocess.Popen], list[subprocess.Popen]]:
    """Every way's first process (the one driven through its stdin), and the others."""
    command = [sys.executable, "-m", "bench.ring_ceiling", "--units", str(units)]
    heads = {"whole": _child([*command, "--role", "whole"], None, driven=True)}
    others = []
    count = STAGES * len(WAYS)
    first = free_ports(count)
    ports = iter(range(first, first + count))
    for way, spin in WAYS:
        spinning = ["--spin"] if spin else []
        if way == ONE_PROCESS:
            heads[_name(way, spin)] = _child([*command, "--role", "stages", *spinning], None,
                                             driven=True)
            continue
        keys = [zmq.curve_keypair() for _ in range(STAGES)]
        env = {**os.environ, KEYS_ENV: json.dumps({
            "ports": [next(ports) for _ in range(STAGES)],
            "public": [p.decode() for p, _ in keys], "secret": [s.decode() for _, s in keys]})}
        for stage in reversed(range(STAGES)):
            flags = ["--role", "stage", "--way", way, "--stage", str(stage), *spinning]
            process = _child([*command, *flags], env, driven=stage == 0)
            if stage == 0:
                heads[_name(way, spin)] = process
            else:
                others.append(process)
    for name, process in heads.items():
        if _line(process) != "ready":
            raise SystemExit(f"{name} did not start")
    return heads, others


def _child(command: list[str], env: dict | None, driven: bool) -> subprocess.Popen:
    pipe = subprocess.PIPE if driven else None
    return subprocess.Popen(command, env=env, stdin=pipe, stdout=pipe, text=True)


def _line(process: subprocess.Popen) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


def _rounds(heads: dict[str, subprocess.Popen], rounds: int, tokens: int) -> dict[str, list[Run]]:
    names = list(heads)
    results: dict[str, list[Run]] = {name: [] for name in names}
    for number in range(rounds + 1):
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            process = heads[name]
            assert process.stdin is not None
            process.stdin.write(f"{tokens}\n")
            process.stdin.flush()
            run = Run(**json.loads(_line(process)))
            if number:  # the first round warms up
                results[name].append(run)
        if number:
            _note(f"round {number}: " + ", ".join(
                f"{name} {results[name][-1].ms:.1f}" for name in names) + " ms a token")
    return results


def _print(results: dict[str, list[Run]]) -> None:
    whole = results["whole"]
    print(f"  {'way':22s} {'ms a token':>10s} {'compute':>8s} {'outside':>8s} "
          f"{'whole / this':>12s}  tokens")
    for name, runs in results.items():
        ms = statistics.median(r.ms for r in runs)
        compute = statistics.median(r.compute_ms for r in runs)
        outside = statistics.median(r.ms - r.compute_ms for r in runs)
        ratio = statistics.median(w.ms / r.ms for w, r in zip(whole, runs, strict=True))
        same = all(r.tokens == w.tokens for w, r in zip(whole, runs, strict=True))
        print(f"  {name:22s} {ms:10.2f} {compute:8.2f} {outside:8.2f} {ratio:12.3f}  "
              f"{'as whole' if same else 'DIFFER'}")


def thirds(manifest: Manifest) -> list[tuple[int, int]]:
    """Three runs of units of about equal weight bytes."""
    total = sum(unit.weight_bytes for unit in manifest.units)
    bounds, first, held = [], 0, 0
    for unit in manifest.units:
        held += unit.weight_bytes
        if len(bounds) < STAGES - 1 and held >= total * (len(bounds) + 1) / STAGES:
            bounds.append((first, unit.index))
            first = unit.index + 1
    return [*bounds, (first, len(manifest.units) - 1)]


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- the whole model ------------------------------------------------------------------------

def _serve_whole(units: Path) -> None:
    manifest = Manifest.load(units)
    executor = StageExecutor(manifest, units, 0, len(manifest.units) - 1, GENERATE_OPTIONS)
    executor.warm_up()

    def token(seq_id: str, ids: list[int], start: int) -> int:
        logits = executor.step(seq_id, token_inputs(ids, start), rows=1)["logits"]
        return int(np.argmax(logits[0, -1]))

    def decode_run(seq_id: str, tokens: int) -> Run:
        run = _decode(lambda ids, start: token(seq_id, ids, start), tokens)
        executor.drop(seq_id)
        return Run(run.ms, run.ms, run.tokens)

    _serve_runs(decode_run)


def _decode(token: Callable[[list[int], int], int], tokens: int) -> Run:
    """The answer to PROMPT, greedy, timing its decode steps."""
    ids = [token(PROMPT, 0)]
    started = time.perf_counter()
    for step in range(tokens):
        ids.append(token(ids[-1:], len(PROMPT) + step))
    ms = (time.perf_counter() - started) / tokens * 1e3
    return Run(ms, 0.0, ids)


def _serve_runs(decode_run: Callable[[str, int], Run]) -> None:
    print("ready", flush=True)
    for number, line in enumerate(sys.stdin):
        print(json.dumps(decode_run(f"run{number}", int(line)).__dict__), flush=True)


def token_inputs(ids: list[int], start: int) -> dict[str, np.ndarray]:
    """A step's inputs: the tokens `ids`, at positions from `start` on."""
    positions = np.arange(start, start + len(ids), dtype=np.int64)[None, :]
    return {"input_ids": np.array([ids], np.int64), "position_ids": positions}


# -- a stage of the ring --------------------------------------------------------------------

class Stage:
    """A stage's step over the wire: the message in, the message for the next stage out,
    carrying what later stages consume (residuals ride along the ring here). Each sequence's
    decode compute adds up, and the run's END message collects it."""

    def __init__(self, units: Path, index: int, spin: bool) -> None:
        manifest = Manifest.load(units)
        first, last = thirds(manifest)[index]
        options = ExecutorOptions(join_bytes=JOIN_WHOLE, spinning=spin)
        self.executor = StageExecutor(manifest, units, first, last, options)
        self.executor.warm_up()
        self.index = index
        self.later = set() if last == len(manifest.units) - 1 else set(
            manifest.stage_inputs(last + 1, len(manifest.units) - 1))
        self.compute: dict[str, float] = {}

    def forward(self, frames: list[Any]) -> list[Any]:
        message = decode(frames)
        assert isinstance(message, StageData)
        return encode(self._end(message) if message.plan == END else self.step(message))

    def first(self, seq_id: str, ids: list[int], start: int) -> StageData:
        """The head's step: the message for the next stage."""
        step = 0 if start == 0 else start - len(PROMPT) + 1
        return self.step(StageData(PLAN, seq_id, step, token_inputs(ids, start)))

    def step(self, message: StageData) -> StageData:
        executor = self.executor
        started = time.perf_counter()
        out = executor.step(message.seq_id, {n: message.tensors[n] for n in executor.inputs},
                            rows=1)
        if message.step:
            self.compute[message.seq_id] = (self.compute.get(message.seq_id, 0.0)
                                            + time.perf_counter() - started)
        if not self.later:
            tensors = {"token": np.array([np.argmax(out["logits"][0, -1])], np.int64)}
        else:
            tensors = {n: v for n, v in {**message.tensors, **out}.items() if n in self.later}
        return StageData(PLAN, message.seq_id, message.step, tensors)

    def _end(self, message: StageData) -> StageData:
        self.executor.drop(message.seq_id)
        compute = message.tensors["compute"] + self.compute.pop(message.seq_id, 0.0)
        return StageData(END, message.seq_id, 0, {"compute": compute})


def _serve_stages(units: Path, spin: bool) -> None:
    """The three stages in this process, each message handed on as it is."""
    stages = [Stage(units, index, spin) for index in range(STAGES)]

    def token(seq_id: str, ids: list[int], start: int) -> int:
        message = stages[0].first(seq_id, ids, start)
        for stage in stages[1:]:
            message = stage.step(message)
        return int(message.tensors["token"][0])

    def decode_run(seq_id: str, tokens: int) -> Run:
        run = _decode(lambda ids, start: token(seq_id, ids, start), tokens)
        compute = sum(stage.compute.pop(seq_id, 0.0) for stage in stages)
        for stage in stages:
            stage.executor.drop(seq_id)
        return Run(run.ms, compute / tokens * 1e3, run.tokens)

    _serve_runs(decode_run)


def _serve_stage(units: Path, way: str, spin: bool, index: int) -> None:
    stage = Stage(units, index, spin)
    if way == "thread":
        _thread_way(stage)
    else:
        import uvloop
        uvloop.run(_loop_way(stage))


def _ring_sockets(context: zmq.Context[SocketT], index: int) -> tuple[SocketT, SocketT]:
    """This stage's receiving ROUTER (a CURVE server) and its DEALER to the next stage."""
    keys = json.loads(os.environ[KEYS_ENV])
    inbox = context.socket(zmq.ROUTER)
    inbox.curve_server = True
    inbox.curve_secretkey = keys["secret"][index].encode()
    inbox.curve_publickey = keys["public"][index].encode()
    inbox.bind(f"tcp://127.0.0.1:{keys['ports'][index]}")
    following = (index + 1) % STAGES
    outbox = context.socket(zmq.DEALER)
    outbox.curve_publickey, outbox.curve_secretkey = zmq.curve_keypair()
    outbox.curve_serverkey = keys["public"][following].encode()
    outbox.connect(f"tcp://127.0.0.1:{keys['ports'][following]}")
    return inbox, outbox


def _thread_way(stage: Stage) -> None:
    inbox, outbox = _ring_sockets(zmq.Context(), stage.index)
    if stage.index:
        while True:
            outbox.send_multipart(stage.forward(inbox.recv_multipart()[1:]))

    def back(frames: list[Any]) -> StageData:
        outbox.send_multipart(frames)
        message = decode(inbox.recv_multipart()[1:])
        assert isinstance(message, StageData)
        return message

    _serve_runs(lambda seq_id, tokens: _head_run(stage, back, seq_id, tokens))


def _head_run(stage: Stage, back: Callable[[list[Any]], StageData], seq_id: str,
              tokens: int) -> Run:
    """One answer around the ring, `back` sending a message from the head and returning
    what comes back to it."""
    run = _decode(lambda ids, start: int(back(encode(stage.first(seq_id, ids, start)))
                                         .tensors["token"][0]), tokens)
    ended = back(encode(StageData(END, seq_id, 0, {"compute": np.zeros(1, np.float32)})))
    compute = float(ended.tensors["compute"][0]) + stage.compute.pop(seq_id, 0.0)
    stage.executor.drop(seq_id)
    return Run(run.ms, compute / tokens * 1e3, run.tokens)


async def _loop_way(stage: Stage) -> None:
    inbox, outbox = _ring_sockets(zmq.asyncio.Context(), stage.index)
    compute = ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()
    if stage.index:
        while True:
            frames = (await inbox.recv_multipart())[1:]
            await outbox.send_multipart(await loop.run_in_executor(compute, stage.forward, frames))

    async def back(frames: list[Any]) -> StageData:
        await outbox.send_multipart(frames)
        message = decode((await inbox.recv_multipart())[1:])
        assert isinstance(message, StageData)
        return message

    def back_from_thread(frames: list[Any]) -> StageData:
        return asyncio.run_coroutine_threadsafe(back(frames), loop).result()

    # the answer's steps run on the compute thread, their messages go through the loop
    await loop.run_in_executor(
        compute, _serve_runs, lambda seq_id, tokens: _head_run(stage, back_from_thread,
                                                               seq_id, tokens))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", help="working directory, kept and reused by later runs "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds, after one warm-up")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps a run")
    parser.add_argument("--role", choices=("whole", "stages", "stage"), help=argparse.SUPPRESS)
    parser.add_argument("--units", help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=RINGS, help=argparse.SUPPRESS)
    parser.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    add_shape_arguments(parser)
    return parser


if __name__ == "__main__":
    main()
