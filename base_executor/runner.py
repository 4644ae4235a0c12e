"""The GEMMs: one unit, one op, a flattened batch of token rows. Pure functions of tensors."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from base_executor.catalog import CONV1D, EMBEDDING, LINEAR, Unit
from proto import executor_pb2 as pb


def run(unit: Unit, op: int, x: torch.Tensor, exact: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [tokens, d_in] (BACKWARD: grad_y [tokens, d_out]; embedding: ids [tokens]).
    out: None, or [tokens, d_out] where a linear or conv1d result is written (a tenant's output
    mailbox: no copy afterwards); the result is returned either way.

    Each op is computed with the same primitive the replaced module uses (F.linear of a 2-D
    input is addmm, or mm without a bias), so a virtualized model is bitwise equal to the
    original where the batch is one call.
    A group unit (fused siblings) is one GEMM over the stacked weights; with `exact`, its
    forward is one GEMM per member instead, so its columns are bitwise the members' own
    results whatever the GEMM kernel does with a wider matrix.
    """
    w, b = unit.weight, unit.bias
    if unit.kind == LINEAR:
        if op in (pb.FORWARD, pb.FORWARD_NO_BIAS) and exact and unit.members:
            bias = op == pb.FORWARD
            return torch.cat([F.linear(x, m.weight, m.bias if bias else None) for m in unit.members], dim=-1, out=out)
        if op == pb.FORWARD and b is not None:
            return F.linear(x, w, b) if out is None else torch.addmm(b, x, w.t(), out=out)
        if op in (pb.FORWARD, pb.FORWARD_NO_BIAS):
            return F.linear(x, w) if out is None else torch.mm(x, w.t(), out=out)
        if op == pb.BACKWARD:
            return torch.mm(x, w, out=out)  # [tokens, out] @ [out, in]
    elif unit.kind == CONV1D:
        if op == pb.FORWARD:
            return torch.addmm(b, x, w, out=out) if b is not None else torch.mm(x, w, out=out)
        if op == pb.FORWARD_NO_BIAS:
            return torch.mm(x, w, out=out)
        if op == pb.BACKWARD:
            return torch.mm(x, w.t(), out=out)  # [tokens, out] @ [out, in]
    elif unit.kind == EMBEDDING:
        if op == pb.FORWARD:
            return F.embedding(x, w, unit.padding_idx)
    raise ValueError(f"unit {unit.id} ({unit.kind}) does not support {pb.Op.Name(op)}")
