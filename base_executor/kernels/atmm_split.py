"""ATMM, split variant: a shrink kernel (x @ A^T into fp32 partials) then an expand kernel.

The shrink may split its reduction over h_in across `split` programs per tile
(split-K), writing one fp32 partial each into the plan's workspace; the expand sums the
partials, multiplies by B^T and the scale, and adds into y. Two launches, but every
program of both has a full share of work: the better choice when tokens are many.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .atmm_tiles import expand_add, shrink, tile_rows
from .lora_pool import LoraPool
from .segment_plan import SegmentPlan
from .tiling import TileConfig
from .triton_launch import CompiledKernels, GridLaunch, int_spec, intern

EXPAND_STAGES = 2  # the expand has no reduction loop to pipeline


@triton.jit(do_not_specialize=["num_active"])
def _atmm_shrink_kernel(x_ptr, a_ptr, ws_ptr, tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr,
                        h_in, num_active, stride_x, stride_a, stride_rows,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # grid: (tiles, split); program (t, s) writes fp32 partial s of its tile's rows.
    slot, start, offs_m, m_mask, rows, offs_r, r_mask, pool_rows = tile_rows(
        tl.program_id(0), tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, stride_rows, BLOCK_M, BLOCK_R)
    pid_k = tl.program_id(1)
    k_per = tl.cdiv(tl.cdiv(h_in, BLOCK_K), tl.num_programs(1)) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(h_in, k_lo + k_per)
    acc = shrink(x_ptr, a_ptr, rows, m_mask, pool_rows, r_mask, k_lo, k_hi, stride_x, stride_a,
                 BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K, UPCAST)
    pos = (pid_k * num_active + start + offs_m).to(tl.int64)
    tl.store(ws_ptr + pos[:, None] * BLOCK_R + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit(do_not_specialize=["num_active", "split"])
def _atmm_expand_kernel(ws_ptr, b_ptr, y_ptr, tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, scale_ptr,
                        h_out, num_active, split, stride_b, stride_y, stride_rows, scale_mult,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        UPCAST: tl.constexpr):
    # grid: (tiles, cdiv(h_out, BLOCK_N)); sums the split partials of its tile's rows.
    slot, start, offs_m, m_mask, rows, offs_r, r_mask, pool_rows = tile_rows(
        tl.program_id(0), tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, stride_rows, BLOCK_M, BLOCK_R)
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in range(split):
        pos = (s * num_active + start + offs_m).to(tl.int64)
        xa += tl.load(ws_ptr + pos[:, None] * BLOCK_R + offs_r[None, :], mask=m_mask[:, None], other=0.0)
    scale = tl.load(scale_ptr + slot) * scale_mult
    expand_add(xa.to(b_ptr.dtype.element_ty), b_ptr, y_ptr, rows, m_mask, pool_rows, r_mask,
               tl.program_id(1) * BLOCK_N, h_out, stride_b, stride_y, scale, BLOCK_M, BLOCK_N, UPCAST)


_SHRINK = CompiledKernels(_atmm_shrink_kernel)
_EXPAND = CompiledKernels(_atmm_expand_kernel)


class SplitLaunch:
    """A plan's shrink + expand at one (h_in, h_out) and tiling: resolved once, reused by every layer."""

    def __init__(self, plan: SegmentPlan, h_in: int, h_out: int, config: TileConfig, upcast: bool):
        bm, bk, bn, br = config.block_m, config.block_k, config.block_n, plan.block_r
        n_tiles = plan.n_tiles[bm]
        self.split = min(config.split, plan.ws_split, triton.cdiv(h_in, bk))
        self.h_in, self.h_out, self.num_active = h_in, h_out, plan.num_active
        self.token_index = plan.token_index     # [num_active] int32
        self.tiles = plan.tiles[bm]             # [n_tiles, 3] int32
        self.workspace = plan.workspace         # [>= split * num_active * block_r] fp32
        self.shrink_consts = (bm, bk, br, h_in % bk == 0, upcast)
        self.expand_consts = (bm, bn, br, upcast)
        self.shrink = GridLaunch(_SHRINK, (n_tiles, self.split, 1),
                                 intern(("shrink", self.shrink_consts, int_spec(h_in))),
                                 config.num_warps, config.num_stages)
        self.expand = GridLaunch(_EXPAND, (n_tiles, triton.cdiv(h_out, bn), 1),
                                 intern(("expand", self.expand_consts, int_spec(h_out))),
                                 config.num_warps, EXPAND_STAGES)

    def __call__(self, x, y, pool: LoraPool, scale_mult: float, stride_x: int, stride_y: int,
                 spec: tuple | None) -> None:
        # x: [num_tokens, h_in] (row stride stride_x), y: [num_tokens, h_out] (row stride
        # stride_y), both unit column stride and pool.dtype; pool.a_rows [rows, h_in],
        # pool.b_rows [rows, h_out], pool.slot_rows [slots, max_rank] int32, pool.rank
        # [slots] int32, pool.scale [slots] fp32. Checked by atmm().
        # workspace: [split, num_active, block_r] fp32 partial sums of x @ A^T
        self.shrink(spec, (
            x, pool.a_rows, self.workspace, self.token_index, self.tiles, pool.slot_rows, pool.rank,
            self.h_in, self.num_active, stride_x, pool.stride_a, pool.stride_rows, *self.shrink_consts))
        self.expand(spec, (
            self.workspace, pool.b_rows, y, self.token_index, self.tiles, pool.slot_rows, pool.rank,
            pool.scale, self.h_out, self.num_active, self.split, pool.stride_b, stride_y, pool.stride_rows,
            scale_mult, *self.expand_consts))
