"""Unit files on a disk that lies or fills up.

- A cached unit whose bytes do not hash to its name is fetched again and never loaded, even
  when it is a perfectly loadable unit of another model, and so is a partial file that was
  corrupted between two transfers.
- A disk that fills while units arrive (a real tmpfs, smaller than the unit) gives one clear
  line, keeps only verified whole files and a partial cut at a chunk boundary, and the
  transfer resumes from there once there is room: first with the receiving side alone, then
  end to end with two real daemons, the receiver's unit cache on the small tmpfs.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from disks import resize, tmpfs
from netns import wait_for
from sharding import reference
from toy_units import ToyModel, logits_after_unit0, write_toy
from waiting import eventually

from peerd.commands.chat import stream_answer
from peerd.commands.client import call
from peerd.commands.local_cluster import LocalCluster
from peerd.control.deploy import Deployment
from peerd.control.unit_store import StoreError, UnitStore, file_sha256
from peerd.control.unit_transfer import CHUNK_BYTES, ChunkServer, fetch_file
from peerd.wire.protocol import PlanAssignment, PlanFigures, PlanStage, UnitChunkRequest
from shards.manifest import UnitFile

CHUNK = 64 * 1024


class Server:
    """The model peer's ChunkServer, asked directly; it records the offsets asked for."""

    def __init__(self, files: dict[str, Path]):
        self.chunks = ChunkServer(lambda: files)
        self.offsets: list[int] = []

    def ask(self, peer: str = "model"):
        async def asked(request: UnitChunkRequest):
            self.offsets.append(request.offset)
            return await self.chunks.answer(request)

        return asked


def _plan(manifest, stages: tuple[PlanStage, ...]) -> PlanAssignment:
    return PlanAssignment(1, 1, stages, "toy", "model", manifest.to_dict(), "throughput", "milp",
                          PlanFigures(0.1, 10.0, 0.1), None)


async def test_a_cached_unit_that_does_not_match_its_hash_is_fetched_again_never_loaded(
    tmp_path,
):
    toy, other = ToyModel(seed=0), ToyModel(seed=1)
    manifest = write_toy(tmp_path / "model", toy)
    impostor = write_toy(tmp_path / "other", other)
    acc, head = manifest.units[1], manifest.units[2]
    store = UnitStore(tmp_path / "store")
    # Another model's head: the same graph, other weights, a valid ONNX file that would load
    # (its own data file is in the store too, under its own name).
    other_model, other_data = impostor.units[2].files
    shutil.copy(tmp_path / "other" / other_data.name, store.path(other_data.content_name))
    shutil.copy(tmp_path / "other" / other_model.name, store.path(head.model_file.content_name))
    # A partial transfer of unit 1 whose bytes were damaged on disk since.
    good = (tmp_path / "model" / acc.model_file.name).read_bytes()
    (store.root / f"{acc.model_file.content_name}.part").write_bytes(
        bytes(b ^ 0xFF for b in good[:100]))
    server = Server(manifest.files_in(tmp_path / "model"))
    deployment = Deployment("second", store, server.ask, lambda report: None, chunk_bytes=256)

    deployment.assign(_plan(manifest, (PlanStage("model", 0, 0), PlanStage("second", 1, 2))))
    await eventually(lambda: deployment.progress.state in ("ready", "failed"), "the stage",
                     timeout=10)
    assert deployment.progress.state == "ready", deployment.progress.detail
    for file in (*acc.files, *head.files):
        assert file_sha256(store.path(file.content_name)) == file.sha256
    assert server.offsets[0] == 100, "unit 1 resumed from its partial file"
    assert server.offsets.count(0) == 3, (
        "then unit 1 was fetched whole, and the head's model and data files once")
    ids = [3, 1, 4]
    logits = logits_after_unit0(manifest, tmp_path / "model", deployment.executor, ids)
    np.testing.assert_allclose(logits, toy.logits(ids), rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits, other.logits(ids), atol=1e-3), "the impostor differs"
    await deployment.close()


async def test_a_full_disk_is_one_clear_line_leaves_the_cache_consistent_and_resumes(tmp_path):
    source = tmp_path / "unit.onnx"
    source.write_bytes(np.random.default_rng(0).bytes(3 * 1024 * 1024 + 77))
    small = tmp_path / "small.onnx"
    small.write_bytes(b"a small unit that fits" * 100)
    sha, small_sha = file_sha256(source), file_sha256(small)
    server = Server({sha: source, small_sha: small})
    unit = UnitFile("unit.onnx", sha, source.stat().st_size)
    with tmpfs(tmp_path / "disk", "2m") as disk:
        store = UnitStore(disk / "units")
        await fetch_file(server.ask(), store, UnitFile("small.onnx", small_sha,
                                                       small.stat().st_size), CHUNK)
        with pytest.raises(StoreError) as failure:
            await fetch_file(server.ask(), store, unit, CHUNK)
        reason = str(failure.value)
        assert reason.startswith("no space left in ") and sha[:12] in reason
        assert "\n" not in reason
        kept = store.received(unit.content_name)
        assert 0 < kept < source.stat().st_size and kept % CHUNK == 0, "cut at a chunk boundary"
        assert not store.has(unit.content_name), "no half file is taken as complete"
        assert store.verify(f"{small_sha}.onnx"), "what was whole stays whole"

        resize(disk, "8m")
        server.offsets.clear()
        path = await fetch_file(server.ask(), store, unit, CHUNK)
        assert path.read_bytes() == source.read_bytes()
        assert server.offsets[0] == kept, "the retry resumed from the bytes on disk"


# -- end to end: two daemons, the receiver's unit cache on a small tmpfs -----------------------

PROMPT, NEW_TOKENS = [2, 7, 1, 8], 8


@pytest.mark.cluster
def test_two_daemons_a_receiver_with_a_full_disk_reports_it_and_recovers_once_there_is_room(
    hf_checkpoint, tmp_path,
):
    # Layer halves of about 9 MB: every unit of the receiver's stage is bigger than its disk.
    model_dir = hf_checkpoint("llama", layers=2, hidden=512, intermediate=1536, heads=8,
                              kv_heads=4)
    expected = reference(model_dir, tuple(PROMPT), NEW_TOKENS, stop_at_eos=True)[0]
    receiver = tmp_path / "peer1"
    with tmpfs(receiver / "units", "6m") as disk:
        cluster = LocalCluster(tmp_path, model_dir, 2, progress=lambda line: None)
        with _entered_in_background(cluster) as deployed:
            failed = wait_for(lambda: _failed_deployment(receiver), 240,
                              "the receiver to report its full disk")
            assert failed["detail"].startswith(f"no space left in {disk}")
            assert "\n" not in failed["detail"]
            # the leader re-sends the plan every round: a retry may be writing just now
            wait_for(lambda: _consistent(UnitStore(disk)), 10,
                     "every whole unit file verified, the partial ending at a chunk")
            resize(disk, "64m")
            wait_for(deployed.is_set, 120, "the retried deployment")
            answer = stream_answer(cluster.dirs[0],
                                   {"prompt_ids": PROMPT, "max_tokens": NEW_TOKENS})
            assert answer["token_ids"] == expected


def _failed_deployment(state_dir: Path) -> dict | None:
    try:
        deployment = call(state_dir, {"op": "status"})["status"]["deployment"]
    except Exception:  # not started yet
        return None
    return deployment if deployment["state"] == "failed" else None


def _consistent(store: UnitStore) -> bool:
    """Every whole file verifies, and the partial that hit the full disk ends at a chunk."""
    try:
        files = {path.name: path for path in store.root.iterdir()}
        partials = [path for name, path in files.items() if name.endswith(".part")]
        whole = {name[:64]: path for name, path in files.items() if not name.endswith(".part")}
        return (bool(partials) and all(p.stat().st_size % CHUNK_BYTES == 0 for p in partials)
                and all(file_sha256(path) == digest for digest, path in whole.items()))
    except FileNotFoundError:  # renamed or removed while we looked
        return False


@contextlib.contextmanager
def _entered_in_background(cluster: LocalCluster) -> Iterator[threading.Event]:
    """Enter the cluster (which waits for a deployed plan) on a thread; the event is set once
    it is in. Any failure of the thread is raised here at the end."""
    entered, failures = threading.Event(), []

    def enter() -> None:
        try:
            cluster.__enter__()
            entered.set()
        except BaseException as exc:  # reported below
            failures.append(exc)

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    try:
        yield entered
    finally:
        cluster.stop()
        thread.join(30)
    if failures:
        raise failures[0]
