"""virtualize(): swap a model's frozen units for VirtLayer shims served by a base executor.

Surgery after construction: the model never knows it is split. Modules are matched against an
ordered list of (matches, shim mixin) pairs, first match wins; every unit the executor serves
must be found in the model, with the same shape, dtype and weights (by fingerprint), before
anything is replaced, so a mismatch leaves the model untouched.
"""
from __future__ import annotations

import gc
import json
import weakref
from typing import Callable

import torch
from torch import nn

from symbiont.client.errors import ModelMismatchError
from symbiont.client.experts import make_experts_shim
from symbiont.client.fusion import fuse_siblings
from symbiont.client.shim import (
    RemoteWeight, UnitRef, VirtEmbedding, VirtLayer, VirtLinear, VirtOwnForward, VirtPatchConv, VirtScaledEmbedding, make_shim,
)
from symbiont.client.layer_span import serve_layer_spans
from symbiont.client.whole_mlp import serve_whole_mlps
from symbiont.proto import codec, patches
from symbiont.proto import executor_pb2 as pb
from symbiont.proto.experts import expert_params
from symbiont.proto.fingerprint import SEEDED, fingerprint


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return ()
    return Conv1D


def _plain_forward(base: type) -> Callable[[nn.Module], bool]:
    return lambda m: isinstance(m, base) and type(m).forward is base.forward


def _scaled_embedding(m: nn.Module) -> bool:
    return isinstance(m, nn.Embedding) and isinstance(getattr(m, "embed_scale", None), torch.Tensor)


SHIM_TABLE: list[tuple[str, Callable[[nn.Module], bool], type]] = [
    ("nn.Linear", _plain_forward(nn.Linear), VirtLinear),
    ("transformers Conv1D", lambda m: isinstance(m, _conv1d_type()), VirtLinear),
    ("nn.Embedding", _plain_forward(nn.Embedding), VirtEmbedding),
    ("a convolution over non-overlapping patches (kernel = stride, no padding: a patch embedding)", patches.is_patch_conv,
     VirtPatchConv),
    ("nn.Embedding scaled by an `embed_scale` buffer (Gemma)", _scaled_embedding, VirtScaledEmbedding),
    ("an nn.Linear or nn.Embedding subclass with a forward of its own, whose F.linear / F.embedding of its weight "
     "become calls", lambda m: isinstance(m, (nn.Linear, nn.Embedding)), VirtOwnForward),
]

# config keys that describe how a model runs here, not which model it is
_RUNTIME_KEYS = {
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "use_cache",
    "_attn_implementation", "attn_implementation", "_attn_implementation_autoset", "output_attentions",
    "output_hidden_states", "return_dict", "_commit_hash", "use_return_dict", "gradient_checkpointing",
    "_experts_implementation", "chunk_size_feed_forward", "tie_word_embeddings",
}


_PEFT_WRAPPING = {"base_layer", "original_module"}  # LoRA-style wrappers, modules_to_save


def unit_path(name: str) -> str:
    """The executor's unit id for a module path of the transformers model under any PEFT wrapping."""
    return ".".join(p for p in name.split(".") if p not in _PEFT_WRAPPING)


def _shim_mixin(module: nn.Module, unit_id: str) -> type:
    for _, matches, mixin in SHIM_TABLE:
        if matches(module):
            return mixin
    supported = "; ".join(desc for desc, _, _ in SHIM_TABLE)
    raise ModelMismatchError(
        f"the executor serves {unit_id!r}, but the model's module there is a {type(module).__module__}."
        f"{type(module).__name__} whose forward symbiont cannot stand in for. Supported: {supported}"
    )


def check_config(model_config, served_json: str) -> None:
    served = json.loads(served_json)
    mine = model_config.to_dict()
    for key in ["model_type"] + sorted(served.keys() & mine.keys()):
        if key not in served or key not in mine:
            continue
        if key in _RUNTIME_KEYS:
            continue
        if json.dumps(served[key], sort_keys=True, default=str) != json.dumps(mine[key], sort_keys=True, default=str):
            raise ModelMismatchError(
                f"model config differs from the served model at {key!r}: executor has {served[key]!r}, this model has {mine[key]!r}"
            )


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    """Puts `new` where root's submodule `name` is."""
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)


def _confirming(transports):
    """A forward hook that confirms the transports' calls (their replies) as the forward ends."""

    @torch.compiler.disable
    def hook(module, args, output):
        for t in transports:
            t.confirm()

    return hook


FULL_MASK_MODELS = ("llama", "mistral", "qwen2")
"""Model types whose forward reads its attention mask only to build the causal mask (transformers'
masking_utils), where at a decoding step a 2-D mask with no position masked and no mask give the
same one."""


def _drops_full_masks(config) -> bool:
    """Whether a model of this config gets _dropping_full_masks: one of FULL_MASK_MODELS without
    sliding-window layers (whose masks are built whatever the padding: no sync to move)."""
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True))
    return getattr(config, "model_type", None) in FULL_MASK_MODELS and not sliding


def _dropping_full_masks(root: nn.Module):
    """A forward pre-hook for a decoding step (one token a row, a DynamicCache, sdpa attention): a
    2-D attention mask with no position masked goes to the model as None, from which transformers
    skips the causal mask alike. Its check (`.all()`, a wait for the GPU) then
    happens as the forward starts, where transformers makes it inside the mask's creation right
    after the embedding call, so a tenant waited there for the executor's reply (8.9-15.8% of a
    decoding tenant's main thread at 16 tenants, benchmarks/RESULTS.md). transformers' generate
    drops a full mask itself from some version after 5.17; this does it for a forward before that.
    A padded batch's step pays one sync more (its mask is kept). Off while torch.compile traces."""
    from transformers import DynamicCache

    config = root.config

    def hook(module, args, kwargs):
        mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if (mask is None or tokens is None or torch.compiler.is_compiling() or type(cache) is not DynamicCache
                or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens.dim() < 2 or tokens.shape[1] != 1
                or getattr(config, "_attn_implementation", None) != "sdpa"
                or mask.shape[-1] != cache.get_seq_length() + 1 or not bool(mask.all())):
            return None
        return args, {**kwargs, "attention_mask": None}

    return hook


def _hosted_adapter(conn, name: str, units: dict, mask) -> pb.AdapterInfo:
    """The hosted adapter `name`, checked against this model's linear units."""
    if mask is not None:
        raise ValueError("a hosted adapter and noise masking cannot be combined yet: hold the adapter privately to mask")
    info = conn.adapters(name)[0]
    missing = [u for u in info.units if u not in units]
    if missing:
        raise ModelMismatchError(f"hosted adapter {name!r} adapts {missing[0]!r}, which is not a linear unit of this model")
    return info


WRAPPED_AS = ("base_model.model.", "base_model.", "_orig_mod.", "_orig_mod.base_model.model.")
"""Where the usual wrappers keep a model: PEFT's PeftModel (LoRA and the like; prompt learning), and
torch.compile's OptimizedModule, alone or around a PeftModel."""


def served_weight_names(module: nn.Module) -> list[str]:
    """The names of the placeholder weights (units the executor serves) under `module`, every name
    of each (tied weights too): for a wrapper of your own, give them to
    `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapper, names)`."""
    return [n for items in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))
            for n, t in items if isinstance(t, RemoteWeight)]


class ServedWeights:
    """The names of the served units' placeholder weights under the module this is set on, as
    DistributedDataParallel reads them (`module._ddp_params_and_buffers_to_ignore`, when DDP wraps
    it): their values live in the executor, so DDP must not broadcast them at start (it reads
    every other parameter's values). The names are made when read, after any PEFT wrapping (a
    LoRA Linear's weight becomes `...base_layer.weight`), and also under each prefix of WRAPPED_AS:
    a PeftModel made after virtualize (or torch.compile's wrapper) answers the attribute with the
    model's. Names no parameter has cost DDP nothing."""

    def __init__(self, module: nn.Module, also=()):
        self._module = weakref.ref(module)
        self._also = list(also)  # names someone had set there before

    def __deepcopy__(self, memo):  # (a copied model's names are its own; it is in memo by now)
        module = self._module()
        return ServedWeights(memo.get(id(module), module), self._also)

    def __iter__(self):
        module = self._module()
        found = [] if module is None else served_weight_names(module)
        names = [*self._also, *found, *(prefix + n for prefix in WRAPPED_AS for n in found)]
        try:
            embeddings = module.get_input_embeddings() if module is not None and hasattr(module, "get_input_embeddings") else None
        except (NotImplementedError, AttributeError):  # (a model class without the accessor)
            embeddings = None
        if isinstance(getattr(embeddings, "weight", None), RemoteWeight):  # (PEFT's prompt learning holds it as word_embeddings)
            names += ["word_embeddings.weight", "_orig_mod.word_embeddings.weight"]
        return iter(names)


def _mark_served_weights(module: nn.Module) -> None:
    """Lets DistributedDataParallel wrap `module` (ServedWeights)."""
    before = module.__dict__.get("_ddp_params_and_buffers_to_ignore", ())
    module._ddp_params_and_buffers_to_ignore = ServedWeights(module, () if isinstance(before, ServedWeights) else before)


def virtualize(
    model: nn.Module,
    executor="local://symbiont",
    *,
    check_weights: bool = True,
    fuse: bool = True,
    whole_mlp: bool = True,
    device: torch.device | str | None = None,
    mask=None,
    adapter: str | None = None,
    lm_loss: str = "fused",
    step_graphs: bool | str = False,
) -> nn.Module:
    """Replaces `model`'s frozen units (Linear, Conv1D, Embedding, lm_head) with shims served by
    `executor` (an address such as 'local://NAME', or a Connection) and frees their weights.
    With `fuse`, sibling units that read the same input (q/k/v, gate/up) share one call forward
    and one backward (client/fusion.py); fuse=False makes one call per unit. With `whole_mlp`, a
    gated MLP block (Llama, Mistral, Qwen2, Gemma) none of whose Linears has an adapter is one
    call forward and one backward (client/whole_mlp.py), when the executor serves it so.
    `device` is where the tenant's tensors live (default: where the model's parameters are); a
    model whose units are still on the meta device (built under `parameters_on_meta`) is
    virtualized without ever holding their weights. `mask` (a client.privacy.NoiseMask) adds
    fresh noise to every linear unit's input and gradient and removes its effect from the reply,
    so the executor never sees them plain; it turns whole-MLP calls off. `adapter` names a LoRA
    adapter the executor hosts (Connection.host_adapter, or the provider's): the executor adds it
    to the calls of the units it adapts (forward and input gradient; it is frozen), and the model
    needs no adapter code; a fused group's call carries it for its adapted members, while a gated
    MLP block with an adapted Linear calls its Linears one by one. `lm_loss` is how a causal LM's
    loss (where the model uses transformers' ForCausalLMLoss) is taken: "fused" (default) in two
    Triton kernels on a GPU, the same function within float32 rounding, reading the logits once a
    pass and holding one float a row (client/fused_loss.py), elsewhere as "chunked"; "chunked", in
    row chunks, bit for bit transformers', without its full-vocabulary float32 tensors
    (client/loss.py); "transformers" keeps transformers' own. `step_graphs` (a tenant on the
    executor's GPU): decoding steps with a static cache are captured once as CUDA graphs, their
    calls as one program the executor runs, and replayed (client/step_graphs.py); other forwards,
    and every forward elsewhere, run as before. step_graphs="compiled": the steps are captured
    from the forward compiled by torch.compile (fused kernels: far fewer launches a token).

    Works on a plain transformers model and on a PEFT model, before or after get_peft_model.
    Returns the same model object, changed in place. Raises ModelMismatchError naming the first
    config field or unit that differs from the served model (the model is then unchanged).
    """
    from symbiont.client import dora, loss
    from symbiont.client.connection import Connection, connect

    if lm_loss not in loss.CHOICES:
        raise ValueError(f"lm_loss must be one of {', '.join(map(repr, loss.CHOICES))}, got {lm_loss!r}")
    if step_graphs not in (False, True, "compiled"):
        raise ValueError(f"step_graphs must be False, True or 'compiled', got {step_graphs!r}")
    dora.install()  # (PEFT's DoRA layers over shims, made before or after this)
    conn = executor if isinstance(executor, Connection) else connect(executor)
    catalog = conn.catalog()
    # a PeftModel's module names depend on the method (LoRA nests, prompt tuning does not):
    # walk the transformers model inside it, whose paths are the unit ids
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(root, "config", None)
    if config is not None:
        check_config(config, catalog.config_json)
    served_dtype = codec.torch_dtype(catalog.dtype)

    by_unit: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in root.named_modules():
        if isinstance(module, VirtLayer):
            raise ValueError(f"{name} is already virtualized (served by {module.transport.url})")
        by_unit.setdefault(unit_path(name), []).append((name, module))

    expert_weights = {  # a served expert unit's id but its number -> (module name, weight name, module)
        (f"{unit_path(name)}.{pname}" if name else pname): (name, pname, module)
        for name, module in root.named_modules() for pname in expert_params(module)
    }
    plan, served_experts = [], {}  # module name -> (module, {weight name: [its experts' units]})
    for unit in catalog.units:
        if unit.members:  # a group of sibling units or an MLP block: no weights of its own
            continue
        prefix, _, number = unit.id.rpartition(".")
        if prefix in expert_weights and number.isdigit():  # one expert of a 3-D weight (proto/experts.py)
            name, pname, module = expert_weights[prefix]
            units = served_experts.setdefault(name, (module, {}))[1].setdefault(pname, [])
            w = module._parameters[pname]
            if int(number) != len(units) or int(number) >= w.shape[0]:
                raise ModelMismatchError(f"the executor serves expert unit {unit.id!r}, which this model does not have")
            if check_weights and w.device.type != "meta" and fingerprint(w[int(number)]) != unit.fingerprint:
                raise ModelMismatchError(f"unit {unit.id!r}: weights differ from the served model's")
            units.append(unit)
            continue
        found = [(n, m) for n, m in by_unit.get(unit.id, []) if m.__dict__.get("_parameters", {}).get("weight") is not None]
        if not found:
            raise ModelMismatchError(f"the executor serves unit {unit.id!r}, which this model does not have")
        name, module = found[-1]
        mixin = _shim_mixin(module, unit.id)
        w = patches.linear_weight(module.weight) if mixin is VirtPatchConv else module.weight
        if w.dtype != served_dtype:
            raise ModelMismatchError(
                f"unit {unit.id!r}: the model holds {w.dtype}, the executor serves {served_dtype}; "
                f"load the model with dtype={served_dtype}"
            )
        if (unit.kind == "linear" and tuple(w.shape) != (unit.out_features, unit.in_features)) or (
            unit.kind != "linear" and tuple(w.shape) != (unit.in_features, unit.out_features)
        ):
            raise ModelMismatchError(f"unit {unit.id!r}: shape {list(w.shape)} differs from the served unit")
        if check_weights and w.device.type != "meta" and not unit.fingerprint.startswith(SEEDED) and fingerprint(w) != unit.fingerprint:
            raise ModelMismatchError(f"unit {unit.id!r}: weights differ from the served model's (shape {list(w.shape)})")
        plan.append((name, module, mixin, unit))

    if device is None:
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    conn.ensure_attached(device)
    hosted = _hosted_adapter(conn, adapter, {unit.id for _, _, _, unit in plan}, mask) if adapter else None
    adapted = set(hosted.units) if hosted else set()
    hosted_ids = (conn.adapter_ids(adapter) if len(conn.transports) > 1 else {0: hosted.id}) if hosted else {}  # (ids are per rank)
    shims = {}
    for name, module, mixin, unit in plan:
        shim = shims[unit.id] = make_shim(module, mixin, unit, conn.transport_for(unit), served_dtype, device)
        if unit.id in adapted:
            shim._adapter = hosted_ids[unit.rank]
        _replace(root, name, shim)
    expert_refs = []
    for name, (module, units) in served_experts.items():
        first = next(iter(units.values()))[0]
        shim = make_experts_shim(module, units, conn.transport_for(first), served_dtype, device)
        expert_refs += [r for refs in shim._experts.values() for r in refs]
        _replace(root, name, shim)
    if mask is not None:
        whole_mlp = False  # (an MLP block is not linear: its Linears are masked one by one)
        mask._members.update({u.id: list(u.members) for u in catalog.units if u.members and u.kind not in ("mlp", "span")})
    if whole_mlp:  # (first: it knows a block by its class, which fusion may subclass; an adapted block calls its Linears)
        members = {u.id: set(u.members) for u in catalog.units if u.members}
        inside = {u.id: set(u.members).union(*(members.get(m, ()) for m in u.members)) for u in catalog.units if u.kind == "mlp"}
        serve_whole_mlps([u for u in catalog.units if u.kind == "mlp" and not adapted & inside[u.id]], root, shims)
    groups = fuse_siblings([u for u in catalog.units if u.members], shims, root) if fuse else []
    if whole_mlp and fuse:  # (a span takes q/k/v and the MLP's parts of the calls those make; a hosted adapter rides in it)
        serve_layer_spans([u for u in catalog.units if u.kind == "span"], root, shims, groups)
    if mask is not None:
        for ref in [*shims.values(), *groups, *expert_refs]:
            ref._mask = mask
    if lm_loss != "transformers":
        loss.install(root, fused=lm_loss == "fused")
    if _drops_full_masks(config):
        root.register_forward_pre_hook(_dropping_full_masks(root), with_kwargs=True)
    if step_graphs:  # (the forward hooks below run around its replays too)
        from symbiont.client import step_graphs as graphs

        graphs.install(root, conn.transports, compiled=step_graphs == "compiled")
    # a call may return before its reply: a failure surfaces by the end of the forward it is in
    root.register_forward_hook(_confirming(conn.transports))
    for m in {id(root): root, id(model): model}.values():
        _mark_served_weights(m)
    for m in root.modules():  # (a copy of a part of the model without the whole is refused: UnitRef.__deepcopy__)
        if isinstance(m, UnitRef):
            m._virtual_root = weakref.ref(root)
    del plan, shims
    gc.collect()
    return model
