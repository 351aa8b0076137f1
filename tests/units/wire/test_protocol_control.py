"""Control messages: every kind round-trips, and anything malformed is a ProtocolError."""

import contextlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.wire import protocol
from peerd.wire.protocol import (
    Battery,
    ClusterReport,
    LinkFigures,
    PeerFigures,
    ProtocolError,
)

FIGURES = PeerFigures(
    id="a1", flops=2.5e10, memory_total=8 << 30, memory_available=3 << 30, load=0.25,
    battery=Battery(percent=80.0, plugged=False), model="tiny", units=(0, 1, 2),
)
LINK = LinkFigures(source="a1", target="b2", latency_s=0.0004, bandwidth_Bps=1.2e8)

SAMPLES = [
    protocol.Hello(record={"id": "a1", "mac": "00"}),
    protocol.Heartbeat(instance="i1", seq=7, epoch=3, leader="a1", mains=True, flops=1e9),
    protocol.Heartbeat(instance="i1", seq=0, epoch=0, leader=None, mains=False, flops=0.0),
    protocol.Goodbye(instance="i1"),
    protocol.VoteRequest(epoch=4, mains=True, flops=3e9),
    protocol.Vote(epoch=4, granted=False),
    protocol.LeaderAnnounce(epoch=4),
    protocol.MeasureRequest(req=11, epoch=4),
    protocol.Measurement(req=11, figures=FIGURES),
    protocol.Measurement(req=12, figures=PeerFigures(
        id="b2", flops=1.0, memory_total=10, memory_available=10, load=0.0, battery=None,
        model=None, units=())),
    protocol.ProbeRequest(req=13, epoch=4, targets=("b2", "c3"), payload_bytes=1 << 20),
    protocol.ProbeReport(req=13, links=(LINK,)),
    protocol.Ping(req=14),
    protocol.Pong(req=14),
    protocol.BandwidthProbe(req=15, tensors={"payload": np.arange(100, dtype=np.uint8)}),
    protocol.BandwidthAck(req=15, received=100),
    protocol.ClusterReport(epoch=4, peers=(FIGURES,), links=(LINK,)),
]


def _round_trip(msg):
    return protocol.decode([bytes(f) for f in protocol.encode(msg)])


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.KIND)
def test_every_control_message_round_trips(msg):
    back = _round_trip(msg)
    if isinstance(msg, protocol.BandwidthProbe):
        np.testing.assert_array_equal(back.tensors["payload"], msg.tensors["payload"])
    else:
        assert back == msg


def test_every_kind_belongs_to_one_channel_and_bulk_never_uses_control():
    assert all(cls.CHANNEL in protocol.CHANNELS for cls in protocol.kinds().values())
    channels = {type(m).KIND: type(m).CHANNEL for m in SAMPLES}
    assert channels.pop("hello") == protocol.HELLO
    assert channels.pop("bandwidth") == channels.pop("bandwidth-ack") == protocol.DATA
    assert set(channels.values()) == {protocol.CONTROL}


def _header(msg) -> dict:
    return msgpack.unpackb(protocol.encode(msg)[0])


def _decode_header(header: dict, *frames):
    return protocol.decode([msgpack.packb(header), *frames])


@pytest.mark.parametrize(
    "msg, change, reason",
    [
        (SAMPLES[1], {"leader": 5}, "leader"),
        (SAMPLES[1], {"mains": 1}, "mains"),
        (SAMPLES[1], {"epoch": -1}, "negative"),
        (SAMPLES[1], {"flops": float("nan")}, "flops"),
        (SAMPLES[4], {"epoch": 0}, "positive"),
        (SAMPLES[8], {"figures": {**_header(SAMPLES[8])["figures"], "load": 1.5}}, "load"),
        (SAMPLES[8], {"figures": {**_header(SAMPLES[8])["figures"], "extra": 1}}, "unexpected"),
        (SAMPLES[8], {"figures": {**_header(SAMPLES[8])["figures"],
                                  "battery": {"percent": "80", "plugged": True}}}, "battery"),
        (SAMPLES[8], {"figures": {**_header(SAMPLES[8])["figures"], "memory_available": 1 << 40}},
         "memory"),
        (SAMPLES[8], {"figures": [1, 2]}, "figures"),
        (SAMPLES[10], {"targets": "b2"}, "targets"),
        (SAMPLES[10], {"payload_bytes": 1 << 40}, "payload size"),
        (SAMPLES[11], {"links": [{"source": "a", "target": "b", "latency_s": 0,
                                  "bandwidth_Bps": 0}]}, "link"),
        (SAMPLES[0], {"record": {"id": 1}}, "record"),
        (SAMPLES[5], {"kind": ["vote"]}, "unknown message kind"),
        (SAMPLES[5], {"v": "1"}, "version"),
    ],
)
def test_bad_fields_are_refused(msg, change, reason):
    header = {**_header(msg), **change}
    with pytest.raises(ProtocolError, match=reason):
        _decode_header(header)


def test_bandwidth_probe_must_carry_one_uint8_payload():
    frames = protocol.encode(SAMPLES[14])
    header = msgpack.unpackb(frames[0])
    header["tensors"][0][1] = "int8"
    with pytest.raises(ProtocolError, match="uint8"):
        _decode_header(header, frames[1])


def test_unhashable_dtype_in_a_tensor_spec_is_a_protocol_error():
    header = _header(protocol.StageData(plan="1.1", seq_id="s", step=0, tensors={}))
    header["tensors"] = [["t", ["float32"], [1]]]
    with pytest.raises(ProtocolError, match="bad name or dtype"):
        _decode_header(header, b"\0" * 4)


def test_cluster_report_nested_values_come_back_as_dataclasses():
    back = _round_trip(SAMPLES[-1])
    assert isinstance(back, ClusterReport)
    assert isinstance(back.peers[0].battery, Battery)
    assert back.peers[0].units == (0, 1, 2)


def _decodes_or_refuses(frames) -> None:
    with contextlib.suppress(ProtocolError):
        protocol.decode(frames)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_random_frames_never_raise_anything_but_protocol_error(frames):
    _decodes_or_refuses(frames)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    field=st.text(max_size=12) | st.sampled_from(["kind", "v", "req", "epoch", "figures",
                                                   "links", "tensors", "record", "targets"]),
    value=msgpack_values,
)
def test_any_single_field_change_decodes_or_is_refused(sample, field, value):
    frames = protocol.encode(sample)
    header = msgpack.unpackb(frames[0])
    header[field] = value
    _decodes_or_refuses([msgpack.packb(header), *frames[1:]])
