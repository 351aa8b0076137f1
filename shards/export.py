"""Export: a model (shards.source) -> one ONNX file per unit plus manifest.json.

The model is built on the "meta" device and segmented (shards.segment); then, unit by unit,
only that unit's weights are read from the model's source, the unit runs on example inputs
(shards.examples) to learn its dynamic axes and costs, is exported with torch.onnx (the
torch.export-based exporter), optionally quantised (int8 or int4, shards.quantize), written
as a model file and a data file (shards.onnx_file), and its weights are dropped again; the
written unit is then loaded in ONNX Runtime and run on the export example (float32 units
must match torch). A unit of the same structure as one exported before (a later layer) gets
that graph with its own weights instead (shards.template) and runs in torch on the export
example only: its costs and the shapes of the other examples are the exported unit's. The
whole model is never in memory.
`shards.cache.shard` decides whether there is anything to export.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import onnxruntime as ort
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim
from torch.onnx._internal.exporter import _constants as _onnx_constants
from torch.onnx._internal.exporter import _core as _onnx_core
from torch.onnx._internal.exporter import _registration as _onnx_registration

from shards import examples, heap
from shards.arch import build_model
from shards.cache import Progress, ShardError, ShardOptions
from shards.checkpoint import materialize
from shards.config import ModelConfig
from shards.executor import session_options
from shards.flops import run_counting_flops, state_bytes_per_token, tensor_bytes
from shards.manifest import (
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
from shards.onnx_file import WrittenUnit, save_external, write_unit
from shards.quantize import quantize_unit
from shards.segment import Segmentation, UnitGraph, segment
from shards.source import ModelSource
from shards.template import Template, learn, signature

MB = 1e6
RETURN_BYTES = 8  # the sampled token id (int64) sent back to the first stage
UNITS_DIR = "units"
_CHECK_TOLERANCE = 1e-4


def export_units(
    source: ModelSource,
    config: ModelConfig,
    directory: Path,
    options: ShardOptions,
    progress: Progress,
    key: str,
    source_sha256: str,
    reuse_graphs: bool = True,
) -> Manifest:
    """Export every unit of the model into `directory` and write its manifest there;
    `reuse_graphs=False` exports every unit (what bench.shard_speed compares against)."""
    exporter = _Exporter(source, config, directory, options, progress, reuse_graphs)
    return exporter.run(key, source_sha256)


@dataclass(frozen=True)
class _Known:
    """An exported unit's graph, for the units of its structure, and what running it on
    the examples other than EXPORT gave: those only decide shapes and FLOPs, which a unit
    of the same structure shares."""

    template: Template
    outputs: dict[str, tuple[torch.Tensor, ...]]
    flops: dict[str, int]


class _Exporter:
    def __init__(
        self,
        source: ModelSource,
        config: ModelConfig,
        directory: Path,
        options: ShardOptions,
        progress: Progress,
        reuse_graphs: bool,
    ) -> None:
        self.source, self.config, self.directory = source, config, directory
        self.options, self.progress, self.reuse_graphs = options, progress, reuse_graphs
        self.model = build_model(config, "meta")
        self.segmentation: Segmentation = segment(self.model, options.granularity)
        self.store = examples.ExampleStore(config, self.segmentation.consumers)
        self.known: dict[tuple, _Known] = {}

    def run(self, key: str, source_sha256: str) -> Manifest:
        (self.directory / UNITS_DIR).mkdir(parents=True)
        units = self._units()
        manifest = Manifest(
            key=key,
            model=_model_info(self.config, source_sha256),
            options=Options(quant=self.options.quant, granularity=self.options.granularity),
            return_bytes=RETURN_BYTES,
            units=tuple(units),
        )
        manifest.save(self.directory)
        return manifest

    def _units(self) -> list[Unit]:
        units: list[Unit] = []
        count = len(self.segmentation.units)
        started = time.perf_counter()
        for unit in self.segmentation.units:
            begun = time.perf_counter()
            result, template = self._unit(unit)
            units.append(result)
            how = f"built from {template}'s graph" if template else "exported"
            pace = sum(u.weight_bytes for u in units) / MB / (time.perf_counter() - started)
            self.progress(f"[{unit.index + 1}/{count}] {unit.name} {how} in "
                          f"{time.perf_counter() - begun:.1f}s ({pace:.0f} MB/s so far)")
        return units

    def _unit(self, unit: UnitGraph) -> tuple[Unit, str | None]:
        """The unit written and checked, and the unit whose graph it reused (None when it
        was exported)."""
        inputs = {case: self.store.inputs(unit, case) for case in self.store.cases}
        key = signature(unit, unit.module(self.model), inputs)
        known = self.known.get(key)
        targets = _weight_targets(self.model, unit.targets)
        if targets:
            materialize(self.model, self.source, targets)
        relative = f"{UNITS_DIR}/{unit.index:03d}-{unit.name}.onnx"
        with tempfile.TemporaryDirectory(dir=self.directory) as scratch:
            if known is not None:
                result = self._reused(unit, known, targets, inputs, relative, Path(scratch))
                if result is not None:
                    return result, known.template.name
            return self._exported(unit, key, targets, inputs, relative, Path(scratch)), None

    def _reused(self, unit: UnitGraph, known: _Known, targets: list[str], inputs: dict,
                relative: str, scratch: Path) -> Unit | None:
        """The unit built from `known`'s graph with its own weights, when the result loads
        and computes what torch computes on the EXPORT example; else None, nothing written
        and the weights still loaded."""
        module = unit.module(self.model)
        args = inputs[examples.EXPORT]
        with torch.no_grad():
            outputs = module(*args)
        (scratch / relative).parent.mkdir()
        written = known.template.apply(unit.names, module, scratch, relative)
        runs = {case: (inputs[case], known.outputs[case]) for case in known.outputs}
        runs[examples.EXPORT] = (args, outputs)
        result = self._manifest_unit(unit, written, runs, known.flops)
        if _problem(scratch / relative, result, args, outputs, exact=True, quiet=True):
            return None
        del module
        _release(self.model, targets, exported=False)
        self._record(unit, runs)
        if self.options.quant is Quant.NONE:
            for file in written.files:
                os.replace(scratch / file.name, self.directory / file.name)
            return result
        return self._finished(unit, scratch / relative, relative, runs, known.flops)

    def _exported(self, unit: UnitGraph, key: tuple, targets: list[str], inputs: dict,
                  relative: str, scratch: Path) -> Unit:
        """The unit exported with torch.onnx (and remembered for the units to come)."""
        module = unit.module(self.model)
        runs, flops = {}, {}
        for case, args in inputs.items():
            outputs, flops[case] = run_counting_flops(module, args)
            runs[case] = (args, outputs)
        staged = to_onnx(module, unit.input_names, unit.output_names, runs, scratch)
        if self.reuse_graphs:
            others = {case: out for case, (_, out) in runs.items() if case != examples.EXPORT}
            template = learn(staged, unit.name, unit.names, module)
            self.known.setdefault(key, _Known(template, others, flops))
        del module
        _release(self.model, targets, exported=True)
        self._record(unit, runs)
        return self._finished(unit, staged, relative, runs, flops)

    def _finished(self, unit: UnitGraph, staged: Path, relative: str, runs: dict,
                  flops: dict) -> Unit:
        """The float32 unit at `staged` quantised as asked, written into the directory and
        checked."""
        if self.options.quant is not Quant.NONE:
            staged = quantize_unit(staged, self.options.quant)
        written = write_unit(staged, self.directory, relative)
        result = self._manifest_unit(unit, written, runs, flops)
        _check(self.directory / relative, result, *runs[examples.EXPORT],
               exact=self.options.quant is Quant.NONE)
        return result

    def _record(self, unit: UnitGraph, runs: dict) -> None:
        for case, (_, outputs) in runs.items():
            self.store.record(unit, case, outputs)

    def _manifest_unit(self, unit: UnitGraph, written: WrittenUnit, runs: dict,
                       flops: dict) -> Unit:
        seg = self.segmentation
        prefill_tokens = self.store.cases[examples.PREFILL].tokens
        count_in, count_out = len(unit.inputs), len(unit.outputs)  # state comes after these
        export_args, export_out = runs[examples.EXPORT]
        _, decode_out = runs[examples.DECODE]
        states = tuple(
            StateSpec(
                input=past,
                output=present,
                dtype="float32",
                shape=(1, self.config.num_kv_heads, 0, self.config.head_dim),
                seq_axis=2,
            )
            for past, present in unit.state
        )
        return Unit(
            index=unit.index,
            name=unit.name,
            files=written.files,
            inputs=tuple(
                UnitInput(name, _dtype(arg), seg.producers[name])
                for name, arg in zip(unit.inputs, export_args[:count_in], strict=True)
            ),
            outputs=tuple(
                UnitOutput(name, _dtype(out), tensor_bytes(dec.shape, _dtype(dec)),
                           seg.consumers[name])
                for name, out, dec in zip(
                    unit.outputs, export_out[:count_out], decode_out[:count_out], strict=True
                )
            ),
            state=states,
            flops_per_token=Flops(
                prefill=flops[examples.PREFILL] / prefill_tokens,
                decode=float(flops[examples.DECODE]),
            ),
            weight_bytes=written.weight_bytes,
            kv_bytes_per_token=sum(
                state_bytes_per_token(s.shape, s.seq_axis, s.dtype) for s in states
            ),
        )


def _model_info(config: ModelConfig, source_sha256: str) -> ModelInfo:
    return ModelInfo(
        architecture=config.architecture,
        vocab_size=config.vocab_size,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        max_positions=config.max_positions,
        eos_token_ids=tuple(config.eos_token_ids),
        bos_token_id=config.bos_token_id,
        source_sha256=source_sha256,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
    )


def _weight_targets(model: torch.nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The targets that hold checkpoint parameters (not buffers computed from the config)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [t for t in targets if any(p == t or p.startswith(t + ".") for p in params)]


def _release(model: torch.nn.Module, targets: list[str], exported: bool) -> None:
    """Put the unit's parameters back on the meta device, freeing their memory; after an
    export, also what the exporter left in reference cycles."""
    for target in targets:
        owner_name, _, leaf = target.rpartition(".")
        owner = model.get_submodule(owner_name)
        value = getattr(owner, leaf)
        if isinstance(value, torch.nn.Module):
            value.to("meta")
        else:
            setattr(owner, leaf, torch.nn.Parameter(value.to("meta"), requires_grad=False))
    if exported:
        # torch.export's fake-tensor dispatch cache is global and keyed by each export's
        # own symbolic shapes: entries of finished units are never hit again, only kept.
        # A full collection walks every object Python tracks (half a second): a unit built
        # from an earlier graph leaves no cycle holding more than a norm's weights.
        FakeTensorMode.cache_clear()
        gc.collect()
    heap.trim()  # the next unit's peak must not stack on this one's leftovers


# -- ONNX -------------------------------------------------------------------------------------
def to_onnx(module: torch.nn.Module, input_names: list[str], output_names: list[str],
            runs: dict, directory: Path) -> Path:
    """Export `module` into `directory`, weights as external data; return the model's path.
    `runs` holds (args, outputs) of at least the EXPORT and MORE_* cases of shards.examples,
    whose differences in shape tell the dynamic axes."""
    axes = [
        examples.dynamic_axes({case: runs[case][0][i].shape for case in runs})
        for i in range(len(input_names))
    ]
    dims = {"T": Dim("T", min=1), "P": Dim("P", min=0), "B": Dim("B", min=1)}
    names = tuple(_axis_names(a, name) for a, name in zip(axes, input_names, strict=True))
    args, _ = runs[examples.EXPORT]
    with _quiet():
        program = _onnx_core.export(
            module,
            tuple(args),
            registry=_registry(),
            input_names=input_names,
            output_names=output_names,
            dynamic_shapes=tuple({a: dims[d] for a, d in spec.items()} for spec in names),
            optimize=True,
            verbose=False,
            opset_version=_onnx_constants.TORCHLIB_OPSET,
        )
        program._rename_dynamic_axes(names)
    return save_external(program, directory)


def _axis_names(axes: examples.Axes, name: str) -> dict[int, str]:
    """{axis: "T", "P" or "B"} for one input."""
    named = {"T": axes.tokens, "P": axes.past, "B": axes.batch}
    if len({a for found in named.values() for a in found}) < sum(map(len, named.values())):
        raise ShardError(f"input {name} has an axis that follows two of tokens, past, batch")
    return {axis: dim for dim, found in named.items() for axis in found}


@functools.cache
def _registry() -> _onnx_registration.ONNXRegistry:
    """The torch -> ONNX operator table. torch.onnx.export (dynamo=True) rebuilds it on every
    call, about a second each; exporting dozens of units calls the same exporter core with
    one table (torch is pinned, so this internal entry point is fixed)."""
    return _onnx_registration.ONNXRegistry.from_torchlib(
        opset_version=_onnx_constants.TORCHLIB_OPSET
    )


class _quiet:
    """Silence the exporter's warnings and advisory log lines."""

    _LOGGERS = ("torch.onnx",)

    def __enter__(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._levels = {name: logging.getLogger(name).level for name in self._LOGGERS}
        for name in self._LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        self._warnings.__exit__(kind, exc, tb)


def _check(path: Path, unit: Unit, args: tuple, expected: tuple, exact: bool) -> None:
    """The written unit must load in ONNX Runtime with the manifest's inputs and outputs and
    run on the example; with `exact`, compute what the torch unit computed."""
    problem = _problem(path, unit, args, expected, exact)
    if problem is not None:
        raise ShardError(f"unit {unit.name}: {problem}")


def _problem(path: Path, unit: Unit, args: tuple, expected: tuple, exact: bool,
             quiet: bool = False) -> str | None:
    """What is wrong with the unit written at `path`, if anything (see _check); `quiet`
    keeps ONNX Runtime's own error log to itself."""
    options = _check_options()
    if quiet:
        options.log_severity_level = 4
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ONNX Runtime raises its own exception types
        return f"written file {path.name} does not load in ONNX Runtime: {_one_line(exc)}"
    inputs = tuple(i.name for i in session.get_inputs())
    outputs = tuple(o.name for o in session.get_outputs())
    if (inputs, outputs) != (unit.graph_inputs, unit.graph_outputs):
        return (f"written file {path.name} has inputs {list(inputs)} and outputs "
                f"{list(outputs)}, the manifest says {list(unit.graph_inputs)} and "
                f"{list(unit.graph_outputs)}")
    try:
        return disagreement(session, inputs, outputs, args, expected, exact)
    except Exception as exc:  # ONNX Runtime raises its own exception types
        return f"written file {path.name} does not run in ONNX Runtime: {_one_line(exc)}"


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def disagreement(session: ort.InferenceSession, inputs, outputs, args: tuple,
                  expected: tuple, exact: bool) -> str | None:
    """How the session's outputs on `args` differ from torch's `expected`, if they do."""
    feeds = {name: a.numpy() for name, a in zip(inputs, args, strict=True)}
    got = session.run(list(outputs), feeds)
    for name, value, want in zip(outputs, got, expected, strict=True):
        if not isinstance(value, np.ndarray):
            return f"ONNX output {name} is a {type(value).__name__}, not a dense tensor"
        if value.shape != tuple(want.shape):
            return f"ONNX output {name} has shape {list(value.shape)}, torch's {list(want.shape)}"
        if not exact:
            continue
        error = float(np.max(np.abs(value - want.numpy()), initial=0.0))
        scale = float(np.max(np.abs(want.numpy()), initial=0.0)) + 1.0
        if error > _CHECK_TOLERANCE * scale:
            return f"ONNX output {name} differs from torch by {error}"
    return None


def _check_options() -> ort.SessionOptions:
    """No optimisation or pre-packing: less memory, the same result."""
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.log_severity_level = 3
    return options


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
