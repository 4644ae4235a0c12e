"""Cross entropy over a GPU's logits in two Triton kernels that read the logits once a pass.

The exact chunked loss (client/loss.py) keeps transformers' kernels so that its result is the
same bit for bit, and pays for it in memory traffic: each chunk of rows is cast to float32, its
log-softmax written, read, recomputed in the backward, a float32 gradient of it made and cast
back: about 8 GB a step at 2 x 512 tokens of a 128k vocabulary, 3 GB more than transformers' own
loss, which S2's eight tenants sharing one GPU paid as 4% of their throughput (RESULTS.md,
session 43). Here the forward reads each row of logits once (an online log-sum-exp in float32)
and keeps one float per row; the backward reads the logits once more and writes their gradient
in their dtype: softmax minus the target's one-hot, times the loss's gradient over the counted
rows.

The same function as transformers' loss (logits.float() then cross_entropy), within float32
rounding: the sum of exponentials is taken in another order, so the loss differs in its last
bits and a logit's gradient can round to its neighbour in bfloat16 (tests/test_loss.py states the
tolerance). A target outside the vocabulary (other than ignore_index) fails the device, as in
transformers' kernel (an assertion on the GPU; on a CPU, in the tests, a RuntimeError).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from symbiont.client.loss import outside_vocabulary, refuse_second_derivative

BLOCK = 4096  # vocabulary entries a program reads at once


@triton.jit
def _forward_kernel(x_ptr, target_ptr, lse_ptr, loss_ptr, vocab, stride, ignore_index, BLOCK: tl.constexpr):
    # grid: (rows,); program r: row r's log-sum-exp and its loss (0 for an ignored row)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    m = -3.4028234663852886e38  # (float32's lowest, not -inf: a first block all -inf would make exp(-inf + inf))
    s = 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(target_ptr + row)
    valid = (t >= 0) & (t < vocab)
    x_t = tl.load(base + tl.where(valid, t, 0)).to(tl.float32)
    loss = tl.where(valid, lse - x_t, float("nan"))
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(t == ignore_index, 0.0, loss))


@triton.jit
def _backward_kernel(x_ptr, target_ptr, lse_ptr, grad_ptr, scale_ptr, out_ptr, vocab, stride, out_stride,
                     ignore_index, BLOCK: tl.constexpr):
    # grid: (rows, cdiv(vocab, BLOCK)); program (r, b): row r's gradient over columns [b * BLOCK, (b + 1) * BLOCK)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    t = tl.load(target_ptr + row)
    g = tl.load(grad_ptr).to(tl.float32) * tl.load(scale_ptr)
    g = tl.where(t == ignore_index, 0.0, g)
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(x - tl.load(lse_ptr + row))
    d = tl.where(cols == t, p - 1.0, p) * g
    tl.store(out_ptr + row * out_stride + cols, d.to(out_ptr.dtype.element_ty), mask=mask)


class FusedCrossEntropy(torch.autograd.Function):
    """cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction) for
    CUDA logits [rows, vocab] (float32, float16 or bfloat16, columns contiguous) and int64
    target [rows]; keeps the logits and one float32 a row for the backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"the fused loss reduces by 'mean' or 'sum', got {reduction!r}")
        rows, vocab = logits.shape
        target = target.to(logits.device).contiguous()
        # a label outside the vocabulary fails the device as transformers' loss does (no host sync;
        # on a CPU, at once), instead of training on a NaN loss's finite gradient
        torch._assert_async(~outside_vocabulary(target, ignore_index, vocab).any(),
                            "the fused loss: a label outside the vocabulary (and not ignore_index)")
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        per_row = torch.empty(rows, dtype=torch.float32, device=logits.device)
        with _on(logits):
            _forward_kernel[(rows,)](logits, target, lse, per_row, vocab, logits.stride(0), ignore_index,
                                     BLOCK=BLOCK, num_warps=8)
        loss = per_row.sum()
        if reduction == "mean":  # (no row counted: 0 / 0, NaN, as nll_loss gives)
            counted = (target != ignore_index).sum().float()
            loss, scale = loss / counted, 1.0 / counted
        else:
            scale = torch.ones((), dtype=torch.float32, device=logits.device)
        ctx.save_for_backward(logits, target, lse, scale)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_derivative("fused")
        logits, target, lse, scale = ctx.saved_tensors
        rows, vocab = logits.shape
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
        with _on(logits):
            _backward_kernel[(rows, triton.cdiv(vocab, BLOCK))](logits, target, lse, grad.contiguous(), scale, out, vocab,
                                                                logits.stride(0), out.stride(0), ctx.ignore_index,
                                                                BLOCK=BLOCK, num_warps=8)
        return out, None, None, None


def _on(t: torch.Tensor):
    """Triton launches on the current device: t's (a CPU tensor: Triton's interpreter, in the tests)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def usable(logits: torch.Tensor) -> bool:
    """Whether these logits [rows, vocab] can take the fused loss."""
    return (logits.is_cuda and logits.dtype in (torch.float32, torch.float16, torch.bfloat16) and logits.dim() == 2
            and logits.shape[0] > 0 and logits.stride(1) == 1)
