"""VirtLayer shims: stand-ins for frozen modules whose weights live in the base executor.

A shim *is an instance of the class it replaces* (a dynamic subclass), so transformers and
PEFT dispatch on it unchanged; its parameters are RemoteWeight placeholders that carry shape,
dtype and device but raise when anyone reads their values. Forward and backward are one
autograd Function registered as the torch custom op `symbiont::unit_call` (with a fake
implementation), so `torch.compile` can keep it in a graph; eager code calls its twin, a plain
autograd.Function, whose dispatch costs a fraction of the custom op's. Sibling Linears that
read one input (q/k/v, gate/up) may share one call: see client/fusion.py.
"""
from __future__ import annotations

import copy
import itertools
import sys
import threading
import warnings
import weakref

import torch
from torch import nn

from symbiont.client.errors import ModelMismatchError
from symbiont.client.transport import adapted_unit
from symbiont.proto import executor_pb2 as pb
from symbiont.proto import patches


class RemoteWeight(torch.Tensor):
    """Metadata of a weight that lives in the executor. Any op on its values raises."""

    @staticmethod
    def __new__(cls, shape, dtype, device, unit: str, url: str):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device, requires_grad=False)
        t.unit, t.url = unit, url
        return t

    def __init__(self, *args, **kwargs):
        pass

    def __deepcopy__(self, memo):
        """A copy of a virtualized model (copy.deepcopy) holds placeholders of the same units (a
        Parameter's copy is a Parameter: its attributes are copied too)."""
        copied = memo[id(self)] = RemoteWeight(self.shape, self.dtype, self.device, self.unit, self.url)
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    __torch_function__ = torch._C._disabled_torch_function_impl

    _ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
    _EXPERT_SUMS = {torch.ops.aten.baddbmm.default, torch.ops.aten.add.Tensor}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        me = next(a for a in args if isinstance(a, RemoteWeight))
        if func in cls._ALIASES:
            return RemoteWeight(me.shape, me.dtype, me.device, me.unit, me.url)
        if func is torch.ops.aten.set_.source_Tensor and isinstance(args[1], RemoteWeight) and args[1].unit == me.unit:
            return args[0]  # (torch's parametrize sets a weight to itself: nothing to read)
        if func in cls._EXPERT_SUMS and args[0] is me and me.dim() == 3:
            # (a LoRA parametrization of served experts, W + delta, checked for its shape when registered;
            # within the experts' forward client/experts.py keeps the sum)
            return RemoteWeight(me.shape, me.dtype, me.device, me.unit, me.url)
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", me.dtype) == me.dtype:
            # model.to(device) moves the placeholder, not values; the executor keeps serving the unit
            return RemoteWeight(me.shape, me.dtype, kwargs.get("device") or me.device, me.unit, me.url)
        method = _peft_method_reading()
        raise RuntimeError(
            f"'{me.unit}' is served by the base executor at {me.url}: this process holds only a placeholder "
            f"(shape {list(me.shape)}, {me.dtype}), so its values cannot be read ({func}). "
            + (f"PEFT's {method} computes with the frozen weight's values (not only through a call of its base "
               "layer), and those never leave the executor: use a method that calls its base layer (LoRA, DoRA, "
               "LoHa, LoKr, OFT, BOFT, IA3, VeRA, AdaLoRA, prompt or prefix tuning, ...)." if method else
               "Call the module instead of reading its weight; merging adapters into the base weight needs the weights locally.")
        )

    def __repr__(self, *, tensor_contents=None):
        return f"RemoteWeight(unit={self.unit!r}, shape={list(self.shape)}, dtype={self.dtype}, url={self.url!r})"

    def __reduce_ex__(self, proto):
        raise RuntimeError(
            f"'{self.unit}' is served by the base executor at {self.url}: this process holds only a placeholder, "
            "which cannot be saved; save the adapter (PEFT save_pretrained) instead of the full model"
        )


def _peft_method_reading() -> str:
    """The PEFT method whose code is reading a placeholder's values, from the calling frames: its
    name as PEFT's folder has it, upper case, and the class whose code it is ("HRA (HRALinear)",
    "LORA (ParamWrapper)"); "" when none is."""
    f = sys._getframe(2)
    while f is not None:
        parts = f.f_code.co_filename.replace("\\", "/").split("/peft/tuners/")
        if len(parts) == 2 and "/" in parts[1]:
            qualname = getattr(f.f_code, "co_qualname", "")
            owner = f" ({qualname.split('.')[0]})" if "." in qualname else ""
            return parts[1].split("/")[0].upper() + owner
        f = f.f_back
    return ""


# ---- the custom op ----------------------------------------------------------------

_SHIMS: "weakref.WeakValueDictionary[int, UnitRef]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


# a call does host work (the request, the doorbell): a CUDA graph replay would skip it, so
# torch.compile's CUDA graphs (mode="reduce-overhead") must leave the op out of theirs
_NOT_IN_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
if not _NOT_IN_CUDA_GRAPHS:
    warnings.warn(
        f"torch {torch.__version__} has no cudagraph_unsafe tag: a model compiled with CUDA graphs (torch.compile "
        "mode 'reduce-overhead', or generate() with a static cache) would replay symbiont calls without sending "
        "them; compile with mode 'default'", RuntimeWarning, stacklevel=2)


@torch.library.custom_op("symbiont::unit_call", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def unit_call(x: torch.Tensor, shim: int, op: int, training: bool = False) -> torch.Tensor:
    """`training`: the call belongs to a training pass (traced_call: as the trace saw it; a compiled
    forward runs with grad off and inputs that require none, so the call could not tell)."""
    return _SHIMS[shim]._remote(x, op, training=training)


def traced_call(x: torch.Tensor, shim: int, op: int) -> torch.Tensor:
    """unit_call as a traced model calls it: a call traced in training (`trains`) is a training
    call, as _remote counts an eager one."""
    return unit_call(x, shim, op, trains(x))


def trains(x: torch.Tensor) -> bool:
    """Whether a call on x belongs to a training pass: grad on, or x requires grad (inside an
    autograd.Function's forward grad mode is off, but x still requires grad)."""
    return torch.is_grad_enabled() or x.requires_grad


@unit_call.register_fake
def _(x, shim, op, training=False):
    s = _SHIMS[shim]
    return x.new_empty(s._out_shape(x.shape, op), dtype=s._out_dtype())


def _setup_context(ctx, inputs, output):
    x, ctx.shim, ctx.op = inputs[:3]
    if _SHIMS[ctx.shim]._kind == "mlp" and ctx.op != pb.BACKWARD:  # its backward sends the input again
        ctx.save_for_backward(x)  # (client/whole_mlp.py; a BACKWARD call's own backward raises instead)


def _backward(ctx, grad):
    # grad_x = grad_y W: the executor keeps no activations, W is frozen; an MLP unit's executor
    # recomputes the block from the input sent beside grad_y
    grad = grad.contiguous()
    if _SHIMS[ctx.shim]._kind == "mlp":
        if ctx.op == pb.BACKWARD:
            raise RuntimeError("a whole-MLP call cannot differentiate twice: its backward is the executor's recompute")
        (x,) = ctx.saved_tensors
        grad = torch.cat([x, grad], dim=-1)
    return unit_call(grad, ctx.shim, pb.BACKWARD, True), None, None, None


unit_call.register_autograd(_backward, setup_context=_setup_context)


class _UnitCall(torch.autograd.Function):
    """The eager twin of `unit_call`: the same forward and backward through autograd.Function,
    which costs a fraction of a custom op's dispatch (a call per unit per step adds up)."""

    @staticmethod
    def forward(ctx, x, shim, op):
        ctx.shim = shim
        return _SHIMS[shim]._remote(x, op)

    @staticmethod
    def backward(ctx, grad):
        return call_unit(grad.contiguous(), ctx.shim, pb.BACKWARD), None, None


_CONFIRMING: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()  # transport -> graph task


def confirm_when_backward_ends(transport) -> None:
    """Has the transport confirm its calls once the running backward pass ends: a call may return
    before its reply, and a failure must surface in the pass it belongs to."""
    task = torch._C._current_graph_task_id()
    if task >= 0 and _CONFIRMING.get(transport) != task:
        _CONFIRMING[transport] = task
        torch.autograd.Variable._execution_engine.queue_callback(transport.confirm)


def tracing() -> bool:
    """Whether torch.compile or torch.jit is tracing this code: they see the custom ops, eager code
    the twins. (torch.compiler.is_compiling() alone is true in every thread while any thread
    compiles: a thread traces where it has a tracing context of its own, trace_serial.)"""
    return (torch.compiler.is_compiling() and trace_serial() != 0) or torch.jit.is_tracing()


def constant_in_traces(fn):
    """torch.compiler.assume_constant_result(fn): Dynamo calls fn as it traces and bakes the result
    into the graph. The mark it sets, set here: that function imports torch._dynamo, which imports
    Triton, and Triton's CPU interpreter must be chosen before Triton's first import
    (tests/test_atmm.py); importing it costs every process's start too. tests/test_layer_span.py
    checks that the mark is still torch's."""
    fn._dynamo_marked_constant = True
    return fn


def records(x: torch.Tensor) -> bool:
    """Whether autograd records an operation on x (else a call need not go through a Function)."""
    return x.requires_grad and torch.is_grad_enabled()


def call_unit(x: torch.Tensor, shim: int, op: int) -> torch.Tensor:
    """`op` of shim's unit on x: the custom op while tracing, its cheaper eager twin otherwise,
    or, when autograd has nothing to record (inference), the call itself."""
    if tracing():
        return traced_call(x, shim, op)
    if records(x):
        return _UnitCall.apply(x, shim, op)
    return _SHIMS[shim]._remote(x, op)


def _state(x: torch.Tensor) -> tuple:
    """What must not change between a group call and a sibling taking its output: x's values (its
    version counter; inference tensors keep none, so for them the same object counts as the same
    values) and whether autograd records."""
    version = -1 if x.is_inference() else x._version
    return version, x.requires_grad, torch.is_grad_enabled(), torch.is_inference_mode_enabled()


class _Handed(threading.local):
    """This thread's outputs a layer span (client/layer_span.py) computed for a module's next call:
    id(module) -> (the input they are for, or None: whatever the next call's; that input's _state,
    or None; the output). And the o_proj shims giving zeros now: id(shim) -> the list their inputs
    go to."""

    def __init__(self):
        self.gives, self.zeroing = {}, {}


HANDED = _Handed()


class _Traced:
    """The same while torch.compile traces (Dynamo cannot read a threading.local): id(module) ->
    (the trace that left it, trace_serial(); the input it is for, or None; the output), and the
    o_proj shims giving zeros: id(shim) -> (trace, the list their inputs go to). Taken only by the
    trace that left it, for identical inputs (`is`)."""

    def __init__(self):
        self.gives, self.zeroing = {}, {}


TRACED = _Traced()
_SERIALS = itertools.count(1)


@constant_in_traces
def trace_serial() -> int:
    """The graph Dynamo is tracing now on this thread (its tracing context is per thread), as a
    number baked into its code; 0 where this thread traces nothing. What one trace leaves in
    TRACED is never taken by another: across a graph break Dynamo replays the writes at run time,
    where threads sharing a compiled model would take each other's."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is None:
        return 0
    serial = getattr(ctx, "_symbiont_trace", None)
    if serial is None:
        serial = ctx._symbiont_trace = next(_SERIALS)
    return serial


def handed(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """What a layer span computed for `module` called on x on this thread, once; None if nothing."""
    if tracing():
        got = TRACED.gives.pop(id(module), None) if TRACED.gives else None
        return got[2] if got is not None and got[0] == trace_serial() and (got[1] is None or got[1] is x) else None
    got = HANDED.gives.pop(id(module), None) if HANDED.gives else None
    if got is not None and (got[0] is None or (got[0] is x and (got[1] is None or got[1] == _state(x)))):
        return got[2]
    return None


# ---- shims --------------------------------------------------------------------------


class UnitRef:
    """A served unit as the custom ops see it: its id, widths and dtype, and how to call it.
    `_shim_id` is its key in _SHIMS, the integer the ops carry instead of the object."""

    unit_id: str
    transport: object  # client.transport.Transport
    _kind: str
    _d_in: int
    _d_out: int
    _dtype: torch.dtype
    _shim_id: int
    _mask = None  # client.privacy.NoiseMask when this tenant masks its calls
    _adapter = 0  # the hosted adapter (AdapterInfo.id) the executor adds to this unit's calls (virtualize's adapter=)

    def _register(self) -> None:
        self._shim_id = next(_IDS)
        _SHIMS[self._shim_id] = self

    def __deepcopy__(self, memo):
        """copy.deepcopy of a virtualized model: each copied shim (and fused group) is its own,
        registered anew, with fresh per-thread state; it calls the same units over the same
        connection (Transport.__deepcopy__), and the copy's adapters are its own. A copy of a part of
        the model without the whole (the model virtualize was given) is refused: PEFT's
        modules_to_save copies a module to train the copy's weights, which would silently stay the
        executor's, untrained."""
        whole = self.__dict__.get("_virtual_root")
        root = whole() if whole is not None else None
        if root is not None and id(root) not in memo and isinstance(self, nn.Module):
            raise RuntimeError(
                f"{self.unit_id!r} is served by the base executor at {self.transport.url}: a copy of a module that holds "
                "it, without the whole model (PEFT's modules_to_save makes one, to train its weights), would hold no "
                "weights to train. Apply get_peft_model before virtualize (the trainable copy then keeps its weights "
                "in this process), or leave such modules out of modules_to_save"
            )
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_virtual_root":
                new.__dict__[key] = weakref.ref(memo[id(root)]) if root is not None and id(root) in memo else value
            else:
                new.__dict__[key] = type(value)() if isinstance(value, threading.local) else copy.deepcopy(value, memo)
        new._register()
        return new

    def _out_dtype(self) -> torch.dtype:
        return self._dtype

    def _check(self, x: torch.Tensor) -> None:
        if x.dtype != self._dtype:
            if torch.is_autocast_enabled(x.device.type):  # (where the unsplit module would cast, not fail)
                raise TypeError(
                    f"{self.unit_id}: input dtype {x.dtype} under torch.autocast, and the executor serves {self._dtype}: "
                    f"a virtualized model runs in the served dtype; serve the executor in {x.dtype} (--dtype) and build "
                    "the model in it (connect(url).model(...) does), or leave autocast off"
                )
            raise TypeError(
                f"{self.unit_id}: input dtype {x.dtype} does not match the served weight's dtype {self._dtype} "
                "(the unsplit module would fail the same way); cast the input or load the model in the served dtype"
            )
        if x.shape[-1] != self._d_in:
            raise ValueError(f"{self.unit_id}: input has last dimension {x.shape[-1]}, the unit takes {self._d_in}")

    def _out_shape(self, shape, op) -> tuple[int, ...]:
        if self._kind == "embedding":
            return tuple(shape) + (self._d_out,)
        return tuple(shape[:-1]) + ((self._d_in,) if op == pb.BACKWARD else (self._d_out,))

    def _remote(self, x: torch.Tensor, op: int, take=None, training: bool = False):
        # (in a compiled forward grad is off and x requires none: `training` says what the trace saw)
        latency = pb.TRAINING if training or trains(x) or op == pb.BACKWARD else pb.INFERENCE
        if op == pb.BACKWARD:  # (a fused group's too)
            confirm_when_backward_ends(self.transport)
        shape = self._out_shape(x.shape, op)
        unit = adapted_unit(self.unit_id, self._adapter)
        if self._mask is not None:
            y = self._mask.call(self, x, op, lambda v, tk: self.transport.call(unit, op, v, shape, self._dtype, latency, tk))
            if y is not None:
                return y if take is None else take(y)
        return self.transport.call(unit, op, x, shape, self._dtype, latency, take)


class VirtLayer(UnitRef, nn.Module):
    """Mixin placed first in a shim's MRO. Holds a reference to a unit, never its weights."""

    _group = None  # client.fusion.FusedGroup when this unit's calls may be fused with its siblings'
    _member = 0  # this unit's index in its group

    def get_base_layer(self) -> nn.Module:
        return self

    def unwrap(self) -> dict:
        """What this shim stands for: the unit id, its kind and widths, the executor's address, and
        its fused group (None when it has none): the group unit, this unit's output columns [a, b)
        of the group's, and whether calls are fused now."""
        g = self._group
        group = None if g is None else {"unit": g.unit_id, "columns": g.columns(self._member), "fused": g.enabled}
        return {"unit": self.unit_id, "kind": self._kind, "in": self._d_in, "out": self._d_out, "url": self.transport.url, "group": group}

    def extra_repr(self) -> str:
        return f"unit={self.unit_id!r}, in={self._d_in}, out={self._d_out}, remote={self.transport.url!r}"


class VirtLinear(VirtLayer):
    """nn.Linear and GPT-2 Conv1D: y = x W^T + b at the executor (one call for the unit, or
    a share of one call for its fused group, traced or not: client/fusion.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        if tracing():
            entry = TRACED.zeroing.get(id(self)) if TRACED.zeroing else None
            seen = entry[1] if entry is not None and entry[0] == trace_serial() else None
        else:
            seen = HANDED.zeroing.get(id(self)) if HANDED.zeroing else None
        if seen is not None:  # (o_proj while its layer span takes the attention's output: float32 zeros)
            seen.append(x)
            return torch.zeros((*x.shape[:-1], self._d_out), dtype=torch.float32, device=x.device)
        if self._group is not None:
            y = self._group.forward(self._member, x)
            if y is not None:
                return y
        return call_unit(x, self._shim_id, pb.FORWARD)


def _int64(ids: torch.Tensor) -> torch.Tensor:
    """Ids travel as int64: narrower integer ids (CPM-Ant's int32) are widened, their values kept."""
    return ids.long() if ids.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8) else ids


class VirtEmbedding(VirtLayer):
    """nn.Embedding: y = W[ids] at the executor."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return call_unit(_int64(ids), self._shim_id, pb.FORWARD)


class VirtOwnForward(VirtLayer):
    """A Linear or Embedding subclass with a forward of its own (OPT's learned positions add an
    offset to the ids, Falcon's Linear is `x @ W.T`, ...): that forward runs here, and where it
    uses its weight, `F.linear(x, weight, bias)`, `x @ weight.T`, `F.embedding(ids, weight, ...)`,
    `weight[a:b]` or `weight[ids]` (Whisper's positions), the unit is called instead. Any other use of the weight's values raises the placeholder's
    error naming the unit."""

    def forward(self, *args, **kwargs):
        own = type(self).__bases__[1].forward  # (the replaced class's: a shim's class is (mixin, replaced class))
        with _WeightUses(self):
            return own(self, *args, **kwargs)


class _WeightUses(torch.overrides.TorchFunctionMode):
    """Within a VirtOwnForward shim's forward: its weight's uses become calls of its unit (torch
    runs a mode's handler with the mode off, so the calls' own torch work is not intercepted)."""

    def __init__(self, shim: VirtLayer):
        super().__init__()
        self.shim = shim

    def _mine(self, t) -> bool:
        return isinstance(t, RemoteWeight) and t.unit == self.shim.unit_id

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.shim
        if func in _LINEAR_FUNCS and s._kind in ("linear", "conv1d"):
            x, w, b = linear_args(args, kwargs)
            if self._mine(w):
                if b is not None and not self._mine(b):
                    raise ModelMismatchError(f"{s.unit_id}: its forward adds a bias of its own to the served weight's product, "
                                             "which symbiont cannot stand in for")
                s._check(x)
                return call_unit(x, s._shim_id, pb.FORWARD if b is not None or s.bias is None else pb.FORWARD_NO_BIAS)
        if func in _TRANSPOSES and s._kind == "linear" and self._mine(args[0]) and not getattr(args[0], "transposed", False):
            w = args[0]  # (W.T: a placeholder marked transposed, which a matmul below turns into the call)
            t = RemoteWeight(tuple(reversed(w.shape)), w.dtype, w.device, w.unit, w.url)
            t.transposed = True
            return t
        if func in _MATMULS and len(args) == 2 and self._mine(args[1]) and getattr(args[1], "transposed", False):
            s._check(args[0])
            return call_unit(args[0], s._shim_id, pb.FORWARD_NO_BIAS)  # x @ W.T
        if func is torch.nn.functional.embedding and s._kind == "embedding":
            ids, w = args[0], (args[1] if len(args) > 1 else kwargs.get("weight"))
            max_norm = args[3] if len(args) > 3 else kwargs.get("max_norm")
            if self._mine(w):
                if max_norm is not None:
                    raise ModelMismatchError(f"{s.unit_id}: an embedding with max_norm renormalises its weight in place, "
                                             "which the executor's weight does not allow")
                return call_unit(_int64(ids), s._shim_id, pb.FORWARD)
        if func is torch.Tensor.__getitem__ and s._kind == "embedding" and self._mine(args[0]):
            return call_unit(_rows(args[0], args[1], s.unit_id), s._shim_id, pb.FORWARD)  # weight[a:b], weight[ids]
        return func(*args, **kwargs)


def _rows(weight: RemoteWeight, index, unit: str) -> torch.Tensor:
    """The ids an index of an embedding's weight selects (Whisper's positions: weight[a:b] or
    weight[ids]) as int64, so the lookup is the unit's call; anything else raises naming the unit."""
    if isinstance(index, slice) and index.step in (None, 1):
        a, b, _ = index.indices(weight.shape[0])
        return torch.arange(a, max(a, b), device=weight.device)
    if isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype is not torch.bool:
        return _int64(index)
    raise ModelMismatchError(f"{unit}: its forward indexes its weight with {type(index).__name__} {index!r}; "
                             "symbiont serves weight[a:b] and weight[ids] as lookups, not this")


_LINEAR_FUNCS = (torch.nn.functional.linear, torch._C._nn.linear)


def linear_args(args, kwargs) -> tuple:
    """(input, weight, bias) of an F.linear call as a torch function mode sees it."""
    return ((args[0] if args else kwargs.get("input")), (args[1] if len(args) > 1 else kwargs.get("weight")),
            (args[2] if len(args) > 2 else kwargs.get("bias")))
_TRANSPOSES = (torch.Tensor.T.__get__, torch.Tensor.t, torch.t, torch.Tensor.mT.__get__)
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


class VirtPatchConv(VirtLayer):
    """A convolution over non-overlapping patches (a vision patch embedding): its input cut into
    patches here, the patches through the unit (a Linear of the flattened kernel) at the executor,
    the result laid out as the convolution's (proto/patches.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batched = x.dim() == len(self.kernel_size) + 2
        flat, grid = patches.to_patches(x, tuple(self.kernel_size))
        self._check(flat)
        return patches.from_patches(call_unit(flat, self._shim_id, pb.FORWARD), grid, batched)


class VirtScaledEmbedding(VirtLayer):
    """Embeddings that multiply the lookup by `embed_scale` (Gemma, ...): the scale stays local."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return call_unit(_int64(ids), self._shim_id, pb.FORWARD) * self.embed_scale.to(self._dtype)


_CLASSES: dict[tuple[type, type], type] = {}


def _plain_new(cls, *args, **kwargs):
    """A shim class called like the class it replaces makes a plain instance of that class: PEFT
    builds a convolution adapter's own layers as type(base_layer)(...), which must be ordinary
    convolutions, not shims. (With no arguments, as copy protocols call it: a bare shim.)"""
    if not args and not kwargs:
        return object.__new__(cls)
    return cls.__bases__[1](*args, **kwargs)


def make_shim(module: nn.Module, mixin: type, unit: pb.UnitInfo, transport, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A shim standing in for `module`: an instance of a subclass of type(module) whose forward
    is `mixin`'s, whose parameters are placeholders and whose other state is module's."""
    cls = type(module)
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Virt{cls.__name__}", (mixin, cls), {"__module__": __name__, "__new__": _plain_new})
    shim = _CLASSES[key].__new__(_CLASSES[key])
    state = dict(module.__dict__)
    state["_parameters"] = {}
    state["_buffers"] = dict(module._buffers)
    state["_modules"] = dict(module._modules) if mixin is VirtOwnForward else {}  # (its own forward may use its children)
    shim.__dict__.update(state)
    for pname, p in module._parameters.items():  # (a None one stays None: an nn.Linear without bias has `bias`)
        placeholder = None if p is None else RemoteWeight(p.shape, dtype, device, unit.id, transport.url)
        shim._parameters[pname] = None if p is None else nn.Parameter(placeholder, requires_grad=False)
    shim.unit_id = unit.id
    shim.transport = transport
    shim._kind = unit.kind
    shim._d_in = unit.in_features
    shim._d_out = unit.out_features
    shim._dtype = dtype
    shim._register()
    return shim
