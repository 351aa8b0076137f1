"""Fuzzing the wire decoder: whatever arrives, `protocol.decode` returns a well-formed message
of a registered kind or raises `ProtocolError`, never anything else.

The strategies are derived from the message classes themselves (their field annotations are
the schema), so every kind is covered, including ones added later: headers shaped like each
kind with wrong types, missing, extra and out-of-range fields; tensor specs whose dtype or
shape does not match the frame; truncated, missing and extra frames; headers and messages
over the size limits; unknown kinds and versions; and plain garbage. A message that does
decode must survive encode -> decode unchanged, so nothing half-checked gets through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_strategies import KINDS, fields, integers, msgpack_values, sample, tensor_fields

from peerd.wire import protocol
from peerd.wire.protocol import MAX_HEADER_BYTES, MAX_MESSAGE_BYTES, ProtocolError
from shards.sampling import Distribution

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
dimensions = st.integers(0, 6) | st.sampled_from([2**31, 2**40, 2**62, 2**64 - 1, -1])
dtype_names = st.sampled_from(sorted(protocol.WIRE_DTYPES)) | st.sampled_from(
    ["complex64", "float64", "object", "U8", "V3", "<f4", ""]
)


@st.composite
def tensor_parts(draw) -> tuple[list, list[bytes]]:
    """Tensor specs and frames: mostly consistent, sometimes off in dtype, shape, length,
    count or form."""
    specs, frames = [], []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["data", "payload", "hidden", "x"]) | st.text(max_size=6))
        dtype = draw(dtype_names)
        shape = draw(st.lists(dimensions, max_size=4) | st.lists(st.integers(0, 2), max_size=10))
        try:
            size = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
        except (TypeError, ValueError):
            size = 0
        length = min(max(size + draw(st.sampled_from([0, 0, 0, -1, 1, 7])), 0), 4096)
        specs.append(draw(st.just([name, dtype, shape]) | msgpack_values))
        frames.append(draw(st.binary(min_size=length, max_size=length)))
    extra = draw(st.sampled_from([0, 0, 0, 1, -1]))
    frames = frames[:extra] if extra < 0 else frames + [b"\0" * 8] * extra
    return draw(st.just(specs) | msgpack_values), frames


@st.composite
def kind_shaped(draw) -> list[bytes]:
    """A header shaped like a registered kind, then possibly broken further."""
    cls = draw(st.sampled_from(sorted(KINDS.values(), key=lambda c: c.KIND)))
    header: dict[Any, Any] = {"v": protocol.PROTOCOL_VERSION, "kind": cls.KIND, **draw(fields(cls))}
    frames: list[bytes] = []
    for name in tensor_fields(cls):
        header[name], more = draw(tensor_parts())
        frames.extend(more)
    for field in draw(st.lists(st.sampled_from(sorted(header)), max_size=2)):
        header.pop(field, None)
    header.update(draw(st.dictionaries(st.sampled_from(["v", "kind", "extra", "req", "epoch"]),
                                       msgpack_values, max_size=2)))
    return [msgpack.packb(header, use_bin_type=True), *frames]


@st.composite
def cut_short(draw) -> list[bytes]:
    """A valid message with frames truncated, dropped or duplicated."""
    msg = draw(st.sampled_from(VALID))
    frames = [bytes(f) for f in protocol.encode(msg)]
    index = draw(st.integers(0, len(frames) - 1))
    action = draw(st.sampled_from(["truncate", "drop", "duplicate", "flip"]))
    if action == "truncate":
        frames[index] = frames[index][: draw(st.integers(0, max(len(frames[index]) - 1, 0)))]
    elif action == "drop":
        del frames[index]
    elif action == "duplicate":
        frames.insert(index, frames[index])
    elif frames[index]:
        position = draw(st.integers(0, len(frames[index]) - 1))
        flipped = frames[index][position] ^ draw(st.integers(1, 255))
        frames[index] = frames[index][:position] + bytes([flipped]) + frames[index][position + 1:]
    return frames


# every kind, and a sampled check carrying its drafts' distributions
VALID = [*(sample(cls) for cls in KINDS.values()),
         dataclasses.replace(sample(protocol.StageData), rows=2, draft_probs=protocol.draft_probs(
             [4], [Distribution(np.int32([4, 7]), np.float32([0.5, 0.5]))]))]


def _header(cls: type) -> dict:
    """The msgpack header of a valid message of this kind."""
    return msgpack.unpackb(protocol.encode(sample(cls))[0])


def _decoded_or_refused(frames: list) -> Any:
    """The decoded message, or None when the decoder refused it with a ProtocolError; any
    other exception fails the test."""
    try:
        msg = protocol.decode(frames)
    except ProtocolError as exc:
        assert str(exc) and "\n" not in str(exc), "the reason is one line"
        return None
    assert KINDS[msg.KIND] is type(msg)
    again = protocol.encode(msg)
    assert [bytes(f) for f in protocol.encode(protocol.decode(again))] == [
        bytes(f) for f in again
    ], "a decoded message survives encode -> decode unchanged"
    return msg


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=4))
def test_random_bytes_are_refused_with_a_protocol_error(frames):
    _decoded_or_refused(frames)


@FUZZ
@given(msgpack_values, st.lists(st.binary(max_size=64), max_size=3))
def test_arbitrary_msgpack_headers_are_refused_or_decoded_whole(header, frames):
    _decoded_or_refused([msgpack.packb(header, use_bin_type=True), *frames])


@pytest.mark.slow
@FUZZ
@given(kind_shaped())
def test_headers_shaped_like_every_kind_decode_whole_or_are_refused(frames):
    _decoded_or_refused(frames)


@FUZZ
@given(cut_short())
def test_truncated_dropped_duplicated_or_flipped_frames_are_refused_or_decode_whole(frames):
    _decoded_or_refused(frames)


@settings(max_examples=200, deadline=None)
@given(seq_id=st.text(max_size=8), step=integers, parts=tensor_parts())
def test_stage_data_whose_tensor_specs_do_not_match_their_frames_is_refused(seq_id, step, parts):
    specs, frames = parts
    header = {**_header(protocol.StageData), "seq_id": seq_id, "step": step, "tensors": specs}
    msg = _decoded_or_refused([msgpack.packb(header, use_bin_type=True), *frames])
    if msg is not None:
        for (name, dtype, shape), frame in zip(specs, frames, strict=True):
            tensor = msg.tensors[name]
            assert (tensor.dtype.name, list(tensor.shape)) == (np.dtype(dtype).name, shape)
            assert tensor.nbytes == len(frame)


def test_a_zero_sized_tensor_with_an_enormous_dimension_is_refused():
    for shape in ([0, 2**64 - 1], [0, 2**62, 2**62], [2**40, 0]):
        header = {**_header(protocol.StageData), "tensors": [["t", "float32", shape]]}
        assert _decoded_or_refused([msgpack.packb(header), b""]) is None, shape


def test_empty_tensors_of_any_rank_travel():
    empty = {"past_k_0": np.zeros((1, 2, 0, 16), np.float32), "mask": np.zeros((0, 0), bool)}
    msg = protocol.decode(protocol.encode(
        dataclasses.replace(sample(protocol.StageData), tensors=empty)))
    assert {n: t.shape for n, t in msg.tensors.items()} == {n: t.shape for n, t in empty.items()}


def test_a_header_over_its_limit_is_refused_before_it_is_unpacked():
    header = msgpack.packb({"v": 1, "kind": "ping", "req": 1, "pad": "x" * MAX_HEADER_BYTES})
    assert _decoded_or_refused([header]) is None


def test_a_message_over_its_limit_is_refused_without_reading_it():
    # Anonymous memory is not committed until touched: this costs no real memory.
    with contextlib.closing(mmap.mmap(-1, MAX_MESSAGE_BYTES + 1)) as huge:
        header = protocol.encode(protocol.BandwidthProbe(1, {"payload": np.zeros(0, np.uint8)}))
        view = memoryview(huge)
        try:
            assert _decoded_or_refused([header[0], view]) is None
        finally:
            view.release()


@FUZZ
@given(kind=st.sampled_from(sorted(KINDS)) | st.text(max_size=20) | msgpack_values,
       version=st.sampled_from([True, 1, protocol.PROTOCOL_VERSION - 1,
                                float(protocol.PROTOCOL_VERSION),
                                protocol.PROTOCOL_VERSION + 1]) | msgpack_values)
def test_unknown_kinds_and_versions_are_refused(kind, version):
    header = {"v": version, "kind": kind, "req": 1}
    if (type(version) is int and version == protocol.PROTOCOL_VERSION
            and isinstance(kind, str) and kind in KINDS):
        return
    assert _decoded_or_refused([msgpack.packb(header, use_bin_type=True)]) is None
