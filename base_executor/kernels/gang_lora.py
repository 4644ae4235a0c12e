"""Hosted adapters inside a gang's round (transports/gangs.py): each taking-part slot's own LoRA on
its own rows of the batch, whichever adapters the round's slots name, in two launches a delta.

A gang's graph serves every set of members, so no adapter is in it: a slot's adapter at each of
the round's deltas (a "part": one LoRA module's A [r, in] and B [out, r]) is a row of the gang's
adapter table (int64: per part, A's address, B's address, the rank, the scale's float32 bits;
rank 0: no adapter), written when the slot is given, like the words' table. Row i of a batch is
slot i // rows's (each slot brings `rows` rows).

- `shrink`: t[i, :rank] = x[i] A^T, accumulated in float32, rounded to the adapter's dtype (a
  row's ranks over SPLIT_R programs: a rank-128 A of a 4096-wide unit is 1 MiB in float32).
- `expand`: y[i, cols] = y[i, cols] + scale * (t[i] B^T), where each step rounds as
  adapters.Delta.add_to's torch ops round it (the product t B^T and its scaling to the adapter's
  dtype, the sum to y's), without fused multiply-adds.

The sums run in another order than cuBLAS's, so a slot's delta is within float rounding of
Delta.add_to's, as every ganged result is within the batching tolerance of the lone call's.
Ranks up to adapters.MAX_RANK; t is a float32 scratch of at least `rows` x that many columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FIELDS = 4  # a part's columns in the adapter table: A, B, rank, scale bits
BLOCK_R = 16
BLOCK_K = 128
BLOCK_N = 128
SPLIT_R = 4  # programs a row's shrink is split over, each every SPLIT_R-th block of BLOCK_R ranks

_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _part(table, width, col, slot, seqs):
    """A slot's adapter at a part: A and B as pointers to ADT, the rank (0 where the slot sits
    the round out or names no adapter there), the scale."""
    entry = table + slot * width + col
    rank = tl.load(entry + 2).to(tl.int32)
    rank = tl.where(tl.load(seqs + slot) != 0, rank, 0)
    scale = tl.load(entry + 3).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.load(entry), tl.load(entry + 1), rank, scale


@triton.jit
def _shrink_kernel(x, x_stride, k_width, table, width, col, seqs, rows, t, t_stride,
                   ADT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = i // rows
    a_at, _, rank, _ = _part(table, width, col, slot, seqs)
    a = a_at.to(tl.pointer_type(ADT))
    r = tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_K)
    for r0 in range(tl.program_id(1) * BLOCK_R, rank, SPLIT * BLOCK_R):
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        rs = r0 + r
        for k0 in range(0, k_width, BLOCK_K):
            ks = k0 + k
            xv = tl.load(x + i * x_stride + ks, mask=ks < k_width, other=0.0).to(ADT).to(tl.float32)
            av = tl.load(a + rs[:, None].to(tl.int64) * k_width + ks[None, :],
                         mask=(rs[:, None] < rank) & (ks[None, :] < k_width), other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(t + i * t_stride + rs, acc.to(ADT).to(tl.float32), mask=rs < rank)


@triton.jit
def _expand_kernel(t, t_stride, y, y_stride, y_at, n_width, table, width, col, seqs, rows,
                   ADT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = i // rows
    _, b_at, rank, scale = _part(table, width, col, slot, seqs)
    b = b_at.to(tl.pointer_type(ADT))
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + r
        tv = tl.load(t + i * t_stride + rs, mask=rs < rank, other=0.0)
        bv = tl.load(b + n[:, None].to(tl.int64) * rank + rs[None, :],
                     mask=(n[:, None] < n_width) & (rs[None, :] < rank), other=0.0).to(tl.float32)
        acc += tl.sum(bv * tv[None, :], axis=1)
    term = (acc.to(ADT).to(tl.float32) * scale).to(ADT).to(tl.float32)
    on = n < tl.where(rank > 0, n_width, 0)  # (a slot without an adapter here: y as it is)
    at = y + i * y_stride + y_at + n
    tl.store(at, (tl.load(at, mask=on, other=0.0).to(tl.float32) + term).to(y.dtype.element_ty), mask=on)


def add(x: torch.Tensor, y: torch.Tensor, y_at: int, n_width: int, table: torch.Tensor, col: int,
        seqs: torch.Tensor, rows: int, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Queues on the current stream, for every row i of x ([slots * rows, k], rows of stride
    x.stride(0), its columns contiguous): y[i, y_at:y_at + n_width] += slot i // rows's delta at
    the part whose table columns start at `col` (adapters of `dtype`); t: the float32 scratch."""
    adt = _TRITON_DTYPES[dtype]
    grid_rows = x.shape[0]
    kw = dict(enable_fp_fusion=False)  # (each product and sum rounds on its own, as torch's ops)
    _shrink_kernel[(grid_rows, SPLIT_R)](x, x.stride(0), x.shape[1], table, table.shape[1], col, seqs, rows, t,
                                         t.stride(0), ADT=adt, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, SPLIT=SPLIT_R, **kw)
    _expand_kernel[(grid_rows, triton.cdiv(n_width, BLOCK_N))](t, t.stride(0), y, y.stride(0), y_at, n_width, table,
                                                                table.shape[1], col, seqs, rows, ADT=adt,
                                                                BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, **kw)


def entry(a: torch.Tensor, b: torch.Tensor, scale: float) -> list[int]:
    """A part's columns of the adapter table for a delta (A [r, in], B [out, r], contiguous)."""
    bits = int(torch.tensor([scale], dtype=torch.float32).view(torch.int32).item())
    return [a.data_ptr(), b.data_ptr(), a.shape[0], bits]
