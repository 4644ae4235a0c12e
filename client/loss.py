"""A causal LM's loss in row chunks: what transformers' ForCausalLMLoss computes, bit for bit,
without its full-vocabulary float32 tensors.

transformers' loss upcasts the logits to float32 and takes cross_entropy over them, which keeps
the float32 log-softmax (tokens x vocabulary: 501 MiB at 2 x 512 tokens of a 128k vocabulary) for
the backward, beside a float32 copy of the logits while it runs and float32 gradients of both in
the backward. With the frozen weights at the executor, that is most of what a fine-tuning
tenant holds beyond its activations (benchmarks/RESULTS.md, "Memory per tenant"). Here the
log-softmax is taken a chunk of rows at a time, forward and again in the backward, and only the
logits (which the model returns anyway) are kept: every row's log-softmax, the loss's reduction
over the rows and every gradient element are the same kernels on the same values as the
unchunked loss, so the loss and the logits' gradient are identical.

virtualize() installs it as the model's `loss_function` where that is transformers'
ForCausalLMLoss (not while torch.compile traces: the compiler fuses the unchunked loss itself):
by default as fused_causal_lm_loss, which on a GPU takes the loss in client/fused_loss.py's two
kernels instead (less memory traffic; equal within float32 rounding, not bit for bit), and these
chunks elsewhere. Neither has a second derivative: a backward with create_graph raises.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

CHOICES = ("fused", "chunked", "transformers")  # virtualize(..., lm_loss=)
CHUNK_BYTES = 64 << 20  # one chunk's float32 log-softmax
_REDUCTIONS = {"mean": 1, "sum": 2}  # (ATen's Reduction enum)


def outside_vocabulary(target: torch.Tensor, ignore_index: int, vocab: int) -> torch.Tensor:
    """Which labels are neither in [0, vocab) nor ignore_index (bool, target's shape)."""
    return (target != ignore_index) & ((target < 0) | (target >= vocab))


def refuse_second_derivative(which: str) -> None:
    """In a loss's backward: raises where it is asked for a graph of itself (create_graph)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"the {which} loss has no second derivative: virtualize(..., lm_loss='transformers') for "
                           "transformers' loss, or set model.loss_function")


class ChunkedCrossEntropy(torch.autograd.Function):
    """cross_entropy(logits.float(), target, ignore_index, reduction) over rows in chunks, keeping
    only `logits` for the backward. logits: [rows, vocab] (any float dtype); target: [rows] int64."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str):
        if logits.device.type == "cpu":  # (transformers' error; on a GPU a bad label fails the device as there)
            bad = outside_vocabulary(target, ignore_index, logits.shape[1])
            if bad.any():
                raise IndexError(f"Target {int(target[bad][0])} is out of bounds.")
        # rows a chunk: a multiple of 4, so every row of a chunk lies at the same offset modulo 16
        # bytes as in one float32 [rows, vocab] (CUDA's log_softmax splits a row's sum by it)
        rows = max(4, CHUNK_BYTES // (4 * logits.shape[1]) // 4 * 4)
        picked = torch.empty(logits.shape[0], 1, dtype=torch.float32, device=logits.device)  # [rows, 1]: log p(target)
        ignored = target == ignore_index
        safe = torch.where(ignored, 0, target).unsqueeze(1)  # (an ignored row's: any column; nll skips it)
        for s in range(0, logits.shape[0], rows):
            torch.gather(torch.log_softmax(logits[s : s + rows].float(), -1), 1, safe[s : s + rows], out=picked[s : s + rows])
        # the reduction nll_loss makes over [rows, vocab] is over the rows' picked values alone
        column = torch.where(ignored, -1, 0)  # (-1: ignored, whatever ignore_index is)
        loss, total_weight = torch.ops.aten.nll_loss_forward(picked, column, None, _REDUCTIONS[reduction], -1)
        ctx.save_for_backward(logits, target, total_weight)
        ctx.rows, ctx.ignore_index, ctx.reduction = rows, ignore_index, _REDUCTIONS[reduction]
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_derivative("chunked")
        logits, target, total_weight = ctx.saved_tensors
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.rows):
            log_p = torch.log_softmax(logits[s : s + ctx.rows].float(), -1)
            g = torch.ops.aten.nll_loss_backward(grad, log_p, target[s : s + ctx.rows], None, ctx.reduction, ctx.ignore_index, total_weight)
            out[s : s + ctx.rows] = torch.ops.aten._log_softmax_backward_data(g, log_p, -1, torch.float32)  # (cast as .float()'s backward)
        return out, None, None, None


def causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100, shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss, its cross entropy in row chunks (module docstring)."""
    return _causal_lm_loss(False, logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)


def fused_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100, shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss, on a GPU in client/fused_loss.py's two kernels (the same
    function within float32 rounding), elsewhere in row chunks as causal_lm_loss."""
    return _causal_lm_loss(True, logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)


def _fused(logits: torch.Tensor):
    """client.fused_loss where it takes these logits [rows, vocab] (CUDA, Triton present), else None."""
    if not logits.is_cuda:
        return None
    try:
        from symbiont.client import fused_loss
    except ImportError:  # (no Triton)
        return None
    return fused_loss if fused_loss.usable(logits) else None


def _causal_lm_loss(fused: bool, logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs):
    if torch.compiler.is_compiling():
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    if shift_labels is None:  # tokens < n predict n
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    target = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    rows = logits.reshape(-1, vocab_size)
    kernels = _fused(rows) if fused else None
    loss = (kernels.FusedCrossEntropy if kernels else ChunkedCrossEntropy).apply(rows, target, ignore_index, reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def install(root, fused: bool = True) -> bool:
    """Makes fused_causal_lm_loss (`fused`) or causal_lm_loss the loss of `root` (a transformers
    model) where its loss is ForCausalLMLoss; says whether it did."""
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    # (transformers' own property: not a class that defines its loss, nor a module set as the loss)
    if inspect.getattr_static(type(root), "loss_function", None) is not PreTrainedModel.__dict__["loss_function"]:
        return False
    if "loss_function" in getattr(root, "_modules", {}):
        return False
    # as PreTrainedModel.loss_function finds it (an unknown or no loss type: ForCausalLMLoss), without its warning
    loss = root.__dict__.get("_loss_function") or LOSS_MAPPING.get(getattr(root, "loss_type", None) or "", ForCausalLMLoss)
    if loss is not ForCausalLMLoss:
        return False
    root.loss_function = fused_causal_lm_loss if fused else causal_lm_loss
    return True
