"""A peer's side of a plan: get the unit files of its stage, load them, report to the leader.

Every member receives each plan (peerd.wire.protocol.PlanAssignment). A peer with a stage looks
for each of its units' files (`Unit.files`: the ONNX model and its data file): the model peer
has them in its shard directory; any other peer looks in its UnitStore (re-hashing a cached
file first, so a corrupted one is fetched again, never loaded) and pulls the missing ones from
the model peer in verified, resumable chunks (peerd.control.unit_transfer); either way a unit's data
file lies beside its model, where ONNX Runtime looks for it. It then loads a StageExecutor
for exactly its units, times each unit on a warm-up step (peerd/cluster/unit_clock.py) and
reports ``ready``; a peer without a stage unloads and reports
``ready`` with no units. Progress goes to the leader as DeployReports and to the log.

A peer whose range changes serves on its old stage until the new plan is live
(peerd/inference/serving.py). Its executors share one SessionShelf, and the units it loses
are freed when the old plane retires, taking the old executor with it. How a stage's units
run depends on the memory the peer has available as it loads (capped by --memory-budget;
`stage_options`): joined, a stage skips a run's fixed costs between units, but a new stage
shares less with the old. Joined whole where the stage's weights fit twice, since the next
plan's stage is then loaded whole beside it; else joined by blocks (shards/joined.py) where
two blocks more fit, since the new stage loads again at most the two blocks its range cuts
besides the units it gains; else each unit alone, and the new stage runs the old stage's
sessions of the units both hold and loads only the units it gains.

Once its stage is ready, a peer also loads the movable copies its plan stage names (the
overlap plan: neighbours' boundary units, within its memory budget) into the same shelf and
holds them, quietly (its state stays ``ready``): when a later plan moves a boundary onto it,
the units it gains are already loaded. Copies the next plan does not name are let go.

A newer plan (by leader epoch, then plan id) cancels work on an older one; bytes already
received stay in the store, so the next plan resumes them. A plan equal to the one loaded
(same manifest and unit range) keeps the executor as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from peerd.cluster.monitor import read_memory
from peerd.cluster.unit_clock import UnitClock
from peerd.control.unit_store import UnitStore
from peerd.control.unit_transfer import CHUNK_BYTES, Ask, fetch_file
from peerd.inference.shares import ShareRunner, whole_units
from peerd.wire.protocol import (
    DeployReport,
    PlanAssignment,
    PlanStage,
    SharesOffer,
    SharesRequest,
)
from peerd.wire.states import DeployState, ExportState
from shards.early_exit import ExitPoint, ExitSettings, exit_point, last_exit_layer
from shards.executor import ExecutorOptions, HeldUnit, SessionShelf, StageExecutor
from shards.joined import JOIN_BYTES, JOIN_WHOLE
from shards.manifest import Manifest, ManifestError, Unit, UnitFile
from shards.share_layout import Norm, ShareUnit, ShareUnits
from shards.share_split import LayerShape, split_layer

log = logging.getLogger("peerd.control.deploy")

REPORT_INTERVAL_S = 1.0
SHARES_POLL_S = 0.5  # how often a group member asks again while the model peer exports

AskShares = Callable[[str, SharesRequest], Awaitable[SharesOffer]]
UNITS_ALONE = ExecutorOptions()  # the sessions of movable copies and group shares too


def stage_options(weight_bytes: int, memory_available: int) -> ExecutorOptions:
    """How a stage of `weight_bytes` of weights runs on a peer with `memory_available` as it
    loads: joined as far as what a plan change then loads beside it still fits."""
    if 2 * weight_bytes <= memory_available:
        return ExecutorOptions(join_bytes=JOIN_WHOLE)
    if weight_bytes + 2 * JOIN_BYTES <= memory_available:
        return ExecutorOptions(join_bytes=JOIN_BYTES)
    return UNITS_ALONE


def _how(options: ExecutorOptions) -> str:
    """How a stage's units run, in words for the log and the deploy detail."""
    if options.join_bytes == JOIN_WHOLE:
        return "joined whole"
    if options.join_bytes:
        return f"joined by {options.join_bytes >> 20} MiB blocks"
    return "each unit alone"


@dataclasses.dataclass(frozen=True)
class LoadedStage:
    """The units this peer runs: units ``first``..``last`` of ``manifest``, in ``executor``;
    in a group stage (``group``: its peers, the lead first), this peer's share of them."""

    manifest: Manifest
    first: int
    last: int
    executor: StageExecutor | ShareRunner
    group: tuple[str, ...] = ()

    @property
    def units(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.last + 1))


@dataclasses.dataclass
class Progress:
    state: DeployState = DeployState.IDLE
    received: int = 0
    total: int = 0
    detail: str = ""


class Deployment:
    def __init__(
        self,
        me: str,
        store: UnitStore,
        ask: Callable[[str], Ask],
        report: Callable[[DeployReport], None],
        ask_shares: AskShares | None = None,
        local_files: Callable[[], Mapping[str, Path]] = dict,
        chunk_bytes: int = CHUNK_BYTES,
        unit_clock: UnitClock | None = None,
        exits: ExitSettings | None = None,
        memory_budget: int | None = None,
    ):
        """`ask(peer)` sends a chunk request to that peer and returns its answer; `report`
        delivers a DeployReport to the leader; `local_files` are unit files this peer has
        without fetching (sha256 -> path: the model peer's shard directory); `unit_clock`
        gets the time of each unit's warm-up step; with `exits`, a first stage also loads
        the head unit, to run it on the exit's hidden state; `memory_budget` (--memory-budget)
        caps the memory available that decides how a stage runs (`stage_options`)."""
        self.me = me
        self.store = store
        self._ask = ask
        self._report = report
        self._ask_shares = ask_shares
        self._local_files = local_files
        self._chunk_bytes = chunk_bytes
        self.unit_clock = unit_clock or UnitClock()
        self.exits = exits or ExitSettings()
        self.sessions = SessionShelf()  # the unit sessions of this peer's stages, old and new
        self._memory_budget = memory_budget
        self.copies: dict[int, HeldUnit] = {}  # the movable copies it holds, by unit index
        self.assignment: PlanAssignment | None = None
        self.manifest: Manifest | None = None  # the current plan's
        self.loaded: LoadedStage | None = None
        self.ready_plan: str | None = None  # key of the plan whose units are loaded
        self.progress = Progress()
        self._task: asyncio.Task | None = None
        self._have: dict[str, int] = {}
        self._reported_at = -float("inf")

    @property
    def units(self) -> tuple[int, ...]:
        """The units this peer has loaded."""
        return self.loaded.units if self.loaded else ()

    @property
    def executor(self) -> StageExecutor | ShareRunner | None:
        return self.loaded.executor if self.loaded else None

    # -- plans ---------------------------------------------------------------------------------

    def assign(self, plan: PlanAssignment) -> bool:
        """Act on a plan from the leader; older plans are ignored, a repeat is answered.
        True when the plan is new to this peer."""
        current = self.assignment
        if current is not None and _order(plan) < _order(current):
            log.info("ignored plan %d of epoch %d: plan %d of epoch %d is newer",
                     plan.plan_id, plan.epoch, current.plan_id, current.epoch)
            return False
        if current is not None and _order(plan) == _order(current):
            if self.progress.state == DeployState.FAILED:
                self._start(plan)  # the leader asks again: retry
            else:  # where it stands, even while the ready stage still loads its copies
                self._send_report()
            return False
        self._start(plan)
        return True

    def _start(self, plan: PlanAssignment) -> None:
        if self._task is not None:
            self._task.cancel()
        self.assignment = plan
        self.manifest = None
        self.progress = Progress(DeployState.PENDING)
        self._have = {}
        self._task = asyncio.create_task(self._deploy(plan), name=f"deploy-{plan.plan_id}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _deploy(self, plan: PlanAssignment) -> None:
        stage = next((s for s in plan.stages if self.me in s.peers), None)
        try:
            self.manifest = _manifest(plan)
            if stage is None:
                self.loaded = None
                self.copies = {}
                self._set(DeployState.READY, detail=plan.problem or "no stage in this plan")
            elif self.manifest is None or plan.model_peer is None:
                raise ValueError("the plan gives this peer a stage but no manifest or model peer")
            else:
                await self._deploy_stage(plan, stage, self.manifest, plan.model_peer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure is reported to the leader, who asks again
            log.error("plan %d: cannot deploy units %s: %s", plan.plan_id, _range(stage), exc)
            self._set(DeployState.FAILED, detail=str(exc) or type(exc).__name__)

    async def _deploy_stage(
        self, plan: PlanAssignment, stage: PlanStage, manifest: Manifest, model_peer: str
    ) -> None:
        if stage.shares:
            await self._deploy_share(plan, stage, manifest, model_peer)
            return
        loaded = self.loaded
        if loaded and not loaded.group and (loaded.manifest.key, loaded.first, loaded.last) == (
            manifest.key, stage.first, stage.last
        ):
            self._set(DeployState.READY, detail="units already loaded")
            await self._hold_copies(model_peer, manifest, stage)
            return
        point = self._exit(manifest, stage)
        units = manifest.units[stage.first : stage.last + 1]
        weights = sum(u.weight_bytes for u in units)
        if point is not None:
            units = (*units, manifest.units[point.head])
        paths, missing = await self._unit_paths(units)
        if missing:
            await self._fetch(model_peer, missing)
        self._set(DeployState.LOADING, detail=f"loading units {_range(stage)}")
        self.loaded = None  # its plane holds the old stage until the new one is live
        options = stage_options(weights, read_memory(self._memory_budget).available)
        executor = await asyncio.to_thread(
            StageExecutor, _at_paths(manifest, paths), self.store.root, stage.first, stage.last,
            options, self.sessions, point,
        )
        await self._warm_up(manifest, executor)
        self.loaded = LoadedStage(manifest, stage.first, stage.last, executor)
        ready = f"loaded units {_range(stage)}, {_how(options)}"
        log.info("plan %d: %s", plan.plan_id, ready)
        self._set(DeployState.READY, detail=ready)
        await self._hold_copies(model_peer, manifest, stage)

    async def _deploy_share(self, plan: PlanAssignment, stage: PlanStage, manifest: Manifest,
                            model_peer: str) -> None:
        """Load this peer's share of a group stage: its share units (exported by the model
        peer for the stage's weights), and the model's own units it runs whole: the
        embedding, and on the lead the head (shares.whole_units)."""
        index = stage.peers.index(self.me)
        offer = await self._share_offer(model_peer, SharesRequest(
            0, manifest.key, stage.first, stage.last, stage.weights))
        whole = tuple(u for u in manifest.units[stage.first : stage.last + 1]
                      if u.name in whole_units(index))
        paths, missing = await self._unit_paths(whole)
        mine = [u for u in offer.units if u.share == index]
        share_paths: dict[tuple[int, str], Path] = {}
        for unit in mine:
            files = tuple(UnitFile(f.name, f.sha256, f.bytes) for f in unit.files)
            share_paths[(unit.layer, unit.half)], lacking = await self._file_paths(files)
            missing += [(f"share {index} of layer {unit.layer}'s {unit.half}", f)
                        for f in lacking]
        if missing:
            await self._fetch(model_peer, missing)
        self._set(DeployState.LOADING, detail=f"loading share {index} of units {_range(stage)}")
        self.loaded = None
        units = _share_units(manifest, stage.weights, offer, index, share_paths)
        runner = await asyncio.to_thread(
            ShareRunner, _at_paths(manifest, paths), self.store.root, stage.first, stage.last,
            units, index, UNITS_ALONE, plan.key)
        self.loaded = LoadedStage(manifest, stage.first, stage.last, runner, stage.peers)
        log.info("plan %d: loaded share %d of units %s", plan.plan_id, index, _range(stage))
        self._set(DeployState.READY, detail=f"loaded share {index} of units {_range(stage)}")

    async def _share_offer(self, model_peer: str, request: SharesRequest) -> SharesOffer:
        """The model peer's share units for the stage, once exported (it exports them the
        first time it is asked; progress in the detail)."""
        if self._ask_shares is None:
            raise ValueError("this peer cannot ask for share units")
        while True:
            offer = await self._ask_shares(model_peer, request)
            if offer.state == ExportState.READY:
                return offer
            if offer.state == ExportState.FAILED:
                raise ValueError(f"the model peer cannot export share units: {offer.detail}")
            if self.progress.detail != (detail := f"model peer exporting: {offer.detail}"):
                self._set(DeployState.FETCHING, detail=detail)
            await asyncio.sleep(SHARES_POLL_S)

    def _exit(self, manifest: Manifest, stage: PlanStage) -> ExitPoint | None:
        """Where the first stage exits early, if asked to: after --exit-layer layers, or
        after its last whole layer where it holds fewer (a plan may give it fewer)."""
        if not self.exits.enabled or stage.first != 0:
            return None
        deepest = last_exit_layer(manifest, stage.last)
        layer = min(self.exits.layer or deepest, deepest)
        if layer == 0:
            log.warning("no early exit: units %s hold no whole decoder layer", _range(stage))
            return None
        if self.exits.layer is not None and layer < self.exits.layer:
            log.warning("early exit after layer %d: units %s end there", layer, _range(stage))
        return exit_point(manifest, layer)

    async def _hold_copies(self, model_peer: str, manifest: Manifest, stage: PlanStage) -> None:
        """Fetch and load the stage's movable copies, without a word to the leader: the
        stage serves meanwhile."""
        units = tuple(manifest.units[i] for i in stage.copies)
        paths, missing = await self._unit_paths(units)
        for _, file in missing:
            await fetch_file(self._ask(model_peer), self.store, file, self._chunk_bytes,
                             lambda _name, _have: None)
        at = _at_paths(manifest, paths)
        self.copies = await asyncio.to_thread(self._load_copies, at, stage.copies)
        if stage.copies:
            log.info("holding movable copies of units %s", ", ".join(map(str, stage.copies)))

    def _load_copies(self, manifest: Manifest, indices: tuple[int, ...]) -> dict[int, HeldUnit]:
        units = [manifest.units[i] for i in indices]
        return {u.index: HeldUnit(u, self.sessions.session(
                    manifest, u, self.store.root / u.model_file.name, UNITS_ALONE))
                for u in units}

    async def _warm_up(self, manifest: Manifest, executor: StageExecutor) -> None:
        """Time each unit on a warm-up step, the planner's first measured prices for them.
        Placeholder inputs may not suit every model; then the units are timed by the first
        answers instead, and the stage serves all the same."""
        try:
            timings = await asyncio.to_thread(executor.warm_up)
        except Exception as exc:  # ONNX Runtime's errors derive from Exception alone
            log.warning("no warm-up step for units %d-%d (%s); answers will time them",
                        executor.first, executor.last, exc)
            return
        self.unit_clock.record(manifest.key, timings)

    async def _unit_paths(
        self, units: tuple[Unit, ...]
    ) -> tuple[dict[int, Path], list[tuple[str, UnitFile]]]:
        """Where each unit's model file is or will be (its data file beside it), and the
        files this peer lacks (named for the log), to fetch into its store before loading."""
        paths: dict[int, Path] = {}
        missing: dict[str, tuple[str, UnitFile]] = {}
        for unit in units:
            paths[unit.index], lacking = await self._file_paths(unit.files)
            for file in lacking:
                missing[file.content_name] = (f"unit {unit.index} ({unit.name})", file)
        return paths, list(missing.values())

    async def _file_paths(self, files: tuple[UnitFile, ...]) -> tuple[Path, list[UnitFile]]:
        """Where a model file (the first of `files`) is or will be, and those of `files`
        this peer lacks: the model peer has them all where it wrote them."""
        local = self._local_files()
        if all(f.sha256 in local for f in files):
            return local[files[0].sha256], []
        lacking = [f for f in files
                   if not await asyncio.to_thread(self.store.verify, f.content_name)]
        return self.store.path(files[0].content_name), lacking

    async def _fetch(self, model_peer: str, missing: list[tuple[str, UnitFile]]) -> None:
        total = sum(file.bytes for _, file in missing)
        self._set(DeployState.FETCHING, total=total, detail=f"fetching {len(missing)} unit files")
        ask = self._ask(model_peer)
        for what, file in missing:
            await fetch_file(ask, self.store, file, self._chunk_bytes, self._fetched)
            log.info("received %s of %s (%d bytes); %d of %d bytes", file.content_name,
                     what, file.bytes, self.progress.received, total)

    def _fetched(self, name: str, have: int) -> None:
        self._have[name] = have
        self.progress.received = min(sum(self._have.values()), self.progress.total)
        if time.monotonic() - self._reported_at >= REPORT_INTERVAL_S:
            log.info("fetching unit files: %d of %d bytes", self.progress.received,
                     self.progress.total)
            self._send_report()

    # -- reports -------------------------------------------------------------------------------

    def _set(self, state: DeployState, total: int | None = None, detail: str = "") -> None:
        self.progress.state = state
        self.progress.detail = detail
        plan = self.assignment
        self.ready_plan = plan.key if state == DeployState.READY and plan is not None else None
        if total is not None:
            self.progress.total, self.progress.received = total, 0
        self._send_report()

    def _send_report(self) -> None:
        plan = self.assignment
        if plan is None:
            return
        self._reported_at = time.monotonic()
        p = self.progress
        self._report(DeployReport(plan.epoch, plan.plan_id, p.state, self.units, p.received,
                                  p.total, p.detail))

    def status(self) -> dict[str, Any]:
        plan = self.assignment
        return {
            "plan_id": plan.plan_id if plan else None,
            "epoch": plan.epoch if plan else None,
            "units": list(self.units),
            "copies": sorted(self.copies),
            **dataclasses.asdict(self.progress),
        }

    def plan_document(self) -> dict[str, Any] | None:
        """The current plan as `peerd status` shows it (DESIGN.md's contract); None until a
        plan arrives, and while no peer serves a model there is nothing to plan."""
        plan = self.assignment
        if plan is None or plan.model is None:
            return None
        predicted = dataclasses.asdict(plan.predicted) if plan.predicted else None
        return {
            "id": plan.plan_id,
            "epoch": plan.epoch,
            "stages": [
                {"peer": s.peer, "units": list(range(s.first, s.last + 1)),
                 "copies": list(s.copies),
                 "shares": [{"peer": share.peer, "weight": share.weight,
                             "fraction": share.weight / sum(s.weights)} for share in s.shares]}
                for s in plan.stages
            ],
            "objective": plan.objective,
            "solver": plan.solver,
            "predicted": predicted,
            "predicted_at_planning": predicted,
            "measured": None,
            "model": plan.model,
            "model_peer": plan.model_peer,
            "problem": plan.problem,
        }


def _order(plan: PlanAssignment) -> tuple[int, int]:
    return plan.epoch, plan.plan_id


def _range(stage: PlanStage | None) -> str:
    return "none" if stage is None else f"{stage.first}-{stage.last}"


def _manifest(plan: PlanAssignment) -> Manifest | None:
    if plan.manifest is None:
        return None
    try:
        manifest = Manifest.from_dict(plan.manifest)
    except ManifestError as exc:
        raise ValueError(f"the plan's manifest is unusable: {exc}") from None
    count = len(manifest.units)
    if plan.stages and plan.stages[-1].last != count - 1:
        raise ValueError(f"the plan covers units 0-{plan.stages[-1].last}, the model has {count}")
    return manifest


def _share_units(manifest: Manifest, weights: tuple[float, ...], offer: SharesOffer,
                 index: int, paths: Mapping[tuple[int, str], Path]) -> ShareUnits:
    """Share `index`'s units as its runner loads them: at `paths`, with the offer's norms."""
    model = manifest.model
    shares = split_layer(LayerShape(model.num_heads, model.num_kv_heads, model.head_dim,
                                    model.intermediate_size), weights)
    units = {(u.layer, u.half, u.share): ShareUnit(u.layer, u.half, u.share,
                                                   paths[(u.layer, u.half)], u.inputs, u.outputs)
             for u in offer.units if u.share == index}
    norms = {(u.layer, u.half): Norm(offer.tensors[f"norm.{u.layer}.{u.half}.weight"],
                                     offer.tensors.get(f"norm.{u.layer}.{u.half}.bias"),
                                     offer.eps)
             for u in offer.units if u.share == index}
    return ShareUnits(shares, weights, units, norms, offer.residual_post_norm)


def _at_paths(manifest: Manifest, paths: Mapping[int, Path]) -> Manifest:
    """The manifest with each unit's model file named by the absolute path it was found at
    (an absolute name overrides the executor's unit directory)."""
    units = tuple(_at_path(u, paths[u.index]) if u.index in paths else u for u in manifest.units)
    return dataclasses.replace(manifest, units=units)


def _at_path(unit: Unit, path: Path) -> Unit:
    model = dataclasses.replace(unit.model_file, name=str(path.resolve()))
    return dataclasses.replace(unit, files=(model, *unit.files[1:]))
