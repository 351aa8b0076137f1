"""A lower bound on the latency, and the cost-to-go the exact latency search prunes with.

The relaxation drops "each peer holds at most one block" (and the waits for unit 0's
messages to later stages): a relaxed plan may use a peer for several blocks. Two devices
make it tight enough to prune with:

- Prices (Lagrangian relaxation): each block on peer f pays `penalty[f]` >= 0. A real plan
  uses each peer at most once, so it pays at most their sum: the least relaxed cost less that
  sum bounds every plan's latency from below. Subgradient ascent (Polyak steps towards the
  best latency known) tunes the prices.
- Critical peers (decremental state-space relaxation): the peers the relaxed optimum still
  reuses are added to a set C, and relaxed plans may use each peer of C at most once. The
  state then carries the subset of C used so far, 2^|C| of them; C grows until the relaxed
  optimum is a real plan, the bound proves the best plan known optimal, or |C| reaches
  MAX_CRITICAL.

The least relaxed cost is a shortest path over (boundary, peer, subset of C used), found by a
backward DP:

  end[k, f, T]   = the least cost after f's block ends at boundary k (a hop on, or the return)
  start[k, g, T] = the least cost from g's block starting at k, T the critical peers used
                   before it (its compute and price, then end with g added to T)

A relaxed path that visits no peer twice is a real plan, which the caller scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from planner.deadline import Deadline
from planner.paths import INF, PathModel

ITERATIONS = 150
STALL = 8  # iterations without a better bound before the step halves
CLOSE = 1e-4  # relative gap to the best latency at which the search can settle the rest
MAX_CRITICAL = 10  # 2^10 subsets per (boundary, peer) in the DP's state

Blocks = list[tuple[int, int, int]]  # (device, start, stop) in ring order
Score = Callable[[Blocks], float]  # a real plan's latency (the caller keeps the best)


@dataclass(frozen=True)
class Relaxation:
    bound: float  # a lower bound on every plan's latency
    penalty: np.ndarray  # (D,) the price of a block on each peer; 0 for the source
    critical: tuple[int, ...]  # the peers relaxed plans use at most once
    start: np.ndarray  # (U + 1, D, 2^|critical|) start[k, g, T], bit i of T: critical[i]
    path: Blocks  # a relaxed plan of least cost


def relax(model: PathModel, best: float, score: Score, deadline: Deadline) -> Relaxation:
    """The best bound subgradient ascent on the prices reaches (no critical peers), stopping
    once it is within CLOSE of `best`, the latency of the best plan known."""
    penalty = np.zeros(len(model.devices))
    found: Relaxation | None = None
    step, stalled = 1.0, 0
    for _ in range(ITERATIONS):
        current = _shortest(model, penalty, ())
        if found is None or current.bound > found.bound:
            found, stalled = current, 0
        else:
            stalled += 1
            if stalled >= STALL:
                step, stalled = step / 2, 0
        uses = _uses(model, current.path)
        if np.isfinite(current.bound) and uses.max() <= 1:
            best = min(best, score(current.path))
        if current.bound >= best * (1 - CLOSE) or deadline.passed():
            break
        slope = uses - 1
        slope[0] = 0.0
        slope[(penalty <= 0) & (slope < 0)] = 0.0
        if not slope.any():
            break  # the relaxed optimum uses every priced peer once: no better bound
        gap = best - current.bound if np.isfinite(best) else 0.1 * abs(current.bound)
        penalty = np.maximum(0.0, penalty + step * gap / (slope @ slope) * slope)
    assert found is not None  # set in the first iteration
    return found


def tighten(relaxation: Relaxation, model: PathModel, best: float, score: Score,
            deadline: Deadline) -> Relaxation:
    """Add the peers the relaxed optimum reuses to the critical ones (as many as fit), at the
    same prices, until its path is a real plan, the bound comes within CLOSE of `best`, or C
    is full."""
    while relaxation.bound < best * (1 - CLOSE) and not deadline.passed():
        uses = _uses(model, relaxation.path)
        reused = tuple(int(d) for d in np.nonzero(uses > 1)[0])
        if not reused:
            score(relaxation.path)  # a real plan
            break
        room = MAX_CRITICAL - len(relaxation.critical)
        if not room:
            break
        relaxation = _shortest(model, relaxation.penalty, relaxation.critical + reused[:room])
    return relaxation


def _uses(model: PathModel, blocks: Blocks) -> np.ndarray:
    return np.bincount([d for d, _, _ in blocks], minlength=len(model.devices)).astype(float)


def _shortest(model: PathModel, penalty: np.ndarray, critical: tuple[int, ...]) -> Relaxation:
    """The relaxed optimum under these prices and critical peers."""
    units, count, width = model.units, len(model.devices), model.width
    subsets = np.arange(1 << len(critical))
    bit = np.zeros(count, np.int64)
    bit[list(critical)] = 1 << np.arange(len(critical))
    after = subsets[None, :] | bit[:, None]  # [g, T]: the critical peers used once g's block is
    again = (subsets[None, :] & bit[:, None]) > 0  # g is critical and in T already
    again[0] = True  # the source holds only the first block
    block = model.block + penalty[:, None, None]
    end = np.full((units + width + 1, count, len(subsets)), INF)
    end[units] = model.back[:, None]
    start = np.full((units + 1, count, len(subsets)), INF)
    widths = np.zeros(start.shape, np.int16)
    nexts = np.zeros(start.shape, np.int8)
    peers = np.arange(count)[:, None]
    for k in range(units - 1, 0, -1):
        cost = block[:, k, :].T[:, :, None] + end[k:k + width + 1][:, peers, after]
        widths[k] = cost.argmin(axis=0)
        start[k] = np.take_along_axis(cost, widths[k][None].astype(np.int64), axis=0)[0]
        start[k][again] = INF
        onward = model.hop[:, :, k][:, :, None] + start[k][None]
        nexts[k] = onward.argmin(axis=1)
        end[k] = np.take_along_axis(onward, nexts[k][:, None].astype(np.int64), axis=1)[:, 0]
    value, path = _first_blocks(model, block, end[:, np.arange(count), after[:, 0]])
    k, used = path[-1][2], after[path[-1][0], 0]
    while np.isfinite(value) and k < units:
        g = int(nexts[k, path[-1][0], used])
        path.append((g, k, k + int(widths[k, g, used])))
        k, used = path[-1][2], after[g, used]
    return Relaxation(value - penalty.sum(), penalty.copy(), critical, start, path)


def _first_blocks(model: PathModel, block: np.ndarray, end: np.ndarray) -> tuple[float, Blocks]:
    """The source's block [0, p) and the block after it (the hop carries unit 0's outputs);
    `block` holds the priced block costs, `end` [k, g] the cost after g's block ends at k."""
    units, width = model.units, model.width
    own = model.block[0, 0, 1:]  # the source's block [0, p), p = 1..width
    alone = own[units - 1] if units <= width else INF
    p = np.arange(1, width + 1)[:, None]
    stops = np.minimum(p + np.arange(width + 1)[None, :], units + width)
    then = (own[:, None, None]
            + (model.first_hop[:, 1:width + 1] + block[:, 1:width + 1]).transpose(1, 0, 2)
            + end[stops].transpose(0, 2, 1))
    flat = int(then.argmin()) if then.size else 0
    if then.size == 0 or alone <= then.flat[flat]:
        return alone, [(0, 0, units)]
    first, g, extra = np.unravel_index(flat, then.shape)
    first = int(first) + 1
    return float(then.flat[flat]), [(0, 0, first), (int(g), first, first + int(extra))]
