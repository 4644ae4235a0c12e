"""Whole-MLP calls: one remote call for a gated MLP block (proto/gated_mlp.py) while none of its
Linears has an adapter, instead of one for gate/up and one for down.

The executor advertises an MLP unit per gated block it serves. virtualize() makes each such block
of the tenant's model an instance of a subclass of its class whose forward calls the unit; its
Linears' shims (gate/up/down, or Phi-3's gate_up/down) stay its children, so PEFT still finds and
wraps them. The moment one of them is wrapped (an adapter), hooked, or its activation replaced,
the block runs its own forward again: one call per (fused) Linear. While torch.compile traces, the whole call is the custom op
`symbiont::unit_call` on the MLP unit (client/shim.py), so a compiled block is one call too.
Forward is the block's own ops at the executor. Backward sends the block's input beside grad_y,
and the executor recomputes the block (it keeps nothing between calls); the tenant keeps only the
input, where the unsplit block keeps its gate, up and activation outputs.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from symbiont.client.shim import UnitRef, VirtLayer, VirtOwnForward, _SHIMS, handed, records, traced_call, tracing
from symbiont.proto import executor_pb2 as pb
from symbiont.proto import gated_mlp


class MlpUnit(UnitRef):
    """The MLP unit of one block, and the shims of the block's Linears that it stands for."""

    def __init__(self, unit: pb.UnitInfo, members: tuple[VirtLayer, ...], layout: gated_mlp.Layout, act):
        self.unit_id = unit.id
        self.transport = members[0].transport
        self._kind = unit.kind
        self._d_in, self._d_out = unit.in_features, unit.out_features
        self._dtype = members[0]._dtype
        self.members = members  # the shims of layout.linears
        self.layout = layout
        self.act = act  # the block's activation when it was virtualized (the executor probed its own)
        self._register()

    def _out_shape(self, shape, op) -> tuple[int, ...]:
        return tuple(shape[:-1]) + (self._d_out,)  # (BACKWARD: [x, grad_y] in, grad_x out)

    def serves(self, block: nn.Module, x: torch.Tensor) -> bool:
        """Whether a call of the whole block stands for block(x) now: its Linears are still the
        plain shims (no adapter wraps one) and its activation the one it had, none of them has a
        hook (nor is there a global module hook) that the per-Linear forward would run, and x is
        what the unit takes."""
        modules = block._modules
        return (
            all(modules.get(name) is m for name, m in zip(self.layout.linears, self.members))
            and getattr(block, self.layout.act, None) is self.act
            and not any(_hooked(m) for m in (*self.members, self.act))
            and not _global_hooks()
            and x.dtype == self._dtype
            and x.dim() > 0
            and x.shape[-1] == self._d_in
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tracing():  # the custom op, whose backward for an MLP unit sends [x, grad_y] too
            return traced_call(x, self._shim_id, pb.FORWARD)
        if records(x):
            return _MlpCall.apply(x, self._shim_id)
        return self._remote(x, pb.FORWARD)


class _MlpCall(torch.autograd.Function):
    """FORWARD of an MLP unit; backward sends [x, grad_y] and gets grad_x (the executor
    recomputes the block)."""

    @staticmethod
    def forward(ctx, x, unit):
        ctx.unit = unit
        ctx.save_for_backward(x)
        return _SHIMS[unit]._remote(x, pb.FORWARD)

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the executor's result carries no graph)
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _SHIMS[ctx.unit]._remote(torch.cat([x, grad], dim=-1), pb.BACKWARD), None


def _hooked(module) -> bool:
    """Whether a module has a hook of its own that its forward (or backward) would run."""
    return isinstance(module, nn.Module) and bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def _global_hooks() -> bool:
    """Whether hooks for every module are registered (torch.nn.modules.module.register_module_*)."""
    m = _nn_module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks or m._global_backward_pre_hooks)


class VirtMLP:
    """Mixin placed first in a served block's class: calls the MLP unit while it may."""

    _whole: MlpUnit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = handed(self, x)  # (the output a layer span computed for x: client/layer_span.py)
        if y is not None:
            return y
        if self._whole.serves(self, x):
            return self._whole.forward(x)
        return super().forward(x)


_CLASSES: dict[type, type] = {}


def serve_whole_mlps(units: list[pb.UnitInfo], root: nn.Module, shims: dict[str, VirtLayer]) -> int:
    """Makes each block the executor serves as an MLP unit call it whole (module docstring), where
    the tenant's block is a gated MLP whose Linears are the shims of the unit's members. Returns
    how many blocks do."""
    n = 0
    for unit in units:
        try:
            block = root.get_submodule(unit.id)
        except AttributeError:
            continue
        layout = gated_mlp.layout(block)
        if layout is None:
            continue
        members = tuple(shims.get(f"{unit.id}.{name}") for name in layout.linears)
        if any(m is None or block._modules.get(name) is not m or isinstance(m, VirtOwnForward)
               for name, m in zip(layout.linears, members)):
            continue  # (a Linear with a forward of its own runs it: the block runs its own forward too)
        cls = type(block)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Virt{cls.__name__}", (VirtMLP, cls), {"__module__": __name__})
        block.__class__ = _CLASSES[cls]
        block._whole = MlpUnit(unit, members, layout, getattr(block, layout.act))
        n += 1
    return n
