"""Swift mode switch and the deLoRA branch (VaLoRA 4.4.1, 4.4.2).

`plan_merge` describes every layer of one adapter (weight, lora_A, lora_B, scale) once,
at adapter load; `merge_lora_` / `unmerge_lora_` then add or subtract ΔW = scale·B·A
into all those weights in place with one kernel launch, computing ΔW tile by tile in
registers (ΔW is never stored).

While adapter m is merged, requests of other adapters x go through deLoRA: the executor
computes x @ W_merged^T as usual and `delora_` adds two low-rank ATMM branches, +x's own
adapter and −m, so the result is x @ (W_base + ΔW_x)^T without forming any full-size
difference matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from .atmm import atmm
from .atmm_tiles import mma
from .lora_pool import LoraPool
from .segment_plan import SegmentPlan, plan_segments
from .tiling import TilingTable

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HELD_RANK = 128  # the largest rank whose [rank, block_n] block of A a program holds (shared memory)


@triton.jit
def _merge_kernel(base_ptr, out_ptr, table_ptr, starts_ptr, scale_ptr, sign, n_mats,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SEARCH: tl.constexpr,
                  ALIGN: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr, GROUP: tl.constexpr, B_ALIGN: tl.constexpr):
    # grid: (tiles of every matrix,); program p writes tile p - starts[i] of matrix i (GROUP row tiles of
    # BLOCK_M rows by BLOCK_N columns), where
    # starts[i] <= p < starts[i + 1] (a binary search of SEARCH steps over the matrices' first tiles):
    #   O_i[m, n] = W_i[m, n] + sign * scale_i * sum_r B_i[m, r] * A_i[r, n]
    # (O_i is W_i itself for a merge in place, or a copy's rows: each element read once, written once)
    # W, A and B are addressed as element offsets from base_ptr (one of the weights), O from out_ptr
    # (base_ptr again, or the copies' arena), so the ALIGN hint (offsets and row strides are multiples
    # of ALIGN elements, checked by plan_merge) lets the compiler use 16-byte loads and stores along W's rows.
    # B_ALIGN > 0: every B is contiguous along its rank (lora_B.weight's layout), its offset and row stride
    # multiples of B_ALIGN: said to the compiler (with runtime strides it read B element by element).
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + n_mats
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        go = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    row = table_ptr + lo * 12
    n_out = tl.load(row + 3)
    n_in = tl.load(row + 4)
    tiles_n = tl.cdiv(n_in, BLOCK_N)
    tile = pid - tl.load(starts_ptr + lo)
    if tile < tl.cdiv(n_out, BLOCK_M * GROUP) * tiles_n:
        w_ptr = base_ptr + tl.multiple_of(tl.load(row + 0), ALIGN)
        a_ptr = base_ptr + tl.multiple_of(tl.load(row + 1), ALIGN)
        if B_ALIGN > 0:
            b_ptr = base_ptr + tl.multiple_of(tl.load(row + 2), B_ALIGN)
            stride_bo = tl.multiple_of(tl.load(row + 8), B_ALIGN)
            stride_br = 1
        else:
            b_ptr = base_ptr + tl.load(row + 2)
            stride_bo = tl.load(row + 8)
            stride_br = tl.load(row + 9)
        rank = tl.load(row + 5)
        stride_w = tl.multiple_of(tl.load(row + 6), ALIGN)
        stride_a = tl.multiple_of(tl.load(row + 7), ALIGN)
        o_ptr = out_ptr + tl.multiple_of(tl.load(row + 10), ALIGN)
        stride_o = tl.multiple_of(tl.load(row + 11), ALIGN)
        s = tl.load(scale_ptr + lo) * sign
        offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        n_ok = offs_n < n_in
        # GROUP row tiles under one column block: A's [rank, BLOCK_N] block (BLOCK_R >= rank) loaded
        # once and held, so each W tile costs only B's rows on top of itself
        r_ok = offs_r < rank
        if EVEN:  # no column mask: keeps A's row loads 16 bytes wide
            at = tl.load(a_ptr + offs_r[:, None] * stride_a + offs_n[None, :], mask=r_ok[:, None], other=0.0)
        else:
            at = tl.load(a_ptr + offs_r[:, None] * stride_a + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        for g in range(GROUP):
            offs_m = ((tile // tiles_n) * GROUP + g) * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = offs_m < n_out
            b_ptrs = b_ptr + offs_m[:, None] * stride_bo + offs_r[None, :] * stride_br  # [BM, BR]
            w_ptrs = w_ptr + offs_m[:, None] * stride_w + offs_n[None, :]
            o_ptrs = o_ptr + offs_m[:, None] * stride_o + offs_n[None, :]
            if EVEN:
                bt = tl.load(b_ptrs, mask=r_ok[None, :], other=0.0)
                acc = mma(bt, at, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
                wt = tl.load(w_ptrs).to(tl.float32)
                tl.store(o_ptrs, (wt + s * acc).to(base_ptr.dtype.element_ty))
            else:
                bt = tl.load(b_ptrs, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
                acc = mma(bt, at, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
                mask = m_ok[:, None] & n_ok[None, :]
                wt = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(o_ptrs, (wt + s * acc).to(base_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, eq=False)
class MergePlan:
    """All layers of one adapter, ready to be merged or unmerged in one launch."""

    base: torch.Tensor    # weights[0]; the table's w, a, b offsets count elements from its first one
    table: torch.Tensor   # [layers, 12] int64: w, a, b offsets; out, in, rank; strides w, a, b_out, b_r; o offset, o stride
    starts: torch.Tensor  # [layers + 1] int32: each layer's first tile, then the tiles of all
    scales: torch.Tensor  # [layers] float32
    tiles: int
    arena: tuple | None   # (numel, dtype, device) of the arena the o offsets count from; None: from base
    align: int            # every W/A offset and row stride is a multiple of this many elements
    even: bool
    block_m: int
    block_n: int
    block_r: int
    num_warps: int
    num_stages: int
    group: int            # row tiles (of block_m rows) a program writes under one held A block
    b_align: int          # > 0: every B contiguous along its rank, offsets and row strides multiples of it
    keep: tuple           # the tensors whose addresses the table holds


def plan_merge(weights: Sequence[torch.Tensor], loras: Sequence[tuple[torch.Tensor, torch.Tensor, float]], *,
               outs: Sequence[torch.Tensor] | None = None, arena: torch.Tensor | None = None, block_m: int = 64,
               block_n: int = 128, block_r: int | None = None, num_warps: int = 4, num_stages: int = 3,
               group: int = 4) -> MergePlan:
    """Describe `weights[i] += scale_i * B_i @ A_i` for all i; with `outs`, `outs[i] = weights[i] +
    scale_i * B_i @ A_i` instead (the weights only read: a merged copy written once).
    With `arena` (a 1-D tensor every out is a view of), the plan holds the outs' places in it, not
    their addresses: `merge_lora_(plan, arena)` then writes into that arena or any other of its size
    and dtype (a plan made once for copies made anew at every merge).

    weights[i]: [out_i, in_i] (nn.Linear layout), contiguous along in_i.
    loras[i]: (A_i [r_i, in_i] contiguous along in_i, B_i [out_i, r_i] any strides
    (lora_B.weight, or a pool's b_rows[...].t()), scale_i). Same dtype as the weight.
    outs[i]: the weight's shape and dtype, contiguous along in_i; unmerging such a plan subtracts.
    The plan holds the addresses: keep the tensors alive and in place.
    Each program writes `group` row tiles of block_m x block_n under one [rank, block_n] block of A,
    loaded once: block_r must cover every rank (None: the least power of two >= 16 that does).
    """
    if len(weights) != len(loras) or not weights:
        raise ValueError(f"need one (A, B, scale) per weight: {len(weights)} weights, {len(loras)} adapters")
    outs = list(weights) if outs is None else list(outs)
    if len(outs) != len(weights):
        raise ValueError(f"need one output per weight: {len(weights)} weights, {len(outs)} outputs")
    dtype, dev = weights[0].dtype, weights[0].device
    if dtype not in _DTYPES:
        raise TypeError(f"weights must be bf16, fp16 or fp32, got {dtype}")
    base = weights[0]
    es = base.element_size()
    if arena is not None:
        if arena.dim() != 1 or arena.dtype != dtype or arena.device != dev or not arena.is_contiguous():
            raise ValueError(f"the arena must be a contiguous 1-D {dtype} tensor on {dev}")
        a0, a1 = arena.data_ptr(), arena.data_ptr() + arena.numel() * es
        if any(o.numel() and not (a0 <= o.data_ptr() and o.data_ptr() + ((o.shape[0] - 1) * o.stride(0) + o.shape[1]) * es <= a1)
               for o in outs):
            raise ValueError("every output must lie in the arena")
    out_base = base if arena is None else arena
    max_rank = max(a.shape[0] for a, _, _ in loras)
    if max_rank > MAX_HELD_RANK:
        raise ValueError(f"rank {max_rank}: the kernel holds A's block whole, for ranks up to {MAX_HELD_RANK}")
    if block_r is None:
        block_r = max(16, triton.next_power_of_2(max_rank))
    if block_r < max_rank or block_r < 16 or block_r & (block_r - 1) or group < 1:
        raise ValueError(f"a program holds A's block whole: block_r {block_r} must be a power of two >= 16 covering "
                         f"every rank (up to {max_rank}), and group ({group}) at least 1")
    tile_rows = block_m * group
    rows, scales, starts, even = [], [], [0], True
    for i, (w, (a, b, scale), o) in enumerate(zip(weights, loras, outs)):
        if w.dim() != 2 or a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"layer {i}: weight, A and B must be 2-D")
        n_out, n_in = w.shape
        r = a.shape[0]
        if a.shape[1] != n_in or b.shape != (n_out, r):
            raise ValueError(f"layer {i}: W {tuple(w.shape)} needs A [r, {n_in}] and B [{n_out}, r], "
                             f"got A {tuple(a.shape)}, B {tuple(b.shape)}")
        if {w.dtype, a.dtype, b.dtype} != {dtype} or {w.device, a.device, b.device} != {dev}:
            raise TypeError(f"layer {i}: weights, A and B must share dtype {dtype} and device {dev}")
        if o.shape != w.shape or o.dtype != dtype or o.device != dev:
            raise ValueError(f"layer {i}: the output must be {tuple(w.shape)} {dtype} on {dev}, got {tuple(o.shape)} {o.dtype} on {o.device}")
        if w.stride(1) != 1 or a.stride(1) != 1 or o.stride(1) != 1:
            raise ValueError(f"layer {i}: W, A and the output must be contiguous along the input dimension")
        offs = [(t.data_ptr() - base.data_ptr()) for t in (w, a, b)] + [o.data_ptr() - out_base.data_ptr()]
        if not w.numel():  # (no tiles; an empty tensor's address is 0)
            offs = [0, 0, 0, 0]
        if any(o % es for o in offs):
            raise ValueError(f"layer {i}: tensors are not aligned to their element size")
        even &= n_out % tile_rows == 0 and n_in % block_n == 0
        rows.append([offs[0] // es, offs[1] // es, offs[2] // es, n_out, n_in, r,
                     w.stride(0), a.stride(0), b.stride(0), b.stride(1), offs[3] // es, o.stride(0)])
        scales.append(float(scale))
        starts.append(starts[-1] + triton.cdiv(n_out, tile_rows) * triton.cdiv(n_in, block_n))
    if starts[-1] >= 2**31:
        raise ValueError(f"{starts[-1]} tiles: more than one launch can address; use larger blocks")
    def aligned(columns, *bases) -> int:
        """16 bytes in elements if these table columns (offsets, row strides) and bases allow it, else 1."""
        vec = 16 // es
        return 1 if any(row[c] % vec for row in rows for c in columns) or any(t.data_ptr() % 16 for t in bases) else vec

    align = aligned((0, 1, 6, 7, 10, 11), base, out_base)  # W's, A's and the outputs' rows
    # B rows contiguous along the rank (PEFT's lora_B.weight): said so, aligned where offsets and strides allow
    b_align = aligned((2, 8), base) if all(b.stride(1) == 1 or b.shape[1] == 1 for _, b, _ in loras) else 0
    table = torch.tensor(rows, dtype=torch.int64).to(dev)
    keep = tuple(weights) + (tuple(outs) if arena is None else ()) + tuple(t for a, b, _ in loras for t in (a, b))
    return MergePlan(base, table, torch.tensor(starts, dtype=torch.int32).to(dev), torch.tensor(scales, dtype=torch.float32).to(dev),
                     starts[-1], None if arena is None else (arena.numel(), dtype, dev), align, even,
                     block_m, block_n, block_r, num_warps, num_stages, group, b_align, keep)


def _apply(plan: MergePlan, sign: float, arena: torch.Tensor | None) -> None:
    if plan.arena is None:
        if arena is not None:
            raise ValueError("this plan writes where its outputs were given: it takes no arena")
        out = plan.base
    else:
        if arena is None or (arena.dim(), arena.numel(), arena.dtype, arena.device) != (1, *plan.arena) or not arena.is_contiguous():
            raise ValueError(f"this plan writes into an arena of {plan.arena[0]} {plan.arena[1]} elements on {plan.arena[2]}")
        if plan.align > 1 and arena.data_ptr() % 16:
            raise ValueError("the arena must start at a 16-byte boundary")
        out = arena
    n = plan.table.shape[0]
    _merge_kernel[(plan.tiles,)](
        plan.base, out, plan.table, plan.starts, plan.scales, sign, n, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_R=plan.block_r, SEARCH=max(1, (n - 1).bit_length()), ALIGN=plan.align, EVEN=plan.even,
        UPCAST=plan.base.device.type != "cuda", GROUP=plan.group, B_ALIGN=plan.b_align,
        num_warps=plan.num_warps, num_stages=plan.num_stages)


def merge_lora_(plan: MergePlan, arena: torch.Tensor | None = None) -> None:
    """W += scale·B·A for every layer of the plan (into its outputs, or their places in `arena`), one launch."""
    _apply(plan, 1.0, arena)


def unmerge_lora_(plan: MergePlan, arena: torch.Tensor | None = None) -> None:
    """W -= scale·B·A for every layer of the plan (in place; a plan with outputs writes W - scale·B·A
    into them, or their places in `arena`), one launch."""
    _apply(plan, -1.0, arena)


@dataclass(frozen=True, eq=False)
class DeloraPlan:
    """The two ATMM branches of a mixed batch while slot `merged_slot` is merged."""

    own: SegmentPlan     # rows of other adapters, each with its own slot
    merged: SegmentPlan  # rows not of the merged adapter (base requests too), with the merged slot
    merged_slot: int


def plan_delora(seg_lens: Sequence[int], seg_slots: Sequence[int], slot_ranks: Sequence[int],
                merged_slot: int, device: torch.device | str) -> DeloraPlan:
    """Segments as for plan_segments; rows of `merged_slot` are served by the merged weight alone."""
    own = [s if s != merged_slot else -1 for s in seg_slots]
    sub = [merged_slot if s != merged_slot else -1 for s in seg_slots]
    return DeloraPlan(plan_segments(seg_lens, own, slot_ranks, device),
                      plan_segments(seg_lens, sub, slot_ranks, device), merged_slot)


def delora_(x: torch.Tensor, y: torch.Tensor, pool: LoraPool, plan: DeloraPlan, *,
            table: TilingTable | None = None) -> torch.Tensor:
    """y (= x @ W_merged^T) += x's own adapter − the merged adapter, per row; in place.

    x: [tokens, h_in], y: [tokens, h_out]; the merged adapter must be pool slot
    plan.merged_slot with the weights and scale that were merged.
    """
    atmm(x, y, pool, plan.own, table=table)
    return atmm(x, y, pool, plan.merged, table=table, scale_mult=-1.0)
