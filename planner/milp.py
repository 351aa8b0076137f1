"""The exact assignment: the full cost model as a mixed-integer program solved by HiGHS.

Binary b[a] per candidate block a = (device d, units i..j-1) from `planner.blocks`. The
chosen blocks carry one unit of flow from boundary 0 to U (conservation at every inner
boundary), so they are contiguous, cover every unit once and follow the ring order by
construction; only the source's blocks start at 0, and each device holds at most one block
(joint device selection). t[j, d, e] says "d's block ends at boundary j and e's starts
there" (the hop d -> e): at each boundary, the t of the device ending (starting) there sum to
its blocks that do. R[d, e] is the residual bytes d sends e, RA[d, e] those riding on a hop.

Throughput: T >= LB + sum over a device's blocks of (cost - LB)^+ (exact for the chosen
block, and a much tighter LP than T >= cost), plus T >= each link's bytes / bandwidth.
Latency: the model minimises the critical path (every compute, every hop with all it
carries, the return), which ignores waits for late residual messages and so bounds the
latency from below. Its plans, taken in increasing critical path and excluded one by one,
are scored by the simulator until no plan left could beat the best latency found; after a
few rounds a model with start/finish times per device (big-M rows on hops and residual
messages) settles it instead.
Times are scaled so the lower bound is SCALE model units; the incumbent's objective caps the
model's (a cutoff) and prunes blocks. Every plan found is offered to the incumbent, which is
what the caller keeps. Derivation: docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.blocks import SCALE, Bounds, candidate_blocks
from planner.bounds import lower_bound
from planner.cost import critical_path_s
from planner.deadline import Deadline, TimeUp
from planner.incumbent import Incumbent
from planner.mip import Mip
from planner.model import Cluster, Stage, Workload
from planner.paths import ring

CUTOFF = 1 + 1e-6  # the objective may not exceed the upper bound (times this)


@dataclass(frozen=True)
class _Residual:
    """An output with a consumer other than the next unit: it may go to any later stage."""

    producer: int
    consumers: tuple[int, ...]
    nbytes: float  # scaled


class _Formulation:
    def __init__(self, cluster: Cluster, workload: Workload, objective: str, lower: float,
                 upper: float, waits: bool = False) -> None:
        self.cluster, self.workload, self.throughput = cluster, workload, objective == "throughput"
        self.devices = ring(cluster)
        self.U, self.D = len(workload.units), len(self.devices)
        self.tau = lower / SCALE
        self.upper = upper / self.tau
        sizes = [o.bytes for u in workload.units for o in u.outputs]
        self.bytes_ref = max(sum(sizes), workload.return_bytes, 1.0)
        self._links()
        compute_bound = self.throughput and self._links_never_bind()
        linked = ~np.isnan(self.latency)
        hop_floor = self.latency[linked].min() if linked.any() else 0.0
        blocks = candidate_blocks(cluster, workload, self.devices, Bounds(
            self.tau, self.upper, self.throughput, compute_bound, hop_floor, self.back))
        self.dev, self.start, self.stop, self.cost = (
            blocks.device, blocks.start, blocks.stop, blocks.cost)
        self.m = Mip()
        self.b = self.m.binaries(len(self.dev))
        self._flow()
        if self.throughput:
            self._bottleneck_compute()
            if compute_bound:
                return
        self._transitions()
        self._residuals()
        self._return()
        if self.throughput:
            self._bottleneck_links()
            return
        self._critical_path()
        if waits:
            self._waits()

    # -- links ------------------------------------------------------------------------------
    def _links(self) -> None:
        """Per device pair: latency and time per scaled byte in model units (nan: no link);
        per device: the return to the source as the objective counts it (inf: no link)."""
        self.latency = np.full((self.D, self.D), np.nan)
        self.per_byte = np.full((self.D, self.D), np.nan)
        for d in range(self.D):
            for e in range(self.D):
                found = self.cluster.link(self.devices[d].id, self.devices[e].id)
                if d != e and found is not None:
                    self.latency[d, e] = found.latency_s / self.tau
                    self.per_byte[d, e] = self.bytes_ref / found.bandwidth_Bps / self.tau
        returned = self.workload.return_bytes / self.bytes_ref
        back = self.per_byte[:, 0] * returned + (0.0 if self.throughput else self.latency[:, 0])
        self.back = np.where(np.isnan(back), np.inf, back)
        self.back[0] = 0.0

    def _links_never_bind(self) -> bool:
        """Every pair of usable devices is linked both ways, and no message could load a link
        beyond the lower bound: then only compute and memory shape the optimum. A message
        carries at most one unit's outputs plus every output consumed beyond the next unit."""
        units = self.workload.units
        widest = max(sum(o.bytes for o in unit.outputs) for unit in units)
        residual = sum(o.bytes for u, unit in enumerate(units) for o in unit.outputs
                       if any(c > u + 1 for c in o.consumers))
        worst = max(widest + residual, self.workload.return_bytes) / self.bytes_ref
        off_diagonal = ~np.eye(self.D, dtype=bool)
        loads = self.per_byte[off_diagonal] * worst
        return bool(np.all(loads <= SCALE))  # nan (a missing link) compares False

    # -- the path of blocks -----------------------------------------------------------------
    def _flow(self) -> None:
        """One unit of flow from boundary 0 to U; at most one block per device."""
        m, b = self.m, self.b
        ends, starts = self.stop < self.U, self.start > 0
        m.sparse_rows(np.concatenate([self.stop[ends] - 1, self.start[starts] - 1]),
                      np.concatenate([b[ends], b[starts]]),
                      np.concatenate([np.ones(ends.sum()), -np.ones(starts.sum())]),
                      self.U - 1, lo=0, hi=0)
        first = self.start == 0
        m.row(b[first], np.ones(first.sum()), lo=1, hi=1)
        other = self.dev > 0
        m.sparse_rows(self.dev[other] - 1, b[other], np.ones(other.sum()), self.D - 1, hi=1)

    def _transitions(self) -> None:
        """t[j, d, e]: d's block ends at boundary j and e's starts there (a hop d -> e). At
        each boundary the t of a device that ends (starts) there sum to its blocks that do."""
        U, D = self.U, self.D
        ends, starts = np.zeros((U + 1, D), bool), np.zeros((U + 1, D), bool)
        ends[self.stop[self.stop < U], self.dev[self.stop < U]] = True
        starts[self.start[self.start > 0], self.dev[self.start > 0]] = True
        linked = ~np.isnan(self.latency)
        j, d, e = np.nonzero(ends[:, :, None] & starts[:, None, :] & linked[None])
        self.t = self.m.variables(len(j), ub=1.0)
        for side, blocks, at in ((d, self.stop < U, self.stop), (e, self.start > 0, self.start)):
            self.m.sparse_rows(np.concatenate([j * D + side, at[blocks] * D + self.dev[blocks]]),
                               np.concatenate([self.t, self.b[blocks]]),
                               np.concatenate([np.ones(len(j)), -np.ones(blocks.sum())]),
                               (U + 1) * D, lo=0, hi=0)
        seq = np.zeros(U + 1)
        for u, unit in enumerate(self.workload.units):
            seq[u + 1] = sum(o.bytes for o in unit.outputs if o.consumers == (u + 1,))
        self.t_bytes = seq[j] / self.bytes_ref
        self.t_latency, self.t_per_byte = self.latency[d, e], self.per_byte[d, e]
        pairs, t_pair = np.unique(np.stack([d, e], axis=-1), axis=0, return_inverse=True)
        self.t_pair = t_pair.ravel()
        self.pair_index = {(int(a), int(b)): i for i, (a, b) in enumerate(pairs.reshape(-1, 2))}

    def _hops(self, i: int) -> np.ndarray:
        """Which transitions are hops over pair i."""
        return self.t_pair == i

    # -- residual messages ------------------------------------------------------------------
    def _residuals(self) -> None:
        """R[d, e]: the bytes of outputs produced on d with a consumer on e (e != d)."""
        self.R: dict[tuple[int, int], list[tuple[int, float]]] = {}
        for u, unit in enumerate(self.workload.units):
            for out in unit.outputs:
                if out.consumers and out.consumers != (u + 1,):
                    self._residual(_Residual(u, out.consumers, out.bytes / self.bytes_ref))

    def _holding(self, units: tuple[int, ...]) -> np.ndarray:
        """Which blocks hold at least one of the (sorted) `units`."""
        sorted_units = np.array(units)
        return np.searchsorted(sorted_units, self.stop) > np.searchsorted(sorted_units, self.start)

    def _residual(self, out: _Residual) -> None:
        """g[e]: e's block holds a consumer but not the producer (one block per device, so a
        sum over e's blocks); r[d, e] >= [producer on d] + g[e] - 1 carries the bytes."""
        m = self.m
        producer = self._holding((out.producer,))
        consumers = self._holding(out.consumers) & ~producer
        g = m.variables(self.D, ub=1.0)
        for e in range(1, self.D):
            cols = self.b[consumers & (self.dev == e)]
            m.row(np.append(cols, g[e]), np.append(-np.ones(len(cols)), 1.0), lo=0)
        for d in range(self.D):
            on_d = self.b[producer & (self.dev == d)]
            for e in range(1, self.D) if len(on_d) else ():
                if d == e:
                    continue
                if np.isnan(self.latency[d, e]):
                    m.row(np.append(on_d, g[e]), np.ones(len(on_d) + 1), hi=1)
                elif out.producer == 0:  # the producer sits on the source, always
                    self.R.setdefault((d, e), []).append((g[e], out.nbytes))
                else:
                    r = m.variables(1, ub=1.0)[0]
                    m.row(np.concatenate([[r, g[e]], on_d]),
                          np.concatenate([[1.0, -1.0], -np.ones(len(on_d))]), lo=-1)
                    self.R.setdefault((d, e), []).append((r, out.nbytes))

    def _return(self) -> None:
        """The final block's device sends the result back to the source."""
        final = self.stop == self.U
        self.final_cols, self.final_back = self.b[final], self.back[self.dev[final]]

    def _carried(self, d: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Columns and scaled bytes of everything the link d -> e carries: hop and residuals."""
        i = self.pair_index.get((d, e))
        hops = self._hops(i) if i is not None else np.zeros(len(self.t), bool)
        parts = self.R.get((d, e), [])
        return (np.concatenate([self.t[hops], [c for c, _ in parts]]).astype(np.int64),
                np.concatenate([self.t_bytes[hops], [b for _, b in parts]]))

    # -- throughput -------------------------------------------------------------------------
    def _bottleneck_compute(self) -> None:
        """T >= LB + (cost - LB)^+ summed over a device's blocks: exact for the chosen one."""
        self.T = self.m.variables(1, lb=SCALE, ub=self.upper * CUTOFF)[0]
        excess = np.maximum(self.cost, SCALE) - SCALE
        self.m.sparse_rows(np.concatenate([self.dev, np.arange(self.D)]),
                           np.concatenate([self.b, np.full(self.D, self.T)]),
                           np.concatenate([-excess, np.ones(self.D)]), self.D, lo=SCALE)
        self.objective = {int(self.T): 1.0}

    def _bottleneck_links(self) -> None:
        """T >= every link's bytes per token / bandwidth (rows that cannot bind are left
        out), and the result's return."""
        for d, e in self._linked():
            cols, sizes = self._carried(d, e)
            residual = len(self.R.get((d, e), []))
            hop = sizes[: len(sizes) - residual]
            most = hop.max(initial=0.0) + sizes[len(hop):].sum()
            if self.per_byte[d, e] * most > SCALE:
                self.m.row(np.append(cols, self.T), np.append(-self.per_byte[d, e] * sizes, 1.0),
                           lo=0)
        heavy = self.final_back > SCALE
        self.m.rows(np.stack([np.full(heavy.sum(), self.T), self.final_cols[heavy]], axis=-1),
                    np.stack([np.ones(heavy.sum()), -self.final_back[heavy]], axis=-1), lo=0)

    def _linked(self) -> list[tuple[int, int]]:
        """Every ordered pair that may exchange a message: a hop or a residual."""
        return sorted({*self.pair_index, *self.R})

    # -- latency ----------------------------------------------------------------------------
    def _critical_path(self) -> None:
        """L >= every block's compute + every hop (latency and all it carries) + the return.
        RA[d, e] >= R[d, e] - (1 - P[d, e]) x most: the residual bytes riding on a hop."""
        m = self.m
        self.L = m.variables(1, lb=SCALE, ub=self.upper * CUTOFF)[0]
        riding, riding_cost = [], []
        for (d, e), parts in self.R.items():
            i = self.pair_index.get((d, e))
            if i is None:  # never adjacent: no hop can carry these bytes
                continue
            most, hops = sum(b for _, b in parts), self.t[self._hops(i)]
            ra = m.variables(1)[0]
            m.row(np.concatenate([[ra], hops, [c for c, _ in parts]]),
                  np.concatenate([[1.0], np.full(len(hops), -most), [-b for _, b in parts]]),
                  lo=-most)
            riding.append(ra)
            riding_cost.append(self.per_byte[d, e])
        final_back = np.where(self.stop == self.U, self.back[self.dev], 0.0)
        cols = np.concatenate([[self.L], self.b, self.t, riding])
        coefs = np.concatenate([[1.0], -self.cost - final_back,
                                -(self.t_latency + self.t_per_byte * self.t_bytes),
                                -np.array(riding_cost)])
        m.row(cols, coefs, lo=0)
        self.objective = {int(self.L): 1.0}

    def _waits(self) -> None:
        """Start and finish times per device: a stage starts once its hop and every residual
        message for it have arrived; L >= the final finish plus the return."""
        m, D = self.m, self.D
        start, finish = m.variables(D), m.variables(D)
        m.fix(start[0], 0.0)
        m.sparse_rows(np.concatenate([np.arange(D), np.arange(D), self.dev]),
                      np.concatenate([finish, start, self.b]),
                      np.concatenate([np.ones(D), -np.ones(D), -self.cost]), D, lo=0, hi=0)
        for d, e in self._linked():
            latency, per_byte = self.latency[d, e], self.per_byte[d, e]
            cols, sizes = self._carried(d, e)
            big = self.upper + latency + per_byte * sizes.sum()
            i = self.pair_index.get((d, e))
            if i is not None:  # the hop: start_e >= finish_d + latency + carried - big(1 - P)
                hop = np.isin(cols, self.t[self._hops(i)])
                m.row(np.concatenate([[start[e], finish[d]], cols]),
                      np.concatenate([[1.0, -1.0], -per_byte * sizes - big * hop]),
                      lo=latency - big)
            parts = self.R.get((d, e))
            if parts:  # a residual message: start_e >= finish_d + latency + its bytes if sent
                sent = m.variables(1, ub=1.0)[0]
                m.rows(np.array([[sent, r] for r, _ in parts]), [1, -1], lo=0)
                m.row([start[e], finish[d], *(r for r, _ in parts), sent],
                      [1.0, -1.0, *(-per_byte * b for _, b in parts), -(big + latency)],
                      lo=-big)
        n = len(self.final_cols)
        m.rows(np.stack([np.full(n, self.L), finish[self.dev[self.stop == self.U]],
                         self.final_cols], axis=-1),
               np.stack([np.ones(n), -np.ones(n), -self.final_back], axis=-1), lo=0)

    # -- solve ------------------------------------------------------------------------------
    def solve(self, best: Incumbent, deadline: Deadline) -> list[Stage] | None:
        """The optimal stages (None when no plan is left), offered to `best`. Raises TimeUp,
        after offering the best solution found, when the deadline passes first."""
        if deadline.passed():
            raise TimeUp
        outcome = self.m.solve(self.objective, time_limit=deadline.left())
        stages = None if outcome.x is None else self._stages(outcome.x)
        if stages:
            best.offer(stages)
        if not outcome.complete:
            raise TimeUp
        return stages

    def _stages(self, x: np.ndarray) -> list[Stage]:
        chosen = np.nonzero(x[self.b] > 0.5)[0]
        chosen = chosen[np.argsort(self.start[chosen])]
        return [Stage(self.devices[self.dev[a]].id, int(self.start[a]), int(self.stop[a]))
                for a in chosen]

    def exclude(self, stages: list[Stage], latency_s: float) -> None:
        """Forbid this exact plan (its blocks, all together) and any plan slower than it."""
        ids = [d.id for d in self.devices]
        chosen = [np.nonzero((self.dev == ids.index(s.peer)) & (self.start == s.start)
                             & (self.stop == s.stop))[0][0] for s in stages]
        self.m.row(self.b[chosen], np.ones(len(chosen)), hi=len(chosen) - 1)
        self.m.row([self.L], [1.0], hi=latency_s / self.tau * CUTOFF)


ROUNDS = 4  # critical-path plans scored before the model with waits


def milp_throughput(cluster: Cluster, workload: Workload, lower: float, best: Incumbent,
                    deadline: Deadline) -> None:
    """Improve `best` to the plan of least bottleneck, given a lower bound on it."""
    _Formulation(cluster, workload, "throughput", lower, best.value).solve(best, deadline)


def milp_latency(cluster: Cluster, workload: Workload, best: Incumbent,
                 deadline: Deadline) -> None:
    """Improve `best` to the plan of least latency: critical-path plans in increasing order,
    each scored with its waits, until none left could beat the best (every plan's latency is
    at least its critical path); after ROUNDS, the model with start and finish times."""
    lower = lower_bound(cluster, workload, "latency")
    model = _Formulation(cluster, workload, "latency", lower, best.value)
    stages = model.solve(best, deadline)
    for _ in range(ROUNDS):
        if stages is None or critical_path_s(cluster, workload, stages) >= best.value * (1 - 1e-12):
            return
        model.exclude(stages, best.value)
        stages = model.solve(best, deadline)
    if stages is not None:
        _Formulation(cluster, workload, "latency", lower, best.value, waits=True).solve(
            best, deadline)
