"""ATMM, fused variant: one kernel does a tile's shrink (x @ A^T) and then its expand (@ B^T).

One launch per call, which is what counts when tokens are few. A tile's output columns
are split over `groups` programs that each redo the tile's shrink; the groups of a tile
are adjacent program ids, so they run together and their repeated reads of the tile's
x rows and of its A hit the L2 cache instead of device memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .atmm_tiles import expand_add, shrink, tile_rows
from .lora_pool import LoraPool
from .segment_plan import SegmentPlan
from .tiling import TileConfig
from .triton_launch import CompiledKernels, GridLaunch, int_spec, intern


@triton.jit(do_not_specialize=["groups"])
def _atmm_fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, scale_ptr,
                       h_in, h_out, groups, stride_x, stride_a, stride_b, stride_y, stride_rows, scale_mult,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # grid: (tiles * groups,); program p: tile p // groups, column group p % groups. It
    # computes its tile's x @ A^T, then expands its group's share of the column blocks.
    pid = tl.program_id(0)
    tile = pid // groups
    group = pid % groups
    slot, start, offs_m, m_mask, rows, offs_r, r_mask, pool_rows = tile_rows(
        tile, tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, stride_rows, BLOCK_M, BLOCK_R)
    acc = shrink(x_ptr, a_ptr, rows, m_mask, pool_rows, r_mask, 0, h_in, stride_x, stride_a,
                 BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K, UPCAST)
    xa = acc.to(b_ptr.dtype.element_ty)
    scale = tl.load(scale_ptr + slot) * scale_mult
    n_blocks = tl.cdiv(h_out, BLOCK_N)
    per = tl.cdiv(n_blocks, groups)
    nb_lo = group * per
    nb_hi = tl.minimum(n_blocks, nb_lo + per)
    for nb in range(nb_lo, nb_hi):
        expand_add(xa, b_ptr, y_ptr, rows, m_mask, pool_rows, r_mask, nb * BLOCK_N, h_out,
                   stride_b, stride_y, scale, BLOCK_M, BLOCK_N, UPCAST)


_KERNELS = CompiledKernels(_atmm_fused_kernel)


class FusedLaunch:
    """A plan's fused ATMM at one (h_in, h_out) and tiling: resolved once, reused by every layer."""

    def __init__(self, plan: SegmentPlan, h_in: int, h_out: int, config: TileConfig, upcast: bool):
        bm, bk, bn, br = config.block_m, config.block_k, config.block_n, plan.block_r
        self.groups = min(config.split, triton.cdiv(h_out, bn))
        self.h_in, self.h_out = h_in, h_out
        self.token_index = plan.token_index     # [num_active] int32
        self.tiles = plan.tiles[bm]             # [n_tiles, 3] int32
        self.consts = (bm, bk, bn, br, h_in % bk == 0, upcast)
        kid = intern(("fused", self.consts, int_spec(h_in), int_spec(h_out)))
        self.launch = GridLaunch(_KERNELS, (plan.n_tiles[bm] * self.groups, 1, 1), kid,
                                 config.num_warps, config.num_stages)

    def __call__(self, x, y, pool: LoraPool, scale_mult: float, stride_x: int, stride_y: int,
                 spec: tuple | None) -> None:
        # x: [num_tokens, h_in] (row stride stride_x), y: [num_tokens, h_out] (row stride
        # stride_y), both unit column stride and pool.dtype; pool.a_rows [rows, h_in],
        # pool.b_rows [rows, h_out], pool.slot_rows [slots, max_rank] int32, pool.rank
        # [slots] int32, pool.scale [slots] fp32. Checked by atmm().
        self.launch(spec, (
            x, pool.a_rows, pool.b_rows, y, self.token_index, self.tiles, pool.slot_rows, pool.rank,
            pool.scale, self.h_in, self.h_out, self.groups, stride_x, pool.stride_a, pool.stride_b,
            stride_y, pool.stride_rows, scale_mult, *self.consts))
