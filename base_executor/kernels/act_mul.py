"""silu(gate) * up of a gated MLP in one kernel, from the gate/up GEMM's output.

torch runs it as two kernels (silu over the gate columns, then the product with the up
columns): the gate values are read twice and the silu written and read back once in between.
This kernel reads each input once and writes the product once, about 40% less memory traffic
(`llama-8b` prefill of 2048 tokens: 117 MB per layer).

Bitwise the two torch ops: silu in float32 as torch computes it (x / (1 + exp(-x)), the
correctly rounded division and libdevice's exp), rounded to the tensor's dtype, then the
product in float32, rounded again. The executor still uses it only where a probe found it equal
(runner.act_mul_of); `act_mul_ref` is its slow twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # (where Triton keeps libdevice moved between releases)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, width, stride_gu, stride_out, BLOCK: tl.constexpr):
    # grid: (rows, cdiv(width, BLOCK)); program (r, b): columns [b * BLOCK, (b + 1) * BLOCK) of row r
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)  # (torch's silu returns the dtype)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [tokens, 2 * width], gate's columns then up's (rows may be strided, columns
    contiguous); returns silu(gate) * up, [tokens, width], contiguous, gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul needs [tokens, 2 * width] with contiguous columns, got {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    if not gate_up.is_cuda or gate_up.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"silu_mul runs on CUDA float32/float16/bfloat16 tensors, got {gate_up.dtype} on {gate_up.device}")
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        with torch.cuda.device(gate_up.device):  # (Triton launches on the current device)
            _silu_mul_kernel[(tokens, triton.cdiv(width, BLOCK))](gate_up, out, width, gate_up.stride(0), out.stride(0),
                                                                   BLOCK=BLOCK, num_warps=4)
    return out


def act_mul_ref(act, gate_up: torch.Tensor) -> torch.Tensor:
    """The slow twin: act(gate) * up with torch's ops, as the MLP module computes it."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return act(gate) * up
