"""Share units (shards/share_units.py) exported once per shape: a later layer's share, or a
share as wide as an earlier one, gets the exported graph with its own weights."""

from __future__ import annotations

import pytest
from sharding import off_by_one, sharded

from shards import share_units
from shards.template import Template


@pytest.mark.slow
@pytest.mark.parametrize(("corrupt", "weights", "layers", "exports"), [
    (False, (1.0, 1.0, 1.0), (0, 1), 2),  # 12 units of two shapes: attention, MLP
    (True, (1.0, 1.0), (0,), 4),
])
def test_a_share_graph_is_reused_unless_the_result_computes_otherwise(
    hf_checkpoint, tmp_path, monkeypatch, corrupt, weights, layers, exports,
):
    """BLOOM, 6 heads and 192 MLP columns: each share has its own heads' ALiBi slopes, a
    buffer the exporter folds into a reshaped constant. Every unit, reused or not, is
    checked against torch as written; a reused one whose weights came out wrong (here: off
    by one) is exported for real."""
    exported = []
    real_export = share_units.to_onnx

    def counted(module, *args):
        exported.append(module)
        return real_export(module, *args)

    monkeypatch.setattr(share_units, "to_onnx", counted)
    if corrupt:
        monkeypatch.setattr(Template, "apply", off_by_one(Template.apply))
    model_dir = hf_checkpoint("bloom", heads=6, hidden=48)
    units = share_units.shares_for(model_dir, sharded(model_dir).manifest, weights, tmp_path,
                                   layers)
    assert len(units.units) == 2 * len(weights) * len(layers)
    assert len(exported) == exports
