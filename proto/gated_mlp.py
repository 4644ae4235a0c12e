"""What both sides take for a gated MLP block, served whole as one MLP unit: a transformers module
of one of these classes (its own forward, not a subclass's), computing
down_proj(act_fn(gate_proj(x)) * up_proj(x)). The executor serves one only after a probe at load
shows its unit computing what the block does (base_executor/catalog.py); a tenant calls it whole
only while none of the block's Linears has an adapter (client/whole_mlp.py)."""

GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP"})
CHILDREN = ("gate_proj", "up_proj", "down_proj")


def is_gated_mlp(module) -> bool:
    cls = type(module)
    return cls.__name__ in GATED_MLPS and cls.forward.__qualname__ == f"{cls.__name__}.forward" and callable(
        getattr(module, "act_fn", None)
    )
