"""Sharding with a content-addressed cache: export only what is not there yet.

`shard_key` hashes the model's source (config.json and the weight files, or the GGUF file),
the options and the exporter (library versions and the export code of this package). A
directory whose manifest carries the same key and all of its unit files (each of the size the
manifest says) is reused as is, so a second `peerd shard` (or a `peerd generate` of a sharded
model) neither exports nor even imports torch: shards.export is imported only when there is
work to do.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from shards.errors import ModelError
from shards.manifest import GRANULARITIES, MANIFEST_NAME, Manifest, ManifestError, Quant
from shards.source import open_model

_EXPORTER_PACKAGES = ("torch", "onnx", "onnxscript", "onnxruntime")
# the modules whose code decides what the exported files contain
_EXPORT_CODE = (
    "arch", "config.py", "source.py", "gguf", "checkpoint.py", "segment.py", "examples.py",
    "export.py", "template.py", "flops.py", "onnx_file.py", "quantize.py",
)


class ShardError(Exception):
    """Sharding failed or its output directory is unusable; the message is one line."""


@dataclass(frozen=True)
class ShardOptions:
    quant: Quant = Quant.NONE
    granularity: str = "half"

    def __post_init__(self) -> None:
        object.__setattr__(self, "quant", Quant(self.quant))  # "int4" is Quant.INT4
        if self.granularity not in GRANULARITIES:
            raise ShardError(f"granularity must be one of {GRANULARITIES}")


@dataclass(frozen=True)
class ShardResult:
    manifest: Manifest
    directory: Path
    exported: bool  # False when an identical earlier result was reused
    seconds: float


Progress = Callable[[str], None]
PARTIAL = ".partial-"  # an export in progress is staged in .<key>.partial-<pid> beside <key>


def shard(
    model_dir: Path,
    out_dir: Path | None,
    shard_root: Path | None = None,
    options: ShardOptions = ShardOptions(),
    progress: Progress = lambda line: None,
) -> ShardResult:
    """Shard the model at `model_dir` (a checkpoint directory or a GGUF file) into `out_dir`,
    or into `shard_root/<key>` when out_dir is None; reuse the directory when it already
    holds this very result."""
    started = time.perf_counter()
    model = open_model(model_dir)
    config = model.config()
    source = model.digest()
    key = shard_key(source, options)
    if out_dir is None:
        if shard_root is None:
            raise ValueError("either out_dir or shard_root is needed")
        out_dir = Path(shard_root) / key
    out_dir = Path(out_dir)
    reused = reusable(out_dir, key)
    if reused is not None:
        return ShardResult(reused, out_dir, False, time.perf_counter() - started)
    from shards.export import export_units

    staging = out_dir.parent / f".{out_dir.name}{PARTIAL}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        manifest = export_units(model, config, staging, options, progress, key, source)
        install(staging, out_dir, key)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ShardResult(manifest, out_dir, True, time.perf_counter() - started)


def cached(model_dir: Path, shard_root: Path,
           options: ShardOptions = ShardOptions()) -> ShardResult | None:
    """What `shard(model_dir, None, shard_root, options)` would reuse, found without it: the
    complete earlier result under `shard_root`, or None when there is work to do or a problem
    (which `shard` meets again and reports)."""
    started = time.perf_counter()
    try:
        key = shard_key(source_digest(model_dir), options)
        directory = Path(shard_root) / key
        manifest = reusable(directory, key)
    except (ModelError, ShardError, OSError):
        return None
    if manifest is None:
        return None
    return ShardResult(manifest, directory, False, time.perf_counter() - started)


def export_running(name: str) -> bool:
    """Is the entry `name` of a shard cache an export whose process is still running?"""
    _, partial, pid = name.rpartition(PARTIAL)
    return bool(partial) and pid.isdigit() and Path(f"/proc/{pid}").exists()


def source_digest(model_path: Path) -> str:
    """The content digest of the model at `model_path` (shards.source)."""
    return open_model(model_path).digest()


def shard_key(source_sha256: str, options: ShardOptions) -> str:
    """The content address of the sharded output of this source with these options."""
    exporter = {name: importlib.metadata.version(name) for name in _EXPORTER_PACKAGES}
    exporter["code"] = _code_digest()
    payload = {"source": source_sha256, "options": asdict(options), "exporter": exporter}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _code_digest() -> str:
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _EXPORT_CODE:
        path = root / name
        for source in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(source.read_bytes())
    return digest.hexdigest()


def reusable(directory: Path, key: str) -> Manifest | None:
    """The manifest of a complete earlier result with this key in `directory`, if any."""
    if not (directory / MANIFEST_NAME).is_file():
        if directory.exists() and any(directory.iterdir()):
            raise ShardError(f"output directory {directory} is not empty and has no manifest")
        return None
    try:
        manifest = Manifest.load(directory)
    except ManifestError:
        return None
    complete = all(_whole(directory / f.name, f.bytes) for f in manifest.files())
    return manifest if manifest.key == key and complete else None


def _whole(path: Path, size: int) -> bool:
    """The file is there with the size its manifest says (hashing is the model host's job)."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def install(staging: Path, out_dir: Path, key: str) -> None:
    """Move a finished result into place, replacing an older result with another key. Its
    files are on disk first: a result is reused on its files' sizes, which a power cut
    could leave right over unwritten data; and only written pages can be handed back once
    a unit is loaded (shards/heap.py)."""
    for path in staging.rglob("*"):
        if path.is_file():
            _sync(path)
    if (out_dir / MANIFEST_NAME).is_file():
        if reusable(out_dir, key) is not None:
            return  # another process finished the same work first
        shutil.rmtree(out_dir)
    elif out_dir.exists():
        out_dir.rmdir()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(out_dir)
    except OSError:  # another process may have installed the same result since the check
        if reusable(out_dir, key) is None:
            raise


def _sync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
