"""Early exit (CE-CoLLM): the model's own final norm and LM head on an intermediate hidden state.

In a pre-norm transformer the residual stream after any decoder layer has the shape of the
one the head unit (final norm, LM head) reads after the last layer, so the head unit's
session, fed the stream after `layer` layers, gives that depth's next-token logits: the
exit. `ExitPoint` names where the exit reads; the stage executor that holds the exit's
unit gives that stream at the last position of every step (`EXIT_HIDDEN` in the step's
outputs) and runs the head on it when asked (`StageExecutor.exit_logits`): after the step's
messages are on their way, so the stages behind start at once. Confidence is the top softmax
probability of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shards.manifest import Manifest

EXIT_HIDDEN = "exit.hidden"  # a step's output on the stage with the exit: [B, 1, hidden]


@dataclass(frozen=True)
class ExitPoint:
    layer: int  # decoder layers before the exit
    unit: int  # the unit whose output is the residual stream after them
    hidden: str  # that output
    head: int  # the head unit: final norm and LM head
    head_input: str  # the name the head unit reads its hidden state under


MAX_DRAFTS = 16


@dataclass(frozen=True)
class ExitSettings:
    """Early exit on the source peer, as `--early-exit`, `--exit-layer` and `--speculative`
    ask for it."""

    threshold: float | None = None  # answer from the exit at this confidence (None: never)
    speculative: int = 0  # tokens the exit drafts for each check by the full model (0: none)
    layer: int | None = None  # decoder layers before the exit (None: the source stage's end)

    def __post_init__(self) -> None:
        if self.threshold is not None and not self.threshold >= 0.0:
            raise ValueError(f"--early-exit must be a number >= 0, not {self.threshold}")
        if not 0 <= self.speculative <= MAX_DRAFTS:
            raise ValueError(f"--speculative must be from 0 to {MAX_DRAFTS}, "
                             f"not {self.speculative}")
        if self.layer is not None and not self.enabled:
            raise ValueError("--exit-layer places the exit of --early-exit or --speculative")
        if self.threshold is not None and self.speculative:
            raise ValueError("--early-exit and --speculative do not go together: an exited "
                             "token is not checked, a drafted one is")

    @property
    def enabled(self) -> bool:
        return self.threshold is not None or self.speculative > 0

    def figures(self, point: ExitPoint, counts: dict) -> dict:
        """What the --json stats and the status say of an exit: where it is, these settings,
        and `counts` (of one answer or of all so far)."""
        return {"layer": point.layer, "threshold": self.threshold,
                "speculative": self.speculative, **counts}


# what an exit did, counted per answer and summed per plane
EXIT_COUNTS = ("exited", "agreed", "checked", "drafted", "accepted")


def exit_point(manifest: Manifest, layer: int) -> ExitPoint:
    """The exit after `layer` decoder layers; ValueError (one line) where there is none."""
    layers = manifest.model.num_layers
    if not 1 <= layer < layers:
        raise ValueError(f"the exit layer must be from 1 to {layers - 1}, not {layer}")
    names = {unit.name: unit for unit in manifest.units}
    unit = names.get(f"layer{layer - 1}.mlp") or names.get(f"layer{layer - 1}")
    head = manifest.units[-1]
    if unit is None or head.name != "head" or len(unit.outputs) != 1 or len(head.inputs) != 1:
        raise ValueError(f"{manifest.model.architecture}: no exit after layer {layer} in "
                         "these units")
    return ExitPoint(layer, unit.index, unit.outputs[0].name, head.index, head.inputs[0].name)


def stage_exit(manifest: Manifest, last_unit: int, layer: int | None) -> ExitPoint:
    """The exit after `layer` layers (None: the deepest) on the stage of units 0..last_unit;
    ValueError (one line) where the stage holds none."""
    deepest = last_exit_layer(manifest, last_unit)
    if deepest == 0:
        raise ValueError("the first stage holds no whole decoder layer to exit after")
    point = exit_point(manifest, layer or deepest)
    if point.unit > last_unit:
        raise ValueError(f"the exit after layer {point.layer} is not on the first stage (units "
                         f"0-{last_unit}, layers 1-{deepest})")
    return point


def last_exit_layer(manifest: Manifest, last_unit: int) -> int:
    """The deepest exit within units 0..last_unit (a stage that starts at unit 0), 0 if the
    units hold no whole decoder layer."""
    deepest = 0
    for layer in range(1, manifest.model.num_layers):
        try:
            if exit_point(manifest, layer).unit <= last_unit:
                deepest = layer
        except ValueError:
            continue
    return deepest


def confidence(row: np.ndarray) -> float:
    """The top softmax probability of a row of logits."""
    row = np.asarray(row, dtype=np.float64)
    top = row.max()
    return float(1.0 / np.exp(row - top).sum())
