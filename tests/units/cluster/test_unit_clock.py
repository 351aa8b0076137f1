"""This peer's measured unit times: medians of recent samples, per model."""

from __future__ import annotations

from peerd.cluster.unit_clock import UnitClock


def test_each_unit_reports_the_median_of_its_recent_samples_and_the_stage_overhead():
    clock = UnitClock(window=3)
    assert clock.figures() is None
    clock.record("m", {4: 0.010, 5: 0.020})  # the warm-up: no overhead yet
    assert clock.figures().overhead_s is None
    for seconds in (0.011, 0.500, 0.012):  # one hiccup among them
        clock.record("m", {4: seconds}, overhead_s=0.002)
    figures = clock.figures()
    assert figures.model == "m" and figures.units == (4, 5)
    assert figures.seconds == (0.012, 0.020)  # the window keeps the last 3 of unit 4
    assert figures.overhead_s == 0.002


def test_another_model_starts_over():
    clock = UnitClock()
    clock.record("m", {0: 0.01}, overhead_s=0.001)
    clock.record("n", {7: 0.03})
    figures = clock.figures()
    assert (figures.model, figures.by_unit(), figures.overhead_s) == ("n", {7: 0.03}, None)
