"""S9's registered adapters: adapter k of a model, made the same wherever it is made (the runner
registers it with the executor; a private tenant loads the same weights into its PEFT model).

Adapter k is LoRA on q_proj and v_proj of every layer (or on the attention projections named), rank
RANKS[k % 5], scale 2 (lora_alpha = 2 r), A and B seeded by k (both non-zero, so a merge changes the
weights; on q and v alone, the default, the weights every S9 run before 2026-11-28 had)."""
from __future__ import annotations

import torch

RANKS = (8, 16, 32, 64, 128)
TARGETS = ("q_proj", "v_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def rank_of(k: int) -> int:
    return RANKS[k % len(RANKS)]


def check_targets(targets) -> None:
    """Raises ValueError naming any target S9 makes no adapter for (it makes them on ATTENTION)."""
    unknown = sorted(set(targets) - set(ATTENTION))
    if unknown:
        raise ValueError(f"S9 adapters go on {', '.join(ATTENTION)}; not on {', '.join(unknown)}")


def adapter_weights(config, k: int, dtype=torch.bfloat16, targets=TARGETS) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{unit path: (A [r, in], B [out, r], scale)} of adapter k for a Llama-like config, on `targets`
    (of ATTENTION)."""
    check_targets(targets)
    r = rank_of(k)
    g = torch.Generator().manual_seed(1_000_003 * (k + 1))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"q_proj": (config.hidden_size, heads), "k_proj": (config.hidden_size, kv),  # (in, out)
              "v_proj": (config.hidden_size, kv), "o_proj": (heads, config.hidden_size)}
    order = [t for t in ATTENTION if t in targets]  # (q before v, as TARGETS: the default's draws as ever)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for target in order:
            n_in, n_out = shapes[target]
            a = torch.randn(r, n_in, generator=g) / n_in**0.5
            b = torch.randn(n_out, r, generator=g) * 0.01
            weights[f"model.layers.{layer}.self_attn.{target}"] = (a.to(dtype), b.to(dtype), 2.0)
    return weights


def as_proto(weights) -> list:
    """The weights as the provider's HostAdapterRequest carries them."""
    from symbiont.proto import executor_pb2 as pb
    from symbiont.proto.codec import dtype_enum

    out = []
    for unit, (a, b, scale) in weights.items():
        out.append(pb.AdapterWeight(unit=unit, rank=a.shape[0], dtype=dtype_enum(a.dtype), scale=scale,
                                    a=a.contiguous().view(torch.uint8).numpy().tobytes(),
                                    b=b.contiguous().view(torch.uint8).numpy().tobytes()))
    return out


def load_into(peft_model, weights) -> None:
    """Copies adapter weights into a PEFT model's `default` LoRA layers (made with the same ranks)."""
    done = 0
    for name, module in peft_model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        unit = name.split("base_model.model.", 1)[-1]
        a, b, _ = weights[unit]
        with torch.no_grad():
            module.lora_A["default"].weight.copy_(a)
            module.lora_B["default"].weight.copy_(b)
        done += 1
    if done != len(weights):
        raise ValueError(f"loaded {done} LoRA layers of {len(weights)}")


def zipf_choice(n_tenants: int, registered: int, s: float, seed: int = 0) -> list[int]:
    """Each tenant's adapter: drawn with probability proportional to 1 / (rank of popularity)^s."""
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([1.0 / (i + 1) ** s for i in range(registered)])
    return torch.multinomial(p / p.sum(), n_tenants, replacement=True, generator=g).tolist()


def skewed_choice(n_tenants: int, registered: int, top_share: float) -> list[int]:
    """round(top_share N) tenants name adapter 0, the others one each of the rest, in turn."""
    top = round(top_share * n_tenants)
    return [0] * top + [1 + i % max(registered - 1, 1) for i in range(n_tenants - top)]
