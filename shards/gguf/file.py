"""Opening a GGUF file with the `gguf` package, with one-line errors and typed metadata.

`gguf.GGUFReader` memory-maps the file and parses its header, metadata and tensor table at
once; a file that is not GGUF, or was cut short, or whose tables point past its end, fails
there with numpy's or the reader's own message. `open_gguf` turns every such failure into
one `ModelError` naming the file, so a bad file is refused before anything is built from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

from shards.errors import ModelError

SUFFIX = ".gguf"
_MISSING = object()


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; the contents are checked on open)."""
    return Path(path).suffix.lower() == SUFFIX and not Path(path).is_dir()


def open_gguf(path: str | Path) -> GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no such GGUF file: {path}")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, OverflowError) as exc:
        raise ModelError(f"not a readable GGUF file ({_one_line(exc)}): {path}") from None


def metadata(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata `key` (a number, string, or list of them)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelError(f"GGUF file lacks metadata {key!r}")
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ModelError(f"GGUF metadata {key!r} is unreadable: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:200]
