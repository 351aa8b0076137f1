"""The on-disk cache of unit files, addressed by their content.

Each file is kept under its content name (`UnitFile.content_name`: `<sha256>.onnx` for a
unit's model, `<sha256>.data` for its weights), all in one directory: a model refers to its
data file by exactly that name, so ONNX Runtime finds the data beside the model here as in
the shard directory it came from. A file arrives in chunks (`write_chunk` at an offset),
possibly across several transfers: the partial file is kept as `<name>.part`, so an
interrupted transfer resumes from `received(name)`. `complete` verifies the sha256 before the
file becomes visible under its final name (an atomic rename), so a reader never sees a file
that is incomplete or corrupt; a file whose bytes do not match is deleted and must be fetched
again. Files are immutable once complete, which is why peers can share them without
coordination.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path

from shards.manifest import DATA_SUFFIX, MODEL_SUFFIX

_CONTENT_NAME = re.compile(rf"([0-9a-f]{{64}})(\{MODEL_SUFFIX}|\{DATA_SUFFIX})")
_HASH_BLOCK = 1 << 20


class StoreError(Exception):
    """A unit file that cannot be stored: bad name or hash, bad offset, or no space left."""


class UnitStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.root / _checked(name)

    def has(self, name: str) -> bool:
        return self.path(name).is_file()

    def received(self, name: str) -> int:
        """Bytes of file `name` already on disk: its size when complete, else the partial size."""
        if self.has(name):
            return self.path(name).stat().st_size
        part = self._part(name)
        return part.stat().st_size if part.exists() else 0

    def write_chunk(self, name: str, offset: int, data: bytes | memoryview) -> int:
        """Append `data` at `offset` (which must be the bytes received so far)."""
        if self.has(name):
            return self.received(name)
        have = self.received(name)
        if offset != have:
            raise StoreError(f"unit file {_short(name)}: chunk at {offset}, expected {have}")
        part = self._part(name)
        try:
            with part.open("ab") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            _truncate(part, have)
            if exc.errno == errno.ENOSPC:
                raise StoreError(
                    f"no space left in {self.root} for unit file {_short(name)}") from None
            raise StoreError(f"cannot write unit file {_short(name)}: {exc.strerror}") from None
        return have + len(data)

    def complete(self, name: str) -> Path:
        """Verify the received bytes and publish the file; a mismatch deletes the partial."""
        if self.has(name):
            return self.path(name)
        part = self._part(name)
        if not part.exists():
            raise StoreError(f"unit file {_short(name)}: nothing received")
        actual = file_sha256(part)
        if actual != _sha256_of(name):
            part.unlink()
            raise StoreError(f"unit file {_short(name)}: received bytes hash to {actual[:12]}")
        os.replace(part, self.path(name))
        return self.path(name)

    def verify(self, name: str) -> bool:
        """Re-hash a stored file; a corrupted one is removed so it will be fetched again."""
        path = self.path(name)
        if not path.is_file():
            return False
        if file_sha256(path) == _sha256_of(name):
            return True
        path.unlink()
        return False

    def _part(self, name: str) -> Path:
        return self.root / f"{_checked(name)}.part"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        while block := stream.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _checked(name: str) -> str:
    _content_name(name)
    return name


def _sha256_of(name: str) -> str:
    return _content_name(name).group(1)


def _content_name(name: str) -> re.Match[str]:
    match = _CONTENT_NAME.fullmatch(name)
    if match is None:
        raise StoreError(f"not a unit file's content name: {name[:80]!r}")
    return match


def _short(name: str) -> str:
    """A content name as messages show it: the digest's first 12 digits and the suffix."""
    return name[:12] + name[64:]


def _truncate(path: Path, size: int) -> None:
    """Cut a partial file back to what was verifiably written before a failed append."""
    if path.exists():
        os.truncate(path, size)
