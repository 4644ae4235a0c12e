"""What both sides take for a layer span: one call from a decoder layer's attention output to the
next layer's q/k/v, served by `base-executor serve` (unless `--no-layer-spans`).

A span of layer i takes [a, r, d, w2, w1] per token: the attention output a (o_proj's input), the
layer's residual r (its input), d, what the tenant's own o_proj adapter adds (zeros without one),
in float32, its bits carried as columns of the served dtype (delta_bits: PEFT adds a float32
adapter's delta to the base output before rounding once), and the weights of
the tenant's two norms as they are now (w2 its post-attention norm's, w1 the next layer's input
norm's; the last layer's span takes w2 alone). So the executor computes the norms with the
tenant's own weights, whatever they are (trained, or changed in place), each row with its own.
It computes, with the layer's own modules (the norms with the weights carried),

    o = (o_proj(a) + d in float32, rounded);  h = r + o;  n2 = post_attention_layernorm(h);  m = mlp(n2);  h2 = h + m
    n1 = next input_layernorm(h2);  qkv = next layer's q/k/v group(n1)      (not for the last layer)

and returns [o, n2, m, n1, qkv] side by side (PIECES, in this order). The tenant runs its
attention and adapters, takes o, n2 and m where its layer asks for them, and hands n1 and q/k/v to
the next layer: one call a layer instead of three (q/k/v, o_proj, the MLP), and the norms done by
the executor. Decoder layers of these classes only (their own forward, Llama's order of ops)."""
from __future__ import annotations

import torch

DECODERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention")  # (o_proj is the last thing they do)
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
QKV = "self_attn.{q_proj,k_proj,v_proj}"  # the next layer's q/k/v group unit, under its path
O_PROJ, MLP = "self_attn.o_proj", "mlp"
INPUT_NORM, POST_NORM = "input_layernorm", "post_attention_layernorm"


def span_id(layer: str) -> str:
    """The span unit of the decoder layer at `layer` (its module path)."""
    return f"{layer}.span"


def own(module, names: tuple[str, ...]) -> bool:
    """Whether `module`'s class is one of `names`, with that class's own forward; past the classes
    of ours a tenant's module is made an instance of (a FusionScope's, a layer span's parts')."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("symbiont."):
            return cls.__name__ in names and cls.forward.__qualname__ == f"{cls.__name__}.forward"
    return False


def widths(hidden: int, attn: int, qkv: int, dtype: torch.dtype) -> tuple[int, int, list[int]]:
    """A span's input width, output width and the widths of its output's pieces [o, n2, m, n1,
    qkv] (the last layer's: [o, n2, m]); attn: o_proj's input width, qkv: 0 for the last layer,
    dtype: the served one."""
    pieces = [hidden, hidden, hidden] + ([hidden, qkv] if qkv else [])
    return attn + hidden + delta_width(hidden, dtype) + (2 if qkv else 1) * hidden, sum(pieces), pieces


LAYOUT = "delta-bytes"
"""The span call's input layout, named in the span unit's fingerprint: a client of another layout
(before 2026-11-27: the delta in three pieces) finds no span it knows, and its layers make their
own calls."""


def norms_print(norms) -> str:
    """What a span unit's fingerprint ends with: the call's layout, and what it says of the norms it
    computes with (the post-attention norm, then the next layer's input norm): their epsilons (their
    weights come with each call). A tenant's span stands for its layer only where its own norms
    print the same."""
    return f"{LAYOUT};norms:" + ",".join(f"{n.variance_epsilon!r}" for n in norms)


def norm(module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMS norm of x's rows as `module` (one of NORMS) computes it, with `weight` in place of its
    own: one weight row per row of x (the tenant's, carried by the call). The same ops as those
    classes' forward; the executor serves a span only where norm_matches says so."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return weight * h.to(x.dtype)


def norm_matches(module, dtype: torch.dtype, device=None) -> bool:
    """Whether norm() is bitwise `module`'s own forward in `dtype` (a probe of random rows and
    weights, the module's weight set to them: a transformers version whose norm computes otherwise
    gets no spans)."""
    import copy

    gen = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(module).to(device=device, dtype=dtype).requires_grad_(False)
    width = probe.weight.shape[-1]
    x = (3 * torch.randn(8, width, generator=gen)).to(device=device, dtype=dtype)
    w = torch.randn(width, generator=gen).to(device=device, dtype=dtype)
    with torch.no_grad():
        probe.weight.copy_(w)
        return torch.equal(probe(x), norm(probe, x, w.expand(8, width)))


def delta_width(hidden: int, dtype: torch.dtype) -> int:
    """How many columns of `dtype` carry a float32 delta `hidden` wide (delta_bits)."""
    return hidden * 4 // dtype.itemsize


def delta_bits(d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 d [rows, hidden] as [rows, delta_width] of `dtype`: the same bytes, read as that
    type (no arithmetic: every value comes back bit for bit, subnormals and NaNs too; the copies on
    the way move bytes)."""
    return d.contiguous().view(dtype)


def delta_of(bits: torch.Tensor) -> torch.Tensor:
    """The float32 d that delta_bits carried in `bits` (a column slice of a call's input)."""
    bits, per_value = bits.contiguous(), 4 // bits.element_size()
    if bits.storage_offset() % per_value or any(st % per_value for st in bits.stride()[:-1]):
        bits = bits.clone(memory_format=torch.contiguous_format)  # (a slice at an odd place of an odd-width row, which one row leaves as it is)
    return bits.view(torch.float32)
