"""Unit files between peers over real CURVE transports on loopback: chunked, resumable,
verified transfers, refusals, and a peer deploying its stage of a plan."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import time
import weakref
from pathlib import Path

import msgpack
import numpy as np
import pytest
from toy_units import ToyModel, logits_after_unit0, write_toy
from waiting import eventually

from peerd.control.deploy import UNITS_ALONE, Deployment, stage_options
from peerd.control.unit_store import UnitStore
from peerd.control.unit_transfer import FETCH_ATTEMPTS, ChunkServer, TransferError, fetch_file
from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret, KeyPair
from peerd.wire.protocol import PlanAssignment, PlanFigures, PlanStage, UnitChunkRequest
from peerd.wire.transport import Endpoint, Transport, TransportError
from shards.executor import StageExecutor
from shards.joined import JOIN_BYTES, JOIN_WHOLE
from shards.manifest import UnitFile

SECRET = ClusterSecret(b"d" * 32)
HOST = "127.0.0.1"
CHUNK = 64 * 1024


class ModelPeer:
    """A transport serving unit files with ChunkServer; it can stop answering, or corrupt
    the first answer for an offset, and it records every chunk request it gets."""

    def __init__(self, files: dict[str, Path]):
        self.keys = KeyPair.generate()
        self.server = ChunkServer(lambda: files)
        self.requests: list[tuple[str, int]] = []
        self.answering = True
        self.corrupt_once: set[int] = set()
        self.transport = Transport(self.keys, SECRET, self._handle, HOST)
        self.ports = self.transport.start()
        self._tasks: set[asyncio.Task] = set()

    def _handle(self, incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, UnitChunkRequest):
            self.requests.append((msg.sha256, msg.offset))
            if self.answering:
                task = asyncio.create_task(self._answer(msg, incoming.reply))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: UnitChunkRequest, reply) -> None:
        answer = await self.server.answer(msg)
        if msg.offset in self.corrupt_once and isinstance(answer, protocol.UnitChunk):
            self.corrupt_once.discard(msg.offset)
            data = answer.tensors["data"].copy()
            data[0] ^= 0xFF
            answer = protocol.UnitChunk(answer.req, answer.sha256, answer.offset, answer.size,
                                        {"data": data})
        reply(answer)

    def endpoint(self) -> Endpoint:
        return Endpoint(HOST, self.ports.control, self.ports.data, self.keys.public)


class Puller:
    """The deploying side: a transport connected to the model peer."""

    def __init__(self, model: ModelPeer, timeout: float = 5.0):
        self.keys = KeyPair.generate()
        self.transport = Transport(self.keys, SECRET, lambda incoming: None, HOST)
        self.transport.start()
        self.transport.admit(model.keys.public)
        model.transport.admit(self.keys.public)
        self.transport.connect("model", model.endpoint())
        self.timeout = timeout

    def ask(self, peer: str = "model"):
        return lambda msg: self.transport.request(peer, msg, self.timeout)


@pytest.fixture
async def link(tmp_path: Path):
    """A model peer serving one random 1 MB file, and a puller with an empty store."""
    source = tmp_path / "unit.data"
    source.write_bytes(np.random.default_rng(0).bytes(1024 * 1024 + 123))
    sha = hashlib.sha256(source.read_bytes()).hexdigest()
    model = ModelPeer({sha: source})
    puller = Puller(model)
    await _until_connected(puller)
    yield model, puller, UnitStore(tmp_path / "store"), UnitFile(f"{sha}.data", sha,
                                                                 source.stat().st_size), source
    await puller.transport.close()
    await model.transport.close()


async def _until_connected(puller: Puller, timeout: float = 5.0) -> None:
    """Wait for the CURVE handshake: a refusal answer proves the round trip works."""
    deadline = time.monotonic() + timeout
    probe = UnitChunkRequest(0, "0" * 64, 0, 1)
    while True:
        try:
            await puller.transport.request("model", probe, 0.5)
            return
        except TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_an_interrupted_transfer_resumes_where_it_stopped(link):
    model, puller, store, file, source = link
    size = file.bytes
    model.requests.clear()

    def cut_after_five_chunks(_name, have):
        if have >= 5 * CHUNK:
            model.answering = False

    puller.timeout = 0.5
    with pytest.raises(TransportError, match="did not answer"):
        await fetch_file(puller.ask(), store, file, CHUNK, cut_after_five_chunks)
    assert store.received(file.content_name) == 5 * CHUNK and not store.has(file.content_name)

    model.answering, puller.timeout = True, 5.0
    model.requests.clear()
    path = await fetch_file(puller.ask(), store, file, CHUNK)
    assert path.read_bytes() == source.read_bytes() and path.name == file.content_name
    offsets = [offset for _, offset in model.requests]
    assert offsets == list(range(5 * CHUNK, size, CHUNK)), "resumed from the bytes on disk"


async def test_a_corrupted_chunk_makes_the_unit_be_fetched_again(link):
    model, puller, store, file, source = link
    model.requests.clear()
    model.corrupt_once = {3 * CHUNK}
    path = await fetch_file(puller.ask(), store, file, CHUNK)
    assert path.read_bytes() == source.read_bytes()
    offsets = [offset for _, offset in model.requests]
    assert offsets.count(0) == 2 and offsets.count(3 * CHUNK) == 2, "fetched twice in full"


async def test_a_unit_that_never_verifies_is_not_stored(link):
    model, puller, store, file, source = link
    sha = hashlib.sha256(b"something else").hexdigest()
    wrong = UnitFile(f"{sha}.data", sha, file.bytes)
    model.server = ChunkServer(lambda: {sha: source})  # serves bytes that hash to another sha
    model.requests.clear()
    with pytest.raises(TransferError, match=f"failed verification {FETCH_ATTEMPTS} times"):
        await fetch_file(puller.ask(), store, wrong, CHUNK)
    assert not store.has(wrong.content_name) and store.received(wrong.content_name) == 0
    assert [o for _, o in model.requests].count(0) == FETCH_ATTEMPTS


async def test_the_model_peer_refuses_unknown_units_and_offsets_beyond_the_file(link):
    model, puller, store, file, source = link
    sha, size = file.sha256, file.bytes
    unknown = hashlib.sha256(b"no such unit").hexdigest()
    with pytest.raises(TransferError, match=f"refused unit {unknown[:12]}: .*not served here"):
        await fetch_file(puller.ask(), store, UnitFile("x.onnx", unknown, 10), CHUNK)
    answer = await puller.transport.request("model", UnitChunkRequest(0, sha, size, 10), 5.0)
    assert isinstance(answer, protocol.UnitRefused)
    assert answer.reason == f"offset {size} is beyond the {size} bytes of unit {sha[:12]}"
    with pytest.raises(TransferError, match="got bytes 0.. of .* asked for 0.. of 99"):
        # the manifest says 99 bytes
        await fetch_file(puller.ask(), store, dataclasses.replace(file, bytes=99), CHUNK)


def test_chunk_requests_that_break_the_rules_do_not_decode():
    good = protocol.encode(UnitChunkRequest(1, "a" * 64, 0, 10))[0]
    header = msgpack.unpackb(good)
    for change, reason in [({"sha256": "../etc/passwd"}, "sha256"),
                           ({"offset": -1}, "negative offset"),
                           ({"length": protocol.MAX_CHUNK_BYTES + 1}, "length")]:
        with pytest.raises(protocol.ProtocolError, match=reason):
            protocol.decode([msgpack.packb({**header, **change})])


# -- a peer deploying its stage -------------------------------------------------------------------


@pytest.fixture
async def toy_cluster(tmp_path: Path):
    """The toy model's units served by a model peer, and a second peer's Deployment."""
    toy = ToyModel()
    manifest = write_toy(tmp_path / "model", toy)
    model = ModelPeer(manifest.files_in(tmp_path / "model"))
    puller = Puller(model)
    await _until_connected(puller)
    reports = []
    deployment = Deployment("second", UnitStore(tmp_path / "store"), puller.ask,
                            reports.append, chunk_bytes=256)
    yield toy, manifest, model, deployment, reports, tmp_path
    await deployment.close()
    await puller.transport.close()
    await model.transport.close()


def _plan(manifest, plan_id: int, stages: tuple[PlanStage, ...], epoch: int = 1):
    return PlanAssignment(epoch, plan_id, stages, "toy", "model", manifest.to_dict(),
                          "throughput", "milp", PlanFigures(0.1, 10.0, 0.1), None)


async def _until(condition, what: str):
    return await eventually(condition, what, timeout=10.0)


def _copy_to_store(store: UnitStore, file: UnitFile, directory: Path) -> None:
    store.path(file.content_name).write_bytes((directory / file.name).read_bytes())


async def test_a_peer_pulls_only_missing_units_refetches_corrupt_ones_and_loads_its_stage(
    toy_cluster,
):
    toy, manifest, model, deployment, reports, tmp_path = toy_cluster
    acc, head = manifest.units[1], manifest.units[2]
    head_model, head_data = head.files
    assert len(acc.files) == 1 and len(head.files) == 2, "the toy's head has a data file"
    store = deployment.store
    _copy_to_store(store, acc.model_file, tmp_path / "model")
    store.path(head_model.content_name).write_bytes(b"corrupted on disk")  # and no data file
    model.requests.clear()

    deployment.assign(_plan(manifest, 1, (PlanStage("model", 0, 0), PlanStage("second", 1, 2))))
    await _until(lambda: deployment.progress.state == "ready", "the stage to load")

    assert {sha for sha, _ in model.requests} == {head_model.sha256, head_data.sha256}, (
        "only the head's model and data files moved")
    assert sorted(p.name for p in store.root.iterdir()) == sorted(
        f.content_name for f in (*acc.files, *head.files))
    assert deployment.units == (1, 2)
    assert reports[-1].state == "ready" and reports[-1].units == (1, 2)
    moved = head_model.bytes + head_data.bytes
    assert any(r.state == "fetching" and r.total == moved for r in reports)
    assert deployment.progress.received == deployment.progress.total == moved

    ids = [3, 1, 4]
    logits = logits_after_unit0(manifest, tmp_path / "model", deployment.executor, ids)
    np.testing.assert_allclose(logits, toy.logits(ids), rtol=1e-5, atol=1e-5)


async def test_a_corrupted_data_file_in_the_store_is_fetched_again_never_loaded(toy_cluster):
    toy, manifest, model, deployment, reports, tmp_path = toy_cluster
    head_model, head_data = manifest.units[2].files
    store = deployment.store
    for file in (*manifest.units[1].files, head_model, head_data):
        _copy_to_store(store, file, tmp_path / "model")
    damaged = bytearray(store.path(head_data.content_name).read_bytes())
    damaged[-1] ^= 0xFF  # same size, one weight changed: it would load and compute nonsense
    store.path(head_data.content_name).write_bytes(damaged)
    model.requests.clear()

    deployment.assign(_plan(manifest, 1, (PlanStage("model", 0, 0), PlanStage("second", 1, 2))))
    await _until(lambda: deployment.progress.state == "ready", "the stage to load")

    assert {sha for sha, _ in model.requests} == {head_data.sha256}
    assert any(r.state == "fetching" and r.total == head_data.bytes for r in reports)
    ids = [2, 7, 1, 8]
    logits = logits_after_unit0(manifest, tmp_path / "model", deployment.executor, ids)
    np.testing.assert_allclose(logits, toy.logits(ids), rtol=1e-5, atol=1e-5)


async def test_newer_plans_replace_older_ones_and_stale_ones_are_ignored(toy_cluster):
    toy, manifest, model, deployment, reports, tmp_path = toy_cluster
    deployment.assign(_plan(manifest, 3, (PlanStage("model", 0, 1), PlanStage("second", 2, 2)),
                            epoch=2))
    await _until(lambda: deployment.units == (2,), "units 2")
    deployment.assign(_plan(manifest, 9, (PlanStage("model", 0, 0), PlanStage("second", 1, 2)),
                            epoch=1))
    assert deployment.assignment.epoch == 2, "a deposed leader's plan is ignored"

    reports.clear()
    deployment.assign(_plan(manifest, 3, (PlanStage("model", 0, 1), PlanStage("second", 2, 2)),
                            epoch=2))
    assert [(r.plan_id, r.state, r.units) for r in reports] == [(3, "ready", (2,))]

    deployment.assign(_plan(manifest, 4, (PlanStage("model", 0, 2),), epoch=2))
    await _until(lambda: deployment.assignment.plan_id == 4 and deployment.units == (),
                 "unloading")
    assert reports[-1].state == "ready" and reports[-1].units == ()
    assert deployment.plan_document()["stages"] == [{"peer": "model", "units": [0, 1, 2],
                                                      "copies": [], "shares": []}]


async def test_a_failed_deployment_is_reported_and_retried_when_the_plan_comes_again(
    toy_cluster,
):
    toy, manifest, model, deployment, reports, tmp_path = toy_cluster
    plan = _plan(manifest, 1, (PlanStage("model", 0, 0), PlanStage("second", 1, 2)))
    model.server = ChunkServer(dict)  # the model peer lost its files
    deployment.assign(plan)
    await _until(lambda: deployment.progress.state == "failed", "the failure")
    assert "not served here" in reports[-1].detail and reports[-1].units == ()

    model.server = ChunkServer(lambda: manifest.files_in(tmp_path / "model"))
    deployment.assign(plan)
    await _until(lambda: deployment.progress.state == "ready", "the retry")
    assert deployment.units == (1, 2)


async def test_while_no_peer_serves_a_model_there_is_no_plan_to_show(toy_cluster):
    toy, manifest, model, deployment, reports, tmp_path = toy_cluster
    deployment.assign(_plan(manifest, 1, (PlanStage("model", 0, 0), PlanStage("second", 1, 2))))
    await _until(lambda: deployment.units == (1, 2), "units 1-2")
    none = PlanAssignment(1, 2, (), None, None, None, "throughput", "milp", None,
                          "no peer serves a model (start one with --model)")
    deployment.assign(none)
    await _until(lambda: deployment.units == (), "unloading")
    assert deployment.plan_document() is None
    infeasible = dataclasses.replace(none, plan_id=3, model="toy", model_peer="model",
                                     problem="model needs 9 GB")
    deployment.assign(infeasible)
    await _until(lambda: deployment.progress.detail == "model needs 9 GB", "the problem")
    assert deployment.plan_document()["problem"] == "model needs 9 GB"
    assert deployment.plan_document()["stages"] == []


async def test_a_peer_whose_range_grows_loads_only_the_unit_it_gains(toy_cluster):
    toy, manifest, model, deployment, reports, tmp_path = toy_cluster
    deployment.assign(_plan(manifest, 1, (PlanStage("model", 0, 1), PlanStage("second", 2, 2))))
    await _until(lambda: deployment.units == (2,), "units 2")
    old = deployment.executor  # what the old plan's plane holds until the new plan is live
    assert old is not None
    model.requests.clear()

    deployment.assign(_plan(manifest, 2, (PlanStage("model", 0, 0), PlanStage("second", 1, 2))))
    await _until(lambda: deployment.units == (1, 2), "units 1-2")

    new = deployment.executor
    assert new is not None and new is not old
    assert new.session(2) is old.session(2), "unit 2 was not loaded again"
    assert {sha for sha, _ in model.requests} == {f.sha256 for f in manifest.units[1].files}
    ids = [3, 1, 4]
    logits = logits_after_unit0(manifest, tmp_path / "model", new, ids)
    np.testing.assert_allclose(logits, toy.logits(ids), rtol=1e-5, atol=1e-5)


def test_a_stage_runs_joined_as_far_as_what_a_plan_change_loads_beside_it_fits():
    stage = 3 * JOIN_BYTES
    assert stage_options(stage, 2 * stage).join_bytes == JOIN_WHOLE
    assert stage_options(stage, 2 * stage - 1).join_bytes == JOIN_BYTES
    assert stage_options(stage, stage + 2 * JOIN_BYTES).join_bytes == JOIN_BYTES
    assert stage_options(stage, stage + 2 * JOIN_BYTES - 1) == UNITS_ALONE
    assert UNITS_ALONE.join_bytes == 0


@pytest.mark.parametrize("room", [True, False], ids=["room-for-two", "tight-budget"])
async def test_a_stage_with_room_for_a_second_copy_runs_as_one_session(tmp_path: Path, room):
    toy = ToyModel()
    manifest = write_toy(tmp_path / "model", toy)
    weights = sum(u.weight_bytes for u in manifest.units[:2])
    deployment = Deployment("model", UnitStore(tmp_path / "store"), lambda peer: None,
                            lambda report: None,
                            local_files=lambda: manifest.files_in(tmp_path / "model"),
                            memory_budget=None if room else 2 * weights - 1)
    try:
        deployment.assign(_plan(manifest, 1, (PlanStage("model", 0, 1),
                                              PlanStage("second", 2, 2))))
        await _until(lambda: deployment.units == (0, 1), "units 0-1")
        stage = deployment.executor
        assert isinstance(stage, StageExecutor)
        assert (stage.session(0) is stage.session(1)) is room
        how = "joined whole" if room else "each unit alone"
        assert deployment.progress.detail == f"loaded units 0-1, {how}"
        ids = [3, 1, 4]
        request = {"input_ids": np.array([ids], np.int64),
                   "position_ids": np.arange(len(ids), dtype=np.int64)[None]}
        head = StageExecutor(manifest, tmp_path / "model", 2, 2)
        logits = head.step("s", stage.step("s", request))["logits"][0]
        np.testing.assert_allclose(logits, toy.logits(ids), rtol=1e-5, atol=1e-5)
    finally:
        await deployment.close()


async def test_movable_copies_are_held_taken_when_the_boundary_moves_and_let_go(toy_cluster):
    toy, manifest, model, deployment, reports, tmp_path = toy_cluster
    deployment.assign(_plan(manifest, 1, (PlanStage("model", 0, 1),
                                          PlanStage("second", 2, 2, copies=(1,)))))
    await _until(lambda: 1 in deployment.copies, "a copy of unit 1")
    assert deployment.units == (2,) and deployment.status()["copies"] == [1]
    assert {sha for sha, _ in model.requests} >= {f.sha256 for f in manifest.units[1].files}
    copy = weakref.ref(deployment.copies[1].session)
    ready = next(i for i, r in enumerate(reports) if r.state == "ready")
    assert all(r.state == "ready" for r in reports[ready:]), "the stage serves while copies load"
    model.requests.clear()

    deployment.assign(_plan(manifest, 2, (PlanStage("model", 0, 0), PlanStage("second", 1, 2))))
    await _until(lambda: deployment.units == (1, 2) and not deployment.copies, "units 1-2")
    new = deployment.executor
    assert new is not None and new.session(1) is copy(), "unit 1 was not loaded again"
    assert not model.requests, "nothing was fetched"
    ids = [3, 1, 4]
    np.testing.assert_allclose(logits_after_unit0(manifest, tmp_path / "model", new, ids),
                               toy.logits(ids), rtol=1e-5, atol=1e-5)

    deployment.assign(_plan(manifest, 3, (PlanStage("model", 0, 1), PlanStage("second", 2, 2))))
    await _until(lambda: deployment.units == (2,), "units 2")
    new = None
    gc.collect()
    assert copy() is None, "a unit neither run nor named as a copy is let go"
