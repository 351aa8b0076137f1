"""Reused unit graphs (shards/template.py): the pieces that do not need an export."""

from __future__ import annotations

import numpy as np
import pytest

from shards.template import _transposed


@pytest.mark.parametrize("shape", [(1, 5), (16, 3), (17, 3), (33, 64), (64, 1024)])
def test_a_weight_is_transposed_into_a_contiguous_copy(shape):
    matrix = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out = _transposed(matrix)
    assert out.flags.c_contiguous and out.dtype == matrix.dtype
    assert np.array_equal(out, matrix.T)
