"""What a long prompt leaves resident in this process once its sequence is gone."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import psutil

from shards import heap

Step = Callable[[str, dict[str, np.ndarray]], object]  # (seq_id, inputs): one step, rows=1


def left_by_prompt(step: Step, drop: Callable[[str], None], tokens: int) -> int:
    """Bytes of resident memory a `tokens`-token prefill leaves once its sequence is dropped
    and glibc has handed its free heap back, after an 8-token prefill has warmed up."""

    def prefill(seq_id: str, length: int) -> None:
        positions = np.arange(length)[None]
        step(seq_id, {"input_ids": np.full((1, length), 5), "position_ids": positions})
        drop(seq_id)
        heap.trim()

    prefill("warm", 8)
    before = psutil.Process().memory_info().rss
    prefill("long", tokens)
    return psutil.Process().memory_info().rss - before
