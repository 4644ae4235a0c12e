"""What both sides take for a layer span: one call from a decoder layer's attention output to the
next layer's q/k/v, served by `base-executor serve --layer-spans`.

A span of layer i takes [a, r, d1, d2, d3] per token: the attention output a (o_proj's input),
the layer's residual r (its input) and d, what the tenant's own o_proj adapter adds (zeros without
one), in float32 as three pieces of the served dtype whose float32 sum is d (split_delta: PEFT adds
a float32 adapter's delta to the base output before rounding once). It computes, with the layer's
own modules,

    o = (o_proj(a) + d in float32, rounded);  h = r + o;  n2 = post_attention_layernorm(h);  m = mlp(n2);  h2 = h + m
    n1 = next input_layernorm(h2);  qkv = next layer's q/k/v group(n1)      (not for the last layer)

and returns [o, n2, m, n1, qkv] side by side (PIECES, in this order). The tenant runs its
attention and adapters, takes o, n2 and m where its layer asks for them, and hands n1 and q/k/v to
the next layer: one call a layer instead of three (q/k/v, o_proj, the MLP), and the norms done by
the executor. Decoder layers of these classes only (their own forward, Llama's order of ops)."""
from __future__ import annotations

from symbiont.proto.fingerprint import fingerprint

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


def widths(hidden: int, attn: int, qkv: int) -> tuple[int, int, list[int]]:
    """A span's input width, output width and the widths of its output's pieces [o, n2, m, n1,
    qkv] (the last layer's: [o, n2, m]); attn: o_proj's input width, qkv: 0 for the last layer."""
    pieces = [hidden, hidden, hidden] + ([hidden, qkv] if qkv else [])
    return attn + 4 * hidden, sum(pieces), pieces


def norms_print(norms) -> str:
    """What a span unit's fingerprint says of the norms it computes with (the post-attention norm,
    then the next layer's input norm): their weights' fingerprints and epsilons. A tenant's span
    stands for its layer only where its own norms print the same."""
    return "norms:" + ",".join(f"{fingerprint(n.weight.detach())}@{n.variance_epsilon!r}" for n in norms)


def split_delta(d, dtype):
    """float32 d as three tensors of `dtype` (bfloat16 or float32) whose float32 sum, (d1 + d2) +
    d3, is d exactly: each piece takes the next 8 (bfloat16) significant bits of what is left,
    which float32 holds exactly (normal numbers; bfloat16 keeps float32's exponents)."""
    d1 = d.to(dtype)
    rest = d - d1.float()
    d2 = rest.to(dtype)
    return d1, d2, (rest - d2.float()).to(dtype)


def join_delta(d1, d2, d3):
    return (d1.float() + d2.float()) + d3.float()
