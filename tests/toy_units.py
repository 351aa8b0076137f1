"""A three-unit toy model built by hand as ONNX graphs, with a numpy reference.

It has the shape of a real sharded model without needing torch: unit 0 ("embed") turns
input_ids into a hidden state and position_ids into a residual `bias`; unit 1 ("acc") keeps
per-sequence state (the hidden states of every position so far) and adds their running sum;
unit 2 ("head") reads the hidden state and, again, the residual `bias`, and returns logits.
The units are written as the exporter writes them (shards.onnx_file): the embedding's table
and the head's projection in a data file beside the model, unit 1's few constants inside it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from shards.executor import StageExecutor
from shards.manifest import (
    REQUEST,
    Flops,
    Manifest,
    ModelInfo,
    Options,
    Quant,
    StateSpec,
    Unit,
    UnitInput,
    UnitOutput,
)
from shards.onnx_file import write_unit

VOCAB, HIDDEN = 11, 4
_EXTERNAL_BYTES = 64  # tensors from this size on go to the data file


class ToyModel:
    """Weights of the toy model and its reference forward pass."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        self.proj = rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)

    def logits(self, ids: list[int]) -> np.ndarray:
        """Reference logits `[len(ids), VOCAB]` of the whole sequence in one pass."""
        hidden = self.table[ids]
        bias = np.arange(len(ids), dtype=np.float32)[:, None]
        running = np.cumsum(hidden, axis=0)
        return (hidden + bias + running + bias) @ self.proj


def write_toy(directory: Path, model: ToyModel) -> Manifest:
    """Write the units' files and return their manifest (not saved)."""
    directory.mkdir(parents=True, exist_ok=True)
    graphs = [_embed(model), _acc(), _head(model)]
    units = []
    for index, (graph, spec) in enumerate(zip(graphs, _SPECS, strict=True)):
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        with tempfile.TemporaryDirectory() as scratch:
            staged = Path(scratch) / "model.onnx"
            onnx.save_model(proto, staged, save_as_external_data=True, location="model.data",
                            size_threshold=_EXTERNAL_BYTES)
            written = write_unit(staged, directory, f"{index}-{spec['name']}.onnx")
        units.append(
            Unit(
                index=index,
                files=written.files,
                flops_per_token=Flops(prefill=1.0, decode=1.0),
                weight_bytes=written.weight_bytes,
                **spec,
            )
        )
    info = ModelInfo("Toy", VOCAB, 1, HIDDEN, 64, (), None, "0" * 64)
    return Manifest(
        key="toy", model=info, options=Options(Quant.NONE, "half"), return_bytes=8,
        units=tuple(units),
    )


_KV = StateSpec("past_s", "present_s", "float32", (1, 1, 0, HIDDEN), 2)
_SPECS = [
    {
        "name": "embed",
        "inputs": (UnitInput("input_ids", "int64", REQUEST),
                   UnitInput("position_ids", "int64", REQUEST)),
        "outputs": (UnitOutput("hidden0", "float32", 16, (1,)),
                    UnitOutput("bias", "float32", 4, (1, 2))),
        "state": (),
        "kv_bytes_per_token": 0,
    },
    {
        "name": "acc",
        "inputs": (UnitInput("hidden0", "float32", 0), UnitInput("bias", "float32", 0)),
        "outputs": (UnitOutput("hidden1", "float32", 16, (2,)),),
        "state": (_KV,),
        "kv_bytes_per_token": 16,
    },
    {
        "name": "head",
        "inputs": (UnitInput("hidden1", "float32", 1), UnitInput("bias", "float32", 0)),
        "outputs": (UnitOutput("logits", "float32", 4 * VOCAB, (REQUEST,)),),
        "state": (),
        "kv_bytes_per_token": 0,
    },
]


def logits_after_unit0(manifest: Manifest, unit_dir: Path, rest: StageExecutor,
                       ids: list[int]) -> np.ndarray:
    """Logits of `ids` when unit 0 (the embedding, from `unit_dir`) feeds `rest`, an
    executor for units 1-2: what a deployed second stage computes."""
    request = {"input_ids": np.array([ids], np.int64),
               "position_ids": np.arange(len(ids), dtype=np.int64)[None]}
    first = StageExecutor(manifest, unit_dir, 0, 0).step("s", request)
    return rest.step("s", first)["logits"][0]


def _io(name: str, dtype: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _embed(model: ToyModel) -> onnx.GraphProto:
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["hidden0"]),
        helper.make_node("Cast", ["position_ids"], ["pos"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pos", "last"], ["bias"]),
    ]
    return helper.make_graph(
        nodes,
        "embed",
        [_io("input_ids", TensorProto.INT64, ["B", "T"]),
         _io("position_ids", TensorProto.INT64, ["B", "T"])],
        [_io("hidden0", TensorProto.FLOAT, ["B", "T", HIDDEN]),
         _io("bias", TensorProto.FLOAT, ["B", "T", 1])],
        [numpy_helper.from_array(model.table, "table"),
         numpy_helper.from_array(np.array([-1], np.int64), "last")],
    )


def _acc() -> onnx.GraphProto:
    # running[t] = sum of past states + cumsum of this block's hidden states up to t
    nodes = [
        helper.make_node("Unsqueeze", ["hidden0", "one"], ["h4"]),
        helper.make_node("Concat", ["past_s", "h4"], ["present_s"], axis=2),
        helper.make_node("ReduceSum", ["past_s", "axis2"], ["past_sum"], keepdims=1),
        helper.make_node("CumSum", ["h4", "axis2_scalar"], ["block_sum"]),
        helper.make_node("Add", ["past_sum", "block_sum"], ["running4"]),
        helper.make_node("Squeeze", ["running4", "one"], ["running"]),
        helper.make_node("Add", ["hidden0", "bias"], ["hb"]),
        helper.make_node("Add", ["hb", "running"], ["hidden1"]),
    ]
    return helper.make_graph(
        nodes,
        "acc",
        [_io("hidden0", TensorProto.FLOAT, ["B", "T", HIDDEN]),
         _io("bias", TensorProto.FLOAT, ["B", "T", 1]),
         _io("past_s", TensorProto.FLOAT, ["B", 1, "P", HIDDEN])],
        [_io("hidden1", TensorProto.FLOAT, ["B", "T", HIDDEN]),
         _io("present_s", TensorProto.FLOAT, ["B", 1, "S", HIDDEN])],
        [numpy_helper.from_array(np.array([1], np.int64), "one"),
         numpy_helper.from_array(np.array([2], np.int64), "axis2"),
         numpy_helper.from_array(np.array(2, np.int64), "axis2_scalar")],
    )


def _head(model: ToyModel) -> onnx.GraphProto:
    nodes = [
        helper.make_node("Add", ["hidden1", "bias"], ["hb"]),
        helper.make_node("MatMul", ["hb", "proj"], ["logits"]),
    ]
    return helper.make_graph(
        nodes,
        "head",
        [_io("hidden1", TensorProto.FLOAT, ["B", "T", HIDDEN]),
         _io("bias", TensorProto.FLOAT, ["B", "T", 1])],
        [_io("logits", TensorProto.FLOAT, ["B", "T", VOCAB])],
        [numpy_helper.from_array(model.proj, "proj")],
    )
