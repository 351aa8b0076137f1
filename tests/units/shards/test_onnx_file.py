"""A unit written as its model file and one data file named by its sha256 (shards/onnx_file.py)."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from shards.onnx_file import save_external, write_unit


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 300)
        self.table = torch.nn.Parameter(torch.randn(300, 5))
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) @ self.table) * self.steps


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside torch.export
def test_the_unit_holds_the_same_model_as_a_plain_save_with_its_weights_beside_it(tmp_path):
    model = _Small().eval()
    x = torch.randn(2, 8)
    program = torch.onnx.export(model, (x,), dynamo=True, verbose=False)
    plain = tmp_path / "plain.onnx"
    program.save(str(plain))
    staging, out = tmp_path / "staging", tmp_path / "out"
    staging.mkdir()
    (out / "units").mkdir(parents=True)
    written = write_unit(save_external(program, staging), out, "units/000-small.onnx")

    model_file, data_file = written.files
    assert model_file.name == "units/000-small.onnx"
    data = (out / data_file.name).read_bytes()
    assert data_file.name == f"units/{data_file.sha256}.data"
    assert hashlib.sha256(data).hexdigest() == data_file.sha256 and len(data) == data_file.bytes
    model_bytes = (out / model_file.name).read_bytes()
    assert hashlib.sha256(model_bytes).hexdigest() == model_file.sha256
    assert len(model_bytes) == model_file.bytes < 10_000, "no weights inside the model file"

    graph = onnx.load(str(out / model_file.name), load_external_data=False).graph
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {e.key: e.value for e in tensor.external_data}
            assert entries["location"] == f"{data_file.sha256}.data"
            assert int(entries["offset"]) % 4096 == 0, "page-aligned, so it can be mapped"
    assert sorted(p.name for p in (out / "units").iterdir()) == sorted(
        [f"{data_file.sha256}.data", "000-small.onnx"]), "nothing else is left behind"

    plain_model, written_model = onnx.load(str(plain)), onnx.load(str(out / model_file.name))
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in plain_model.graph.initializer}
    for tensor in written_model.graph.initializer:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor), arrays.pop(tensor.name))
    assert not arrays
    assert written.weight_bytes == sum(
        onnx.numpy_helper.to_array(t).nbytes for t in plain_model.graph.initializer
    )
    assert written_model.graph.node == plain_model.graph.node
    session = ort.InferenceSession(str(out / model_file.name))
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)
