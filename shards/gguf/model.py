"""A GGUF file as a model source: its config from metadata, its tensors as a Hugging Face
checkpoint would hold them.

The file is what llama.cpp's `convert_hf_to_gguf.py` wrote from a Hugging Face checkpoint,
so reading it undoes that conversion:
- names: our parameters are named as in the checkpoint (`checkpoint.param_sources`); the
  `gguf` package's `TensorNameMap`, the very table the converter renames with, gives the
  GGUF name of each (`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight`);
- layouts: the converter permutes the rows of Q and K of the Llama architecture for
  llama.cpp's interleaved rotary pairs (not Qwen2's, which llama.cpp rotates in halves as
  transformers does), transposes GPT-2's Conv1D weights, and regroups BLOOM's fused QKV rows
  from per head (q, k, v) to all queries, all keys, all values; each is undone here;
- values: every tensor is dequantised to float32 (shards.gguf.dequant), one at a time.
Hyper-parameters come from the `{arch}.*` metadata, the vocabulary size and the MLP width
from the tensors themselves (the converter writes GPT-2's and BLOOM's feed-forward length as
4 x hidden whatever the model's), tied embeddings from the absence of `output.weight`, and
Llama 3's RoPE scaling from the `rope_freqs` tensor the converter computes (one divisor per
frequency; `rope.scaling.*` metadata carries only linear scaling).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from shards.config import ModelConfig
from shards.errors import ModelError
from shards.gguf.dequant import check_type, dequantize
from shards.gguf.file import metadata, open_gguf
from shards.source import ModelSource

if TYPE_CHECKING:
    import torch

# GGUF architecture -> (Hugging Face class, our family, the gguf package's architecture)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", gguf.MODEL_ARCH.LLAMA),
    "qwen2": ("Qwen2ForCausalLM", "llama", gguf.MODEL_ARCH.QWEN2),
    "gpt2": ("GPT2LMHeadModel", "gpt2", gguf.MODEL_ARCH.GPT2),
    "bloom": ("BloomForCausalLM", "bloom", gguf.MODEL_ARCH.BLOOM),
}
ACTIVATIONS = {"llama": "silu", "gpt2": "gelu_new", "bloom": "bloom_gelu"}
ROPE_FREQS = "rope_freqs.weight"
# Older checkpoints and the BLOOM converter name tensors without the base model's prefix.
_OPTIONAL_PREFIXES = ("model.", "transformer.")


class GGUFModel(ModelSource):
    @property
    def name(self) -> str:
        return self.path.stem

    @functools.cached_property
    def reader(self) -> gguf.GGUFReader:
        return open_gguf(self.path)

    @functools.cached_property
    def architecture(self) -> str:
        name = metadata(self.reader, "general.architecture")
        if name not in ARCHITECTURES:
            raise ModelError(f"unsupported GGUF architecture: {name}")
        return name

    @functools.cached_property
    def tensors(self) -> dict[str, gguf.ReaderTensor]:
        """Every tensor by name, each checked before any is read: a file that cannot be
        sharded to the end fails before the first unit is exported."""
        size = self.path.stat().st_size
        for tensor in self.reader.tensors:
            check_type(tensor)
            if tensor.data_offset + tensor.n_bytes > size:
                raise ModelError(f"GGUF tensor {tensor.name} lies past the end of {self.path}")
        return {tensor.name: tensor for tensor in self.reader.tensors}

    def digest(self) -> str:
        with self.path.open("rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()

    def config(self) -> ModelConfig:
        return self._config

    @functools.cached_property
    def _config(self) -> ModelConfig:
        hf_class, family, _ = ARCHITECTURES[self.architecture]
        experts = self._arch_metadata("expert_count", 0)
        if experts:
            raise ModelError(f"unsupported GGUF model: a mixture of {experts} experts")
        hidden = self._int("embedding_length")
        heads = self._int("attention.head_count")
        common = {
            "architecture": hf_class,
            "family": family,
            "vocab_size": self._shape("token_embd.weight")[0],
            "hidden_size": hidden,
            "num_layers": self._int("block_count"),
            "num_heads": heads,
            "head_dim": self._int("attention.key_length", hidden // heads),
            "intermediate_size": self._shape("blk.0.ffn_up.weight")[0],
            "max_positions": self._int("context_length"),
            "activation": ACTIVATIONS[family],
            "tie_embeddings": "output.weight" not in self.tensors,
            "qkv_bias": any(f"blk.0.{n}.bias" in self.tensors for n in ("attn_q", "attn_qkv")),
            "o_bias": "blk.0.attn_output.bias" in self.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in self.tensors,
            "eos_token_ids": self._end_ids(),
            "bos_token_id": metadata(self.reader, gguf.Keys.Tokenizer.BOS_ID, None),
        }
        if family == "llama":
            return ModelConfig(**common, **self._llama_fields(heads, common["head_dim"]))
        return ModelConfig(
            **common, num_kv_heads=heads, norm_eps=self._float("attention.layer_norm_epsilon")
        )

    def _llama_fields(self, heads: int, head_dim: int) -> dict[str, Any]:
        rope_dims = self._int("rope.dimension_count", head_dim)
        if rope_dims != head_dim:
            raise ModelError(f"unsupported GGUF rope: {rope_dims} of {head_dim} dimensions rotate")
        return {
            "num_kv_heads": self._int("attention.head_count_kv", heads),
            "norm_eps": self._float("attention.layer_norm_rms_epsilon"),
            "rope_theta": self._float("rope.freq_base", 10000.0),
            "rope_scaling": self._rope_scaling(head_dim),
        }

    def _rope_scaling(self, head_dim: int) -> dict[str, Any] | None:
        kind = self._arch_metadata("rope.scaling.type", "none")
        if kind not in ("none", "linear"):
            raise ModelError(f"unsupported GGUF rope scaling: {kind}")
        if ROPE_FREQS in self.tensors:
            if kind == "linear":
                raise ModelError("unsupported GGUF rope scaling: linear with rope_freqs")
            factors = self._read(ROPE_FREQS)
            if factors.shape != (head_dim // 2,):
                raise ModelError(f"bad GGUF tensor {ROPE_FREQS}: shape {factors.shape}")
            return {"rope_type": "freq_factors", "factors": tuple(factors.tolist())}
        if kind == "linear":
            return {"rope_type": "linear", "factor": self._float("rope.scaling.factor")}
        return None

    def _end_ids(self) -> tuple[int, ...]:
        keys = (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID)
        ids = (metadata(self.reader, key, None) for key in keys)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def _arch_metadata(self, suffix: str, default: Any = None) -> Any:
        return metadata(self.reader, f"{self.architecture}.{suffix}", default)

    def _int(self, suffix: str, default: int | None = None) -> int:
        value = self._arch_metadata(suffix, default)
        if value is None:
            raise ModelError(f"GGUF file lacks metadata '{self.architecture}.{suffix}'")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelError(
                f"bad GGUF metadata '{self.architecture}.{suffix}': {value!r} is not a "
                "positive integer"
            )
        return value

    def _float(self, suffix: str, default: float | None = None) -> float:
        value = self._arch_metadata(suffix, default)
        if value is None:
            raise ModelError(f"GGUF file lacks metadata '{self.architecture}.{suffix}'")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ModelError(f"bad GGUF metadata '{self.architecture}.{suffix}': {value!r}")
        # GGUF keeps these as float32: take the shortest decimal that is that float32 (the
        # 1e-6 the checkpoint said, not 9.99999997e-07), as the source config computed with.
        return float(str(np.float32(value)))

    def _shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in numpy/torch order (GGUF lists dimensions the other way)."""
        return tuple(int(n) for n in reversed(self._tensor(name).shape))

    def _tensor(self, name: str) -> gguf.ReaderTensor:
        if name not in self.tensors:
            raise ModelError(f"missing tensor {name} in {self.path}")
        return self.tensors[name]

    def _read(self, name: str) -> np.ndarray:
        tensor = self._tensor(name)
        return dequantize(tensor).reshape(self._shape(name))

    def read_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        import torch

        config = self.config()
        name_map = gguf.get_tensor_name_map(ARCHITECTURES[self.architecture][2], config.num_layers)
        undo = _UNDO[self.architecture]
        tensors = {}
        for name in set(names):
            stored = self._stored_name(name_map, name)
            values = undo(config, stored, self._read(stored))
            # a copy only where needed: F32 data is a read-only view of the mapped file
            owned = np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])
            tensors[name] = torch.from_numpy(owned)
        return tensors

    def _stored_name(self, name_map: gguf.TensorNameMap, name: str) -> str:
        candidates = [name, *(name[len(p):] for p in _OPTIONAL_PREFIXES if name.startswith(p))]
        for candidate in candidates:
            stored = name_map.get_name(candidate, try_suffixes=(".weight", ".bias"))
            if stored is not None and stored in self.tensors:
                return stored
        raise ModelError(f"missing tensor for {name} in {self.path}")


# -- undoing convert_hf_to_gguf.py's layout changes -------------------------------------------
def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of LlamaModel.permute: per head, rows (pair, half) back to (half, pair)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _undo_llama(config: ModelConfig, name: str, array: np.ndarray) -> np.ndarray:
    if ".attn_q." in name:
        return _unpermute(array, config.num_heads)
    if ".attn_k." in name:
        return _unpermute(array, config.num_kv_heads)
    return array


def _undo_gpt2(config: ModelConfig, name: str, array: np.ndarray) -> np.ndarray:
    """GPT-2's Conv1D weights are [in, out]; the converter stores them [out, in]."""
    conv1d = (".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight", ".ffn_down.weight")
    return array.T if name.endswith(conv1d) else array


def _undo_bloom(config: ModelConfig, name: str, array: np.ndarray) -> np.ndarray:
    """BLOOM's fused QKV rows go back from (q|k|v, head, dim) to (head, q|k|v, dim)."""
    if ".attn_qkv." not in name:
        return array
    grouped = array.reshape(3, config.num_heads, config.head_dim, *array.shape[1:])
    return grouped.swapaxes(0, 1).reshape(array.shape)


def _unchanged(config: ModelConfig, name: str, array: np.ndarray) -> np.ndarray:
    return array


_UNDO: dict[str, Callable[[ModelConfig, str, np.ndarray], np.ndarray]] = {
    "llama": _undo_llama,
    "qwen2": _unchanged,
    "gpt2": _undo_gpt2,
    "bloom": _undo_bloom,
}
