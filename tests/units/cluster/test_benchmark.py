"""Peer measurements: the calibration graph, FLOP/s, link latency/bandwidth, collection."""

import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from waiting import answered

from peerd.cluster import benchmark, calibration_graph
from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret, KeyPair
from peerd.wire.protocol import LinkFigures, PeerFigures
from peerd.wire.transport import Endpoint, Incoming, Transport, TransportError


def test_calibration_graph_multiplies_a_row_by_distinct_constant_matrices():
    size, depth = 32, 3
    model = onnx.load_from_string(calibration_graph.calibration_model(size, depth))
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["ConstantOfShape", "MatMul"] * depth
    constants = [onnx.numpy_helper.to_array(n.attribute[0].t)[0]
                 for n in model.graph.node if n.op_type == "ConstantOfShape"]
    assert len(set(constants)) == depth  # none shared: every run reads depth x size^2 weights
    x = np.random.default_rng(3).standard_normal((1, size)).astype(np.float32)
    expected = x
    for value in constants:
        expected = expected @ np.full((size, size), value, np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-4, atol=1e-4)
    assert benchmark.calibration_flops(size, depth) == 2 * 32**2 * 3


def test_measured_flops_are_plausible_for_a_cpu():
    flops = benchmark.measure_flops(size=256, depth=2, seconds=0.05)
    assert 1e8 < flops < 1e14


def test_calibration_computes_only_on_the_cores_this_peer_is_pinned_to():
    code = ("import os; os.sched_setaffinity(0, {0}); from peerd.cluster.benchmark import "
            "calibration_session; "
            "print(calibration_session(64, 1).get_session_options().intra_op_num_threads)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["1"]


def test_a_prompts_rows_run_faster_per_flop_than_one_row():
    """One row streams the weights for 2 FLOPs a weight; 128 rows reuse each weight read 128
    times, as a prompt does: the prompt figure must come out well above the decode one."""
    speeds = benchmark.measure_speeds()
    assert speeds.prompt > 2 * speeds.decode > 0
    graph = onnx.load_from_string(calibration_graph.calibration_model(8, 1, rows=3))
    assert [d.dim_value for d in graph.graph.input[0].type.tensor_type.shape.dim] == [3, 8]
    assert benchmark.calibration_flops(8, 1, rows=3) == 3 * benchmark.calibration_flops(8, 1)


async def test_the_speed_meter_measures_once_then_reuses_the_figures(monkeypatch):
    calls = []
    speeds = benchmark.Speeds(5e9, 6e10)
    monkeypatch.setattr(benchmark, "measure_speeds", lambda: calls.append(1) or speeds)
    meter = benchmark.SpeedMeter(max_age_s=60)
    assert await meter.current() == speeds and await meter.current() == speeds
    assert len(calls) == 1
    assert await benchmark.SpeedMeter(max_age_s=0).current() == speeds


def test_link_arithmetic():
    assert benchmark.transfer_bandwidth(1_000_000, 0.11, 0.01) == pytest.approx(1e7)
    # A round trip larger than half the transfer is not trusted.
    assert benchmark.transfer_bandwidth(1_000_000, 0.1, 0.09) == pytest.approx(2e7)


class ShapedTransport:
    """A fake transport whose pings take ``rtt`` and whose transfers run at ``rate`` B/s."""

    def __init__(self, rtt: float, rate: float):
        self.rtt, self.rate = rtt, rate

    async def request(self, peer, msg, timeout):
        if isinstance(msg, protocol.BandwidthProbe):
            size = msg.tensors["payload"].nbytes
            await asyncio.sleep(self.rtt + size / self.rate)
            return protocol.BandwidthAck(msg.req, size)
        await asyncio.sleep(self.rtt)
        return protocol.Pong(msg.req)


async def test_a_link_is_measured_from_round_trips_and_a_timed_transfer():
    transport = ShapedTransport(rtt=0.02, rate=10e6)
    link = await benchmark.measure_link(transport, "a", "b", payload_bytes=1_000_000)
    assert (link.source, link.target) == ("a", "b")
    assert link.latency_s == pytest.approx(0.01, rel=0.3)
    assert link.bandwidth_Bps == pytest.approx(10e6, rel=0.2)


class LateWorkers(ThreadPoolExecutor):
    """Worker threads that start every job `lag` seconds late, as threads waking on a core
    that had gone idle do."""

    def __init__(self, lag: float):
        super().__init__(max_workers=4)
        self.lag = lag

    def submit(self, fn, /, *args, **kwargs):
        def late():
            time.sleep(self.lag)
            return fn(*args, **kwargs)

        return super().submit(late)


async def test_the_data_path_latency_counts_the_targets_worker_thread():
    """A relay is answered from a worker thread of the target, so a late worker there shows
    in the link's latency (half a round trip); the asker's own late start is not timed."""
    secret, lag = ClusterSecret(b"s" * 32), 0.05

    def handle(incoming: Incoming) -> None:
        match incoming.msg:
            case protocol.Relay() as relay:
                benchmark.answer_relay(relay, incoming.reply)
            case protocol.Ping(req=req):
                incoming.reply(protocol.Pong(req))
            case protocol.BandwidthProbe(req=req, tensors=tensors):
                incoming.reply(protocol.BandwidthAck(req, tensors["payload"].nbytes))

    keys = [KeyPair.generate(), KeyPair.generate()]
    nodes = [Transport(k, secret, handle, "127.0.0.1") for k in keys]
    ports = [node.start() for node in nodes]
    try:
        nodes[0].admit(keys[1].public)
        nodes[1].admit(keys[0].public)
        nodes[0].connect("b", Endpoint("127.0.0.1", ports[1].control, ports[1].data,
                                       keys[1].public))
        nodes[1].connect("a", Endpoint("127.0.0.1", ports[0].control, ports[0].data,
                                       keys[0].public))
        await answered(nodes[0], "b", msg=protocol.Relay(req=0))  # both channels shaken hands
        await answered(nodes[0], "b")
        asyncio.get_running_loop().set_default_executor(LateWorkers(lag))
        link = await benchmark.measure_link(nodes[0], "a", "b", payload_bytes=4096)
    finally:
        for node in nodes:
            await node.close()
    assert link.latency_s >= lag / 2


class FailingTransport:
    async def request(self, peer, msg, timeout):
        raise TransportError(f"{peer} is not reachable")


async def test_unreachable_targets_are_left_out():
    assert await benchmark.measure_links(FailingTransport(), "a", ["b", "c"], 100) == ()


def _figures(peer: str) -> PeerFigures:
    return PeerFigures(peer, 1e9, 10, 5, 0.1, None, None, ())


async def test_figures_are_collected_from_everyone_who_answers_for_themselves():
    async def ask(peer):
        if peer == "silent":
            raise TransportError("no answer")
        return _figures("impostor" if peer == "liar" else peer)

    figures = await benchmark.collect_figures(ask, ["a", "silent", "liar", "b"])
    assert sorted(figures) == ["a", "b"]


async def test_links_are_probed_one_source_at_a_time_for_every_ordered_pair():
    active, log = [], []

    async def ask(source, targets):
        active.append(source)
        assert len(active) == 1, "two peers probing at once"
        log.append((source, targets))
        await asyncio.sleep(0.01)
        active.remove(source)
        if source == "c":
            raise TransportError("c is gone")
        forged = LinkFigures("x", "y", 0.1, 1.0)
        return (*(LinkFigures(source, t, 0.001, 1e8) for t in targets), forged)

    links = await benchmark.collect_links(ask, ["a", "b", "c"])
    assert log == [("a", ("b", "c")), ("b", ("a", "c")), ("c", ("a", "b"))]
    assert {(link.source, link.target) for link in links} == {
        ("a", "b"), ("a", "c"), ("b", "a"), ("b", "c")}


def test_the_daemon_never_imports_torch():
    code = "import sys, peerd.daemon.wiring; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
