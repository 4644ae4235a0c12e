"""Plain-PyTorch twins of the ATMM and merge kernels, and the S7 baselines.

`atmm_ref`, `merge_ref` and `delora_ref` are the slow, obviously-right definitions the
Triton kernels are tested against (fp32 arithmetic, one segment or layer at a time).
`PaddedBatch`/`atmm_padded_bmm` (ranks and per-adapter token counts padded, two
`torch.bmm`) and `LoopBatch`/`atmm_loop` (one `torch.matmul` pair per adapter) are the
baselines S7 compares ATMM with; their per-batch set-up is done once, like the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .lora_pool import LoraPool


def pool_adapter(pool: LoraPool, slot: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(lora_A.weight [r, h_in], lora_B.weight [h_out, r], scale) of one slot, gathered from the pool."""
    r = int(pool.rank[slot])
    idx = pool.slot_rows[slot, :r].long()
    return pool.a_rows[idx], pool.b_rows[idx].t(), float(pool.scale[slot])


def atmm_ref(x: torch.Tensor, y: torch.Tensor, pool: LoraPool, seg_lens: Sequence[int],
             seg_slots: Sequence[int], scale_mult: float = 1.0) -> torch.Tensor:
    """Twin of atmm.atmm: y += scale_mult * scale * (x @ A^T) @ B^T per segment, in fp32."""
    acc = y.float()
    start = 0
    for n, s in zip(seg_lens, seg_slots):
        if n and s >= 0:
            a, b, scale = pool_adapter(pool, s)
            xs = x[start:start + n].float()
            acc[start:start + n] += (scale_mult * scale) * ((xs @ a.float().t()) @ b.float().t())
        start += n
    y.copy_(acc.to(y.dtype))
    return y


def merge_ref(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
              sign: float = 1.0) -> torch.Tensor:
    """Twin of one layer of lora_merge: W += sign * scale * B @ A, in fp32, in place."""
    w = weight.float() + (sign * scale) * (b.float() @ a.float())
    weight.copy_(w.to(weight.dtype))
    return weight


def delora_ref(x: torch.Tensor, base_weight: torch.Tensor, pool: LoraPool, seg_lens: Sequence[int],
               seg_slots: Sequence[int]) -> torch.Tensor:
    """What deLoRA must equal: x @ W_base^T plus each segment's own adapter (fp32, unmerged)."""
    y = (x.float() @ base_weight.float().t()).to(x.dtype)
    return atmm_ref(x, y, pool, seg_lens, seg_slots)


def _groups(seg_lens: Sequence[int], seg_slots: Sequence[int]) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    start = 0
    for n, s in zip(seg_lens, seg_slots):
        if s >= 0:
            rows.setdefault(s, []).extend(range(start, start + n))
        start += n
    return {s: r for s, r in rows.items() if r}


@dataclass(frozen=True, eq=False)
class PaddedBatch:
    """Per-batch set-up of the padded-bmm baseline."""

    rows: torch.Tensor     # [active] int64, token rows grouped by adapter
    pad_pos: torch.Tensor  # [active] int64, their positions in the [n, l_max] padded batch
    a_pad: torch.Tensor    # [n, h_in, r_max]   A^T of each adapter in the batch, zero-padded ranks
    b_pad: torch.Tensor    # [n, r_max, h_out]  scale * B^T, zero-padded ranks
    l_max: int


def prepare_padded(pool: LoraPool, seg_lens: Sequence[int], seg_slots: Sequence[int]) -> PaddedBatch:
    groups = _groups(seg_lens, seg_slots)
    dev = pool.a_rows.device
    r_max = max(int(pool.rank[s]) for s in groups)
    l_max = max(len(r) for r in groups.values())
    n = len(groups)
    a_pad = torch.zeros(n, pool.h_in, r_max, dtype=pool.a_rows.dtype, device=dev)
    b_pad = torch.zeros(n, r_max, pool.h_out, dtype=pool.a_rows.dtype, device=dev)
    rows, pos = [], []
    for i, (s, r) in enumerate(groups.items()):
        a, b, scale = pool_adapter(pool, s)
        a_pad[i, :, :a.shape[0]] = a.t()
        b_pad[i, :a.shape[0]] = (scale * b.float().t()).to(b.dtype)
        rows += r
        pos += range(i * l_max, i * l_max + len(r))
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    return PaddedBatch(as_t(rows), as_t(pos), a_pad, b_pad, l_max)


def atmm_padded_bmm(x: torch.Tensor, y: torch.Tensor, pb: PaddedBatch) -> torch.Tensor:
    """Baseline: pad each adapter's tokens to l_max and ranks to r_max, two batched GEMMs."""
    n, h_in, _ = pb.a_pad.shape
    xp = x.new_zeros(n * pb.l_max, h_in)
    xp.index_copy_(0, pb.pad_pos, x.index_select(0, pb.rows))
    t = torch.bmm(xp.view(n, pb.l_max, h_in), pb.a_pad)       # [n, l_max, r_max]
    out = torch.bmm(t, pb.b_pad).view(n * pb.l_max, -1)       # [n * l_max, h_out]
    y.index_add_(0, pb.rows, out.index_select(0, pb.pad_pos))
    return y


@dataclass(frozen=True, eq=False)
class LoopBatch:
    """Per-batch set-up of the per-adapter matmul-loop baseline."""

    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]  # (rows, A^T, B^T, scale)


def prepare_loop(pool: LoraPool, seg_lens: Sequence[int], seg_slots: Sequence[int]) -> LoopBatch:
    dev = pool.a_rows.device
    out = []
    for s, r in _groups(seg_lens, seg_slots).items():
        a, b, scale = pool_adapter(pool, s)
        out.append((torch.tensor(r, dtype=torch.int64, device=dev), a.t().contiguous(),
                    b.t().contiguous(), scale))
    return LoopBatch(out)


def atmm_loop(x: torch.Tensor, y: torch.Tensor, lb: LoopBatch) -> torch.Tensor:
    """Baseline: for each adapter, gather its rows, two matmuls, scatter-add."""
    for rows, a_t, b_t, scale in lb.groups:
        y.index_add_(0, rows, torch.matmul(torch.matmul(x.index_select(0, rows), a_t), b_t), alpha=scale)
    return y
