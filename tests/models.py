"""Shared test helpers: the architectures under test, their LoRA targets, deterministic inputs."""
from __future__ import annotations

import torch

from symbiont.base_executor.models import build_builtin

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2", "tiny-gpt2", "tiny-phi3"]
LORA_TARGETS = {
    "tiny-llama": ["q_proj", "v_proj"],
    "tiny-llama-lazy": ["q_proj", "v_proj"],
    "tiny-qwen2": ["q_proj", "v_proj"],
    "tiny-mistral": ["q_proj", "v_proj"],
    "tiny-gemma2": ["q_proj", "v_proj"],
    "tiny-gpt2": ["c_attn"],
    "tiny-phi3": ["qkv_proj"],
}


def ids(batch: int = 2, seq: int = 12, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, seq), generator=g)


def span_batch(unit, rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A layer span unit's input (proto/layer_span.py) of `rows` random rows: [a, r, d, w2, w1],
    d a small float32 delta carried as its bits."""
    from symbiont.proto.layer_span import delta_bits, delta_width

    hidden, a_width = unit.members[0].out_features, unit.members[0].in_features
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, unit.in_features, generator=g).to(dtype)
    x[:, a_width + hidden:a_width + hidden + delta_width(hidden, dtype)] = delta_bits(
        0.01 * torch.randn(rows, hidden, generator=g), dtype)
    return x


def lora_model(name: str, seed: int = 1, base=None):
    """build_builtin(name) (or `base`) wrapped in PEFT LoRA with random A and B (B != 0 so
    every adapter weight gets a gradient from the first step)."""
    from peft import LoraConfig, get_peft_model

    base = build_builtin(name) if base is None else base
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA_TARGETS[name], init_lora_weights=False,
        fan_in_fan_out=name == "tiny-gpt2", lora_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(base, config)


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def assert_grads_close(ref: dict, got: dict, rtol: float = 1e-5) -> None:
    assert ref.keys() == got.keys() and ref, f"adapter parameters differ: {sorted(ref)} vs {sorted(got)}"
    for name in ref:
        err = (ref[name] - got[name]).norm().item()
        scale = ref[name].norm().item()
        assert scale > 0, f"{name} has a zero gradient: the test would not see a difference"
        assert err <= rtol * scale, f"{name}: |diff| {err:.3e} > {rtol} x |grad| {scale:.3e}"


def assert_backward_matches(ref, virt, x: torch.Tensor, rtol: float = 1e-5) -> None:
    """One language-model backward of the unsplit `ref` and the virtualized `virt` on x: their
    adapter gradients agree within rtol."""
    for m in (ref, virt):
        m(input_ids=x, labels=x).loss.backward()
    assert_grads_close(lora_grads(ref), lora_grads(virt), rtol=rtol)


def assert_sgd_steps_match(ref, virt, x: torch.Tensor, steps: int = 2) -> None:
    """SGD steps of the unsplit `ref` and the virtualized `virt` on x, side by side: after each
    backward their adapter gradients agree (from the second step on, after an update)."""
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (ref, virt)]
    for _ in range(steps):
        for m, opt in zip((ref, virt), opts):
            opt.zero_grad()
            m(input_ids=x, labels=x).loss.backward()
        assert_grads_close(lora_grads(ref), lora_grads(virt))
        for opt in opts:
            opt.step()


def enable_checkpointing(model, reentrant: bool) -> None:
    """Training mode with gradient checkpointing (the reentrant kind needs inputs that require grad)."""
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()


def check_gang_lora(device: torch.device, dtype: torch.dtype) -> None:
    """kernels/gang_lora.py against adapters.Delta.add_to: slots of two rows with adapters of ranks
    8, 0, 37 (several rank blocks and programs) and 16 in `dtype`, the third slot sitting out (its
    adapter in the table, not read), rows of a strided x, the result written into columns of a
    wider y; then four parts at once (more than one launch takes), of other widths and columns, one
    slot without an adapter at one of them: each taking-part slot's rows get Delta.add_to's term
    within float rounding (the sums in another order: a rounding of the adapter's dtype), every
    other element of y as it was."""
    from symbiont.base_executor.adapters import MAX_RANK, Delta
    from symbiont.base_executor.kernels import gang_lora
    from symbiont.proto import executor_pb2 as pb

    g = torch.Generator().manual_seed(0)
    slots, rows, k = 4, 2, 96
    ranks = [[(8, 0.5), (0, 1.0), (37, -2.0), (16, 1.5)], [(3, 1.0), (130, 0.25), (1, -1.0), (0, 1.0)],
             [(21, 2.0), (5, 1.0), (64, 0.5), (9, -0.5)], [(2, 1.0), (2, 1.0), (40, 1.0), (7, 3.0)]]
    places = [(7, 200), (230, 33), (263, 130), (400, 64)]  # (first column in y, width) of each part
    deltas = [[Delta((0.2 * torch.randn(r, k, generator=g)).to(device, dtype),
                     (0.2 * torch.randn(n, r, generator=g)).to(device, dtype), s) for r, s in part]
              for part, (_, n) in zip(ranks, places)]
    x = torch.randn(slots * rows, k + 10, generator=g).to(device, dtype)[:, 5:5 + k]
    y = torch.randn(slots * rows, 480, generator=g).to(device, dtype)
    table = torch.tensor([[0] * 3 + [v for part in deltas for v in gang_lora.entry(part[s].a, part[s].b, part[s].scale)]
                          for s in range(slots)], dtype=torch.int64, device=device)
    seqs = torch.tensor([1, 1, 0, 3], dtype=torch.int32, device=device)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    t = torch.zeros(slots * rows, gang_lora.MAX_PARTS * MAX_RANK, device=device)
    for n_parts in (1, 4):
        want = y.clone()
        for part, (first, n) in zip(deltas[:n_parts], places):
            for s, d in enumerate(part):
                if seqs[s] and d.a.shape[0]:
                    d.add_to(pb.FORWARD, x[s * rows:(s + 1) * rows], want[s * rows:(s + 1) * rows, first:first + n])
        got = y.clone()
        gang_lora.add(x, got, places[:n_parts], table, 3, seqs, rows, t, dtype)
        torch.testing.assert_close(got, want, **tol)
        assert not torch.allclose(got[6:], y[6:]), "slot 3's adapter was not added"
        assert torch.equal(got[4:6], y[4:6]) and torch.equal(got[:, :7], y[:, :7]), "a slot sitting out got a delta"
        if n_parts == 1:
            assert torch.equal(got[2:4], y[2:4]) and torch.equal(got[:, 207:], y[:, 207:])
        else:
            assert torch.equal(got[:, 393:400], y[:, 393:400]) and torch.equal(got[:, 464:], y[:, 464:])
            assert not torch.allclose(got[:, 400:464], y[:, 400:464]), "the fourth part (a second launch) was not added"
