"""Patch embeddings as linear units: a convolution whose kernel equals its stride, without padding,
dilation or groups (the patch embedding of CLIP, SigLIP, Qwen2-VL's Conv3d, ...), is a Linear over
the flattened patches: y[b, :, i..] = W.reshape(out, -1) @ x[b, :, patch i..].flatten() + bias.
The executor serves its weight as a linear unit [out, C * prod(kernel)] (a view of the weight); the
tenant cuts its input into patches, calls the unit, and lays the result out as the convolution
does. The sums are the convolution's, in another order: equal to float rounding, not bitwise."""
from __future__ import annotations

import math

import torch
from torch import nn

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_patch_conv(module: nn.Module) -> bool:
    """Whether `module` is a plain convolution over non-overlapping patches."""
    if not isinstance(module, _CONVS) or type(module).forward is not next(c for c in _CONVS if isinstance(module, c)).forward:
        return False
    unpadded = module.padding == "valid" or (not isinstance(module.padding, str) and not any(module.padding))
    return (tuple(module.kernel_size) == tuple(module.stride) and unpadded and all(d == 1 for d in module.dilation)
            and module.groups == 1 and module.padding_mode == "zeros" and not getattr(module, "transposed", False))


def linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The convolution's weight [out, C, *kernel] as the unit's [out, C * prod(kernel)] (a view)."""
    return weight.reshape(weight.shape[0], -1)


def to_patches(x: torch.Tensor, kernel: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x [B, C, S1..Sn] (or [C, S1..Sn]) as patches [B * prod(S_i // k_i), C * prod(k)], flattened in
    the weight's order (C, then the kernel's dims), and the output's grid (B, n1..nn) to restore."""
    n = len(kernel)
    if x.dim() == n + 1:
        x = x.unsqueeze(0)
    b, c, sizes = x.shape[0], x.shape[1], x.shape[2:]
    grid = [s // k for s, k in zip(sizes, kernel)]
    x = x[(slice(None), slice(None), *(slice(0, g * k) for g, k in zip(grid, kernel)))]  # (a stride that does not divide drops the rest)
    shape = [b, c] + [d for g, k in zip(grid, kernel) for d in (g, k)]
    x = x.reshape(shape)
    order = [0] + [2 + 2 * i for i in range(n)] + [1] + [3 + 2 * i for i in range(n)]  # B, n1..nn, C, k1..kn
    return x.permute(order).reshape(b * math.prod(grid), c * math.prod(kernel)), (b, *grid)


def from_patches(y: torch.Tensor, grid: tuple[int, ...], batched: bool) -> torch.Tensor:
    """The unit's result [B * prod(n), out] laid out as the convolution's [B, out, n1..nn]."""
    n = len(grid) - 1
    y = y.reshape(*grid, y.shape[-1]).permute(0, n + 1, *range(1, n + 1)).contiguous()
    return y if batched else y.squeeze(0)
