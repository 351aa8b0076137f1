"""Exported unit graphs reused for the units of the same structure.

Exporting a unit with torch.onnx costs seconds (tracing, decompositions, optimisation), and
the layers of a model are one graph with other weights. The first unit of each structure is
exported; its graph is remembered with, for each initializer, the unit parameter or buffer
it holds (as is, transposed or reshaped, as the exporter folded it) or its value when it is
a constant of the graph. A later unit of the same structure (`signature`: the same fx graph,
parameter shapes and example shapes, known before the unit runs) gets that graph with its
own parameters in place and its own input and output names, written straight into its unit
files (shards.onnx_file). The exporter runs the result in ONNX Runtime against torch on the
export example and exports for real when they differ, so a layer that only looks like the
others (another constant, another branch) is never wrong. Tensor-parallel share units
(shards.share_units) are reused the same way, across layers and across shares as wide.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.fx as fx
from onnx import helper, numpy_helper
from torch.fx.node import map_arg

from shards.onnx_file import DataFile, WrittenUnit
from shards.segment import UnitGraph

_INDEX = re.compile(r"\d+")
_TRANSPOSE_ROWS = 16
Names = tuple[Sequence[str], Sequence[str]]  # a graph's input names, then its output names


@dataclass(frozen=True)
class Source:
    """An initializer that holds tensor `index` of its unit: as is, transposed (the exporter
    folds `x @ W.T` into a constant) or reshaped (it folds an unsqueezed buffer)."""

    index: int
    transposed: bool
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class Template:
    name: str  # the unit it was exported for
    skeleton: onnx.ModelProto  # the graph without initializers
    initializers: tuple[str, ...]  # in the graph's order
    external: frozenset[str]  # those the exporter saved as external data
    sources: dict[str, Source]
    constants: dict[str, np.ndarray]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def apply(self, names: Names, module: torch.nn.Module,
              directory: Path, relative: str) -> WrittenUnit:
        """Write the graph with `module`'s parameters and the input and output `names` as
        `directory/relative` and its data file (shards.onnx_file's layout)."""
        params = [value for _, value in _tensors(module)]
        model = onnx.ModelProto()
        model.CopyFrom(self.skeleton)
        data = DataFile(directory, relative)
        for name in self.initializers:
            value = np.asarray(self._value(name, params), order="C")  # scalars stay scalars
            tensor = model.graph.initializer.add()  # the model's own, for `data` to point
            if name in self.external:
                tensor.name, tensor.data_type = name, helper.np_dtype_to_tensor_dtype(value.dtype)
                tensor.dims.extend(value.shape)
                data.add(tensor, [value.data.cast("B")])
            else:
                tensor.CopyFrom(numpy_helper.from_array(value, name))
        inputs, outputs = names
        _rename(model.graph, dict(zip(self.inputs + self.outputs, (*inputs, *outputs),
                                      strict=True)))
        return data.finish(model)

    def _value(self, name: str, params: list[np.ndarray]) -> np.ndarray:
        source = self.sources.get(name)
        if source is None:
            return self.constants[name]
        value = params[source.index].astype(source.dtype, copy=False)
        return _transposed(value) if source.transposed else value.reshape(source.shape)


def signature(unit: UnitGraph, module: torch.nn.Module,
              inputs: dict[str, tuple[torch.Tensor, ...]]) -> tuple:
    """What two units share when one's graph can serve the other, known before either
    runs: the unit's name, its fx graph and its parameters' names with layer numbers left
    out, the parameters' shapes, and every example's input shapes."""
    params = tuple((_INDEX.sub("#", name), tuple(p.shape), p.dtype)
                   for name, p in module.named_parameters())
    shapes = tuple((case, tuple((tuple(a.shape), a.dtype) for a in args))
                   for case, args in sorted(inputs.items()))
    return _INDEX.sub("#", unit.name), _structure(unit.graph), params, shapes


def _structure(graph: fx.Graph) -> tuple[str, ...]:
    """Each operation of the graph with the values it reads numbered by position and the
    modules and tensors it reads named without layer numbers."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    ops = []
    for node in graph.nodes:
        target = "" if node.op == "placeholder" else str(node.target)
        if node.op in ("call_module", "get_attr"):
            target = _INDEX.sub("#", target)
        args = map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        ops.append(f"{node.op} {target} {args!r}")
    return tuple(ops)


def learn(staged: Path, name: str, names: Names, module: torch.nn.Module) -> Template:
    """The template of the unit `name` just exported to `staged` from `module`, with its
    input and output `names`."""
    model = onnx.load(str(staged), load_external_data=False)
    external = frozenset(t.name for t in model.graph.initializer
                         if t.data_location == onnx.TensorProto.EXTERNAL)
    tensors = _tensors(module)
    params = [value for _, value in tensors]
    by_name = {tensor_name: i for i, (tensor_name, _) in enumerate(tensors)}
    sources: dict[str, Source] = {}
    constants: dict[str, np.ndarray] = {}
    for tensor in model.graph.initializer:
        value = _array(tensor, staged.parent)
        source = _source(value, params, by_name.get(tensor.name))
        if source is None:
            constants[tensor.name] = np.array(value)  # a copy: `staged` is scratch
        else:
            sources[tensor.name] = source
    initializers = tuple(t.name for t in model.graph.initializer)
    del model.graph.initializer[:]
    inputs, outputs = names
    return Template(name, model, initializers, external, sources, constants,
                    tuple(inputs), tuple(outputs))


def _array(tensor: onnx.TensorProto, directory: Path) -> np.ndarray:
    """The initializer's value; mapped from its data file when external (loading the model
    with its data would hold the unit's weights twice more, beside torch's copy)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    entries = {e.key: e.value for e in tensor.external_data}
    return np.memmap(directory / entries["location"], mode="r",
                     dtype=helper.tensor_dtype_to_np_dtype(tensor.data_type),
                     offset=int(entries.get("offset", 0)), shape=tuple(tensor.dims))


def _tensors(module: torch.nn.Module) -> list[tuple[str, np.ndarray]]:
    """The module's parameters, then its buffers (such as ALiBi's per-head slopes)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(name, tensor.detach().numpy()) for name, tensor in named]


def _source(value: np.ndarray, params: list[np.ndarray], named: int | None) -> Source | None:
    """Which tensor `value` holds: the one it is named after first, then any by value."""
    order = ([named] if named is not None else []) + list(range(len(params)))
    for i in order:
        param = params[i]
        fits = param.shape == value.shape or param.size == value.size > 1
        if fits and np.array_equal(param.reshape(value.shape), value):
            return Source(i, False, value.shape, value.dtype)
        if param.ndim == 2 and param.T.shape == value.shape and np.array_equal(param.T, value):
            return Source(i, True, value.shape, value.dtype)
    return None


def _transposed(matrix: np.ndarray) -> np.ndarray:
    """`matrix.T`, contiguous. Copied a few whole rows at a time: numpy's own copy walks
    the matrix a column at a time, and a row of a power-of-two width (a layer's weights)
    maps every element of that column to the same few cache sets, about 6x slower."""
    out = np.empty(matrix.shape[::-1], matrix.dtype)
    for start in range(0, len(matrix), _TRANSPOSE_ROWS):
        out[:, start : start + _TRANSPOSE_ROWS] = matrix[start : start + _TRANSPOSE_ROWS].T
    return out


def _rename(graph: onnx.GraphProto, names: dict[str, str]) -> None:
    for value in (*graph.input, *graph.output, *graph.value_info):
        value.name = names.get(value.name, value.name)
    for node in graph.node:
        for field in (node.input, node.output):
            for i, name in enumerate(field):
                field[i] = names.get(name, name)
