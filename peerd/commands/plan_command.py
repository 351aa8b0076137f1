"""`peerd plan`: read a cluster file and a units file (or manifest), print the planner's plan."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from peerd.errors import PeerdError
from planner.constraints import size
from planner.cost import capacity, memory_need, stage_compute_s
from planner.errors import PlannerError
from planner.groups import FIRST_TOKEN, Shape, ShapeKind, best_by_kind, fastest, stage_s
from planner.io import cluster_from_dict, plan_to_dict, shape_to_dict, workload_from_dict
from planner.model import Cluster, Plan, Workload
from planner.solve import solve


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise PeerdError(f"cannot read {what} file {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PeerdError(f"{what} file {path} is not valid JSON: {exc}") from exc


@contextmanager
def quiet_solver() -> Iterator[None]:
    """HiGHS (inside scipy) prints stray debugging lines on the process's stdout (file
    descriptor 1); send them to /dev/null while solving so stdout keeps only our output.
    Not thread-safe: it swaps the process-wide descriptor."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _units(units: range | tuple[int, ...]) -> str:
    if not units:
        return "-"
    if list(units) == list(range(units[0], units[-1] + 1)):
        return str(units[0]) if len(units) == 1 else f"{units[0]}-{units[-1]}"
    return ",".join(map(str, units))


def render(plan: Plan, cluster: Cluster, workload: Workload) -> str:
    """The plan as a short table for people."""
    p = plan.predicted
    lines = [
        f"{plan.solver} plan for {plan.objective}: {p.throughput_tps:.2f} tokens/s "
        f"(bottleneck {1e3 * p.bottleneck_s:.2f} ms), latency {1e3 * p.latency_s:.2f} ms "
        f"per token, solved in {1e3 * plan.solve_s:.1f} ms",
        f"{'stage':<6}{'peer':<20}{'units':<10}{'compute':>12}{'memory':>22}  movable",
    ]
    for i, (stage, movable) in enumerate(zip(plan.stages, plan.movable, strict=True)):
        device = cluster.device(stage.peer)
        need = sum(memory_need(cluster, workload.units[u]) for u in stage.units)
        memory = f"{size(need)} / {size(capacity(cluster, device))}"
        compute = f"{1e3 * stage_compute_s(cluster, workload, stage):.2f} ms"
        lines.append(f"{i:<6}{stage.peer:<20}{_units(stage.units):<10}{compute:>12}{memory:>22}"
                     f"  {_units(movable)}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        cluster = cluster_from_dict(_read_json(args.cluster, "cluster"))
    except PlannerError as exc:
        raise PeerdError(f"cluster file {args.cluster}: {exc}") from exc
    try:
        workload = workload_from_dict(_read_json(args.units, "units"))
    except PlannerError as exc:
        raise PeerdError(f"units file {args.units}: {exc}") from exc
    if args.shapes:
        return _print_shapes(args, cluster, workload)
    if args.objective == FIRST_TOKEN:
        raise PeerdError("--objective first-token weighs shapes: add --shapes")
    try:
        with quiet_solver():
            plan = solve(cluster, workload, args.objective, args.solver)
    except PlannerError as exc:
        raise PeerdError(str(exc)) from exc
    print(json.dumps(plan_to_dict(plan)) if args.json else render(plan, cluster, workload))
    return 0


def _print_shapes(args: argparse.Namespace, cluster: Cluster, workload: Workload) -> int:
    try:
        kinds = best_by_kind(cluster, workload, args.objective, args.prompt_tokens)
    except PlannerError as exc:
        raise PeerdError(str(exc)) from exc
    best = fastest(kinds.values())
    if args.json:
        print(json.dumps({"best": shape_to_dict(best),
                          "by_kind": {kind.value: shape_to_dict(shape)
                                      for kind, shape in kinds.items()}}))
    else:
        print(render_shapes(best, kinds, cluster, workload))
    return 0


def render_shapes(best: Shape, kinds: dict[ShapeKind, Shape], cluster: Cluster,
                  workload: Workload) -> str:
    """The best shape's stages (a group's peers with their shares), then each shape's
    figures, for people."""
    lines = [f"best shape for {best.objective}: {best.kind.value}",
             f"{'stage':<6}{'peers (share)':<40}{'units':<10}{'decode':>12}"]
    for i, stage in enumerate(best.stages):
        peers = ", ".join(f"{share.peer} ({100 * share.fraction:.0f}%)" if len(stage.shares) > 1
                          else share.peer for share in stage.shares)
        decode = f"{1e3 * stage_s(cluster, workload, stage, 1):.2f} ms"
        lines.append(f"{i:<6}{peers:<40}{_units(stage.units):<10}{decode:>12}")
    lines.append(f"{'shape':<22}{'first token':>14}{'latency':>12}{'tokens/s':>10}"
                 f"  (prompt {best.prompt_tokens} tokens)")
    for kind, shape in sorted(kinds.items(), key=lambda item: list(ShapeKind).index(item[0])):
        p = shape.predicted
        lines.append(f"{kind.value:<22}{1e3 * p.first_token_s:>11.1f} ms"
                     f"{1e3 * p.latency_s:>9.2f} ms{p.throughput_tps:>10.2f}")
    return "\n".join(lines)
