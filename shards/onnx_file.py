"""Write a unit as its ONNX model file plus one external data file named by its sha256.

Protobuf caps a serialised message at 2 GiB, so weights cannot live inside the model file of
a unit of any size (Qwen2.5-7B's embedding alone is 2.18 GB). Every unit is therefore written
as a small `.onnx` file whose weights are external data in one file beside it. The exporter
first saves the unit with its weights in a scratch directory (`save_external`, streamed
tensor by tensor; the int8 quantiser adds a second data file there); `write_unit` then copies
every external weight into one data file beside the final model (a `DataFile`: in chunks and
hashed on the way, each at a page-aligned offset) and names it `<sha256>.data`. A unit built
from an earlier unit's graph (shards.template) writes its weights into a `DataFile`
directly. The model refers to its data by that name, and a content-addressed store keeps the
file under the same name, so ONNX Runtime finds the data beside the model wherever the pair
is kept, and the model file's own sha256 covers the reference. Small constants the exporter
keeps inside the graph stay there.

ONNX Runtime memory-maps external weights: a weight it reads as is (a Gather table) costs
only the pages touched; one it pre-packs (a MatMul) costs the packed copy, and never a second
copy from parsing the model.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import onnx

from shards.manifest import DATA_SUFFIX, UnitFile

if TYPE_CHECKING:
    from torch.onnx import ONNXProgram

_CHUNK = 16 * 1024 * 1024
_ALIGN = 4096  # every weight starts on a page, so it can be mapped as it is
_ROOM_LEFT = 1 << 20  # what a write must leave free: the exporter's own files


@dataclass(frozen=True)
class WrittenUnit:
    files: tuple[UnitFile, ...]  # the model, then its data file when it has external weights
    weight_bytes: int  # bytes of all its initializers


def save_external(program: ONNXProgram, directory: Path) -> Path:
    """Save `program` into `directory` with its weights in a separate data file. Where the
    filesystem lacks room for the weights (and _ROOM_LEFT beside them), this raises ENOSPC
    before writing: the exporter writes weights with numpy's tofile, whose OSError on a
    full disk has no errno ("problem writing element N to file") and whose partial file is
    removed before the error comes up, so afterwards a full disk cannot be told from any
    other failure."""
    needed = sum(value.const_value.nbytes for value in program.model.graph.initializers.values()
                 if value.const_value is not None)
    free = shutil.disk_usage(directory).free
    if free < needed + _ROOM_LEFT:
        raise OSError(errno.ENOSPC, f"no space left in {directory}: {needed} bytes of "
                      f"weights to write, {free} free")
    staged = Path(directory) / "model.onnx"
    program.save(str(staged), external_data=True)
    return staged


def write_unit(staged: Path, directory: Path, relative: str) -> WrittenUnit:
    """Write the model saved at `staged` (weights external, in its directory) as
    `directory/relative` and one data file beside it; return the files, named relative to
    `directory`."""
    model = onnx.load(str(staged), load_external_data=False)
    data = DataFile(Path(directory), relative)
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = _entries(tensor)
            data.add(tensor, _chunks(Path(staged).parent / entries["location"],
                                     int(entries.get("offset", 0)), int(entries["length"])))
    return data.finish(model)


class DataFile:
    """The data file of the unit whose model file will be `directory/relative`, being
    written: each external weight at a page-aligned offset, hashed on the way, the file
    named by its sha256 when `finish` writes the model beside it."""

    def __init__(self, directory: Path, relative: str) -> None:
        self.path = directory / relative
        self._folder = PurePosixPath(relative).parent  # file names are relative to directory
        self._partial = self.path.parent / f".{self.path.name}.data.partial"
        self._out = self._partial.open("wb")
        self._digest = hashlib.sha256()
        self._placed: list[tuple[onnx.TensorProto, int, int]] = []

    def add(self, tensor: onnx.TensorProto, chunks: Iterable[bytes | memoryview]) -> None:
        """Append the tensor's bytes, given in `chunks`; it will point at them."""
        self._put(bytes(-self._out.tell() % _ALIGN))
        offset = self._out.tell()
        for chunk in chunks:
            self._put(chunk)
        self._placed.append((tensor, offset, self._out.tell() - offset))

    def finish(self, model: onnx.ModelProto) -> WrittenUnit:
        """Name the data file by its sha256 and write `model` (whose initializers include
        every tensor added) at `path`, referring to it."""
        size = self._out.tell()
        self._out.close()
        files: tuple[UnitFile, ...] = ()
        if self._placed:
            sha256 = self._digest.hexdigest()
            name = f"{sha256}{DATA_SUFFIX}"
            os.replace(self._partial, self.path.parent / name)
            self._point(name)
            files = (UnitFile(str(self._folder / name), sha256, size),)
        else:
            self._partial.unlink()
        self.path.write_bytes(model.SerializeToString())
        model_file = UnitFile(str(self._folder / self.path.name), _sha256(self.path),
                              self.path.stat().st_size)
        weight_bytes = sum(_tensor_bytes(t) for t in model.graph.initializer)
        return WrittenUnit((model_file, *files), weight_bytes)

    def _put(self, data: bytes | memoryview) -> None:
        self._out.write(data)
        self._digest.update(data)

    def _point(self, name: str) -> None:
        for tensor, offset, length in self._placed:
            del tensor.external_data[:]
            for key, value in (("location", name), ("offset", offset), ("length", length)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            tensor.data_location = onnx.TensorProto.EXTERNAL


def _chunks(location: Path, offset: int, length: int) -> Iterator[bytes]:
    """`length` bytes of the file at `location` from `offset`, in chunks."""
    with location.open("rb") as data:
        data.seek(offset)
        remaining = length
        while remaining:
            chunk = data.read(min(_CHUNK, remaining))
            if not chunk:
                raise OSError(f"external data {location} ends early")
            yield chunk
            remaining -= len(chunk)


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
