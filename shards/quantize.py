"""int8 dynamic quantisation of a staged unit, one weight (and one slice of it) at a time.

MatMul weights become int8, per tensor and symmetric, and the MatMul becomes ONNX Runtime's
DynamicQuantizeMatMul, which quantises its activations at run time (the op ONNX Runtime
fuses quantize_dynamic's output into). A Gather over a float table (the embedding) gathers
from a uint8 table (asymmetric) and dequantises the rows it took. That is what
onnxruntime.quantization's quantize_dynamic does by default, and the scales, zero points and
rounding come from its own helpers, so the results are the same to the bit. The graph is
rewritten here because quantize_dynamic holds the model several times over in memory (about
7x the unit's float32 weights at its peak), while this reads each weight through a memory
map and writes its quantised version in slices.

Input and output are models saved with external data (see shards/onnx_file.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.quant_utils import compute_data_quant_params, quantize_nparray

MS_DOMAIN = "com.microsoft"
_QTYPES = {"MatMul": TensorProto.INT8, "Gather": TensorProto.UINT8}
_SLICE_BYTES = 16 * 1024 * 1024
_DATA_FILE = "int8.data"


@dataclass(frozen=True)
class _Quantized:
    weight: str  # int8 (MatMul) or uint8 (Gather) initializer
    scale: str
    zero_point: str


def quantize_unit(staged: Path) -> Path:
    """Write the int8 version of the model at `staged` beside it; return its path."""
    model = onnx.load(str(staged), load_external_data=False)
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    done: dict[str, _Quantized] = {}
    added: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    with (staged.parent / _DATA_FILE).open("wb") as sink:
        for node in graph.node:
            weight = _float_weight(node, initializers)
            if weight is None:
                nodes.append(node)
                continue
            if weight not in done:
                array = _read(initializers[weight], staged.parent)
                done[weight] = _quantize(weight, array, _QTYPES[node.op_type], sink, added)
            nodes.extend(_rewrite(node, done[weight]))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    out = staged.parent / "int8.onnx"
    onnx.save(model, str(out))
    return out


def _float_weight(node: onnx.NodeProto, initializers: dict[str, TensorProto]) -> str | None:
    """The float matrix this MatMul multiplies by, or this Gather reads from, if constant."""
    position = {"MatMul": 1, "Gather": 0}.get(node.op_type)
    if position is None or len(node.input) <= position:
        return None
    tensor = initializers.get(node.input[position])
    if tensor is None or tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2:
        return None
    return tensor.name


def _read(tensor: TensorProto, directory: Path) -> np.ndarray:
    """A float32 weight, memory-mapped when it lives in an external data file."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    entries = {e.key: e.value for e in tensor.external_data}
    return np.memmap(
        directory / entries["location"], dtype=np.float32, mode="r",
        offset=int(entries.get("offset", 0)), shape=tuple(tensor.dims),
    )


def _quantize(
    name: str, array: np.ndarray, qtype: int, sink: BinaryIO, added: list[TensorProto]
) -> _Quantized:
    rows = max(1, _SLICE_BYTES // max(1, array[0].nbytes))
    slices = [array[i : i + rows] for i in range(0, len(array), rows)]
    low = min(float(s.min()) for s in slices)
    high = max(float(s.max()) for s in slices)
    zero_point, scale = compute_data_quant_params(
        array, qtype, symmetric=qtype == TensorProto.INT8, rmin_override=low, rmax_override=high
    )
    numpy_type = helper.tensor_dtype_to_np_dtype(qtype)
    offset = sink.tell()
    for part in slices:
        quantized_part = quantize_nparray(qtype, np.asarray(part), scale, zero_point)
        sink.write(quantized_part.astype(numpy_type).tobytes())
    quantized = _Quantized(f"{name}_quantized", f"{name}_scale", f"{name}_zero_point")
    added.append(_external(quantized.weight, qtype, array.shape, offset, sink.tell() - offset))
    added.append(numpy_helper.from_array(np.asarray(scale, np.float32), quantized.scale))
    added.append(numpy_helper.from_array(np.asarray(zero_point, numpy_type), quantized.zero_point))
    return quantized


def _external(
    name: str, qtype: int, shape: tuple[int, ...], offset: int, length: int
) -> TensorProto:
    tensor = TensorProto(name=name, data_type=qtype, dims=list(shape))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", _DATA_FILE), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def _rewrite(node: onnx.NodeProto, q: _Quantized) -> list[onnx.NodeProto]:
    if node.op_type == "MatMul":
        inputs = [node.input[0], q.weight, q.scale, q.zero_point]
        return [helper.make_node("DynamicQuantizeMatMul", inputs, list(node.output),
                                 name=node.name, domain=MS_DOMAIN)]
    gathered = f"{node.output[0]}_quantized"
    gather = helper.make_node("Gather", [q.weight, node.input[1]], [gathered], name=node.name)
    gather.attribute.extend(node.attribute)
    dequantize = helper.make_node("DequantizeLinear", [gathered, q.scale, q.zero_point],
                                  list(node.output), name=f"{node.name}_dequantize")
    return [gather, dequantize]
