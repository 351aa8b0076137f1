"""The model side of the peer started with `--model DIR|FILE.gguf`: shard it, then serve its
units (peers receive units, never the checkpoint or the GGUF file).

Sharding runs `peerd shard` in a child process: exporting needs torch, and the daemon process
never imports it. The child writes into the state directory's content-addressed shard cache
(`<state>/shards/<key>`), so a restart with the same model reuses the units at once: the
daemon looks there first itself (shards.cache.cached, which needs no torch) and starts no
child when the units are there. The child's progress lines are logged as they come. Once
done, every file of every unit (its model and its data file) is checked against the
manifest's sha256 before it is served, so this peer never hands out a file that would fail
verification on every receiver. `--quant` of `peerd start` is passed on to the child: every
peer runs the units this one makes, so they all run the same quantisation.

A child that ran out of space (it exits with EX_TEMPFAIL and names the full directory) leaves
the model failed until the shard cache's filesystem has more room than it had then; sharding
then starts again by itself, so freeing space is all a user has to do. The share units of a
group stage, exported in a child too, go the same way: refused with the child's line while
the disk is full, exported again when asked once there is room.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from peerd import statedir
from peerd.control.unit_store import file_sha256
from peerd.wire.protocol import (
    ManifestOffer,
    ShareFile,
    SharesOffer,
    SharesRequest,
    ShareUnitFiles,
)
from peerd.wire.states import ExportState, ModelState
from shards.cache import ShardOptions, cached
from shards.cli import SHARDS_SUBDIR
from shards.manifest import Manifest, ManifestError, Quant
from shards.share_bundle import read_bundle
from shards.source import open_model

log = logging.getLogger("peerd.control.model_host")

SPACE_POLL_S = 1.0  # how often a model that failed for want of space looks for room again
SHARES_SUBDIR = "shares"  # exported share units in the state directory, by bundle key
ROOM_TO_RETRY = 1 << 20  # bytes freed since that failure that are worth another try


class ModelHost:
    def __init__(self, model_dir: Path, state_dir: Path, quant: Quant = Quant.NONE):
        self.model_dir = Path(model_dir)
        self.quant = quant
        self.name = open_model(self.model_dir).name
        self._state_dir = Path(state_dir)
        self.state = ModelState.SHARDING
        self.detail = "starting"
        self.manifest: Manifest | None = None
        self.directory: Path | None = None
        self.files: Mapping[str, Path] = {}
        self._process: asyncio.subprocess.Process | None = None
        self._bundles: dict[str, _Bundle] = {}  # share units of group stages, by bundle key

    async def run(self) -> None:
        """Shard the model (or reuse an earlier result) and get ready to serve it; after a
        full disk, again once there is room."""
        while True:
            try:
                directory = await self._shard()
                manifest = await asyncio.to_thread(_checked_manifest, directory)
                break
            except ShardingFailed as exc:
                self.state, self.detail = ModelState.FAILED, str(exc)
                log.error("cannot serve model %s: %s", self.name, exc)
                if not exc.no_space:
                    return
            await self._until_room(f"sharding model {self.name}")
            self.state = ModelState.SHARDING
        self.manifest, self.files = manifest, manifest.files_in(directory)
        self.directory = directory
        self.state = ModelState.READY
        self.detail = f"{len(manifest.units)} units in {directory}"
        log.info("model %s ready: %s", self.name, self.detail)

    async def _shard(self) -> Path:
        found = await asyncio.to_thread(cached, self.model_dir, self._state_dir / SHARDS_SUBDIR,
                                        ShardOptions(quant=self.quant))
        if found is not None:
            log.info("model %s: the units are in the shard cache already", self.model_dir)
            return found.directory
        log.info("sharding model %s (quant %s) in a child process", self.model_dir, self.quant)
        self._process = process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "peerd", "shard", str(self.model_dir), "--json",
            "--quant", self.quant.value,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PEERD_STATE_DIR": str(self._state_dir)},
        )
        assert process.stdout is not None and process.stderr is not None  # both are pipes
        stdout, _ = await asyncio.gather(process.stdout.read(),
                                         self._follow_progress(process.stderr))
        code = await process.wait()
        if code != 0:
            raise ShardingFailed(f"sharding failed: {self.detail}",
                                 no_space=code == statedir.EX_TEMPFAIL)
        try:
            return Path(json.loads(stdout)["directory"])
        except (ValueError, KeyError, TypeError):
            raise ShardingFailed("sharding printed no result") from None

    async def _follow_progress(self, stderr: asyncio.StreamReader) -> None:
        while line := await stderr.readline():
            text = line.decode(errors="replace").strip()
            if text:
                self.detail = text.removeprefix("shard: ").removeprefix("peerd: ")
                log.info("sharding %s: %s", self.name, self.detail)

    async def _until_room(self, then: str) -> None:
        """Wait until the state directory's filesystem has gained room since the failure,
        to do what failed (`then`) again."""
        free_then = _free_bytes(self._state_dir)
        while _free_bytes(self._state_dir) < free_then + ROOM_TO_RETRY:
            await asyncio.sleep(SPACE_POLL_S)
        log.info("room in %s again: %s again", self._state_dir, then)

    def offer(self, req: int, have: str | None) -> ManifestOffer:
        """The answer to a manifest request; the manifest is left out when the asker has it."""
        if self.manifest is None:
            return ManifestOffer(req, self.name, self.state, self.detail, None, None)
        key = self.manifest.key
        content = None if have == key else self.manifest.to_dict()
        return ManifestOffer(req, self.name, ModelState.READY, self.detail, key, content)

    async def close(self) -> None:
        """Stop a sharding or share-exporting child that is still running."""
        for process in (self._process, *(b.process for b in self._bundles.values())):
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        for bundle in self._bundles.values():
            if bundle.task is not None:
                bundle.task.cancel()

    # -- share units of group stages -------------------------------------------------------------

    def served(self) -> dict[str, Path]:
        """Every file this peer serves by sha256: its units' and its exported share units'."""
        shared = {sha: path for b in self._bundles.values() for sha, path in b.files.items()}
        return {**self.files, **shared}

    def shares(self, request: SharesRequest) -> SharesOffer:
        """The answer to a member of a group asking for its share units: exported once per
        manifest, unit range and weights (kept in the state directory, so a re-plan or a
        restart with the same ones exports nothing), in a child process (torch)."""
        manifest, directory = self.manifest, self.directory
        if manifest is None or directory is None or request.model != manifest.key:
            return SharesOffer(request.req, ExportState.FAILED,
                               f"peer serves no model {request.model}")
        key = _bundle_key(request)
        bundle = self._bundles.get(key)
        if bundle is None:
            bundle = self._bundles[key] = _Bundle(self._state_dir / SHARES_SUBDIR / key)
            found = read_bundle(bundle.out)
            if found is not None:
                bundle.ready(found)
            else:
                bundle.task = asyncio.get_running_loop().create_task(
                    self._export(key, bundle, request, directory))
        return bundle.offer(request.req)

    async def _export(self, key: str, bundle: _Bundle, request: SharesRequest,
                      shard_dir: Path) -> None:
        log.info("exporting share units of units %d-%d for weights %s", request.first,
                 request.last, list(request.weights))
        bundle.process = process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shards.share_bundle", str(self.model_dir), str(shard_dir),
            str(bundle.out), "--weights", ",".join(map(repr, request.weights)),
            "--first", str(request.first), "--last", str(request.last),
            stderr=asyncio.subprocess.PIPE)
        assert process.stderr is not None  # a pipe
        while line := await process.stderr.readline():
            if text := line.decode(errors="replace").strip():
                bundle.detail = text
                log.info("share units: %s", text)
        code = await process.wait()
        found = read_bundle(bundle.out) if code == 0 else None
        if found is None:
            bundle.state = ExportState.FAILED
            log.error("share units of units %d-%d: %s", request.first, request.last,
                      bundle.detail)
            if code == statedir.EX_TEMPFAIL:  # a full disk: asked again, export again
                await self._until_room(f"exporting share units of units "
                                       f"{request.first}-{request.last}")
                del self._bundles[key]
            return
        bundle.ready(found)


class ShardingFailed(Exception):
    """The model could not be sharded or its output is unusable; the message is one line.
    `no_space`: for want of disk space, so worth trying again once there is room."""

    def __init__(self, message: str, no_space: bool = False) -> None:
        super().__init__(message)
        self.no_space = no_space


def _free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def _checked_manifest(directory: Path) -> Manifest:
    try:
        manifest = Manifest.load(directory)
    except ManifestError as exc:
        raise ShardingFailed(str(exc)) from None
    for unit in manifest.units:
        for file in unit.files:
            path = directory / file.name
            if not path.is_file():
                raise ShardingFailed(f"unit {unit.name}: {path} is missing")
            if file_sha256(path) != file.sha256:
                raise ShardingFailed(f"unit {unit.name}: {path} does not match its manifest "
                                     f"(remove {directory} to shard the model again)")
    return manifest


@dataclasses.dataclass
class _Bundle:
    """A group stage's share units, exported (or being exported) into `out`."""

    out: Path
    state: ExportState = ExportState.EXPORTING
    detail: str = "starting"
    document: dict[str, Any] | None = None
    files: dict[str, Path] = dataclasses.field(default_factory=dict)  # by sha256
    task: asyncio.Task | None = None
    process: asyncio.subprocess.Process | None = None

    def ready(self, document: dict[str, Any]) -> None:
        self.state, self.detail, self.document = ExportState.READY, "exported", document
        self.files = {f["sha256"]: self.out / f["name"]
                      for unit in document["units"] for f in unit["files"]}

    def offer(self, req: int) -> SharesOffer:
        document = self.document
        if self.state != ExportState.READY or document is None:
            return SharesOffer(req, self.state, self.detail)
        units = tuple(ShareUnitFiles(u["layer"], u["half"], u["share"],
                                     tuple(ShareFile(**f) for f in u["files"]),
                                     tuple(u["inputs"]), tuple(u["outputs"]))
                      for u in document["units"])
        tensors = {f"norm.{name}.{part}": np.asarray(values, np.float32)
                   for name, norm in document["norms"].items()
                   for part, values in norm.items() if values is not None}
        return SharesOffer(req, ExportState.READY, self.detail, units,
                           document["residual_post_norm"],
                           float(document["eps"]), tensors)


def _bundle_key(request: SharesRequest) -> str:
    """The bundle's name: its manifest, unit range and weights."""
    what = json.dumps([request.model, request.first, request.last, list(request.weights)])
    return hashlib.sha256(what.encode()).hexdigest()[:32]
