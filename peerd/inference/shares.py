"""A stage run as N tensor-parallel shares: one schedule per share, two ways to exchange.

`ShareRunner` is one share of units [first, last] of a manifest (docs/architecture.md,
"Tensor-parallel shares"): its own ONNX Runtime sessions (its attention and MLP share units
from shards.share_units, and the model's own embedding and head units where the stage has
them) and its own heads' K/V per sequence. `ShareRunner.schedule` is its part of one step,
a generator that yields an `Exchange` (the `ShareData` it sends, the senders it waits for)
and is sent back the messages it waited for. A step's rows (positions) are split among the
shares by their weights (shards.share_split.split_rows); for every layer half:

    each share: norm its rows (numpy)            -> AllGather: sent to every other share
    each share: its attention / MLP share unit,  -> ReduceScatter: each tile's partial sent
      one tile per share's rows                     to the tile's owner once computed
    each share: sum of the partials of its rows, in share order, and the residual add

The tiles overlap the collectives with the block's matrix products (Galaxy's tiled
overlap): a share runs a tile as soon as its rows are there, so the rows and partials of
the other tiles travel meanwhile. Every block runs its tiles in row order. Attention must:
each tile's K/V is appended before the next (a tile's queries see the earlier tiles' keys,
as a prompt run in chunks does), so share 0 starts at once and share k a message later than
share k - 1. The MLP could start anywhere (it is row by row), but in row order a share
hands the earlier shares, which are ahead of it, their partials first: with its own rows
first, share 0 of a 2-peer group waited 120 ms of a 1.25 s first token (512 tokens, 12
layers) for the partial share 1 computed last, and share 1 as long again for share 0's rows
of the next attention; in row order neither waits more than 30 ms and the first token came
in 1.13-1.2 s.

The embedding unit runs on every share for all rows: it is a table lookup, and it also
gives the per-step tensors (rotary cos/sin, mask) every attention share reads for all rows,
so running it whole spares a collective. The stage's last hidden state is gathered on share
0, which answers for the stage; where the stage ends in the head unit (final norm, LM head),
share 0 runs it there on the rows whose tokens are drawn (the step's `rows`). Run on every
share's rows instead, the head's logits were what crossed the link: 32 MB from the other
share of a 512-token prompt with 32,000 tokens, against 1 MB of hidden state, and the lead
waited 0.4 s of a 1.06 s first token for them. A one-row decode step has one share do the
connective part (the one with the largest weight, share 0 among equals) and the others get
no rows; a share sends nothing where the receiver gets no rows, and waits for no share that
has none.

Two drivers run the schedule:
- `ShareStage`, in one process: all N schedules, each resumed once the messages it waits
  for have come, every message encoded and decoded by peerd.wire.protocol (`peerd generate
  --tensor-parallel N`, the exactness tests);
- `drive`, on a daemon: this peer's one schedule, its messages sent over the data channel
  and the peers' awaited (peerd.inference.groups).
Steps of several sequences run one after another (no batching).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from peerd.wire import protocol
from peerd.wire.protocol import ShareData, SharePhase
from shards.executor import ExecutorOptions, Outcome, SessionShelf, last_rows, session_options
from shards.manifest import Manifest, Unit
from shards.share_layout import ATTN, HIDDEN, MLP, NORMED, PAST, ShareUnits, step_inputs
from shards.share_split import ShareError, Span, split_rows

ROWS_AXIS = 1  # [batch, rows, width]
STEP_ROWS_AXIS = 2  # the per-step tensors: [batch, 1, rows, width]
EMBED, HEAD = "embed", "head"
Tensors = dict[str, np.ndarray]


ExchangeKey = tuple[str, int, int, str, int]  # seq_id, step, unit, phase, sender


def sent_key(message: ShareData) -> ExchangeKey:
    """Which exchange a message belongs to, and its sender: what a receiver files it by."""
    return message.seq_id, message.step, message.unit, str(message.phase), message.share


@dataclass(frozen=True)
class ShareTag:
    """What every message of one exchange is tagged with (and its sender, `share`)."""

    plan: str
    seq_id: str
    step: int
    unit: int
    phase: SharePhase
    share: int

    def from_sender(self, sender: int) -> ExchangeKey:
        """The key of the message of this exchange that `sender` sends (`sent_key`)."""
        return self.seq_id, self.step, self.unit, str(self.phase), sender

    def phase_of(self, phase: SharePhase) -> ShareTag:
        return ShareTag(self.plan, self.seq_id, self.step, self.unit, phase, self.share)

    def of(self, span: Span, rows: np.ndarray) -> ShareData:
        return ShareData(self.plan, self.seq_id, self.step, self.unit, self.phase, self.share,
                         span.start, span.stop, {"rows": np.ascontiguousarray(rows)})


@dataclass(frozen=True)
class Exchange:
    """One collective round as one share sees it: the messages it sends (to share index),
    and the shares whose message of this round (`tag`) it waits for."""

    tag: ShareTag
    sends: tuple[tuple[int, ShareData], ...]
    expects: tuple[int, ...]


# Yields each exchange, is sent the messages waited for (by sender), returns the stage's
# outputs on share 0 (None on the others).
Schedule = Generator[Exchange, dict[int, ShareData], Tensors | None]


class _StepState:
    """What one share holds during a step: values whole (the stage's inputs, the per-step
    tensors) and its rows of the residual stream, named `rows_name`."""

    def __init__(self, whole: Tensors, spans: tuple[Span, ...], index: int) -> None:
        self.whole = dict(whole)
        self.spans = spans
        self.span = spans[index]
        self.rows: np.ndarray | None = None
        self.rows_name = ""

    def take_rows(self, name: str) -> None:
        self.rows = np.ascontiguousarray(self.whole[name][:, self.span.start : self.span.stop])
        self.rows_name = name

    @property
    def current(self) -> np.ndarray:
        assert self.rows is not None  # set by the unit that started the stage's rows
        return self.rows


class ShareRunner:
    """Share `index` of units [first, last] of `manifest`: its sessions, its K/V, its part of
    each step (`schedule`). `units` needs this share's units only."""

    def __init__(self, manifest: Manifest, directory: Path, first: int, last: int,
                 units: ShareUnits, index: int, options: ExecutorOptions | None = None,
                 plan: str = "local") -> None:
        self.manifest, self.first, self.last, self.plan = manifest, first, last, plan
        self.index = index
        self.units: tuple[Unit, ...] = manifest.units[first : last + 1]
        self.inputs = manifest.stage_inputs(first, last)
        self.outputs = manifest.stage_outputs(first, last)
        self.share_units = units
        self.head_dim = _head_dim(self.units)
        self.exit = None  # no early exit on shares (yet)
        options = options or ExecutorOptions()
        shelf = SessionShelf()  # its own sessions, as on a peer of its own
        # off the process arena: grown again after every step's hand-back, it slowed a
        # group's first token (docs/architecture.md, "Execution")
        whole = replace(options, memory_arena=False)
        self.model_units = {
            unit.name: shelf.session(manifest, unit, Path(directory) / unit.model_file.name,
                                     whole)
            for unit in self.units if unit.name in whole_units(index)}
        so = session_options(options.threads, options.spinning)  # the process's pool, if any
        self.blocks = {
            _block(unit): ort.InferenceSession(
                str(units.unit(*_block(unit), index).path), so,
                providers=list(options.providers))
            for unit in self.units if unit.name not in (EMBED, HEAD)}
        self.kv_heads = units.shares[index].kv_heads.size
        self.kv: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}

    # -- state -------------------------------------------------------------------------------
    @property
    def holds_state(self) -> bool:
        return any(half == ATTN for _, half in self.blocks)

    def length(self, seq_id: str) -> int:
        held = self.kv.get(seq_id)
        return int(next(iter(held.values()))[0].shape[2]) if held else 0

    def truncate(self, seq_id: str, length: int) -> None:
        """Keep the first `length` positions of the sequence's K/V."""
        held = self.kv.get(seq_id, {})
        for layer, (key, value) in held.items():
            held[layer] = (key[:, :, :length], value[:, :, :length])

    def drop(self, seq_id: str) -> None:
        self.kv.pop(seq_id, None)

    @property
    def sequence_count(self) -> int:
        return len(self.kv)

    def kv_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for held in self.kv.values() for k, v in held.values())

    # -- one step ----------------------------------------------------------------------------
    def schedule(self, seq_id: str, step: int, inputs: Tensors,
                 rows: int | None = None) -> Schedule:
        """This share's part of the step (see the module's docstring); the head's logits
        at the step's last `rows` positions (None: at all)."""
        missing = [name for name in self.inputs if name not in inputs]
        if missing:
            raise ValueError(f"stage {self.first}-{self.last}: missing inputs {missing}")
        state = _StepState(inputs, split_rows(_row_count(inputs), self.share_units.weights),
                           self.index)
        for unit in self.units:
            if unit.name == EMBED:
                state.whole.update(self._run_unit(EMBED, {i.name: state.whole[i.name]
                                                          for i in unit.inputs}))
                state.take_rows(next(o.name for o in unit.outputs if o.name.endswith(HIDDEN)))
                continue
            if state.rows is None:  # the stage starts here: its input arrived whole
                state.take_rows(_hidden_input(unit))
            if unit.name != HEAD:
                yield from self._layer_half(unit, seq_id, step, state)
        return (yield from self._outputs(seq_id, step, state, rows))

    def _run_unit(self, name: str, feeds: Tensors) -> Tensors:
        session = self.model_units[name]
        names = [o.name for o in session.get_outputs()]
        return {name: np.asarray(value)
                for name, value in zip(names, session.run(names, feeds), strict=True)}

    def _layer_half(self, unit: Unit, seq_id: str, step: int, state: _StepState):
        """Norm my rows, send them to every other share, then run the block tile by tile
        (one tile per share's rows), each partial sent to its tile's owner as soon as it is
        computed, and sum the partials of my rows in share order."""
        layer, half = _block(unit)
        normed = self.share_units.norms[(layer, half)](state.current)
        gather = self._message(seq_id, step, unit.index, SharePhase.GATHER)
        reduce = gather.phase_of(SharePhase.REDUCE)
        spans, others = state.spans, self._others(state)
        if state.span.size:
            yield Exchange(gather, tuple((to, gather.of(state.span, normed)) for to in others),
                           ())
        partials: dict[int, np.ndarray] = {}
        for owner in self._tile_order(state):
            rows = normed if owner == self.index else _rows(
                (yield Exchange(gather, (), (owner,)))[owner])
            partial = self._tile(unit, seq_id, state, rows, spans[owner])
            if owner == self.index:
                partials[owner] = partial
            else:
                yield Exchange(reduce, ((owner, reduce.of(spans[owner], partial)),), ())
        if state.span.size:
            got = yield Exchange(reduce, (), tuple(others))
            partials.update((i, _rows(message)) for i, message in got.items())
            total = partials[0]
            for i in range(1, len(spans)):
                total = total + partials[i]
            residual = normed if self.share_units.residual_post_norm else state.current
            state.rows = residual + total
        state.rows_name = unit.outputs[0].name

    def _others(self, state: _StepState) -> list[int]:
        return [i for i in range(len(state.spans)) if i != self.index]

    @staticmethod
    def _tile_order(state: _StepState) -> list[int]:
        """The shares whose rows this share's block runs on, in row order: attention must
        (each tile's keys are the earlier tiles' and its own), and the MLP does too, so
        that every share hands the earlier shares their partials first (see the module's
        docstring)."""
        return [i for i, span in enumerate(state.spans) if span.size]

    def _tile(self, unit: Unit, seq_id: str, state: _StepState, normed: np.ndarray,
              span: Span) -> np.ndarray:
        """The share's partial block output at rows `span` (and, for attention, their K/V
        appended to the sequence's)."""
        layer, half = _block(unit)
        feeds = {NORMED: normed}
        if half == ATTN:
            feeds |= {name: _step_rows(state.whole[name], span) for name in step_inputs(unit)}
            feeds |= dict(zip(PAST, self._past(seq_id, layer), strict=True))
        partial, *present = map(np.asarray, self.blocks[(layer, half)].run(None, feeds))
        if present:
            self.kv.setdefault(seq_id, {})[layer] = (present[0], present[1])
        return partial

    def _past(self, seq_id: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32)
        return self.kv.get(seq_id, {}).get(layer, (empty, empty))

    # -- messages and the stage's outputs -----------------------------------------------
    def _message(self, seq_id: str, step: int, unit: int, phase: SharePhase) -> ShareTag:
        return ShareTag(self.plan, seq_id, step, unit, phase, self.index)

    def _outputs(self, seq_id: str, step: int, state: _StepState, rows: int | None):
        """The stage's outputs, answered by share 0: the hidden state gathered from every
        share (that has rows) and, where the stage has the head, the head run on it; the
        rest from what it holds whole."""
        message = self._message(seq_id, step, self.last, SharePhase.OUTPUT)
        shares = range(len(state.spans))
        if self.index != 0:
            sends = ((0, message.of(state.span, state.current)),) if state.span.size else ()
            yield Exchange(message, sends, ())
            return None
        got = yield Exchange(message, (), tuple(i for i in shares if i and state.spans[i].size))
        produced = {state.rows_name: np.concatenate(
            [state.current, *(_rows(got[i]) for i in shares if i and state.spans[i].size)],
            axis=ROWS_AXIS)}
        head = self.units[-1]
        if head.name == HEAD:
            hidden = produced[state.rows_name]
            produced = self._run_unit(HEAD, {head.inputs[0].name: hidden if rows is None else
                                             last_rows(hidden, rows)})
        return {name: produced[name] if name in produced else state.whole[name]
                for name in self.outputs}


def drive(schedule: Schedule, exchange: Callable[[Exchange], dict[int, ShareData]]
          ) -> Tensors | None:
    """Run one share's schedule, `exchange` sending each round's messages and returning
    those it waits for."""
    try:
        round_ = next(schedule)
        while True:
            round_ = schedule.send(exchange(round_))
    except StopIteration as done:
        return done.value


def one_by_one(step: Callable[[str, Tensors, int | None], Tensors],
               steps: Sequence[tuple[str, Tensors]],
               rows: Mapping[str, int] | None) -> list[Outcome]:
    """Each step in turn (shares run no batches yet): its outputs, or its exception."""
    outcomes: list[Outcome] = []
    for seq_id, inputs in steps:
        try:
            outcomes.append(step(seq_id, inputs, (rows or {}).get(seq_id)))
        except Exception as exc:  # ONNX Runtime's errors derive from Exception alone
            outcomes.append(exc)
    return outcomes


class ShareStage:
    """Units [first, last] of `manifest` run as len(units.shares) shares in one process."""

    def __init__(self, manifest: Manifest, directory: Path, first: int, last: int,
                 units: ShareUnits, options: ExecutorOptions | None = None,
                 plan: str = "local") -> None:
        self.manifest, self.first, self.last = manifest, first, last
        self.shares = [ShareRunner(manifest, directory, first, last, units, i, options, plan)
                       for i in range(len(units.shares))]
        self.inputs = self.shares[0].inputs
        self.exit = None
        self.wire_bytes = 0
        self._steps: dict[str, int] = {}

    def step_many(self, steps: Sequence[tuple[str, Tensors]],
                  unit_s: dict[int, float] | None = None,
                  rows: Mapping[str, int] | None = None) -> list[Outcome]:
        return one_by_one(self.step, steps, rows)

    def step(self, seq_id: str, inputs: Tensors, rows: int | None = None) -> Tensors:
        """Every share's schedule, each resumed once the messages it waits for have come,
        every message through the codec; share 0's outputs."""
        step = self._steps.get(seq_id, 0)
        self._steps[seq_id] = step + 1
        schedules = [share.schedule(seq_id, step, inputs, rows) for share in self.shares]
        inboxes: list[dict[ExchangeKey, ShareData]] = [{} for _ in schedules]
        waiting: dict[int, Exchange] = {}
        outputs: Tensors | None = None
        for index, schedule in enumerate(schedules):
            waiting[index] = self._post(next(schedule), inboxes)
        while waiting:
            ready = [i for i, round_ in waiting.items()
                     if all(round_.tag.from_sender(s) in inboxes[i] for s in round_.expects)]
            if not ready:
                raise RuntimeError(f"the shares of step {step} of {seq_id} wait on each other")
            for index in ready:
                round_ = waiting.pop(index)
                got = {s: inboxes[index].pop(round_.tag.from_sender(s)) for s in round_.expects}
                try:
                    waiting[index] = self._post(schedules[index].send(got), inboxes)
                except StopIteration as done:
                    outputs = done.value if index == 0 else outputs
        assert outputs is not None  # share 0 answers for the stage
        return outputs

    def _post(self, round_: Exchange,
              inboxes: list[dict[ExchangeKey, ShareData]]) -> Exchange:
        for receiver, message in round_.sends:
            received = self._carry(message)
            inboxes[receiver][sent_key(received)] = received
        return round_

    def _carry(self, message: ShareData) -> ShareData:
        frames = [bytes(f) for f in protocol.encode(message)]
        self.wire_bytes += sum(len(f) for f in frames)
        received = protocol.decode(frames)
        assert isinstance(received, ShareData)  # decode gives back what was encoded
        return received

    def drop(self, seq_id: str) -> None:
        self._steps.pop(seq_id, None)
        for share in self.shares:
            share.drop(seq_id)

    @property
    def holds_state(self) -> bool:
        return self.shares[0].holds_state

    def length(self, seq_id: str) -> int:
        return self.shares[0].length(seq_id)

    def truncate(self, seq_id: str, length: int) -> None:
        for share in self.shares:
            share.truncate(seq_id, length)

    @property
    def sequence_count(self) -> int:
        return self.shares[0].sequence_count


def whole_units(index: int) -> tuple[str, ...]:
    """The model's own units share `index` runs whole: the embedding on every share, the
    head on share 0, which answers for the stage."""
    return (EMBED, HEAD) if index == 0 else (EMBED,)


def _step_rows(tensor: np.ndarray, span: Span) -> np.ndarray:
    """Rows `span` of a per-step tensor (rotary cos/sin, the query positions: [B, 1, T, x])."""
    if span.size == tensor.shape[STEP_ROWS_AXIS]:
        return tensor
    return np.ascontiguousarray(tensor[:, :, span.start : span.stop])


def _rows(message: ShareData) -> np.ndarray:
    return message.tensors["rows"]


def _block(unit: Unit) -> tuple[int, str]:
    """(layer, ATTN or MLP) of a layer-half unit ("layer3.attn")."""
    layer, _, half = unit.name.partition(".")
    if not layer.startswith("layer") or half not in (ATTN, MLP):
        raise ShareError(f"unit {unit.name} is not a layer half: tensor-parallel shares need "
                         f"a model sharded into layer halves")
    return int(layer.removeprefix("layer")), half


def _hidden_input(unit: Unit) -> str:
    return next(i.name for i in unit.inputs if i.name.endswith(HIDDEN))


def _row_count(inputs: Tensors) -> int:
    """The step's rows: new tokens, or positions of the hidden state it starts from."""
    return int(inputs["position_ids"].shape[ROWS_AXIS]) if "position_ids" in inputs else int(
        next(v for k, v in inputs.items() if k.endswith(HIDDEN)).shape[ROWS_AXIS])


def _head_dim(units: tuple[Unit, ...]) -> int:
    specs = [spec for unit in units for spec in unit.state]
    return specs[0].shape[3] if specs else 0
