"""Quantisation (shards/quantize.py) matches ONNX Runtime's own quantisers: int8 is
onnxruntime.quantization.quantize_dynamic, int4 is MatMulNBitsQuantizer (symmetric blocks
of quantize.BLOCK, accuracy level 4), to the bit, whatever slices the weights are read in."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
from sharding import sharded

from shards import quantize
from shards.manifest import Quant
from shards.onnx_file import write_unit
from shards.quantize import quantize_unit

# what the embedding's Gather and the MatMuls become
QUANTISED_OPS = {
    Quant.INT8: ("DequantizeLinear", "DynamicQuantizeMatMul"),
    Quant.INT4: ("GatherBlockQuantized", "MatMulNBits"),
}


def _feeds(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in session.get_inputs():
        shape = [{"T": 5, "P": 3, "B": 2}.get(d, d) for d in spec.shape]
        if spec.type == "tensor(int64)":
            feeds[spec.name] = np.resize(np.array([3, 200, 17, 383, 0], dtype=np.int64), shape)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _staged(hf_checkpoint, tmp_path, unit: int, family: str = "llama", name="model.onnx"):
    result = sharded(hf_checkpoint(family))
    model = onnx.load(str(result.directory / result.manifest.units[unit].model_file.name))
    staged = tmp_path / name
    onnx.save(model, str(staged), save_as_external_data=True, location="model.data",
              size_threshold=1024)
    return staged


def _reference(staged, quant: Quant, out, model=None) -> None:
    if quant is Quant.INT8:
        quantize_dynamic(staged, out, weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul", "Gather"])
        return
    quantizer = MatMulNBitsQuantizer(
        model or onnx.load(str(staged)), block_size=quantize.BLOCK, is_symmetric=True,
        accuracy_level=quantize.ACCURACY_LEVEL, op_types_to_quantize=("MatMul", "Gather"),
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(out))


def _outputs(path) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, _feeds(session))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # ORT's, not ours
@pytest.mark.parametrize("quant", [Quant.INT8, Quant.INT4])
@pytest.mark.parametrize("unit", [0, 1, 2, 5])
def test_same_outputs_as_onnx_runtimes_quantiser(hf_checkpoint, tmp_path, unit, quant):
    staged = _staged(hf_checkpoint, tmp_path, unit)
    reference, ours = tmp_path / "reference.onnx", tmp_path / "ours.onnx"
    _reference(staged, quant, reference)
    write_unit(quantize_unit(staged, quant), tmp_path, ours.name)

    for want, have in zip(_outputs(reference), _outputs(ours), strict=True):
        np.testing.assert_array_equal(have, want)
    graph = onnx.load(str(ours)).graph
    assert QUANTISED_OPS[quant][unit != 0] in {n.op_type for n in graph.node}
    assert not [t.name for t in graph.initializer
                if len(t.dims) >= 2 and t.data_type == onnx.TensorProto.FLOAT
                and not t.name.endswith("_scales")]


@pytest.mark.parametrize("quant", [Quant.INT8, Quant.INT4])
@pytest.mark.parametrize("unit", [0, 5])
def test_weights_read_in_small_slices_give_the_same_file(
    hf_checkpoint, tmp_path, monkeypatch, unit, quant
):
    """The test models' matrices fit in one slice; cut them into many (rows of the int8
    matrices and tables, columns of the int4 MatMul weights) and nothing may change."""
    staged = _staged(hf_checkpoint, tmp_path, unit)
    whole = tmp_path / "whole.onnx"
    write_unit(quantize_unit(staged, quant), tmp_path, whole.name)
    monkeypatch.setattr(quantize, "_SLICE_BYTES", 3000)  # 11 rows of 64 or columns of 16
    sliced = tmp_path / "sliced.onnx"
    write_unit(quantize_unit(staged, quant), tmp_path, sliced.name)
    assert sliced.read_bytes() == whole.read_bytes()


@pytest.mark.parametrize("unit", [1, 2])
def test_int4_quantises_gpt2s_gemm_layers_as_matmuls(hf_checkpoint, tmp_path, unit):
    """GPT-2's Conv1D layers are Gemm(A, B) (the bias is an Add): the same product as MatMul,
    and int4 quantises them exactly as MatMulNBitsQuantizer quantises that MatMul."""
    staged = _staged(hf_checkpoint, tmp_path, unit, "gpt2")
    as_matmul = onnx.load(str(staged))
    gemms = [n for n in as_matmul.graph.node if n.op_type == "Gemm"]
    assert gemms
    for node in gemms:
        node.op_type = "MatMul"
        del node.attribute[:]
    reference, ours = tmp_path / "reference.onnx", tmp_path / "ours.onnx"
    _reference(None, Quant.INT4, reference, as_matmul)
    write_unit(quantize_unit(staged, Quant.INT4), tmp_path, ours.name)
    for want, have in zip(_outputs(reference), _outputs(ours), strict=True):
        np.testing.assert_array_equal(have, want)
    ops = [n.op_type for n in onnx.load(str(ours)).graph.node]
    assert "Gemm" not in ops and ops.count("MatMulNBits") == len(gemms)


def test_int4_layout_is_matmulnbits_blocks(hf_checkpoint, tmp_path):
    """The head's weight [K, N]: N rows of K/BLOCK blocks of BLOCK/2 bytes, two values a
    byte, low nibble first, stored +8; one scale per block, which maps the block's extreme
    to -8."""
    staged = _staged(hf_checkpoint, tmp_path, 5)
    weight = next(t for t in onnx.load(str(staged)).graph.initializer if len(t.dims) == 2)
    floats = onnx.numpy_helper.to_array(weight, str(tmp_path))
    ours = tmp_path / "ours.onnx"
    write_unit(quantize_unit(staged, Quant.INT4), tmp_path, ours.name)
    graph = onnx.load(str(ours)).graph
    tensors = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    packed, scales = tensors[f"{weight.name}_q4"], tensors[f"{weight.name}_scales"]
    k, n = floats.shape
    block = quantize.BLOCK
    assert packed.shape == (n, k // block, block // 2) and scales.shape == (n, k // block)
    values = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, k // block, block)
    restored = ((values.astype(np.float32) - 8) * scales[..., None]).reshape(n, k).T
    extremes = np.abs(floats.T.reshape(n, -1, block)).max(-1)
    np.testing.assert_allclose(np.abs(scales), extremes / 8, rtol=1e-6)
    # half a step, or a whole one for a value near the opposite extreme (7 steps, not 8)
    error = np.abs(restored - floats).T.reshape(n, -1, block).max(-1)
    assert (error <= np.abs(scales) * (1 + 1e-6)).all()
    assert np.median(error / np.abs(scales)) < 0.5


def test_int4_runs_matmuls_of_one_activation_as_one(hf_checkpoint, tmp_path):
    """q, k and v (and the MLP's gate and up) read the same normalised hidden state: int4
    multiplies it by their weights side by side in one MatMulNBits and splits the product;
    the outputs are those of MatMulNBitsQuantizer's one MatMulNBits per MatMul (test above)."""
    for unit, matmuls, fused in ((1, 4, 2), (2, 3, 2)):  # a layer's attention, its MLP
        staged = _staged(hf_checkpoint, tmp_path, unit, name=f"unit{unit}.onnx")
        assert [n.op_type for n in onnx.load(str(staged)).graph.node].count("MatMul") >= matmuls
        ours = tmp_path / f"ours{unit}.onnx"
        write_unit(quantize_unit(staged, Quant.INT4), tmp_path, ours.name)
        ops = [n.op_type for n in onnx.load(str(ours)).graph.node]
        assert ops.count("MatMulNBits") == fused and ops.count("Split") >= 1
