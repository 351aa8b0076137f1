"""A stage run as N tensor-parallel shares in one process, every exchange through the codec.

`ShareStage` runs units [first, last] of a manifest the way a group of N peers would serve
them (docs/architecture.md, "Tensor-parallel shares"), with the interface `StageWorker`
needs of a stage (`step_many`, `drop`, `length`, ...). Each `_Share` has its own ONNX
Runtime sessions (its attention and MLP share units from shards.share_units, and the
model's own embedding and head units where the stage has them) and its own heads' K/V per
sequence. A step's rows (positions) are split among the shares by their weights
(shards.share_split.split_rows); for every layer half:

    each share: norm its rows (numpy)           -> AllGather: every share has all normed rows
    each share: its attention / MLP share unit  -> ReduceScatter: each share sums the
    each share: residual add on its rows           partials of its own rows, in share order

The embedding unit runs on every share for all rows: it is a table lookup, and it also
gives the per-step tensors (rotary cos/sin, mask) every attention share reads for all rows,
so running it whole spares a collective. The head unit (final norm, LM head) runs on each
share's rows. The stage's output (the last hidden state or the logits) is gathered on share
0, which answers for the stage. A one-row decode step has one share do the connective part
(the one with the largest weight, share 0 among equals) and the others get no rows.

Every tensor one share hands another is a `ShareData` encoded and decoded by
peerd.wire.protocol, so the messages are those a group of peers would send each other over
the data channel. Steps of several sequences run one after another (no batching).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from peerd.wire import protocol
from peerd.wire.protocol import ShareData, SharePhase
from shards.executor import ExecutorOptions, Outcome, SessionShelf, session_options
from shards.manifest import Manifest, Unit
from shards.share_layout import ATTN, HIDDEN, MLP, NORMED, PAST, ShareUnits, step_inputs
from shards.share_split import ShareError, Span, split_rows

ROWS_AXIS = 1  # [batch, rows, width]
EMBED, HEAD = "embed", "head"


class _Share:
    """One share: its sessions and its heads' K/V per sequence."""

    def __init__(self, index: int, stage: ShareStage, units: ShareUnits,
                 directory: Path, options: ExecutorOptions) -> None:
        self.index = index
        shelf = SessionShelf()  # its own sessions, as on a peer of its own
        self.model_units = {
            unit.name: shelf.session(stage.manifest, unit, directory / unit.model_file.name,
                                     options)
            for unit in stage.units if unit.name in (EMBED, HEAD)}
        so = session_options(options.threads, options.spinning)  # the process's pool, if any
        self.blocks = {
            (layer, half): ort.InferenceSession(
                str(units.unit(layer, half, index).path), so, providers=list(options.providers))
            for layer, half in stage.blocks}
        share = units.shares[index]
        self.kv_heads = share.kv_heads.size
        self.kv: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}

    def past(self, seq_id: str, layer: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros((1, self.kv_heads, 0, head_dim), np.float32)
        return self.kv.get(seq_id, {}).get(layer, (empty, empty))

    def run_unit(self, name: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self.model_units[name]
        names = [o.name for o in session.get_outputs()]
        return {name: np.asarray(value)
                for name, value in zip(names, session.run(names, feeds), strict=True)}


class _StepState:
    """What one share holds during a step: values whole (the stage's inputs, the per-step
    tensors) and its rows of the residual stream, named `rows_name`."""

    def __init__(self, whole: dict[str, np.ndarray], span: Span) -> None:
        self.whole = dict(whole)
        self.span = span
        self.rows: np.ndarray | None = None
        self.rows_name = ""

    def take_rows(self, name: str) -> None:
        self.rows = np.ascontiguousarray(self.whole[name][:, self.span.start : self.span.stop])
        self.rows_name = name


class ShareStage:
    """Units [first, last] of `manifest` run as len(units.shares) shares."""

    def __init__(self, manifest: Manifest, directory: Path, first: int, last: int,
                 units: ShareUnits, options: ExecutorOptions | None = None,
                 plan: str = "local") -> None:
        self.manifest, self.first, self.last, self.plan = manifest, first, last, plan
        self.units: tuple[Unit, ...] = manifest.units[first : last + 1]
        self.inputs = manifest.stage_inputs(first, last)
        self.outputs = manifest.stage_outputs(first, last)
        self.blocks = [_block(unit) for unit in self.units if unit.name not in (EMBED, HEAD)]
        self.share_units = units
        self.head_dim = _head_dim(self.units)
        options = options or ExecutorOptions()
        self.shares = [_Share(i, self, units, Path(directory), options)
                       for i in range(len(units.shares))]
        self.exit = None  # no early exit on shares (yet)
        self.wire_bytes = 0
        self._steps: dict[str, int] = {}

    # -- the interface StageWorker runs ---------------------------------------------------
    def step_many(self, steps: Sequence[tuple[str, dict[str, np.ndarray]]],
                  unit_s: dict[int, float] | None = None) -> list[Outcome]:
        """Each step in turn: its outputs, or the exception it raised."""
        outcomes: list[Outcome] = []
        for seq_id, inputs in steps:
            try:
                outcomes.append(self.step(seq_id, inputs))
            except Exception as exc:  # ONNX Runtime's errors derive from Exception alone
                outcomes.append(exc)
        return outcomes

    def step(self, seq_id: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.inputs if name not in inputs]
        if missing:
            raise ValueError(f"stage {self.first}-{self.last}: missing inputs {missing}")
        step = self._steps.get(seq_id, 0)
        spans = split_rows(_row_count(inputs), self.share_units.weights)
        states = [_StepState(inputs, span) for span in spans]
        for unit in self.units:
            self._run_unit(unit, seq_id, step, states)
        self._steps[seq_id] = step + 1
        return self._outputs(seq_id, step, states)

    def drop(self, seq_id: str) -> None:
        self._steps.pop(seq_id, None)
        for share in self.shares:
            share.kv.pop(seq_id, None)

    @property
    def holds_state(self) -> bool:
        return any(half == ATTN for _, half in self.blocks)

    def length(self, seq_id: str) -> int:
        held = self.shares[0].kv.get(seq_id)
        return int(next(iter(held.values()))[0].shape[2]) if held else 0

    def truncate(self, seq_id: str, length: int) -> None:
        """Keep the first `length` positions of every share's K/V of the sequence."""
        for share in self.shares:
            held = share.kv.get(seq_id, {})
            for layer, (key, value) in held.items():
                held[layer] = (key[:, :, :length], value[:, :, :length])

    @property
    def sequence_count(self) -> int:
        return len(self.shares[0].kv)

    # -- one unit, all shares ---------------------------------------------------------------
    def _run_unit(self, unit: Unit, seq_id: str, step: int, states: list[_StepState]) -> None:
        if unit.name == EMBED:
            for share, state in zip(self.shares, states, strict=True):
                state.whole.update(share.run_unit(EMBED, {i.name: state.whole[i.name]
                                                          for i in unit.inputs}))
                state.take_rows(next(o.name for o in unit.outputs if o.name.endswith(HIDDEN)))
            return
        for state in states:
            if state.rows is None:  # the stage starts here: its input arrived whole
                state.take_rows(_hidden_input(unit))
        if unit.name == HEAD:
            self._head(unit, states)
        else:
            self._block(unit, seq_id, step, states)

    def _head(self, unit: Unit, states: list[_StepState]) -> None:
        for share, state in zip(self.shares, states, strict=True):
            assert state.rows is not None
            name = unit.outputs[0].name
            if state.span.size:
                state.rows = share.run_unit(HEAD, {unit.inputs[0].name: state.rows})[name]
            else:
                state.rows = np.zeros((state.rows.shape[0], 0, self.manifest.model.vocab_size),
                                      np.float32)
            state.rows_name = name

    def _block(self, unit: Unit, seq_id: str, step: int, states: list[_StepState]) -> None:
        layer, half = _block(unit)
        units = self.share_units
        norm = units.norms[(layer, half)]
        normed = [norm(_rows(state)) for state in states]
        spans = [state.span for state in states]
        everyone = self._all_gather(unit.index, seq_id, step, normed, spans)
        partials = [self._branch(share, state, unit, seq_id, everyone[share.index])
                    for share, state in zip(self.shares, states, strict=True)]
        sums = self._reduce_scatter(unit.index, seq_id, step, partials, spans)
        for state, mine, added in zip(states, normed, sums, strict=True):
            residual = mine if units.residual_post_norm else _rows(state)
            state.rows = residual + added
            state.rows_name = unit.outputs[0].name

    def _branch(self, share: _Share, state: _StepState, unit: Unit, seq_id: str,
                normed: np.ndarray) -> np.ndarray:
        """The share's partial block output over all rows (and its new K/V, kept)."""
        layer, half = _block(unit)
        feeds = {NORMED: normed}
        if half == ATTN:
            feeds |= {name: state.whole[name] for name in step_inputs(unit)}
            feeds |= dict(zip(PAST, share.past(seq_id, layer, self.head_dim), strict=True))
        partial, *present = map(np.asarray, share.blocks[(layer, half)].run(None, feeds))
        if present:
            share.kv.setdefault(seq_id, {})[layer] = (present[0], present[1])
        return partial

    # -- collectives, through the codec -----------------------------------------------------
    def _carry(self, message: ShareData) -> np.ndarray:
        frames = [bytes(f) for f in protocol.encode(message)]
        self.wire_bytes += sum(len(f) for f in frames)
        received = protocol.decode(frames)
        assert isinstance(received, ShareData)  # decode gives back what was encoded
        return received.tensors["rows"]

    def _message(self, seq_id: str, step: int, unit: int, phase: SharePhase, sender: int,
                 span: Span, rows: np.ndarray) -> ShareData:
        return ShareData(self.plan, seq_id, step, unit, phase, sender, span.start, span.stop,
                         {"rows": np.ascontiguousarray(rows)})

    def _all_gather(self, unit: int, seq_id: str, step: int, pieces: list[np.ndarray],
                    spans: list[Span]) -> list[np.ndarray]:
        """Each share's copy of every share's rows, in row order."""
        return [np.concatenate([
            piece if sender == receiver else self._carry(self._message(
                seq_id, step, unit, SharePhase.GATHER, sender, spans[sender], piece))
            for sender, piece in enumerate(pieces)], axis=ROWS_AXIS)
            for receiver in range(len(pieces))]

    def _reduce_scatter(self, unit: int, seq_id: str, step: int, partials: list[np.ndarray],
                        spans: list[Span]) -> list[np.ndarray]:
        """Each share's sum of all partials at its own rows, summed in share order."""
        sums = []
        for receiver, span in enumerate(spans):
            total = None
            for sender, partial in enumerate(partials):
                mine = partial[:, span.start : span.stop]
                if sender != receiver:
                    mine = self._carry(self._message(seq_id, step, unit, SharePhase.REDUCE,
                                                     sender, span, mine))
                total = mine if total is None else total + mine
            sums.append(total)
        return sums

    def _outputs(self, seq_id: str, step: int, states: list[_StepState]) -> dict[str, np.ndarray]:
        """The stage's outputs as share 0 answers them: its row output gathered from every
        share, the rest from what it holds whole."""
        answering = states[0]
        outputs = {}
        for name in self.outputs:
            if name != answering.rows_name:
                outputs[name] = answering.whole[name]
                continue
            pieces = [_rows(answering)] + [
                self._carry(self._message(seq_id, step, self.last, SharePhase.OUTPUT, sender,
                                          state.span, _rows(state)))
                for sender, state in enumerate(states) if sender > 0]
            outputs[name] = np.concatenate(pieces, axis=ROWS_AXIS)
        return outputs


def _rows(state: _StepState) -> np.ndarray:
    assert state.rows is not None  # set by the unit that started the stage's rows
    return state.rows


def _block(unit: Unit) -> tuple[int, str]:
    """(layer, ATTN or MLP) of a layer-half unit ("layer3.attn")."""
    layer, _, half = unit.name.partition(".")
    if not layer.startswith("layer") or half not in (ATTN, MLP):
        raise ShareError(f"unit {unit.name} is not a layer half: tensor-parallel shares need "
                         f"a model sharded into layer halves")
    return int(layer.removeprefix("layer")), half


def _hidden_input(unit: Unit) -> str:
    return next(i.name for i in unit.inputs if i.name.endswith(HIDDEN))


def _row_count(inputs: dict[str, np.ndarray]) -> int:
    """The step's rows: new tokens, or positions of the hidden state it starts from."""
    return int(inputs["position_ids"].shape[ROWS_AXIS]) if "position_ids" in inputs else int(
        next(v for k, v in inputs.items() if k.endswith(HIDDEN)).shape[ROWS_AXIS])


def _head_dim(units: tuple[Unit, ...]) -> int:
    specs = [spec for unit in units for spec in unit.state]
    return specs[0].shape[3] if specs else 0
