"""ONNX export: files, dynamic axes (P = 0 included), unit costs, caching, int8, int4."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from sharding import off_by_one, reference, sharded

from peerd.commands.generate import build_pipeline, generate
from planner.io import workload_from_dict
from shards import cache, quantize
from shards.cache import ShardError, ShardOptions, shard
from shards.checkpoint import load_model
from shards.executor import StageExecutor
from shards.export import export_units
from shards.manifest import MANIFEST_NAME, Quant
from shards.sampling import SamplingParams
from shards.segment import segment
from shards.source import open_model
from shards.template import Template


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    return model_dir, sharded(model_dir)


def _graph_io(path) -> tuple[dict, list[str]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    dims = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in graph.input
    }
    return dims, [o.name for o in graph.output]


def test_every_unit_is_a_model_and_its_weights_as_external_data_and_loads(llama):
    _, result = llama
    for unit in result.manifest.units:
        for file in unit.files:
            data = (result.directory / file.name).read_bytes()
            assert hashlib.sha256(data).hexdigest() == file.sha256 and len(data) == file.bytes
        model, weights = unit.files
        assert weights.name == f"units/{weights.sha256}.data"
        assert weights.bytes >= unit.weight_bytes - 1024, "the weights are in the data file"
        path = result.directory / model.name
        graph = onnx.load(str(path), load_external_data=False).graph
        external = {t.name: t.dims for t in graph.initializer
                    if t.data_location == onnx.TensorProto.EXTERNAL}
        assert external and all(
            {e.key: e.value for e in t.external_data}["location"] == f"{weights.sha256}.data"
            for t in graph.initializer if t.name in external)
        assert all(t.name in external for t in graph.initializer if len(t.dims) == 2)
        dims, outputs = _graph_io(path)
        assert tuple(dims) == unit.graph_inputs and tuple(outputs) == unit.graph_outputs
        session = ort.InferenceSession(str(path))
        assert tuple(i.name for i in session.get_inputs()) == unit.graph_inputs


def test_units_of_a_shard_directory_load_from_a_copy_anywhere(llama, tmp_path):
    """A unit's files are complete in themselves: copied elsewhere, the pair still loads."""
    _, result = llama
    head = result.manifest.units[-1]
    for file in head.files:
        (tmp_path / file.content_name).write_bytes((result.directory / file.name).read_bytes())
    session = ort.InferenceSession(str(tmp_path / head.model_file.content_name))
    assert [o.name for o in session.get_outputs()] == ["logits"]


def test_batch_sequence_and_past_axes_are_dynamic(llama):
    _, result = llama
    attn = result.manifest.units[1]
    dims, _ = _graph_io(result.directory / attn.model_file.name)
    assert dims["embed.hidden"] == ["B", "T", 64]
    assert dims["mask"] == ["B", 1, "T", 1]
    assert dims["past_k_0"] == dims["past_v_0"] == ["B", 2, "P", 16]


@pytest.mark.parametrize(("tokens", "past"), [(5, 0), (1, 6), (1, 0), (7, 3)])
def test_exported_attention_equals_the_torch_unit_for_any_lengths(llama, tokens, past):
    model_dir, result = llama
    config, model = load_model(model_dir)
    unit = segment(model).units[1]
    generator = torch.Generator().manual_seed(tokens * 10 + past)
    hidden = torch.randn(1, tokens, config.hidden_size, generator=generator)
    positions = torch.arange(past, past + tokens)[None]
    cos, sin = model.rotary(positions)
    mask = model.mask(positions)
    kv = [torch.randn(1, config.num_kv_heads, past, config.head_dim, generator=generator)
          for _ in range(2)]
    args = (hidden, cos, sin, mask, *kv)
    with torch.no_grad():
        expected = unit.module(model)(*args)
    session = ort.InferenceSession(str(result.directory / result.manifest.units[1].model_file.name))
    got = session.run(unit.output_names, dict(zip(unit.input_names, (a.numpy() for a in args),
                                                  strict=True)))
    for value, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(value, want.numpy(), rtol=0, atol=1e-5)


def test_attention_neither_repeats_k_v_nor_leaves_its_norm_in_pieces(llama, tmp_path):
    """What decode speed rests on (shards/arch/common.py): after ONNX Runtime's optimiser,
    no operator expands the K/V to every query head, and the RMSNorm is one operator."""
    _, result = llama
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(result.directory / result.manifest.units[1].model_file.name),
                         options)
    graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    ops = [node.op_type for node in graph.node]
    assert "Expand" not in ops and "Pow" not in ops
    assert ops.count("SimplifiedLayerNormalization") == 1


def test_a_loaded_unit_keeps_no_page_of_its_data_file_resident(llama, tmp_path):
    """ONNX Runtime keeps parts of a unit's data file mapped once it has copied the weights
    into layouts of its own (int4's scales, the embedding's table): the executor hands the
    pages read while loading back (shards/heap.py), and a step reads back what it needs."""
    model_dir, _ = llama
    int4 = sharded(model_dir, Quant.INT4)
    directory = shutil.copytree(int4.directory, tmp_path / "copy")  # mapped by this test only
    data = {os.path.realpath(directory / f.name)
            for unit in int4.manifest.units for f in unit.files[1:]}
    for path in data:  # written out: pages not yet on disk cannot be handed back
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    stage = StageExecutor(int4.manifest, directory, 0, len(int4.manifest.units) - 1)
    mapped, resident = _mappings_of(data)
    assert mapped > 0 and resident == 0
    ids = np.array([[1, 2, 3]])
    logits = stage.step("s", {"input_ids": ids, "position_ids": np.arange(3)[None]})["logits"]
    assert np.isfinite(logits).all()
    assert _mappings_of(data)[1] > 0  # the embedding's rows, read back


def _mappings_of(paths: set[str]) -> tuple[int, int]:
    """Bytes mapped from `paths` in this process, and of those the bytes resident."""
    mapped = resident = 0
    current = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split(maxsplit=5)
            if "-" in fields[0] and len(fields) >= 5:
                current = len(fields) == 6 and fields[5].strip() in paths
                if current:
                    start, end = (int(a, 16) for a in fields[0].split("-"))
                    mapped += end - start
            elif current and fields[0] == "Rss:":
                resident += int(fields[1]) * 1024
    return mapped, resident


def test_unit_costs(llama):
    model_dir, result = llama
    config, model = load_model(model_dir)
    units = {u.name: u for u in result.manifest.units}
    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kv_width = config.num_kv_heads * config.head_dim
    mlp, attn, head = units["layer0.mlp"], units["layer0.attn"], units["head"]
    assert mlp.flops_per_token.decode == mlp.flops_per_token.prefill == 2 * 3 * hidden * inner
    assert head.flops_per_token.decode == 2 * hidden * vocab
    projections = 2 * hidden * (2 * config.num_heads * config.head_dim + 2 * kv_width)
    assert attn.flops_per_token.decode > projections  # plus attention over 128 positions
    assert attn.kv_bytes_per_token == 2 * kv_width * 4
    assert mlp.kv_bytes_per_token == units["embed"].kv_bytes_per_token == 0
    params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.mlp."))
    assert 4 * params <= mlp.weight_bytes <= 4 * params + 256  # plus a few small constants
    assert units["embed"].output("embed.hidden").bytes_per_token == 4 * hidden
    assert units["embed"].output("rotary.cos").bytes_per_token == 4 * config.head_dim


def test_second_shard_reuses_the_result_without_exporting(llama, monkeypatch):
    model_dir, first = llama

    def refuse(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr("shards.export.export_units", refuse)
    again = shard(model_dir, None, shard_root=first.directory.parent)
    assert not again.exported and again.directory == first.directory
    assert again.manifest == first.manifest


def test_a_result_with_a_data_file_missing_or_cut_short_is_not_reused(llama, tmp_path):
    _, result = llama
    key, data = result.manifest.key, result.manifest.units[0].files[1]
    copy = tmp_path / "copy"
    shutil.copytree(result.directory, copy)
    assert cache.reusable(copy, key) == result.manifest
    os.truncate(copy / data.name, data.bytes - 1)
    assert cache.reusable(copy, key) is None
    (copy / data.name).unlink()
    assert cache.reusable(copy, key) is None


def test_key_follows_options_and_weights(llama, hf_checkpoint):
    model_dir, result = llama
    source = cache.source_digest(model_dir)
    assert cache.shard_key(source, ShardOptions()) == result.manifest.key
    keys = {cache.shard_key(source, ShardOptions(quant)) for quant in Quant}
    assert result.manifest.key in keys and len(keys) == len(Quant)
    other = cache.source_digest(hf_checkpoint("llama", seed=1))
    assert cache.shard_key(other, ShardOptions()) != result.manifest.key


def test_a_foreign_non_empty_output_directory_is_refused(llama, tmp_path):
    model_dir, _ = llama
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ShardError, match="not empty"):
        shard(model_dir, tmp_path)


@pytest.mark.slow
def test_sharded_bfloat16_checkpoint_generates_like_transformers(hf_checkpoint):
    model_dir = hf_checkpoint("qwen2", layers=1, dtype="bfloat16", max_shard_size="40KB")
    result = sharded(model_dir)
    prompt = (1, 2, 3, 4, 5)
    tokens, _ = reference(model_dir, prompt, 32)
    run = generate(build_pipeline(result.manifest, result.directory, 2), result.manifest,
                   list(prompt), 32, SamplingParams(), stop_at_eos=False)
    assert run.token_ids == tokens


def _steps(lines: list[str]) -> list[str]:
    """Progress lines without their timings: '[4/8] layer1.attn built from ...'."""
    return [line.split(" in ")[0] for line in lines]


@pytest.mark.slow
def test_later_layers_reuse_the_first_layer_s_graph_with_their_own_weights(hf_checkpoint,
                                                                          tmp_path):
    model_dir = hf_checkpoint("llama", layers=3)
    lines: list[str] = []
    result = shard(model_dir, tmp_path / "units", progress=lines.append)
    assert _steps(lines) == [
        "[1/8] embed exported", "[2/8] layer0.attn exported", "[3/8] layer0.mlp exported",
        "[4/8] layer1.attn built from layer0.attn's graph",
        "[5/8] layer1.mlp built from layer0.mlp's graph",
        "[6/8] layer2.attn built from layer0.attn's graph",
        "[7/8] layer2.mlp built from layer0.mlp's graph", "[8/8] head exported",
    ]
    prompt = (3, 1, 4, 1, 5)
    tokens, _ = reference(model_dir, prompt, 24)
    run = generate(build_pipeline(result.manifest, result.directory, 3), result.manifest,
                   list(prompt), 24, SamplingParams(), stop_at_eos=False)
    assert run.token_ids == tokens


@pytest.mark.slow
def test_units_built_from_an_earlier_graph_are_what_exporting_them_writes(hf_checkpoint,
                                                                          tmp_path):
    """The same weights, costs and message sizes (a reused unit runs in torch on the export
    example alone and takes the rest from the unit whose graph it got), and a model file
    that computes the same; its bytes differ only in the exporter's debug names."""
    model_dir = hf_checkpoint("llama", layers=2)
    source = open_model(model_dir)
    results = {}
    for reuse in (False, True):
        results[reuse] = export_units(source, source.config(), tmp_path / str(reuse),
                                      ShardOptions(), lambda line: None, "key", "source",
                                      reuse_graphs=reuse)
    exported, reused = results[False].units, results[True].units
    for every, built in zip(exported, reused, strict=True):
        assert replace(built, files=built.files[1:]) == replace(every, files=every.files[1:])
        assert _initializer_shapes(tmp_path / "True" / built.files[0].name) == (
            _initializer_shapes(tmp_path / "False" / every.files[0].name))
    runs = [generate(build_pipeline(results[reuse], tmp_path / str(reuse), 2),
                     results[reuse], [3, 1, 4], 12, SamplingParams(), stop_at_eos=False)
            for reuse in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids


def _initializer_shapes(model_file: Path) -> list[list[int]]:
    """The shapes of a model file's initializers, in order (a scalar is [], not [1])."""
    model = onnx.load(str(model_file), load_external_data=False)
    return [list(tensor.dims) for tensor in model.graph.initializer]


@pytest.mark.slow
def test_a_reused_graph_that_computes_otherwise_is_exported_instead(hf_checkpoint, tmp_path,
                                                                     monkeypatch):
    """A layer that only looks like the first (here: a reused weight off by one) is caught
    by running it against torch, and exported for real."""
    monkeypatch.setattr(Template, "apply", off_by_one(Template.apply))
    model_dir = hf_checkpoint("llama", layers=2)
    lines: list[str] = []
    result = shard(model_dir, tmp_path / "units", progress=lines.append)
    assert len(result.manifest.units) == 6  # each checked against torch as it was written
    assert all(step.endswith(" exported") for step in _steps(lines)), lines


@pytest.mark.slow
def test_int8_units_are_smaller_and_mostly_agree_with_float32(llama):
    model_dir, fp32 = llama
    int8 = sharded(model_dir, Quant.INT8)
    assert int8.manifest.options.quant is Quant.INT8 and int8.manifest.key != fp32.manifest.key
    for small, full in zip(int8.manifest.units, fp32.manifest.units, strict=True):
        assert small.weight_bytes < 0.35 * full.weight_bytes
    prompt = [1, 17, 42, 99, 7]
    run = generate(build_pipeline(fp32.manifest, fp32.directory, 1), fp32.manifest, prompt, 64,
                   SamplingParams(), stop_at_eos=False)
    sequence = np.array([prompt + run.token_ids[:-1]])
    top1 = []
    for result in (fp32, int8):
        top1.append(_teacher_forced(result, sequence)[len(prompt) - 1 :].argmax(-1))
    assert (top1[0] == run.token_ids).all()
    assert (top1[0] == top1[1]).mean() > 0.7


def _teacher_forced(result, sequence: np.ndarray) -> np.ndarray:
    stage = StageExecutor(result.manifest, result.directory, 0, len(result.manifest.units) - 1)
    step = {"input_ids": sequence, "position_ids": np.arange(sequence.shape[1])[None]}
    return stage.step("s", step)["logits"][0]


def test_int4_units_hold_under_a_sixth_of_the_bytes_and_the_planner_budgets_those(llama):
    """Symmetric blocks of 32 cost 0.5 + 4/32 bytes per 4 bytes of float32 (0.156x); the
    norms stay float32 (up to 1.5% of a unit of this small model, whose matrices dominate)."""
    model_dir, fp32 = llama
    int4 = sharded(model_dir, Quant.INT4)
    assert int4.manifest.options.quant is Quant.INT4 and int4.manifest.key != fp32.manifest.key
    ratio = (0.5 + 4 / quantize.BLOCK) / 4
    for small, full in zip(int4.manifest.units, fp32.manifest.units, strict=True):
        assert ratio <= small.weight_bytes / full.weight_bytes <= ratio + 0.015
        assert small.weight_bytes < small.file_bytes
    total = [sum(u.weight_bytes for u in r.manifest.units) for r in (int4, fp32)]
    assert total[0] <= 0.16 * total[1]
    workload = workload_from_dict(json.loads((int4.directory / MANIFEST_NAME).read_text()))
    assert [u.weight_bytes for u in workload.units] == [
        u.weight_bytes for u in int4.manifest.units]

