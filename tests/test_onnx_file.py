"""Single-file ONNX writing that streams the weights (shards/onnx_file.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from shards.onnx_file import save_external, write_single_file


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 300)
        self.table = torch.nn.Parameter(torch.randn(300, 5))
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) @ self.table) * self.steps


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside torch.export
def test_streamed_file_holds_the_same_model_as_a_plain_save(tmp_path):
    model = _Small().eval()
    x = torch.randn(2, 8)
    program = torch.onnx.export(model, (x,), dynamo=True, verbose=False)
    plain = tmp_path / "plain.onnx"
    program.save(str(plain))
    streamed = tmp_path / "streamed.onnx"
    staging = tmp_path / "staging"
    staging.mkdir()
    weight_bytes = write_single_file(save_external(program, staging), streamed)
    plain_model, streamed_model = onnx.load(str(plain)), onnx.load(str(streamed))
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in plain_model.graph.initializer}
    for tensor in streamed_model.graph.initializer:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor), arrays.pop(tensor.name))
    assert not arrays
    assert weight_bytes == sum(
        onnx.numpy_helper.to_array(t).nbytes for t in plain_model.graph.initializer
    )
    assert streamed_model.graph.node == plain_model.graph.node
    session = ort.InferenceSession(str(streamed))
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)
