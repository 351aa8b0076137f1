"""What the head's answers measure: latency of an answer alone, tokens/s while answering."""

from __future__ import annotations

import pytest

from peerd.inference.answer_clock import AnswerClock


def test_tokens_that_come_together_share_their_interval():
    """A speculative check gives several tokens at once: each has its share of the time
    since the last token, and the head's figures stay valid (a latency above 0)."""
    clock = AnswerClock()
    clock.begin(0.0, idle=True)
    clock.token(0.1, None, alone=True)
    for now in (0.13, 0.16):
        for _ in range(3):
            clock.token(now, 0.01, alone=True)
    clock.token(0.16, 0.0, alone=True)  # within one tick of the clock: no interval
    figures = clock.figures("1.1")
    assert figures.latency_s == pytest.approx(0.01)
    assert figures.tokens == 7


def test_latency_counts_lone_answers_and_throughput_every_decoded_token():
    clock = AnswerClock()
    assert clock.figures("1.1").latency_s is None
    clock.begin(10.0, idle=True)
    clock.token(10.5, None, alone=True)  # the prefill's token starts no interval
    for now in (10.51, 10.52, 10.53):
        clock.token(now, 0.01, alone=True)
    clock.begin(20.0, idle=True)  # an idle 10 s does not count as answering
    clock.token(20.2, None, alone=False)
    clock.token(20.21, 0.02, alone=False)  # two answers at once: tokens every 10 ms
    clock.token(20.22, 0.02, alone=False)
    figures = clock.figures("1.1")
    assert figures.plan == "1.1" and figures.tokens == 5
    assert figures.latency_s == pytest.approx(0.01)
    assert figures.throughput_tps == pytest.approx(100)
