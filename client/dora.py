"""DoRA on units served by the executor.

PEFT's DoRA scales each output row of a LoRA-adapted Linear by magnitude / ||W_j + s (BA)_j||,
the norm taken over the row of the frozen weight plus the adapter's update. A shim holds no W, so
the norm comes from what the executor gives without W leaving it:

    ||W_j + s L_j||^2 = ||W_j||^2 + 2 s <W_j, L_j> + s^2 ||L_j||^2

- ||W_j||^2: the executor computes it once per unit (a `norms` control request), float32;
- <W_j, L_j>: the diagonal of L W^T, from FORWARD_NO_BIAS calls of the unit with L's rows as the
  tokens (d_out tokens, in blocks); L is the adapter's own update, the tenant's.

PEFT's DoraLinearLayer is left as it is for every layer whose base is not a shim; for a shim its
`update_layer` and `forward` run the same arithmetic with the norm computed as above. The norm is
exact in float32 up to rounding (the expansion, not the sum, is rounded), so DoRA's logits and
gradients match the unsplit model's within float32 rounding, not bitwise (tests/test_parity.py).
A unit with a bias is refused (DoRA subtracts the bias from the base output: its values would have
to leave the executor), as is an embedding.
"""
from __future__ import annotations

import torch

from symbiont.client.errors import ModelMismatchError
from symbiont.proto import executor_pb2 as pb

BLOCK_ROWS = 1024  # rows of L per FORWARD_NO_BIAS call: a call's result is [rows, d_out]


def install() -> None:
    """Makes PEFT's DoraLinearLayer work on shims (idempotent; a no-op without PEFT)."""
    try:
        from peft.tuners.lora.dora import DoraLinearLayer
    except ImportError:
        return
    if getattr(DoraLinearLayer, "_symbiont_dora", False):
        return
    update_layer, forward = DoraLinearLayer.update_layer, DoraLinearLayer.forward

    def update_layer_on_shims(self, *, base_layer, lora_A, lora_B, scaling, place_on_cpu=False):
        if not _is_shim(base_layer):
            return update_layer(self, base_layer=base_layer, lora_A=lora_A, lora_B=lora_B, scaling=scaling,
                                place_on_cpu=place_on_cpu)
        with torch.no_grad():
            norm = weight_norm(base_layer, lora_B.float() @ lora_A.float(), scaling)
        if place_on_cpu:
            norm = norm.to("cpu")
        self.weight = torch.nn.Parameter(norm.to(base_layer._dtype), requires_grad=True)  # (PEFT: the base weight's dtype)

    def forward_on_shims(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name="default"):
        if not _is_shim(base_layer):
            return forward(self, x, lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base_layer,
                           base_result=base_result, adapter_name=adapter_name)
        lora_weight = self.get_lora_weight(lora_A=lora_A, lora_B=lora_B, adapter_name=adapter_name).to(x.dtype)
        with torch.no_grad():  # (DoRA treats the norm as a constant: no gradient through it)
            norm = weight_norm(base_layer, lora_weight.detach(), scaling).to(x.dtype)
        mag_norm_scale = (self.weight / norm).view(1, -1)
        lora_result = lora_B(lora_A(x))
        if base_result is None:  # (x went through the adapter's dropout: the base output of that x)
            base_result = base_layer(x)
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling

    DoraLinearLayer.update_layer = update_layer_on_shims
    DoraLinearLayer.forward = forward_on_shims
    DoraLinearLayer._symbiont_dora = True


def _is_shim(module) -> bool:
    from symbiont.client.shim import VirtLayer

    if not isinstance(module, VirtLayer):
        return False
    if module._kind not in ("linear", "conv1d"):
        raise ModelMismatchError(f"DoRA on {module.unit_id!r}, a {module._kind} unit served by the executor: "
                                 "not supported (only linear units)")
    if getattr(module, "bias", None) is not None:
        raise ModelMismatchError(f"DoRA on {module.unit_id!r}, which has a bias: not supported through the executor "
                                 "(DoRA takes the bias off the base output, and its values stay with the executor)")
    return True


def weight_norm(shim, lora_weight: torch.Tensor, scaling: float) -> torch.Tensor:
    """||W_j + scaling L_j|| for every output row j of shim's unit, float32, on L's device.
    lora_weight: L, [d_out, d_in] (PEFT's orientation after its transpose)."""
    t = shim.transport
    squared = getattr(shim, "_dora_squared_norms", None)
    if squared is None:
        reply = t.control("norms", pb.NormsRequest(unit=shim.unit_id)).norms
        squared = shim._dora_squared_norms = torch.tensor(reply.squared, dtype=torch.float32)
    d_out = shim._d_out
    low = lora_weight.to(shim._dtype)
    dots = torch.empty(d_out, dtype=torch.float32, device=lora_weight.device)
    for a in range(0, d_out, BLOCK_ROWS):
        b = min(a + BLOCK_ROWS, d_out)
        y = t.call(shim.unit_id, pb.FORWARD_NO_BIAS, low[a:b], (b - a, d_out), shim._dtype, pb.TRAINING)
        dots[a:b] = y[:, a:b].diagonal().float()
    l2 = lora_weight.float().square().sum(dim=1)
    total = squared.to(lora_weight.device) + 2 * scaling * dots + scaling * scaling * l2
    return total.clamp_min(0).sqrt()
