"""The manifest of a sharded model (`manifest.json`): what every unit is, needs and costs.

Torch-free: peers that only execute units read it. The format is documented in
docs/manifest.md; `Manifest.load` validates a file and raises ManifestError with a one-line
reason. Producer -1 means "a request input" (input_ids, position_ids); consumer -1 means
"the request" (the sampler reads the logits on the stage that computes them).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

FORMAT = 3
MANIFEST_NAME = "manifest.json"
REQUEST = -1
GRANULARITIES = ("half", "layer")  # units are layer halves (attn, mlp) or whole layers
MODEL_SUFFIX, DATA_SUFFIX = ".onnx", ".data"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class Quant(StrEnum):
    """How a unit's weights are stored: float32, int8 (dynamic quantisation) or int4
    (weight-only blocks). The one definition of the choices (`--quant`, the cache key, the
    manifest's `options.quant`)."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


class ManifestError(ValueError):
    """A manifest that cannot be read or is inconsistent."""


@dataclass(frozen=True)
class UnitInput:
    name: str
    dtype: str
    producer: int


@dataclass(frozen=True)
class UnitOutput:
    name: str
    dtype: str
    bytes_per_token: int
    consumers: tuple[int, ...]


@dataclass(frozen=True)
class StateSpec:
    """A per-sequence tensor kept by the executor: `input` at step n is `output` of step n-1.

    `shape` is the shape of the empty state (length 0 along `seq_axis`).
    """

    input: str
    output: str
    dtype: str
    shape: tuple[int, ...]
    seq_axis: int


@dataclass(frozen=True)
class Flops:
    prefill: float
    decode: float


@dataclass(frozen=True)
class UnitFile:
    """One file of a unit: `name` is relative to the manifest's directory."""

    name: str
    sha256: str
    bytes: int

    @property
    def content_name(self) -> str:
        """Its name in a content-addressed store: the sha256 and the suffix. A data file is
        written under this very name, which is how its model refers to it, so ONNX Runtime
        finds it beside the model in a shard directory and in a store alike."""
        return self.sha256 + PurePosixPath(self.name).suffix


@dataclass(frozen=True)
class Unit:
    index: int
    name: str
    files: tuple[UnitFile, ...]  # the ONNX model, then its external data file, if any
    inputs: tuple[UnitInput, ...]
    outputs: tuple[UnitOutput, ...]
    state: tuple[StateSpec, ...]
    flops_per_token: Flops
    weight_bytes: int
    kv_bytes_per_token: int

    @property
    def model_file(self) -> UnitFile:
        return self.files[0]

    @property
    def file_bytes(self) -> int:
        """Bytes of all its files on disk (the data file's alignment padding included)."""
        return sum(f.bytes for f in self.files)

    @property
    def graph_inputs(self) -> tuple[str, ...]:
        """The ONNX graph's inputs: the unit's inputs, then its state inputs."""
        return tuple(i.name for i in self.inputs) + tuple(s.input for s in self.state)

    @property
    def graph_outputs(self) -> tuple[str, ...]:
        """The ONNX graph's outputs: the unit's outputs, then its state outputs."""
        return tuple(o.name for o in self.outputs) + tuple(s.output for s in self.state)

    @property
    def sampled(self) -> bool:
        """It gives what the request samples from (the LM head's logits): a step needs it
        only at the positions whose tokens are drawn."""
        return any(REQUEST in out.consumers for out in self.outputs)

    def output(self, name: str) -> UnitOutput:
        for out in self.outputs:
            if out.name == name:
                return out
        raise KeyError(f"unit {self.name} has no output {name!r}")


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    source_sha256: str
    # A decoder layer's shape, which its tensor-parallel split follows (shards.share_split);
    # 0 in manifests written before groups: such a model cannot be served by a group.
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0

    @property
    def share_grains(self) -> int:
        """How many peers a layer half can be split over: its KV-head groups, at most its
        MLP columns (a group splits every layer half alike); 0 where unknown."""
        return min(self.num_kv_heads, self.intermediate_size)


@dataclass(frozen=True)
class Options:
    quant: Quant
    granularity: str


@dataclass(frozen=True)
class Manifest:
    key: str
    model: ModelInfo
    options: Options
    return_bytes: int
    units: tuple[Unit, ...]
    format: int = FORMAT

    # -- dependency maps -------------------------------------------------------------------
    def sequential(self) -> dict[tuple[int, str], int]:
        """SDM: (unit, output) -> the next unit, for outputs the next unit consumes."""
        return {
            (u.index, o.name): u.index + 1
            for u in self.units
            for o in u.outputs
            if u.index + 1 in o.consumers
        }

    def residual(self) -> dict[tuple[int, str], tuple[int, ...]]:
        """RDM: (unit, output) -> the later, non-adjacent units that consume it."""
        deps = {}
        for u in self.units:
            for o in u.outputs:
                later = tuple(c for c in o.consumers if c > u.index + 1)
                if later:
                    deps[(u.index, o.name)] = later
        return deps

    # -- stages ----------------------------------------------------------------------------
    def stage_inputs(self, first: int, last: int) -> dict[str, int]:
        """Tensors units [first, last] need from outside the stage: name -> producer."""
        needed: dict[str, int] = {}
        for unit in self.units[first : last + 1]:
            for inp in unit.inputs:
                if inp.producer < first:
                    needed.setdefault(inp.name, inp.producer)
        return needed

    def stage_outputs(self, first: int, last: int) -> dict[str, tuple[int, ...]]:
        """Outputs of units [first, last] consumed outside the stage: name -> consumers."""
        sent: dict[str, tuple[int, ...]] = {}
        for unit in self.units[first : last + 1]:
            for out in unit.outputs:
                outside = tuple(c for c in out.consumers if c > last or c == REQUEST)
                if outside:
                    sent[out.name] = outside
        return sent

    # -- files -----------------------------------------------------------------------------
    def files(self) -> tuple[UnitFile, ...]:
        """Every file of every unit: what serving or holding the whole model means."""
        return tuple(f for u in self.units for f in u.files)

    def files_in(self, directory: Path) -> dict[str, Path]:
        """sha256 -> path of every unit file in a shard directory (what a model peer serves)."""
        return {f.sha256: Path(directory) / f.name for f in self.files()}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ManifestError(f"no {MANIFEST_NAME} in {directory}") from None
        except (OSError, ValueError) as exc:
            raise ManifestError(f"cannot read {path}: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ManifestError(f"not a format-{FORMAT} manifest")
        try:
            manifest = cls(
                key=str(data["key"]),
                model=_model_info(data["model"]),
                options=_options(data["options"]),
                return_bytes=int(data["return_bytes"]),
                units=tuple(_unit(u) for u in data["units"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}") from None
        _check_chain(manifest.units)
        return manifest


def _options(data: dict[str, Any]) -> Options:
    return Options(quant=Quant(data["quant"]), granularity=str(data["granularity"]))


def _model_info(data: dict[str, Any]) -> ModelInfo:
    return ModelInfo(**{**data, "eos_token_ids": tuple(data["eos_token_ids"])})


def _unit(data: dict[str, Any]) -> Unit:
    return Unit(
        index=int(data["index"]),
        name=str(data["name"]),
        files=tuple(_unit_file(f) for f in data["files"]),
        inputs=tuple(UnitInput(**i) for i in data["inputs"]),
        outputs=tuple(
            UnitOutput(**{**o, "consumers": tuple(o["consumers"])}) for o in data["outputs"]
        ),
        state=tuple(StateSpec(**{**s, "shape": tuple(s["shape"])}) for s in data["state"]),
        flops_per_token=Flops(**data["flops_per_token"]),
        weight_bytes=int(data["weight_bytes"]),
        kv_bytes_per_token=int(data["kv_bytes_per_token"]),
    )


def _unit_file(data: dict[str, Any]) -> UnitFile:
    return UnitFile(name=str(data["name"]), sha256=str(data["sha256"]), bytes=int(data["bytes"]))


def _check_files(unit: Unit) -> None:
    """A unit is its model file, then data files named by their own sha256 (the names the
    model refers to them by)."""
    if not unit.files or not unit.model_file.name.endswith(MODEL_SUFFIX):
        raise ManifestError(f"unit {unit.name}: its first file must be an ONNX model")
    for file in unit.files:
        if not _SHA256.fullmatch(file.sha256) or file.bytes < 0:
            raise ManifestError(f"unit {unit.name}: file {file.name} has a bad sha256 or size")
    for file in unit.files[1:]:
        if PurePosixPath(file.name).name != file.sha256 + DATA_SUFFIX:
            raise ManifestError(f"unit {unit.name}: data file {file.name} is not named "
                                f"<sha256>{DATA_SUFFIX}")


def _check_chain(units: tuple[Unit, ...]) -> None:
    """Units are numbered 0..n-1, every dependency points forward, and every unit's files are
    well named."""
    if not units:
        raise ManifestError("manifest has no units")
    for position, unit in enumerate(units):
        _check_files(unit)
        if unit.index != position:
            raise ManifestError(f"unit {unit.name} has index {unit.index}, expected {position}")
        for inp in unit.inputs:
            if not REQUEST <= inp.producer < position:
                raise ManifestError(
                    f"unit {unit.name}: input {inp.name} comes from unit {inp.producer}"
                )
        for out in unit.outputs:
            if any(c != REQUEST and not position < c < len(units) for c in out.consumers):
                raise ManifestError(
                    f"unit {unit.name}: output {out.name} has consumers {list(out.consumers)}"
                )
