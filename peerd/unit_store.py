"""The on-disk cache of unit files, addressed by their sha256.

A unit arrives in chunks (`write_chunk` at an offset), possibly across several transfers:
the partial file is kept as `<sha>.part`, so an interrupted transfer resumes from
`received(sha)`. `complete` verifies the hash before the file becomes visible under its
final name (an atomic rename), so a reader never sees a unit that is incomplete or corrupt;
a file whose bytes do not match is deleted and must be fetched again. Files are immutable
once complete, which is why peers can share them without coordination.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path

_SHA256 = re.compile(r"[0-9a-f]{64}")
_HASH_BLOCK = 1 << 20


class StoreError(Exception):
    """A unit that cannot be stored: bad hash, bad offset, or no space left."""


class UnitStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.root / f"{_checked(sha256)}.onnx"

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def received(self, sha256: str) -> int:
        """Bytes of `sha256` already on disk: its size when complete, else the partial size."""
        if self.has(sha256):
            return self.path(sha256).stat().st_size
        part = self._part(sha256)
        return part.stat().st_size if part.exists() else 0

    def write_chunk(self, sha256: str, offset: int, data: bytes | memoryview) -> int:
        """Append `data` at `offset` (which must be the bytes received so far)."""
        if self.has(sha256):
            return self.received(sha256)
        have = self.received(sha256)
        if offset != have:
            raise StoreError(f"unit {sha256[:12]}: chunk at {offset}, expected {have}")
        part = self._part(sha256)
        try:
            with part.open("ab") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            _truncate(part, have)
            if exc.errno == errno.ENOSPC:
                raise StoreError(f"no space left in {self.root} for unit {sha256[:12]}") from None
            raise StoreError(f"cannot write unit {sha256[:12]}: {exc.strerror}") from None
        return have + len(data)

    def complete(self, sha256: str) -> Path:
        """Verify the received bytes and publish the file; a mismatch deletes the partial."""
        if self.has(sha256):
            return self.path(sha256)
        part = self._part(sha256)
        if not part.exists():
            raise StoreError(f"unit {sha256[:12]}: nothing received")
        actual = file_sha256(part)
        if actual != sha256:
            part.unlink()
            raise StoreError(f"unit {sha256[:12]}: received bytes hash to {actual[:12]}")
        os.replace(part, self.path(sha256))
        return self.path(sha256)

    def verify(self, sha256: str) -> bool:
        """Re-hash a stored unit; a corrupted one is removed so it will be fetched again."""
        path = self.path(sha256)
        if not path.is_file():
            return False
        if file_sha256(path) == sha256:
            return True
        path.unlink()
        return False

    def _part(self, sha256: str) -> Path:
        return self.root / f"{_checked(sha256)}.part"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        while block := stream.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _checked(sha256: str) -> str:
    if not _SHA256.fullmatch(sha256):
        raise StoreError(f"not a sha256 digest: {sha256[:80]!r}")
    return sha256


def _truncate(path: Path, size: int) -> None:
    """Cut a partial file back to what was verifiably written before a failed append."""
    if path.exists():
        os.truncate(path, size)
