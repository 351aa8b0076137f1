"""GGUF tensor data -> float32, for the tensor types peerd reads.

The `gguf` package dequantises block by block in numpy (`gguf.quants.dequantize`); each type
listed here is checked against the original weights in tests/units/shards/test_gguf_model.py. A
tensor of any other type is refused with a one-line reason rather than read by code never checked.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize as _dequantize_blocks

from shards.errors import ModelError

T = GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}
)


def check_type(tensor: ReaderTensor) -> None:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ModelError(f"unsupported GGUF tensor type {tensor.tensor_type.name} in {tensor.name}")


def dequantize(tensor: ReaderTensor) -> np.ndarray:
    """The tensor's values as float32, one row per stored row (numpy order)."""
    check_type(tensor)
    values = _dequantize_blocks(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    if not np.isfinite(values).all():
        raise ModelError(f"GGUF tensor {tensor.name} holds values that are not finite")
    return values
