"""int8 quantisation (shards/quantize.py) matches onnxruntime.quantization.quantize_dynamic."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.quantization import QuantType, quantize_dynamic
from sharding import sharded

from shards.onnx_file import write_unit
from shards.quantize import quantize_unit


def _feeds(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in session.get_inputs():
        shape = [{"T": 5, "P": 3}.get(d, d) for d in spec.shape]
        if spec.type == "tensor(int64)":
            feeds[spec.name] = np.arange(5, dtype=np.int64)[None]
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("unit", [0, 1, 2, 5])
def test_same_outputs_as_quantize_dynamic(hf_checkpoint, tmp_path, unit):
    result = sharded(hf_checkpoint("llama"))
    model = onnx.load(str(result.directory / result.manifest.units[unit].model_file.name))
    staged = tmp_path / "model.onnx"
    onnx.save(model, str(staged), save_as_external_data=True, location="model.data",
              size_threshold=1024)
    reference = tmp_path / "reference.onnx"
    quantize_dynamic(staged, reference, weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul", "Gather"])
    ours = tmp_path / "ours.onnx"
    write_unit(quantize_unit(staged), tmp_path, ours.name)

    sessions = [ort.InferenceSession(str(path)) for path in (reference, ours)]
    feeds = _feeds(sessions[0])
    expected, got = (s.run(None, feeds) for s in sessions)
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_array_equal(have, want)
    matrices = [t for t in onnx.load(str(ours)).graph.initializer if len(t.dims) == 2]
    assert matrices and all(
        t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) for t in matrices
    )
