"""The stage executor: runs a contiguous range of units with ONNX Runtime, without torch.

One `StageExecutor` holds the ONNX Runtime sessions of units [first, last] and, per sequence,
the K/V state of those units. `step(seq_id, inputs)` runs one forward pass of one sequence
(a prefill of T tokens or a decode of one) and returns the tensors other stages (or the
sampler) consume; `step_many` runs the passes of several sequences, those with the same
number of new tokens as one batch: decoding is bound by reading the weights, and a batch
reads them once for all its sequences. State never leaves the executor except through
`export_state`, which rebalancing uses to move a unit together with its K/V.

A batch's K/V is each sequence's left-padded to the longest (shards/arch/common.py), and it
stays batched after the step: when the same sequences run together again, as they do step
after step while the same answers are in flight, their K/V goes in as it came out. Only
when the batch changes are its sequences' K/V taken apart (`_Batch.split`) and gathered
anew, once per change rather than twice per step.

Values that stay inside the stage (the hidden state between units, the K/V state between
steps) are kept as ONNX Runtime's native `OrtValue`s and passed to the next run as they are,
so they are never copied into numpy.

With `ExecutorOptions.join_bytes` the units run joined, a few sessions per stage rather than
one per unit (shards/joined.py): one session per block of the model's units, or per part of
a block the stage's range cuts. A session holds weights and nothing of any sequence, so
executors built with one `SessionShelf` run each session once between them: during a
rebalance the new plan's stage takes the sessions it shares with the old plan's stage (each
unit, or with `join_bytes` the blocks both hold whole and any unit the old one ran alone)
and loads the rest (`held_bytes` counts a shared session once).

Each step can report how long each unit took (`step(..., unit_s=)`; a joined run's time
shared among its units by their decode FLOPs), and `warm_up` times a one-token step on
placeholder inputs right after loading: the measured prices the planner puts on this peer's
units (docs/planner.md).
"""

from __future__ import annotations

import functools
import importlib
import os
import statistics
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort

from shards import heap
from shards.early_exit import EXIT_HIDDEN, ExitPoint
from shards.joined import (
    Join,
    JoinedUnit,
    blocks,
    joined_models,
    kept_outputs,
    segments,
)
from shards.manifest import Manifest, StateSpec, Unit

# ONNX Runtime's native module (what onnxruntime's Python classes wrap): untyped
native: Any = importlib.import_module("onnxruntime.capi._pybind_state")
NativeValue = Any  # a native.OrtValue
Value = np.ndarray | NativeValue
Outcome = dict[str, np.ndarray] | Exception  # a step's outputs, or why it failed
_CPU = native.OrtDevice(native.OrtDevice.cpu(), native.OrtDevice.default_memory(), 0)
_RUN_OPTIONS = native.RunOptions()
_SHRINK_ARENA = native.RunOptions()  # the run that ends a step on the process arena
_SHRINK_ARENA.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
WARM_UP_RUNS = 5


@dataclass(frozen=True)
class ExecutorOptions:
    """ONNX Runtime settings.

    threads=0 means one intra-op thread per core this process may run on, set explicitly:
    left to itself ONNX Runtime picks the same number but pins each pool thread to a core,
    and where other processes use the cores too, a pinned thread waits for its busy core
    instead of taking the free one (89 vs 59 ms per decoded token on a loaded 2-core
    machine). Each unit has its own session and thread pool, so spinning is off by default:
    pools of units that just ran would otherwise keep spinning on the cores the next unit
    needs (1.4 s instead of 55 ms per token there). A stage joined whole whose workers spin
    only until each run ends decoded 9% faster over three daemons on idle cores, but took
    twice as long beside a busy process (docs/architecture.md, "Measured and left as it is").
    `spinning` makes a session's own workers spin between operators until each run ends,
    never after it; nothing in peerd turns it on (bench/ring_ceiling.py and
    bench/spin_per_step.py measure it).

    memory_arena: every session built with it allocates from the process's one ONNX Runtime
    arena (`use_process_arena`), handed back at the end of each step (the last unit's run shrinks
    it). Without an arena, a long prompt's attention scores go to the system on every unit:
    glibc maps an allocation over 32 MB afresh each time and its pages fault in zeroed. A
    1024-token prompt on the 24-layer hidden-1024 model prefilled in 2.91 s without, 2.04 s
    with the arena (int4: 2.87 against 1.89 s), leaving 1847 against 1662 MB resident, at
    the same decode speed (bench/executor_memory.py). An arena of each session's own (ONNX
    Runtime's default) would keep every unit's peak at once and never hand it back: 3219 MB
    resident against 1800 MB without, after a 512-token prompt on the same model.
    prepacking stays on: ONNX Runtime releases a memory-mapped weight once it has re-laid it
    out, so float32 holds one copy either way (1314 MB resident with, 1315 without), while
    without it float32 decodes one token at x0.72-0.93 and four at once at x0.41-0.48
    (bench/spin_per_step.py), int8 at x0.58 and int4's MatMulNBits at under 1% of the speed.

    shared_pool runs every session of the process on one thread pool of `threads` threads
    whose workers spin between operators and between units (ONNX Runtime's global pool; its
    spinning cannot be turned off). Decoding the 24-layer hidden-1024 model on the 2-core
    development machine: 21.8 against 17.9 tokens/s for float32, 68.9 against 49.8 for int4
    when the process had the cores to itself, but 10.4 against 15.6 and 29 against 38 beside
    a busy process pinned to one core, whose core the spinning worker then fights for. So
    it is for a process that owns the machine's cores (`peerd generate`), not the default.
    The first executor built with it sizes the pool, and every later session of the process
    runs on it (`use_shared_pool`).

    join_bytes: units run joined into one session per block of at most this many bytes of
    weights (shards/joined.py; JOIN_BYTES, or JOIN_WHOLE for each stage as one session);
    0 runs each unit in a session of its own. A process that owns its cores gains by it
    (`peerd generate`, joined whole: a decode step of the 24-layer hidden-1024 model
    x0.89-0.93 against units alone on the shared pool; 30.1 against 29.0 tokens/s joined
    by 128 MiB blocks). Daemons join a stage whole when its weights fit twice in the
    memory available, else by blocks where two blocks more fit (peerd/control/deploy.py,
    `stage_options`): two three-daemon clusters side by side, one of them joining whole,
    6 rounds each way on 2026-11-29, one answer 20.0 against 18.4 and 19.2 against 18.0
    tokens/s, 4 in flight 64.5 against 61.0 and 63.1 against 59.5 (the same clusters both
    unchanged: 19.5 against 18.8, 61.7 against 60.3); joined by 128 MiB blocks instead,
    19.6 against 19.1 and 63.9 against 62.9. Of a stage joined whole the next plan's stage
    shares only what runs alone (the LM head, movable copies) and loads the rest again
    beside it.
    """

    threads: int = 0
    spinning: bool = False
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    memory_arena: bool = True
    prepacking: bool = True
    shared_pool: bool = False
    join_bytes: int = 0


class StageExecutor:
    def __init__(
        self,
        manifest: Manifest,
        unit_dir: Path,
        first: int,
        last: int,
        options: ExecutorOptions | None = None,
        shelf: SessionShelf | None = None,
        exit: ExitPoint | None = None,
    ) -> None:
        """Units [first, last] of `manifest`, their model files in `unit_dir` (a file
        named by an absolute path is found there). With `shelf`, a unit whose session
        another executor of the shelf holds is not loaded again. With `exit` (one of these
        units), every step also gives the hidden state the exit reads at its last position
        (`EXIT_HIDDEN`), for `exit_logits`: the head unit's file must be in `unit_dir`
        too."""
        if not 0 <= first <= last < len(manifest.units):
            raise ValueError(
                f"unit range [{first}, {last}] is not within 0..{len(manifest.units) - 1}"
            )
        if exit is not None and not first <= exit.unit <= last:
            raise ValueError(f"the exit after layer {exit.layer} is not on units {first}-{last}")
        self.manifest = manifest
        self.first, self.last = first, last
        self.units: tuple[Unit, ...] = manifest.units[first : last + 1]
        self.inputs = manifest.stage_inputs(first, last)
        self.outputs = manifest.stage_outputs(first, last)
        self._dtypes = {i.name: i.dtype for u in self.units for i in u.inputs}
        options = options or ExecutorOptions()
        shelf = shelf or SessionShelf()
        self._segments = _segments(manifest, Path(unit_dir), first, last, options, shelf, exit)
        self._step_end = _SHRINK_ARENA if options.memory_arena else _RUN_OPTIONS
        self.exit = exit
        self._exit_session = None if exit is None else shelf.session(
            manifest, manifest.units[exit.head],
            Path(unit_dir) / manifest.units[exit.head].model_file.name, options)
        self._exit_run = None if self._exit_session is None else _NativeRun(self._exit_session)
        self._state: dict[str, dict[str, NativeValue]] = {}  # sequences held on their own
        self._batches: dict[str, _Batch] = {}  # sequences held in the batch they last ran in
        self._lock = threading.Lock()

    # -- running ---------------------------------------------------------------------------
    def step(self, seq_id: str, inputs: dict[str, np.ndarray],
             unit_s: dict[int, float] | None = None,
             rows: int | None = None) -> dict[str, np.ndarray]:
        """One forward pass of `seq_id` over this stage's units.

        `inputs` holds every tensor in `self.inputs`; float16 arrays are accepted where the
        unit wants float32 (activations sent in half precision). Given `unit_s`, the seconds
        each unit took are written into it, by unit index. Given `rows`, the LM head
        (`Unit.sampled`) runs on the step's last `rows` positions only, the ones whose tokens
        are drawn, and the logits have `rows` rows: over a 512-token prompt the head on every
        row was a sixth of the prefill of a 12-layer hidden-1024 Llama with 32,000 tokens.
        """
        self._check_inputs(inputs)
        with self._lock:
            state = self._alone(seq_id)
        values: dict[str, Value] = {
            name: _as_dtype(inputs[name], self._dtypes[name]) for name in self.inputs
        }
        new_state = self._run_units(values, state, unit_s, rows)
        with self._lock:
            self._state[seq_id] = new_state
        return self._outputs(values)

    def step_many(self, steps: Sequence[tuple[str, dict[str, np.ndarray]]],
                  unit_s: dict[int, float] | None = None,
                  rows: Mapping[str, int] | None = None) -> list[Outcome]:
        """One forward pass of each (seq_id, inputs) in `steps`: the outputs in the same
        order, or in a failed step's place the exception it raised. Sequences whose inputs
        have the same shapes (the same number of new tokens) run as one batch; a batch that
        fails is run again one sequence at a time (its K/V was not touched), so that one bad
        step fails alone. Given `unit_s`, the seconds each unit took, all batches together,
        are written into it; given `rows`, a sequence's logits rows (`step`)."""
        results: list[Outcome] = [{} for _ in steps]
        batches: dict[tuple, list[int]] = {}
        seen: set[str] = set()
        for index, (seq_id, inputs) in enumerate(steps):
            try:
                if seq_id in seen:
                    raise ValueError(f"{seq_id} has a step earlier in this batch")
                seen.add(seq_id)
                key = (self._shapes(inputs), (rows or {}).get(seq_id))
                batches.setdefault(key, []).append(index)
            except ValueError as exc:
                results[index] = exc
        timings: dict[int, float] = {}
        for (_, logit_rows), indices in batches.items():
            batch = [steps[i] for i in indices]
            for index, outcome in zip(indices, self._outcomes(batch, timings, logit_rows),
                                      strict=True):
                results[index] = outcome
            if unit_s is not None:
                for unit, seconds in timings.items():
                    unit_s[unit] = unit_s.get(unit, 0.0) + seconds
        return results

    def _outcomes(self, steps: list[tuple[str, dict[str, np.ndarray]]],
                  unit_s: dict[int, float], rows: int | None) -> list[Outcome]:
        if len(steps) > 1:
            try:
                return list(self._step_batch(steps, unit_s, rows))
            except Exception:  # ONNX Runtime's errors derive from Exception alone
                pass
        outcomes: list[Outcome] = []
        for seq_id, inputs in steps:
            try:
                outcomes.append(self.step(seq_id, inputs, unit_s, rows))
            except Exception as exc:  # as above
                outcomes.append(exc)
        return outcomes

    def _shapes(self, inputs: dict[str, np.ndarray]) -> tuple:
        """What decides which steps can share a batch: each input's shape past the batch
        axis."""
        self._check_inputs(inputs)
        return tuple(np.shape(inputs[name])[1:] for name in self.inputs)

    def _step_batch(self, steps: list[tuple[str, dict[str, np.ndarray]]],
                    unit_s: dict[int, float], rows: int | None) -> list[dict[str, np.ndarray]]:
        seq_ids = tuple(seq_id for seq_id, _ in steps)
        with self._lock:
            state, pads = self._batched_state(seq_ids)
        values: dict[str, Value] = {
            name: np.concatenate([_as_dtype(inputs[name], self._dtypes[name])
                                  for _, inputs in steps])
            for name in self.inputs
        }
        new_state = self._run_units(values, state, unit_s, rows)
        with self._lock:
            batch = _Batch(seq_ids, pads, new_state, self._state_specs())
            for seq_id in seq_ids:
                self._state.pop(seq_id, None)
                self._batches[seq_id] = batch
        outputs = self._outputs(values)
        return [{name: out[b : b + 1] for name, out in outputs.items()}
                for b in range(len(steps))]

    def _outputs(self, values: dict[str, Value]) -> dict[str, np.ndarray]:
        outputs = {name: _numpy(values[name]) for name in self.outputs}
        if self.exit is not None:
            outputs[EXIT_HIDDEN] = np.array(_numpy(values[self.exit.hidden])[:, -1:])
        return outputs

    def exit_logits(self, hidden: np.ndarray) -> np.ndarray:
        """The exit's logits [B, 1, vocab] of a step's `EXIT_HIDDEN`: the head unit's final
        norm and LM head on the hidden state after the exit's layer."""
        if self.exit is None or self._exit_run is None:
            raise ValueError(f"units {self.first}-{self.last} have no exit")
        produced = self._exit_run({self.exit.head_input: _native(np.ascontiguousarray(hidden))})
        return _numpy(next(iter(produced.values())))

    def _batched_state(self, seq_ids: tuple[str, ...]) -> tuple[dict[str, Value], list[int]]:
        """The K/V of `seq_ids` as one batch, and each one's padding: as the last step left
        it when it ran the same sequences, else gathered from each sequence's own."""
        held = {id(self._batches.get(seq_id)) for seq_id in seq_ids}
        batch = self._batches.get(seq_ids[0])
        if len(held) == 1 and batch is not None and batch.seq_ids == seq_ids:
            return batch.state, list(batch.pads)
        states = [self._alone(seq_id) for seq_id in seq_ids]
        specs = self._state_specs()
        if not specs:
            return {}, [0] * len(seq_ids)
        lengths = [_length(state[specs[0].input], specs[0].seq_axis) for state in states]
        longest = max(lengths)
        gathered = {spec.input: _left_padded([state[spec.input] for state in states], spec,
                                             longest)
                    for spec in specs}
        return gathered, [longest - length for length in lengths]

    def _alone(self, seq_id: str) -> dict[str, NativeValue]:
        """The sequence's K/V held on its own (taking its batch apart first); call with the
        lock held."""
        batch = self._batches.get(seq_id)
        if batch is not None:
            for member, state in batch.split(self._batches):
                del self._batches[member]
                self._state[member] = state
        return self._state.get(seq_id) or self._empty_state()

    def _check_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        missing = [name for name in self.inputs if name not in inputs]
        if missing:
            raise ValueError(f"stage {self.first}-{self.last}: missing inputs {missing}")

    def _run_units(self, values: dict[str, Value], state: dict[str, Value],
                   unit_s: dict[int, float] | None, rows: int | None = None
                   ) -> dict[str, NativeValue]:
        new_state: dict[str, NativeValue] = {}
        last = self._segments[-1]
        for segment in self._segments:
            started = time.perf_counter()
            segment.run(values, state, new_state, rows if segment.sampled else None,
                        self._step_end if segment is last else _RUN_OPTIONS)
            if unit_s is not None:
                segment.share_time(time.perf_counter() - started, unit_s)
        return new_state

    def warm_up(self, runs: int = WARM_UP_RUNS) -> dict[int, float]:
        """Run a one-token step `runs` times on placeholder inputs (zeros, every free
        dimension 1) and return each unit's median seconds: what a decode step at the start
        of a sequence costs, known before any answer runs. The first run also takes ONNX
        Runtime's one-time costs off the first real answer."""
        inputs = self._placeholder_inputs()
        samples: dict[int, list[float]] = {unit.index: [] for unit in self.units}
        for _ in range(runs):
            seq_id = f"warm-up-{uuid.uuid4().hex}"
            timings: dict[int, float] = {}
            try:
                self.step(seq_id, inputs, timings)
            finally:
                self.drop(seq_id)
            for index, seconds in timings.items():
                samples[index].append(seconds)
        return {index: statistics.median(times) for index, times in samples.items()}

    def _placeholder_inputs(self) -> dict[str, np.ndarray]:
        wanted: dict[str, ort.NodeArg] = {}
        for session in self.sessions:
            for arg in session.get_inputs():
                wanted.setdefault(arg.name, arg)
        return {name: np.zeros([d if isinstance(d, int) else 1 for d in wanted[name].shape],
                               _ORT_TYPES[wanted[name].type])
                for name in self.inputs}

    def drop(self, seq_id: str) -> None:
        """Forget a sequence and free its K/V (unknown ids are ignored). A batch's K/V is
        freed once none of its sequences is held in it any more."""
        with self._lock:
            self._state.pop(seq_id, None)
            self._batches.pop(seq_id, None)

    # -- accounting ------------------------------------------------------------------------
    @property
    def sequence_count(self) -> int:
        return len(self._state) + len(self._batches)

    @property
    def weight_bytes(self) -> int:
        """Bytes of its units' weights (the manifest's count)."""
        return sum(unit.weight_bytes for unit in self.units)

    def kv_bytes(self) -> int:
        """Bytes of K/V held for all sequences."""
        with self._lock:
            batches = {id(batch): batch for batch in self._batches.values()}.values()
            held = [*self._state.values(), *(batch.state for batch in batches)]
            return sum(_nbytes(v) for state in held for v in state.values())

    @property
    def sessions(self) -> tuple[ort.InferenceSession, ...]:
        """The ONNX Runtime sessions that run its units, in order."""
        return tuple(segment.session for segment in self._segments)

    def session(self, unit_index: int) -> ort.InferenceSession:
        """The ONNX Runtime session that runs one of its units (and the others joined
        with it)."""
        self._unit(unit_index)
        return next(s.session for s in self._segments if s.first <= unit_index <= s.last)

    # -- moving state ----------------------------------------------------------------------
    def export_state(self, seq_id: str, unit_index: int) -> dict[str, np.ndarray]:
        """Copies of the K/V one unit holds for `seq_id`, keyed by state input name."""
        unit = self._unit(unit_index)
        with self._lock:
            if seq_id not in self._state and seq_id not in self._batches:
                raise KeyError(f"unknown sequence {seq_id!r}")
            state = self._alone(seq_id)
        return {spec.input: np.array(_numpy(state[spec.input])) for spec in unit.state}

    def import_state(self, seq_id: str, unit_index: int, tensors: dict[str, np.ndarray]) -> None:
        """Install one unit's K/V for `seq_id` (as produced by `export_state` elsewhere)."""
        unit = self._unit(unit_index)
        for spec in unit.state:
            _check_state(spec, tensors.get(spec.input))
        with self._lock:
            state = self._state[seq_id] = self._alone(seq_id)
            for spec in unit.state:
                state[spec.input] = _owned(tensors[spec.input], spec.dtype)

    def fork(self, source: str, seq_id: str, length: int) -> None:
        """Start `seq_id` from the first `length` positions of `source`'s K/V (a new turn of
        a conversation whose earlier turn ran as `source`). All of it is shared rather than
        copied: a step never writes into its K/V inputs."""
        with self._lock:
            if source not in self._state and source not in self._batches:
                raise KeyError(f"unknown sequence {source!r}")
            kept = self._alone(source)
            specs = self._state_specs()
            held = _length(kept[specs[0].input], specs[0].seq_axis) if specs else length
            if not 0 < length <= held:
                raise ValueError(f"{source} holds {held} positions, not {length}")
            self._batches.pop(seq_id, None)
            self._state[seq_id] = {
                spec.input: kept[spec.input] if length == held else
                _owned(_unpadded(_numpy(kept[spec.input]), 0, 0, spec.seq_axis, length),
                       spec.dtype)
                for spec in specs}

    def truncate(self, seq_id: str, length: int) -> None:
        """Keep only the first `length` positions of the sequence's K/V (the positions
        of drafted tokens the full model rejected): a fork of the sequence onto itself."""
        self.fork(seq_id, seq_id, length)

    @property
    def holds_state(self) -> bool:
        """Whether its units keep K/V between steps."""
        return bool(self._state_specs())

    def length(self, seq_id: str) -> int:
        """Positions of K/V held for `seq_id` (0 for a sequence it does not hold)."""
        specs = self._state_specs()
        with self._lock:
            if not specs or (seq_id not in self._state and seq_id not in self._batches):
                return 0
            batch = self._batches.get(seq_id)
            if batch is not None:
                row = batch.seq_ids.index(seq_id)
                return _length(batch.state[specs[0].input], specs[0].seq_axis) - batch.pads[row]
            return _length(self._state[seq_id][specs[0].input], specs[0].seq_axis)

    # -- helpers ---------------------------------------------------------------------------
    def _unit(self, unit_index: int) -> Unit:
        if not self.first <= unit_index <= self.last:
            raise KeyError(f"unit {unit_index} is not on this stage ({self.first}-{self.last})")
        return self.manifest.units[unit_index]

    def _state_specs(self) -> list[StateSpec]:
        return [spec for unit in self.units for spec in unit.state]

    def _empty_state(self) -> dict[str, NativeValue]:
        return {
            spec.input: _owned(np.zeros(spec.shape, spec.dtype), spec.dtype)
            for spec in self._state_specs()
        }


def _session(model: Path | bytes, options: ExecutorOptions,
             data_folder: Path | None = None) -> ort.InferenceSession:
    """A session of the model file at `model`, or of the serialised model `model` whose
    weights are in files in `data_folder`."""
    if options.shared_pool:
        use_shared_pool(options.threads or usable_cores())
    so = session_options(options.threads, options.spinning)
    if options.memory_arena:
        use_process_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.disable_prepacking", str(int(not options.prepacking)))
    so.enable_cpu_mem_arena = options.memory_arena
    so.log_severity_level = 3
    if data_folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                    str(data_folder))
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, so, providers=list(options.providers))


_SAME_AS_REQUESTED = 1  # ONNX Runtime's ArenaExtendStrategy::kSameAsRequested
_process_arena = False
_process_arena_lock = threading.Lock()


def use_process_arena() -> None:
    """Register the process's one CPU arena (ExecutorOptions.memory_arena), for sessions
    built with `session.use_env_allocators`. It grows by what is asked, no more (ONNX
    Runtime's default doubles)."""
    global _process_arena
    with _process_arena_lock:
        if not _process_arena:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                     ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, _SAME_AS_REQUESTED, -1, -1))
            _process_arena = True


_shared_pool_threads: int | None = None
_shared_pool_lock = threading.Lock()


def use_shared_pool(threads: int) -> None:
    """Run every later session of this process on ONNX Runtime's global thread pool of
    `threads` threads (ExecutorOptions.shared_pool). The first call sizes it; there is no
    way back: ONNX Runtime then refuses to build a session with a pool of its own."""
    global _shared_pool_threads
    with _shared_pool_lock:
        if _shared_pool_threads is None:
            native.set_global_thread_pool_sizes(threads, 1)
            _shared_pool_threads = threads


def session_options(threads: int = 0, spinning: bool = False) -> ort.SessionOptions:
    """Session options with this process's threading, for every session peerd builds: the
    shared pool once the process has one, else a pool of the session's own with `threads`
    threads (0: one per usable core), its workers spinning between operators until each run
    ends, or not."""
    so = ort.SessionOptions()
    if _shared_pool_threads is not None:
        so.use_per_session_threads = False
        return so
    so.intra_op_num_threads = threads or usable_cores()
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", str(int(spinning)))
    # workers that spin on after a run take the cores the next stage (or process) needs
    so.add_session_config_entry("session.force_spinning_stop", str(int(spinning)))
    return so


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class SessionShelf:
    """The sessions of the executors built with it, one per unit or per run of units joined,
    shared among them.

    A session is shared for the same manifest (a model at one quantisation), units, model
    files, options and joined outputs. The shelf holds sessions weakly: a session lives as
    long as some executor runs it, and units no executor runs any more are freed with the
    last one.
    """

    def __init__(self) -> None:
        self._held: weakref.WeakValueDictionary[tuple, ort.InferenceSession] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()

    def session(self, manifest: Manifest, unit: Unit, path: Path,
                options: ExecutorOptions) -> ort.InferenceSession:
        """The session an executor holds for `unit` alone, else a new one of the file at
        `path`."""
        return self.sessions(manifest, [_Wanted((unit,), (path,), frozenset())], options)[0]

    def sessions(self, manifest: Manifest, wanted: Sequence[_Wanted],
                 options: ExecutorOptions) -> list[ort.InferenceSession]:
        """Each wanted session: the one an executor holds, else a new one; units joined
        (shards/joined.py) are joined in one go."""
        with self._lock:
            keys = [_shelf_key(manifest, w.units, options, w.keep) for w in wanted]
            found = {i: session for i, key in enumerate(keys)
                     if (session := self._held.get(key)) is not None}
            missing = [i for i in range(len(wanted)) if i not in found]
            joins = [Join(tuple(JoinedUnit.of(*pair) for pair in zip(w.units, w.paths,
                                                                     strict=True)), w.keep)
                     for w in (wanted[i] for i in missing) if len(w.units) > 1]
            models = iter(joined_models(joins))
            for i in missing:
                units, paths = wanted[i].units, wanted[i].paths
                session = (_session(paths[0], options) if len(units) == 1 else
                           _session(next(models), options, data_folder=paths[0].parent))
                # ONNX Runtime keeps a unit's data file mapped once it has copied the
                # weights into layouts of its own (int4: the scales MatMulNBits also packed;
                # the embedding's table, of which a token reads a row), and the pages read
                # while loading stay resident: 35 of the 283 MB the 24-layer int4 model took
                heap.page_out(path.parent / f.content_name
                              for unit, path in zip(units, paths, strict=True)
                              for f in unit.files[1:])
                self._held[keys[i]] = found[i] = session
            return [found[i] for i in range(len(wanted))]

    def holds_alone(self, manifest: Manifest, unit: Unit, options: ExecutorOptions) -> bool:
        """Whether some executor, or a held copy, runs `unit` in a session of its own."""
        with self._lock:
            return _shelf_key(manifest, (unit,), options, frozenset()) in self._held


def _shelf_key(manifest: Manifest, units: tuple[Unit, ...], options: ExecutorOptions,
               keep: frozenset[str]) -> tuple:
    """What makes two sessions the same; not `join_bytes`, which only groups units: a unit
    run alone is the same session whatever its stage's join."""
    return (manifest.key, tuple(u.index for u in units),
            tuple(u.model_file.sha256 for u in units), replace(options, join_bytes=0),
            keep if len(units) > 1 else frozenset())


class _Wanted(NamedTuple):
    """A session to hold: of `units` (joined, keeping the `keep` outputs, where several) from
    their model files at `paths`."""

    units: tuple[Unit, ...]
    paths: tuple[Path, ...]
    keep: frozenset[str]


class _Segment:
    """Consecutive units of a stage, run as one session."""

    def __init__(self, units: Sequence[Unit], session: ort.InferenceSession) -> None:
        first, last = units[0].index, units[-1].index
        self.units, self.first, self.last = units, first, last
        self.session = session
        self.sampled = any(unit.sampled for unit in self.units)
        self._run = _NativeRun(session)
        self._inputs = tuple(dict.fromkeys(
            inp.name for unit in self.units for inp in unit.inputs
            if not first <= inp.producer <= last))
        self._state = tuple(spec for unit in self.units for spec in unit.state)
        # a joined run's time goes to its units by their FLOPs (at least 1, so that each
        # unit's time stays positive): the planner prices units, not runs
        flops = [max(unit.flops_per_token.decode, 1.0) for unit in self.units]
        total = sum(flops)
        self._shares = [(unit.index, f / total) for unit, f in zip(self.units, flops,
                                                                   strict=True)]

    def run(self, values: dict[str, Value], state: dict[str, Value],
            new_state: dict[str, NativeValue], rows: int | None, run_options: Any) -> None:
        """Run on `values` (on the inputs' last `rows` positions, if given), adding the
        outputs to them and the new K/V to `new_state`."""
        given = {name: values[name] for name in self._inputs}
        if rows is not None:  # arrays of their own, alive until the run (_native wraps them)
            given = {name: last_rows(_numpy(value), rows) for name, value in given.items()}
        feeds = {name: _native(value) for name, value in given.items()}
        feeds.update((spec.input, _native(state[spec.input])) for spec in self._state)
        produced = self._run(feeds, run_options)
        for spec in self._state:
            new_state[spec.input] = produced.pop(spec.output)
        values.update(produced)

    def share_time(self, seconds: float, unit_s: dict[int, float]) -> None:
        """Write each unit's share of the run's `seconds` into `unit_s`."""
        for index, share in self._shares:
            unit_s[index] = seconds * share


def _segments(manifest: Manifest, unit_dir: Path, first: int, last: int,
              options: ExecutorOptions, shelf: SessionShelf,
              exit: ExitPoint | None) -> list[_Segment]:
    """Units [first, last] as the sessions that run them: joined by block, kept apart where
    their files lie in different folders or where the shelf already runs a unit alone (a
    movable copy, or a unit an earlier stage ran alone: not loaded again)."""
    paths = {u.index: unit_dir / u.model_file.name for u in manifest.units[first : last + 1]}

    @functools.cache
    def alone(unit: int) -> bool:
        return shelf.holds_alone(manifest, manifest.units[unit], options)

    def apart(unit: int, following: int) -> bool:
        return paths[unit].parent != paths[following].parent or alone(unit) or alone(following)

    wanted = []
    for start, end in segments(blocks(manifest, options.join_bytes), first, last, apart):
        keep = kept_outputs(manifest, start, end)
        if exit is not None and start <= exit.unit <= end:
            keep |= {exit.hidden}
        units = manifest.units[start : end + 1]
        wanted.append(_Wanted(units, tuple(paths[u.index] for u in units), keep))
    sessions = shelf.sessions(manifest, wanted, options)
    return [_Segment(w.units, session) for w, session in zip(wanted, sessions, strict=True)]


@dataclass
class _Batch:
    """The K/V of sequences that last ran as one batch: [B, ..., P, ...] per state input,
    sequence b's own positions after pads[b] of padding."""

    seq_ids: tuple[str, ...]
    pads: list[int]
    state: dict[str, NativeValue]
    specs: list[StateSpec]

    def split(self, held: dict[str, _Batch]) -> list[tuple[str, dict[str, NativeValue]]]:
        """Each sequence still `held` in this batch, with its K/V on its own."""
        members = [(b, seq_id) for b, seq_id in enumerate(self.seq_ids) if held.get(seq_id) is self]
        arrays = {spec.input: _numpy(self.state[spec.input]) for spec in self.specs}
        return [(seq_id, {spec.input: _owned(_unpadded(arrays[spec.input], b, self.pads[b],
                                                       spec.seq_axis), spec.dtype)
                          for spec in self.specs})
                for b, seq_id in members]


def _unpadded(batched: np.ndarray, row: int, pad: int, seq_axis: int,
              length: int | None = None) -> np.ndarray:
    """Row `row`'s positions after `pad` (the first `length` of them, if given)."""
    index: list[slice] = [slice(None)] * batched.ndim
    end = None if length is None else pad + length
    index[0], index[seq_axis] = slice(row, row + 1), slice(pad, end)
    return batched[tuple(index)]


def _left_padded(states: list[Value], spec: StateSpec, longest: int) -> np.ndarray:
    """One batch of the sequences' K/V, each left-padded with zeros to `longest`."""
    shape = list(spec.shape)
    shape[0], shape[spec.seq_axis] = len(states), longest
    batch = np.zeros(shape, spec.dtype)
    for row, state in enumerate(states):
        own = _numpy(state)
        index: list[slice | int] = [slice(None)] * len(shape)
        index[0] = row
        index[spec.seq_axis] = slice(longest - own.shape[spec.seq_axis], longest)
        batch[tuple(index)] = own[0]
    return batch


def _length(value: Value, axis: int) -> int:
    return int(value.shape[axis]) if isinstance(value, np.ndarray) else int(value.shape()[axis])


class HeldUnit(NamedTuple):
    """A unit's session held outside any executor (a movable copy)."""

    unit: Unit
    session: ort.InferenceSession


def held_bytes(executors: Iterable[StageExecutor], held: Iterable[HeldUnit] = ()) -> int:
    """Bytes the weights and K/V of `executors`, and the weights of the `held` units,
    occupy: a unit session that several of them run is counted once (the manifest's count
    of its weights)."""
    weights: dict[int, int] = {id(h.session): h.unit.weight_bytes for h in held}
    kv: dict[int, int] = {}
    for executor in executors:
        for segment in executor._segments:
            weights[id(segment.session)] = sum(unit.weight_bytes for unit in segment.units)
        if executor.exit is not None:
            weights[id(executor._exit_session)] = executor.manifest.units[
                executor.exit.head].weight_bytes
        kv[id(executor)] = executor.kv_bytes()
    return sum(weights.values()) + sum(kv.values())


class _NativeRun:
    """A session's run on native OrtValues, through ONNX Runtime's native session: the
    public `run_with_ort_values` validates and wraps every value, and an IOBinding is built
    and bound per run; with three inputs and three outputs a run cost 60 us that way and 30 us
    with IOBinding against 7 us here (the 2-core development machine): 50 units a token made
    that 1.2 ms of int4's 16 ms per decoded token."""

    def __init__(self, session: ort.InferenceSession) -> None:
        native_session: Any = session._sess
        self._run = native_session.run_with_ort_values
        self._names = [o.name for o in session.get_outputs()]

    def __call__(self, feeds: dict[str, NativeValue],
                 run_options: Any = _RUN_OPTIONS) -> dict[str, NativeValue]:
        produced = self._run(feeds, self._names, run_options)
        # by index: iterating the native vector took 70-90 us, indexing it 3
        return {name: produced[i] for i, name in enumerate(self._names)}


def _native(value: Value) -> NativeValue:
    """A value to run on; an array is wrapped, not copied (it outlives the step)."""
    if isinstance(value, np.ndarray):
        return native.OrtValue.ortvalue_from_numpy(value, _CPU)
    return value


def _owned(array: np.ndarray, dtype: str) -> NativeValue:
    """A copy of `array` in memory of its own, to keep as state."""
    array = np.ascontiguousarray(array, dtype=dtype)
    value = native.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype, _CPU)
    value.update_inplace(array)
    return value


def last_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """The last `rows` positions of [batch, positions, width] activations."""
    return np.ascontiguousarray(array[:, array.shape[1] - rows :])


def _as_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype != dtype:
        array = array.astype(dtype)
    return np.ascontiguousarray(array)


def _numpy(value: Value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()


def _nbytes(value: NativeValue) -> int:
    itemsize = np.dtype(_ORT_TYPES[value.data_type()]).itemsize
    return int(np.prod(value.shape(), dtype=np.int64)) * itemsize


def _check_state(spec: StateSpec, array: np.ndarray | None) -> None:
    if array is None:
        raise ValueError(f"state {spec.input!r} is missing")
    expected = [d for axis, d in enumerate(spec.shape) if axis != spec.seq_axis]
    got = [d for axis, d in enumerate(array.shape) if axis != spec.seq_axis]
    if array.ndim != len(spec.shape) or got != expected:
        raise ValueError(f"state {spec.input!r}: shape {list(array.shape)} does not fit")


_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}
