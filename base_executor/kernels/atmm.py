"""ATMM: the LoRA deltas of many heterogeneous adapters in one batched launch.

    y[t] += scale[s] * (x[t] @ A_s^T) @ B_s^T        for each token row t served by slot s

A_s is adapter s's lora_A.weight [rank_s, h_in] and B_s its lora_B.weight [h_out, rank_s].
Ranks differ between adapters of one launch and nothing is padded: token rows are
grouped by adapter into tiles of `block_m` rows (a `SegmentPlan`, segment_plan.py,
built once per batch and reused by every layer), and each tile reads only its own
adapter's rank rows from a `LoraPool` (lora_pool.py).

Two variants, chosen per shape class by the tiling table (tiling.py): 'fused'
(atmm_fused.py, one kernel, best when tokens are few) and 'split' (atmm_split.py, a
shrink then an expand kernel, optionally split-K). Inputs bf16/fp16, accumulation fp32.

A call must be cheap to issue: `atmm` checks its inputs with a handful of tensor
attribute reads, the plan caches each layer shape's resolved launch, and repeat
launches call Triton's compiled kernel directly (triton_launch.py).
"""

from __future__ import annotations

import torch

from .atmm_fused import FusedLaunch
from .atmm_split import SplitLaunch
from .lora_pool import LoraPool, pack_lora_pool
from .segment_plan import SegmentPlan, plan_segments
from .tiling import TileConfig, TilingTable, default_table, fit_config

__all__ = ["atmm", "LoraPool", "pack_lora_pool", "SegmentPlan", "plan_segments"]


def _resolve(plan: SegmentPlan, h_in: int, h_out: int, config: TileConfig | None,
             table: TilingTable | None, upcast: bool) -> FusedLaunch | SplitLaunch:
    if config is None:
        config = (table or default_table()).lookup(plan.num_active, plan.num_adapters, plan.max_rank,
                                                   h_in, h_out)
    else:
        config = fit_config(config, plan.block_r)
    variant = FusedLaunch if config.mode == "fused" else SplitLaunch
    return variant(plan, h_in, h_out, config, upcast)


def atmm(x: torch.Tensor, y: torch.Tensor, pool: LoraPool, plan: SegmentPlan, *,
         config: TileConfig | None = None, table: TilingTable | None = None,
         scale_mult: float = 1.0) -> torch.Tensor:
    """y += scale_mult * scale[s] * (x @ A_s^T) @ B_s^T per row; returns y (updated in place).

    x: [num_tokens, h_in], y: [num_tokens, h_out], same dtype (bf16/fp16) and device as
    the pool and the plan, each contiguous along its last dimension (row strides may be
    larger, e.g. a column slice of a fused qkv output). The tiling comes from `config`,
    else `table`, else the default table for this GPU.
    """
    if plan.num_active == 0:
        return y
    dtype = pool.dtype
    if x.dtype is not dtype or y.dtype is not dtype:
        raise TypeError(f"x, y and the pool must share one dtype, got {x.dtype}, {y.dtype}, {dtype}")
    xs, ys = x.shape, y.shape
    if len(xs) != 2 or len(ys) != 2:
        raise ValueError(f"x and y must be 2-D, got {tuple(xs)} and {tuple(ys)}")
    (stride_x, col_x), (stride_y, col_y) = x.stride(), y.stride()
    if col_x != 1 or col_y != 1:
        raise ValueError("x and y must be contiguous along their last dimension")
    (t_x, h_in), (t_y, h_out) = xs, ys
    if t_x != plan.num_tokens or t_y != plan.num_tokens:
        raise ValueError(f"the plan covers {plan.num_tokens} rows, x has {t_x}, y {t_y}")
    if h_in != pool.h_in or h_out != pool.h_out:
        raise ValueError(f"x [*, {h_in}] -> y [*, {h_out}] does not match the pool ({pool.h_in} -> {pool.h_out})")
    dev = x.get_device()
    if dev != y.get_device() or dev != pool.device_index or dev != plan.device_index:
        raise ValueError(f"x on {x.device}, y on {y.device}, plan on {plan.device}, pool on {pool.a_rows.device}")
    launch = plan.launches.get((h_in, h_out, config, table))
    if launch is None:
        launch = plan.launches[(h_in, h_out, config, table)] = _resolve(plan, h_in, h_out, config, table, dev < 0)
    # What Triton specialises on beyond the launch's constexprs: the pool's dtype, pointer
    # alignments and strides (one interned id), x's and y's alignment and row strides.
    # None on the CPU: Triton's interpreter has no compiled kernels to reuse.
    spec = None if dev < 0 else (pool.spec_id, x.data_ptr() % 16 == 0, y.data_ptr() % 16 == 0,
                                 0 if stride_x == 1 else 1 if stride_x % 16 == 0 else 2,
                                 0 if stride_y == 1 else 1 if stride_y % 16 == 0 else 2)
    launch(x, y, pool, float(scale_mult), stride_x, stride_y, spec)
    return y
