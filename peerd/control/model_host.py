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
then starts again by itself, so freeing space is all a user has to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from peerd import statedir
from peerd.control.unit_store import file_sha256
from peerd.wire.protocol import ManifestOffer
from peerd.wire.states import ModelState
from shards.cache import ShardOptions, cached
from shards.cli import SHARDS_SUBDIR
from shards.manifest import Manifest, ManifestError, Quant
from shards.source import open_model

log = logging.getLogger("peerd.control.model_host")

SPACE_POLL_S = 1.0  # how often a model that failed for want of space looks for room again
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
        self.files: Mapping[str, Path] = {}
        self._process: asyncio.subprocess.Process | None = None

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
            await self._until_room()
            self.state = ModelState.SHARDING
        self.manifest, self.files = manifest, manifest.files_in(directory)
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

    async def _until_room(self) -> None:
        """Wait until the shard cache's filesystem has gained room since the failure."""
        free_then = _free_bytes(self._state_dir)
        while _free_bytes(self._state_dir) < free_then + ROOM_TO_RETRY:
            await asyncio.sleep(SPACE_POLL_S)
        log.info("room in %s again: sharding model %s again", self._state_dir, self.name)

    def offer(self, req: int, have: str | None) -> ManifestOffer:
        """The answer to a manifest request; the manifest is left out when the asker has it."""
        if self.manifest is None:
            return ManifestOffer(req, self.name, self.state, self.detail, None, None)
        key = self.manifest.key
        content = None if have == key else self.manifest.to_dict()
        return ManifestOffer(req, self.name, ModelState.READY, self.detail, key, content)

    async def close(self) -> None:
        """Stop a sharding child that is still running."""
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._process.wait()


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
