"""Hypothesis strategies for protocol messages, derived from the message classes themselves.

Field annotations are the schema (peerd/wire/protocol.py), so these follow the protocol as kinds
and fields are added: `typed(hint)` draws values shaped like an annotation, `hinted(hint)`
mixes in values of any type, and `sample(cls)` builds one valid instance. `frames(header,
tensors)` packs a header and tensor frames as `protocol.encode` would, without the message
class checking anything first, so a test can send what a real sender never would.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import msgpack
import numpy as np
from hypothesis import strategies as st

from peerd.wire import protocol

KINDS = protocol.kinds()

leaves = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats() | st.text(max_size=16) | st.binary(max_size=16)
)
msgpack_values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), children, max_size=4),
    max_leaves=16,
)
# Small integers hit the range checks; the extremes hit overflow and size arithmetic.
integers = st.integers(-3, 70) | st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**64 - 1, -(2**63)])
hex_digests = st.text("0123456789abcdef", min_size=64, max_size=64)


def hinted(hint: Any) -> st.SearchStrategy:
    """Values shaped like the annotation, mostly, and sometimes of any other type."""
    return msgpack_values if hint is Any else st.one_of(typed(hint), msgpack_values)


def typed(hint: Any) -> st.SearchStrategy:
    """Values of the annotation's type, in or out of the ranges its message accepts."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([typed(option) for option in typing.get_args(hint)])
    if origin in (list, tuple):
        return st.lists(hinted(typing.get_args(hint)[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), msgpack_values, max_size=4)
    if dataclasses.is_dataclass(hint):
        return fields(hint)
    return {
        type(None): st.none(),
        bool: st.booleans(),
        int: integers,
        float: st.floats() | integers,
        str: st.text(max_size=12) | hex_digests,
        bytes: st.binary(max_size=16),
    }.get(hint, msgpack_values)


def fields(cls: type, overrides: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy:
    """A map of every field of `cls` but its tensors, drawn from `overrides` by field name
    where given, else from the annotation."""
    overrides = overrides or {}
    hints = typing.get_type_hints(cls)
    return st.fixed_dictionaries({
        f.name: overrides[f.name] if f.name in overrides else hinted(hints[f.name])
        for f in dataclasses.fields(cls)
        if f.name not in tensor_fields(cls)
    })


def tensor_fields(cls: type) -> list[str]:
    """The fields of `cls` that carry tensors (as frames)."""
    return [name for name, hint in typing.get_type_hints(cls).items()
            if hint == protocol.Tensors]


def frames(kind: str, values: dict[str, Any], tensors: dict[str, np.ndarray] | None = None,
           ) -> list[bytes]:
    """The frames of a message of `kind` with these header values and tensors, unchecked."""
    header: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION, "kind": kind, **values}
    payload = []
    if tensors is not None:
        header["tensors"] = [[n, a.dtype.name, list(a.shape)] for n, a in tensors.items()]
        payload = [np.ascontiguousarray(a).tobytes() for a in tensors.values()]
    return [msgpack.packb(header, use_bin_type=True), *payload]


# -- valid samples -------------------------------------------------------------------------------

SHA = "ab" * 32
# Fields whose plain value would break a rule of their kind.
RULED: dict[str, dict[str, Any]] = {
    "manifest-offer": {"state": "sharding", "key": None, "manifest": None},
    "deploy-report": {"state": "ready", "received": 0},
    "unit-chunk-request": {"sha256": SHA},
    "unit-chunk": {"sha256": SHA, "offset": 0, "size": 10,
                   "tensors": {"data": np.arange(10, dtype=np.uint8)}},
    "bandwidth": {"tensors": {"payload": np.zeros(64, np.uint8)}},
    "seq-move": {"holders": ("a", "b")},
    "seq-fork": {"source": "s0", "seq_id": "s1"},
    "seq-state": {"units": (1,), "tensors": {"past_s": np.ones((1, 1, 2, 4), np.float32)}},
    "share": {"phase": "gather", "row_start": 0, "row_stop": 3,
              "tensors": {"rows": np.ones((1, 3, 4), np.float32)}},
    "shares-request": {"weights": (1.0, 2.0)},
    "shares-offer": {"state": "exporting"},
    "stage": {"tensors": {"hidden": np.ones((1, 3, 4), np.float32),
                          "position_ids": np.arange(3, dtype=np.int64)[None]}},
}


def _plain_value(hint: Any) -> Any:
    """A simple valid value for an annotation (the first option of a union)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _plain_value(typing.get_args(hint)[0])
    if origin in (list, tuple):
        return ()
    if origin is dict:
        return {}
    if dataclasses.is_dataclass(hint):
        return sample(hint)
    return {bool: True, int: 1, float: 0.5, str: "s1", bytes: b"b"}[hint]


def sample(cls: type) -> Any:
    """A valid instance of a message (or nested) class, built from its annotations."""
    hints = typing.get_type_hints(cls)
    ruled = RULED.get(getattr(cls, "KIND", ""), {})
    values = {
        f.name: ruled[f.name] if f.name in ruled else _plain_value(hints[f.name])
        for f in dataclasses.fields(cls)
        if f.name in ruled or f.default is dataclasses.MISSING
    }
    return cls(**values)
