"""A cheap, exact fingerprint of a weight tensor: shape, dtype and a strided sample of its bits.

Both sides compute it the same way, so `virtualize()` can tell that a tenant's model is
the served one (or name the first unit that differs) without moving the weights.
"""
from __future__ import annotations

import hashlib

import torch

SAMPLES = 4096


SEEDED = "seeded:"
"""The fingerprint of a lazy built-in's unit (base_executor/models.py): its model, seed and path, known
before its weight is drawn; a tenant cannot check such a unit's values, only its shape and dtype."""


def sample_indices(n: int) -> torch.Tensor:
    """The flat indices of the elements a fingerprint of n elements samples."""
    k = min(n, SAMPLES)
    # integer arithmetic so every torch version picks the same elements
    return (torch.arange(k, dtype=torch.int64) * max(n - 1, 0)) // max(k - 1, 1)


def digest(shape: tuple[int, ...], dtype: torch.dtype, sample: torch.Tensor) -> str:
    """The fingerprint of a tensor of `shape` and `dtype` whose sampled elements are `sample`."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tuple(shape)}|{str(dtype)}|".encode())
    h.update(sample.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(weight: torch.Tensor) -> str:
    flat = weight.detach().reshape(-1)
    return digest(tuple(weight.shape), weight.dtype, flat[sample_indices(flat.numel()).to(flat.device)])
