"""When the leader moves work between peers: the rebalancing policy as a pure state machine.

After every measurement round the leader scores the deployed plan with the fresh figures
(load, battery, memory) and asks the planner for the best plan, first among the plan's own
peers in the plan's own order (only boundaries move: units shift to a ring neighbour, whose
files are usually already cached), then over every peer. `apply(state, look)` decides:

* the deployed plan no longer holds (a peer dropped below the battery threshold, memory
  shrank): rebalance at once;
* a plan predicted better by at least `margin`, seen in every round for `sustain_s`, and the
  last change at least `cooldown_s` ago: rebalance, boundaries only when that reaches the
  margin, else the full plan;
* anything else: keep the plan (a better plan that stops being better starts the wait over).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Policy:
    margin: float = 0.15  # predicted improvement that is worth a transition
    sustain_s: float = 3.0  # how long it must hold
    cooldown_s: float = 10.0  # since the last plan change


@dataclasses.dataclass(frozen=True)
class Look:
    """One round's view: objective values (seconds; lower is better) of the deployed plan
    under fresh figures, of the best boundary move, and of the best plan overall."""

    now: float
    current_s: float
    boundaries_s: float | None  # None: no boundary move is feasible
    best_s: float
    broken: str | None = None  # why the deployed plan no longer holds

    @property
    def best_gain(self) -> float:
        """How much faster the best plan is predicted to be: current / best - 1."""
        return self.current_s / self.best_s - 1


@dataclasses.dataclass(frozen=True)
class State:
    better_since: float | None = None
    changed_at: float = -math.inf


@dataclasses.dataclass(frozen=True)
class Decision:
    full: bool  # re-plan over every peer (False: move boundaries only)
    gain: float  # predicted improvement: current / new - 1
    reason: str


def apply(state: State, policy: Policy, look: Look) -> tuple[State, Decision | None]:
    if look.broken is not None:
        return State(None, look.now), _decide(look, policy, look.broken)
    if look.best_gain < policy.margin:
        return dataclasses.replace(state, better_since=None), None
    since = look.now if state.better_since is None else state.better_since
    waiting = look.now - since < policy.sustain_s
    if waiting or look.now - state.changed_at < policy.cooldown_s:
        return dataclasses.replace(state, better_since=since), None
    return State(None, look.now), _decide(look, policy, None)


def _decide(look: Look, policy: Policy, broken: str | None) -> Decision:
    boundaries = look.boundaries_s
    if boundaries is not None and (
        broken is None and look.current_s / boundaries - 1 >= policy.margin
    ):
        gain = look.current_s / boundaries - 1
        return Decision(False, gain, f"moving boundaries is predicted {gain:.0%} faster")
    gain = look.best_gain if math.isfinite(look.current_s) else math.inf
    why = broken or f"a new plan is predicted {gain:.0%} faster"
    return Decision(True, gain, why)
