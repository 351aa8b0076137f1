"""Write a unit as its ONNX model file plus one external data file named by its sha256.

Protobuf caps a serialised message at 2 GiB, so weights cannot live inside the model file of
a unit of any size (Qwen2.5-7B's embedding alone is 2.18 GB). Every unit is therefore written
as a small `.onnx` file whose weights are external data in one file beside it. The exporter
first saves the unit with its weights in a scratch directory (`save_external`, streamed
tensor by tensor; the int8 quantiser adds a second data file there); `write_unit` then copies
every external weight into one data file beside the final model, in chunks and hashed on the
way, each at a page-aligned offset, and names it `<sha256>.data`. The model refers to its
data by that name, and a content-addressed store keeps the file under the same name, so
ONNX Runtime finds the data beside the model wherever the pair is kept, and the model file's
own sha256 covers the reference. Small constants the exporter keeps inside the graph stay
there.

ONNX Runtime memory-maps external weights: a weight it reads as is (a Gather table) costs
only the pages touched; one it pre-packs (a MatMul) costs the packed copy, and never a second
copy from parsing the model.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO

import onnx

from shards.manifest import DATA_SUFFIX, UnitFile

if TYPE_CHECKING:
    from torch.onnx import ONNXProgram

_CHUNK = 16 * 1024 * 1024
_ALIGN = 4096  # every weight starts on a page, so it can be mapped as it is


@dataclass(frozen=True)
class WrittenUnit:
    files: tuple[UnitFile, ...]  # the model, then its data file when it has external weights
    weight_bytes: int  # bytes of all its initializers


def save_external(program: ONNXProgram, directory: Path) -> Path:
    """Save `program` into `directory` with its weights in a separate data file."""
    staged = Path(directory) / "model.onnx"
    program.save(str(staged), external_data=True)
    return staged


def write_unit(staged: Path, directory: Path, relative: str) -> WrittenUnit:
    """Write the model saved at `staged` (weights external, in its directory) as
    `directory/relative` and one data file beside it; return the files, named relative to
    `directory`."""
    model = onnx.load(str(staged), load_external_data=False)
    initializers = model.graph.initializer
    external = [t for t in initializers if t.data_location == onnx.TensorProto.EXTERNAL]
    weight_bytes = sum(_tensor_bytes(t) for t in initializers)
    path = Path(directory) / relative
    data = ()
    if external:
        sha256, size = _write_data(external, Path(staged).parent, path.parent)
        name = str(PurePosixPath(relative).parent / f"{sha256}{DATA_SUFFIX}")
        data = (UnitFile(name, sha256, size),)
    path.write_bytes(model.SerializeToString())
    return WrittenUnit((UnitFile(relative, _sha256(path), path.stat().st_size), *data),
                       weight_bytes)


def _write_data(tensors: list[onnx.TensorProto], source: Path, target: Path) -> tuple[str, int]:
    """Copy the tensors' external bytes into one file in `target`, named by its sha256, and
    point the tensors at it; return the sha256 and size."""
    partial = target / ".data.partial"
    digest = hashlib.sha256()
    placed = []
    with partial.open("wb") as out:
        for tensor in tensors:
            _put(out, digest, bytes(-out.tell() % _ALIGN))
            offset = out.tell()
            entries = _entries(tensor)
            length = int(entries["length"])
            _copy(source / entries["location"], int(entries.get("offset", 0)), length, out,
                  digest)
            placed.append((tensor, offset, length))
        size = out.tell()
    sha256 = digest.hexdigest()
    os.replace(partial, target / f"{sha256}{DATA_SUFFIX}")
    for tensor, offset, length in placed:
        del tensor.external_data[:]
        for key, value in (("location", f"{sha256}{DATA_SUFFIX}"), ("offset", offset),
                           ("length", length)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
    return sha256, size


def _copy(location: Path, offset: int, length: int, out: BinaryIO, digest) -> None:
    with location.open("rb") as data:
        data.seek(offset)
        remaining = length
        while remaining:
            chunk = data.read(min(_CHUNK, remaining))
            if not chunk:
                raise OSError(f"external data {location} ends early")
            _put(out, digest, chunk)
            remaining -= len(chunk)


def _put(out: BinaryIO, digest, data: bytes) -> None:
    out.write(data)
    digest.update(data)


def _entries(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return int(_entries(tensor)["length"])
    # a small constant kept in the graph, raw or in a typed field (e.g. int64_data)
    return len(tensor.raw_data) or onnx.numpy_helper.to_array(tensor).nbytes


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
