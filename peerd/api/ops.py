"""The local API's operations (`status`, `stop`, `subscribe`, `chat`, `rebalance`) and the
status document they read. Reading status changes nothing: it only reads each room's state
through its getters."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from peerd.api import status
from peerd.api.local_api import EventBus, Op, Send
from peerd.cluster.measuring import Measuring
from peerd.cluster.peers import ClusterView
from peerd.control.plans import Plans
from peerd.errors import PeerdError
from peerd.inference.serving import Serving

if TYPE_CHECKING:
    from peerd.api.openai_api import OpenAiApi  # imported by the daemon only when served


@dataclasses.dataclass(frozen=True)
class Rooms:
    """What the status document reads."""

    cluster: ClusterView
    measuring: Measuring
    plans: Plans
    serving: Serving
    openai: OpenAiApi | None


def status_document(me: status.SelfInfo, counters: status.Counters,
                    rooms: Rooms) -> dict[str, Any]:
    report = rooms.measuring.report
    plans = rooms.plans
    document = status.build(
        me, rooms.cluster.membership, rooms.cluster.election, report, counters,
        plans.plan_document(report, rooms.serving.answer_figures()), plans.model_status(report),
    )
    document["deployment"] = plans.deployment.status()
    document["history"] = rooms.measuring.history.document()
    document["rebalance"] = plans.coordinator.policy is not None
    document["replan_pending"] = plans.replan_pending
    document["dataplane"] = rooms.serving.status()
    document["torch_imported"] = "torch" in sys.modules
    document["openai"] = rooms.openai.status() if rooms.openai is not None else None
    return document


class LocalOps:
    def __init__(self, status: Callable[[], dict[str, Any]], events: EventBus, chat: Op,
                 set_rebalancing: Callable[[bool], None], stop: Callable[[], None]):
        self._status = status
        self._events = events
        self.chat = chat
        self._set_rebalancing = set_rebalancing
        self._stop = stop

    def table(self) -> dict[str, Op]:
        return {"status": self.status, "stop": self.stop, "subscribe": self.subscribe,
                "chat": self.chat, "rebalance": self.rebalance}

    async def status(self, request: dict[str, Any], send: Send) -> None:
        await send({"ok": True, "status": self._status()})

    async def rebalance(self, request: dict[str, Any], send: Send) -> None:
        enabled = request.get("enabled")
        if not isinstance(enabled, bool):
            raise PeerdError('"enabled" must be true or false')
        self._set_rebalancing(enabled)
        await send({"ok": True, "rebalance": enabled})

    async def stop(self, request: dict[str, Any], send: Send) -> None:
        await send({"ok": True, "stopping": True})
        self._stop()

    async def subscribe(self, request: dict[str, Any], send: Send) -> None:
        with self._events.subscription() as (past, queue):
            await send({"ok": True, "subscribed": True})
            for event in past:
                await send(event)
            while True:
                await send(await queue.get())
