"""Next-token sampling over a logits row, in numpy: greedy, temperature, top-k, top-p.

A `Sampler` owns one random stream per sequence, seeded from the request's seed, and draws
exactly one uniform number per sampled token. Given the same logits it picks the same
tokens, whichever peer or split computed them.

Speculative sampling (`speculative_token`, `Sampler.verify`) checks tokens a cheaper model
drafted from its own distribution so that the answer still follows the full model's.

`token_logprobs` reports what the model thought of a step: the log-softmax of the raw logits
(before temperature, top-k or top-p, which shape the draw but not the model's probabilities),
for the chosen token and the most likely ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20
# The floor of a reported log-probability: a token the model rules out (a logit of -inf)
# reads as this, as OpenAI reports it, rather than -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0
# Mixed into the seed of the drafts' random streams, which must not be the sampler's
DRAFT_SALT = 0x5EC


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
        ids, weights = _candidates(np.asarray(logits, dtype=np.float64), self.params)
        return _pick(ids, weights, self._rng.random())

    def verify(self, rows: np.ndarray, drafts: Sequence[int],
               proposals: Sequence[Distribution]) -> tuple[tuple[int, ...], int]:
        """The full model's tokens for a sampled speculative check: `rows` holds the logits
        at the last token and at each draft (`[len(drafts) + 1, vocab]`), `proposals` the
        distributions the drafts were drawn from. Each draft in turn is kept or replaced
        (`speculative_token`); the first replacement ends the check, and the checks from
        there on and the token are the replacement (so `Generation.verified` keeps the
        drafts before it, then it). When every draft is kept the token is sampled from the
        last row as usual. Each token the check gives costs one draw of the stream, as a
        sampled token does: an answer resumed with `skip` = its tokens goes on with fresh
        draws."""
        for index, (draft, q) in enumerate(zip(drafts, proposals, strict=True)):
            p = self._processed(rows[index])
            token = speculative_token(p, q.dense(p.size), draft, self._rng.random())
            if token != draft:
                return (*drafts[:index], *[token] * (len(drafts) - index)), token
        return tuple(drafts), self(rows[len(drafts)])

    def _processed(self, row: np.ndarray) -> np.ndarray:
        """The distribution this sampler draws from for a row of logits, dense."""
        ids, weights = _candidates(np.asarray(row, dtype=np.float64), self.params)
        return _dense(ids, weights, row.size)


@dataclass(frozen=True)
class Distribution:
    """A next-token distribution over its support: token ids and their probabilities, in
    float32 as the wire carries them. Whoever uses it normalises the float32 numbers by
    their float64 sum, so the head that draws from it and the last stage that tests the
    draw read exactly the same distribution. A repeated id counts with its probabilities
    summed."""

    ids: np.ndarray  # int32
    probs: np.ndarray  # float32, >= 0, some > 0

    def draw(self, u: float) -> int:
        """The token at `u` (uniform in [0, 1)) of the cumulative distribution."""
        return _pick(self.ids, self.probs.astype(np.float64), u)

    def dense(self, vocab: int) -> np.ndarray:
        return _dense(self.ids, self.probs.astype(np.float64), vocab)


def distribution(logits: np.ndarray, params: SamplingParams) -> Distribution:
    """What a sampled answer's sampler draws from for a `[vocab]` row of logits
    (temperature, top-k, top-p), over its support: the tokens whose float32 probability is
    above 0. Top-k and top-p keep it small; temperature alone keeps the whole vocabulary."""
    ids, weights = _candidates(np.asarray(logits, dtype=np.float64), params)
    probs = (weights / weights.sum()).astype(np.float32)
    support = probs > 0
    return Distribution(ids[support].astype(np.int32), probs[support])


def draft_stream(params: SamplingParams, tokens: int) -> np.random.Generator:
    """The random stream the drafts of a check are drawn with, for an answer that has
    `tokens` tokens: seeded from (seed, DRAFT_SALT, tokens), so it is independent of the last
    stage's stream (seeded from the seed alone) and of every other check's (each starts
    after more tokens), also after the answer resumes on another plan, and the same for
    the same seed."""
    seed = np.random.SeedSequence((params.seed, DRAFT_SALT, tokens))
    return np.random.Generator(np.random.PCG64(seed))


def acceptance(p: np.ndarray, q: np.ndarray, draft: int) -> float:
    """The probability that speculative sampling keeps `draft`: min(1, p(x) / q(x))."""
    return min(1.0, float(p[draft] / q[draft]))


def residual(p: np.ndarray, q: np.ndarray, draft: int) -> np.ndarray:
    """What speculative sampling draws from when it replaces `draft` (which it can where
    acceptance(p, q, draft) < 1): max(0, p - q), normalised. It is 0 at the draft, whose
    rejection means q(x) > p(x); where p and q are equal up to rounding and nothing is
    left, p without the draft."""
    excess = np.maximum(p - q, 0.0)
    excess[draft] = 0.0
    if not excess.sum() > 0.0:
        excess = p.copy()
        excess[draft] = 0.0
    return excess / excess.sum()


def speculative_token(p: np.ndarray, q: np.ndarray, draft: int, u: float) -> int:
    """Speculative sampling's token at one drafted position (Leviathan et al. 2023, Chen et
    al. 2023). `p` is the full model's distribution, `q` the one `draft` was drawn from
    (dense, `[vocab]`), `u` a uniform draw in [0, 1) independent of the draft.

    The draft is kept when u < a = acceptance(p, q, draft); otherwise the token is drawn
    from residual(p, q, draft) at (u - a) / (1 - a): given a rejection, u is uniform on
    [a, 1), so the rescaled draw is a fresh uniform and the position costs one draw. The
    token then follows p whatever q is: P(y) = q(y) min(1, p(y)/q(y)) + P(reject) r(y) =
    min(p, q)(y) + max(0, p - q)(y) = p(y), as P(reject) = sum max(0, q - p) = sum max(0,
    p - q). A replacement is never the draft."""
    accept = acceptance(p, q, draft)
    if u < accept:
        return draft
    weights = residual(p, q, draft)
    support = np.flatnonzero(weights)
    return _pick(support, weights[support], (u - accept) / (1.0 - accept))


def _dense(ids: np.ndarray, weights: np.ndarray, vocab: int) -> np.ndarray:
    """`[vocab]` probabilities from the (unnormalised) weights of `ids`, repeats summed."""
    return np.bincount(ids, weights, minlength=vocab) / weights.sum()


def _pick(ids: np.ndarray, weights: np.ndarray, u: float) -> int:
    """The id at `u` (uniform in [0, 1)) of the cumulative of `weights` (unnormalised)."""
    cumulative = np.cumsum(weights)
    position = min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")),
                   len(ids) - 1)
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
