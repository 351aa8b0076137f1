"""Make docs/dashboard.svg: the dashboard of a live three-peer cluster.

    python -m tui.screenshot [OUT.svg]

Starts three daemons on loopback with the built-in model (peerd/commands/local_cluster.py, as
`peerd demo` does) and runs the dashboard headless against the leader. To fill the event log
with what a household sees, one follower's daemon is killed and started again (a laptop
closed and opened: a re-plan that cannot place the model, then a plan over all three again);
then a question is typed into the chat pane, and once the answer and the figures it updates
are in, the screen is saved as SVG.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peerd.commands.local_cluster import LocalCluster
from peerd.errors import PeerdError
from shards.builtin import write_builtin_model
from tui.app import DashboardApp
from tui.widgets.chat import ChatPane

SIZE = (160, 46)
QUESTION = "Tell me a story about the sea."
WAIT_S = 180.0


async def shoot(app: DashboardApp, cluster: LocalCluster, follower: int, out: Path) -> None:
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: app.status, "the first status")
        cluster.kill(follower)
        await _until(pilot, lambda: _stages(app) == 0, "the re-plan without the follower")
        cluster.restart(follower)
        await _until(pilot, lambda: _deployed(app.status) and _stages(app), "the plan over all")
        await pilot.click("#prompt")
        await pilot.press(*QUESTION, "enter")
        pane = app.query_one(ChatPane)
        await _until(pilot, lambda: pane.last_done, "the answer")
        before = app.status
        await _until(pilot, lambda: app.status is not before, "the status after the answer")
        app.save_screenshot(out.name, str(out.parent))


def _stages(app: DashboardApp) -> int | None:
    """How many stages the latest plan event has (None before one arrives)."""
    return len(app.plan_event["stages"]) if app.plan_event else None


def _deployed(status: dict[str, Any] | None) -> bool:
    if status is None:
        return False
    loaded = {p["id"]: p["units"] for p in status["peers"]}
    plan = status["plan"] or {}
    return bool(plan.get("stages")) and all(loaded.get(s["peer"]) == s["units"]
                                            for s in plan["stages"])


async def _until(pilot, condition: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise PeerdError(f"timed out after {WAIT_S:.0f}s waiting for {what}")
        await pilot.pause(0.1)


def _answering(cluster: LocalCluster, i: int) -> dict[str, Any]:
    status = cluster.status(i)
    if status is None:
        raise SystemExit(f"peer {i} of the local cluster does not answer")
    return status


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "docs/dashboard.svg").resolve()
    root = Path(tempfile.mkdtemp(prefix="peerd-shot-"))
    model_dir = write_builtin_model(root / "builtin-model")
    with LocalCluster(root, model_dir, peers=3) as cluster:
        statuses = [_answering(cluster, i) for i in range(cluster.count)]
        leader = [s["self"] for s in statuses].index(statuses[0]["leader"])
        follower = next(i for i in range(1, cluster.count) if i != leader)  # peer0 has the model
        app = DashboardApp(cluster.dirs[leader], chat_max_tokens=48)
        asyncio.run(shoot(app, cluster, follower, out))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
