"""The model peer's side: sharding in a child process, the manifest offer, share units of a
group exported in a child (on a full disk too), and a daemon that never imports torch."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_objects import unstarted_daemon
from disks import fill, tmpfs
from sharding import seed_shard_cache, sharded
from waiting import eventually

from peerd.commands.cli import build_parser
from peerd.control.model_host import SHARES_SUBDIR, ModelHost
from peerd.control.unit_transfer import ChunkServer
from peerd.daemon.start import options_from_args
from peerd.wire.protocol import SharesRequest, UnitChunk, UnitChunkRequest
from peerd.wire.states import ExportState
from shards.manifest import Manifest, Quant


@pytest.mark.slow
async def test_the_model_is_sharded_in_a_child_process_and_offered(hf_checkpoint, tmp_path,
                                                                   caplog):
    host = ModelHost(hf_checkpoint("llama"), tmp_path, Quant.INT4)
    assert host.offer(1, None).state == "sharding"
    with caplog.at_level(logging.INFO, "peerd.control.model_host"):
        await host.run()
    assert host.state == "ready", host.detail
    assert "exported in" in caplog.text, "the child's progress is logged"

    manifest = host.manifest
    assert manifest == Manifest.load(tmp_path / "shards" / manifest.key)
    assert manifest.options.quant is Quant.INT4, "the child was asked for --quant int4"
    offer = host.offer(7, None)
    assert (offer.req, offer.state, offer.key) == (7, "ready", manifest.key)
    assert Manifest.from_dict(offer.manifest) == manifest
    assert host.offer(8, manifest.key).manifest is None, "the asker has it already"

    assert set(host.files) == {f.sha256 for f in manifest.files()}
    for file in manifest.units[1].files:  # its model and its data file
        answer = await ChunkServer(lambda: host.files).answer(
            UnitChunkRequest(1, file.sha256, 0, file.bytes))
        assert isinstance(answer, UnitChunk) and answer.size == file.bytes
        assert answer.tensors["data"].tobytes() == (host.files[file.sha256]).read_bytes()


async def test_a_corrupted_data_file_in_the_shard_cache_is_refused_in_one_line(
    hf_checkpoint, tmp_path,
):
    model_dir = hf_checkpoint("llama")
    result = sharded(model_dir)
    cached = tmp_path / "shards" / result.manifest.key
    shutil.copytree(result.directory, cached)
    data = result.manifest.units[-1].files[1]
    damaged = bytearray((cached / data.name).read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # the same size: the cache is reused, then checked
    (cached / data.name).write_bytes(damaged)
    host = ModelHost(model_dir, tmp_path)
    await host.run()
    assert (host.state, host.files, host.manifest) == ("failed", {}, None)
    assert host.detail == (f"unit head: {cached / data.name} does not match its manifest "
                           f"(remove {cached} to shard the model again)")


@pytest.mark.slow
async def test_share_units_on_a_full_disk_fail_naming_it_then_export_once_there_is_room(
    hf_checkpoint, tmp_path,
):
    model_dir = hf_checkpoint("llama", heads=4, kv_heads=2)
    with tmpfs(tmp_path / "state", "64m") as state_dir:
        seed_shard_cache(state_dir, model_dir)
        host = ModelHost(model_dir, state_dir)
        await host.run()
        assert host.state == "ready", host.detail
        assert host.manifest is not None
        request = SharesRequest(0, host.manifest.key, 0, len(host.manifest.units) - 1,
                                (1.0, 1.0))
        ballast = state_dir / "ballast"
        fill(ballast)
        failed = await eventually(
            lambda: (offer := host.shares(request)).state == ExportState.FAILED and offer,
            "the export to fail", timeout=120)
        assert f"no space left in {state_dir / SHARES_SUBDIR}" in failed.detail
        assert "\n" not in failed.detail
        assert host.shares(request).state == ExportState.FAILED, "not again while full"
        ballast.unlink()
        ready = await eventually(
            lambda: (offer := host.shares(request)).state == ExportState.READY and offer,
            "the export to run again and finish", timeout=120)
        assert ready.units and all(host.served()[f.sha256].is_file()
                                   for unit in ready.units for f in unit.files)
        await host.close()


@pytest.mark.parametrize(("flags", "quant"), [
    ((), Quant.NONE), (("--quant", "int4"), Quant.INT4), (("--int8",), Quant.INT8)])
async def test_peerd_start_hands_its_quant_to_the_model_host(tmp_path, flags, quant):
    args = build_parser().parse_args(
        ["start", "--state-dir", str(tmp_path), "--model", str(tmp_path), *flags])
    async with unstarted_daemon(tmp_path, options_from_args(args)) as daemon:
        assert daemon.plans.model_host.quant is quant


async def test_a_model_that_cannot_be_sharded_is_reported_not_raised(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    host = ModelHost(empty, tmp_path / "state")
    await host.run()
    assert host.state == "failed"
    assert host.detail == f"sharding failed: not a model directory: no config.json in {empty}"
    offer = host.offer(3, None)
    assert (offer.state, offer.key, offer.manifest) == ("failed", None, None)


NO_TORCH = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from toy_units import ToyModel, write_toy
import peerd.daemon.start, peerd.control.deploy, peerd.control.coordinator
import peerd.control.model_host, peerd.control.planning
from shards.executor import StageExecutor
manifest = write_toy(Path({directory!r}), ToyModel())
StageExecutor(manifest, Path({directory!r}), 0, 2)
print("torch" in sys.modules)
"""


def test_the_daemon_and_a_loaded_stage_never_import_torch(tmp_path):
    script = NO_TORCH.format(tests=str(Path(__file__).parents[2]), directory=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
