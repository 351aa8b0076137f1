"""Speculative sampling's rule (shards/sampling.py): whatever distribution q a draft comes
from, the token it gives follows the full model's p.

The exact check adds up the rule's parts: a draft x (drawn with q(x)) is kept with
acceptance(p, q, x), else replaced by a draw from residual(p, q, x), so
P(y) = sum_x q(x) [acceptance(x) 1{y = x} + (1 - acceptance(x)) residual_x(y)], which must
be p(y). A second check runs `speculative_token` itself over evenly spaced draws u: it
realises those parts up to one grid cell per breakpoint of its piecewise-constant choice.
"""

from __future__ import annotations

import numpy as np
import pytest

from shards.sampling import (
    Distribution,
    Sampler,
    SamplingParams,
    acceptance,
    distribution,
    residual,
    speculative_token,
)

VOCAB = 12


def _sparse(rng: np.random.Generator, size: int, support: int) -> np.ndarray:
    """A random distribution over `support` random tokens of the vocabulary (top-k like)."""
    out = np.zeros(size)
    out[rng.choice(size, support, replace=False)] = rng.dirichlet(np.ones(support))
    return out


def _cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    dense = [("dense", rng.dirichlet(np.ones(VOCAB)), rng.dirichlet(np.ones(VOCAB)))
             for _ in range(3)]
    sparse = [("top-k supports", _sparse(rng, VOCAB, 3), _sparse(rng, VOCAB, 4))
              for _ in range(3)]
    p_only_some = np.zeros(VOCAB)
    p_only_some[[0, 1]] = [0.7, 0.3]
    q_wider = np.full(VOCAB, 1 / VOCAB)  # mass where p has none
    disjoint_q = np.zeros(VOCAB)
    disjoint_q[[5, 6]] = [0.5, 0.5]  # every draft rejected
    peaked = np.zeros(VOCAB)
    peaked[3] = 1.0
    exit_row, full_row = rng.normal(0, 2, VOCAB), rng.normal(0, 2, VOCAB)
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    processed = Sampler(params)._processed(full_row)
    return [*dense, *sparse,
            ("q where p has none", p_only_some, q_wider),
            ("disjoint supports", p_only_some, disjoint_q),
            ("p equals q", q_wider, q_wider.copy()),
            ("one-hot p", peaked, q_wider),
            ("processed rows", processed, distribution(exit_row, params).dense(VOCAB))]


CASES = _cases()


@pytest.mark.parametrize(("name", "p", "q"), CASES, ids=[c[0] for c in CASES])
def test_the_rule_gives_p_exactly(name, p, q):
    out = np.zeros(VOCAB)
    for x in np.flatnonzero(q):
        keep = acceptance(p, q, x)
        out[x] += q[x] * keep
        if keep < 1:
            out += q[x] * (1 - keep) * residual(p, q, x)
    np.testing.assert_allclose(out, p, atol=1e-12)


@pytest.mark.parametrize(("name", "p", "q"), CASES, ids=[c[0] for c in CASES])
def test_speculative_token_realises_the_rule(name, p, q):
    """Over u on a grid of M midpoints each choice's share is within (breakpoints)/M of
    the rule's probability; a replacement is never the draft."""
    cells = 5_000
    grid = (np.arange(cells) + 0.5) / cells
    tolerance = (VOCAB + 2) / cells
    for x in np.flatnonzero(q):
        keep = acceptance(p, q, x)
        chosen = np.array([speculative_token(p, q, int(x), u) for u in grid])
        shares = np.bincount(chosen, minlength=VOCAB) / cells
        expected = np.zeros(VOCAB) if keep == 1 else (1 - keep) * residual(p, q, x)
        expected[x] += keep
        np.testing.assert_allclose(shares, expected, atol=tolerance)
        assert not (chosen[grid >= keep] == x).any()


def test_a_check_costs_one_draw_per_token_it_gives():
    """A sampled check keeps the drafts up to the first replacement, fills the checks after
    it with the replacement, and uses as many draws as it gives tokens: a sampler resumed
    with `skip` = those tokens continues the same stream."""
    params = SamplingParams(temperature=1.0, top_k=4, seed=3)
    rng = np.random.default_rng(1)
    for trial in range(40):
        rows = rng.normal(0, 1.5, (4, VOCAB))
        proposals = [distribution(rng.normal(0, 1.5, VOCAB), params) for _ in range(3)]
        drafts = [p.draw(rng.random()) for p in proposals]
        sampler = Sampler(params, skip=trial)
        checks, token = sampler.verify(rows, drafts, proposals)
        kept = next((i for i, (d, c) in enumerate(zip(drafts, checks, strict=True)) if d != c),
                    len(drafts))
        assert checks[:kept] == tuple(drafts[:kept])
        assert set(checks[kept:]) <= {token} and (kept == 3 or token != drafts[kept])
        given = kept + 1
        assert sampler(rows[0]) == Sampler(params, skip=trial + given)(rows[0])


def test_distribution_holds_what_the_sampler_draws_from():
    logits = np.random.default_rng(2).normal(0, 1, 50)
    top_k = distribution(logits, SamplingParams(temperature=0.7, top_k=5))
    assert top_k.ids.size == 5 and top_k.ids.dtype == np.int32
    assert set(top_k.ids) == set(np.argsort(-logits)[:5])
    assert distribution(logits, SamplingParams(temperature=0.7)).ids.size == 50
    params = SamplingParams(temperature=0.7, top_p=0.8)
    np.testing.assert_allclose(distribution(logits, params).dense(50),
                               Sampler(params)._processed(logits), atol=1e-6)


def test_a_distribution_draws_by_its_cumulative():
    q = Distribution(np.array([4, 9, 2], np.int32), np.array([0.25, 0.5, 0.25], np.float32))
    assert [q.draw(u) for u in (0.0, 0.24, 0.26, 0.74, 0.76, 0.999)] == [4, 4, 9, 9, 2, 2]
