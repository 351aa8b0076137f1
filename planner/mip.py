"""A small sparse model builder over `scipy.optimize.milp` (HiGHS), vectorised with numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from planner.errors import PlannerError

INF = np.inf


@dataclass(frozen=True)
class Outcome:
    x: np.ndarray | None  # the best solution found; None when there is none
    complete: bool  # False: the time limit stopped the search (x may be None or not optimal)


class Mip:
    """Variables are integer indices; rows are (columns, coefficients, lower, upper)."""

    def __init__(self) -> None:
        self._lb: list[np.ndarray] = []
        self._ub: list[np.ndarray] = []
        self._integer: list[np.ndarray] = []
        self._count = 0
        self._rows: list[tuple[np.ndarray, np.ndarray, int]] = []
        self._lo: list[np.ndarray] = []
        self._hi: list[np.ndarray] = []
        self._nrows = 0
        self._fixed: dict[int, float] = {}
        self._sparse: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def variables(self, shape: int | tuple[int, ...], lb: float = 0.0, ub: float = INF,
                  integer: bool = False) -> np.ndarray:
        size = int(np.prod(shape))
        index = np.arange(self._count, self._count + size).reshape(shape)
        self._count += size
        self._lb.append(np.full(size, lb, dtype=float))
        self._ub.append(np.full(size, ub, dtype=float))
        self._integer.append(np.full(size, int(integer)))
        return index

    def binaries(self, shape: int | tuple[int, ...]) -> np.ndarray:
        return self.variables(shape, 0.0, 1.0, integer=True)

    def fix(self, index: np.ndarray | int, value: float) -> None:
        for i in np.atleast_1d(index).ravel():
            self._fixed[int(i)] = value

    def rows(self, cols: np.ndarray, coefs: ArrayLike, lo: float | np.ndarray = -INF,
             hi: float | np.ndarray = INF) -> None:
        """Add rows lo <= sum_j coefs[r, j] * x[cols[r, j]] <= hi, one per leading index r."""
        cols = np.atleast_2d(np.asarray(cols, dtype=np.int64))
        coefs = np.broadcast_to(np.asarray(coefs, dtype=float), cols.shape)
        n = cols.shape[0]
        if n == 0:
            return
        self._rows.append((cols, coefs, self._nrows))
        self._lo.append(np.broadcast_to(np.asarray(lo, dtype=float), (n,)))
        self._hi.append(np.broadcast_to(np.asarray(hi, dtype=float), (n,)))
        self._nrows += n

    def row(self, cols: list | np.ndarray, coefs: list | np.ndarray, lo: float = -INF,
            hi: float = INF) -> None:
        self.rows(np.asarray(cols).reshape(1, -1), np.asarray(coefs, dtype=float).reshape(1, -1),
                  lo, hi)

    def sparse_rows(self, which: np.ndarray, cols: np.ndarray, coefs: np.ndarray, count: int,
                    lo: float | np.ndarray = -INF, hi: float | np.ndarray = INF) -> None:
        """Add `count` rows given as triplets: entry t puts coefs[t] at (which[t], cols[t])."""
        if count == 0:
            return
        self._sparse.append((np.asarray(which, dtype=np.int64) + self._nrows,
                             np.asarray(cols, dtype=np.int64), np.asarray(coefs, dtype=float)))
        self._lo.append(np.broadcast_to(np.asarray(lo, dtype=float), (count,)))
        self._hi.append(np.broadcast_to(np.asarray(hi, dtype=float), (count,)))
        self._nrows += count

    def solve(self, cost: dict[int, float], maximize: bool = False,
              time_limit: float | None = None) -> Outcome:
        """The exact optimum (relative gap 0) as variable values (None when infeasible), or
        the best solution found when `time_limit` seconds pass first.

        HiGHS presolve stays off: on these models it has reported wrong optima as optimal
        (found by tests/units/planner/test_planner_properties.py; HiGHS issues #1725, #3094).
        """
        # imported here: scipy takes a second or more to import, and of the processes that
        # import the planner (every daemon, `peerd demo`) only a leader that plans needs it
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        c = np.zeros(self._count)
        for i, value in cost.items():
            c[i] += -value if maximize else value
        r, j, v = [], [], []
        for cols, coefs, start in self._rows:
            n, width = cols.shape
            r.append(np.repeat(np.arange(start, start + n), width))
            j.append(cols.ravel())
            v.append(coefs.ravel())
        for which, cols, coefs in self._sparse:
            r.append(which)
            j.append(cols)
            v.append(coefs)
        a = coo_matrix(
            (np.concatenate(v), (np.concatenate(r), np.concatenate(j))),
            shape=(self._nrows, self._count),
        ).tocsr()
        a.eliminate_zeros()
        lb, ub = np.concatenate(self._lb), np.concatenate(self._ub)
        fixed = np.fromiter(self._fixed, dtype=np.int64, count=len(self._fixed))
        lb[fixed] = ub[fixed] = np.fromiter(self._fixed.values(), dtype=float, count=len(fixed))
        options = {"mip_rel_gap": 0.0, "presolve": False}
        if time_limit is not None:
            options["time_limit"] = time_limit
        lo, hi = np.concatenate(self._lo), np.concatenate(self._hi)
        # scipy has no type hints: pyright takes these bounds for floats, from their defaults
        bounds = Bounds(lb, ub)  # pyright: ignore[reportArgumentType]
        rows = LinearConstraint(a, lo, hi)  # pyright: ignore[reportArgumentType]
        result = milp(c, integrality=np.concatenate(self._integer), bounds=bounds,
                      constraints=rows, options=options)
        if result.status == 2:
            return Outcome(None, complete=True)
        if result.status == 1 and time_limit is not None:
            return Outcome(result.x, complete=False)
        if result.status != 0:
            raise PlannerError(f"the MILP solver stopped without an optimum: {result.message}")
        return Outcome(result.x, complete=True)
