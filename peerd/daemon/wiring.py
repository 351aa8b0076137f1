"""The daemon (`peerd start`): builds the rooms, starts and stops them, and hands each
incoming message to the room that handles its kind, on one asyncio loop (uvloop when
available). docs/architecture.md maps the rooms:

- peerd/cluster/peers.py: membership and election (`ClusterView`), heartbeats;
- peerd/cluster/measuring.py: the leader's measurement rounds, every peer's latest report;
- peerd/control/plans.py: planning on the leader, deploying on every peer, the model peer;
- peerd/inference/serving.py: data planes and chats, switched by the events of
  peerd/control/plan_live.py (`StageLoaded`, `PlanLive`);
- peerd/api/ops.py: the local API's operations and the status document.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import signal
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peerd import statedir
from peerd.api import openai_settings, ops, status
from peerd.api.local_api import EventBus, LocalApi
from peerd.api.plan_events import plan_events
from peerd.cluster import election, measuring, membership
from peerd.cluster.discovery import MdnsDiscovery, StaticPeers, advertised_addresses
from peerd.cluster.monitor import Monitor, on_mains
from peerd.cluster.peers import ClusterView, Handler
from peerd.cluster.records import PeerRecord
from peerd.control.coordinator import Shapes
from peerd.control.model_host import ModelHost
from peerd.control.plans import Plans
from peerd.daemon.limits import raise_file_limit
from peerd.daemon.sd_notify import Notifier
from peerd.errors import PeerdError
from peerd.inference.serving import Serving
from peerd.wire import protocol
from peerd.wire.identity import ClusterSecret, Identity
from peerd.wire.transport import Incoming, Transport, TransportError
from shards.early_exit import ExitSettings
from shards.manifest import Quant
from shards.source import open_model

if TYPE_CHECKING:
    from peerd.api.openai_api import OpenAiApi

log = logging.getLogger("peerd.daemon.wiring")

SHUTDOWN_STEP_S = 5.0


@dataclasses.dataclass(frozen=True)
class Options:
    state_dir: Path
    interface: str | None = None
    port: int = 0
    memory_budget: int | None = None
    static_peers: tuple[tuple[str, int], ...] = ()
    battery_file: str | None = None
    model: str | None = None
    quant: Quant = Quant.NONE  # the weights of the units made of `model`
    membership_timing: membership.Timing = membership.Timing()
    election_timing: election.Timing = election.Timing()
    measure_interval_s: float = 1.0  # figures from every peer; links every links_interval_s
    links_interval_s: float = 60.0
    probe_bytes: int = measuring.PROBE_BYTES
    fp16_wire: bool = False
    rebalance: bool = True  # as leader, move work when load or battery change
    objective: str = "throughput"  # what this peer's plans optimise while it leads
    shapes: Shapes | None = None  # plan groups too while it leads (None: pipelines)
    openai: openai_settings.Settings | None = None  # the OpenAI-compatible endpoint, if served
    exits: ExitSettings = ExitSettings()  # early exit, when this peer holds the first stage
    standalone: bool = False  # answer from the exit alone while no plan serves


class Daemon:
    def __init__(self, identity: Identity, secret: ClusterSecret, options: Options):
        self.identity, self.secret, self.options = identity, secret, options
        self.instance = secrets.token_hex(4)
        model = Path(options.model) if options.model else None
        self.monitor = Monitor(identity.id, options.memory_budget, options.battery_file,
                               open_model(model).name if model else None)
        self.transport = Transport(
            identity.keys, secret, self._on_message, options.interface, options.port
        )
        self.events = EventBus()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self.cluster = ClusterView(
            identity.id, self.instance, secret, self.transport,
            on_mains(self.monitor.battery.read()), self.events.publish,
            options.membership_timing, options.election_timing,
        )
        self.measuring = measuring.Measuring(
            self.cluster, self.transport, self._own_figures, self._spawn, self.events.publish,
            measuring.Timing(options.measure_interval_s, options.links_interval_s,
                             options.probe_bytes),
        )
        self.serving = Serving(identity.id, self.transport, model, fp16_wire=options.fp16_wire,
                               exits=options.exits, standalone=options.standalone)
        self.plans = Plans(
            self.cluster, self.transport, options.state_dir, model, options.quant,
            options.objective, options.rebalance, self._spawn, self.serving.on_plan,
            on_new_plan=self._publish_plan, on_deployed=self.measuring.remeasure,
            unit_clock=self.serving.unit_clock, exits=options.exits, shapes=options.shapes,
            memory_budget=options.memory_budget,
        )
        self.measuring.on_report(self.plans.watch.measured)
        self.ops = ops.LocalOps(self.status, self.events, self.serving.chat.op_chat,
                                self.plans.set_rebalancing, self.stop)
        self._handlers: dict[type, Handler] = {
            **self.cluster.handlers(), **self.measuring.handlers(), **self.plans.handlers(),
            **self.serving.handlers(),
        }

    @property
    def id(self) -> str:
        return self.identity.id

    # -- lifetime -----------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        self.notifier = Notifier.from_environment()
        raise_file_limit()
        try:
            ports = self.transport.start()
        except TransportError as exc:
            await self.transport.close()
            raise PeerdError(str(exc)) from None
        self.record = self.cluster.record = PeerRecord(
            self.id, self.identity.name, self.instance, self.identity.keys.public,
            ports.hello, ports.control, ports.data,
        )
        self.api = LocalApi(statedir.socket_path(self.options.state_dir), self.ops.table())
        self.openai = self._openai_endpoint()
        self.discovery = MdnsDiscovery(
            self.record, self.secret, self.options.interface, self.cluster.on_record,
            self.cluster.on_departure,
        )
        try:
            await self.api.start()
            if self.openai is not None:
                await self.openai.start()
            await self.discovery.start()
            self._start_loops()
            log.info("peerd %s (%s) started: hello %d, control %d, data %d, instance %s",
                     self.identity.name, self.id, ports.hello, ports.control, ports.data,
                     self.instance)
            self.notifier.ready(f"{self.identity.name} ready: hello {ports.hello}, "
                                f"control {ports.control}, data {ports.data}")
            await self._stopping.wait()
        finally:
            await self._shutdown()

    def _openai_endpoint(self) -> OpenAiApi | None:
        settings = self.options.openai
        if settings is None:
            return None
        # Imported here: aiohttp costs every daemon that does not serve the endpoint 12 MB.
        from peerd.api.openai_api import OpenAiApi, served_model

        return OpenAiApi(self.ops.chat, lambda: served_model(self.plans.deployment), settings)

    def _start_loops(self) -> None:
        self._spawn(self.cluster.heartbeats())
        self._spawn(self.cluster.watch_capability(self.monitor))
        self._spawn(self.measuring.lead(self.plans.solve_and_deploy))
        self._spawn(self.notifier.feed_watchdog())
        if self.plans.model_host is not None:
            self._spawn(self._host_model(self.plans.model_host))
        if self.options.static_peers:
            static = StaticPeers(
                list(self.options.static_peers), self.record, self.secret, self.transport,
                self.cluster.on_record,
            )
            self._spawn(static.run())

    async def _host_model(self, host: ModelHost) -> None:
        """Prepare and serve the model once this peer's speeds are measured: hashing and
        sharding it meanwhile on the same cores halved the prompt figure (a model peer
        pinned to one core measured 104 GFLOP/s against its twin's 202)."""
        # ONNX Runtime failing to measure: watch_capability logs it and tries again
        with contextlib.suppress(Exception):
            await self.monitor.speeds.current()
        await host.run()

    def stop(self) -> None:
        log.info("stopping")
        self._stopping.set()

    async def _shutdown(self) -> None:
        if self.openai is not None:
            await _within("the OpenAI endpoint", self.openai.close())
        self.notifier.stopping()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await _within("the daemon's tasks", asyncio.gather(*tasks, return_exceptions=True),
                      tasks)
        await _within("serving", self.serving.close())
        await _within("deployment and the model host", self.plans.close())
        self.cluster.say_goodbye()
        # mDNS goodbyes; meanwhile the control goodbyes flush
        await _within("discovery", self.discovery.close())
        await _within("the local API", self.api.close())
        await _within("the transport", self.transport.close())
        log.info("stopped")

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    # -- messages -----------------------------------------------------------------------------

    def _on_message(self, incoming: Incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, protocol.Hello):
            self.cluster.hello(incoming)
            return
        member = self.cluster.member_by_key(incoming.sender_key)
        if member is None:
            log.info("dropped %s from a key that is not a member", msg.KIND)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.info("dropped %s from %s: nothing here handles it yet", msg.KIND, member.id)
            return
        handler(member, msg, incoming)

    # -- between the rooms --------------------------------------------------------------------

    async def _own_figures(self) -> protocol.PeerFigures:
        """This peer's readings, with the units it has loaded, its stage's time per step,
        each unit's time per decode token, the memory its units and their K/V occupy and, on
        a head, what its answers measured."""
        deployment = self.plans.deployment
        return dataclasses.replace(
            await self.monitor.figures(), units=deployment.units, plan=deployment.ready_plan,
            stage_s=self.serving.stage_seconds(), unit_times=self.serving.unit_clock.figures(),
            answers=self.serving.answer_figures(),
            memory_used=self.serving.memory_bytes(deployment.executor,
                                                  deployment.copies.values()),
        )

    def _publish_plan(self, plan: protocol.PlanAssignment) -> None:
        for event in plan_events(plan):
            self.events.publish(event)

    def status(self) -> dict[str, Any]:
        me = status.SelfInfo(
            id=self.id,
            name=self.identity.name,
            instance=self.instance,
            cluster=self.secret.cluster_id,
            address=advertised_addresses(self.options.interface)[0],
            ports=dataclasses.asdict(self.transport.ports) if self.transport.ports else {},
        )
        counters = status.Counters(
            ignored_records=self.discovery.ignored,
            refused_handshakes=self.transport.zap.denied,
            malformed_messages=self.transport.malformed,
        )
        rooms = ops.Rooms(self.cluster, self.measuring, self.plans, self.serving, self.openai)
        return ops.status_document(me, counters, rooms)


async def _within(what: str, step, tasks: Sequence[asyncio.Task] = ()) -> None:
    """One step of shutting down, given SHUTDOWN_STEP_S: a stuck step is logged (with the
    tasks still running) and passed over, so `peerd stop` always ends the process."""
    try:
        await asyncio.wait_for(step, SHUTDOWN_STEP_S)
    except TimeoutError:
        stuck = [getattr(task.get_coro(), "__qualname__", task.get_name())
                 for task in tasks if not task.done()]
        log.warning("shutdown: %s did not finish in %gs%s; going on", what, SHUTDOWN_STEP_S,
                    f" ({', '.join(stuck)})" if stuck else "")
