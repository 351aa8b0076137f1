"""GGUF files written from the random checkpoints of tests/checkpoints.py, as llama.cpp's
`convert_hf_to_gguf.py` writes them.

`write_gguf(model_dir, out, tensor_type)` follows the converter: tensor names from the
`gguf` package's `TensorNameMap`, the `{arch}.*` hyper-parameters each model class writes,
the Llama architecture's Q/K row permutation (not Qwen2's), GPT-2's transposed Conv1D
weights and duplicated `output.weight`, BLOOM's regrouped fused QKV rows and duplicated
`output.weight`, Llama 3's RoPE scaling as a `rope_freqs` tensor, 1-D tensors kept in F32.
Matrices are stored as `tensor_type`: F32, F16 and BF16 by conversion; Q8_0, Q4_0, Q4_1,
Q5_0 and Q5_1 with `gguf.quants.quantize`; Q4_K, Q5_K and Q6_K, which the package cannot
quantise, with the small quantisers below (per-block scales chosen from the block's range;
llama.cpp's own search for the best scales is not reproduced, so compare these files with
transformers run on their dequantised weights, not on the source). A matrix whose rows do
not divide into the type's blocks falls back to F16, as in the converter (K-quant blocks
hold 256 values: use hidden sizes that are multiples of 256 to get K-quant matrices).
The vocabulary (`tokenizer.ggml.*`, chat template) comes from tests/gguf_vocab.py when it
exists and the checkpoint has a tokenizer (`vocab=False` leaves it out); the end and start
ids are written here when it did not write them.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

from shards.config import WEIGHTS_FILE, WEIGHTS_INDEX

QK_K = 256
ROPE_FREQS = "rope_freqs.weight"
ARCHITECTURES = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "GPT2LMHeadModel": gguf.MODEL_ARCH.GPT2,
    "BloomForCausalLM": gguf.MODEL_ARCH.BLOOM,
}
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}


def write_gguf(model_dir: Path, out: Path, tensor_type: str = "F32", vocab: bool = True) -> Path:
    """Convert the checkpoint in `model_dir` into the GGUF file `out`; return `out`."""
    hparams = json.loads((model_dir / "config.json").read_text())
    arch = ARCHITECTURES[hparams["architectures"][0]]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    _HPARAMS[arch](writer, hparams)
    writer.add_file_type(FILE_TYPES[tensor_type])
    vocab_module = _vocab_module() if vocab else None
    if vocab_module is not None and (model_dir / "tokenizer.json").is_file():
        vocab_module.add_vocab(writer, model_dir)
    _add_special_ids(writer, model_dir, hparams)
    name_map = gguf.get_tensor_name_map(arch, _block_count(hparams))
    for name, tensor in _converted(arch, hparams, _read_checkpoint(model_dir)):
        stored = name if name == ROPE_FREQS else name_map.get_name(name, (".weight", ".bias"))
        assert stored is not None, f"no GGUF name for {name}"
        _add_tensor(writer, stored, tensor.numpy(), tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _vocab_module():
    path = Path(__file__).with_name("gguf_vocab.py")
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("gguf_vocab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _add_special_ids(writer: gguf.GGUFWriter, model_dir: Path, hparams: dict) -> None:
    generation = model_dir / "generation_config.json"
    source = json.loads(generation.read_text()) if generation.is_file() else hparams
    written = writer.kv_data[0]
    eos = source.get("eos_token_id", hparams.get("eos_token_id"))
    if gguf.Keys.Tokenizer.EOS_ID not in written and eos is not None:
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    bos = hparams.get("bos_token_id")
    if gguf.Keys.Tokenizer.BOS_ID not in written and bos is not None:
        writer.add_bos_token_id(bos)


def _read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / WEIGHTS_INDEX
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else [WEIGHTS_FILE])
    tensors = {}
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as handle:
            names = handle.keys()
            tensors.update({name: handle.get_tensor(name).float() for name in names})
    return tensors


def _block_count(hparams: dict) -> int:
    return hparams.get("num_hidden_layers", hparams.get("n_layer"))


# -- hyper-parameters, as each converter model class writes them ---------------------------
def _rope_parameters(hparams: dict) -> dict:
    return hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}


def _text_model(writer: gguf.GGUFWriter, hparams: dict) -> None:
    """TextModel.set_gguf_parameters (the base class)."""
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    theta = _rope_parameters(hparams).get("rope_theta", hparams.get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    if hparams.get("head_dim") is not None:
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])


def _llama(writer: gguf.GGUFWriter, hparams: dict) -> None:
    _text_model(writer, hparams)
    writer.add_vocab_size(hparams["vocab_size"])
    writer.add_rope_dimension_count(_head_dim(hparams))
    rope = _rope_parameters(hparams)
    if rope.get("rope_type", rope.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])


def _gpt2(writer: gguf.GGUFWriter, hparams: dict) -> None:
    writer.add_block_count(hparams["n_layer"])
    writer.add_context_length(hparams.get("n_ctx", hparams["n_positions"]))
    writer.add_embedding_length(hparams["n_embd"])
    writer.add_feed_forward_length(4 * hparams["n_embd"])
    writer.add_head_count(hparams["n_head"])
    writer.add_layer_norm_eps(hparams["layer_norm_epsilon"])


def _bloom(writer: gguf.GGUFWriter, hparams: dict) -> None:
    n_embed = hparams.get("hidden_size", hparams.get("n_embed"))
    n_head = hparams.get("n_head", hparams.get("num_attention_heads"))
    writer.add_context_length(hparams.get("seq_length", n_embed))
    writer.add_embedding_length(n_embed)
    writer.add_feed_forward_length(4 * n_embed)
    writer.add_block_count(hparams["n_layer"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_eps(hparams["layer_norm_epsilon"])


_HPARAMS = {
    gguf.MODEL_ARCH.LLAMA: _llama,
    gguf.MODEL_ARCH.QWEN2: _text_model,
    gguf.MODEL_ARCH.GPT2: _gpt2,
    gguf.MODEL_ARCH.BLOOM: _bloom,
}


def _head_dim(hparams: dict) -> int:
    return hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]


# -- tensors, as each converter model class's modify_tensors changes them -------------------
def _converted(arch: gguf.MODEL_ARCH, hparams: dict, tensors: dict[str, torch.Tensor]):
    """(name for the name map, or a GGUF name for added tensors; tensor) in file order."""
    if arch == gguf.MODEL_ARCH.LLAMA:
        yield from _llama_tensors(hparams, tensors)
    elif arch == gguf.MODEL_ARCH.GPT2:
        yield from _gpt2_tensors(tensors)
    elif arch == gguf.MODEL_ARCH.BLOOM:
        yield from _bloom_tensors(hparams, tensors)
    else:
        yield from tensors.items()


def permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: per head, rotary halves -> interleaved pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _llama_tensors(hparams: dict, tensors: dict[str, torch.Tensor]):
    rope = _rope_parameters(hparams)
    if rope.get("rope_type") == "llama3":
        yield ROPE_FREQS, _llama3_rope_factors(hparams, rope)
    n_head, n_kv_head = hparams["num_attention_heads"], hparams["num_key_value_heads"]
    for name, tensor in tensors.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute(tensor, n_head)
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute(tensor, n_kv_head)
        yield name, tensor


def _llama3_rope_factors(hparams: dict, rope: dict) -> torch.Tensor:
    base, dim = rope.get("rope_theta", 10000.0), _head_dim(hparams)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _gpt2_tensors(tensors: dict[str, torch.Tensor]):
    for name, tensor in tensors.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            tensor = tensor.transpose(1, 0)
        yield name, tensor
        if name.removeprefix("transformer.") == "wte.weight":
            yield "lm_head.weight", tensor


def _bloom_tensors(hparams: dict, tensors: dict[str, torch.Tensor]):
    n_head = hparams.get("n_head", hparams.get("num_attention_heads"))
    n_embed = hparams.get("hidden_size", hparams.get("n_embed"))
    for name, tensor in tensors.items():
        name = name.removeprefix("transformer.")
        if name.endswith("query_key_value.weight"):
            tensor = tensor.reshape(n_head, 3, n_embed // n_head, n_embed)
            tensor = torch.cat([tensor[:, i].reshape(-1, n_embed) for i in range(3)])
        elif name.endswith("query_key_value.bias"):
            tensor = tensor.reshape(n_head, 3, n_embed // n_head)
            tensor = torch.cat([tensor[:, i].reshape(n_embed) for i in range(3)])
        yield name, tensor
        if name == "word_embeddings.weight" and "lm_head.weight" not in tensors:
            yield "lm_head.weight", tensor


# -- storage types ----------------------------------------------------------------------------
def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, tensor_type: str) -> None:
    qtype = Q[tensor_type]
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    if array.ndim == 1 or name == ROPE_FREQS:
        qtype = Q.F32
    elif array.shape[-1] % block_size:
        qtype = Q.F16
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, gguf.quants.quantize(array, qtype))
    else:
        writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)


def quantize(array: np.ndarray, qtype: Q) -> np.ndarray:
    """Rows of float32 values -> rows of GGUF blocks (uint8)."""
    if qtype in K_QUANTIZERS:
        blocks = array.reshape(-1, QK_K).astype(np.float32)
        return K_QUANTIZERS[qtype](blocks).reshape(*array.shape[:-1], -1)
    return gguf.quants.quantize(array, qtype)


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _ratio(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.divide(values, scale, out=np.zeros_like(values), where=scale != 0)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block into 12 bytes (inverse of Q4_K.get_scale_min)."""
    low = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    low_mins = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    rest = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, low_mins, rest], axis=1).astype(np.uint8)


def _affine_k(blocks: np.ndarray, levels: int):
    """Q4_K/Q5_K: x ~ d*scale_j*q - dmin*min_j on 8 sub-blocks of 32, q in 0..levels."""
    sub = blocks.reshape(-1, 8, 32)
    mins = np.maximum(0.0, -sub.min(axis=2))
    scales = (sub.max(axis=2) + mins) / levels
    d = _f16(scales.max(axis=1) / 63)
    dmin = _f16(mins.max(axis=1) / 63)
    scale_q = np.clip(np.round(_ratio(scales, d[:, None].astype(np.float32))), 0, 63)
    min_q = np.clip(np.round(_ratio(mins, dmin[:, None].astype(np.float32))), 0, 63)
    step = d[:, None, None].astype(np.float32) * scale_q[:, :, None]
    offset = dmin[:, None, None].astype(np.float32) * min_q[:, :, None]
    q = np.clip(np.round(_ratio(sub + offset, step)), 0, levels).astype(np.uint8)
    head = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8),
                           _pack_k_scales(scale_q.astype(np.uint8), min_q.astype(np.uint8))],
                          axis=1)
    return head, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2g and 2g+1 of 32 values share 32 bytes: low and high nibbles."""
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _affine_k(blocks, 15)
    return np.concatenate([head, _nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _affine_k(blocks, 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # [n, 8, 32]: bit j of byte l is sub-block j's
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([head, qh, _nibbles(q)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """x ~ d*scale_s*(q - 32) on 16 sub-blocks of 16, q in 0..63, int8 scales."""
    sub = blocks.reshape(-1, 16, 16)
    scales = np.abs(sub).max(axis=2) / 31
    d = _f16(scales.max(axis=1) / 127)
    scale_q = np.clip(np.round(_ratio(scales, d[:, None].astype(np.float32))), -128, 127)
    step = d[:, None, None].astype(np.float32) * scale_q[:, :, None]
    q = (np.clip(np.round(_ratio(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    halves = q.reshape(-1, 2, 128)  # each half: ql 64 bytes (two nibble rows), qh 32 bytes
    low = halves & 0x0F
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    high = (halves >> 4).reshape(-1, 2, 4, 32)
    qh = np.bitwise_or.reduce(high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None],
                              axis=2).reshape(-1, 64)
    return np.concatenate([ql, qh, scale_q.astype(np.int8).view(np.uint8),
                           d[:, None].view(np.uint8)], axis=1)


K_QUANTIZERS = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}
