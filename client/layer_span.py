"""Layer spans: one remote call per decoder layer while a tenant decodes (proto/layer_span.py).

An executor (unless started with `--no-layer-spans`) advertises a span unit per Llama-type decoder layer: from
the layer's attention output to the next layer's q/k/v. virtualize() makes the layer, its
attention, its two norms and its MLP block instances of subclasses whose forward takes their part
from the span's one call, while the layer's own forward (transformers' code) runs as it is:

1. the input norm gives the n1 the previous layer's span computed (else computes it), and the
   layer's q/k/v group hands out the q/k/v of the same span (client/fusion.py's kept outputs);
2. the attention runs, with its o_proj shim giving float32 zeros: a LoRA on o_proj then returns its
   delta d alone, in float32. The attention makes the span call with [a, r, d] (o_proj's input,
   the layer's input) and returns o = o_proj(a) + d, rounded once, as PEFT computes it;
3. the post-attention norm gives n2 and the MLP block m; the layer adds its residuals itself;
4. the layer hands n1 and the next q/k/v on to the next layer, for its output h2 exactly.

The span's call carries the weights of the tenant's two norms as they are at that call (trained,
changed in place or not), and the executor computes the norms with them: a tenant's span needs
only norms of the served epsilon, in the served dtype. A layer runs its own way (three calls)
whenever a span cannot stand for it: gradients recorded (a span keeps nothing for backward),
more than SPAN_MAX_TOKENS tokens, an adapter other than one plain LoRA on
o_proj (and q, k, v), a hook on any of its parts or the next layer's, or a masked tenant. A hosted
adapter of o_proj or q, k, v rides in the span's call (the executor adds it there); one of the MLP
leaves the layer its own calls. What the parts hand each
other is the calling thread's: threads sharing a model each get their own. While torch.compile
traces, the same hand-overs go through shim.TRACED and the q/k/v group's _traced_handed (Dynamo
cannot read a threading.local), and the call is the custom op: compiled code makes one call a
layer too.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from symbiont.client.shim import HANDED, TRACED, UnitRef, VirtLayer, _state, handed, trace_serial, traced_call, tracing
from symbiont.client.whole_mlp import VirtMLP, _global_hooks
from symbiont.client.whole_mlp import _hooked as _any_hook
from symbiont.proto import executor_pb2 as pb
from symbiont.proto import layer_span

SPAN_MAX_TOKENS = 256
"""A layer of more tokens than this (a long prefill) makes its three calls: their round trips cost
little beside its GEMMs, and a span's reply is 4 hidden widths and q/k/v per token."""
WASTE_LIMIT = 3
"""A span stops after this many calls in a row whose n1 the next layer did not take."""


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
        self.norms = (getattr(layer, layer_span.POST_NORM),) + ((getattr(nxt, layer_span.INPUT_NORM),) if nxt is not None else ())
        self.eps = [n.variance_epsilon for n in self.norms]  # (the served ones, as checked at virtualize)
        # a hosted adapter's id where it adapts this o_proj or the next q/k/v (the executor adds
        # both inside the span; a layer whose MLP it adapts gets no span: no whole-MLP block)
        self._adapter = o_shim._adapter or (group._adapter if group is not None else 0)
        self.enabled, self.wasted = True, 0
        self._now = _Now()
        self._traced = _TracedNow()  # (while torch.compile traces: the same, each entry tagged with its trace)
        self._register()

    # ---- whether the span stands for the layer now --------------------------------

    def ready(self, h: torch.Tensor) -> bool:
        """Whether the span stands for its layer on input h now (the layer's every call: plain
        dict lookups, no module __getattr__)."""
        if not self.enabled or torch.is_grad_enabled() or h.dtype != self._dtype or h.dim() == 0:
            return False
        if h.shape[-1] != self.pieces[0] or h.numel() // h.shape[-1] > SPAN_MAX_TOKENS:
            return False
        mods = self.layer._modules
        attn, mlp = mods.get("self_attn"), mods.get(layer_span.MLP)
        if not (isinstance(attn, VirtSpanAttention) and isinstance(mlp, VirtMLP)) or mods.get(layer_span.POST_NORM) is not self.norms[0]:
            return False
        parts = [self.layer, attn, mlp, mods.get(layer_span.INPUT_NORM), self.norms[0]]
        if self.next is not None:
            nmods = self.next._modules
            nattn = nmods.get("self_attn")
            if nmods.get(layer_span.INPUT_NORM) is not self.norms[1] or nattn is None:
                return False
            amods = nattn._modules
            parts += [self.next, nattn, self.norms[1], amods.get("q_proj"), amods.get("k_proj"), amods.get("v_proj")]
        o_proj = attn._modules.get("o_proj")
        parts.append(o_proj)
        if any(m is None or _hooked(m) or "forward" in m.__dict__ for m in parts):  # (a forward set on the instance: its own)
            return False
        for n, eps in zip(self.norms, self.eps):  # (their weights go with the call: any values, of the served dtype)
            w = n._parameters.get("weight")
            if w is None or w.dtype != self._dtype or w.shape != h.shape[-1:] or w.device != h.device or n.__dict__.get("variance_epsilon") != eps:
                return False
        # (o_proj: any hook of it would see zeros, or change only the delta)
        return (mlp._whole.serves(mlp, h) and _plain_or_lora(o_proj, self.o_shim) and not _any_hook(o_proj)
                and not _any_hook(self.o_shim) and (self.group is None or self.group.enabled) and not _global_hooks())

    # ---- the layer's forward with the span on -------------------------------------

    def run(self, layer_forward, h: torch.Tensor, args, kwargs) -> torch.Tensor:
        gives, now = HANDED.gives, self._now
        now.r, now.carry = h, None
        try:
            h2 = layer_forward(h, *args, **kwargs)
        finally:
            now.r = None
            gives.pop(id(self.norms[0]), None)  # (what was not taken goes)
            gives.pop(id(getattr(self.layer, layer_span.MLP)), None)
        carry, now.carry = now.carry, None
        if carry and self.next is not None:
            n1, qkv = carry
            if gives.pop(id(self.norms[1]), None) is None:  # (the next layer took the last one, or there was none)
                self.wasted = 0
            else:
                self.wasted += 1
                self.enabled = self.wasted < WASTE_LIMIT
            gives[id(self.norms[1])] = (h2, _state(h2), n1)
            last = self.group._last
            last.kept, last.x, last.state, last.wasted = dict(enumerate(qkv)), n1, _state(n1), 0
        return h2

    def run_traced(self, layer_forward, h: torch.Tensor, args, kwargs) -> torch.Tensor:
        """run() while torch.compile traces: the hand-overs in TRACED and on the q/k/v group, the
        call the custom op (no waste count: the compiled code runs as traced)."""
        t, serial = self._traced, trace_serial()  # (each hand-over taken by this trace alone)
        t.r, t.carry = (serial, h), None
        try:
            h2 = layer_forward(h, *args, **kwargs)
        finally:
            t.r = None
            TRACED.gives.pop(id(self.norms[0]), None)
            TRACED.gives.pop(id(getattr(self.layer, layer_span.MLP)), None)
        carry, t.carry = t.carry, None
        if carry is not None and carry[0] == serial and carry[1] and self.next is not None:
            n1, qkv = carry[1]
            TRACED.gives[id(self.norms[1])] = (serial, h2, n1)
            self.group._traced_handed = (serial, n1, dict(enumerate(qkv)))
        return h2

    def attention_traced(self, attn_forward, args, kwargs):
        t, serial = self._traced, trace_serial()
        r = t.r
        if r is None or r[0] != serial:  # (the layer's forward began in another graph: no span)
            return attn_forward(*args, **kwargs)
        r = r[1]
        seen = []
        TRACED.zeroing[id(self.o_shim)] = (serial, seen)
        try:
            out = attn_forward(*args, **kwargs)
        finally:
            TRACED.zeroing.pop(id(self.o_shim), None)
        t.r = None
        d = out[0] if isinstance(out, tuple) else out
        if not seen:  # (o_proj ran in another graph, a graph break between: it made its own call)
            return out
        if len(seen) != 1 or d.shape != r.shape or d.dtype != torch.float32:
            raise RuntimeError(f"{self.unit_id}: the attention did not end with one o_proj call; serve with --no-layer-spans")
        x, lead = self._input(seen[0], r, d)
        y = traced_call(x, self._shim_id, pb.FORWARD)
        o, n2, m, *carry = [p.reshape(*lead, p.shape[-1]).contiguous() for p in y.split(self.pieces, dim=-1)]
        TRACED.gives[id(self.norms[0])] = (serial, None, n2)
        TRACED.gives[id(getattr(self.layer, layer_span.MLP))] = (serial, n2, m)
        t.carry = (serial, (carry[0], tuple(carry[1:])) if carry else ())
        return (o, *out[1:]) if isinstance(out, tuple) else o

    def _input(self, a, r, d):
        """The call's input rows [a, r, d, w2, w1] (d: the delta's bytes, delta_bits) and the leading shape of r."""
        lead, rows = r.shape[:-1], r.reshape(-1, r.shape[-1])
        if self.layer._modules["self_attn"]._modules.get("o_proj") is self.o_shim:  # (no adapter: d is zeros)
            bits = torch.zeros(rows.shape[0], layer_span.delta_width(rows.shape[1], self._dtype), dtype=self._dtype, device=rows.device)
        else:
            bits = layer_span.delta_bits(d.reshape(-1, d.shape[-1]), self._dtype)
        weights = [n._parameters["weight"].detach().expand(rows.shape) for n in self.norms]  # (each row its own copy)
        return torch.cat([a.reshape(-1, a.shape[-1]), rows, bits, *weights], dim=-1), lead

    def attention(self, attn_forward, args, kwargs):
        """The attention's forward with o_proj giving float32 zeros, then the span's call: returns
        what the attention returns, its output o_proj(a) + d."""
        now = self._now
        r = now.r
        if r is None:
            return attn_forward(*args, **kwargs)
        seen = HANDED.zeroing[id(self.o_shim)] = []
        try:
            out = attn_forward(*args, **kwargs)
        finally:
            del HANDED.zeroing[id(self.o_shim)]
        now.r = None  # (taken: the layer's forward has no second attention)
        d = out[0] if isinstance(out, tuple) else out
        if len(seen) != 1 or d.shape != r.shape or d.dtype != torch.float32:
            raise RuntimeError(f"{self.unit_id}: the attention did not end with one o_proj call; serve with --no-layer-spans")
        x, lead = self._input(seen[0], r, d)

        def take_pieces(y):
            y = y.reshape(-1, y.shape[-1])
            if y.shape[0] == 1:  # (one token: one copy out of the mailbox, its pieces contiguous views of it)
                return [p.view(*lead, p.shape[-1]) for p in y.clone().split(self.pieces, dim=-1)]
            return [p.reshape(*lead, p.shape[-1]).clone(memory_format=torch.contiguous_format) for p in y.split(self.pieces, dim=-1)]

        o, n2, m, *carry = self._remote(x, pb.FORWARD, take_pieces)
        gives = HANDED.gives
        gives[id(self.norms[0])] = (None, None, n2)  # (its next call's: on h = r + o)
        gives[id(getattr(self.layer, layer_span.MLP))] = (n2, None, m)
        now.carry = (carry[0], tuple(carry[1:])) if carry else ()  # (n1, (q, k, v)); () for the last layer
        return (o, *out[1:]) if isinstance(out, tuple) else o


class _TracedNow:
    """A span's state while torch.compile traces (Dynamo cannot read a threading.local; each entry
    is tagged with its trace instead): the layer's input while its forward runs with the span on
    (None once the attention took it), and what the call carries to the next layer."""

    def __init__(self):
        self.r, self.carry = None, None


class _Now(_TracedNow, threading.local):
    """The same, each thread its own (eager code)."""


def _hooked(module: nn.Module) -> bool:
    """Whether a module has a hook of its own that its forward would run, transformers' output
    recorders aside: they only read what a module returns, and stay once installed (a part a span
    stands for is still called and returns its true output; o_proj, which gives zeros, is checked
    for any hook). While Dynamo traces, any hook counts: it reads no function's name, and a
    function it takes as a constant may not take a module (torch 2.11 refuses)."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    if not any(hooks):
        return False
    return tracing() or any(not getattr(f, "__qualname__", "").endswith("output_capturing_hook") for h in hooks for f in h.values())


def _plain_or_lora(module, shim: VirtLayer) -> bool:
    """o_proj is its shim, or PEFT's vanilla LoRA Linear over it with at most one active adapter
    (its forward then returns base + delta, and float32 zeros for base give the delta alone)."""
    if module is shim:
        return True
    if type(module) is not _lora_linear() or module.get_base_layer() is not shim or module.merged:
        return False
    active = [a for a in module.active_adapters if a in module.lora_A] if not module.disable_adapters else []
    return len(active) <= 1 and not any(a in module.lora_variant for a in active) and (
        shim._dtype in (torch.float32, torch.bfloat16) or all(module.lora_A[a].weight.dtype == shim._dtype for a in active))


_LORA_LINEAR: list = []  # PEFT's LoRA Linear class, once looked up (None without PEFT)


def _lora_linear():
    """PEFT's LoRA Linear class (None without PEFT). Looked up when spans are set up
    (serve_layer_spans), so traced code only reads the list (functools.cache makes Dynamo warn)."""
    if not _LORA_LINEAR:
        try:
            from peft.tuners.lora.layer import Linear
        except ImportError:
            Linear = None
        _LORA_LINEAR.append(Linear)
    return _LORA_LINEAR[0]


# ---- the parts of a layer -----------------------------------------------------------


class VirtSpanDecoder:
    """Mixin placed first in a decoder layer's class: its forward with the span on, while it may."""

    _span: SpanUnit

    def forward(self, hidden_states, *args, **kwargs):
        span = self._span
        if tracing():
            if span.ready(hidden_states):
                return span.run_traced(super().forward, hidden_states, args, kwargs)
            if span.next is not None:
                TRACED.gives.pop(id(span.norms[1]), None)
                span.group._traced_handed = None
            return super().forward(hidden_states, *args, **kwargs)
        if span.ready(hidden_states):
            return span.run(super().forward, hidden_states, args, kwargs)
        if span.next is not None:
            HANDED.gives.pop(id(span.norms[1]), None)
        return super().forward(hidden_states, *args, **kwargs)


class VirtSpanAttention:
    """Mixin placed first in an attention's class: its forward makes the span's call when its layer's is on."""

    _span: SpanUnit

    def forward(self, *args, **kwargs):
        if tracing():
            return self._span.attention_traced(super().forward, args, kwargs)
        return self._span.attention(super().forward, args, kwargs)


class VirtNorm:
    """Mixin placed first in a norm's class: gives what a span computed for its input (its layer's
    span for the post-attention norm, the layer before's for the input norm), else computes it."""

    def forward(self, x):
        y = handed(self, x)
        return super().forward(x) if y is None else y


def _base(module):
    """The module a PEFT layer wraps (a shim's is itself), or None."""
    get = getattr(module, "get_base_layer", None)
    return get() if callable(get) else None


def _norm(module) -> bool:
    """A norm of a known class (made a VirtNorm already, as the next layer's of another span)."""
    return layer_span.own(module, layer_span.NORMS)


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
    the tenant's layer is of a known class with its o_proj shim, a whole-MLP block, norms of the
    served epsilons (the unit's fingerprint names them; their weights go with each call) and, but
    for the last layer, a fused q/k/v group in the next layer. Returns how many layers do."""
    by_unit = {g.unit_id: g for g in groups}
    paths = {id(m): p for p, m in root.named_modules()}
    _lora_linear()
    n = 0
    for unit in units:
        path = unit.id[: -len(".span")]
        try:
            layer = root.get_submodule(path)
        except AttributeError:
            continue
        o_proj, mlp_id, *qkv = unit.members
        o_shim, mlp = shims.get(o_proj), getattr(layer, layer_span.MLP, None)
        attn = getattr(layer, "self_attn", None)
        if not (layer_span.own(layer, layer_span.DECODERS) and layer_span.own(attn, layer_span.ATTENTIONS)
                and isinstance(o_shim, VirtLayer) and _base(getattr(attn, "o_proj", None)) is o_shim and isinstance(mlp, VirtMLP)
                and mlp._whole.unit_id == mlp_id and all(_norm(getattr(layer, n, None)) for n in (layer_span.INPUT_NORM, layer_span.POST_NORM))):
            continue
        group = nxt = None
        if qkv:
            group = by_unit.get(qkv[0])
            try:
                nxt = root.get_submodule(qkv[0][: -len("." + layer_span.QKV)])
            except AttributeError:
                continue
            if group is None or not _norm(getattr(nxt, layer_span.INPUT_NORM, None)):
                continue
        d_in, d_out, pieces = layer_span.widths(o_shim._d_out, o_shim._d_in, group._d_out if group else 0, o_shim._dtype)
        norms = [getattr(layer, layer_span.POST_NORM)] + ([getattr(nxt, layer_span.INPUT_NORM)] if nxt is not None else [])
        if d_in != unit.in_features or d_out != unit.out_features or paths.get(id(layer)) != path or not unit.fingerprint.endswith("|" + layer_span.norms_print(norms)):
            continue  # (norms of other epsilons than the served ones: the layer calls its units)
        span = SpanUnit(unit, layer, o_shim, pieces, nxt, group)
        _subclass(layer, VirtSpanDecoder)
        _subclass(attn, VirtSpanAttention)
        for name in (layer_span.INPUT_NORM, layer_span.POST_NORM):
            _subclass(getattr(layer, name), VirtNorm)
        if nxt is not None:
            _subclass(span.norms[1], VirtNorm)
        layer._span = attn._span = span
        n += 1
    return n
