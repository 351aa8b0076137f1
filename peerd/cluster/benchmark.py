"""Measuring peers: FLOP/s on a calibration ONNX graph, and link latency and bandwidth.

The calibration unit is decode-shaped: one row through a chain of square MatMuls too large
for the cache (`calibration_graph.py`), timed on ONNX Runtime with the stage
executor's threading (no torch in the daemon). A decode step is bound by reading weights
from memory, so a peer's figure predicts its stage times; a matrix-matrix product would
measure arithmetic an order of magnitude faster than decode ever runs. That is what a
prompt runs, so the same chain on `PROMPT_ROWS` rows gives the peer's prompt FLOP/s, which
prices time to first token (on one core of the development machine: 20 GFLOP/s on one
row against 200 on 128 rows; priced at the one-row figure, the 512-token prompt of a
12-layer hidden-1024 model came to 7 s, where it takes 0.8). Links are
measured from a source peer to a target. The latency is the data path's: a stage's tensors
leave from its compute thread and are run on the receiver's, so each message also pays two
hand-offs between a worker thread and an event loop on either side, and threads waking on
cores that had gone idle. Half the median round trip of a few `Relay`s, sent from a worker
thread and answered from one of the target's, a few milliseconds apart, measures that (on the
2-core development machine, two daemons each pinned to a core: 0.7 ms one way, where a ping
between the event loops measured 0.24 ms and a 2-peer group's decode exchanges took
1.4 ms each: priced at the ping, the planner predicted a group decoding at 49 ms a token
that took 116). The shortest round trip of a few pings on the control channel (the one that
queued least) is taken out of a timed bulk transfer on the data channel, answered when fully
received, for the bandwidth.

The leader collects every peer's figures and asks every peer in turn to probe all the others,
so links are measured between every ordered pair, one prober at a time: transfers at once
would share the medium, and a ping queued behind another transfer would distort the round
trip that is taken out (the daemon also runs at most one probing session per peer).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from peerd.cluster.calibration_graph import calibration_model
from peerd.wire import protocol
from peerd.wire.protocol import LinkFigures, PeerFigures
from peerd.wire.transport import Transport, TransportError
from shards import heap
from shards.executor import session_options

log = logging.getLogger("peerd.cluster.benchmark")

CALIBRATION_SIZE = 2048
CALIBRATION_DEPTH = 4  # 64 MiB of weights: more than a CPU's last-level cache
CALIBRATION_SECONDS = 0.25
# The prompt figure's best run is taken over a longer window: a core of the development
# machine (a 2-vCPU VM) computes the 128-row chain in 46 ms or in 68 ms for seconds at a
# time (the host's other tenants), and a 0.25 s window that fell in a slow spell read one of
# two like cores 89 GFLOP/s and the other 63, enough for the planner to run a 512-token
# prompt on the "faster" one behind a pipeline hop. Over 1 s, six startups read the two
# within 13%.
PROMPT_CALIBRATION_SECONDS = 1.0
FLOPS_MAX_AGE_S = 600.0
LATENCY_PINGS = 5
RELAYS = 7
RELAY_GAP_S = 0.005  # between relays: the receiver's threads idle, as between a stage's steps
PROMPT_ROWS = 128
PROBE_BYTES = 4 * 1024 * 1024
PROBE_TRANSFERS = 2
PING_TIMEOUT_S = 2.0
TRANSFER_TIMEOUT_S = 30.0


def calibration_flops(size: int = CALIBRATION_SIZE, depth: int = CALIBRATION_DEPTH,
                      rows: int = 1) -> int:
    return 2 * rows * size**2 * depth


def calibration_session(size: int, depth: int, rows: int = 1) -> ort.InferenceSession:
    """The calibration graph on as many threads as the stage executor uses: one per core
    this process may run on (ONNX Runtime's default, one per core of the machine, would
    also compute on cores a pinned peer must not use)."""
    options = session_options()
    options.log_severity_level = 3
    return ort.InferenceSession(
        calibration_model(size, depth, rows), options, providers=["CPUExecutionProvider"]
    )


@dataclass(frozen=True)
class Speeds:
    """A peer's FLOP/s on one row (a decode step) and on `PROMPT_ROWS` rows (a prompt)."""

    decode: float
    prompt: float


def measure_flops(
    size: int = CALIBRATION_SIZE,
    depth: int = CALIBRATION_DEPTH,
    seconds: float = CALIBRATION_SECONDS,
    rows: int = 1,
) -> float:
    """Effective FLOP/s of this machine on the calibration graph of `rows` rows (best run;
    blocking)."""
    fastest = _fastest_run(calibration_session(size, depth, rows), size, rows, seconds)
    heap.trim()  # the session's memory, freed now, would otherwise stay resident (~50 MB)
    return calibration_flops(size, depth, rows) / fastest


def measure_speeds() -> Speeds:
    """This machine's decode-shaped and prompt-shaped FLOP/s (blocking)."""
    return Speeds(measure_flops(),
                  measure_flops(rows=PROMPT_ROWS, seconds=PROMPT_CALIBRATION_SECONDS))


def _fastest_run(session: ort.InferenceSession, size: int, rows: int, seconds: float) -> float:
    x = np.random.default_rng(1).standard_normal((rows, size)).astype(np.float32)
    session.run(None, {"x": x})  # warm-up: allocations, thread pool
    fastest = math.inf
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        session.run(None, {"x": x})
        fastest = min(fastest, time.perf_counter() - start)
        runs += 1
    return fastest


class SpeedMeter:
    """This peer's speeds (`Speeds`), measured off the event loop and re-measured when old."""

    def __init__(self, max_age_s: float = FLOPS_MAX_AGE_S):
        self.speeds = Speeds(0.0, 0.0)
        self._max_age_s = max_age_s
        self._measured_at = -math.inf
        self._lock = asyncio.Lock()

    async def current(self) -> Speeds:
        async with self._lock:
            if time.monotonic() - self._measured_at > self._max_age_s:
                self.speeds = await asyncio.to_thread(measure_speeds)
                self._measured_at = time.monotonic()
        return self.speeds


def transfer_bandwidth(nbytes: int, elapsed_s: float, round_trip_s: float) -> float:
    """Bytes/s of a transfer timed from sending to its acknowledgement.

    The elapsed time includes one round trip (data out, acknowledgement back); it is taken
    out, but never more than half the elapsed time, so a noisy round trip cannot blow up a
    fast transfer's figure.
    """
    return nbytes / max(elapsed_s - round_trip_s, elapsed_s / 2)


async def measure_link(
    transport: Transport, source: str, target: str, payload_bytes: int = PROBE_BYTES
) -> LinkFigures:
    latency = await data_path_latency(transport, target)
    round_trips = []
    for _ in range(LATENCY_PINGS):
        start = time.perf_counter()
        await transport.request(target, protocol.Ping(req=0), PING_TIMEOUT_S)
        round_trips.append(time.perf_counter() - start)
    round_trip = min(round_trips)
    probe = protocol.BandwidthProbe(
        req=0, tensors={"payload": np.zeros(payload_bytes, dtype=np.uint8)}
    )
    bandwidth = 0.0
    for _ in range(PROBE_TRANSFERS):  # the best transfer: the first may still be in slow start
        start = time.perf_counter()
        await transport.request(target, probe, TRANSFER_TIMEOUT_S)
        elapsed = time.perf_counter() - start
        bandwidth = max(bandwidth, transfer_bandwidth(payload_bytes, elapsed, round_trip))
    return LinkFigures(source, target, latency, bandwidth)


async def data_path_latency(transport: Transport, target: str) -> float:
    """One way from a worker thread here to one of `target`'s: half the median round trip
    of `RELAYS` relays."""
    loop = asyncio.get_running_loop()

    def relay() -> float:  # on a worker thread, as a stage's compute thread sends its tensors
        start = time.perf_counter()
        asking = transport.request(target, protocol.Relay(req=0), PING_TIMEOUT_S)
        asyncio.run_coroutine_threadsafe(asking, loop).result()
        return time.perf_counter() - start

    round_trips = []
    for _ in range(RELAYS):
        round_trips.append(await asyncio.to_thread(relay))
        await asyncio.sleep(RELAY_GAP_S)
    return statistics.median(round_trips) / 2


def answer_relay(relay: protocol.Relay, reply: Callable[[protocol.Message], None]) -> None:
    """Answer `relay` from a worker thread, as a stage's compute thread takes and sends
    (on the event loop)."""
    loop = asyncio.get_running_loop()
    loop.run_in_executor(None, loop.call_soon_threadsafe, reply, protocol.Relayed(relay.req))


async def measure_links(
    transport: Transport, source: str, targets: Iterable[str], payload_bytes: int
) -> tuple[LinkFigures, ...]:
    """This peer's links to each target, one at a time; unreachable targets are left out."""
    links = []
    for target in targets:
        try:
            links.append(await measure_link(transport, source, target, payload_bytes))
        except TransportError as exc:
            log.info("could not measure the link to %s: %s", target, exc)
    return tuple(links)


async def collect_figures(
    ask: Callable[[str], Awaitable[PeerFigures]], peers: Iterable[str]
) -> dict[str, PeerFigures]:
    """Every peer's figures, asked at once; peers that fail to answer are left out."""
    peers = list(peers)
    answers = await asyncio.gather(*(ask(p) for p in peers), return_exceptions=True)
    figures = {}
    for peer, answer in zip(peers, answers, strict=True):
        if isinstance(answer, PeerFigures) and answer.id == peer:
            figures[peer] = answer
        else:
            log.info("no figures from %s: %s", peer, answer)
    return figures


async def collect_links(
    ask: Callable[[str, tuple[str, ...]], Awaitable[tuple[LinkFigures, ...]]],
    peers: Iterable[str],
) -> tuple[LinkFigures, ...]:
    """Every ordered pair's link, asking one source peer at a time."""
    peers = list(peers)
    links: list[LinkFigures] = []
    for source in peers:
        try:
            measured = await ask(source, tuple(p for p in peers if p != source))
        except TransportError as exc:
            log.info("%s could not probe its links: %s", source, exc)
            continue
        links.extend(link for link in measured if link.source == source)
    return tuple(links)
