"""`shards.cache.cached`: what `shard` would reuse, found without running it (so a warm
`peerd demo` and a restarted model peer start no `peerd shard` child)."""

from __future__ import annotations

import os
import shutil

from sharding import sharded

from shards.cache import ShardOptions, cached, shard
from shards.manifest import Quant


def test_the_units_of_an_earlier_shard_are_found_as_shard_would_reuse_them(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    result = sharded(model_dir)
    found = cached(model_dir, result.directory.parent)
    assert found is not None and not found.exported
    assert (found.directory, found.manifest) == (result.directory, result.manifest)
    again = shard(model_dir, None, shard_root=result.directory.parent)
    assert (again.exported, again.directory) == (False, found.directory)


def test_units_of_other_options_another_model_or_cut_short_are_not_found(hf_checkpoint,
                                                                          tmp_path):
    model_dir = hf_checkpoint("llama")
    result = sharded(model_dir)
    root = tmp_path / "shards"  # these units alone (the session's cache holds others too)
    shutil.copytree(result.directory, root / result.directory.name)
    assert cached(model_dir, root) is not None
    assert cached(model_dir, root, ShardOptions(Quant.INT8)) is None
    assert cached(hf_checkpoint("llama", seed=1), root) is None

    data = result.manifest.units[-1].files[1]
    os.truncate(root / result.directory.name / data.name, data.bytes - 1)
    assert cached(model_dir, root) is None


def test_what_shard_would_refuse_is_left_for_shard_to_report(hf_checkpoint, tmp_path):
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    assert cached(not_a_model, tmp_path / "shards") is None

    model_dir = hf_checkpoint("llama")
    foreign = tmp_path / "shards" / sharded(model_dir).directory.name
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    assert cached(model_dir, tmp_path / "shards") is None
