"""Tenant processes the tests start (and kill), and what they share."""
from __future__ import annotations


def gpu_tenant_and_input(url: str, unit: str):
    """A connection to the executor at `url` attached on cuda:0, and a 3-token input for `unit` there."""
    import torch

    from symbiont import connect

    conn = connect(url)
    conn.ensure_attached("cuda:0")
    d_in = next(u.in_features for u in conn.catalog().units if u.id == unit)
    return conn, torch.randn(3, d_in, device="cuda:0")
