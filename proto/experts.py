"""Mixture-of-experts weights served one Linear unit per expert: what both sides agree on.

transformers 5 keeps a MoE block's experts as 3-D parameters of one module (Mixtral's
`experts.gate_up_proj` [experts, 2 * intermediate, hidden] and `experts.down_proj`), whose eager
forward routes each token and computes `F.linear(x, gate_up_proj[e])` per expert hit. The executor
serves expert e of parameter P as the Linear unit `{module path}.{P's name}.{e}` (its weight the
view P[e]); the tenant runs the block's eager forward itself, routing included, with P[e]'s
F.linear becoming that unit's call.
"""
from __future__ import annotations


def expert_params(module) -> list[str]:
    """The names of `module`'s 3-D expert weights that can be served so: a transformers experts
    class (its forward wrapped by `use_experts_implementation`, the eager one kept as
    `__wrapped__`) whose weights are [experts, out, in] (not transposed) without biases."""
    forward = getattr(type(module), "forward", None)
    if getattr(forward, "__wrapped__", None) is None or not hasattr(module, "is_transposed"):
        return []
    if module.is_transposed or getattr(module, "has_bias", False):
        return []
    return [n for n, p in module.named_parameters(recurse=False) if p is not None and p.dim() == 3]


def expert_unit(path: str, name: str, expert: int) -> str:
    return f"{path}.{name}.{expert}" if path else f"{name}.{expert}"
