"""Device functions shared by the ATMM kernels (atmm_fused.py, atmm_split.py) and lora_merge.

A tile is up to BLOCK_M token rows of one adapter slot, described by a row of the
segment plan's tile map: (slot, first position in token_index, rows). Its adapter's rank
rows are gathered from the pool through slot_rows, so a paged pool works like a
contiguous one.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc += a @ b in fp32."""
    # The CPU interpreter multiplies bf16 bit patterns as integers: feed it fp32 there.
    # fp32 operands (fp32 weights in lora_merge) get full fp32 products, not tf32.
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def tile_rows(tile, tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, stride_rows,
              BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Tile `tile`'s slot, first position, token rows, and the slot's pool rows."""
    slot = tl.load(tile_ptr + tile * 3)
    start = tl.load(tile_ptr + tile * 3 + 1)
    count = tl.load(tile_ptr + tile * 3 + 2)
    rank = tl.load(rank_ptr + slot)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)                # [BM]
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    pool_rows = tl.load(slot_rows_ptr + slot * stride_rows + offs_r, mask=r_mask, other=0).to(tl.int64)  # [BR]
    return slot, start, offs_m, m_mask, rows, offs_r, r_mask, pool_rows


@triton.jit
def shrink(x_ptr, a_ptr, rows, m_mask, pool_rows, r_mask, k_lo, k_hi, stride_x, stride_a,
           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
           EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_R] = x[rows, k_lo:k_hi] @ A_pool[pool_rows, k_lo:k_hi]^T."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]        # [BM, BK]
    a_ptrs = a_ptr + pool_rows[None, :] * stride_a + offs_k[:, None]   # [BK, BR]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_ptrs + k, mask=r_mask[None, :], other=0.0)
        else:
            k_ok = (k + offs_k) < k_hi
            xt = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs + k, mask=r_mask[None, :] & k_ok[:, None], other=0.0)
        acc = mma(xt, at, acc, UPCAST)
    return acc


@triton.jit
def expand_add(xa, b_ptr, y_ptr, rows, m_mask, pool_rows, r_mask, n0, h_out, stride_b, stride_y, scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """y[rows, n0:n0+BN] += scale * xa @ B_pool[pool_rows, n0:n0+BN] (xa [BM, BR] in the input dtype)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < h_out
    bt = tl.load(b_ptr + pool_rows[:, None] * stride_b + offs_n[None, :],
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)                # [BR, BN]
    out = mma(xa, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
    y_ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]                   # [BM, BN]
    mask = m_mask[:, None] & n_mask[None, :]
    yt = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yt + out * scale).to(y_ptr.dtype.element_ty), mask=mask)
