"""The wire protocol: every message peers exchange is defined here, and only here.

A message travels as a list of ZeroMQ frames: frame 0 is a msgpack map
``{"v": PROTOCOL_VERSION, "kind": KIND, ...fields}``; a message with tensors lists them in the
header as ``"tensors": [[name, dtype, shape], ...]`` and sends each tensor's raw bytes as one
more frame, in that order (no pickling; decoding is zero-copy over the received buffers).

Messages are frozen dataclasses registered with ``@message("kind")``. Their field annotations
are the schema: ``decode`` checks every header field against them, so a handler only ever sees
well-typed messages. Anything else raises ``ProtocolError``; receivers log it and drop the
message.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
MAX_HEADER_BYTES = 1024 * 1024
MAX_TENSORS = 4096
MAX_RANK = 8

# The dtypes a tensor frame may carry; anything else is refused on receipt.
WIRE_DTYPES = frozenset({"float32", "float16", "int64", "int32", "int8", "uint8", "bool"})

Tensors = dict[str, np.ndarray]


class ProtocolError(ValueError):
    """A message that is malformed, of an unknown kind, or of another protocol version."""


_REGISTRY: dict[str, type] = {}


def message(kind: str):
    """Register a frozen dataclass as the message of this kind."""

    def register(cls):
        if kind in _REGISTRY:
            raise TypeError(f"message kind {kind!r} registered twice")
        cls.KIND = kind
        _REGISTRY[kind] = cls
        return cls

    return register


def kinds() -> dict[str, type]:
    return dict(_REGISTRY)


@message("stage")
@dataclasses.dataclass(frozen=True)
class StageData:
    """Activations for one step of one sequence, sent to the stage that consumes them.

    ``tensors`` maps manifest output names to arrays: the sequential input of the receiving
    stage, or the residual outputs it consumes. ``step`` counts forward passes of the sequence
    (0 is the prefill), so a receiver can pair residuals with the sequential input of the same
    step.
    """

    KIND: ClassVar[str]
    seq_id: str
    step: int
    tensors: Tensors


def encode(msg: Any) -> list[bytes | memoryview]:
    """Frames for a registered message: a msgpack header, then one frame per tensor."""
    kind = getattr(type(msg), "KIND", None)
    if kind not in _REGISTRY or _REGISTRY[kind] is not type(msg):
        raise TypeError(f"not a registered message: {type(msg).__name__}")
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind}
    frames: list[bytes | memoryview] = []
    for field in dataclasses.fields(msg):
        value = getattr(msg, field.name)
        if field.name == "tensors":
            header["tensors"], frames = _tensor_frames(value)
        else:
            header[field.name] = value
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _tensor_frames(tensors: Tensors) -> tuple[list, list[memoryview]]:
    specs, frames = [], []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = array.dtype.name
        if dtype not in WIRE_DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {dtype} cannot travel on the wire")
        specs.append([name, dtype, list(array.shape)])
        frames.append(memoryview(array).cast("B"))
    return specs, frames


def decode(frames: Sequence[bytes | memoryview | Any]) -> Any:
    """The message carried by these frames, or ProtocolError saying what is wrong."""
    if not frames:
        raise ProtocolError("empty message")
    buffers = [_buffer(frame) for frame in frames]
    total = sum(len(b) for b in buffers)
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {total} bytes exceeds {MAX_MESSAGE_BYTES}")
    header = _unpack_header(buffers[0])
    cls = _REGISTRY.get(header.pop("kind", None))
    if cls is None:
        raise ProtocolError("unknown message kind")
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name == "tensors":
            values["tensors"] = _decode_tensors(header.pop("tensors", None), buffers[1:])
            continue
        if field.name not in header:
            if field.default is not dataclasses.MISSING:
                continue
            raise ProtocolError(f"{cls.KIND}: missing field {field.name!r}")
        values[field.name] = _check(header.pop(field.name), hints[field.name], field.name)
    if header:
        raise ProtocolError(f"{cls.KIND}: unexpected fields {sorted(header)}")
    if "tensors" not in values and len(buffers) > 1:
        raise ProtocolError(f"{cls.KIND}: carries no tensors but has {len(buffers) - 1} frames")
    return cls(**values)


def _buffer(frame: Any) -> memoryview:
    if hasattr(frame, "buffer"):  # zmq.Frame
        frame = frame.buffer
    return memoryview(frame).cast("B")


def _unpack_header(buffer: memoryview) -> dict:
    if len(buffer) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(buffer)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(buffer, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    if header.pop("v", None) != PROTOCOL_VERSION:
        raise ProtocolError(f"not protocol version {PROTOCOL_VERSION}")
    return header


def _decode_tensors(specs: Any, buffers: list[memoryview]) -> Tensors:
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError("tensors: expected a list of [name, dtype, shape]")
    if len(specs) != len(buffers):
        raise ProtocolError(f"tensors: header lists {len(specs)}, message has {len(buffers)}")
    tensors: Tensors = {}
    for spec, buffer in zip(specs, buffers, strict=True):
        name, dtype, shape = _tensor_spec(spec)
        if name in tensors:
            raise ProtocolError(f"tensor {name!r} sent twice")
        itemsize = np.dtype(dtype).itemsize
        if math.prod(shape) * itemsize != len(buffer):
            raise ProtocolError(
                f"tensor {name!r}: {len(buffer)} bytes do not fit {dtype}{list(shape)}"
            )
        tensors[name] = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    return tensors


def _tensor_spec(spec: Any) -> tuple[str, str, tuple[int, ...]]:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise ProtocolError("tensor spec is not [name, dtype, shape]")
    name, dtype, shape = spec
    if not isinstance(name, str) or dtype not in WIRE_DTYPES:
        raise ProtocolError(f"tensor spec has a bad name or dtype: {name!r} {dtype!r}")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_RANK
        and all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"tensor {name!r}: bad shape {shape!r}")
    return name, dtype, tuple(shape)


def _check(value: Any, hint: Any, name: str) -> Any:
    """value, if it matches the annotation; lists come back as tuples for tuple hints."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check(value, option, name)
            except ProtocolError:
                continue
        raise ProtocolError(f"field {name!r}: {type(value).__name__} is not {hint}")
    if hint is Any:
        return value
    if hint is type(None):
        if value is None:
            return None
    elif origin in (list, tuple):
        if isinstance(value, list):
            item = typing.get_args(hint)[0]
            items = [_check(v, item, f"{name}[]") for v in value]
            return tuple(items) if origin is tuple else items
    elif origin is dict:
        if isinstance(value, dict):
            key_hint, value_hint = typing.get_args(hint)
            return {
                _check(k, key_hint, f"{name} key"): _check(v, value_hint, f"{name}[{k!r}]")
                for k, v in value.items()
            }
    elif hint is float:
        if type(value) in (int, float) and math.isfinite(value):
            return float(value)
    elif hint in (int, str, bool, bytes):
        if type(value) is hint:
            return value
    else:
        raise TypeError(f"field {name!r}: annotation {hint} is not supported on the wire")
    raise ProtocolError(f"field {name!r}: {type(value).__name__} is not {hint}")

