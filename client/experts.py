"""Mixture-of-experts blocks whose experts the executor serves (proto/experts.py): the experts
module stays the tenant's class and runs its own eager forward here (routing, the combine by the
router's weights, everything a LoRA on the router or attention needs), while each expert's
`F.linear(x, weight[e])` becomes a call of that expert's unit. Its 3-D weights are placeholders.
PEFT's LoRA on an expert weight (ParamWrapper: the weight parametrized as W + delta) is kept as that
sum: expert e's product is its call plus x delta_e^T, equal to rounding to x (W_e + delta_e)^T."""
from __future__ import annotations

import torch
from torch import nn

from symbiont.client.errors import ModelMismatchError
from symbiont.client.shim import _LINEAR_FUNCS, RemoteWeight, UnitRef, call_unit, linear_args
from symbiont.proto import executor_pb2 as pb


class ExpertRef(UnitRef):
    """One expert's unit (a Linear with no module of its own)."""

    def __init__(self, unit: pb.UnitInfo, transport, dtype: torch.dtype):
        self.unit_id, self.transport, self._kind = unit.id, transport, "linear"
        self._d_in, self._d_out, self._dtype = unit.in_features, unit.out_features, dtype
        self._register()


class VirtExperts(nn.Module):
    """Mixin placed first: the replaced experts class's eager forward under _ExpertUses."""

    _experts: dict  # placeholder unit (module path.weight name) -> [ExpertRef per expert]

    def forward(self, *args, **kwargs):
        mro = type(self).__mro__  # (torch's parametrize subclasses our class: the replaced one follows VirtExperts)
        eager = mro[mro.index(VirtExperts) + 1].forward.__wrapped__  # (not a grouped-mm implementation)
        with _ExpertUses(self):
            return eager(self, *args, **kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: {len(refs)} experts served" for name, refs in self._experts.items())


class _ExpertUses(torch.overrides.TorchFunctionMode):
    """weight[e] of a served 3-D expert weight is expert e's placeholder; F.linear of it is its call."""

    def __init__(self, shim: VirtExperts):
        super().__init__()
        self.shim = shim

    def _served(self, t) -> bool:
        return isinstance(t, RemoteWeight) and t.unit in self.shim._experts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # PEFT's LoRA on an expert weight (ParamWrapper) parametrizes it as W + delta: kept as a sum
        if func in (torch.Tensor.__add__, torch.add) and self._served(args[0]) and isinstance(args[1], torch.Tensor) \
                and not kwargs:
            return _with_delta(args[0], lambda e, d=args[1]: d[e])
        if func is torch.baddbmm and self._served(args[0]) and kwargs.keys() <= {"alpha"} and len(args) == 3:
            lhs, rhs, alpha = args[1], args[2], kwargs.get("alpha", 1)
            return _with_delta(args[0], lambda e: torch.mm(lhs[e], rhs[e]) * alpha)
        if func is torch.Tensor.__getitem__ and self._served(args[0]):
            e = args[1]
            if isinstance(e, torch.Tensor) and e.dim() == 0 and not e.is_floating_point():
                e = int(e)
            if isinstance(e, int):
                ref = self.shim._experts[args[0].unit][e]
                w = RemoteWeight((ref._d_out, ref._d_in), ref._dtype, args[0].device, ref.unit_id, args[0].url)
                w.expert = ref
                w.deltas = [d(e) for d in getattr(args[0], "deltas", ())]  # (each [out, in])
                return w
        if func in _LINEAR_FUNCS:
            x, w, b = linear_args(args, kwargs)
            ref = getattr(w, "expert", None)
            if ref is not None:
                if b is not None:
                    raise ModelMismatchError(f"{ref.unit_id}: the experts' forward adds a bias of its own, which symbiont "
                                             "cannot stand in for")
                ref._check(x)
                y = call_unit(x, ref._shim_id, pb.FORWARD)
                for delta in w.deltas:  # x (W + delta)^T as x W^T + x delta^T: equal to rounding
                    y = y + torch.nn.functional.linear(x, delta)
                return y
        return func(*args, **kwargs)


def _with_delta(w: RemoteWeight, delta) -> RemoteWeight:
    """w plus a delta: a placeholder of w's unit whose expert e adds delta(e), [out, in], to its call."""
    out = RemoteWeight(w.shape, w.dtype, w.device, w.unit, w.url)
    out.deltas = [*getattr(w, "deltas", ()), delta]
    return out


_CLASSES: dict[type, type] = {}


def make_experts_shim(module: nn.Module, units: dict[str, list[pb.UnitInfo]], transport, dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
    """An instance of a subclass of type(module) whose 3-D weights named in `units` (name ->
    the units of its experts, in order) are placeholders, and whose other state is module's."""
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Virt{cls.__name__}", (VirtExperts, cls), {"__module__": __name__})
    shim = _CLASSES[cls].__new__(_CLASSES[cls])
    shim.__dict__.update(dict(module.__dict__, _parameters=dict(module._parameters)))
    shim._experts = {}
    for name, infos in units.items():
        p = module._parameters[name]
        prefix = infos[0].id.rpartition(".")[0]
        if p.dim() != 3 or p.shape[0] != len(infos) or tuple(p.shape[1:]) != (infos[0].out_features, infos[0].in_features):
            raise ModelMismatchError(f"{prefix}: shape {list(p.shape)} differs from the {len(infos)} served experts of "
                                     f"[{infos[0].out_features}, {infos[0].in_features}]")
        placeholder = RemoteWeight(p.shape, dtype, device, prefix, transport.url)
        shim._parameters[name] = nn.Parameter(placeholder, requires_grad=False)
        shim._experts[prefix] = [ExpertRef(u, transport, dtype) for u in infos]
    return shim
