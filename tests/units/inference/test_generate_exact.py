"""Exactness: the exported units, split into K stages, reproduce transformers exactly.

For every family and every K from 1 to the number of units, greedy generation through the
in-process pipeline (every message through the wire codec) gives transformers' greedy tokens,
and each logits row is within 1e-4 of transformers' float32 logits.
"""

from __future__ import annotations

import numpy as np
import pytest
from sharding import reference, sharded

from peerd.commands.generate import build_pipeline, generate, split_units
from shards.sampling import SamplingParams

FAMILIES = ["llama", "llama-tied", "llama3-rope-scaling", "qwen2", "mistral", "gpt2", "bloom"]
PROMPT = (1, 17, 42, 99, 7, 250, 3, 64)
NEW_TOKENS = 36
GREEDY = SamplingParams()


def _run(result, parts: int, params: SamplingParams = GREEDY, fp16_wire: bool = False):
    pipeline = build_pipeline(result.manifest, result.directory, parts, fp16_wire)
    run = generate(pipeline, result.manifest, list(PROMPT), NEW_TOKENS, params, stop_at_eos=False)
    assert all(w.executor.sequence_count == 0 for w in pipeline.workers)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_at_every_split(hf_checkpoint, family):
    model_dir = hf_checkpoint(family)
    result = sharded(model_dir)
    tokens, logits = reference(model_dir, PROMPT, NEW_TOKENS)
    for parts in range(1, len(result.manifest.units) + 1):
        run = _run(result, parts)
        assert run.token_ids == tokens, f"{family} split into {parts} parts"
        np.testing.assert_allclose(np.stack(run.logits), logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_seeded_sampling_is_reproducible_and_the_same_at_every_split(hf_checkpoint, family):
    result = sharded(hf_checkpoint(family))
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=11)
    first = _run(result, 1, params).token_ids
    assert _run(result, 1, params).token_ids == first
    for parts in range(2, len(result.manifest.units) + 1):
        assert _run(result, parts, params).token_ids == first, f"split into {parts} parts"
    other_seed = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=12)
    assert _run(result, 3, other_seed).token_ids != first


def test_float16_wire_keeps_logits_close(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    result = sharded(model_dir)
    _, logits = reference(model_dir, PROMPT, NEW_TOKENS)
    run = _run(result, len(result.manifest.units), fp16_wire=True)
    first_row = run.logits[0]
    np.testing.assert_allclose(first_row, logits[0], rtol=0, atol=0.05 * np.abs(logits[0]).max())


@pytest.mark.parametrize("units", [1, 6, 50])
def test_splits_are_contiguous_and_even(units):
    for parts in range(1, units + 1):
        ranges = split_units(units, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == units - 1
        assert all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:], strict=False))
        sizes = [last - first + 1 for first, last in ranges]
        assert len(sizes) == parts and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
