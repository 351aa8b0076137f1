"""The rebalancing policy as a pure state machine (peerd/control/rebalance.py)."""

import math

from peerd.control.rebalance import Look, Policy, State, apply

POLICY = Policy(margin=0.15, sustain_s=3.0, cooldown_s=10.0)


def _look(now, current=1.0, boundaries=None, best=1.0, broken=None) -> Look:
    return Look(now, current, boundaries, best, broken)


def _run(looks, state=State()):  # noqa: B008 - State is frozen
    decisions = []
    for look in looks:
        state, decision = apply(state, POLICY, look)
        decisions.append(decision)
    return state, decisions


def test_a_better_plan_must_hold_for_the_sustain_time_before_it_is_taken():
    _, decisions = _run([_look(t, current=1.3) for t in (100, 101, 102, 102.9, 103.0)])
    assert decisions[:4] == [None] * 4
    assert decisions[4].full and math.isclose(decisions[4].gain, 0.3)


def test_a_gain_below_the_margin_or_one_that_goes_away_starts_the_wait_over():
    looks = [_look(100, current=1.3), _look(102, current=1.1), _look(103, current=1.3),
             _look(105.5, current=1.3), _look(106, current=1.3)]
    _, decisions = _run(looks)
    assert decisions == [None, None, None, None, decisions[4]] and decisions[4] is not None


def test_no_rebalance_within_the_cooldown_of_the_last_change():
    state = State(changed_at=100.0)
    _, decisions = _run([_look(t, current=2.0) for t in (101, 105, 109.9, 110)], state)
    assert decisions[:3] == [None] * 3 and decisions[3] is not None


def test_a_broken_plan_is_replaced_at_once_even_in_the_cooldown():
    state, decision = apply(State(changed_at=100.0), POLICY,
                            _look(100.5, current=math.inf, best=1.0, broken="peer x on 15%"))
    assert decision.full and decision.reason == "peer x on 15%"
    assert state.changed_at == 100.5


def test_moving_boundaries_is_preferred_when_it_reaches_the_margin():
    _, decisions = _run([_look(t, current=1.5, boundaries=1.25, best=1.0) for t in (0, 3)],
                        State(changed_at=-100))
    assert decisions[1].full is False and math.isclose(decisions[1].gain, 0.2)
    _, decisions = _run([_look(t, current=1.5, boundaries=1.4, best=1.0) for t in (0, 3)],
                        State(changed_at=-100))
    assert decisions[1].full is True and math.isclose(decisions[1].gain, 0.5)
