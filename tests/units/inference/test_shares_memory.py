"""What a share holds once a step is over: its K/V, not the step's activations."""

from __future__ import annotations

import pytest
from resident import left_by_prompt
from sharding import sharded, share_units

from peerd.inference.shares import ShareStage


@pytest.mark.slow
def test_a_long_prompt_on_shares_leaves_no_arena_behind(hf_checkpoint):
    """Each share's attention runs its tiles on the process arena (heads x rows x length
    floats of scores per tile), handed back when the step ends: once the sequence is dropped,
    resident memory is back within one share's scores of the whole prompt."""
    length, heads = 2048, 4
    model_dir = hf_checkpoint("llama", heads=heads, kv_heads=2, max_position_embeddings=length)
    result = sharded(model_dir)
    stage = ShareStage(result.manifest, result.directory, 0, len(result.manifest.units) - 1,
                       share_units(model_dir, (1.0, 1.0)))
    left = left_by_prompt(lambda seq_id, inputs: stage.step(seq_id, inputs, rows=1),
                          stage.drop, length)
    assert left < heads // 2 * length * length * 4
