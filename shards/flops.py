"""Unit costs for the planner: FLOPs per token, K/V and message bytes.

FLOPs are counted by torch's FlopCounterMode while the unit runs on example inputs, so they
follow the code actually exported (matrix products and attention; elementwise work is not
counted, as usual). Prefill is reported per token of a PROFILE_CONTEXT-token prompt; decode
is one new token over PROFILE_CONTEXT cached positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode


def run_counting_flops(
    module: Callable[..., tuple[torch.Tensor, ...]], args: Sequence[torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...], int]:
    """The module's outputs on `args` and the FLOPs it spent computing them."""
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        outputs = module(*args)
    return outputs, counter.get_total_flops()


def tensor_bytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def state_bytes_per_token(shape: Sequence[int], seq_axis: int, dtype: str) -> int:
    """Bytes one more cached position adds to a state tensor of this (empty) shape."""
    per_position = [d for axis, d in enumerate(shape) if axis != seq_axis]
    return tensor_bytes(per_position, dtype)
