"""The GEMMs: one unit, one op, a flattened batch of token rows. Pure functions of tensors."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from symbiont.base_executor.catalog import CONV1D, EMBEDDING, LINEAR, MLP, SPAN, Unit
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")


def run(unit: Unit, op: int, x: torch.Tensor, exact: bool = False, out: torch.Tensor | None = None,
        span_deltas=None) -> torch.Tensor:
    """x: [tokens, d_in] (BACKWARD: grad_y [tokens, d_out]; MLP BACKWARD: [x, grad_y] side by
    side, [tokens, 2 * hidden]; embedding: ids [tokens]).
    out: None, or [tokens, d_out] where the result is written (a tenant's output mailbox: no copy
    afterwards); the result is returned either way.
    Embedding ids are looked up clamped to the table's rows: ids the executor did not check (a
    same-GPU tenant's, which its transport checks: client/transports/ids.py) read a row of the
    table, never memory beyond it.
    span_deltas: a span unit's hosted adapters, None or an object whose o(a, base) and
    qkv(n1, q) add them where o_proj's and q/k/v's own calls would (core.RowSpanDeltas: each
    adapter on its calls' rows; gangs' rounds: each slot's); any other unit's are added to its
    result by the caller.

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
    elif unit.kind == MLP:
        return _mlp(unit, op, x, exact, out)
    elif unit.kind == SPAN and op == pb.FORWARD:
        return _span(unit, x, exact, out, span_deltas)
    elif unit.kind == EMBEDDING:
        if op == pb.FORWARD:  # (F.embedding's forward is this index_select: bitwise the module's rows)
            ids = x.clamp(0, w.shape[0] - 1)  # ids no one checked (a tenant's GPU memory) never read out of bounds
            return torch.index_select(w, 0, ids, out=out)
    raise ValueError(f"unit {unit.id} ({unit.kind}) does not support {pb.Op.Name(op)}")


def flops(unit: Unit, op: int, tokens: int) -> float:
    """Model FLOPs (2 per multiply-add) of one call: what the stats count as work done."""
    if unit.kind == EMBEDDING:
        return 0.0
    if unit.kind == SPAN:
        return sum(flops(m, op, tokens) for m in unit.members)
    if unit.kind == MLP:
        pair, down = unit.members
        forward = flops(pair, op, tokens) + flops(down, op, tokens)
        return forward if op == pb.FORWARD else 2 * forward + flops(pair, op, tokens)  # (the recompute of gate/up)
    return 2.0 * tokens * unit.in_features * unit.out_features


def _mlp(unit: Unit, op: int, x: torch.Tensor, exact: bool, out: torch.Tensor | None,
         fuse_act: bool = False) -> torch.Tensor:
    """A gated MLP block, down(act(gate(x)) * up(x)), its gate and up one unit (a group, or one
    Linear like Phi-3's gate_up_proj), with the ops its module uses (forward is
    bitwise the module's with `exact`). BACKWARD recomputes the block from x (nothing is kept
    between calls) and returns grad_x = [grad_gate, grad_up] W_gate_up. `fuse_act`: act(gate) * up
    in one kernel wherever the unit has it, not only from FUSE_MIN_ELEMENTS on."""
    pair, down = unit.members
    width = pair.out_features // 2  # [tokens, 2 * intermediate]: gate's columns, then up's
    if op == pb.FORWARD:
        gate_up = run(pair, pb.FORWARD, x, exact)  # [tokens, 2 * width]
        if unit.act_mul is not None and (fuse_act or x.shape[0] * width >= FUSE_MIN_ELEMENTS):
            a = unit.act_mul(gate_up)
        else:
            gate, up = gate_up.split(width, dim=-1)
            a = unit.act(gate) * up
        return run(down, pb.FORWARD, a, exact, out)
    if op == pb.BACKWARD:
        x, grad_y = x.split(unit.in_features, dim=-1)  # each [tokens, hidden]
        gate_up = run(pair, pb.FORWARD, x, exact)
        grad_a = run(down, pb.BACKWARD, grad_y)  # d/d(act(gate) * up)
        if unit.act_backward is None:  # an activation without a known backward op: autograd's
            with torch.enable_grad():
                gate, up = (h.detach().requires_grad_() for h in gate_up.split(width, dim=-1))
                a = unit.act(gate) * up
            grad_gate, grad_up = torch.autograd.grad(a, (gate, up), grad_a)
            return run(pair, pb.BACKWARD, torch.cat([grad_gate, grad_up], dim=-1), out=out)
        # the ops autograd runs for act(gate) * up, each written over what it no longer needs
        # (gate_up becomes [grad_gate, grad_up]): no autograd engine, a third of its memory
        gate, up = gate_up.split(width, dim=-1)
        act = unit.act(gate)
        torch.mul(grad_a, up, out=up)  # up's columns: d/d act(gate)
        grad_a.mul_(act)  # grad_up
        del act
        unit.act_backward(up, gate, gate)  # gate's columns: grad_gate
        up.copy_(grad_a)
        return run(pair, pb.BACKWARD, gate_up, out=out)
    raise ValueError(f"MLP unit {unit.id} does not support {pb.Op.Name(op)}")


def _span(unit: Unit, x: torch.Tensor, exact: bool, out: torch.Tensor | None, deltas=None) -> torch.Tensor:
    """A layer span's FORWARD (proto/layer_span.py): x = [a, r, d, w2, w1] per token (d float32, its bits),
    out [o, n2, m, n1, qkv], each piece with the ops the tenant's layer would run (so, at one call
    a batch, bitwise what its own layer gives), the norms with the tenant's weights w2, w1. Hosted
    adapters' deltas (`deltas`: run's span_deltas) are added to o_proj's and q/k/v's results as
    their own calls add them."""
    from symbiont.proto.layer_span import delta_of, delta_width, norm

    o_proj, mlp, *qkv = unit.members
    hidden = o_proj.out_features
    a, r, d, *w = x.split([o_proj.in_features, hidden, delta_width(hidden, x.dtype)] + [hidden] * len(unit.norms), dim=-1)
    pieces = _span_pieces(unit)
    y = torch.empty(x.shape[0], sum(pieces), dtype=x.dtype, device=x.device) if out is None else out
    o, n2, m, *nxt = y.split(pieces, dim=-1)
    # a tenant's o_proj adapter adds its float32 delta to the base output as PEFT does, one
    # rounding (a served-dtype adapter's delta the same: its add's math is float32 too)
    a = a.contiguous()
    base = run(o_proj, pb.FORWARD, a, exact)
    if deltas is not None:
        deltas.o(a, base)
    o.copy_(base.float() + delta_of(d))
    h = r + o
    n2.copy_(norm(unit.norms[0], h, w[0]))
    m.copy_(run(mlp, pb.FORWARD, n2.contiguous(), exact))
    if qkv:
        n1, q = nxt
        n1.copy_(norm(unit.norms[1], h + m, w[1]))
        n1 = n1.contiguous()
        q.copy_(run(qkv[0], pb.FORWARD, n1, exact))
        if deltas is not None:
            deltas.qkv(n1, q)
    return y


def _span_pieces(unit: Unit) -> list[int]:
    """The widths of a span's output pieces, [o, n2, m, n1, qkv] (the last layer's: [o, n2, m])."""
    o_proj, _, *qkv = unit.members
    hidden = o_proj.out_features
    return [hidden] * 3 + ([hidden, qkv[0].out_features] if qkv else [])


def span_fused(unit: Unit, x: torch.Tensor, exact: bool, out: torch.Tensor, deltas=None) -> torch.Tensor:
    """A span's FORWARD as _span computes it, its elementwise work in two kernels
    (kernels/span_norms.py) and the MLP's act(gate) * up in one where the unit has it: 7 kernels
    instead of ~36, within float rounding of _span (not bitwise: the norms' sums in another
    order). For gangs' rounds, whose results are within the batching tolerance anyway; hosted
    adapters' deltas as _span adds them. x and out are contiguous [rows, width]; where d's float32
    bits do not fall on 4-byte boundaries, _span computes it."""
    from symbiont.base_executor.kernels import span_norms
    from symbiont.proto.layer_span import delta_width

    o_proj, mlp, *qkv = unit.members
    hidden = o_proj.out_features
    r_at = o_proj.in_features
    d_at = r_at + hidden
    w2_at = d_at + delta_width(hidden, x.dtype)
    size = x.element_size()
    if (not (x.is_contiguous() and out.is_contiguous()) or (x.data_ptr() + d_at * size) % 4
            or (x.stride(0) * size) % 4):
        return _span(unit, x, exact, out, deltas)
    _, _, m, *nxt = out.split(_span_pieces(unit), dim=-1)
    base = run(o_proj, pb.FORWARD, x[:, :r_at], exact)
    if deltas is not None:
        deltas.o(x[:, :r_at], base)
    span_norms.o_and_norm(base, x, out, r_at, d_at, w2_at, 0, hidden, unit.norms[0].variance_epsilon)
    _mlp(mlp, pb.FORWARD, out[:, hidden:2 * hidden], exact, m, fuse_act=True)
    if qkv:
        span_norms.m_and_norm(x, out, hidden, r_at, w2_at + hidden, 0, 2 * hidden, 3 * hidden,
                              unit.norms[1].variance_epsilon)
        run(qkv[0], pb.FORWARD, nxt[0], exact, nxt[1])
        if deltas is not None:
            deltas.qkv(nxt[0], nxt[1])
    return out


FUSE_MIN_ELEMENTS = 1 << 18
"""A call fuses act(gate) * up from this many products on (19 tokens of `llama-8b`, 32 of
`llama-1b`; fused, a 2048-token `llama-8b` prefill took 2.7-4.4 ms less: benchmarks/RESULTS.md).
Below, the fused kernel's launch from Python costs more host time than its saved memory traffic
is worth, and `llama-1b` decode measured slower with it fused inside the graph replays
(1.12-1.18 against 0.93-1.08 in three runs, within their noise but always that way round)."""


def act_mul_of(act, dtype: torch.dtype, device: torch.device, width: int):
    """The fused act(gate) * up (gate_up -> product, kernels/act_mul.py) for an MLP whose gate
    and up are `width` wide, when one is bitwise what torch's two ops give there; else None."""
    if device.type != "cuda":
        return None
    try:  # (no Triton, one that fails to import, or one that cannot build the kernel here: torch's ops)
        from symbiont.base_executor.kernels.act_mul import act_mul_ref, silu_mul

        gen = torch.Generator().manual_seed(0)
        gate_up = (6 * torch.randn(64, 2 * width, generator=gen)).to(dtype).to(device)
        gate_up[0, :width] = torch.linspace(-90, 90, width)  # (exp's range ends, where silu saturates)
        tiny = torch.finfo(dtype).tiny
        edge = torch.tensor([0.0, -0.0, tiny / 2, -tiny / 2, tiny / 64, tiny, -tiny], dtype=dtype)  # (subnormals: no flush)
        gate_up[1, :edge.numel()] = edge.to(device)
        gate_up[1, width:width + edge.numel()] = edge.to(device)
        same = torch.equal(silu_mul(gate_up), act_mul_ref(act, gate_up))
    except Exception as e:
        log.warning("fused silu(gate) * up unavailable (%s: %s); MLP units use two torch ops", type(e).__name__, e)
        return None
    return silu_mul if same else None


_ACT_BACKWARDS = (  # (grad, x, out) -> out: the backward ops of the activations gated MLPs use
    lambda g, x, out: torch.ops.aten.silu_backward.grad_input(g, x, grad_input=out),
    lambda g, x, out: torch.ops.aten.gelu_backward.grad_input(g, x, approximate="tanh", grad_input=out),
    lambda g, x, out: torch.ops.aten.gelu_backward.grad_input(g, x, approximate="none", grad_input=out),
)


def act_backward_of(act, dtype: torch.dtype):
    """The backward op of activation `act` among _ACT_BACKWARDS, found by a probe: the one whose
    result is bitwise what autograd gives through act; None when none is."""
    gen = torch.Generator().manual_seed(0)
    x, g = (4 * torch.randn(16, 256, generator=gen)).to(dtype), torch.randn(16, 256, generator=gen).to(dtype)
    with torch.enable_grad():
        xr = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(act(xr), xr, g)
    for f in _ACT_BACKWARDS:
        try:
            got = f(g, x, torch.empty_like(x))
        except RuntimeError:  # (an op this build lacks for the dtype)
            continue
        if torch.equal(got, want):
            return f
    return None
