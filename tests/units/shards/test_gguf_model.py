"""GGUF files as a model source: config from metadata, weights undone from llama.cpp's
conversion, dequantisation, and generation equal to transformers.

The files are written by tests/gguf_files.py from the random checkpoints of
tests/checkpoints.py. References: for F32, F16 and BF16 files (from checkpoints stored in
that dtype, so the file holds exactly the checkpoint's values), transformers on the source
checkpoint; for quantised files, transformers with the weights transformers' own GGUF loader
dequantises from the file (an implementation independent of ours), compared weight by weight
for every quantised type and by greedy generation for Q8_0, Q4_0 and Q4_K.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_files import quantize, write_gguf
from sharding import reference, sharded, state_dir
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from peerd.commands.generate import build_pipeline, generate
from peerd.control.model_host import ModelHost
from shards.arch.rope import inverse_frequencies
from shards.checkpoint import load_model, param_sources
from shards.config import load_config
from shards.errors import ModelError
from shards.gguf import model as gguf_model
from shards.gguf.dequant import SUPPORTED_TYPES, dequantize
from shards.sampling import SamplingParams
from shards.source import open_model

PROMPT = (1, 17, 42, 99, 7, 250, 3, 64)
NEW_TOKENS = 24
FAMILIES = ["llama", "llama-tied", "llama3-rope-scaling", "qwen2", "gpt2", "bloom"]
SHAPE_FIELDS = (
    "architecture", "family", "vocab_size", "hidden_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim", "intermediate_size", "norm_eps", "activation", "qkv_bias",
    "o_bias", "mlp_bias", "rope_theta", "eos_token_ids", "bos_token_id",
)
K_QUANT_SIZE = {"hidden": 256}  # K-quant blocks hold 256 values: rows must divide into them


@pytest.fixture(scope="module")
def gguf_file(hf_checkpoint, tmp_path_factory):
    """gguf_file(family, tensor_type, **overrides) -> (checkpoint dir, GGUF file)."""
    written: dict[tuple, tuple[Path, Path]] = {}

    def get(family: str, tensor_type: str = "F32", **overrides):
        key = (family, tensor_type, tuple(sorted(overrides.items())))
        if key not in written:
            model_dir = hf_checkpoint(family, **overrides)
            out = tmp_path_factory.mktemp("gguf") / f"{family}-{tensor_type}.gguf"
            written[key] = model_dir, write_gguf(model_dir, out, tensor_type)
        return written[key]

    return get


# -- config and weights -----------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_metadata_equals_the_source_config(gguf_file, family):
    model_dir, path = gguf_file(family)
    ours, source = load_config(path), load_config(model_dir)
    assert {f: getattr(ours, f) for f in SHAPE_FIELDS} == {
        f: getattr(source, f) for f in SHAPE_FIELDS
    }
    torch.testing.assert_close(inverse_frequencies(ours), inverse_frequencies(source))
    # GPT-2 and BLOOM files carry a copy of the embedding as output.weight
    assert ours.tie_embeddings == (source.tie_embeddings and family not in ("gpt2", "bloom"))


def test_llama3_scaling_comes_from_rope_freqs(gguf_file):
    config = load_config(gguf_file("llama3-rope-scaling")[1])
    assert config.rope_scaling["rope_type"] == "freq_factors"
    assert set(config.rope_scaling["factors"]) == {1.0, 8.0}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("tensor_type", "dtype"), [
    ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16")
])
def test_weights_equal_the_checkpoint(gguf_file, family, tensor_type, dtype):
    model_dir, path = gguf_file(family, tensor_type, dtype=dtype)
    _, ours = load_model(path)
    _, source = load_model(model_dir)
    for name, param in source.named_parameters():
        assert torch.equal(ours.get_parameter(name), param), name


@cache
def _dequantised_model(model_dir: Path, path: Path) -> transformers.PreTrainedModel:
    """The source's transformers model holding the weights that transformers' own GGUF
    loader reads (dequantises, un-permutes, regroups) from `path`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    assert model.load_state_dict(tensors, strict=False).missing_keys == []
    return model


@pytest.mark.parametrize(("family", "tensor_type", "overrides"), [
    ("llama", "Q8_0", {}),
    ("llama3-rope-scaling", "Q4_0", {}),
    ("qwen2", "Q5_0", {}),
    ("gpt2", "Q4_1", {}),
    ("bloom", "Q5_1", {}),
    ("llama", "Q4_K", K_QUANT_SIZE),
    ("qwen2", "Q5_K", K_QUANT_SIZE),
    ("gpt2", "Q6_K", K_QUANT_SIZE),
    ("bloom", "Q4_K", K_QUANT_SIZE),
])
def test_quantised_weights_equal_what_transformers_reads_from_the_file(
    gguf_file, family, tensor_type, overrides
):
    model_dir, path = gguf_file(family, tensor_type, **overrides)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert tensor_type in types and "F16" not in types  # every matrix is quantised
    config, ours = load_model(path)
    theirs = _dequantised_model(model_dir, path).state_dict()
    for name, hf_name in param_sources(config).items():
        assert torch.equal(ours.get_parameter(name), theirs[hf_name]), name


def test_llama_q_and_k_are_stored_permuted_and_read_back_unpermuted(gguf_file, monkeypatch):
    """The file holds the converter's interleaved rows; reading must undo them."""
    model_dir, path = gguf_file("llama")
    _, source = load_model(model_dir)
    reader = gguf.GGUFReader(path)
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    source_k = source.get_parameter("layers.0.attn.k_proj.weight").numpy()
    assert not np.array_equal(stored.data, source_k)
    monkeypatch.setitem(gguf_model._UNDO, "llama", gguf_model._unchanged)
    _, unpermuted = load_model(path)
    assert not torch.equal(unpermuted.get_parameter("layers.0.attn.k_proj.weight"),
                           source.get_parameter("layers.0.attn.k_proj.weight"))


def test_qwen2_q_and_k_are_stored_as_in_the_checkpoint(gguf_file):
    model_dir, path = gguf_file("qwen2")
    _, source = load_model(model_dir)
    stored = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.attn_q.weight")
    assert np.array_equal(stored.data, source.get_parameter("layers.1.attn.q_proj.weight"))


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES - {gguf.GGMLQuantizationType.F32},
                                         key=lambda t: t.name))
def test_each_tensor_type_dequantises_to_the_values_it_was_made_from(qtype):
    """Round trip through the type's blocks: the error stays within the type's resolution
    (about half a step of the coarsest, 4-bit, types on values of this spread)."""
    values = np.random.default_rng(0).normal(0.0, 0.2, (8, 512)).astype(np.float32)
    blocks = quantize(values, qtype)
    tensor = gguf.ReaderTensor("t", qtype, np.array([512, 8]), values.size, blocks.nbytes, 0,
                               blocks, None)
    restored = dequantize(tensor).reshape(values.shape)
    bits = {"Q4": 4, "Q5": 5, "Q6": 6, "Q8": 8, "BF": 8}.get(qtype.name[:2], 11)
    tolerance = 2.0 * float(np.abs(values).max()) / 2 ** (bits - 1)
    assert np.abs(restored - values).max() < tolerance
    assert np.abs(restored - values).mean() < tolerance / 3


# -- generation --------------------------------------------------------------------------------
def _generate(path: Path, parts: int) -> list[int]:
    result = sharded(path)
    pipeline = build_pipeline(result.manifest, result.directory, parts)
    run = generate(pipeline, result.manifest, list(PROMPT), NEW_TOKENS, SamplingParams(),
                   stop_at_eos=False)
    return run.token_ids, np.stack(run.logits)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tokenizer", "tensor_type", "dtype"), [
    ("llama", "spm", "F32", "float32"),      # a Llama 2 with its SentencePiece vocabulary
    ("llama", "spm", "F16", "float16"),
    ("llama3-rope-scaling", "llama-bpe", "F32", "float32"),  # byte-level BPE, rope scaling
    ("qwen2", "qwen2", "F32", "float32"),
    ("gpt2", "gpt-2", "F32", "float32"),
])
def test_greedy_equals_transformers_on_the_source_checkpoint(
    gguf_file, family, tokenizer, tensor_type, dtype
):
    """F16 is generated from one family only: an F16 file's weights equal the checkpoint's
    bit for bit in every family (test_weights_equal_the_checkpoint), so past the reading the
    units are the same as from F32."""
    model_dir, path = gguf_file(family, tensor_type, dtype=dtype, tokenizer=tokenizer)
    _check_greedy(model_dir, path)


@pytest.mark.slow
def test_bloom_greedy_equals_transformers_on_the_source_checkpoint(gguf_file):
    _check_greedy(*gguf_file("bloom"))


def _check_greedy(model_dir, path) -> None:
    tokens, logits = reference(model_dir, PROMPT, NEW_TOKENS)
    got, got_logits = _generate(path, parts=3)
    assert got == tokens
    np.testing.assert_allclose(got_logits, logits, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tensor_type", "overrides"), [
    ("llama", "Q8_0", {}),
    ("qwen2", "Q4_0", {}),
    ("llama", "Q4_K", K_QUANT_SIZE),
])
def test_quantised_greedy_equals_transformers_on_the_dequantised_weights(
    gguf_file, family, tensor_type, overrides
):
    model_dir, path = gguf_file(family, tensor_type, **overrides)
    model = _dequantised_model(model_dir, path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        logits = model(out[:, :-1]).logits[0, len(PROMPT) - 1:].numpy()
    got, got_logits = _generate(path, parts=2)
    assert got == out[0, len(PROMPT):].tolist()
    # hidden 256 gives logits near 10: float32 sums reordered differ by about 1e-5 of them
    np.testing.assert_allclose(got_logits, logits, rtol=1e-4, atol=1e-4)


def _peerd(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PEERD_STATE_DIR": str(state_dir())}
    return subprocess.run([sys.executable, "-m", "peerd", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.slow
def test_peerd_generate_runs_a_gguf_file(gguf_file):
    model_dir, path = gguf_file("llama")
    sharded(path)
    done = _peerd("generate", str(path), "--prompt-ids", ",".join(map(str, PROMPT)),
                  "--max-tokens", str(NEW_TOKENS), "--parts", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == reference(model_dir, PROMPT, NEW_TOKENS,
                                                             stop_at_eos=True)[0]


@pytest.mark.slow
async def test_a_peer_started_with_a_gguf_file_serves_its_units(gguf_file):
    _, path = gguf_file("llama")
    host = ModelHost(path, state_dir())
    assert host.name == "llama-F32"
    await host.run()
    assert host.state == "ready", host.detail
    assert host.manifest.model.source_sha256 == open_model(path).digest()
    assert set(host.files) == {f.sha256 for f in host.manifest.files()}


# -- the source seam ---------------------------------------------------------------------------
def test_a_gguf_source_is_named_by_its_stem_and_digested_by_its_bytes(gguf_file, tmp_path):
    _, path = gguf_file("llama")
    source = open_model(path)
    assert source.name == "llama-F32"
    copy = shutil.copy(path, tmp_path / "other.gguf")
    assert open_model(copy).digest() == source.digest()
    with open(copy, "r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        handle.write(b"\x01\x02\x03\x04")
    assert open_model(copy).digest() != source.digest()


# -- refusals ----------------------------------------------------------------------------------
def _patched(path: Path, tmp_path: Path, change) -> Path:
    copy = Path(shutil.copy(path, tmp_path / path.name))
    reader = gguf.GGUFReader(copy, "r+")
    change(reader)
    reader.data.flush()
    return copy


def _retyped(reader: gguf.GGUFReader) -> None:
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    tensor.field.parts[4][0] = gguf.GGMLQuantizationType.IQ2_XS  # same rows, fewer bytes


def _renamed_architecture(reader: gguf.GGUFReader) -> None:
    reader.fields["general.architecture"].parts[-1][:] = np.frombuffer(b"mamba", np.uint8)


def _bad_files(gguf_file, tmp_path) -> dict[str, tuple[Path, str]]:
    _, path = gguf_file("llama")
    _, k_path = gguf_file("llama", "Q4_K", **K_QUANT_SIZE)
    size = path.stat().st_size
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: size - 100])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(path.read_bytes()[:200])
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all\n" * 20)
    return {
        "type": (_patched(k_path, tmp_path, _retyped),
                 "unsupported GGUF tensor type IQ2_XS in blk.0.attn_q.weight"),
        "architecture": (_patched(path, tmp_path, _renamed_architecture),
                         "unsupported GGUF architecture: mamba"),
        "truncated": (cut, "not a readable GGUF file ("),
        "header only": (header_only, "not a readable GGUF file ("),
        "not gguf": (junk, "not a readable GGUF file (GGUF magic invalid)"),
        "missing": (tmp_path / "nowhere.gguf", "no such GGUF file: "),
    }


@pytest.mark.parametrize("case", ["type", "architecture", "truncated", "header only",
                                  "not gguf", "missing"])
def test_unusable_files_are_refused_with_one_line(gguf_file, tmp_path, case):
    path, message = _bad_files(gguf_file, tmp_path)[case]
    with pytest.raises(ModelError) as caught:
        source = open_model(path)
        source.config()
        source.read_tensors([])
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.slow
def test_peerd_shard_refuses_them_with_exit_1(gguf_file, tmp_path):
    for path, message in _bad_files(gguf_file, tmp_path).values():
        done = _peerd("shard", str(path), "--json")
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.startswith(f"peerd: {message}") and done.stderr.count("\n") == 1


def test_a_mixture_of_experts_is_refused(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "mixtral.gguf", "llama")
    writer.add_expert_count(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="^unsupported GGUF model: a mixture of 8 experts$"):
        load_config(tmp_path / "mixtral.gguf")


def test_a_corrupted_scale_is_refused_when_its_tensor_is_read(gguf_file, tmp_path):
    _, path = gguf_file("llama", "Q8_0")

    def infinite_scale(reader: gguf.GGUFReader) -> None:
        tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
        tensor.data[0, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)

    source = open_model(_patched(path, tmp_path, infinite_scale))
    source.config()
    with pytest.raises(ModelError, match="^GGUF tensor blk.0.attn_q.weight holds values that "
                                         "are not finite$"):
        source.read_tensors(["model.layers.0.self_attn.q_proj.weight"])
