"""Moving unit files between peers: the model peer serves chunks, a deploying peer pulls them.

A unit file (a unit's model or its data file: the wire names either by its sha256) travels as
a series of chunk requests on the data channel, so a transfer never delays heartbeats or
votes. The receiver writes each chunk into its UnitStore at the offset it already holds, so a
transfer cut short (a timeout, a dead link, a restarted daemon) resumes from
`store.received(name)`. When all bytes are there the store verifies the sha256; a file that
does not match is thrown away and fetched again from the start, a few times at most.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from peerd.control.unit_store import StoreError, UnitStore
from peerd.wire.protocol import UnitChunk, UnitChunkRequest, UnitRefused
from shards.manifest import UnitFile

log = logging.getLogger("peerd.control.unit_transfer")

CHUNK_BYTES = 4 * 1024 * 1024
CHUNK_TIMEOUT_S = 30.0
FETCH_ATTEMPTS = 3

Ask = Callable[[UnitChunkRequest], Awaitable[Any]]
Progress = Callable[[str, int], None]  # (content name, bytes of it on disk now)


class TransferError(Exception):
    """A unit file that could not be fetched; the message is one line."""


# -- the serving side (the model peer) ---------------------------------------------------------


class ChunkServer:
    """Answers chunk requests from the files it is given (sha256 -> path), read off the loop."""

    def __init__(self, files: Callable[[], Mapping[str, Path]]):
        self._files = files

    async def answer(self, request: UnitChunkRequest) -> UnitChunk | UnitRefused:
        path = self._files().get(request.sha256)
        if path is None:
            return UnitRefused(request.req, f"unit {request.sha256[:12]} is not served here")
        try:
            size, data = await asyncio.to_thread(_read, path, request.offset, request.length)
        except OSError as exc:
            return UnitRefused(request.req, f"unit {request.sha256[:12]}: {exc.strerror}")
        if request.offset >= size:
            return UnitRefused(
                request.req,
                f"offset {request.offset} is beyond the {size} bytes of unit "
                f"{request.sha256[:12]}",
            )
        chunk = np.frombuffer(data, dtype=np.uint8)
        return UnitChunk(request.req, request.sha256, request.offset, size, {"data": chunk})


def _read(path: Path, offset: int, length: int) -> tuple[int, bytes]:
    with path.open("rb") as stream:
        size = stream.seek(0, 2)
        stream.seek(offset)
        return size, stream.read(length)


# -- the receiving side (a deploying peer) -----------------------------------------------------


async def fetch_file(
    ask: Ask,
    store: UnitStore,
    file: UnitFile,
    chunk_bytes: int = CHUNK_BYTES,
    progress: Progress = lambda name, have: None,
) -> Path:
    """The verified unit file `file` in `store`, fetched as needed."""
    name, sha256, size = file.content_name, file.sha256, file.bytes
    for attempt in range(1, FETCH_ATTEMPTS + 1):
        have = store.received(name)
        progress(name, have)
        while have < size:
            length = min(chunk_bytes, size - have)
            data = _chunk_data(await ask(UnitChunkRequest(0, sha256, have, length)), sha256,
                               have, size)
            have = await asyncio.to_thread(store.write_chunk, name, have, data)
            progress(name, have)
        try:
            return await asyncio.to_thread(store.complete, name)
        except StoreError as exc:
            log.warning("unit file %s failed verification (attempt %d of %d), fetching it "
                        "again: %s", name, attempt, FETCH_ATTEMPTS, exc)
    raise TransferError(f"unit file {sha256[:12]} failed verification {FETCH_ATTEMPTS} times")


def _chunk_data(answer: Any, sha256: str, offset: int, size: int) -> memoryview:
    if isinstance(answer, UnitRefused):
        raise TransferError(f"the model peer refused unit {sha256[:12]}: {answer.reason}")
    if not isinstance(answer, UnitChunk):
        raise TransferError(f"unit {sha256[:12]}: answered with {answer.KIND}, not a chunk")
    if (answer.sha256, answer.offset, answer.size) != (sha256, offset, size):
        raise TransferError(
            f"unit {sha256[:12]}: got bytes {answer.offset}.. of {answer.sha256[:12]} "
            f"({answer.size} bytes), asked for {offset}.. of {size}"
        )
    return answer.tensors["data"].data
