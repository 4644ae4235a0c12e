"""A layer span's elementwise work in two kernels, for gangs' rounds (runner.span_fused).

runner._span computes a span (proto/layer_span.py) with the ops the tenant's own layer runs, so
that one call a batch is bitwise the tenant's layer: between its four GEMMs that is some thirty
small kernels (casts, the delta's add, residual adds, two RMS norms of five ops each, copies into
the output's pieces). In a gang's round every kernel of the chain is waited for by all its
tenants, and at N = 16 the GPU's rate of small kernels is what they share (benchmarks/RESULTS.md,
session 49), so a round computes them fused instead:

- `o_and_norm`: o = (o_proj's result + d in float32, rounded); h = r + o (rounded);
  n2 = norm(h) with the row's weight w2. Writes o and n2 into the output's pieces.
- `m_and_norm`: h = r + o, h2 = h + m (each rounded as torch rounds a sum of two tensors of the
  dtype); n1 = norm(h2) with w1. Writes n1.

The norm is layer_span.norm's: in float32, x * rsqrt(mean(x^2) + eps), rounded, times the weight
(the product of two values of the dtype, rounded). The elementwise steps round where torch's ops
do (no fused multiply-adds); the mean's sum runs in another order (and rsqrt may be another
instruction), so a fused span is within float rounding of the eager one, not bitwise: what a
gang's results are anyway (the batch's GEMMs are other kernels than the lone calls'). o is
bitwise where cuBLAS computes o_proj's GEMM over the batch's strided columns as over a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm(h, w, inv_width, eps):
    hf = h.to(tl.float32)
    y = hf * tl.math.rsqrt(tl.sum(hf * hf, axis=0) * inv_width + eps)
    return (w.to(tl.float32) * y.to(h.dtype).to(tl.float32)).to(h.dtype)


@triton.jit
def _o_and_norm_kernel(base, x, out, width, x_stride, out_stride, r_at, d_at, w_at, o_at, n_at, inv_width, eps,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    on = cols < width
    xr = x + row * x_stride
    dtype = out.dtype.element_ty
    d = tl.load((xr + d_at).to(tl.pointer_type(tl.float32)) + cols, mask=on, other=0.0)
    o = (tl.load(base + row * width + cols, mask=on, other=0.0).to(tl.float32) + d).to(dtype)
    h = (tl.load(xr + r_at + cols, mask=on, other=0.0).to(tl.float32) + o.to(tl.float32)).to(dtype)
    n = _norm(h, tl.load(xr + w_at + cols, mask=on, other=0.0), inv_width, eps)
    orow = out + row * out_stride
    tl.store(orow + o_at + cols, o, mask=on)
    tl.store(orow + n_at + cols, n, mask=on)


@triton.jit
def _m_and_norm_kernel(x, out, width, x_stride, out_stride, r_at, w_at, o_at, m_at, n_at, inv_width, eps,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    on = cols < width
    xr = x + row * x_stride
    orow = out + row * out_stride
    dtype = out.dtype.element_ty
    o = tl.load(orow + o_at + cols, mask=on, other=0.0)
    h = (tl.load(xr + r_at + cols, mask=on, other=0.0).to(tl.float32) + o.to(tl.float32)).to(dtype)
    h2 = (h.to(tl.float32) + tl.load(orow + m_at + cols, mask=on, other=0.0).to(tl.float32)).to(dtype)
    tl.store(orow + n_at + cols, _norm(h2, tl.load(xr + w_at + cols, mask=on, other=0.0), inv_width, eps), mask=on)


def _launch_args(x: torch.Tensor, width: int) -> tuple:
    block = triton.next_power_of_2(width)
    # (no fused multiply-adds: each product and sum rounds on its own, as torch's separate ops do)
    return (x.shape[0],), dict(BLOCK=block, num_warps=max(1, min(16, block // 256)), enable_fp_fusion=False)


def o_and_norm(base: torch.Tensor, x: torch.Tensor, out: torch.Tensor, r_at: int, d_at: int, w_at: int,
               o_at: int, n_at: int, eps: float) -> None:
    """Queues: out[:, o_at:+w] = o, out[:, n_at:+w] = n2 (the module's docstring), from base
    [rows, w] (o_proj's result, contiguous) and x's columns (r at r_at, d's float32 bits at d_at,
    w2 at w_at); x and out contiguous rows."""
    width = base.shape[1]
    grid, kw = _launch_args(x, width)
    _o_and_norm_kernel[grid](base, x, out, width, x.stride(0), out.stride(0), r_at, d_at, w_at, o_at, n_at,
                             1.0 / width, eps, **kw)


def m_and_norm(x: torch.Tensor, out: torch.Tensor, width: int, r_at: int, w_at: int, o_at: int, m_at: int,
               n_at: int, eps: float) -> None:
    """Queues: out[:, n_at:+width] = n1 = norm((r + o) + m) with w1 (the module's docstring)."""
    grid, kw = _launch_args(x, width)
    _m_and_norm_kernel[grid](x, out, width, x.stride(0), out.stride(0), r_at, w_at, o_at, m_at, n_at,
                             1.0 / width, eps, **kw)
