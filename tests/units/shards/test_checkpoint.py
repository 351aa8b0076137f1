"""Reading Hugging Face checkpoint directories: config normalisation, tensor-by-tensor loading,
partial materialisation of a meta model, and one-line errors for unusable directories."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from checkpoints import FAMILIES
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shards.checkpoint
from shards.arch import build_model, empty_cache
from shards.checkpoint import load_model, load_tensors, materialize, param_sources
from shards.config import load_config
from shards.errors import ModelError

PROMPT = torch.tensor([[1, 40, 41, 99, 120, 7, 8, 200]])


def copy_checkpoint(src, tmp_path):
    return shutil.copytree(src, tmp_path / "model")


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del raw[key]
    path.write_text(json.dumps(raw))


def logits(config, model):
    with torch.inference_mode():
        return model(PROMPT, torch.arange(PROMPT.shape[1])[None], *empty_cache(config))[0]


def model_error(fn, *args) -> str:
    with pytest.raises(ModelError) as caught:
        fn(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- config ---------------------------------------------------------------------------------

def test_llama_config_fields(hf_checkpoint):
    config = load_config(hf_checkpoint("llama", dtype="float16"))
    assert (config.architecture, config.family) == ("LlamaForCausalLM", "llama")
    assert (config.num_layers, config.hidden_size, config.num_heads) == (2, 64, 4)
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size) == (2, 16, 128)
    assert (config.tie_embeddings, config.qkv_bias, config.o_bias) == (False, False, False)
    assert (config.eos_token_ids, config.bos_token_id, config.torch_dtype) == ((2,), 1, "float16")
    assert config.rope_scaling is None and config.window(0) is None


def test_family_specific_fields(hf_checkpoint):
    qwen2 = load_config(hf_checkpoint("qwen2"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.rope_theta) == (True, False, 1000000.0)
    assert load_config(hf_checkpoint("mistral")).layer_windows == (12, 12)
    assert load_config(hf_checkpoint("llama3-rope-scaling")).rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    gpt2 = load_config(hf_checkpoint("gpt2"))
    assert (gpt2.family, gpt2.tie_embeddings, gpt2.activation) == ("gpt2", True, "gelu_new")
    bloom = load_config(hf_checkpoint("bloom"))
    assert (bloom.family, bloom.num_kv_heads, bloom.residual_post_norm) == ("bloom", 4, False)


def test_eos_ids_come_from_generation_config(hf_checkpoint, tmp_path):
    model_dir = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    assert load_config(model_dir).eos_token_ids == (2, 4)


def test_transformers_4_rope_format_loads_and_matches(hf_checkpoint, tmp_path):
    """Older checkpoints keep rope_theta at top level and the scaling in rope_scaling."""
    model_dir = copy_checkpoint(hf_checkpoint("llama3-rope-scaling"), tmp_path)
    params = json.loads((model_dir / "config.json").read_text())["rope_parameters"]
    theta = params.pop("rope_theta")
    edit_config(model_dir, rope_parameters=None, rope_theta=theta, rope_scaling=params)
    config, model = load_model(model_dir)
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == theta
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        expected = reference(PROMPT).logits
    torch.testing.assert_close(logits(config, model), expected, atol=1e-4, rtol=0)


def test_original_bloom_key_names(hf_checkpoint, tmp_path):
    """bigscience/bloom-* configs say n_embed and num_attention_heads."""
    model_dir = copy_checkpoint(hf_checkpoint("bloom"), tmp_path)
    edit_config(model_dir, hidden_size=None, n_head=None, n_embed=64, num_attention_heads=4)
    config = load_config(model_dir)
    assert (config.hidden_size, config.num_heads, config.head_dim) == (64, 4, 16)


# --- loading --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_param_sources_name_stored_tensors(hf_checkpoint, family):
    model_dir = hf_checkpoint(family)
    config = load_config(model_dir)
    sources = param_sources(config)
    ours = {name for name, _ in build_model(config, "meta").named_parameters()}
    assert set(sources) == ours
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        assert set(sources.values()) <= set(handle.keys())


def test_tied_head_reads_the_embedding(hf_checkpoint):
    tied = param_sources(load_config(hf_checkpoint("llama-tied")))
    assert tied["head.lm_head.weight"] == tied["embed.tokens.weight"] == "model.embed_tokens.weight"
    untied = param_sources(load_config(hf_checkpoint("llama")))
    assert untied["head.lm_head.weight"] == "lm_head.weight"


def test_load_tensors_reads_only_the_named_tensors(hf_checkpoint, monkeypatch):
    model_dir = hf_checkpoint("llama", dtype="bfloat16", max_shard_size="40KB")
    fetched = []

    class Spy:
        def __init__(self, path, framework):
            self.handle = safe_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            fetched.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(shards.checkpoint, "safe_open", Spy)
    names = ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight", "lm_head.weight"]
    tensors = load_tensors(model_dir, names)
    assert sorted(fetched) == sorted(names) and set(tensors) == set(names)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert len({p.name for p in model_dir.glob("model-*.safetensors")}) > 1


def test_checkpoint_without_base_prefix_loads(hf_checkpoint, tmp_path):
    """The original gpt2 checkpoint stores h.0.attn... instead of transformer.h.0.attn..."""
    source = hf_checkpoint("gpt2")
    model_dir = copy_checkpoint(source, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()},
              model_dir / "model.safetensors", metadata={"format": "pt"})
    config, model = load_model(model_dir)
    torch.testing.assert_close(logits(config, model), logits(*load_model(source)), atol=0, rtol=0)


def test_materialize_loads_only_the_chosen_modules(hf_checkpoint):
    model_dir = hf_checkpoint("bloom")
    config, full = load_model(model_dir)
    partial = build_model(config, "meta")
    materialize(partial, model_dir, ["layers.1.attn", "head"])
    for name, param in partial.named_parameters():
        chosen = name.startswith(("layers.1.attn.", "head."))
        assert param.is_meta != chosen, name
        if chosen:
            assert torch.equal(param, full.get_parameter(name))
    hidden = torch.randn(1, 3, config.hidden_size)
    step = (full.mask(torch.arange(3)[None]),)
    past = empty_cache(config)[:2]
    with torch.inference_mode():
        got = partial.layers[1].attn(hidden, *step, *past)
        expected = full.layers[1].attn(hidden, *step, *past)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("family", ["llama3-rope-scaling", "bloom"])
def test_meta_build_keeps_config_constants_real(hf_checkpoint, family):
    """RoPE frequencies and ALiBi slopes are computed, not loaded: a meta build has them."""
    model = build_model(load_config(hf_checkpoint(family)), "meta")
    buffers = dict(model.named_buffers())
    assert buffers and not any(b.is_meta for b in buffers.values())
    assert all(p.is_meta for p in model.parameters())


def test_materialize_rejects_an_unknown_module(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    with pytest.raises(ValueError, match="layers.9"):
        materialize(build_model(load_config(model_dir), "meta"), model_dir, ["layers.9"])


# --- unusable directories -------------------------------------------------------------------

def test_not_a_model_directory(tmp_path):
    for model_dir in (tmp_path, tmp_path / "nowhere"):
        assert model_error(load_model, model_dir) == (
            f"not a model directory: no config.json in {model_dir}")


def test_unsupported_architecture(hf_checkpoint, tmp_path):
    model_dir = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    edit_config(model_dir, architectures=["FalconForCausalLM"])
    assert model_error(load_config, model_dir) == "unsupported architecture: FalconForCausalLM"


def test_no_weights(hf_checkpoint, tmp_path):
    model_dir = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    assert model_error(load_config, model_dir) == (
        "no weights: expected model.safetensors or model.safetensors.index.json")


@pytest.mark.parametrize(("changes", "expected"), [
    ({"hidden_size": None}, "bad config.json: missing 'hidden_size'"),
    ({"num_hidden_layers": "two"}, "bad config.json: 'num_hidden_layers' must be a positive "
                                   "integer, got 'two'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling: yarn"),
    ({"hidden_act": "mish"}, "unsupported activation: mish"),
])
def test_bad_config_values(hf_checkpoint, tmp_path, changes, expected):
    model_dir = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    edit_config(model_dir, **changes)
    assert model_error(load_model, model_dir) == expected


def test_config_that_is_not_json(hf_checkpoint, tmp_path):
    model_dir = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    (model_dir / "config.json").write_text("{not json")
    assert model_error(load_config, model_dir).startswith(f"unreadable config.json in {model_dir}")


def test_missing_tensor(hf_checkpoint, tmp_path):
    model_dir = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert model_error(load_model, model_dir) == (
        f"missing tensor model.layers.1.mlp.down_proj.weight in {model_dir}")


def test_tensor_shape_disagrees_with_config(hf_checkpoint, tmp_path):
    model_dir = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    edit_config(model_dir, intermediate_size=96)
    assert model_error(load_model, model_dir).endswith("but the config implies (96, 64)")


def test_truncated_weights_file(hf_checkpoint, tmp_path):
    model_dir = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert model_error(load_model, model_dir).startswith(f"unreadable weights {weights}")
