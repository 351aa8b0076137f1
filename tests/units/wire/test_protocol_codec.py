"""The wire codec: round trips, zero-copy decoding, and refusal of malformed frames."""

import msgpack
import numpy as np
import pytest

from peerd.wire import protocol
from peerd.wire.protocol import ProtocolError, StageData
from shards.sampling import Distribution


def _stage() -> StageData:
    rng = np.random.default_rng(0)
    return StageData(
        plan="1.1",
        seq_id="s1",
        step=3,
        tensors={
            "hidden": rng.standard_normal((1, 5, 8), dtype=np.float32),
            "position_ids": np.arange(5, dtype=np.int64).reshape(1, 5),
            "mask": np.tril(np.ones((5, 5), dtype=bool)),
            "half": rng.standard_normal((2, 3)).astype(np.float16),
        },
    )


def test_stage_round_trip_preserves_every_tensor_bit_for_bit():
    msg = _stage()
    back = protocol.decode([bytes(f) for f in protocol.encode(msg)])
    assert (back.seq_id, back.step) == (msg.seq_id, msg.step)
    assert list(back.tensors) == list(msg.tensors)
    for name, array in msg.tensors.items():
        assert back.tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(back.tensors[name], array)


def test_decoded_tensors_view_the_received_buffers_without_copying():
    frames = [bytearray(f) for f in protocol.encode(_stage())]
    back = protocol.decode(frames)
    frames[1][0:4] = np.float32(42.0).tobytes()
    assert back.tensors["hidden"][0, 0, 0] == 42.0


def test_non_contiguous_arrays_travel_correctly():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    msg = StageData(plan="1.1", seq_id="x", step=0, tensors={"t": base[:, ::2]})
    back = protocol.decode(protocol.encode(msg))
    np.testing.assert_array_equal(back.tensors["t"], base[:, ::2])


def _header(frames) -> dict:
    return msgpack.unpackb(frames[0])


def _with_header(frames, **changes):
    header = _header(frames)
    header.update(changes)
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda f: [], "empty"),
        (lambda f: [b"\xc1garbage", *f[1:]], "not msgpack"),
        (lambda f: [msgpack.packb([1, 2]), *f[1:]], "not a map"),
        (lambda f: _with_header(f, v=99), "version"),
        (lambda f: _with_header(f, kind="nope"), "unknown message kind"),
        (lambda f: _with_header(f, step="3"), "step"),
        (lambda f: _with_header(f, extra=1), "unexpected fields"),
        (lambda f: f[:-1], "header lists"),
        (lambda f: [*f[:-1], bytes(f[-1])[:-1]], "do not fit"),
        (lambda f: _with_header(f, tensors=[["a", "complex64", [1]]] * 4), "bad name or dtype"),
        (lambda f: _with_header(f, tensors=[["a", "float32", [-1]]] * 4), "bad shape"),
        (lambda f: _with_header(f, tensors="x"), "expected a list"),
    ],
)
def test_malformed_frames_raise_protocol_error_naming_the_fault(mutate, reason):
    frames = [bytes(f) for f in protocol.encode(_stage())]
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(mutate(frames))


def test_missing_field_is_refused():
    frames = protocol.encode(_stage())
    header = _header(frames)
    del header["seq_id"]
    with pytest.raises(ProtocolError, match="missing field 'seq_id'"):
        protocol.decode([msgpack.packb(header), *frames[1:]])


def test_oversized_message_is_refused(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 64)
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(protocol.encode(_stage()))


def test_unregistered_types_cannot_be_encoded():
    with pytest.raises(TypeError):
        protocol.encode(object())


def test_tensors_of_unsupported_dtype_cannot_be_sent():
    msg = StageData(plan="1.1", seq_id="x", step=0, tensors={"c": np.zeros(2, dtype=np.complex64)})
    with pytest.raises(TypeError, match="cannot travel"):
        protocol.encode(msg)


def test_a_token_travels_with_its_logprobs_and_without_them():
    plain = protocol.SequenceToken("s", 3, 7)
    ranked = protocol.SequenceToken("s", 3, 7, -0.25, (7, 2), (-0.25, -1.5))
    for token in (plain, ranked):
        assert protocol.decode(protocol.encode(token)) == token
    opened = protocol.SequenceOpen(0, "1.1", "s", 0.5, 0, 1.0, 0, 0, logprobs=20)
    assert protocol.decode(protocol.encode(opened)) == opened


@pytest.mark.parametrize("fields, reason", [
    ({"logprob": -1.0, "top_ids": (1, 2), "top_logprobs": (-1.0,)}, "differ"),
    ({"logprob": 0.5}, "above 0"),
    ({"top_ids": (1,), "top_logprobs": (-1.0,)}, "without the token's"),
    ({"logprob": -1.0, "top_ids": tuple(range(21)), "top_logprobs": (-1.0,) * 21}, "exceed 20"),
])
def test_token_logprobs_out_of_shape_are_refused(fields, reason):
    with pytest.raises(ProtocolError, match=reason):
        protocol.SequenceToken("s", 0, 1, **fields)


def test_a_sequence_open_asking_for_more_than_20_logprobs_is_refused():
    with pytest.raises(ProtocolError, match="logprobs outside 0..20"):
        protocol.SequenceOpen(0, "1.1", "s", 0.5, 0, 1.0, 0, 0, logprobs=21)


def _drafts(**changes) -> dict[str, np.ndarray]:
    """StageData.draft_probs of two drafts (tokens 3 and 9), with `changes` to its arrays."""
    q = [Distribution(np.array([3, 5], np.int32), np.array([0.75, 0.25], np.float32)),
         Distribution(np.array([9, 1, 2], np.int32), np.array([0.5, 0.3, 0.2], np.float32))]
    return {**protocol.draft_probs([3, 9], q), **changes}


def _stage_carrying(draft_probs: dict[str, np.ndarray], rows: int = 3) -> list[bytes]:
    """The frames of a check of `rows` rows carrying these draft probabilities, unchecked."""
    frames = [bytes(f) for f in protocol.encode(StageData("1.1", "s", 2, {}, rows=rows))]
    specs = [[name, a.dtype.name, list(a.shape)] for name, a in draft_probs.items()]
    return [*_with_header(frames, draft_probs=specs),
            *(np.ascontiguousarray(a).tobytes() for a in draft_probs.values())]


def test_a_sampled_check_carries_its_drafts_distributions():
    msg = StageData("1.1", "s", 2, _stage().tensors, rows=3, draft_probs=_drafts())
    back = protocol.decode(protocol.encode(msg))
    np.testing.assert_array_equal(back.tensors["hidden"], msg.tensors["hidden"])
    tokens, proposals = protocol.read_draft_probs(back.draft_probs)
    assert tokens == [3, 9]
    assert [q.ids.tolist() for q in proposals] == [[3, 5], [9, 1, 2]]
    np.testing.assert_array_equal(proposals[1].probs, np.float32([0.5, 0.3, 0.2]))
    assert protocol.decode(_stage_carrying(_drafts())).draft_probs.keys() == _drafts().keys()


@pytest.mark.parametrize("draft_probs, rows, reason", [
    (_drafts(probs=np.float32([0.75, np.nan, 0.5, 0.3, 0.2])), 3, "not all finite and >= 0"),
    (_drafts(probs=np.float32([0.75, -0.25, 0.5, 0.3, 0.2])), 3, "not all finite and >= 0"),
    (_drafts(sizes=np.int32([2, 2])), 3, "do not add up"),
    (_drafts(sizes=np.int32([0, 5])), 3, "do not add up"),
    (_drafts(), 2, "for 2 drafts in a step of 1"),
    (_drafts(ids=np.int32([3, -5, 9, 1, 2])), 3, "negative draft token id"),
    (_drafts(tokens=np.int32([5, 9]), probs=np.float32([0.75, 0, 0.5, 0.3, 0.2])), 3,
     "gives no probability"),
    (_drafts(tokens=np.int32([4, 9])), 3, "gives no probability"),
    (_drafts(ids=np.int64([3, 5, 9, 1, 2])), 3, "1-D, int32 but probs float32"),
    ({"tokens": np.int32([3])}, 2, "draft_probs holds"),
])
def test_malformed_draft_probabilities_are_refused_in_one_line(draft_probs, rows, reason):
    with pytest.raises(ProtocolError, match=reason) as refused:
        protocol.decode(_stage_carrying(draft_probs, rows))
    assert "\n" not in str(refused.value)
