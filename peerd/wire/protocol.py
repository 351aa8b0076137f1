"""The wire protocol: every message peers exchange is defined here, and only here.

A message travels as a list of ZeroMQ frames: frame 0 is a msgpack map
``{"v": PROTOCOL_VERSION, "kind": KIND, ...fields}``; a field of tensors (``Tensors``, such as
``tensors``) lists them in the header as ``"<field>": [[name, dtype, shape], ...]`` and each
tensor's raw bytes follow as one more frame, fields in their order, tensors in the listed
order (no pickling; decoding is zero-copy over the received buffers).

Messages are frozen dataclasses registered with ``@message("kind")``. Their field annotations
are the schema: ``decode`` checks every header field against them (nested frozen dataclasses
travel as maps), and ``__post_init__`` checks ranges, so a handler only ever sees well-formed
messages. Anything else raises ``ProtocolError``; receivers log it and drop the message.

Each kind belongs to one channel (one socket pair, see peerd/wire/transport.py): ``control``
(small, latency-sensitive), ``data`` (bulk: tensors, bandwidth probes) or ``hello`` (static
peer introductions). A message arriving on another channel's socket is dropped.
docs/protocol.md describes every message.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import msgpack
import numpy as np

from peerd.wire.states import (
    OFFERED_MODEL_STATES,
    REPORTED_DEPLOY_STATES,
    ExportState,
    ModelState,
)
from shards.sampling import Distribution

PROTOCOL_VERSION = 6
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
MAX_HEADER_BYTES = 1024 * 1024
MAX_TENSORS = 4096
MAX_BATCH = 256  # steps of one batch (StageData.batch_size)
MAX_ROWS = 17  # positions a speculative check asks tokens of: 16 drafts and the next
MAX_BATCH_NAME = 64
MAX_RANK = 8

MAX_PROBE_BYTES = 64 * 1024 * 1024
MAX_SKIP = 1 << 20  # tokens a resumed sequence may skip: far above any answer's length
MAX_TOP_LOGPROBS = 20  # most likely tokens reported with a token (OpenAI's top_logprobs)
CONTROL, DATA, HELLO = "control", "data", "hello"
CHANNELS = (CONTROL, DATA, HELLO)

# The dtypes a tensor frame may carry; anything else is refused on receipt.
WIRE_DTYPES = frozenset({"float32", "float16", "int64", "int32", "int8", "uint8", "bool"})

Tensors = dict[str, np.ndarray]


class ProtocolError(ValueError):
    """A message that is malformed, of an unknown kind, or of another protocol version."""


class Message(Protocol):
    """What every registered message is: a frozen dataclass of a kind, on a channel."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


Answer = TypeVar("Answer")


class Asks(Generic[Answer]):
    """The base of a request: a message the asker numbers (``req``), answered by a message
    of type ``Answer`` carrying the same number. The answer is written as a string (it is
    defined further down); `answer_kinds` reads it."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    req: int


# A class is registered before the type checker sees it as a dataclass, hence type[Any].
_REGISTRY: dict[str, type[Any]] = {}
_Class = TypeVar("_Class", bound=type)


def message(kind: str, channel: str = CONTROL) -> typing.Callable[[_Class], _Class]:
    """Register a frozen dataclass as the message of this kind, sent on this channel."""
    if channel not in CHANNELS:
        raise ValueError(f"unknown channel {channel!r}")

    def register(cls: _Class) -> _Class:
        if kind in _REGISTRY:
            raise TypeError(f"message kind {kind!r} registered twice")
        cls.KIND = kind
        cls.CHANNEL = channel
        _REGISTRY[kind] = cls
        return cls

    return register


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise ProtocolError(reason)


def _sole_tensor(tensors: Tensors, name: str, where: str) -> np.ndarray:
    _require(len(tensors) == 1 and name in tensors, f"{where}: expected one tensor, {name!r}")
    return tensors[name]


def kinds() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


@functools.cache
def answer_kinds(request: type[Asks[Any]]) -> tuple[type[Message], ...]:
    """The message classes that answer a request of class `request` (its ``Asks[...]``)."""
    (asks,) = [b for b in getattr(request, "__orig_bases__", ()) if typing.get_origin(b) is Asks]
    holder = types.SimpleNamespace(__annotations__={"answer": typing.get_args(asks)[0]})
    answer = typing.get_type_hints(holder, globals())["answer"]
    return typing.get_args(answer) or (answer,)


@message("stage", channel=DATA)
@dataclasses.dataclass(frozen=True)
class StageData:
    """Activations for one step of one sequence, sent to the stage that consumes them.

    ``tensors`` maps manifest output names to arrays: the sequential input of the receiving
    stage, or the residual outputs it consumes. ``step`` counts forward passes of the sequence
    (0 is the prefill), so a receiver can pair residuals with the sequential input of the same
    step. ``plan`` names the plan the sender runs it under (``plan_key``): during a plan
    change both plans serve at once, and a message of a retired plan must not start a
    sequence on the new one. ``batch`` names the batch of steps the sender ran this one in
    and ``batch_size`` counts the steps of that batch it sends to this receiver, so the
    receiver runs them as one batch too rather than the first to arrive alone ("" and 1: a
    step that ran alone). ``past``, the head's, counts the positions of the sequence's K/V the
    step continues from: a stage holding more (drafted tokens the full model rejected) drops
    the rest first. ``rows`` asks the last stage for the tokens of the step's last ``rows``
    positions (a speculative check, ``SequenceToken.checks``), not only of the last one.
    ``draft_probs``, for a check of a sampled answer, holds its drafts and the distribution
    each was drawn from (``DRAFT_PROBS``, ``draft_probs``), which the last stage tests them
    against (speculative sampling); each stage forwards it to the next. Steps of one
    sequence may follow each other before the first is done (early exit): each stage runs
    them in ``step`` order.
    """

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    plan: str
    seq_id: str
    step: int
    tensors: Tensors
    batch: str = ""
    batch_size: int = 1
    past: int | None = None
    rows: int = 1
    draft_probs: Tensors = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _require(1 <= self.batch_size <= MAX_BATCH, f"stage: batch_size outside 1..{MAX_BATCH}")
        _require(len(self.batch) <= MAX_BATCH_NAME, "stage: batch name too long")
        _require(self.step >= 0, "stage: negative step")
        _require(self.past is None or self.past >= 0, "stage: negative past")
        _require(1 <= self.rows <= MAX_ROWS, f"stage: rows outside 1..{MAX_ROWS}")
        if self.draft_probs:
            _check_draft_probs(self.draft_probs, self.rows - 1)


# StageData.draft_probs, for n drafts: "tokens" [n] (the drafts), "sizes" [n] (the size of
# each one's distribution's support), then the supports one after the other: "ids" [sum of
# sizes] and "probs" (float32) [sum of sizes]. The integers are int32.
DRAFT_PROBS = ("tokens", "sizes", "ids", "probs")


def draft_probs(tokens: Sequence[int], proposals: Sequence[Distribution]) -> Tensors:
    """StageData.draft_probs for drafts and the distributions they were drawn from."""
    return {"tokens": np.asarray(tokens, np.int32),
            "sizes": np.asarray([q.ids.size for q in proposals], np.int32),
            "ids": np.concatenate([q.ids for q in proposals]).astype(np.int32),
            "probs": np.concatenate([q.probs for q in proposals]).astype(np.float32)}


def read_draft_probs(tensors: Tensors) -> tuple[list[int], list[Distribution]]:
    """The drafts and their distributions of a (checked) StageData.draft_probs."""
    bounds = np.cumsum(tensors["sizes"])[:-1]
    rows = zip(np.split(tensors["ids"], bounds), np.split(tensors["probs"], bounds), strict=True)
    return [int(t) for t in tensors["tokens"]], [Distribution(i, p) for i, p in rows]


def _check_draft_probs(tensors: Tensors, drafts: int) -> None:
    _require(tuple(tensors) == DRAFT_PROBS, f"stage: draft_probs holds {list(tensors)}, "
             f"not {list(DRAFT_PROBS)}")
    tokens, sizes, ids, probs = (tensors[name] for name in DRAFT_PROBS)
    _require(all(t.ndim == 1 and t.dtype == np.int32 for t in (tokens, sizes, ids))
             and probs.ndim == 1 and probs.dtype == np.float32,
             "stage: draft_probs are 1-D, int32 but probs float32")
    _require(tokens.size == sizes.size == drafts,
             f"stage: draft_probs for {tokens.size} drafts in a step of {drafts}")
    _require(bool((sizes > 0).all()) and int(sizes.sum()) == ids.size == probs.size,
             "stage: draft_probs sizes do not add up to their ids and probs")
    _require(bool((ids >= 0).all()), "stage: a negative draft token id")
    _require(bool(np.isfinite(probs).all() and (probs >= 0).all()),
             "stage: draft probabilities are not all finite and >= 0")
    _, proposals = read_draft_probs(tensors)
    _require(all(q.probs[q.ids == t].sum() > 0 for t, q in zip(tokens, proposals, strict=True)),
             "stage: a draft its distribution gives no probability")


class SharePhase(enum.StrEnum):
    """Which exchange of a tensor-parallel group a ``ShareData`` belongs to."""

    GATHER = "gather"  # the sender's normed rows, before an attention or MLP block
    REDUCE = "reduce"  # the sender's partial block output at the receiver's rows
    OUTPUT = "output"  # the sender's rows of the stage's output, to the share answering it


@message("share", channel=DATA)
@dataclasses.dataclass(frozen=True)
class ShareData:
    """One tensor a share of a tensor-parallel group sends another (docs/architecture.md,
    "Tensor-parallel shares"), for step ``step`` of ``seq_id`` under ``plan``: for manifest
    unit ``unit`` in ``phase``, from share ``share``. ``tensors`` holds one tensor, "rows",
    [batch, row_stop - row_start, width]: rows row_start..row_stop-1 of the step."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    plan: str
    seq_id: str
    step: int
    unit: int
    phase: str
    share: int
    row_start: int
    row_stop: int
    tensors: Tensors

    def __post_init__(self):
        _require(self.phase in tuple(SharePhase), f"share: unknown phase {self.phase!r}")
        _require(self.step >= 0 and self.unit >= 0 and self.share >= 0,
                 "share: negative step, unit or share")
        _require(0 <= self.row_start <= self.row_stop, "share: bad row range")
        rows = _sole_tensor(self.tensors, "rows", "share")
        count = self.row_stop - self.row_start
        _require(rows.ndim == 3 and rows.shape[1] == count,
                 f"share: tensor rows of shape {list(rows.shape)} is not [batch, {count}, width]")


@message("share-step", channel=DATA)
@dataclasses.dataclass(frozen=True)
class ShareStep:
    """The lead of a group stage hands each other member the inputs of step ``step`` of
    ``seq_id`` (the stage's inputs, as the lead took them in ``StageData``): run your share
    of it. Members run the steps of a sequence in the order they come."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    plan: str
    seq_id: str
    step: int
    tensors: Tensors

    def __post_init__(self):
        _require(self.step >= 0, "share-step: negative step")


@message("share-drop", channel=DATA)
@dataclasses.dataclass(frozen=True)
class ShareDrop:
    """The lead of a group stage ends a sequence on the other members: free its K/V."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    plan: str
    seq_id: str


@message("seq-open", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceOpen(Asks["SequenceOpened"]):
    """The head asks the last stage to sample a new sequence with these settings; the answer
    (``SequenceOpened``) comes before the head runs the sequence's first step. ``skip`` is
    the number of tokens already sampled for this answer (a resumed answer continues the
    seeded random stream where it stopped). ``logprobs``, where given, asks for each token's
    log-probability and that many most likely tokens with it (``SequenceToken``)."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    plan: str
    seq_id: str
    temperature: float
    top_k: int
    top_p: float
    seed: int
    skip: int
    logprobs: int | None = None

    def __post_init__(self):
        _require(self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                 f"seq-open: logprobs outside 0..{MAX_TOP_LOGPROBS}")
        # The last stage seeds a random stream with these: a negative seed or an enormous
        # skip would raise there, or allocate the skipped draws, instead of being refused.
        _require(self.seed >= 0, "seq-open: negative seed")
        _require(0 <= self.skip <= MAX_SKIP, f"seq-open: skip outside 0..{MAX_SKIP}")


@message("seq-opened", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceOpened:
    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    error: str | None = None


@message("seq-token", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceToken:
    """The last stage's sampled token for one step, sent to the head; for a sequence opened
    with ``logprobs``, also the token's log-probability and the most likely tokens
    (``top_ids``, most likely first) with theirs. For a step with ``rows`` > 1, ``checks``
    holds the full model's most likely token at each of the positions before the last."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    seq_id: str
    step: int
    token: int
    logprob: float | None = None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    checks: tuple[int, ...] = ()

    def __post_init__(self):
        _require(len(self.top_ids) == len(self.top_logprobs) <= MAX_TOP_LOGPROBS,
                 f"seq-token: top_ids and top_logprobs differ or exceed {MAX_TOP_LOGPROBS}")
        _require(self.logprob is not None or not self.top_ids,
                 "seq-token: top logprobs without the token's")
        logprobs = (*self.top_logprobs, *(() if self.logprob is None else (self.logprob,)))
        _require(all(lp <= 0.0 for lp in logprobs), "seq-token: a logprob above 0")
        _require(all(i >= 0 for i in (self.token, *self.top_ids, *self.checks)),
                 "seq-token: negative id")
        _require(len(self.checks) < MAX_ROWS, f"seq-token: {MAX_ROWS} checks or more")


@message("seq-drop", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceDrop:
    """The head ends a sequence (finished, cancelled or failed): free its K/V and sampler."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    seq_id: str


@message("seq-move", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceMove(Asks["SequenceMoved"]):
    """The head moves an answer to plan ``to_plan`` at a token boundary: the stage of
    ``plan`` that gets this sends its K/V of ``seq_id`` to the peers holding the same units
    in ``to_plan`` (``holders[u]`` holds unit u), stored there under ``to_seq_id``
    (``SequenceState``), then answers with ``SequenceMoved``."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    plan: str
    seq_id: str
    to_plan: str
    to_seq_id: str
    holders: tuple[str, ...]

    def __post_init__(self):
        _require(0 < len(self.holders) <= MAX_TENSORS, "seq-move: holders out of range")


@message("seq-state", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceState(Asks["SequenceMoved"]):
    """The K/V of ``units`` for sequence ``seq_id`` of plan ``plan``, keyed by the units'
    state input names, to store on the stage holding those units; answered by
    ``SequenceMoved``."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    plan: str
    seq_id: str
    units: tuple[int, ...]
    tensors: Tensors

    def __post_init__(self):
        _require(all(u >= 0 for u in self.units), "seq-state: negative unit index")


@message("seq-moved", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceMoved:
    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    error: str | None = None


@message("seq-fork", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceFork(Asks["SequenceForked"]):
    """The head starts sequence ``seq_id`` from the first ``length`` positions of the K/V
    the stage keeps for ``source`` (an ended answer of the same conversation); answered by
    ``SequenceForked`` before the sequence's first step."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    plan: str
    source: str
    seq_id: str
    length: int

    def __post_init__(self):
        _require(self.length > 0, "seq-fork: length must be positive")
        _require(self.source != self.seq_id, "seq-fork: a sequence cannot start from itself")


@message("seq-forked", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceForked:
    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    error: str | None = None


@message("seq-stats-ask", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceStatsRequest(Asks["SequenceStats"]):
    """The head, as an answer ends, asks each stage what the sequence cost it."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    seq_id: str


@message("seq-stats", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceStats:
    """One stage's work on one sequence: steps run, seconds computing its units, seconds
    handing its outputs to the transport, bytes sent to the next stage (sequential) and to
    later stages (residual), and whether it sends float16 activations."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    steps: int
    compute_s: float
    transfer_s: float
    sequential_bytes: int
    residual_bytes: int
    fp16_wire: bool


@message("chat", channel=DATA)
@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A chat typed on another peer's socket, forwarded to the head. ``body`` is the local
    API's chat request (peerd/inference/serving.py validates it on the head)."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    chat_id: str
    body: dict[str, Any]


@message("chat-event", channel=DATA)
@dataclasses.dataclass(frozen=True)
class ChatEvent:
    """One local-API event of a forwarded chat (a token, the end, or an error), relayed by
    the asking peer to its client as it is."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    chat_id: str
    event: dict[str, Any]


@message("chat-cancel", channel=DATA)
@dataclasses.dataclass(frozen=True)
class ChatCancel:
    """The client of a forwarded chat went away: the head ends the answer."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    chat_id: str


@message("seq-failed", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SequenceFailed:
    """A stage could not run a step of the sequence; the head ends it with this reason."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    seq_id: str
    reason: str


# Control messages. The sender of a message is never a field: the transport knows it from the
# CURVE key that the ZAP handler authenticated, so a member cannot speak for another.


@message("hello", channel=HELLO)
@dataclasses.dataclass(frozen=True)
class Hello:
    """A static peer introduces itself with its signed record (peerd/cluster/records.py); the answer
    is the receiver's own Hello."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    record: dict[str, str]


@message("heartbeat")
@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """Sent to every member several times a second: liveness, run instance, the sender's view
    of the current leader and epoch, and its capability for the election."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    instance: str
    seq: int
    epoch: int
    leader: str | None
    mains: bool
    flops: float

    def __post_init__(self):
        _require(self.seq >= 0 and self.epoch >= 0, "heartbeat: negative seq or epoch")
        _require(self.flops >= 0, "heartbeat: negative flops")


@message("goodbye")
@dataclasses.dataclass(frozen=True)
class Goodbye:
    """The sender's run ``instance`` is shutting down cleanly."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    instance: str


@message("vote-request")
@dataclasses.dataclass(frozen=True)
class VoteRequest:
    """The sender stands for leader of ``epoch`` with this capability."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    epoch: int
    mains: bool
    flops: float

    def __post_init__(self):
        _require(self.epoch > 0, "vote-request: epoch must be positive")
        _require(self.flops >= 0, "vote-request: negative flops")


@message("vote")
@dataclasses.dataclass(frozen=True)
class Vote:
    """The sender's answer to a candidate; ``epoch`` is the voter's epoch after the request."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    epoch: int
    granted: bool

    def __post_init__(self):
        _require(self.epoch >= 0, "vote: negative epoch")


@message("leader")
@dataclasses.dataclass(frozen=True)
class LeaderAnnounce:
    """The sender won the election of ``epoch``."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    epoch: int

    def __post_init__(self):
        _require(self.epoch > 0, "leader: epoch must be positive")


@dataclasses.dataclass(frozen=True)
class Battery:
    percent: float
    plugged: bool

    def __post_init__(self):
        _require(0 <= self.percent <= 100, "battery percent outside 0..100")


@dataclasses.dataclass(frozen=True)
class UnitTimes:
    """Measured seconds per decode token of the units a peer ran (``units[i]`` took
    ``seconds[i]``), for the model whose manifest key is ``model``, and the seconds per
    decode step its stage spent outside them (``overhead_s``)."""

    model: str
    units: tuple[int, ...]
    seconds: tuple[float, ...]
    overhead_s: float | None = None  # None: no decode step ran yet, only the warm-up

    def __post_init__(self):
        _require(self.overhead_s is None or self.overhead_s >= 0,
                 "unit times: negative overhead")
        _require(len(self.units) == len(self.seconds), "unit times: units and seconds differ")
        _require(len(set(self.units)) == len(self.units), "unit times: a unit twice")
        _require(all(u >= 0 for u in self.units), "unit times: negative unit index")
        _require(all(s > 0 for s in self.seconds), "unit times: seconds not > 0")

    def by_unit(self) -> dict[int, float]:
        return dict(zip(self.units, self.seconds, strict=True))


@dataclasses.dataclass(frozen=True)
class AnswerFigures:
    """What the head measured of its answers on plan ``plan`` (its key): the per-token
    latency of an answer running alone and the decode tokens per second while answering
    (None until measured), from ``tokens`` decoded tokens."""

    plan: str
    latency_s: float | None
    throughput_tps: float | None
    tokens: int

    def __post_init__(self):
        _require(self.latency_s is None or self.latency_s > 0, "answers: latency not > 0")
        _require(self.throughput_tps is None or self.throughput_tps > 0,
                 "answers: throughput not > 0")
        _require(self.tokens >= 0, "answers: negative token count")


@dataclasses.dataclass(frozen=True)
class PeerFigures:
    """One peer's measurements: FLOP/s on the calibration unit (one row, and a prompt's
    rows), memory (capped by its --memory-budget), CPU load of other processes (0..1),
    battery, model, loaded units and the plan they belong to, the measured time per step of
    its stage and per decode token of each unit it ran, the memory its units and their K/V
    occupy, and, on a head, what its answers measured."""

    id: str
    flops: float
    memory_total: int
    memory_available: int
    load: float
    battery: Battery | None
    model: str | None
    units: tuple[int, ...]
    plan: str | None = None  # the plan (its key) whose units are loaded, once ready
    stage_s: float | None = None  # recent seconds per step of this peer's stage
    unit_times: UnitTimes | None = None
    answers: AnswerFigures | None = None
    memory_used: int = 0  # bytes its loaded units' weights and their K/V occupy now
    prompt_flops: float = 0.0  # FLOP/s on a prompt's rows (benchmark.PROMPT_ROWS); 0: unknown

    def __post_init__(self):
        _require(self.flops >= 0 and self.prompt_flops >= 0, "figures: negative flops")
        _require(0 <= self.memory_available <= self.memory_total, "figures: bad memory")
        _require(self.memory_used >= 0, "figures: negative memory used")
        _require(0 <= self.load <= 1, "figures: load outside 0..1")


@dataclasses.dataclass(frozen=True)
class LinkFigures:
    """Measured from ``source`` to ``target``: one-way latency and bandwidth."""

    source: str
    target: str
    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self):
        _require(self.latency_s >= 0 and self.bandwidth_Bps > 0, "link: bad figures")


@message("measure")
@dataclasses.dataclass(frozen=True)
class MeasureRequest(Asks["Measurement"]):
    """The leader of ``epoch`` asks for the receiver's PeerFigures."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    epoch: int


@message("measurement")
@dataclasses.dataclass(frozen=True)
class Measurement:
    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    figures: PeerFigures


@message("probe")
@dataclasses.dataclass(frozen=True)
class ProbeRequest(Asks["ProbeReport"]):
    """The leader of ``epoch`` asks the receiver to measure its links to ``targets``, sending
    ``payload_bytes`` to each for the bandwidth."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    epoch: int
    targets: tuple[str, ...]
    payload_bytes: int

    def __post_init__(self):
        _require(0 < self.payload_bytes <= MAX_PROBE_BYTES, "probe: payload size out of range")


@message("probe-report")
@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """The links the receiver of a ProbeRequest could measure (unreachable targets omitted)."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    links: tuple[LinkFigures, ...]


@message("ping")
@dataclasses.dataclass(frozen=True)
class Ping(Asks["Pong"]):
    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int


@message("pong")
@dataclasses.dataclass(frozen=True)
class Pong:
    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int


@message("relay", channel=DATA)
@dataclasses.dataclass(frozen=True)
class Relay(Asks["Relayed"]):
    """A round trip between the two peers' worker threads, the way a stage's tensors go
    (the data path's latency): sent from a worker thread of the asker, answered from one of
    the receiver's."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int


@message("relayed", channel=DATA)
@dataclasses.dataclass(frozen=True)
class Relayed:
    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int


@message("bandwidth", channel=DATA)
@dataclasses.dataclass(frozen=True)
class BandwidthProbe(Asks["BandwidthAck"]):
    """A timed bulk transfer: one uint8 tensor named ``payload``."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    tensors: Tensors

    def __post_init__(self):
        payload = _sole_tensor(self.tensors, "payload", "bandwidth")
        _require(payload.dtype == np.uint8, "bandwidth: payload is not uint8")
        _require(payload.nbytes <= MAX_PROBE_BYTES, "bandwidth: payload too large")


@message("bandwidth-ack", channel=DATA)
@dataclasses.dataclass(frozen=True)
class BandwidthAck:
    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    received: int


@message("cluster-report")
@dataclasses.dataclass(frozen=True)
class ClusterReport:
    """The leader of ``epoch`` shares its latest measurements of every peer and link."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    epoch: int
    peers: tuple[PeerFigures, ...]
    links: tuple[LinkFigures, ...]


# -- Deployment: the model's manifest, plans, and unit files --------------------------------
# (peerd/control/coordinator.py on the leader, peerd/control/deploy.py and
# peerd/control/unit_transfer.py on every peer, peerd/control/model_host.py on the peer started with
# --model)

MAX_CHUNK_BYTES = 16 * 1024 * 1024
_HEX_DIGITS = frozenset("0123456789abcdef")


def _require_sha256(value: str, where: str) -> None:
    _require(len(value) == 64 and set(value) <= _HEX_DIGITS, f"{where}: not a sha256 digest")


@message("manifest-request")
@dataclasses.dataclass(frozen=True)
class ManifestRequest(Asks["ManifestOffer"]):
    """The leader of ``epoch`` asks a model peer for its manifest; ``have`` is the key of the
    manifest it already holds, which the answer then leaves out."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    epoch: int
    have: str | None


@message("manifest-offer")
@dataclasses.dataclass(frozen=True)
class ManifestOffer:
    """A model peer's sharding ``state`` (``detail``: the last progress line, or the error);
    once ``ready``, the manifest's ``key`` and, unless the asker has it, the manifest itself
    (the map of ``manifest.json``)."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    model: str
    state: str
    detail: str
    key: str | None
    manifest: dict[str, Any] | None

    def __post_init__(self):
        _require(self.state in OFFERED_MODEL_STATES,
                 f"manifest-offer: unknown state {self.state!r}")
        _require((self.key is not None) == (self.state == ModelState.READY),
                 "manifest-offer: a key comes with state ready, and only then")
        _require(self.manifest is None or self.key is not None,
                 "manifest-offer: a manifest without a key")


@dataclasses.dataclass(frozen=True)
class PlanShare:
    """A peer's share of a group stage: ``weight`` of every layer half, relative to the
    other shares' (shards.share_split splits by these)."""

    peer: str
    weight: float

    def __post_init__(self):
        _require(math.isfinite(self.weight) and self.weight > 0,
                 "plan share: weight must be a positive number")


@dataclasses.dataclass(frozen=True)
class PlanStage:
    """``peer`` runs units ``first`` to ``last`` (inclusive), and holds ``copies`` of
    neighbouring stages' units loaded beside them: the overlap plan's movable copies
    (LinguaLinked Eq. 6-7), so that a boundary moving onto this peer loads no weights.
    A group stage lists its ``shares`` (tensor-parallel, docs/architecture.md), the lead,
    ``peer``, first; a one-peer stage has none."""

    peer: str
    first: int
    last: int
    copies: tuple[int, ...] = ()
    shares: tuple[PlanShare, ...] = ()

    def __post_init__(self):
        _require(0 <= self.first <= self.last, "plan stage: bad unit range")
        _require(all(u >= 0 and not self.first <= u <= self.last for u in self.copies),
                 "plan stage: a copy of a unit of its own range")
        _require(not self.shares or (len(self.shares) >= 2 and self.shares[0].peer == self.peer),
                 "plan stage: a group has two shares or more, the lead's first")
        _require(len(set(self.peers)) == len(self.peers), "plan stage: a peer with two shares")
        _require(not (self.shares and self.copies), "plan stage: a group holds no copies")

    @property
    def peers(self) -> tuple[str, ...]:
        """Every peer serving the stage, the lead first."""
        return tuple(s.peer for s in self.shares) or (self.peer,)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(s.weight for s in self.shares)


@dataclasses.dataclass(frozen=True)
class PlanFigures:
    """What the planner predicts for a plan."""

    latency_s: float
    throughput_tps: float
    bottleneck_s: float


@dataclasses.dataclass(frozen=True)
class PlanRebalance:
    """Why load or battery moved work: ``reason``, the predicted ``gain`` (current / new - 1;
    None when the old plan no longer held), and whether it re-planned over every peer
    (``full``) or moved boundaries."""

    reason: str
    gain: float | None
    full: bool


@message("plan")
@dataclasses.dataclass(frozen=True)
class PlanAssignment:
    """Plan ``plan_id`` of the leader of ``epoch``, sent to every member.

    ``stages`` cover the manifest's units in order, the first on ``model_peer``, which serves
    the unit files. A peer loads the units of its own stage; a peer without one unloads. No
    stages means that no plan is possible now, and ``problem`` says why.
    """

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    epoch: int
    plan_id: int
    stages: tuple[PlanStage, ...]
    model: str | None
    model_peer: str | None
    manifest: dict[str, Any] | None
    objective: str
    solver: str
    predicted: PlanFigures | None
    problem: str | None
    reason: str = ""  # why the leader made it
    rebalance: PlanRebalance | None = None  # set when load or battery moved work

    def __post_init__(self):
        _require(self.epoch > 0 and self.plan_id > 0, "plan: epoch and plan_id must be positive")
        if not self.stages:
            _require(self.problem is not None, "plan: neither stages nor a problem")
            return
        _require(self.problem is None, "plan: stages and a problem")
        _require(
            None not in (self.model, self.model_peer, self.manifest, self.predicted),
            "plan: stages without a model, model peer, manifest or prediction",
        )
        first = self.stages[0]
        _require(first.peer == self.model_peer and first.first == 0,
                 "plan: the first stage must start at unit 0 on the model peer")
        for before, after in zip(self.stages, self.stages[1:], strict=False):
            _require(after.first == before.last + 1, "plan: stages do not follow each other")
        peers = [p for s in self.stages for p in s.peers]
        _require(len(set(peers)) == len(peers), "plan: a peer holds two stages")

    @property
    def peers(self) -> tuple[str, ...]:
        """Every peer serving a stage (a group's members too), in stage order."""
        return tuple(p for s in self.stages for p in s.peers)

    @property
    def key(self) -> str:
        """The plan's name on the data plane (``StageData.plan``): unique across leaders."""
        return f"{self.epoch}.{self.plan_id}"


@message("deploy-report")
@dataclasses.dataclass(frozen=True)
class DeployReport:
    """A peer's progress on plan ``plan_id`` of ``epoch``, sent to that leader: ``received``
    of ``total`` bytes of unit files fetched, then ``ready`` with the ``units`` it loaded, or
    ``failed`` with the reason in ``detail``."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    epoch: int
    plan_id: int
    state: str
    units: tuple[int, ...]
    received: int
    total: int
    detail: str

    def __post_init__(self):
        _require(self.state in REPORTED_DEPLOY_STATES,
                 f"deploy-report: unknown state {self.state!r}")
        _require(0 <= self.received <= self.total, "deploy-report: bad byte counts")


@message("unit-chunk-request", channel=DATA)
@dataclasses.dataclass(frozen=True)
class UnitChunkRequest(Asks["UnitChunk | UnitRefused"]):
    """Asks the model peer for ``length`` bytes of unit file ``sha256`` from ``offset``."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    sha256: str
    offset: int
    length: int

    def __post_init__(self):
        _require_sha256(self.sha256, "unit-chunk-request")
        _require(self.offset >= 0, "unit-chunk-request: negative offset")
        _require(0 < self.length <= MAX_CHUNK_BYTES, "unit-chunk-request: length out of range")


@message("unit-chunk", channel=DATA)
@dataclasses.dataclass(frozen=True)
class UnitChunk:
    """Bytes from ``offset`` of unit file ``sha256`` (``size`` bytes in all), as one 1-D
    uint8 tensor named ``data``."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    sha256: str
    offset: int
    size: int
    tensors: Tensors

    def __post_init__(self):
        _require_sha256(self.sha256, "unit-chunk")
        data = _sole_tensor(self.tensors, "data", "unit-chunk")
        _require(data.dtype == np.uint8 and data.ndim == 1, "unit-chunk: data is not 1-D uint8")
        _require(0 < data.nbytes <= MAX_CHUNK_BYTES, "unit-chunk: chunk size out of range")
        _require(self.offset >= 0 and self.offset + data.nbytes <= self.size,
                 "unit-chunk: chunk outside the file")


@message("unit-refused", channel=DATA)
@dataclasses.dataclass(frozen=True)
class UnitRefused:
    """The model peer cannot serve a chunk request, and ``reason`` says why."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    reason: str


@message("shares-request", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SharesRequest(Asks["SharesOffer"]):
    """A member of a group stage asks the model peer for the share units of units
    ``first``..``last`` of manifest ``model`` split by ``weights`` (its plan stage's); the
    model peer exports them the first time it is asked (``SharesOffer.state`` "exporting")."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    model: str
    first: int
    last: int
    weights: tuple[float, ...]

    def __post_init__(self):
        _require(0 <= self.first <= self.last, "shares-request: bad unit range")
        _require(2 <= len(self.weights) <= MAX_TENSORS
                 and all(math.isfinite(w) and w > 0 for w in self.weights),
                 "shares-request: weights must be two or more positive numbers")


@dataclasses.dataclass(frozen=True)
class ShareFile:
    """A file of a share unit, fetched like a unit's (``UnitChunkRequest`` by sha256)."""

    name: str
    sha256: str
    bytes: int

    def __post_init__(self):
        _require_sha256(self.sha256, "share file")
        _require(self.bytes >= 0, "share file: negative size")


@dataclasses.dataclass(frozen=True)
class ShareUnitFiles:
    """The share unit of share ``share`` of a layer's ``half`` ("attn" or "mlp"): its ONNX
    model, then its data file, and its input and output names."""

    layer: int
    half: str
    share: int
    files: tuple[ShareFile, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __post_init__(self):
        _require(self.half in ("attn", "mlp"), f"share unit: unknown half {self.half!r}")
        _require(self.layer >= 0 and self.share >= 0 and len(self.files) >= 1,
                 "share unit: negative layer or share, or no files")


@message("shares-offer", channel=DATA)
@dataclasses.dataclass(frozen=True)
class SharesOffer:
    """The model peer's answer to ``SharesRequest``: ``state`` "exporting" (``detail``: the
    last progress line), "failed" (``detail``: why) or "ready", with every share's ``units``,
    whether the residual branch starts from the normed state (BLOOM), the norms' ``eps``, and
    each layer half's pre-norm as tensors "norm.<layer>.<half>.weight" (and ".bias")."""

    KIND: ClassVar[str]
    CHANNEL: ClassVar[str]
    req: int
    state: str
    detail: str
    units: tuple[ShareUnitFiles, ...] = ()
    residual_post_norm: bool = False
    eps: float = 0.0
    tensors: Tensors = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _require(self.state in set(ExportState), f"shares-offer: unknown state {self.state!r}")
        _require(self.state == ExportState.READY or not self.units,
                 "shares-offer: units before ready")


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for a registered message: a msgpack header, then one frame per tensor."""
    kind = getattr(type(msg), "KIND", None)
    if kind not in _REGISTRY or _REGISTRY[kind] is not type(msg):
        raise TypeError(f"not a registered message: {type(msg).__name__}")
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind}
    frames: list[bytes | memoryview] = []
    tensor_fields = _tensor_fields(type(msg))
    for field in dataclasses.fields(msg):
        value = getattr(msg, field.name)
        if field.name in tensor_fields:
            header[field.name], more = _tensor_frames(value)
            frames.extend(more)
        else:
            header[field.name] = _plain(value)
    # msgpack has no type hints; its pure-Python fallback's `pack` reads as Optional
    packed: bytes = msgpack.packb(header, use_bin_type=True)  # pyright: ignore[reportAssignmentType]
    return [packed, *frames]


def _plain(value: Any) -> Any:
    """Nested dataclasses as maps, tuples as lists: what msgpack can carry."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _tensor_frames(tensors: Tensors) -> tuple[list[list[Any]], list[bytes | memoryview]]:
    specs: list[list[Any]] = []
    frames: list[bytes | memoryview] = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = array.dtype.name
        if dtype not in WIRE_DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {dtype} cannot travel on the wire")
        specs.append([name, dtype, list(array.shape)])
        frames.append(array.reshape(-1).view(np.uint8).data)  # also when empty
    return specs, frames


def decode(frames: Sequence[bytes | memoryview | Any]) -> Message:
    """The message carried by these frames, or ProtocolError saying what is wrong."""
    if not frames:
        raise ProtocolError("empty message")
    buffers = [_buffer(frame) for frame in frames]
    total = sum(len(b) for b in buffers)
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {total} bytes exceeds {MAX_MESSAGE_BYTES}")
    header = _unpack_header(buffers[0])
    kind = header.pop("kind", None)
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("unknown message kind")
    frames_left = buffers[1:]
    for name in _tensor_fields(cls):
        if name in header:
            header[name], frames_left = _decode_tensors(name, header[name], frames_left)
    if frames_left:
        raise ProtocolError(f"{cls.KIND}: {len(frames_left)} frames no tensor field lists")
    return _build(cls, header, cls.KIND)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _tensor_fields(cls: type) -> tuple[str, ...]:
    """The fields of a message class that carry tensors, in order."""
    hints = _hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if hints[f.name] == Tensors)


def _build(cls: type, header: dict, where: str) -> Any:
    """An instance of dataclass ``cls`` from a decoded map, every field checked."""
    values: dict[str, Any] = {}
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        if field.name not in header:
            if field.default is not dataclasses.MISSING:
                continue
            raise ProtocolError(f"{where}: missing field {field.name!r}")
        value = header.pop(field.name)
        values[field.name] = (
            value if field.name in _tensor_fields(cls)
            else _check(value, hints[field.name], field.name)
        )
    if header:
        raise ProtocolError(f"{where}: unexpected fields {sorted(map(str, header))}")
    try:
        return cls(**values)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _buffer(frame: Any) -> memoryview:
    if hasattr(frame, "buffer"):  # zmq.Frame
        frame = frame.buffer
    return memoryview(frame).cast("B")


def _unpack_header(buffer: memoryview) -> dict:
    if len(buffer) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(buffer)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(buffer, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    version = header.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 == 1.0
        raise ProtocolError(f"not protocol version {PROTOCOL_VERSION}")
    return header


def _decode_tensors(field: str, specs: Any,
                    buffers: list[memoryview]) -> tuple[Tensors, list[memoryview]]:
    """The tensors a field lists, from the first of `buffers`, and the buffers left."""
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError(f"{field}: expected a list of [name, dtype, shape]")
    if len(specs) > len(buffers):
        raise ProtocolError(f"{field}: header lists {len(specs)}, message has {len(buffers)}")
    tensors: Tensors = {}
    for spec, buffer in zip(specs, buffers, strict=False):
        name, dtype, shape = _tensor_spec(spec)
        if name in tensors:
            raise ProtocolError(f"tensor {name!r} sent twice")
        itemsize = np.dtype(dtype).itemsize
        # Bounded with zero dimensions counted as one: numpy refuses an empty array whose
        # other dimensions overflow, with a plain ValueError.
        if math.prod(max(d, 1) for d in shape) * itemsize > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"tensor {name!r}: shape {list(shape)} is too large")
        if math.prod(shape) * itemsize != len(buffer):
            raise ProtocolError(
                f"tensor {name!r}: {len(buffer)} bytes do not fit {dtype}{list(shape)}"
            )
        tensors[name] = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    return tensors, buffers[len(specs):]


def _tensor_spec(spec: Any) -> tuple[str, str, tuple[int, ...]]:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise ProtocolError("tensor spec is not [name, dtype, shape]")
    name, dtype, shape = spec
    if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise ProtocolError(f"tensor spec has a bad name or dtype: {name!r} {dtype!r}")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_RANK
        and all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"tensor {name!r}: bad shape {shape!r}")
    return name, dtype, tuple(shape)


def _check(value: Any, hint: Any, name: str) -> Any:
    """value, if it matches the annotation; lists come back as tuples for tuple hints."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check(value, option, name)
            except ProtocolError:
                continue
        raise ProtocolError(f"field {name!r}: {type(value).__name__} is not {hint}")
    if hint is Any:
        return value
    if hint is type(None):
        if value is None:
            return None
    elif origin in (list, tuple):
        if isinstance(value, list):
            item = typing.get_args(hint)[0]
            items = [_check(v, item, f"{name}[]") for v in value]
            return tuple(items) if origin is tuple else items
    elif origin is dict:
        if isinstance(value, dict):
            key_hint, value_hint = typing.get_args(hint)
            return {
                _check(k, key_hint, f"{name} key"): _check(v, value_hint, f"{name}[{k!r}]")
                for k, v in value.items()
            }
    elif hint is float:
        if type(value) in (int, float) and math.isfinite(value):
            return float(value)
    elif hint in (int, str, bool, bytes):
        if type(value) is hint:
            return value
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return _build(hint, dict(value), name)
    else:
        raise TypeError(f"field {name!r}: annotation {hint} is not supported on the wire")
    raise ProtocolError(f"field {name!r}: {type(value).__name__} is not {hint}")
