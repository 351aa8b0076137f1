"""Pure optimisation: cost model, solvers and simulator. No I/O, no torch, no network."""
