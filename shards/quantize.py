"""Quantisation of a staged unit, one weight (and one slice of it) at a time.

Every constant float matrix a MatMul multiplies by, or a Gather reads rows from (the
embedding), is replaced, and so is the node. For int4 so is a Gemm that is a plain matrix
product (no bias input, no transposes, alpha 1: GPT-2's Conv1D layers, whose bias is a
separate Add); int8 leaves Gemm alone, as quantize_dynamic does for MatMul and Gather only:

- int8: MatMul weights become int8, per tensor and symmetric, under ONNX Runtime's
  DynamicQuantizeMatMul, which quantises its activations at run time (the op ONNX Runtime
  fuses quantize_dynamic's output into). A Gather gathers from a uint8 table (asymmetric)
  and dequantises the rows it took. That is what onnxruntime.quantization's quantize_dynamic
  does by default, and the scales, zero points and rounding come from its own helpers, so
  the results are the same to the bit.
- int4: weight-only blocks of BLOCK values along the reduction axis, symmetric (no zero
  points), one float32 scale per block. A MatMul becomes com.microsoft.MatMulNBits with
  accuracy_level 4 (activations quantised to int8 per block at run time, int8 dot
  products); a Gather becomes com.microsoft.GatherBlockQuantized over uint8 data with
  bits=4, which reads the MatMulNBits layout: the table [V, H] is stored as the MatMulNBits
  weight of its transpose. The packing and the scales come from ONNX Runtime's own C++
  block quantiser (`quantize_matmul_4bits`, what MatMulNBitsQuantizer calls), so a MatMul
  quantised here is the one MatMulNBitsQuantizer writes. MatMuls that multiply the same
  activation (q, k and v; gate and up) become one MatMulNBits over their weights side by
  side, its product split after (`_int4_siblings`). A table whose rows do not split into
  whole blocks is quantised as for int8.

Why symmetric blocks of 32: per float32 weight they cost 0.5 + 4/32 = 0.625 bytes (0.156x);
zero points would add 1/64 (0.160x) for 7% less error on normal weights, and took about 20%
longer per decode step on the development machine (bench/quant.py measures the result).

The graph is rewritten here because ONNX Runtime's quantisers hold the model several times
over in memory (quantize_dynamic peaks at about 7x the unit's float32 weights), while this
reads each weight through a memory map and writes its quantised version in slices to one
data file beside the model. Input and output are models saved with external data (see
shards/onnx_file.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# the native module's names are not visible to a type checker
from onnxruntime.capi._pybind_state import quantize_matmul_4bits  # pyright: ignore[reportAttributeAccessIssue]
from onnxruntime.quantization.quant_utils import compute_data_quant_params, quantize_nparray

from shards.manifest import Quant

MS_DOMAIN = "com.microsoft"
BLOCK = 32  # int4 values per scale
ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations
_SLICE_BYTES = 16 * 1024 * 1024  # float32 bytes read per slice
_DATA_FILE = "quantized.data"


@dataclass(frozen=True)
class _Quantized:
    inputs: tuple[str, ...]  # the quantised weight, its scale(s) and zero point if any
    shape: tuple[int, ...]  # of the float matrix it replaces


class _Sink:
    """The data file of the quantised weights: each tensor is appended as external data."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.tensors: list[TensorProto] = []

    def tensor(
        self, name: str, qtype: int, dims: tuple[int, ...], parts: Iterator[np.ndarray]
    ) -> None:
        offset = self.handle.tell()
        for part in parts:
            self.handle.write(np.ascontiguousarray(part).tobytes())
        tensor = TensorProto(name=name, data_type=qtype, dims=list(dims))
        tensor.data_location = TensorProto.EXTERNAL
        length = self.handle.tell() - offset
        for key, value in (("location", _DATA_FILE), ("offset", offset), ("length", length)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        self.tensors.append(tensor)

    def small(self, array: np.ndarray, name: str) -> None:
        self.tensors.append(numpy_helper.from_array(array, name))


Quantizer = Callable[[str, np.ndarray, _Sink], _Quantized]
Rewriter = Callable[[onnx.NodeProto, _Quantized], list[onnx.NodeProto]]


def quantize_unit(staged: Path, quant: Quant) -> Path:
    """Write the `quant` version of the model at `staged` beside it; return its path."""
    model = onnx.load(str(staged), load_external_data=False)
    graph = model.graph
    with (staged.parent / _DATA_FILE).open("wb") as handle:
        sink = _Sink(handle)
        nodes = _rewritten(graph, quant, staged.parent, sink)
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept + sink.tensors)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    out = staged.parent / "quantized.onnx"
    onnx.save(model, str(out))
    return out


def _rewritten(graph: onnx.GraphProto, quant: Quant, directory: Path, sink: _Sink
               ) -> list[onnx.NodeProto]:
    """The graph's nodes with every weight it quantises quantised (once) into `sink`."""
    initializers = {t.name: t for t in graph.initializer}
    siblings = _int4_siblings(graph, initializers) if quant is Quant.INT4 else {}
    done: dict[tuple[str, str], _Quantized] = {}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        group = siblings.get(node.output[0])
        if group is not None:
            if node is group[0]:
                nodes.extend(_fused_matmul_nbits(group, initializers, directory, sink))
            continue
        weight = _float_weight(node, initializers)
        scheme = _scheme(quant, node, initializers[weight]) if weight else None
        if not weight or not scheme:
            nodes.append(node)
            continue
        quantize, rewrite = scheme
        key = (weight, quantize.__name__)
        if key not in done:
            done[key] = quantize(weight, _read(initializers[weight], directory), sink)
        nodes.extend(rewrite(node, done[key]))
    return nodes


def _scheme(quant: Quant, node: onnx.NodeProto, weight: TensorProto
            ) -> tuple[Quantizer, Rewriter] | None:
    """How to quantise this node's weight and what replaces the node; None: leave it."""
    if node.op_type == "Gemm":
        return (_int4_matmul, _matmul_nbits) if quant is Quant.INT4 else None
    if node.op_type == "MatMul":
        return (_int4_matmul, _matmul_nbits) if quant is Quant.INT4 else (_int8, _dynamic_matmul)
    whole_blocks = weight.dims[1] % BLOCK == 0 and _attribute(node, "axis", 0) == 0
    if quant is Quant.INT4 and whole_blocks:
        return _int4_table, _block_gather
    return _uint8, _dequantized_gather


def _float_weight(node: onnx.NodeProto, initializers: dict[str, TensorProto]) -> str | None:
    """The float matrix this MatMul (or plain Gemm) multiplies by, or this Gather reads
    from, if constant."""
    position = {"MatMul": 1, "Gather": 0, "Gemm": 1 if _plain_gemm(node) else None}.get(
        node.op_type)
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


def _rows(array: np.ndarray) -> Iterator[np.ndarray]:
    """The matrix in slices of whole rows of about _SLICE_BYTES each."""
    step = max(1, _SLICE_BYTES // max(1, array[0].nbytes))
    for start in range(0, len(array), step):
        yield array[start : start + step]


# -- int8 -------------------------------------------------------------------------------------
def _int8(name: str, array: np.ndarray, sink: _Sink,
          qtype: TensorProto.DataType = TensorProto.INT8) -> _Quantized:
    """One scale (and zero point) for the whole matrix, as quantize_dynamic computes them."""
    low = min(float(part.min()) for part in _rows(array))
    high = max(float(part.max()) for part in _rows(array))
    zero_point, scale = compute_data_quant_params(
        array, qtype, symmetric=qtype == TensorProto.INT8, rmin_override=low, rmax_override=high
    )
    numpy_type = helper.tensor_dtype_to_np_dtype(qtype)
    quantized = _Quantized((f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"),
                           array.shape)
    parts = (np.asarray(quantize_nparray(qtype, np.asarray(p), scale, zero_point))
             .astype(numpy_type) for p in _rows(array))
    sink.tensor(quantized.inputs[0], qtype, array.shape, parts)
    sink.small(np.asarray(scale, np.float32), quantized.inputs[1])
    sink.small(np.asarray(zero_point, numpy_type), quantized.inputs[2])
    return quantized


def _uint8(name: str, array: np.ndarray, sink: _Sink) -> _Quantized:
    return _int8(name, array, sink, TensorProto.UINT8)


def _dynamic_matmul(node: onnx.NodeProto, q: _Quantized) -> list[onnx.NodeProto]:
    return [helper.make_node("DynamicQuantizeMatMul", [node.input[0], *q.inputs],
                             list(node.output), name=node.name, domain=MS_DOMAIN)]


def _dequantized_gather(node: onnx.NodeProto, q: _Quantized) -> list[onnx.NodeProto]:
    weight, scale, zero_point = q.inputs
    gathered = f"{node.output[0]}_quantized"
    gather = helper.make_node("Gather", [weight, node.input[1]], [gathered], name=node.name)
    gather.attribute.extend(node.attribute)
    dequantize = helper.make_node("DequantizeLinear", [gathered, scale, zero_point],
                                  list(node.output), name=f"{node.name}_dequantize")
    return [gather, dequantize]


# -- int4 -------------------------------------------------------------------------------------
def _int4_matmul(name: str, array: np.ndarray, sink: _Sink) -> _Quantized:
    """A MatMul weight [K, N]: N columns of ceil(K / BLOCK) blocks."""
    k, n = array.shape
    step = max(1, _SLICE_BYTES // (4 * k))
    columns = (array[:, start : start + step] for start in range(0, n, step))
    return _int4(name, columns, (k, n), (n, -(-k // BLOCK), BLOCK // 2), sink)


def _int4_table(name: str, array: np.ndarray, sink: _Sink) -> _Quantized:
    """A Gather table [V, H], quantised as the MatMul weight [H, V] it is the transpose of;
    its bytes are then the table's rows, H / 2 bytes each."""
    rows, width = array.shape
    columns = (part.T for part in _rows(array))
    return _int4(name, columns, (width, rows), (rows, width // 2), sink, array.shape)


def _int4(name: str, columns: Iterator[np.ndarray], kn: tuple[int, int], dims: tuple[int, ...],
          sink: _Sink, shape: tuple[int, ...] | None = None) -> _Quantized:
    """Quantise the [K, N] matrix given as [K, n] column slices, in order. Each column's
    packed blocks are contiguous, so each slice's bytes follow the last one's; the scales
    (1/32 of the float32 bytes) are kept until the end. `dims` is the packed tensor's
    shape; `shape` the float matrix's (default [K, N])."""
    scales: list[np.ndarray] = []

    def packed() -> Iterator[np.ndarray]:
        for part in columns:
            part = np.ascontiguousarray(part, dtype=np.float32)
            k, n = part.shape
            blocks = -(-k // BLOCK)
            data = np.zeros((n, blocks, BLOCK // 2), np.uint8)
            scale = np.zeros((n, blocks), np.float32)
            unused_zero_points = np.zeros((n, (blocks + 1) // 2), np.uint8)
            quantize_matmul_4bits(data, part, scale, unused_zero_points, BLOCK, n, k, True)
            scales.append(scale)
            yield data

    k, n = kn
    quantized = _Quantized((f"{name}_q4", f"{name}_scales"), shape or kn)
    sink.tensor(quantized.inputs[0], TensorProto.UINT8, dims, packed())
    sink.tensor(quantized.inputs[1], TensorProto.FLOAT, (n, -(-k // BLOCK)), iter(scales))
    return quantized


def _int4_siblings(graph: onnx.GraphProto, initializers: dict[str, TensorProto]
                   ) -> dict[str, list[onnx.NodeProto]]:
    """MatMuls that multiply the same activation by different weights of the same K (a
    layer's q, k and v projections; its MLP's gate and up), by each one's output: int4 runs
    each group as one MatMulNBits over the weights side by side. On the 2-core development
    machine one MatMulNBits call of 1024 x 1536 took 92 us against 192 us for q, k and v
    apart (1024 x 1024 + 2 x 1024 x 256), and 1024 x 5632 took 218 us against 300 us for
    gate and up apart: at M = 1 a call's fixed cost (activation quantisation, the thread
    pool's wake-up) is as large as its arithmetic. Each output column is the same dot
    product either way, so the outputs are too."""
    by_input: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        weight = _float_weight(node, initializers)
        if weight and node.op_type in ("MatMul", "Gemm"):
            by_input.setdefault(node.input[0], []).append(node)
    groups: dict[str, list[onnx.NodeProto]] = {}
    for members in by_input.values():
        weights = [initializers[m.input[1]] for m in members]
        distinct = len({w.name for w in weights}) == len(weights)
        if len(members) > 1 and distinct and len({w.dims[0] for w in weights}) == 1:
            groups.update((m.output[0], members) for m in members)
    return groups


def _fused_matmul_nbits(group: list[onnx.NodeProto], initializers: dict[str, TensorProto],
                        directory: Path, sink: _Sink) -> list[onnx.NodeProto]:
    """One MatMulNBits over the group's weights side by side, split into their outputs."""
    arrays = [_read(initializers[node.input[1]], directory) for node in group]
    k = arrays[0].shape[0]
    widths = [array.shape[1] for array in arrays]
    step = max(1, _SLICE_BYTES // (4 * k))
    columns = (array[:, start : start + step] for array in arrays
               for start in range(0, array.shape[1], step))
    first = group[0]
    name = f"{first.input[1]}_fused"
    quantized = _int4(name, columns, (k, sum(widths)), (sum(widths), -(-k // BLOCK), BLOCK // 2),
                      sink)
    sink.small(np.array(widths, np.int64), f"{name}_widths")
    product = f"{first.output[0]}_fused"
    matmul = _matmul_nbits(first, quantized)[0]
    matmul.output[0] = product
    split = helper.make_node("Split", [product, f"{name}_widths"],
                             [node.output[0] for node in group], name=f"{first.name}_split",
                             axis=-1)
    return [matmul, split]


def _matmul_nbits(node: onnx.NodeProto, q: _Quantized) -> list[onnx.NodeProto]:
    k, n = q.shape
    return [helper.make_node(
        "MatMulNBits", [node.input[0], *q.inputs], list(node.output), name=node.name,
        domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=BLOCK, accuracy_level=ACCURACY_LEVEL,
    )]


def _block_gather(node: onnx.NodeProto, q: _Quantized) -> list[onnx.NodeProto]:
    data, scales = q.inputs
    return [helper.make_node(
        "GatherBlockQuantized", [data, node.input[1], scales], list(node.output),
        name=node.name, domain=MS_DOMAIN, bits=4, block_size=BLOCK, gather_axis=0,
        quantize_axis=1,
    )]


def _plain_gemm(node: onnx.NodeProto) -> bool:
    """A Gemm that computes A @ B and nothing else."""
    return (node.op_type == "Gemm" and len(node.input) == 2
            and _attribute(node, "alpha", 1.0) == 1.0
            and _attribute(node, "transA", 0) == _attribute(node, "transB", 0) == 0)


def _attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    attribute = next((a for a in node.attribute if a.name == name), None)
    return default if attribute is None else helper.get_attribute_value(attribute)
