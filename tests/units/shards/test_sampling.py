"""Sampling: greedy, temperature, top-k, top-p; seeded and reproducible."""

from __future__ import annotations

import numpy as np
import pytest

from shards.sampling import Sampler, SamplingParams

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], dtype=np.float32))


def _draws(params: SamplingParams, n: int = 2000, logits: np.ndarray = LOGITS) -> np.ndarray:
    sampler = Sampler(params)
    return np.array([sampler(logits) for _ in range(n)])


def test_greedy_takes_the_argmax_and_the_lowest_id_on_ties():
    assert Sampler(SamplingParams())(LOGITS) == 1
    assert Sampler(SamplingParams())(np.array([0.0, 2.0, 2.0], np.float32)) == 1


def test_same_seed_same_tokens_other_seed_other_tokens():
    params = SamplingParams(temperature=1.0, seed=7)
    assert list(_draws(params, 200)) == list(_draws(params, 200))
    assert list(_draws(params, 200)) != list(_draws(SamplingParams(temperature=1.0, seed=8), 200))


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(_draws(SamplingParams(temperature=1.0, seed=1)), minlength=5)
    np.testing.assert_allclose(counts / counts.sum(), np.exp(LOGITS), atol=0.04)


def test_low_temperature_concentrates_on_the_best_token():
    draws = _draws(SamplingParams(temperature=0.05, seed=2), 300)
    assert (draws == 1).mean() > 0.99


def test_top_k_keeps_only_the_k_best():
    draws = _draws(SamplingParams(temperature=1.0, top_k=2, seed=3))
    assert set(draws) == {1, 3}
    assert abs((draws == 1).mean() - 0.4 / 0.7) < 0.04


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.65, seed=4))) == {1, 3}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.75, seed=4))) == {1, 3, 4}


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", -1.0), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5)]
)
def test_bad_parameters_are_refused(field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        SamplingParams(**{field: value})
