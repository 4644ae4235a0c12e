"""Hosted adapters inside a gang's round (transports/gangs.py): each taking-part slot's own LoRA on
its own rows of the batch, whichever adapters the round's slots name, in two launches for every
delta of one place (a span's q, k and v together: `add`'s parts).

A gang's graph serves every set of members, so no adapter is in it: a slot's adapter at each of
the round's deltas (a "part": one LoRA module's A [r, in] and B [out, r]) is a row of the gang's
adapter table (int64: per part, A's address, B's address, the rank, the scale's float32 bits;
rank 0: no adapter), written when the slot is given, like the words' table. Row i of a batch is
slot i // rows's (each slot brings `rows` rows).

- `shrink`: t[i, p, :rank] = x[i] A_p^T for each part p, accumulated in float32, rounded to the
  adapter's dtype (a row's ranks over SPLIT_R programs, BLOCK_K inputs a step: a call in a round is
  on every member's path, so the kernels are wide and shallow; ranks up to 128 in one pass).
- `expand`: y[i, cols_p] = y[i, cols_p] + scale * (t[i, p] B_p^T), where each step rounds as
  adapters.Delta.add_to's torch ops round it (the product t B^T and its scaling to the adapter's
  dtype, the sum to y's), without fused multiply-adds.

The sums run in another order than cuBLAS's, so a slot's delta is within float rounding of
Delta.add_to's, as every ganged result is within the batching tolerance of the lone call's.
Ranks up to adapters.MAX_RANK; t is a float32 scratch of at least the batch's rows x (parts x that
many) columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FIELDS = 4  # a part's columns in the adapter table: A, B, rank, scale bits
MAX_PARTS = 3  # parts one launch takes (q, k and v); more go in further launches
BLOCK_R = 16
BLOCK_K = 512
SPLIT_R = 8  # programs a row's shrink is split over, each every SPLIT_R-th block of BLOCK_R ranks
BLOCK_N = 64
BLOCK_RE = 64  # ranks an expand step takes

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
def _place(p, at0, n0, at1, n1, at2, n2):
    """Part p's first column in y and its width."""
    return tl.where(p == 0, at0, tl.where(p == 1, at1, at2)), tl.where(p == 0, n0, tl.where(p == 1, n1, n2))


@triton.jit
def _shrink_kernel(x, x_stride, k_width, table, width, col, seqs, rows, t, t_stride, t_part,
                   ADT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   FIELDS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    slot = i // rows
    a_at, _, rank, _ = _part(table, width, col + p * FIELDS, slot, seqs)
    a = a_at.to(tl.pointer_type(ADT))
    r = tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_K)
    out = t + i * t_stride + p * t_part
    for r0 in range(tl.program_id(2) * BLOCK_R, rank, SPLIT * BLOCK_R):
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        rs = r0 + r
        for k0 in range(0, k_width, BLOCK_K):
            ks = k0 + k
            xv = tl.load(x + i * x_stride + ks, mask=ks < k_width, other=0.0).to(ADT).to(tl.float32)
            av = tl.load(a + rs[:, None].to(tl.int64) * k_width + ks[None, :],
                         mask=(rs[:, None] < rank) & (ks[None, :] < k_width), other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(out + rs, acc.to(ADT).to(tl.float32), mask=rs < rank)


@triton.jit
def _expand_kernel(t, t_stride, t_part, y, y_stride, table, width, col, seqs, rows, at0, n0, at1, n1, at2, n2,
                   ADT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, FIELDS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    slot = i // rows
    _, b_at, rank, scale = _part(table, width, col + p * FIELDS, slot, seqs)
    y_at, n_width = _place(p, at0, n0, at1, n1, at2, n2)
    b = b_at.to(tl.pointer_type(ADT))
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    rank = tl.where(n_width > tl.program_id(2) * BLOCK_N, rank, 0)  # (a block past this part's columns: nothing)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + r
        tv = tl.load(t + i * t_stride + p * t_part + rs, mask=rs < rank, other=0.0)
        bv = tl.load(b + n[:, None].to(tl.int64) * rank + rs[None, :],
                     mask=(n[:, None] < n_width) & (rs[None, :] < rank), other=0.0).to(tl.float32)
        acc += tl.sum(bv * tv[None, :], axis=1)
    term = (acc.to(ADT).to(tl.float32) * scale).to(ADT).to(tl.float32)
    on = n < tl.where(rank > 0, n_width, 0)  # (a slot without an adapter here: y as it is)
    at = y + i * y_stride + y_at + n
    tl.store(at, (tl.load(at, mask=on, other=0.0).to(tl.float32) + term).to(y.dtype.element_ty), mask=on)


def add(x: torch.Tensor, y: torch.Tensor, places: list, table: torch.Tensor, col: int,
        seqs: torch.Tensor, rows: int, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Queues on the current stream, for every row i of x ([slots * rows, k], rows of stride
    x.stride(0), its columns contiguous) and every part p of `places` ([(first column in y,
    width)], the parts whose table columns start at col, col + FIELDS, ...): y[i, first:first +
    width] += slot i // rows's delta at part p (adapters of `dtype`); t: the float32 scratch, at
    least min(len(places), MAX_PARTS) x adapters.MAX_RANK columns."""
    from symbiont.base_executor.adapters import MAX_RANK

    ends = sorted((at, at + n) for at, n in places)
    if t.shape[0] < x.shape[0] or t.shape[1] < min(len(places), MAX_PARTS) * MAX_RANK or any(
            a[1] > b[0] for a, b in zip(ends, ends[1:])):  # (one launch's parts add into y at once)
        raise ValueError(f"gang_lora.add: scratch {tuple(t.shape)} for {x.shape[0]} rows, or parts' columns overlap: {places}")
    adt = _TRITON_DTYPES[dtype]
    kw = dict(enable_fp_fusion=False)  # (each product and sum rounds on its own, as torch's ops)
    for g in range(0, len(places), MAX_PARTS):
        group = places[g:g + MAX_PARTS]
        at_n = [v for place in group + [group[-1]] * (MAX_PARTS - len(group)) for v in place]
        c = col + g * FIELDS
        _shrink_kernel[(x.shape[0], len(group), SPLIT_R)](
            x, x.stride(0), x.shape[1], table, table.shape[1], c, seqs, rows, t, t.stride(0), MAX_RANK,
            ADT=adt, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, SPLIT=SPLIT_R, FIELDS=FIELDS, **kw)
        _expand_kernel[(x.shape[0], len(group), triton.cdiv(max(n for _, n in group), BLOCK_N))](
            t, t.stride(0), MAX_RANK, y, y.stride(0), table, table.shape[1], c, seqs, rows, *at_n,
            ADT=adt, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_RE, FIELDS=FIELDS, **kw)


def entry(a: torch.Tensor, b: torch.Tensor, scale: float) -> list[int]:
    """A part's columns of the adapter table for a delta (A [r, in], B [out, r], contiguous)."""
    bits = int(torch.tensor([scale], dtype=torch.float32).view(torch.int32).item())
    return [a.data_ptr(), b.data_ptr(), a.shape[0], bits]
