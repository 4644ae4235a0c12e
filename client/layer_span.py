"""Layer spans: one remote call per decoder layer while a tenant decodes (proto/layer_span.py).

An executor started with `--layer-spans` advertises a span unit per Llama-type decoder layer: from
the layer's attention output to the next layer's q/k/v. virtualize() makes the layer, its
attention, its two norms and its MLP block instances of subclasses whose forward takes their part
from the span's one call, while the layer's own forward (transformers' code) runs as it is:

1. the input norm gives the n1 the previous layer's span computed (else computes it), and the
   layer's q/k/v group hands out the q/k/v of the same span (client/fusion.py's kept outputs);
2. the attention runs, with its o_proj shim giving zeros: a LoRA on o_proj then returns its delta
   d alone. The attention makes the span call with [a, r, d] (o_proj's input, the layer's input)
   and returns o = o_proj(a) + d;
3. the post-attention norm gives n2 and the MLP block m; the layer adds its residuals itself;
4. the layer hands n1 and the next q/k/v on to the next layer, for its output h2 exactly.

A layer runs its own way (three calls) whenever a span cannot stand for it: gradients recorded,
torch.compile tracing, more than SPAN_MAX_TOKENS tokens, an adapter other than one plain LoRA on
o_proj, one on the MLP's Linears or the norms, a hook on any of its parts, or a masked tenant.
What the parts hand each other is for the thread that made the span's call: threads sharing a model
each get their own.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from symbiont.client.fusion import _state
from symbiont.client.shim import UnitRef, VirtLayer, tracing
from symbiont.client.whole_mlp import VirtMLP, _global_hooks, _hooked
from symbiont.proto import executor_pb2 as pb
from symbiont.proto import layer_span

SPAN_MAX_TOKENS = 256
"""A layer of more tokens than this (a long prefill) makes its three calls: their round trips cost
little beside its GEMMs, and a span's reply is 4 hidden widths and q/k/v per token."""


class SpanUnit(UnitRef):
    """The span unit of one decoder layer, and what the parts of the layer take from its call."""

    def __init__(self, unit, layer: nn.Module, o_shim: VirtLayer, pieces: list[int], nxt: nn.Module | None, group):
        self.unit_id = unit.id
        self.transport = o_shim.transport
        self._kind = unit.kind
        self._d_in, self._d_out = unit.in_features, unit.out_features
        self._dtype = o_shim._dtype
        self.layer, self.o_shim, self.next, self.group = layer, o_shim, nxt, group  # (the next layer, its q/k/v group: None for the last)
        self.pieces = pieces[:4] + (list(group.sizes) if group is not None else [])  # [o, n2, m, n1, q, k, v]
        self._now = _Now()  # this thread's: its layer's forward with the span on, and what the parts take
        self._register()

    # ---- whether the span stands for the layer now --------------------------------

    def ready(self, h: torch.Tensor) -> bool:
        layer = self.layer
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, layer_span.MLP, None)
        norms = (getattr(layer, layer_span.INPUT_NORM, None), getattr(layer, layer_span.POST_NORM, None))
        return (
            not tracing()
            and not (torch.is_grad_enabled() and (h.requires_grad or _trains(layer)))
            and h.dtype == self._dtype
            and h.dim() > 0 and h.shape[-1] == self.pieces[0]
            and h.numel() // h.shape[-1] <= SPAN_MAX_TOKENS
            and isinstance(attn, VirtSpanAttention) and not _hooked(attn)
            and all(isinstance(n, VirtNorm) and not _hooked(n) for n in norms)
            and isinstance(mlp, VirtMLP) and mlp._whole.serves(mlp, h)
            and _plain_or_lora(getattr(attn, "o_proj", None), self.o_shim)
            and (self.group is None or self.group.enabled)
            and not _global_hooks()
        )

    # ---- the layer's forward with the span on -------------------------------------

    def run(self, layer_forward, h: torch.Tensor, args, kwargs) -> torch.Tensor:
        now = self._now
        now.open, now.r, now.a, now.carry = True, h, None, None
        try:
            h2 = layer_forward(h, *args, **kwargs)
        finally:
            now.open, now.r, now.a = False, None, None
            post, mlp = getattr(self.layer, layer_span.POST_NORM), getattr(self.layer, layer_span.MLP)
            now.gives.pop(id(post), None)  # (what was not taken goes)
            now.gives.pop(id(mlp), None)
        if now.carry is not None and self.next is not None:
            n1, qkv = now.carry
            now.gives[id(self.next_norm())] = (h2, _state(h2), n1)
            last = self.group._last
            last.kept, last.x, last.state, last.wasted = dict(enumerate(qkv)), n1, _state(n1), 0
        now.carry = None
        return h2

    def next_norm(self) -> "VirtNorm":
        return getattr(self.next, layer_span.INPUT_NORM)

    def give(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """What this thread's last span call computed for `module` called on x, once; None if nothing."""
        got = self._now.gives.pop(id(module), None)
        if got is not None and (got[0] is None or (got[0] is x and (got[1] is None or got[1] == _state(x)))):
            return got[2]
        return None

    def zero(self, x: torch.Tensor) -> torch.Tensor | None:
        """o_proj's shim called on x: zeros while this thread's attention runs for the span (x kept)."""
        now = self._now
        if not now.zeroing:
            return None
        now.a = x
        return torch.zeros((*x.shape[:-1], self.o_shim._d_out), dtype=x.dtype, device=x.device)

    def attention(self, attn_forward, args, kwargs):
        """The attention's forward with o_proj giving zeros, then the span's call: returns what
        the attention returns, its output o_proj(a) + d."""
        now = self._now
        if not now.open:
            return attn_forward(*args, **kwargs)
        now.zeroing = True
        try:
            out = attn_forward(*args, **kwargs)
        finally:
            now.zeroing = False
        d = out[0] if isinstance(out, tuple) else out
        a, r = now.a, now.r
        if a is None or d.shape != r.shape:  # (o_proj was not called, or not on the output: no span)
            raise RuntimeError(f"{self.unit_id}: the attention did not end with o_proj; serve without --layer-spans")
        x = torch.cat([a.reshape(-1, a.shape[-1]), r.reshape(-1, r.shape[-1]), d.reshape(-1, d.shape[-1])], dim=-1)
        lead = r.shape[:-1]

        def take(y):
            return [p.reshape(*lead, p.shape[-1]).clone(memory_format=torch.contiguous_format)
                    for p in y.reshape(-1, y.shape[-1]).split(self.pieces, dim=-1)]

        o, n2, m, *carry = self._remote(x, pb.FORWARD, take)
        now.gives[id(getattr(self.layer, layer_span.POST_NORM))] = (None, None, n2)  # (its next call's: on h = r + o)
        now.gives[id(getattr(self.layer, layer_span.MLP))] = (n2, None, m)
        now.carry = (carry[0], tuple(carry[1:])) if carry else ()  # (n1, (q, k, v)); () for the last layer
        return (o, *out[1:]) if isinstance(out, tuple) else o


class _Now(threading.local):
    """A thread's state of one span: inside its layer's forward (open; r the layer's input, a
    o_proj's), o_proj giving zeros, what the call carries to the next layer, and the outputs the
    layer's parts (and the next input norm) take: id(module) -> (x they are for or None: its next
    call, x's _state or None, output)."""

    def __init__(self):
        self.open, self.zeroing, self.r, self.a, self.carry, self.gives = False, False, None, None, None, {}


def _trains(layer: nn.Module) -> bool:
    return any(p.requires_grad for p in layer.parameters())


def _plain_or_lora(module, shim: VirtLayer) -> bool:
    """o_proj is its shim, or PEFT's plain LoRA Linear over it with at most one active adapter
    (its forward then returns base + delta, and base zeros gives the delta alone)."""
    if module is shim:
        return True
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return False
    if type(module) is not LoraLinear or module.get_base_layer() is not shim or _hooked(module) or module.merged:
        return False
    active = [a for a in module.active_adapters if a in module.lora_A] if not module.disable_adapters else []
    return len(active) <= 1 and not any(module.use_dora.get(a, False) for a in active) and not any(
        module.lora_magnitude_vector and a in module.lora_magnitude_vector for a in active)


# ---- the parts of a layer -----------------------------------------------------------


class VirtSpanDecoder:
    """Mixin placed first in a decoder layer's class: its forward with the span on, while it may."""

    _span: SpanUnit

    def forward(self, hidden_states, *args, **kwargs):
        if tracing():  # (torch.compile sees the layer's own forward: no span state in its graph)
            return super().forward(hidden_states, *args, **kwargs)
        span = self._span
        if span.ready(hidden_states):
            return span.run(super().forward, hidden_states, args, kwargs)
        if span.next is not None:
            span._now.gives.pop(id(span.next_norm()), None)
        return super().forward(hidden_states, *args, **kwargs)


class VirtSpanAttention:
    """Mixin placed first in an attention's class: its forward makes the span's call when its layer's is on."""

    _span: SpanUnit

    def forward(self, *args, **kwargs):
        if tracing():
            return super().forward(*args, **kwargs)
        return self._span.attention(super().forward, args, kwargs)


class VirtNorm:
    """Mixin placed first in a norm's class: gives what its span computed for its input (the
    span of its layer for the post-attention norm, of the layer before for the input norm), else
    computes it."""

    _giver: SpanUnit | None = None

    def forward(self, x):
        giver = self._giver
        if giver is not None and not tracing():
            y = giver.give(self, x)
            if y is not None:
                return y
        return super().forward(x)


def _norm(module) -> bool:
    """A norm of a known class (made a VirtNorm already, as the next layer's of another span)."""
    return isinstance(module, VirtNorm) or layer_span.own(module, layer_span.NORMS)


_CLASSES: dict[tuple[type, type], type] = {}


def _subclass(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    if isinstance(module, mixin):
        return
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Virt{cls.__name__}" if not cls.__name__.startswith("Virt") else cls.__name__,
                             (mixin, cls), {"__module__": __name__})
    module.__class__ = _CLASSES[key]


def serve_layer_spans(units: list, root: nn.Module, shims: dict, groups: list) -> int:
    """Makes each decoder layer the executor serves a span for call it (module docstring), where
    the tenant's layer is of a known class with its o_proj shim, a whole-MLP block and, but for
    the last layer, a fused q/k/v group in the next layer. Returns how many layers do."""
    by_unit = {g.unit_id: g for g in groups}
    paths = {id(m): p for p, m in root.named_modules()}
    n = 0
    for unit in units:
        path = unit.id[: -len(".span")]
        try:
            layer = root.get_submodule(path)
        except AttributeError:
            continue
        o_proj, mlp_id, *qkv = unit.members
        o_shim, mlp = shims.get(o_proj), getattr(layer, layer_span.MLP, None)
        if not (layer_span.own(layer, layer_span.DECODERS) and isinstance(o_shim, VirtLayer) and isinstance(mlp, VirtMLP)
                and mlp._whole.unit_id == mlp_id and all(_norm(getattr(layer, n, None)) for n in (layer_span.INPUT_NORM, layer_span.POST_NORM))):
            continue
        group = nxt = None
        hidden = o_shim._d_out
        if qkv:
            group = by_unit.get(qkv[0])
            parent = qkv[0][: -len("." + layer_span.QKV)]
            try:
                nxt = root.get_submodule(parent)
            except AttributeError:
                continue
            if group is None or not _norm(getattr(nxt, layer_span.INPUT_NORM, None)):
                continue
        _, d_out, pieces = layer_span.widths(hidden, o_shim._d_in, group._d_out if group else 0)
        if d_out != unit.out_features or paths.get(id(layer)) != path:
            continue
        span = SpanUnit(unit, layer, o_shim, pieces, nxt, group)
        _subclass(layer, VirtSpanDecoder)
        _subclass(layer.self_attn, VirtSpanAttention)
        for name in (layer_span.INPUT_NORM, layer_span.POST_NORM):
            _subclass(getattr(layer, name), VirtNorm)
        if nxt is not None:
            _subclass(getattr(nxt, layer_span.INPUT_NORM), VirtNorm)
            getattr(nxt, layer_span.INPUT_NORM)._giver = span
        layer._span = layer.self_attn._span = getattr(layer, layer_span.POST_NORM)._giver = mlp._giver = o_shim._span_zero = span
        n += 1
    return n
