"""Tensor descriptors shared by both sides: dtype enum <-> torch dtype, sizes, views on raw bytes."""
from __future__ import annotations

import torch

from proto import executor_pb2 as pb

TORCH_OF = {
    pb.FLOAT32: torch.float32,
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT16: torch.float16,
    pb.INT64: torch.int64,
}
ENUM_OF = {v: k for k, v in TORCH_OF.items()}
NAME_OF = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int64: "int64"}
DTYPE_BY_NAME = {v: k for k, v in NAME_OF.items()}


def dtype_enum(dtype: torch.dtype) -> int:
    """The wire enum of a torch dtype; TypeError for dtypes no unit takes."""
    try:
        return ENUM_OF[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel to the executor; supported: {sorted(NAME_OF.values())}") from None


def torch_dtype(enum: int) -> torch.dtype:
    """The torch dtype of a wire enum; ValueError for an unknown or unset enum."""
    try:
        return TORCH_OF[enum]
    except KeyError:
        raise ValueError(f"unknown dtype enum {enum}") from None


def nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def view(buffer, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor that aliases `buffer[offset : offset + nbytes]` (no copy). The caller checks bounds."""
    count = 1
    for d in shape:
        count *= int(d)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(tuple(shape))
