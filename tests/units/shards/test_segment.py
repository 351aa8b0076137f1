"""Segmentation: units, dependency maps, and that the unit graphs compute the whole model."""

from __future__ import annotations

import pytest
import torch

from shards.arch import build_model, empty_cache
from shards.checkpoint import load_model
from shards.config import load_config
from shards.segment import LOGITS, REQUEST, segment

RESIDUALS = {"llama": {"rotary.cos", "rotary.sin", "mask"}, "bloom": {"mask"}}


def _segmentation(hf_checkpoint, family: str, granularity: str = "half"):
    config = load_config(hf_checkpoint(family, layers=3))
    return config, segment(build_model(config, "meta"), granularity)


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_per_step_tensors_are_produced_once_and_read_by_every_attention(hf_checkpoint, family):
    _, seg = _segmentation(hf_checkpoint, family)
    attention_units = [u.index for u in seg.units if u.name.endswith(".attn")]
    assert len(attention_units) == 3
    residuals = {n for n, c in seg.consumers.items() if len(c) > 1 or min(c) > seg.producers[n] + 1}
    assert residuals == RESIDUALS[family]
    for name in RESIDUALS[family]:
        assert seg.producers[name] == 0
        assert seg.consumers[name] == tuple(attention_units)


@pytest.mark.parametrize("family", ["llama", "bloom", "gpt2"])
def test_the_hidden_state_is_sequential_and_units_form_a_chain(hf_checkpoint, family):
    config, seg = _segmentation(hf_checkpoint, family)
    names = [u.name for u in seg.units]
    halves = [f"layer{i}.{part}" for i in range(config.num_layers) for part in ("attn", "mlp")]
    assert names == ["embed", *halves, "head"]
    for unit in seg.units[:-1]:
        hidden = f"{unit.name}.hidden"
        assert hidden in unit.outputs and seg.consumers[hidden] == (unit.index + 1,)
    assert seg.units[-1].outputs == (LOGITS,) and seg.consumers[LOGITS] == (REQUEST,)
    for unit in seg.units:
        assert all(seg.producers[name] < unit.index for name in unit.inputs)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_units_end_at_cut_points_and_blocks_start_at_eq1_candidates(hf_checkpoint, family):
    _, seg = _segmentation(hf_checkpoint, family)
    assert len(seg.boundaries) == len(seg.units) - 1
    assert set(seg.boundaries) <= set(seg.cut_points)
    # the residual stream entering each attention / MLP block fans out (Eq. 1); only the value
    # entering the head may not (GPT-2's final LayerNorm is its single reader)
    assert set(seg.boundaries[:-1]) <= set(seg.candidates)
    assert (seg.boundaries[-1] in seg.candidates) == (family == "llama")


def test_state_and_weights_stay_with_their_layer(hf_checkpoint):
    _, seg = _segmentation(hf_checkpoint, "llama")
    for unit in seg.units:
        if unit.name.startswith("layer"):
            layer, half = unit.name.removeprefix("layer").split(".")
            assert all(t.startswith(f"layers.{layer}.{half}.") for t in unit.targets)
            expected = ((f"past_k_{layer}", f"present_k_{layer}"),
                        (f"past_v_{layer}", f"present_v_{layer}"))
            assert unit.state == (expected if half == "attn" else ())


def test_layer_granularity_gives_one_unit_per_layer(hf_checkpoint):
    config, seg = _segmentation(hf_checkpoint, "llama", "layer")
    assert [u.name for u in seg.units] == ["embed", "layer0", "layer1", "layer2", "head"]
    assert seg.consumers["rotary.cos"] == (1, 2, 3)


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "bloom"])
@pytest.mark.parametrize("past", [0, 5])
def test_units_chained_in_torch_compute_the_whole_model(hf_checkpoint, family, past):
    config, model = load_model(hf_checkpoint(family, layers=3))
    seg = segment(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, 4), generator=generator)
    positions = torch.arange(past, past + 4)[None]
    cache = [torch.randn(1, config.num_kv_heads, past, config.head_dim, generator=generator)
             for _ in empty_cache(config)]
    with torch.no_grad():
        logits, *present = model(ids, positions, *cache)
        values = {"input_ids": ids, "position_ids": positions}
        values.update({f"past_{k}_{i}": cache[2 * i + (k == "v")]
                       for i in range(config.num_layers) for k in "kv"})
        for unit in seg.units:
            outputs = unit.module(model)(*(values[n] for n in unit.input_names))
            values.update(zip(unit.output_names, outputs, strict=True))
    torch.testing.assert_close(values[LOGITS], logits, rtol=0, atol=0)
    for i in range(config.num_layers):
        torch.testing.assert_close(values[f"present_k_{i}"], present[2 * i], rtol=0, atol=0)
        torch.testing.assert_close(values[f"present_v_{i}"], present[2 * i + 1], rtol=0, atol=0)


def test_unknown_granularity_is_refused(hf_checkpoint):
    config = load_config(hf_checkpoint("llama"))
    with pytest.raises(ValueError, match="granularity"):
        segment(build_model(config, "meta"), "quarter")
