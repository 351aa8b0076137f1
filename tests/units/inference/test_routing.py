"""Message routes: residuals go straight to their consumers, nearest first, never relayed."""

import pytest

from peerd.inference.routing import Route, routes


@pytest.fixture
def manifest(toy):
    return toy[1]


def test_one_unit_per_stage_sends_the_residual_directly_to_the_last_stage(manifest):
    head, middle, last = routes(manifest, [(0, 0), (1, 1), (2, 2)])
    assert head.sends == (Route(1, ("hidden0", "bias")), Route(2, ("bias",)))
    assert middle.sends == (Route(2, ("hidden1",)),)
    assert last.sends == ()
    assert last.expects == {0: ("bias",), 1: ("hidden1",)}
    assert middle.expects == {0: ("hidden0", "bias")}
    assert last.returns == ("logits",)
    assert head.returns == middle.returns == ()


def test_a_residual_consumed_inside_the_producing_stage_is_not_sent_to_the_next(manifest):
    head, last = routes(manifest, [(0, 0), (1, 2)])
    assert head.sends == (Route(1, ("hidden0", "bias")),)
    assert last.expects == {0: ("hidden0", "bias")}


def test_a_single_stage_sends_nothing_and_returns_the_logits(manifest):
    (only,) = routes(manifest, [(0, 2)])
    assert (only.sends, only.expects, only.returns) == ((), {}, ("logits",))


@pytest.mark.parametrize(
    "ranges, reason",
    [
        ([(0, 0), (2, 2)], "expected 1"),
        ([(0, 1)], "cover 2 units"),
        ([(0, 2), (3, 3)], "cover 4 units"),
    ],
)
def test_ranges_that_do_not_cover_the_units_in_order_are_refused(manifest, ranges, reason):
    with pytest.raises(ValueError, match=reason):
        routes(manifest, ranges)
