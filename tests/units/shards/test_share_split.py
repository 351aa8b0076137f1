"""The split of a layer among tensor-parallel shares: contiguous, complete, proportional."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shards.share_split import (
    LayerShape,
    ShareError,
    apportion,
    column_block,
    split_layer,
    split_rows,
)

weights = st.lists(st.floats(0.1, 10.0), min_size=1, max_size=6)


@given(grains=st.integers(1, 64), weights=weights)
def test_apportion_is_contiguous_complete_and_proportional(grains, weights):
    if len(weights) > grains:
        with pytest.raises(ShareError, match="exceed"):
            apportion(grains, weights, "grains")
        return
    spans = apportion(grains, weights, "grains")
    assert spans[0].start == 0 and spans[-1].stop == grains
    assert all(a.stop == b.start for a, b in zip(spans, spans[1:], strict=False))
    assert all(s.size >= 1 for s in spans)
    quotas = [grains * w / sum(weights) for w in weights]
    if min(quotas) >= 1:
        assert all(abs(s.size - q) < 1 for s, q in zip(spans, quotas, strict=True))


def test_gqa_shares_keep_each_kv_head_with_its_query_heads():
    shares = split_layer(LayerShape(num_heads=8, num_kv_heads=2, head_dim=16,
                                    intermediate_size=192), [1, 1])
    assert [(s.kv_heads.start, s.kv_heads.stop) for s in shares] == [(0, 1), (1, 2)]
    assert [(s.heads.start, s.heads.stop) for s in shares] == [(0, 4), (4, 8)]
    assert [(s.columns.start, s.columns.stop) for s in shares] == [(0, 128), (128, 192)]


def test_unequal_weights_give_proportional_shares():
    shares = split_layer(LayerShape(8, 8, 16, 512), [3, 1])
    assert [s.heads.size for s in shares] == [6, 2]
    assert [s.columns.size for s in shares] == [384, 128]


def test_more_shares_than_kv_groups_is_a_clear_error():
    with pytest.raises(ShareError, match="2 shares exceed the 1 KV-head groups of a layer"):
        split_layer(LayerShape(4, 1, 16, 128), [1, 1])


def test_bad_weights_are_refused():
    with pytest.raises(ShareError, match="positive"):
        split_layer(LayerShape(4, 4, 16, 128), [1, 0])


def test_column_block_shrinks_to_leave_every_share_a_block():
    assert column_block(128, 2) == 64
    assert column_block(96, 2) == 32
    assert column_block(6, 4) == 1
    with pytest.raises(ShareError, match="MLP columns"):
        column_block(3, 4)


def test_one_row_goes_to_the_largest_weight_first_of_equals():
    assert [s.size for s in split_rows(1, [1, 1])] == [1, 0]
    assert [s.size for s in split_rows(1, [1, 3])] == [0, 1]
    assert [s.size for s in split_rows(7, [1, 1, 1])] == [3, 2, 2]
