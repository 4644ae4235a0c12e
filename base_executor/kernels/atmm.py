"""ATMM: the LoRA deltas of many heterogeneous adapters in one batched launch.

    y[t] += scale[s] * (x[t] @ A_s^T) @ B_s^T        for each token row t served by slot s

A_s is adapter s's lora_A.weight [rank_s, h_in] and B_s its lora_B.weight [h_out, rank_s].
Ranks differ between adapters of one launch and nothing is padded: token rows are
grouped by adapter into tiles of `block_m` rows (a `SegmentPlan`, built once per batch
and reused by every layer), and each tile reads only its own adapter's rank rows.

Adapter weights live in a `LoraPool`: two row pools (A rows of width h_in, B columns
stored as rows of width h_out) addressed through a per-slot row index, so a paged pool
whose rows are scattered works the same as one contiguous tensor per adapter.

Two execution modes, chosen per shape class by the tiling table (tiling.py):
'split' runs a shrink kernel (x @ A^T, optionally split over h_in into fp32 partials)
then an expand kernel (sum partials, @ B^T, scale, add into y); 'fused' runs one kernel
that does the shrink and then loops over output columns, which saves a launch when
tokens are few. Inputs bf16/fp16, accumulation fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .tiling import BLOCK_MS, TileConfig, TilingTable, block_r_for, default_table, fit_config

_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
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
def _tile_rows(tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, stride_rows,
               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's tile: slot, first position, token rows, and the slot's pool rows."""
    pid_t = tl.program_id(0)
    slot = tl.load(tile_ptr + pid_t * 3)
    start = tl.load(tile_ptr + pid_t * 3 + 1)
    count = tl.load(tile_ptr + pid_t * 3 + 2)
    rank = tl.load(rank_ptr + slot)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    pool_rows = tl.load(slot_rows_ptr + slot * stride_rows + offs_r, mask=r_mask, other=0).to(tl.int64)
    return slot, start, offs_m, m_mask, rows, offs_r, r_mask, pool_rows


@triton.jit
def _shrink(x_ptr, a_ptr, rows, m_mask, pool_rows, r_mask, k_lo, k_hi, stride_x, stride_a,
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
        acc = _mma(xt, at, acc, UPCAST)
    return acc


@triton.jit
def _expand_add(xa, b_ptr, y_ptr, rows, m_mask, pool_rows, r_mask, n0, h_out, stride_b, stride_y, scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """y[rows, n0:n0+BN] += scale * xa @ B_pool[pool_rows, n0:n0+BN] (xa in the input dtype)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < h_out
    bt = tl.load(b_ptr + pool_rows[:, None] * stride_b + offs_n[None, :],
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)                # [BR, BN]
    out = _mma(xa, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
    y_ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]                   # [BM, BN]
    mask = m_mask[:, None] & n_mask[None, :]
    yt = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yt + out * scale).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_active"])
def _atmm_shrink_kernel(x_ptr, a_ptr, ws_ptr, tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr,
                        h_in, num_active, stride_x, stride_a, stride_rows,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # grid: (tiles, split_k); program (t, s) writes fp32 partial s of its tile's rows.
    slot, start, offs_m, m_mask, rows, offs_r, r_mask, pool_rows = _tile_rows(
        tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, stride_rows, BLOCK_M, BLOCK_R)
    pid_k = tl.program_id(1)
    k_per = tl.cdiv(tl.cdiv(h_in, BLOCK_K), tl.num_programs(1)) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(h_in, k_lo + k_per)
    acc = _shrink(x_ptr, a_ptr, rows, m_mask, pool_rows, r_mask, k_lo, k_hi, stride_x, stride_a,
                  BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K, UPCAST)
    pos = (pid_k * num_active + start + offs_m).to(tl.int64)
    tl.store(ws_ptr + pos[:, None] * BLOCK_R + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit(do_not_specialize=["num_active", "split_k"])
def _atmm_expand_kernel(ws_ptr, b_ptr, y_ptr, tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, scale_ptr,
                        h_out, num_active, split_k, stride_b, stride_y, stride_rows, scale_mult,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        UPCAST: tl.constexpr):
    # grid: (tiles, cdiv(h_out, BLOCK_N)); sums the split_k partials of its tile's rows.
    slot, start, offs_m, m_mask, rows, offs_r, r_mask, pool_rows = _tile_rows(
        tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, stride_rows, BLOCK_M, BLOCK_R)
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in range(split_k):
        pos = (s * num_active + start + offs_m).to(tl.int64)
        xa += tl.load(ws_ptr + pos[:, None] * BLOCK_R + offs_r[None, :], mask=m_mask[:, None], other=0.0)
    scale = tl.load(scale_ptr + slot) * scale_mult
    _expand_add(xa.to(b_ptr.dtype.element_ty), b_ptr, y_ptr, rows, m_mask, pool_rows, r_mask,
                tl.program_id(1) * BLOCK_N, h_out, stride_b, stride_y, scale, BLOCK_M, BLOCK_N, UPCAST)


@triton.jit
def _atmm_fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, scale_ptr,
                       h_in, h_out, stride_x, stride_a, stride_b, stride_y, stride_rows, scale_mult,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # grid: (tiles, split_n); program (t, j) redoes its tile's shrink, then expands its
    # share of the output column blocks.
    slot, start, offs_m, m_mask, rows, offs_r, r_mask, pool_rows = _tile_rows(
        tok_ptr, tile_ptr, slot_rows_ptr, rank_ptr, stride_rows, BLOCK_M, BLOCK_R)
    acc = _shrink(x_ptr, a_ptr, rows, m_mask, pool_rows, r_mask, 0, h_in, stride_x, stride_a,
                  BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K, UPCAST)
    xa = acc.to(b_ptr.dtype.element_ty)
    scale = tl.load(scale_ptr + slot) * scale_mult
    n_blocks = tl.cdiv(h_out, BLOCK_N)
    per = tl.cdiv(n_blocks, tl.num_programs(1))
    nb_lo = tl.program_id(1) * per
    nb_hi = tl.minimum(n_blocks, nb_lo + per)
    for nb in range(nb_lo, nb_hi):
        _expand_add(xa, b_ptr, y_ptr, rows, m_mask, pool_rows, r_mask, nb * BLOCK_N, h_out,
                    stride_b, stride_y, scale, BLOCK_M, BLOCK_N, UPCAST)


# ---------------------------------------------------------------------------------------
# Host side: adapter pool, segment plan, launcher.


def _ptr_spec(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _int_spec(v: int) -> int:
    # What Triton specialises an int argument on: == 1, divisible by 16, or neither.
    assert -2 ** 31 <= v < 2 ** 31, "int arguments must fit int32"
    return 0 if v == 1 else 1 if v % 16 == 0 else 2


_INTERNED: dict[tuple, int] = {}


def _intern(t: tuple) -> int:
    return _INTERNED.setdefault(t, len(_INTERNED))


@dataclass(frozen=True)
class _Launch:
    """How one plan runs at one (h_in, h_out): resolved once, reused by every layer."""

    fused: bool
    grid1: tuple[int, int, int]   # fused kernel, or the shrink
    grid2: tuple[int, int, int]   # the expand
    split: int                    # split-K partials (split mode)
    tiles: torch.Tensor
    consts: tuple                 # constexpr arguments, in kernel order (without UPCAST)
    num_warps: int
    num_stages: int
    kernel_id: int                # interned (config, constexprs, h_in/h_out specialisation)


def _resolve(plan: "SegmentPlan", h_in: int, h_out: int, config: TileConfig | None,
             table: TilingTable | None) -> _Launch:
    if config is None:
        config = (table or default_table()).lookup(plan.num_active, plan.num_adapters, plan.max_rank,
                                                   h_in, h_out)
    else:
        config = fit_config(config, plan.block_r)
    bm, bk, bn, br = config.block_m, config.block_k, config.block_n, plan.block_r
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    n_tiles, even_k = plan.n_tiles[bm], h_in % bk == 0
    fused = config.mode == "fused"
    if fused:
        grid1, grid2, split = (n_tiles, min(config.split, cdiv(h_out, bn)), 1), (0, 0, 0), 1
        consts = (bm, bk, bn, br, even_k)
    else:
        split = min(config.split, plan.ws_split, cdiv(h_in, bk))
        grid1, grid2 = (n_tiles, split, 1), (n_tiles, cdiv(h_out, bn), 1)
        consts = (bm, bk, br, even_k, bm, bn, br)
    kid = _intern((config, consts, _int_spec(h_in), _int_spec(h_out)))
    return _Launch(fused, grid1, grid2, split, plan.tiles[bm], consts, config.num_warps, config.num_stages, kid)


class _Launcher:
    """Launches a @triton.jit kernel; repeats of a known specialisation skip Triton's binder.

    The JIT path costs tens of microseconds of Python per launch. The first launch for a
    `key` goes through it and keeps the compiled kernel; later launches with the same key
    call that kernel directly. Callers build `key` from everything Triton specialises on
    (constexprs, dtypes, 16-byte alignment of pointers, int arguments == 1 or % 16), so a
    cached kernel is only reused where the JIT would have picked the same one.
    """

    enabled = True

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict[tuple, object] = {}

    def __call__(self, key, grid: tuple[int, int, int], args: tuple, num_warps: int, num_stages: int) -> None:
        if key is not None and _Launcher.enabled:
            kernel = self.compiled.get(key)
            if kernel is not None:
                try:
                    kernel[grid](*args)
                    return
                except TypeError:  # a Triton whose compiled-kernel launcher wants other arguments
                    _Launcher.enabled = False
        kernel = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
        if key is not None and kernel is not None:
            self.compiled[key] = kernel


_launch_shrink = _Launcher(_atmm_shrink_kernel)
_launch_expand = _Launcher(_atmm_expand_kernel)
_launch_fused = _Launcher(_atmm_fused_kernel)


@dataclass(frozen=True, eq=False)
class LoraPool:
    """Adapter weights of one module kind (one h_in -> h_out projection), paged by rank row.

    Rank row j of slot s is a_rows[slot_rows[s, j]] (= lora_A.weight[j]) and
    b_rows[slot_rows[s, j]] (= lora_B.weight[:, j]); rows past rank[s] are never read.
    """

    a_rows: torch.Tensor     # [pool_rows, h_in]
    b_rows: torch.Tensor     # [pool_rows, h_out]
    slot_rows: torch.Tensor  # [slots, max_rank] int32
    rank: torch.Tensor       # [slots] int32
    scale: torch.Tensor      # [slots] float32

    def __post_init__(self) -> None:
        a, b, sr = self.a_rows, self.b_rows, self.slot_rows
        if a.dtype not in _DTYPES or b.dtype != a.dtype:
            raise TypeError(f"pool rows must be bf16 or fp16 and alike, got {a.dtype} and {b.dtype}")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
            raise ValueError(f"a_rows [rows, h_in] and b_rows [rows, h_out] must have the same rows, "
                             f"got {tuple(a.shape)} and {tuple(b.shape)}")
        if a.stride(1) != 1 or b.stride(1) != 1:
            raise ValueError("pool rows must be contiguous along the hidden dimension")
        if sr.dtype != torch.int32 or not sr.is_contiguous() or sr.dim() != 2:
            raise TypeError("slot_rows must be a contiguous int32 [slots, max_rank] tensor")
        if self.rank.dtype != torch.int32 or self.rank.shape != (sr.shape[0],):
            raise TypeError(f"rank must be int32 [{sr.shape[0]}]")
        if self.scale.dtype != torch.float32 or self.scale.shape != (sr.shape[0],):
            raise TypeError(f"scale must be float32 [{sr.shape[0]}]")
        if len({t.device for t in (a, b, sr, self.rank, self.scale)}) != 1:
            raise ValueError("all pool tensors must be on one device")
        spec = (a.dtype, a.device, *(_ptr_spec(t) for t in (a, b, sr, self.rank, self.scale)),
                *(_int_spec(v) for v in (a.stride(0), b.stride(0), sr.stride(0))))
        object.__setattr__(self, "spec_id", _intern(spec))  # what Triton specialises on, as a small int
        object.__setattr__(self, "strides", (a.stride(0), b.stride(0), sr.stride(0)))

    @property
    def h_in(self) -> int:
        return self.a_rows.shape[1]

    @property
    def h_out(self) -> int:
        return self.b_rows.shape[1]


def pack_lora_pool(adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]], *,
                   row_order: torch.Tensor | None = None, spare_rows: int = 0) -> LoraPool:
    """A pool holding `adapters` = [(lora_A.weight [r, h_in], lora_B.weight [h_out, r], scale)].

    `row_order` (a permutation of the pool's rows) scatters the rank rows as a paged pool
    would; `spare_rows` leaves unused rows that no slot points to.
    """
    a0, b0 = adapters[0][0], adapters[0][1]
    ranks = [a.shape[0] for a, _, _ in adapters]
    total = sum(ranks) + spare_rows
    if row_order is None:
        row_order = torch.arange(total)
    a_rows = torch.zeros(total, a0.shape[1], dtype=a0.dtype, device=a0.device)
    b_rows = torch.zeros(total, b0.shape[0], dtype=b0.dtype, device=b0.device)
    slot_rows = torch.zeros(len(adapters), max(ranks), dtype=torch.int32)
    pos = 0
    for s, (a, b, _) in enumerate(adapters):
        r = a.shape[0]
        dst = row_order[pos:pos + r].to(torch.int64)
        a_rows[dst.to(a0.device)] = a
        b_rows[dst.to(a0.device)] = b.t()
        slot_rows[s, :r] = dst.to(torch.int32)
        pos += r
    dev = a0.device
    return LoraPool(a_rows, b_rows, slot_rows.to(dev), torch.tensor(ranks, dtype=torch.int32, device=dev),
                    torch.tensor([float(s) for _, _, s in adapters], dtype=torch.float32, device=dev))


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Token rows of one batch grouped by adapter slot; build once, use for every layer."""

    num_tokens: int                 # rows of x and y
    num_active: int                 # rows served by an adapter
    num_adapters: int               # distinct slots in the batch
    max_rank: int                   # largest rank among them
    token_index: torch.Tensor       # [num_active] int32, rows of x grouped by slot
    tiles: dict[int, torch.Tensor]  # block_m -> [n_tiles, 3] int32 (slot, first position, rows)
    workspace: torch.Tensor         # [ws_split * num_active * block_r] fp32, split-K partials
    ws_split: int                   # most split-K partials the workspace holds
    n_tiles: dict[int, int]         # block_m -> tiles
    block_r: int                    # rank tile: block_r_for(max_rank)
    launches: dict = field(default_factory=dict)  # (h_in, h_out, config, table) -> _Launch, filled by atmm

    @property
    def device(self) -> torch.device:
        return self.token_index.device


def plan_segments(seg_lens: Sequence[int], seg_slots: Sequence[int], slot_ranks: Sequence[int],
                  device: torch.device | str) -> SegmentPlan:
    """Group a batch's token rows by adapter.

    The batch is `len(seg_lens)` consecutive segments of x's rows; segment i has
    seg_lens[i] rows (0 allowed) served by slot seg_slots[i] (-1: no adapter).
    slot_ranks[s] must equal the pool's rank[s].
    """
    lens = np.asarray(seg_lens, dtype=np.int64).reshape(-1)
    slots = np.asarray(seg_slots, dtype=np.int64).reshape(-1)
    ranks = np.asarray(slot_ranks, dtype=np.int64).reshape(-1)
    if lens.shape != slots.shape:
        raise ValueError(f"seg_lens and seg_slots differ in length: {lens.size} vs {slots.size}")
    if (lens < 0).any():
        raise ValueError("segment lengths must be >= 0")
    if slots.size and (slots.min() < -1 or slots.max() >= ranks.size):
        raise ValueError(f"segment slots must be -1 or in 0..{ranks.size - 1}")
    tok_slot = np.repeat(slots, lens)                                   # [num_tokens]
    active = np.flatnonzero(tok_slot >= 0)
    order = active[np.argsort(tok_slot[active], kind="stable")]         # rows grouped by slot
    used, first, counts = np.unique(tok_slot[order], return_index=True, return_counts=True)
    max_rank = int(ranks[used].max()) if used.size else 0
    pad = lambda a: np.concatenate([a, np.zeros(-a.size % 4, a.dtype)])  # noqa: E731  16-byte aligned parts
    parts, tiles_at = [pad(order)], {}
    offset = parts[0].size
    for bm in BLOCK_MS:
        nt = -(-counts // bm)                                           # tiles per slot
        within = np.arange(nt.sum()) - np.repeat(np.cumsum(nt) - nt, nt)
        t_first = np.repeat(first, nt) + within * bm
        t_count = np.minimum(bm, np.repeat(first + counts, nt) - t_first)
        tab = np.stack([np.repeat(used, nt), t_first, t_count], axis=1).reshape(-1)
        parts.append(pad(tab))
        tiles_at[bm] = (offset, int(nt.sum()))
        offset += parts[-1].size
    meta = torch.from_numpy(np.concatenate(parts).astype(np.int32)).to(device)  # one copy
    block_r = block_r_for(max_rank) if used.size else 16
    ws_split = max(1, min(8, 16384 // max(1, order.size)))
    return SegmentPlan(
        num_tokens=int(lens.sum()), num_active=int(order.size), num_adapters=int(used.size),
        max_rank=max_rank, token_index=meta[:order.size],
        tiles={bm: meta[o:o + 3 * n].view(n, 3) for bm, (o, n) in tiles_at.items()},
        workspace=torch.empty(ws_split * order.size * block_r, dtype=torch.float32, device=device),
        ws_split=ws_split, n_tiles={bm: n for bm, (_, n) in tiles_at.items()}, block_r=block_r)


def atmm(x: torch.Tensor, y: torch.Tensor, pool: LoraPool, plan: SegmentPlan, *,
         config: TileConfig | None = None, table: TilingTable | None = None,
         scale_mult: float = 1.0) -> torch.Tensor:
    """y += scale_mult * scale[s] * (x @ A_s^T) @ B_s^T per row; returns y (updated in place).

    x: [num_tokens, h_in], y: [num_tokens, h_out], same dtype (bf16/fp16) as the pool,
    each contiguous along its last dimension (row strides may be larger, e.g. a column
    slice of a fused qkv output). The tiling comes from `config`, else `table`, else
    the default table for this GPU.
    """
    if plan.num_active == 0:
        return y
    a, b = pool.a_rows, pool.b_rows
    if x.dtype is not a.dtype or y.dtype is not a.dtype:
        raise TypeError(f"x, y and the pool must share one dtype, got {x.dtype}, {y.dtype}, {a.dtype}")
    if x.dim() != 2 or y.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("x and y must be 2-D and contiguous along their last dimension")
    (t_x, h_in), (t_y, h_out) = x.shape, y.shape
    if t_x != plan.num_tokens or t_y != plan.num_tokens:
        raise ValueError(f"the plan covers {plan.num_tokens} rows, x has {t_x}, y {t_y}")
    if h_in != pool.h_in or h_out != pool.h_out:
        raise ValueError(f"x [*, {h_in}] -> y [*, {h_out}] does not match the pool ({pool.h_in} -> {pool.h_out})")
    if x.device != plan.device or a.device != x.device:
        raise ValueError(f"x on {x.device}, plan on {plan.device}, pool on {a.device}")
    lk = (h_in, h_out, config, table)
    launch = plan.launches.get(lk)
    if launch is None:
        launch = plan.launches[lk] = _resolve(plan, h_in, h_out, config, table)
    upcast = x.device.type != "cuda"
    sx, sy = x.stride(0), y.stride(0)
    key = None if upcast else (launch.kernel_id, pool.spec_id, x.data_ptr() % 16 == 0, y.data_ptr() % 16 == 0,
                               _int_spec(sx), _int_spec(sy))
    sa, sb, sr = pool.strides
    if launch.fused:
        _launch_fused(key, launch.grid1, (
            x, a, b, y, plan.token_index, launch.tiles, pool.slot_rows, pool.rank, pool.scale,
            h_in, h_out, sx, sa, sb, sy, sr, scale_mult, *launch.consts, upcast),
            launch.num_warps, launch.num_stages)
        return y
    bm, bk, br, even_k = launch.consts[:4]
    # ws: [split_k, num_active, block_r] fp32 partial sums of x @ A^T
    _launch_shrink(key, launch.grid1, (
        x, a, plan.workspace, plan.token_index, launch.tiles, pool.slot_rows, pool.rank,
        h_in, plan.num_active, sx, sa, sr, bm, bk, br, even_k, upcast),
        launch.num_warps, launch.num_stages)
    _launch_expand(key, launch.grid2, (
        plan.workspace, b, y, plan.token_index, launch.tiles, pool.slot_rows, pool.rank, pool.scale,
        h_out, plan.num_active, launch.split, sb, sy, sr, scale_mult, *launch.consts[4:], upcast),
        launch.num_warps, 2)
    return y
