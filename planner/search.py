"""The exact latency search, for workloads `planner.paths` applies to: EdgeShard's DP over
(peers used, last peer, boundary), pruned by a bound.

An entry is a partial plan: the source's block, then blocks on distinct peers up to a
boundary. Layer n holds the entries with n + 1 blocks; extending one appends a block on an
unused peer. Of the entries with the same (peers used, last peer, boundary) only the one that
finishes first is kept, together with the earliest time any of them had the source finish:
unit 0's later messages leave then, and an earlier source only makes later stages wait less.
That pair may come from two plans, so a complete entry's latency bounds from below every plan
merged into it; when the simulated latency of the plan it keeps is that bound, no plan it
stands for is better. When one is not, the search splits the source's block sizes in halves
and searches each (with a single size the merge is exact).

An entry is dropped when its finish plus the cost-to-go (`planner.lagrange`) cannot beat the
best plan known (`planner.incumbent`). A beam search (the most promising entries of each
layer only) finds good plans first, again once the relaxation is tightened; the bound alone
often proves the best plan optimal before the exhaustive search.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from planner.deadline import Deadline, TimeUp
from planner.incumbent import Incumbent
from planner.lagrange import CLOSE, Blocks, Relaxation, relax, tighten
from planner.model import Stage
from planner.paths import INF, PathModel

BEAMS = (32, 512)  # entries kept per layer while looking for good plans: before and after
# the relaxation is tightened
MAX_PEERS = 40  # sets of peers are bit masks in int64 keys
CHUNK = 1 << 18  # candidate blocks built at once (the deadline is checked between chunks)


@dataclass(frozen=True)
class _Layer:
    mask: np.ndarray  # the peers used, bit 0 the source
    last: np.ndarray  # the peer holding the last block
    stop: np.ndarray  # the boundary where that block ends
    finish: np.ndarray  # when it finishes
    source_done: np.ndarray  # the earliest the source finished among the plans merged here
    parent: np.ndarray  # the entry of the previous layer this one extends
    bound: np.ndarray  # finish plus the cost-to-go: no completion can be faster
    unused: np.ndarray  # the prices of the peers not used yet (see _CostToGo)

    def take(self, index: np.ndarray) -> _Layer:
        return _Layer(*(getattr(self, f.name)[index] for f in fields(self)))


class _CostToGo:
    """A lower bound on the time from the end of the last block to the result's return: the
    relaxation's start[k, g, T] over the next unused peer g (T: the critical peers used), less
    the prices of the peers still unused (a completion uses each at most once, and may not use
    the others again; the relaxation charged every use)."""

    def __init__(self, model: PathModel, relaxation: Relaxation) -> None:
        self.model, self.relaxation = model, relaxation
        self.penalty = relaxation.penalty
        self.unused = self.penalty.sum()  # the source's price is 0

    def __call__(self, mask: np.ndarray, last: np.ndarray, stop: np.ndarray,
                 unused: np.ndarray) -> np.ndarray:
        used = np.zeros(len(mask), np.int64)
        for i, peer in enumerate(self.relaxation.critical):
            used |= ((mask >> peer) & 1) << i
        peers = np.arange(len(self.penalty))[None, :]
        inside = stop < self.model.units
        at = np.where(inside, stop, 1)[:, None]
        onward = self.model.hop[last[:, None], peers, at] + \
            self.relaxation.start[at, peers, used[:, None]]
        onward[((mask[:, None] >> peers) & 1) == 1] = INF
        return np.where(inside, onward.min(axis=1) - unused, self.model.back[last])


class _Search:
    def __init__(self, model: PathModel, best: Incumbent, cost_to_go: _CostToGo,
                 deadline: Deadline) -> None:
        self.model, self.best, self.cost_to_go, self.deadline = model, best, cost_to_go, deadline

    def settle(self, lo: int, hi: int) -> None:
        """Search the plans whose source holds lo..hi units until none of them can beat the
        best known."""
        if self.run(lo, hi, beam=None) and hi > lo:
            middle = (lo + hi) // 2
            self.settle(lo, middle)
            self.settle(middle + 1, hi)

    def run(self, lo: int, hi: int, beam: int | None) -> bool:
        """Extend layer by layer, scoring complete entries; whether one is left below the best
        latency known (its plan was slower than its bound: the merge was loose)."""
        layers = [self._source_layer(lo, hi)]
        while len(layers[-1].mask):
            if self.deadline.passed():
                raise TimeUp
            self._complete(layers)
            layers.append(self._extend(layers[-1], beam))
        return any(((layer.stop == self.model.units) & (layer.bound < self.best.cutoff)).any()
                   for layer in layers)

    def _source_layer(self, lo: int, hi: int) -> _Layer:
        stop = np.arange(lo, hi + 1)
        finish = self.model.block[0, 0, stop]
        stop, finish = stop[np.isfinite(finish)], finish[np.isfinite(finish)]
        zeros = np.zeros(len(stop), np.int64)
        return _Layer(zeros + 1, zeros, stop, finish, finish, zeros - 1, finish,
                      np.full(len(stop), self.cost_to_go.unused))

    def _complete(self, layers: list[_Layer]) -> None:
        """Score the plans complete entries of the newest layer keep, most promising first,
        while they could beat the best."""
        layer = layers[-1]
        done = np.nonzero(layer.stop == self.model.units)[0]
        for index in done[np.argsort(layer.bound[done])]:
            if layer.bound[index] >= self.best.cutoff:
                break
            self.best.offer(_stages(self.model, _blocks(layers, int(index))))

    def _extend(self, layer: _Layer, beam: int | None) -> _Layer:
        """The next layer: every open entry extended by a block on each unused peer. (Entries
        ending on different peers never merge, so each peer's are merged on their own.)"""
        merged = []
        for e in range(1, len(self.model.devices)):
            rows = np.nonzero((layer.stop < self.model.units) & (((layer.mask >> e) & 1) == 0))[0]
            parts = []
            for chunk in np.array_split(rows, -(-len(rows) * self.model.width // CHUNK) or 1):
                if self.deadline.passed():
                    raise TimeUp
                parts.append(self._children(layer, e, chunk))
            merged.append(_merge(_concat(parts), len(self.model.devices), self.model.units))
        layer = _concat(merged)
        if beam is not None and len(layer.mask) > beam:
            layer = layer.take(np.argpartition(layer.bound, beam)[:beam])
        return layer

    def _children(self, layer: _Layer, e: int, rows: np.ndarray) -> _Layer:
        """The entries `rows` extended by a block on peer e, less those that cannot beat the
        best."""
        m = self.model
        pick, width = np.nonzero(np.isfinite(m.block[e, layer.stop[rows], 1:]))
        row, width = rows[pick], width + 1
        at, last = layer.stop[row], layer.last[row]
        compute = m.block[e, at, width]
        after_source = layer.finish[row] + m.first_hop[e, at, width]
        after_peer = np.maximum(layer.finish[row] + m.hop[last, e, at],
                                layer.source_done[row] + m.residual[e, at, width])
        finish = np.where(last == 0, after_source, after_peer) + compute
        mask, stop = layer.mask[row] | (1 << e), at + width
        peer = np.full(len(row), e)
        unused = layer.unused[row] - self.cost_to_go.penalty[e]
        bound = finish + self.cost_to_go(mask, peer, stop, unused)
        keep = bound < self.best.cutoff
        return _Layer(mask[keep], peer[keep], stop[keep], finish[keep],
                      layer.source_done[row][keep], row[keep], bound[keep], unused[keep])


def _concat(parts: list[_Layer]) -> _Layer:
    if not parts:
        ints, floats = np.zeros(0, np.int64), np.zeros(0)
        return _Layer(mask=ints, last=ints, stop=ints, finish=floats, source_done=floats,
                      parent=ints, bound=floats, unused=floats)
    return _Layer(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                     for f in fields(_Layer)})


def _merge(layer: _Layer, devices: int, units: int) -> _Layer:
    """One entry per (peers used, last peer, boundary): the first to finish, with the earliest
    source finish of them all."""
    if not len(layer.mask):
        return layer
    key = (layer.mask * devices + layer.last) * (units + 1) + layer.stop
    order = np.lexsort((layer.finish, key))
    first = np.nonzero(np.r_[True, key[order][1:] != key[order][:-1]])[0]
    kept = layer.take(order[first])
    return replace(kept, source_done=np.minimum.reduceat(layer.source_done[order], first))


def _blocks(layers: list[_Layer], index: int) -> Blocks:
    """The plan an entry of the newest layer keeps, walking back through its parents."""
    blocks: Blocks = []
    for depth in range(len(layers) - 1, -1, -1):
        parent = int(layers[depth].parent[index])
        start = int(layers[depth - 1].stop[parent]) if depth else 0
        blocks.append((int(layers[depth].last[index]), start, int(layers[depth].stop[index])))
        index = parent
    return blocks[::-1]


def _stages(model: PathModel, blocks: Blocks) -> list[Stage]:
    return [Stage(model.devices[d].id, a, b) for d, a, b in blocks]


def settle_latency(model: PathModel, best: Incumbent, deadline: Deadline) -> None:
    """Improve `best` (a latency incumbent, possibly empty) until no plan beats it; raises
    TimeUp when the deadline passes first."""
    def score(blocks: Blocks) -> float:
        return best.offer(_stages(model, blocks))

    relaxation = relax(model, best.value, score, deadline)
    sizes = (1, model.width)
    for beam in BEAMS:
        if relaxation.bound >= best.value * (1 - CLOSE):
            break  # the bound is close: the exhaustive search settles the rest at once
        _Search(model, best, _CostToGo(model, relaxation), deadline).run(*sizes, beam=beam)
        relaxation = tighten(relaxation, model, best.value, score, deadline)
    if relaxation.bound < best.cutoff:
        _Search(model, best, _CostToGo(model, relaxation), deadline).settle(*sizes)
