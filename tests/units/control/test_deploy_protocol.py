"""The deployment messages: each round-trips, and each rule they enforce refuses on decode."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from peerd.wire import protocol
from peerd.wire.protocol import (
    DeployReport,
    ManifestOffer,
    ManifestRequest,
    PlanAssignment,
    PlanFigures,
    PlanStage,
    ProtocolError,
    UnitChunk,
    UnitChunkRequest,
    UnitRefused,
)

SHA = "ab" * 32
MANIFEST = {"format": 1, "key": "k", "units": [{"index": 0, "consumers": [-1, 2]}]}
PLAN = PlanAssignment(
    epoch=3, plan_id=7,
    stages=(PlanStage("m", 0, 4), PlanStage("p", 5, 9)),
    model="tiny", model_peer="m", manifest=MANIFEST, objective="throughput", solver="milp",
    predicted=PlanFigures(0.01, 120.0, 0.008), problem=None,
)
NO_PLAN = PlanAssignment(3, 8, (), None, None, None, "throughput", "milp", None,
                         "no peer serves a model (start one with --model)")

SAMPLES = [
    ManifestRequest(req=1, epoch=3, have=None),
    ManifestRequest(req=2, epoch=3, have="k"),
    ManifestOffer(req=1, model="tiny", state="sharding", detail="[1/9] embed", key=None,
                  manifest=None),
    ManifestOffer(req=2, model="tiny", state="ready", detail="", key="k", manifest=MANIFEST),
    PLAN,
    NO_PLAN,
    DeployReport(epoch=3, plan_id=7, state="fetching", units=(), received=10, total=99,
                 detail="fetching 2 unit files"),
    DeployReport(epoch=3, plan_id=7, state="ready", units=(5, 6, 7, 8, 9), received=0, total=0,
                 detail=""),
    UnitChunkRequest(req=4, sha256=SHA, offset=1 << 20, length=1 << 22),
    UnitRefused(req=4, reason="unit abababababab is not served here"),
]


def _round_trip(msg):
    return protocol.decode([bytes(f) for f in protocol.encode(msg)])


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.KIND)
def test_every_deployment_message_round_trips(msg):
    assert _round_trip(msg) == msg


def test_a_chunk_carries_its_bytes_as_one_frame_on_the_data_channel():
    data = np.frombuffer(b"unit bytes", dtype=np.uint8)
    chunk = UnitChunk(req=4, sha256=SHA, offset=100, size=110, tensors={"data": data})
    frames = protocol.encode(chunk)
    assert len(frames) == 2 and bytes(frames[1]) == b"unit bytes"
    back = _round_trip(chunk)
    assert (back.offset, back.size, back.tensors["data"].tobytes()) == (100, 110, b"unit bytes")
    kinds = protocol.kinds()
    assert {k: kinds[k].CHANNEL for k in ("unit-chunk-request", "unit-chunk", "unit-refused",
                                          "plan", "manifest-offer")} == {
        "unit-chunk-request": "data", "unit-chunk": "data", "unit-refused": "data",
        "plan": "control", "manifest-offer": "control"}


def _header(msg) -> dict:
    return msgpack.unpackb(protocol.encode(msg)[0])


def _stages(*triples) -> list[dict]:
    return [{"peer": p, "first": f, "last": last} for p, f, last in triples]


@pytest.mark.parametrize(
    "msg, change, reason",
    [
        (PLAN, {"stages": _stages(("m", 0, 4), ("p", 6, 9))}, "do not follow each other"),
        (PLAN, {"stages": _stages(("p", 0, 4), ("m", 5, 9))}, "first stage must start"),
        (PLAN, {"stages": _stages(("m", 0, 4), ("m", 5, 9))}, "a peer holds two stages"),
        (PLAN, {"stages": _stages(("m", 3, 2))}, "bad unit range"),
        (PLAN, {"manifest": None}, "stages without a model"),
        (PLAN, {"problem": "both"}, "stages and a problem"),
        (PLAN, {"plan_id": 0}, "must be positive"),
        (NO_PLAN, {"problem": None}, "neither stages nor a problem"),
        (SAMPLES[2], {"state": "done"}, "unknown state"),
        (SAMPLES[2], {"key": "k"}, "a key comes with state ready"),
        (SAMPLES[3], {"key": None}, "a key comes with state ready"),
        (SAMPLES[6], {"received": 100}, "bad byte counts"),
        (SAMPLES[6], {"state": "lost"}, "unknown state"),
        (SAMPLES[8], {"sha256": "AB" * 32}, "not a sha256"),
        (SAMPLES[8], {"length": 0}, "length out of range"),
    ],
)
def test_deployment_messages_that_break_a_rule_are_refused(msg, change, reason):
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode([msgpack.packb({**_header(msg), **change})])


def test_a_chunk_outside_its_file_or_of_the_wrong_type_is_refused():
    chunk = UnitChunk(4, SHA, 0, 10, {"data": np.zeros(10, np.uint8)})
    frames = protocol.encode(chunk)
    header = msgpack.unpackb(frames[0])
    with pytest.raises(ProtocolError, match="chunk outside the file"):
        protocol.decode([msgpack.packb({**header, "offset": 5}), frames[1]])
    header["tensors"][0][1] = "int8"
    with pytest.raises(ProtocolError, match="data is not 1-D uint8"):
        protocol.decode([msgpack.packb(header), frames[1]])
