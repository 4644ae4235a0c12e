"""Tensor descriptors shared by both sides: dtype enum <-> torch dtype, sizes, views on raw bytes."""
from __future__ import annotations

import torch

from symbiont.proto import executor_pb2 as pb

TORCH_OF = {
    pb.FLOAT32: torch.float32,
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT16: torch.float16,
    pb.INT64: torch.int64,
}
ENUM_OF = {v: k for k, v in TORCH_OF.items()}
NAME_OF = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int64: "int64"}
DTYPE_BY_NAME = {v: k for k, v in NAME_OF.items()}


def ids_out_of_range(unit: str, rows: int, low: int, high: int) -> str | None:
    """The error message of embedding ids whose lowest is `low` and highest `high`, for a table of
    `rows` rows (None: they lie in it): the executor's check and a tenant transport's alike."""
    if low < 0 or high >= rows:
        return f"ids for {unit!r} must lie in [0, {rows}), got [{low}, {high}]"
    return None


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


def int32_words(t: torch.Tensor, max_bytes: int | None = None) -> torch.Tensor | None:
    """t's bytes as a 1-D int32 view (what word-copying kernels copy), or None where they are not
    whole 4-byte-aligned words of a contiguous tensor, or are more than `max_bytes`."""
    size = t.numel() * t.element_size()
    if not t.is_contiguous() or size % 4 or t.data_ptr() % 4 or (max_bytes is not None and size > max_bytes):
        return None
    return t.view(-1).view(torch.uint8).view(torch.int32)


def view(buffer, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor that aliases `buffer[offset : offset + nbytes]` (no copy). The caller checks bounds."""
    count = 1
    for d in shape:
        count *= int(d)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(tuple(shape))


def from_bytes(data: bytes, shape, dtype: torch.dtype, copy: bool = True) -> torch.Tensor:
    """A fresh tensor of `shape` and `dtype` from raw bytes (a gRPC payload); ValueError when the
    byte count is not the shape's. copy=False: a tensor over `data` itself, to be read only (one
    copy and one allocation less, for a caller that copies what it reads anyway)."""
    want = nbytes(shape, dtype)
    if len(data) != want:
        raise ValueError(f"{len(data)} bytes; shape {list(shape)} in {NAME_OF.get(dtype, dtype)} needs {want}")
    if not want:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(data) if copy else data, dtype=dtype).view(tuple(shape))


def _quiet_read_only_views() -> None:
    """torch warns once per process that a tensor over an immutable buffer (from_bytes(copy=False))
    could be written: its users only read it, so the one warning is taken here, unseen."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(bytes(1), dtype=torch.uint8)


_quiet_read_only_views()


GRPC_CHUNK_BYTES = 4 << 20  # the most payload bytes in one gRPC message (the executor's default)


def grpc_message_limit(chunk_bytes: int = GRPC_CHUNK_BYTES) -> int:
    """The gRPC message size limit both sides set: a chunk of payload and its header."""
    return chunk_bytes + (1 << 20)


def chunks(data: bytes, size: int) -> list[tuple[bytes, bool]]:
    """data cut into pieces of at most `size` bytes, each with whether more follow (one empty
    piece for no data)."""
    n = max(1, (len(data) + size - 1) // size)
    return [(data[i * size : (i + 1) * size], i < n - 1) for i in range(n)]


def to_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a host tensor, in row-major order."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class ViewCache:
    """Memoised views of one data area: a call whose offset, shape and dtype match an earlier
    call's reuses that view (making one costs several torch calls; a lookup costs none).

    `make(offset, shape, dtype)` builds a view; the cache forgets everything past `limit`
    entries (sequence lengths vary) and on clear(), which the area's owner calls before the
    memory goes away."""

    def __init__(self, make, limit: int = 256):
        self._make = make
        self._limit = limit
        self._views: dict = {}

    def get(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        key = (offset, tuple(shape), dtype)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= self._limit:
                self._views.clear()
            with torch.inference_mode(False):  # (a view made under inference_mode could not be written outside it)
                v = self._views[key] = self._make(offset, key[1], dtype)
        return v

    def clear(self) -> None:
        self._views.clear()
