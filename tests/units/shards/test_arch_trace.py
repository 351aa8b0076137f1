"""The architectures stay traceable by torch.fx and exportable to ONNX, with one graph input
per cache tensor and the per-step tensors computed once."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
import torch
import torch.fx

from shards.arch import cache_names, empty_cache
from shards.checkpoint import load_model

TRACE_FAMILIES = ["llama", "llama3-rope-scaling", "qwen2", "mistral", "gpt2", "bloom"]
PROMPT = torch.tensor([[1, 40, 41, 99, 120, 7, 8, 200]])


def prefill_and_step(model, config):
    """Call `model` on a prefill and then on a 2-token step; return both outputs."""
    prefill = model(PROMPT, torch.arange(8)[None], *empty_cache(config))
    step = model(torch.tensor([[5, 6]]), torch.tensor([[8, 9]]), *prefill[1:])
    return prefill, step


@pytest.mark.parametrize("family", TRACE_FAMILIES)
def test_symbolic_trace_reproduces_the_model(hf_checkpoint, family):
    config, model = load_model(hf_checkpoint(family, layers=3))
    traced = torch.fx.symbolic_trace(model)
    placeholders = [node.name for node in traced.graph.nodes if node.op == "placeholder"]
    assert placeholders == ["input_ids", "position_ids", *cache_names(3, "past")]
    with torch.inference_mode():
        for ours, theirs in zip(prefill_and_step(model, config), prefill_and_step(traced, config),
                                strict=True):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_rotary_tensors_are_computed_once(hf_checkpoint):
    _, model = load_model(hf_checkpoint("llama", layers=3))
    graph = torch.fx.symbolic_trace(model).graph
    calls = [n for n in graph.nodes if getattr(n.target, "__name__", n.target) == "cos"]
    assert len(calls) == 1


def export(model, config, path, dynamo: bool) -> None:
    past_names = cache_names(config.num_layers, "past")
    with torch.inference_mode():
        past = model(PROMPT, torch.arange(8)[None], *empty_cache(config))[1:]
    args = (torch.tensor([[5, 6]]), torch.tensor([[8, 9]]), *past)
    if dynamo:
        steps, cached = torch.export.Dim("T"), torch.export.Dim("P")
        shapes = {"input_ids": {1: steps}, "position_ids": {1: steps},
                  **{name: {2: cached} for name in past_names}}
        torch.onnx.export(model, args, path, dynamo=True, dynamic_shapes=shapes, verbose=False)
        return
    axes = {"input_ids": {1: "T"}, "position_ids": {1: "T"}, **{n: {2: "P"} for n in past_names}}
    torch.onnx.export(model, args, path, dynamo=False, opset_version=17,
                      input_names=["input_ids", "position_ids", *past_names],
                      output_names=["logits", *cache_names(config.num_layers, "present")],
                      dynamic_axes=axes)


@pytest.mark.parametrize(("family", "dynamo"), [
    ("llama", False), ("mistral", False), ("qwen2", False), ("gpt2", False), ("bloom", False),
    ("mistral", True), ("bloom", True),
])
@pytest.mark.slow
def test_onnx_export_runs_in_onnxruntime(hf_checkpoint, tmp_path, family, dynamo):
    # a window shorter than the prompt, so that the exported window logic is exercised
    options = {"sliding_window": 5} if family == "mistral" else {}
    config, model = load_model(hf_checkpoint(family, **options))
    path = tmp_path / "model.onnx"
    export(model, config, path, dynamo)
    session = onnxruntime.InferenceSession(str(path))
    names = [i.name for i in session.get_inputs()]
    with torch.inference_mode():
        prefill, step = prefill_and_step(model, config)
    # the same two calls through ONNX Runtime: a prefill (P = 0), then a step with P = 8
    feeds = dict(zip(names, [PROMPT.numpy(), np.arange(8)[None],
                             *[t.numpy() for t in empty_cache(config)]], strict=True))
    got = session.run(None, feeds)
    for ours, theirs in zip(prefill, got, strict=True):
        np.testing.assert_allclose(theirs, ours.numpy(), atol=1e-4, rtol=0)
    feeds = dict(zip(names, [np.array([[5, 6]]), np.array([[8, 9]]), *got[1:]], strict=True))
    for ours, theirs in zip(step, session.run(None, feeds), strict=True):
        np.testing.assert_allclose(theirs, ours.numpy(), atol=1e-4, rtol=0)
