"""manifest.json: round trip, validation, dependency maps, stage boundaries."""

from __future__ import annotations

import dataclasses
import json

import pytest
from sharding import sharded

from shards.manifest import MANIFEST_NAME, Manifest, ManifestError, Options, Quant


@pytest.fixture(scope="module")
def bloom(hf_checkpoint):
    return sharded(hf_checkpoint("bloom"))


def test_round_trip_is_lossless(bloom, tmp_path):
    bloom.manifest.save(tmp_path)
    assert Manifest.load(tmp_path) == bloom.manifest
    assert Manifest.load(bloom.directory) == bloom.manifest


def test_dependency_maps_of_a_real_model(bloom):
    manifest = bloom.manifest
    attention = [u.index for u in manifest.units if u.name.endswith(".attn")]
    residual = manifest.residual()
    assert residual == {(0, "mask"): tuple(attention[1:])}
    sequential = manifest.sequential()
    for unit in manifest.units[:-1]:
        assert sequential[(unit.index, f"{unit.name}.hidden")] == unit.index + 1


def test_stage_inputs_and_outputs(bloom):
    manifest = bloom.manifest
    assert manifest.stage_inputs(2, 3) == {"layer0.attn.hidden": 1, "mask": 0}
    assert manifest.stage_outputs(0, 2) == {"mask": (3,), "layer0.mlp.hidden": (3,)}
    assert manifest.stage_outputs(4, 5) == {"logits": (-1,)}
    assert manifest.stage_inputs(0, 5) == {"input_ids": -1, "position_ids": -1}


def _write(tmp_path, data) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))


def test_broken_manifests_get_one_line_errors(bloom, tmp_path):
    with pytest.raises(ManifestError, match="no manifest.json"):
        Manifest.load(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{")
    with pytest.raises(ManifestError, match="cannot read"):
        Manifest.load(tmp_path)
    data = bloom.manifest.to_dict()
    _write(tmp_path, {**data, "format": 99})
    with pytest.raises(ManifestError, match="format-3"):
        Manifest.load(tmp_path)
    del data["units"][0]["files"][0]["sha256"]
    _write(tmp_path, data)
    with pytest.raises(ManifestError, match="malformed manifest: KeyError"):
        Manifest.load(tmp_path)


def test_dependencies_must_point_forward(bloom):
    units = list(bloom.manifest.units)
    first = units[1]
    backwards = dataclasses.replace(first.inputs[0], producer=3)
    units[1] = dataclasses.replace(first, inputs=(backwards, *first.inputs[1:]))
    data = dataclasses.replace(bloom.manifest, units=tuple(units)).to_dict()
    with pytest.raises(ManifestError, match="comes from unit 3"):
        Manifest.from_dict(data)


def test_a_unit_is_its_model_then_data_files_named_by_their_sha256(bloom):
    head = bloom.manifest.units[-1]
    model, data = head.files
    assert head.model_file == model and data.content_name == data.name.split("/")[-1]
    assert model.content_name == f"{model.sha256}.onnx"
    for files, reason in [
        ((), "first file must be an ONNX model"),
        ((data, model), "first file must be an ONNX model"),
        ((model, dataclasses.replace(data, name="units/weights.data")), "not named <sha256>.data"),
        ((model, dataclasses.replace(data, sha256="abc")), "bad sha256 or size"),
        ((dataclasses.replace(model, bytes=-1), data), "bad sha256 or size"),
    ]:
        units = (*bloom.manifest.units[:-1], dataclasses.replace(head, files=files))
        with pytest.raises(ManifestError, match=f"unit head: .*{reason}"):
            Manifest.from_dict(dataclasses.replace(bloom.manifest, units=units).to_dict())
    assert len(bloom.manifest.files()) == sum(len(u.files) for u in bloom.manifest.units)


@pytest.mark.parametrize(("options", "quant"), [
    ({"quant": "int4", "granularity": "half"}, Quant.INT4),
    ({"quant": "int8", "granularity": "half"}, Quant.INT8),
    ({"quant": "none", "granularity": "half"}, Quant.NONE),
])
def test_options_name_the_quantisation(bloom, options, quant):
    manifest = Manifest.from_dict({**bloom.manifest.to_dict(), "options": options})
    assert manifest.options == Options(quant, "half")
    assert manifest.to_dict()["options"] == {"quant": quant.value, "granularity": "half"}


def test_an_unknown_quantisation_is_refused(bloom):
    data = {**bloom.manifest.to_dict(), "options": {"quant": "int3", "granularity": "half"}}
    with pytest.raises(ManifestError, match="malformed manifest: ValueError: 'int3'"):
        Manifest.from_dict(data)
