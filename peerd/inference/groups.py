"""A group stage on daemons: each member runs its share's schedule (peerd.inference.shares),
its `ShareData` going straight to the other members over the data channel.

The lead (`GroupLead`, the stage's runner in its DataPlane) takes the stage's StageData as a
one-peer stage does; for each step it hands every other member the step's inputs
(`ShareStep`), then runs its own share. A member (`GroupMember`) runs its share of each step
it is handed, in order, on its compute thread. The schedule runs on the compute thread; at
each exchange it hands its messages to the event loop to send (`Transport.deliver`) without
waiting for them, and blocks the compute thread until the messages it waits for have come
(`Mailbox`, filled by the event loop as they arrive), so the event loop keeps serving
meanwhile. The lead's share answers the stage's outputs, which its DataPlane sends on as
any stage's. K/V stays with each member's share. A member that does not send within
`timeout_s`, or a send of this peer's that fails, fails the step with `GroupLost`, a
TransportError: the data plane treats it as a lost peer (the plan re-plans once the leader
notices, and answers re-prefill on the next plan). `ShareDrop` frees a sequence on the
members when the lead drops it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from peerd.inference.shares import (
    Exchange,
    ExchangeKey,
    ShareRunner,
    ShareTag,
    Tensors,
    drive,
    one_by_one,
    sent_key,
)
from peerd.wire.protocol import Message, ShareData, ShareDrop, ShareStep
from peerd.wire.transport import Transport, TransportError
from shards.executor import Outcome
from shards.manifest import Manifest

log = logging.getLogger("peerd.inference.groups")

StepKey = tuple[str, int]  # seq_id, step
GROUP_TIMEOUT_S = 10.0  # a member's message of a step comes within this, or it is lost


class GroupLost(TransportError):
    """A member of the group did not send its part of a step in time (or the group closed)."""


class Mailbox:
    """The ShareData of a member's steps that have come, until its schedule takes them."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._held: dict[ExchangeKey, ShareData] = {}
        self._closed = False
        self._failures: dict[StepKey, GroupLost] = {}  # of steps whose sends failed

    def put(self, message: ShareData) -> None:
        key = sent_key(message)
        with self._ready:
            self._held[key] = message
            self._ready.notify_all()

    def take(self, tag: ShareTag, senders: Sequence[int], timeout_s: float
             ) -> dict[int, ShareData]:
        """The messages of exchange `tag` from `senders`, waiting at most `timeout_s`."""
        keys = {s: tag.from_sender(s) for s in senders}
        with self._ready:
            come = self._ready.wait_for(
                lambda: self._closed or (tag.seq_id, tag.step) in self._failures
                or all(k in self._held for k in keys.values()), timeout_s)
            if self._closed:
                raise GroupLost("the group stage closed")
            if (failure := self._failures.pop((tag.seq_id, tag.step), None)) is not None:
                raise failure
            if not come:
                missing = [s for s, k in keys.items() if k not in self._held]
                raise GroupLost(f"share(s) {missing} sent no {tag.phase} of unit {tag.unit} "
                                f"in {timeout_s:g}s")
            return {s: self._held.pop(k) for s, k in keys.items()}

    def forget(self, seq_id: str) -> None:
        with self._ready:
            for key in [k for k in self._held if k[0] == seq_id]:
                del self._held[key]
            for step in [s for s in self._failures if s[0] == seq_id]:
                del self._failures[step]

    def fail(self, step: StepKey, failure: GroupLost) -> None:
        """Fail the wait of `step` in progress, or its next one, and no other step's: a
        step that waits for nothing more is done here (its receiver's own wait fails it
        there), and the link may have come back for the later steps. Held until the step
        waits again or its sequence is forgotten."""
        with self._ready:
            self._failures[step] = failure
            self._ready.notify_all()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()


class _Share:
    """This peer's share of a group stage on the daemons: its runner and its exchanges."""

    def __init__(self, runner: ShareRunner, group: Sequence[str], transport: Transport,
                 timeout_s: float) -> None:
        self.runner, self.group, self.transport = runner, tuple(group), transport
        self.timeout_s = timeout_s
        self.mailbox = Mailbox()
        self.loop = asyncio.get_running_loop()
        self._sending: set[asyncio.Task] = set()

    def run(self, seq_id: str, step: int, inputs: Tensors,
            rows: int | None = None) -> Tensors | None:
        """This share's part of the step, on the compute thread."""
        return drive(self.runner.schedule(seq_id, step, inputs, rows), self._exchange)

    def _exchange(self, exchange: Exchange) -> dict[int, ShareData]:
        if exchange.sends:
            self.loop.call_soon_threadsafe(self._post, exchange.sends)
        return self.mailbox.take(exchange.tag, exchange.expects, self.timeout_s)

    def _post(self, sends: Sequence[tuple[int, ShareData]]) -> None:
        """Send a round's ShareData without holding up the compute thread: waiting for
        each send held it 2.5-2.9 ms (the event loop's turn and the encoding), 48 times in
        a 512-token prefill, while its next tile could run. The mailbox keys messages by
        tag, so their order does not matter; a send that fails fails its step's next wait."""
        task = self.loop.create_task(self.send(sends))
        self._sending.add(task)
        _, first = sends[0]
        task.add_done_callback(functools.partial(self._sent, (first.seq_id, first.step)))

    def _sent(self, step: StepKey, task: asyncio.Task) -> None:
        self._sending.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self.mailbox.fail(step, GroupLost(f"a share's data was not sent: {error}"))

    def call(self, coroutine) -> None:
        """Run `coroutine` on the event loop and wait for it (from the compute thread)."""
        asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(self.timeout_s * 2)

    async def send(self, sends: Sequence[tuple[int, Message]]) -> None:
        for share, message in sends:
            await self.transport.deliver(self.group[share], message, self.timeout_s)

    def receive(self, sender: str, message: ShareData) -> None:
        if message.share >= len(self.group) or self.group[message.share] != sender:
            log.warning("dropped share data of share %d from %s: not that share's peer",
                        message.share, sender)
            return
        self.mailbox.put(message)

    def close(self) -> None:
        self.mailbox.close()


class GroupLead:
    """The lead's runner of a group stage, in its DataPlane (a StageWorker's executor)."""

    def __init__(self, runner: ShareRunner, group: Sequence[str], transport: Transport,
                 plan: str, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self.share = _Share(runner, group, transport, timeout_s)
        self.runner, self.plan = runner, plan
        self.first, self.last = runner.first, runner.last
        self.exit = None  # no early exit on groups (yet)
        self._steps: dict[str, int] = {}

    @property
    def manifest(self) -> Manifest:
        return self.runner.manifest

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(self.runner.inputs)

    @property
    def holds_state(self) -> bool:
        return self.runner.holds_state

    @property
    def group(self) -> tuple[str, ...]:
        return self.share.group

    def step_many(self, steps: Sequence[tuple[str, Tensors]],
                  unit_s: dict[int, float] | None = None,
                  rows: Mapping[str, int] | None = None) -> list[Outcome]:
        return one_by_one(self._step, steps, rows)

    def _step(self, seq_id: str, inputs: Tensors, rows: int | None) -> Tensors:
        """One step, handed to the members first."""
        step = self._steps.get(seq_id, 0)
        self._steps[seq_id] = step + 1
        handed = ShareStep(self.plan, seq_id, step, dict(inputs))
        self.share.call(self.share.send([(i, handed) for i in range(1, len(self.group))]))
        outputs = self.share.run(seq_id, step, inputs, rows)
        assert outputs is not None  # the lead is share 0, which answers for the stage
        return outputs

    def length(self, seq_id: str) -> int:
        return self.runner.length(seq_id)

    def truncate(self, seq_id: str, length: int) -> None:
        if length < self.runner.length(seq_id):
            raise ValueError("a group stage cannot go back to an earlier position")

    def drop(self, seq_id: str) -> None:
        self._steps.pop(seq_id, None)
        self.runner.drop(seq_id)
        self.share.mailbox.forget(seq_id)
        for peer in self.group[1:]:
            self.share.loop.call_soon_threadsafe(
                self.share.transport.send, peer, ShareDrop(self.plan, seq_id))

    @property
    def sequence_count(self) -> int:
        return self.runner.sequence_count

    def kv_bytes(self) -> int:
        return self.runner.kv_bytes()

    # what a one-peer stage does with its K/V that a group does not (yet): the data plane
    # then re-prefills instead (a fork, a move to another plan)
    def fork(self, source: str, seq_id: str, length: int) -> None:
        raise ValueError("a group stage does not fork sequences")

    def export_state(self, seq_id: str, unit: int) -> Tensors:
        raise KeyError(f"a group stage does not move the K/V of {seq_id}")

    def import_state(self, seq_id: str, unit: int, tensors: Tensors) -> None:
        raise ValueError("a group stage does not take moved K/V")

    def exit_logits(self, hidden) -> None:
        raise ValueError("a group stage has no early exit")

    def handle(self, sender: str, message: Message) -> None:
        match message:
            case ShareData():
                self.share.receive(sender, message)
            case _:
                log.warning("dropped %s from %s: the lead of a group takes share data only",
                            message.KIND, sender)

    def close(self) -> None:
        self.share.close()


class GroupMember:
    """A member (not the lead) of a group stage: runs its share of each step handed to it."""

    def __init__(self, runner: ShareRunner, group: Sequence[str], transport: Transport,
                 plan: str, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        # built on the event loop (its messages come there)
        self.share = _Share(runner, group, transport, timeout_s)
        self.runner, self.plan = runner, plan
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"share{runner.index}")
        self.closed = False

    def handle(self, sender: str, message: Message) -> None:
        """A share message of this plan: steps and drops come from the lead alone."""
        from_lead = sender == self.share.group[0]
        match message:
            case ShareData():
                self.share.receive(sender, message)
            case ShareStep() if from_lead and not self.closed:
                self._compute.submit(self._run, message)
            case ShareDrop() if from_lead and not self.closed:  # after the steps handed before
                self._compute.submit(self._drop, message)
            case ShareStep() | ShareDrop() if from_lead:  # the stage closed meanwhile
                pass
            case _:
                log.warning("dropped %s from %s: not for share %d", message.KIND, sender,
                            self.runner.index)

    def _run(self, message: ShareStep) -> None:
        try:
            self.share.run(message.seq_id, message.step, message.tensors)
        except Exception as exc:  # the lead's wait for this share fails the step there
            log.warning("share %d of step %d of %s failed: %s", self.runner.index,
                        message.step, message.seq_id, exc)

    def _drop(self, message: ShareDrop) -> None:
        self.runner.drop(message.seq_id)
        self.share.mailbox.forget(message.seq_id)

    @property
    def sequence_count(self) -> int:
        return self.runner.sequence_count

    def close(self) -> None:
        self.closed = True
        self.share.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
