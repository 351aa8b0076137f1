"""Next-token sampling over a logits row, in numpy: greedy, temperature, top-k, top-p.

A `Sampler` owns one random stream per sequence, seeded from the request's seed, and draws
exactly one uniform number per sampled token. Given the same logits it picks the same
tokens, whichever peer or split computed them.

`token_logprobs` reports what the model thought of a step: the log-softmax of the raw logits
(before temperature, top-k or top-p, which shape the draw but not the model's probabilities),
for the chosen token and the most likely ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20
# The floor of a reported log-probability: a token the model rules out (a logit of -inf)
# reads as this, as OpenAI reports it, rather than -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # report each token's log-probability and this many most likely tokens (None: none)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, not {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], not {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be from 0 to {MAX_TOP_LOGPROBS}, not {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks token ids for one sequence."""

    def __init__(self, params: SamplingParams, skip: int = 0) -> None:
        """`skip`: tokens this sequence already sampled, whose draws the stream passes over
        (an answer resumed on another plan continues the stream where it stopped)."""
        self.params = params
        self._rng = np.random.Generator(np.random.PCG64(params.seed))
        if not params.greedy and skip:
            self._rng.random(skip)

    def __call__(self, logits: np.ndarray) -> int:
        """The next token id from a `[vocab]` row of logits."""
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, probs = _candidates(np.asarray(logits, dtype=np.float64), self.params)
        cumulative = np.cumsum(probs)
        draw = self._rng.random() * cumulative[-1]
        position = min(int(np.searchsorted(cumulative, draw, side="right")), len(ids) - 1)
        return int(ids[position])


def _candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids in decreasing probability (ties by id) and their unnormalised weights."""
    order = np.lexsort((np.arange(logits.size), -logits))
    if params.top_k:
        order = order[: params.top_k]
    scaled = logits[order] / params.temperature
    probs = np.exp(scaled - scaled[0])
    if params.top_p < 1.0:
        mass = np.cumsum(probs) / probs.sum()
        keep = int(np.searchsorted(mass, params.top_p, side="left")) + 1
        order, probs = order[:keep], probs[:keep]
    return order, probs


Ranked = list[tuple[int, float]]  # (token id, log-probability), most likely first


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, Ranked]:
    """The log-probability of `token` under a `[vocab]` row of raw logits, and the `top`
    most likely tokens with theirs (most likely first, ties by id)."""
    row = np.asarray(logits, dtype=np.float64)
    shifted = row - row.max()
    logprobs = np.maximum(shifted - np.log(np.exp(shifted).sum()), LOGPROB_FLOOR)
    best: Ranked = []
    top = min(top, row.size)
    if top:
        candidates = np.argpartition(-logprobs, top - 1)[:top]
        ordered = candidates[np.lexsort((candidates, -logprobs[candidates]))]
        best = [(int(i), float(logprobs[i])) for i in ordered]
    return float(logprobs[token]), best
