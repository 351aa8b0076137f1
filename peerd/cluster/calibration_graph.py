"""The calibration graph's bytes, written without the `onnx` package.

Importing `onnx` costs every daemon 10 MB resident (measured) for a graph of a few hundred
bytes, so the five ONNX messages it needs are written here in protobuf's wire format, with
the field numbers of onnx.proto. tests/units/cluster/test_benchmark.py parses the bytes with
`onnx`, checks them with its checker and runs them on ONNX Runtime.
"""

from __future__ import annotations

import struct

IR_VERSION = 8
OPSET = 17
FLOAT, INT64 = 1, 7  # TensorProto.DataType
TENSOR_ATTRIBUTE = 4  # AttributeProto.AttributeType.TENSOR


def calibration_model(size: int, depth: int, rows: int = 1) -> bytes:
    """Rows x[rows,size] multiplied by ``depth`` [size,size] matrices, as a step multiplies
    its tokens' activations by its weights: one row as a decode step, many as a prompt's.

    The matrices are ConstantOfShape nodes, which ONNX Runtime folds into weights when it
    loads the graph: the serialized graph stays a few hundred bytes. Each has its own value
    (no two are the same constant to be shared), and together they are far larger than a
    CPU's cache, so every run streams them from memory as decode does."""
    nodes, shapes, previous = [], [], "x"
    for i in range(depth):
        shapes.append(_tensor(f"s{i}", INT64, [2], struct.pack("<2q", size, size)))
        value = _tensor(f"v{i}", FLOAT, [1], struct.pack("<f", (1.0 + i / depth) / size))
        attribute = _text(1, "value") + _field(5, value) + _number(20, TENSOR_ATTRIBUTE)
        nodes.append(_node("ConstantOfShape", [f"s{i}"], f"w{i}", attribute))
        output = "y" if i == depth - 1 else f"h{i}"
        nodes.append(_node("MatMul", [previous, f"w{i}"], output))
        previous = output
    graph = b"".join([
        *(_field(1, node) for node in nodes),
        _text(2, "peerd-calibration"),
        *(_field(5, shape) for shape in shapes),
        _field(11, _matrix("x", rows, size)),
        _field(12, _matrix("y", rows, size)),
    ])
    opset = _number(2, OPSET)
    return _number(1, IR_VERSION) + _field(8, opset) + _field(7, graph)


def _node(op: str, inputs: list[str], output: str, attribute: bytes = b"") -> bytes:
    node = b"".join(_text(1, name) for name in inputs) + _text(2, output) + _text(4, op)
    return node + (_field(5, attribute) if attribute else b"")


def _tensor(name: str, data_type: int, dims: list[int], raw: bytes) -> bytes:
    return (b"".join(_number(1, d) for d in dims) + _number(2, data_type) + _text(8, name)
            + _field(9, raw))


def _matrix(name: str, rows: int, size: int) -> bytes:
    """ValueInfoProto of a float tensor [rows, size]."""
    shape = b"".join(_field(1, _number(1, d)) for d in (rows, size))
    tensor_type = _number(1, FLOAT) + _field(2, shape)
    return _text(1, name) + _field(2, _field(1, tensor_type))


def _number(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _text(field: int, text: str) -> bytes:
    return _field(field, text.encode())


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)
