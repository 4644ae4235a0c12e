"""A batch's token rows grouped by adapter slot: built once per batch, read by every layer's ATMM.

The plan holds, on the device, the rows of x that adapters serve grouped by slot
(token_index) and, for each token-tile height of tiling.BLOCK_MS, the tile map the
kernels walk: one (slot, first position, rows) triple per tile, a tile never mixing
adapters. It also caches each layer shape's resolved launch (atmm.py), so only the
first layer of a batch pays for choosing tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .tiling import BLOCK_MS, block_r_for


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
    device_index: int               # of token_index: -1 on the CPU
    launches: dict = field(default_factory=dict)  # (h_in, h_out, config, table) -> launch, filled by atmm

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
        ws_split=ws_split, n_tiles={bm: n for bm, (_, n) in tiles_at.items()}, block_r=block_r,
        device_index=meta.get_device())
