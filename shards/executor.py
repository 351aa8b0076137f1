"""The stage executor: runs a contiguous range of units with ONNX Runtime, without torch.

One `StageExecutor` holds the ONNX Runtime sessions of units [first, last] and, per sequence,
the K/V state of those units. `step(seq_id, inputs)` runs one forward pass of one sequence
(a prefill of T tokens or a decode of one) and returns the tensors other stages (or the
sampler) consume. State never leaves the executor except through `export_state`, which
rebalancing uses to move a unit together with its K/V.

Values that stay inside the stage (the hidden state between units, the K/V state between
steps) are kept as ONNX Runtime's native `OrtValue`s and passed to the next run as they are,
so they are never copied into numpy.

A unit's session holds its weights and nothing of any sequence, so executors built with one
`SessionShelf` run one session per unit between them: during a rebalance the new plan's
stage takes the sessions of the units it keeps from the old plan's stage and loads only the
units it gains (`held_bytes` counts a shared session once).

Each step can report how long each unit took (`step(..., unit_s=)`), and `warm_up` times a
one-token step on placeholder inputs right after loading: the measured prices the planner
puts on this peer's units (docs/planner.md).
"""

from __future__ import annotations

import importlib
import os
import statistics
import threading
import time
import uuid
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort

from shards import heap
from shards.manifest import Manifest, StateSpec, Unit

# ONNX Runtime's native module (what onnxruntime's Python classes wrap): untyped
native: Any = importlib.import_module("onnxruntime.capi._pybind_state")
NativeValue = Any  # a native.OrtValue
Value = np.ndarray | NativeValue
_CPU = native.OrtDevice(native.OrtDevice.cpu(), native.OrtDevice.default_memory(), 0)
_RUN_OPTIONS = native.RunOptions()
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
    needs (1.4 s instead of 55 ms per token there).

    memory_arena is off by default: each session (one per unit) would keep its own arena at
    the peak its unit ever needed, never handed back, so one long prompt leaves every unit's
    peak resident at once. All 50 units of the 24-layer hidden-1024 model in one executor,
    after a 512-token prompt: 3219 MB resident with arenas against 1800 MB without for
    float32 (1345 MB of weights), 2212 against 877 MB for int4 (210 MB); after 1024 tokens,
    int4: 10.8 GB against 1.3 GB. Decode speed with arenas was x0.86 to x1.08 of without,
    within the noise of the loaded machine (bench/executor_memory.py).
    prepacking stays on: ONNX Runtime releases a memory-mapped weight once it has re-laid it
    out, so float32 holds one copy either way (1314 MB resident with, 1315 without), while
    without it int8 decodes at x0.58 and int4's MatMulNBits at under 1% of the speed.

    shared_pool runs every session of the process on one thread pool of `threads` threads
    whose workers spin between operators and between units (ONNX Runtime's global pool; its
    spinning cannot be turned off). Decoding the 24-layer hidden-1024 model on the 2-core
    development machine: 21.8 against 17.9 tokens/s for float32, 68.9 against 49.8 for int4
    when the process had the cores to itself, but 10.4 against 15.6 and 29 against 38 beside
    a busy process pinned to one core, whose core the spinning worker then fights for. So
    it is for a process that owns the machine's cores (`peerd generate`), not the default.
    The first executor built with it sizes the pool, and every later session of the process
    runs on it (`use_shared_pool`).
    """

    threads: int = 0
    spinning: bool = False
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    memory_arena: bool = False
    prepacking: bool = True
    shared_pool: bool = False


class StageExecutor:
    def __init__(
        self,
        manifest: Manifest,
        unit_dir: Path,
        first: int,
        last: int,
        options: ExecutorOptions | None = None,
        shelf: SessionShelf | None = None,
    ) -> None:
        """Units [first, last] of `manifest`, their model files in `unit_dir` (a file
        named by an absolute path is found there). With `shelf`, a unit whose session
        another executor of the shelf holds is not loaded again."""
        if not 0 <= first <= last < len(manifest.units):
            raise ValueError(
                f"unit range [{first}, {last}] is not within 0..{len(manifest.units) - 1}"
            )
        self.manifest = manifest
        self.first, self.last = first, last
        self.units: tuple[Unit, ...] = manifest.units[first : last + 1]
        self.inputs = manifest.stage_inputs(first, last)
        self.outputs = manifest.stage_outputs(first, last)
        self._dtypes = {i.name: i.dtype for u in self.units for i in u.inputs}
        options = options or ExecutorOptions()
        shelf = shelf or SessionShelf()
        self._sessions = [
            shelf.session(manifest, u, Path(unit_dir) / u.model_file.name, options)
            for u in self.units
        ]
        self._runs = [_NativeRun(session) for session in self._sessions]
        self._state: dict[str, dict[str, NativeValue]] = {}
        self._lock = threading.Lock()

    # -- running ---------------------------------------------------------------------------
    def step(self, seq_id: str, inputs: dict[str, np.ndarray],
             unit_s: dict[int, float] | None = None) -> dict[str, np.ndarray]:
        """One forward pass of `seq_id` over this stage's units.

        `inputs` holds every tensor in `self.inputs`; float16 arrays are accepted where the
        unit wants float32 (activations sent in half precision). Given `unit_s`, the seconds
        each unit took are written into it, by unit index.
        """
        missing = [name for name in self.inputs if name not in inputs]
        if missing:
            raise ValueError(f"stage {self.first}-{self.last}: missing inputs {missing}")
        with self._lock:
            state = self._state.get(seq_id) or self._empty_state()
        values: dict[str, Value] = {
            name: _as_dtype(inputs[name], self._dtypes[name]) for name in self.inputs
        }
        new_state: dict[str, NativeValue] = {}
        for unit, run in zip(self.units, self._runs, strict=True):
            started = time.perf_counter()
            self._run_unit(unit, run, values, state, new_state)
            if unit_s is not None:
                unit_s[unit.index] = time.perf_counter() - started
        with self._lock:
            self._state[seq_id] = new_state
        return {name: _numpy(values[name]) for name in self.outputs}

    def _run_unit(
        self,
        unit: Unit,
        run: _NativeRun,
        values: dict[str, Value],
        state: dict[str, NativeValue],
        new_state: dict[str, NativeValue],
    ) -> None:
        feeds = {inp.name: _native(values[inp.name]) for inp in unit.inputs}
        feeds.update((spec.input, state[spec.input]) for spec in unit.state)
        produced = run(feeds)
        for spec in unit.state:
            new_state[spec.input] = produced.pop(spec.output)
        values.update(produced)

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
        for session in self._sessions:
            for arg in session.get_inputs():
                wanted.setdefault(arg.name, arg)
        return {name: np.zeros([d if isinstance(d, int) else 1 for d in wanted[name].shape],
                               _ORT_TYPES[wanted[name].type])
                for name in self.inputs}

    def drop(self, seq_id: str) -> None:
        """Forget a sequence and free its K/V (unknown ids are ignored)."""
        with self._lock:
            self._state.pop(seq_id, None)

    # -- accounting ------------------------------------------------------------------------
    @property
    def sequence_count(self) -> int:
        return len(self._state)

    @property
    def weight_bytes(self) -> int:
        """Bytes of its units' weights (the manifest's count)."""
        return sum(unit.weight_bytes for unit in self.units)

    def kv_bytes(self) -> int:
        """Bytes of K/V held for all sequences."""
        with self._lock:
            return sum(_nbytes(v) for seq in self._state.values() for v in seq.values())

    def session(self, unit_index: int) -> ort.InferenceSession:
        """The ONNX Runtime session that runs one of its units."""
        return self._sessions[self._unit(unit_index).index - self.first]

    # -- moving state ----------------------------------------------------------------------
    def export_state(self, seq_id: str, unit_index: int) -> dict[str, np.ndarray]:
        """Copies of the K/V one unit holds for `seq_id`, keyed by state input name."""
        unit = self._unit(unit_index)
        with self._lock:
            state = self._state.get(seq_id)
        if state is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return {spec.input: state[spec.input].numpy() for spec in unit.state}

    def import_state(self, seq_id: str, unit_index: int, tensors: dict[str, np.ndarray]) -> None:
        """Install one unit's K/V for `seq_id` (as produced by `export_state` elsewhere)."""
        unit = self._unit(unit_index)
        for spec in unit.state:
            _check_state(spec, tensors.get(spec.input))
        with self._lock:
            state = self._state.setdefault(seq_id, self._empty_state())
            for spec in unit.state:
                state[spec.input] = _owned(tensors[spec.input], spec.dtype)

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


def _session(path: Path, options: ExecutorOptions) -> ort.InferenceSession:
    if options.shared_pool:
        use_shared_pool(options.threads or usable_cores())
    so = session_options(options.threads, options.spinning)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.disable_prepacking", str(int(not options.prepacking)))
    so.enable_cpu_mem_arena = options.memory_arena
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=list(options.providers))


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
    threads (0: one per usable core), spinning or not."""
    so = ort.SessionOptions()
    if _shared_pool_threads is not None:
        so.use_per_session_threads = False
        return so
    so.intra_op_num_threads = threads or usable_cores()
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", str(int(spinning)))
    return so


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class SessionShelf:
    """The unit sessions of the executors built with it, one per unit, shared among them.

    A session is shared for the same manifest (a model at one quantisation), unit, model
    file and options. The shelf holds sessions weakly: a session lives as long as some
    executor runs it, and a unit no executor runs any more is freed with its last one.
    """

    def __init__(self) -> None:
        self._held: weakref.WeakValueDictionary[tuple, ort.InferenceSession] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()

    def session(self, manifest: Manifest, unit: Unit, path: Path,
                options: ExecutorOptions) -> ort.InferenceSession:
        """The session an executor holds for `unit`, else a new one of the file at `path`."""
        key = (manifest.key, unit.index, unit.model_file.sha256, options)
        with self._lock:
            session = self._held.get(key)
            if session is None:
                session = _session(path, options)
                # ONNX Runtime keeps the unit's data file mapped once it has copied the
                # weights into layouts of its own (int4: the scales MatMulNBits also packed;
                # the embedding's table, of which a token reads a row), and the pages read
                # while loading stay resident: 35 of the 283 MB the 24-layer int4 model took
                heap.page_out(path.parent / f.content_name for f in unit.files[1:])
                self._held[key] = session
            return session


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
        for unit, session in zip(executor.units, executor._sessions, strict=True):
            weights[id(session)] = unit.weight_bytes
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

    def __call__(self, feeds: dict[str, NativeValue]) -> dict[str, NativeValue]:
        produced = self._run(feeds, self._names, _RUN_OPTIONS)
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
