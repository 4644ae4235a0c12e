"""Adapter weights as the ATMM kernels read them: rank rows of many adapters in two row pools.

A `LoraPool` holds one module kind (one h_in -> h_out projection) for every adapter
slot. Rank row j of slot s is a_rows[slot_rows[s, j]] (= lora_A.weight[j]) and
b_rows[slot_rows[s, j]] (= lora_B.weight[:, j]), so a paged pool whose rows are
scattered works the same as one contiguous tensor per adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .triton_launch import int_spec, intern, ptr_spec

DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)
class LoraPool:
    """Adapter weights of one module kind, paged by rank row; rows past rank[s] are never read."""

    a_rows: torch.Tensor     # [pool_rows, h_in]
    b_rows: torch.Tensor     # [pool_rows, h_out]
    slot_rows: torch.Tensor  # [slots, max_rank] int32
    rank: torch.Tensor       # [slots] int32
    scale: torch.Tensor      # [slots] float32

    def __post_init__(self) -> None:
        a, b, sr = self.a_rows, self.b_rows, self.slot_rows
        if a.dtype not in DTYPES or b.dtype != a.dtype:
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
        spec = (a.dtype, a.device, *(ptr_spec(t) for t in (a, b, sr, self.rank, self.scale)),
                *(int_spec(v) for v in (a.stride(0), b.stride(0), sr.stride(0))))
        # Read by every atmm call: plain attributes, no tensor calls.
        derived = {
            "spec_id": intern(spec),            # what Triton specialises on, as a small int
            "dtype": a.dtype,
            "device_index": a.get_device(),     # -1 on the CPU
            "h_in": a.shape[1],
            "h_out": b.shape[1],
            "stride_a": a.stride(0),
            "stride_b": b.stride(0),
            "stride_rows": sr.stride(0),
        }
        for k, v in derived.items():
            object.__setattr__(self, k, v)


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
