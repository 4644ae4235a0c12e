"""The tenant's causal-LM loss: in row chunks (client/loss.py) the same loss and logits gradient as
transformers' ForCausalLMLoss, bit for bit, without a full-vocabulary float32 tensor kept; fused
(client/fused_loss.py, Triton; here in its interpreter) the same within float32 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from symbiont import virtualize
from symbiont.base_executor.models import build_builtin
from symbiont.client import fused_loss
from symbiont.client import loss as chunked


def _both(fn_a, fn_b, logits, *args, grad_scale=1.3, **kwargs):
    """(loss, logits.grad) of each loss function on its own leaf copy of logits."""
    out = []
    for fn in (fn_a, fn_b):
        x = logits.detach().clone().requires_grad_(True)
        value = fn(x, *args, **kwargs)
        value.backward(torch.tensor(grad_scale))
        out.append((value.detach(), x.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_chunked_cross_entropy_is_bitwise_cross_entropy(monkeypatch, dtype, reduction, ignore_index):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * 301 * 37)  # 36 rows a chunk: a ragged last chunk
    torch.manual_seed(0)
    logits = torch.randn(300, 301, dtype=dtype) * 4
    target = torch.randint(0, 301, (300,))
    target[::7] = ignore_index

    (a, ga), (b, gb) = _both(
        lambda x: F.cross_entropy(x.float(), target, ignore_index=ignore_index, reduction=reduction),
        lambda x: chunked.ChunkedCrossEntropy.apply(x, target, ignore_index, reduction),
        logits,
    )
    assert not a.isnan() and torch.equal(a, b) and torch.equal(ga, gb) and ga.dtype == dtype


def test_it_has_no_second_derivative():
    logits = torch.randn(8, 11, requires_grad=True)
    loss = chunked.ChunkedCrossEntropy.apply(logits, torch.randint(0, 11, (8,)), -100, "mean")
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, logits, create_graph=True)


def _assert_fused_close(a, ga, b, gb):
    """The fused loss (b, gb) against cross_entropy's (a, ga): the loss within float32 rounding of
    the sum's order, each gradient element within one step of its dtype (float32: 1e-5 relative;
    a subnormal value: one step of the subnormals, float16's 6e-8, which an H100 shows)."""
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    info = torch.finfo(ga.dtype)
    eps = 1e-5 if ga.dtype == torch.float32 else info.eps
    torch.testing.assert_close(gb, ga, rtol=eps, atol=info.smallest_normal * info.eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_fused_cross_entropy_is_cross_entropy_within_rounding(dtype, reduction, ignore_index):
    torch.manual_seed(4)
    vocab = fused_loss.BLOCK + 907  # (two blocks a row, the second ragged)
    logits = torch.randn(11, vocab, dtype=dtype) * 4
    target = torch.randint(0, vocab, (11,))
    target[::4] = ignore_index
    (a, ga), (b, gb) = _both(
        lambda x: F.cross_entropy(x.float(), target, ignore_index=ignore_index, reduction=reduction),
        lambda x: fused_loss.FusedCrossEntropy.apply(x, target, ignore_index, reduction),
        logits,
    )
    assert not a.isnan() and gb.dtype == dtype and b.dtype == torch.float32
    _assert_fused_close(a, ga, b, gb)
    assert not gb[::4].any()  # (ignored rows: no gradient)


def test_fused_cross_entropy_edges():
    logits = torch.randn(6, 50, dtype=torch.bfloat16)
    (a, ga), (b, gb) = _both(lambda x: F.cross_entropy(x.float(), torch.full((6,), -100), reduction="mean"),
                             lambda x: fused_loss.FusedCrossEntropy.apply(x, torch.full((6,), -100), -100, "mean"), logits)
    assert a.isnan() and b.isnan() and not gb.any()  # every row ignored: 0 / 0, as nll_loss
    for bad in (torch.tensor([3, 50, 7, 9, 1, 0]), torch.tensor([3, -1, 7, 9, 1, 0])):  # a target outside the vocabulary
        with pytest.raises(RuntimeError, match="label outside the vocabulary"):
            fused_loss.FusedCrossEntropy.apply(logits.float(), bad, -100, "sum")
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        fused_loss.FusedCrossEntropy.apply(logits.float(), torch.zeros(6, dtype=torch.long), -100, "none")
    # a row whose first block is all -inf (a masked vocabulary), and a strided target
    wide = torch.randn(4, fused_loss.BLOCK + 100)
    wide[:, : fused_loss.BLOCK] = -float("inf")
    target = torch.randint(fused_loss.BLOCK, fused_loss.BLOCK + 100, (8,))[::2]
    (a, ga), (b, gb) = _both(lambda x: F.cross_entropy(x, target), lambda x: fused_loss.FusedCrossEntropy.apply(x, target, -100, "mean"), wide)
    assert not a.isnan()
    _assert_fused_close(a, ga, b, gb)
    x = logits.float().requires_grad_(True)
    loss = fused_loss.FusedCrossEntropy.apply(x, torch.randint(0, 50, (6,)), -100, "mean")
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, x, create_graph=True)
    assert not fused_loss.usable(logits)  # (a CPU tensor: the exact chunks take it)


def _causal_lm_cases(seed: int):
    """(logits [3, 11, 97] bf16, labels, the loss's keyword arguments) for each way transformers
    calls a causal LM's loss: mean, num_items_in_batch as a tensor and an int, shift_labels given,
    another ignore_index."""
    torch.manual_seed(seed)
    logits = torch.randn(3, 11, 97, dtype=torch.bfloat16)
    labels = torch.randint(0, 97, (3, 11))
    labels[0, :4] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(17)}, {"num_items_in_batch": 9},
                   {"shift_labels": torch.roll(labels, -1, 1)}, {"ignore_index": 5}):
        yield logits, labels.clamp(min=0) if "ignore_index" in kwargs else labels, kwargs


def test_causal_lm_loss_is_transformers_loss(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * 97 * 5)
    for logits, labels, kwargs in _causal_lm_cases(1):
        (a, ga), (b, gb) = _both(ForCausalLMLoss, chunked.causal_lm_loss, logits, labels, 97, **kwargs)
        assert torch.equal(a, b) and torch.equal(ga, gb), kwargs
    for bad in (-100, 97):  # a label neither in the vocabulary nor the ignored one
        for fn in (ForCausalLMLoss, chunked.causal_lm_loss):
            with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
                fn(logits, torch.full_like(labels, bad), 97, ignore_index=5)
    # every label ignored: nan, as transformers gives, and zero gradients
    (a, ga), (b, gb) = _both(ForCausalLMLoss, chunked.causal_lm_loss, logits, torch.full_like(labels, -100), 97)
    assert a.isnan() and b.isnan() and torch.equal(ga, gb)


def test_fused_causal_lm_loss_through_the_kernels_is_transformers_loss(monkeypatch):
    assert chunked._fused(torch.randn(4, 97)) is None  # (a CPU's logits: the chunks)
    monkeypatch.setattr(chunked, "_fused", lambda logits: fused_loss)  # (here: the kernels in Triton's interpreter)
    for logits, labels, kwargs in _causal_lm_cases(6):
        (a, ga), (b, gb) = _both(ForCausalLMLoss, chunked.fused_causal_lm_loss, logits, labels, 97, **kwargs)
        _assert_fused_close(a, ga, b, gb)


def test_it_keeps_no_full_vocabulary_float32_tensor():
    logits = torch.randn(64, 500, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 500, (1, 64))
    for fn, keeps_float32 in ((ForCausalLMLoss, True), (chunked.causal_lm_loss, False)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
            fn(logits.view(1, 64, 500), labels, 500)
        assert any(d == torch.float32 and n >= 500 for d, n in saved) == keeps_float32, saved


def test_virtualize_installs_it_and_training_stays_exact(executor, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * 256 * 8)  # 8 rows a chunk: 32 tokens in 4 chunks
    torch.manual_seed(2)
    x = torch.randint(1, 256, (2, 16))
    ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), executor.url)
    # (fused by default: on a CPU it takes the exact chunks)
    assert virt.loss_function is chunked.fused_causal_lm_loss and ref.loss_function is ForCausalLMLoss
    for m in (ref, virt):  # a trainable part of the tenant's own: the final norm
        m.requires_grad_(False)
        m.model.norm.weight.requires_grad_(True)
    a, b = ref(x, labels=x), virt(x, labels=x)
    a.loss.backward()
    b.loss.backward()
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits)
    assert torch.equal(ref.model.norm.weight.grad, virt.model.norm.weight.grad)


def test_a_model_with_another_loss_keeps_it(executor):
    model = build_builtin("tiny-llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    mine = model.loss_function
    assert virtualize(model, executor.url).loss_function is mine

    class OwnLoss(type(build_builtin("tiny-llama"))):  # (a class that defines its loss: a method)
        def loss_function(self, logits, labels, vocab_size, **kwargs):
            return logits.float().sum()

    model = build_builtin("tiny-llama")
    model.__class__ = OwnLoss
    assert not chunked.install(model) and virtualize(model, executor.url).loss_function.__func__ is OwnLoss.loss_function
    model = build_builtin("tiny-llama")
    model.loss_function = torch.nn.CrossEntropyLoss()  # (a module set as the loss)
    assert not chunked.install(model)
    virt = virtualize(build_builtin("tiny-llama"), executor.url, lm_loss="transformers")
    assert virt.loss_function is ForCausalLMLoss
    assert virtualize(build_builtin("tiny-llama"), executor.url, lm_loss="chunked").loss_function is chunked.causal_lm_loss
    from symbiont import connect

    conn = connect(executor.url)  # (a model built from the skeleton takes it too)
    assert conn.model(lm_loss="transformers").loss_function is ForCausalLMLoss
    conn.close()
    model = build_builtin("tiny-llama")
    with pytest.raises(ValueError, match="lm_loss must be one of"):
        virtualize(model, executor.url, lm_loss="fast")
    assert model.loss_function is ForCausalLMLoss  # (unchanged)


def _cross_entropy_of(target, reduction):
    return lambda x: F.cross_entropy(x.float(), target, ignore_index=-100, reduction=reduction)


def _on_a_gpu(logits, *losses):
    """Each loss's (value, logits.grad) on its own copy of the GPU's logits, and its allocator peak
    over them, forward and backward."""
    results, peaks = [], []
    for fn in losses:
        x = logits.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        value = fn(x)
        value.backward(torch.tensor(1.3, device=logits.device))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append((value.detach(), x.grad))
        del x, value
    return results, peaks


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("vocab", [128256, 50257])
def test_on_a_gpu_bitwise_and_a_full_vocabulary_less(monkeypatch, reduction, vocab):
    # S2's shapes: 2 x 512 tokens of llama's 128,256-token vocabulary, bfloat16 logits; and GPT-2's
    # 50,257, whose rows lie at every offset modulo 16 bytes, in chunks of 12 rows
    if vocab % 4:
        monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * vocab * 13)
    dev = torch.device("cuda")
    torch.manual_seed(3)
    logits = torch.randn(1024, vocab, dtype=torch.bfloat16, device=dev) * 4
    target = torch.randint(0, vocab, (1024,), device=dev)
    target[::9] = -100
    results, peaks = _on_a_gpu(logits, _cross_entropy_of(target, reduction),
                               lambda x: chunked.ChunkedCrossEntropy.apply(x, target, -100, reduction))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b) and torch.equal(ga, gb)
    full = 1024 * vocab * 4  # one float32 [tokens, vocabulary]
    assert peaks[1] < peaks[0] - full, [p / 2**20 for p in peaks]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("vocab", [128256, 50257])
def test_on_a_gpu_fused_within_rounding_and_less_memory_than_the_chunks(dtype, reduction, vocab):
    dev = torch.device("cuda")
    torch.manual_seed(5)
    logits = torch.randn(1024, vocab, dtype=dtype, device=dev) * 4
    target = torch.randint(0, vocab, (1024,), device=dev)
    target[::9] = -100
    results, peaks = _on_a_gpu(logits, _cross_entropy_of(target, reduction),
                               lambda x: chunked.ChunkedCrossEntropy.apply(x, target, -100, reduction),
                               lambda x: fused_loss.FusedCrossEntropy.apply(x, target, -100, reduction))
    (a, ga), _, (b, gb) = results
    _assert_fused_close(a, ga, b, gb)
    grad = logits.numel() * logits.element_size()  # the logits' gradient: all the fused loss holds besides a float a row
    assert peaks[2] < grad + (8 << 20) < peaks[1], [p / 2**20 for p in peaks]  # (float32 on an H100: grad + 1.005 MiB)
