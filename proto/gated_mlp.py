"""What both sides take for a gated MLP block, served whole as one MLP unit: a transformers module
of one of these classes (its own forward, not a subclass's), computing
down_proj(act(gate(x)) * up(x)), with gate and up two Linears (gate_proj, up_proj) or one whose
output is gate's columns then up's (Phi-3's gate_up_proj). The executor serves one only after a
probe at load shows its unit computing what the block does (base_executor/catalog.py); a tenant
calls it whole only while none of the block's Linears has an adapter (client/whole_mlp.py)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a gated MLP block keeps its parts."""

    linears: tuple[str, ...]
    """The Linears' child names: gate's and up's (or the one of both), then down's."""
    act: str
    """The attribute that holds the activation."""


SPLIT = Layout(("gate_proj", "up_proj", "down_proj"), "act_fn")
FUSED = Layout(("gate_up_proj", "down_proj"), "activation_fn")
GATED_MLPS = {
    **dict.fromkeys(("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP"), SPLIT),
    "Phi3MLP": FUSED,
}


def layout(module) -> Layout | None:
    """The layout of a gated MLP block this can serve whole; None for any other module."""
    cls = type(module)
    found = GATED_MLPS.get(cls.__name__)
    if found is None or cls.forward.__qualname__ != f"{cls.__name__}.forward" or not callable(getattr(module, found.act, None)):
        return None
    return found
