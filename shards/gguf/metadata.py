"""A GGUF file's metadata (its key-value section) alone, read fast.

`gguf.GGUFReader` parses the whole file into numpy views, one per array element; for a
vocabulary of 128k tokens and 280k merges that takes tens of seconds. The tokenizer needs only
the key-value section at the start of the file, read here in one pass: strings one by one,
number arrays with numpy. A file that is not GGUF, or is cut short, is one `ModelError`.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import ModelError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY, _BOOL = 8, 9, 7
# GGUF value type -> struct / numpy format (without byte order)
_NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key of the file with its value: a number, bool, string, or list of them."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no such GGUF file: {path}")
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Parser(buf).key_values()
    except (ValueError, struct.error, UnicodeDecodeError, OSError, OverflowError) as exc:
        message = " ".join(str(exc).split())[:200]
        raise ModelError(f"not a readable GGUF file ({message}): {path}") from None


class _Parser:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.offset = buf, 0
        if buf[:4] != _MAGIC:
            raise ValueError("no GGUF magic")
        little, big = struct.unpack_from("<I", buf, 4)[0], struct.unpack_from(">I", buf, 4)[0]
        if little not in _VERSIONS and big not in _VERSIONS:
            raise ValueError(f"unsupported GGUF version {little}")
        self.order = "<" if little in _VERSIONS else ">"
        self.offset = 8
        self.layouts: dict[str, struct.Struct] = {}

    def key_values(self) -> dict[str, Any]:
        _tensors, count = self._unpack("QQ")
        found = {}
        for _ in range(count):
            key = self._string()
            (value_type,) = self._unpack("I")
            found[key] = self._value(value_type)
        return found

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("IQ")
            return self._array(item_type, count)
        if value_type not in _NUMBERS:
            raise ValueError(f"unknown value type {value_type}")
        (value,) = self._unpack(_NUMBERS[value_type])
        return value

    def _array(self, item_type: int, count: int) -> list[Any]:
        if item_type in _NUMBERS:
            dtype = np.dtype(self.order + _NUMBERS[item_type])
            end = self.offset + dtype.itemsize * count
            if end > len(self.buf):
                raise ValueError("array runs past the end of the file")
            values = np.frombuffer(self.buf, dtype, count, self.offset)
            self.offset = end
            return values.tolist()
        if item_type == _STRING:
            return self._strings(count)
        return [self._value(item_type) for _ in range(count)]

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row: the hot loop for vocabularies and merges."""
        buf, offset, strings = self.buf, self.offset, []
        size_at = self._layout("Q").unpack_from
        for _ in range(count):
            (size,) = size_at(buf, offset)
            offset += 8 + size
            strings.append(str(buf[offset - size:offset], "utf-8"))
        if offset > len(buf):
            raise ValueError("string runs past the end of the file")
        self.offset = offset
        return strings

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        layout = self._layout(fmt)
        values = layout.unpack_from(self.buf, self.offset)
        self.offset += layout.size
        return values

    def _layout(self, fmt: str) -> struct.Struct:
        if fmt not in self.layouts:
            self.layouts[fmt] = struct.Struct(self.order + fmt)
        return self.layouts[fmt]
