"""Sibling-call fusion: one remote call for Linear units that read the same input.

The executor advertises a group unit for each set of siblings (q/k/v, gate/up): a Linear whose
output is the members' outputs side by side. The first member called with an input x makes one
FORWARD call on the group (one output per member) and keeps the other members' outputs; a
sibling called next with the very same x (same object, unchanged
since) takes its output instead of calling. Backward is one BACKWARD call on the group with the
members' output gradients side by side (zeros for a member whose output went unused): autograd
runs a node once, when all its outputs' gradients are in.

Fusion never changes what a member returns, only how many calls it takes: a member called with
another input makes a fresh group call (what a group call keeps is its thread's: threads sharing a
model fuse each their own calls), and a group whose kept outputs keep going unused (its
members read different inputs) stops fusing and calls per unit. While `torch.compile` traces the
members' parent module (q/k/v's attention, gate/up's MLP block), the group call is the custom op
(client/shim.py) and the kept outputs live only until that forward returns (FusionScope):
siblings fed the same traced tensor share one call in the graph, and no state outlives it.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from symbiont.client.shim import UnitRef, VirtLayer, VirtLinear, _SHIMS, _state, call_unit, records, trace_serial, traced_call, tracing
from symbiont.proto import executor_pb2 as pb

WASTE_LIMIT = 3
"""A group stops fusing after this many group calls in a row left some member's output unused."""


class FusedGroup(UnitRef):
    """The group unit of some sibling shims, and the outputs of its last call not yet taken."""

    def __init__(self, unit: pb.UnitInfo, members: list[VirtLayer]):
        self.unit_id = unit.id
        self.transport = members[0].transport
        self._kind = unit.kind
        self._d_in, self._d_out = unit.in_features, unit.out_features
        self._dtype = members[0]._dtype
        self.sizes = [m._d_out for m in members]
        if sum(self.sizes) != self._d_out or any(m._d_in != self._d_in for m in members):
            raise ValueError(f"group {unit.id!r} ({self._d_in} -> {self._d_out}) does not match its members' widths {self.sizes}")
        self.enabled = True
        self._adapter = next((m._adapter for m in members if m._adapter), 0)  # (the executor adds each adapted member's share)
        self._last = _Last()  # this thread's last group call (threads sharing a model fuse each their own calls)
        self._traced_kept = None  # while torch.compile traces: (trace, x, {member: output}) of the last group call
        self._traced_handed = None  # while torch.compile traces: (trace, x, {member: output}) a layer span computed (layer_span.py)
        self._scope_open = False  # while torch.compile traces the members' parent's forward (FusionScope)
        self._register()
        for i, m in enumerate(members):
            m._group, m._member = self, i

    def columns(self, member: int) -> tuple[int, int]:
        """The member's output columns [a, b) of the group's output."""
        a = sum(self.sizes[:member])
        return a, a + self.sizes[member]

    def forward(self, member: int, x: torch.Tensor) -> torch.Tensor | None:
        """The member's output for x, from the last group call or a new one; None when this group
        no longer fuses (the caller then calls its own unit)."""
        if not self.enabled:
            return None
        if tracing():
            return self._traced(member, x)
        last = self._last
        if member in last.kept and last.x is x and last.state == _state(x):
            y = last.kept.pop(member)
            if not last.kept:
                last.x, last.wasted = None, 0
            return y
        if last.kept:  # outputs of the last call that no member took
            last.kept.clear()
            last.x = None
            last.wasted += 1
            if last.wasted >= WASTE_LIMIT:
                self.enabled = False
                return None
        if records(x):
            ys = _GroupCall.apply(x, self._shim_id)  # eager only: fusion is off while tracing
        else:  # nothing for autograd to record
            ys = _split(x, self._shim_id)
        last.kept = {i: y for i, y in enumerate(ys) if i != member}
        last.x, last.state = x, _state(x)
        return ys[member]

    def _traced(self, member: int, x: torch.Tensor) -> torch.Tensor | None:
        """forward() while torch.compile traces: the group call is the custom op, and the outputs
        the other members take are kept only while the trace is inside the forward of the
        members' parent (FusionScope), which drops them as it returns: what Dynamo leaves on the
        group once the compiled code has run is None. A member called outside that forward
        calls its own unit (None)."""
        serial = trace_serial()  # (what another trace left is never taken: shim.trace_serial)
        handed = self._traced_handed
        if handed is not None and handed[0] == serial and handed[1] is x and member in handed[2]:
            y = handed[2].pop(member)
            if not handed[2]:
                self._traced_handed = None
            return y
        if not self._scope_open:
            return None
        kept = self._traced_kept
        if kept is not None and kept[0] == serial and kept[1] is x and member in kept[2]:
            return kept[2].pop(member)
        ys = traced_call(x, self._shim_id, pb.FORWARD).split(self.sizes, dim=-1)
        self._traced_kept = (serial, x, {i: y.contiguous() for i, y in enumerate(ys) if i != member})
        return ys[member].contiguous()


class _Last(threading.local):
    """Each thread's last group call: its input, the input's _state then (a sibling takes a kept
    output only if it is unchanged), the outputs no member has taken yet (member index -> output),
    and how many group calls in a row left some output untaken."""

    def __init__(self):  # (run anew in each thread that reads it)
        self.x, self.state, self.kept, self.wasted = None, None, {}, 0


class FusionScope:
    """Mixin placed first in the class of a module whose children make fused groups: while
    torch.compile traces its forward, its groups fuse, and what they keep lives until it returns."""

    _fusion_groups: tuple[FusedGroup, ...] = ()

    def forward(self, *args, **kwargs):
        if not tracing():
            return super().forward(*args, **kwargs)
        for g in self._fusion_groups:
            g._scope_open, g._traced_kept = True, None
        try:
            return super().forward(*args, **kwargs)
        finally:
            for g in self._fusion_groups:
                g._scope_open, g._traced_kept = False, None


_SCOPES: dict[type, type] = {}


# ---- the call ----------------------------------------------------------------------


class _GroupCall(torch.autograd.Function):
    """FORWARD of a group unit: one call, one output per member (each its own contiguous tensor,
    as the member's own call would return). Backward: grad_x = [grad_1 ... grad_n] W_group, one
    call; autograd passes zeros for outputs nobody used."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group)

    @staticmethod
    def backward(ctx, *grads):
        return call_unit(torch.cat(grads, dim=-1), ctx.group, pb.BACKWARD), None


def _split(x: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """The group's FORWARD, [..., sum of the members' widths], copied out of the transport's
    result in place as one contiguous tensor per member."""
    g = _SHIMS[group]

    def take(y):
        return tuple(part.clone(memory_format=torch.contiguous_format) for part in y.split(g.sizes, dim=-1))

    return g._remote(x, pb.FORWARD, take)


def fuse_siblings(groups: list[pb.UnitInfo], shims: dict[str, VirtLayer], root: nn.Module) -> list[FusedGroup]:
    """Links each advertised group to its members' shims; a group some member of which has no
    shim (or a shim of another kind) is left out, and those members call per unit. The members'
    parent module (in `root`) becomes a FusionScope for the group."""
    made = []
    for unit in groups:
        members = [shims.get(m) for m in unit.members]
        if not (unit.kind == "linear" and all(m is not None and m._kind == "linear" and isinstance(m, VirtLinear) for m in members)):
            continue  # (a member with a forward of its own calls its unit alone)
        group = FusedGroup(unit, members)
        made.append(group)
        try:
            parent = root.get_submodule(unit.members[0].rpartition(".")[0])
        except AttributeError:
            continue  # (traced, its members then call per unit)
        cls = type(parent)
        if not issubclass(cls, FusionScope):
            if cls not in _SCOPES:
                name = cls.__name__ if cls.__name__.startswith("Virt") else f"Virt{cls.__name__}"  # (a served MLP block's is)
                _SCOPES[cls] = type(name, (FusionScope, cls), {"__module__": __name__})
            parent.__class__ = _SCOPES[cls]
        parent._fusion_groups = parent._fusion_groups + (group,)
    return made
