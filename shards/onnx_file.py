"""Write an ONNX model as one self-contained file without holding it twice in memory.

Serialising a model the usual way builds the whole protobuf in memory, which for a unit of
W weight bytes costs about 3 W on top of the weights themselves. Instead the model is first
saved with its weights as external data (`save_external`, streamed tensor by tensor; ONNX
Runtime memory-maps such weights, so checking the staged model costs 1 W, not 2 W), and the
final file is then written field by field (`write_single_file`): the small model and graph
messages, and each initializer with its raw bytes copied from the external data file in
chunks. Protobuf accepts fields in any order, so the graph (with its initializers) is
written after the other model fields.

The result is an ordinary single-file ONNX model (weights in `raw_data`), as deployment
and ONNX Runtime expect.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import onnx
from torch.onnx import ONNXProgram

_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
_LENGTH_DELIMITED = 2
_CHUNK = 16 * 1024 * 1024


def save_external(program: ONNXProgram, directory: Path) -> Path:
    """Save `program` into `directory` with its weights in a separate data file."""
    staged = Path(directory) / "model.onnx"
    program.save(str(staged), external_data=True)
    return staged


def write_single_file(staged: Path, path: Path) -> int:
    """Write the model saved by `save_external` to `path` as one file; return the bytes of
    its initializers."""
    model = onnx.load(str(staged), load_external_data=False)
    return _write(model, staged.parent, path)


def _write(model: onnx.ModelProto, data_dir: Path, path: Path) -> int:
    graph = model.graph
    initializers = list(graph.initializer)
    del graph.initializer[:]
    pieces = [_Initializer(tensor, data_dir) for tensor in initializers]
    graph_bytes = graph.SerializeToString()
    graph_length = len(graph_bytes) + sum(p.field_length for p in pieces)
    model.ClearField("graph")
    with path.open("wb") as out:
        out.write(model.SerializeToString())
        out.write(_tag(_MODEL_GRAPH) + _varint(graph_length) + graph_bytes)
        for piece in pieces:
            piece.write(out)
    return sum(p.data_length for p in pieces)


class _Initializer:
    """One initializer as a graph field: its message, with raw bytes from the data file."""

    def __init__(self, tensor: onnx.TensorProto, data_dir: Path) -> None:
        self.source: tuple[Path, int] | None = None
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {e.key: e.value for e in tensor.external_data}
            self.source = (data_dir / entries["location"], int(entries.get("offset", 0)))
            self.data_length = int(entries["length"])
            tensor.ClearField("external_data")
            tensor.ClearField("data_location")
            body = tensor.SerializeToString() + _tag(_TENSOR_RAW_DATA) + _varint(self.data_length)
            streamed = self.data_length
        else:
            self.data_length = len(tensor.raw_data) or _typed_bytes(tensor)
            body = tensor.SerializeToString()
            streamed = 0
        self.head = _tag(_GRAPH_INITIALIZER) + _varint(len(body) + streamed) + body
        self.field_length = len(self.head) + streamed

    def write(self, out: BinaryIO) -> None:
        out.write(self.head)
        if self.source is None:
            return
        location, offset = self.source
        with location.open("rb") as data:
            data.seek(offset)
            remaining = self.data_length
            while remaining:
                chunk = data.read(min(_CHUNK, remaining))
                if not chunk:
                    raise OSError(f"external data {location} ends early")
                out.write(chunk)
                remaining -= len(chunk)


def _typed_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of a small tensor stored in a typed field (e.g. int64_data) rather than raw."""
    return onnx.numpy_helper.to_array(tensor).nbytes


def _tag(field: int) -> bytes:
    return _varint(field << 3 | _LENGTH_DELIMITED)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)

