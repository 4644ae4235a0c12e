"""The unit table: every frozen Linear, GPT-2 Conv1D, Embedding and lm_head of the served model,
keyed by module path, tied weights deduplicated, plus one group unit per set of sibling Linears that
read the same input (q/k/v, gate/up), so a tenant can make one call for all of them, and one
MLP unit per gated MLP block (down(act(gate(x)) * up(x))), so a tenant whose MLP has no adapter
makes one call for the whole block; and the skeleton a tenant builds its model from."""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
import json

import torch
from torch import nn

from symbiont.proto import executor_pb2 as pb
from symbiont.proto.codec import dtype_enum
from symbiont.proto.fingerprint import fingerprint
from symbiont.proto import experts, gated_mlp, layer_span, patches

LINEAR, CONV1D, EMBEDDING, MLP, SPAN = "linear", "conv1d", "embedding", "mlp", "span"

# Sibling Linear modules under one parent that read the same input, by the names transformers
# gives them. Phi-3 (qkv_proj, gate_up_proj), GPT-2 (c_attn), Falcon and GPT-NeoX come fused.
ATTENTION_SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),  # Llama, Mistral, Qwen2, Gemma, GPT-J, OPT, BART, Whisper
    ("query", "key", "value"),  # BERT, RoBERTa, ViT
    ("q", "k", "v"),  # T5
)
MLP_SIBLINGS = (
    ("gate_proj", "up_proj"),  # Llama, Mistral, Qwen2, Gemma
    ("wi_0", "wi_1"),  # T5 v1.1
    ("w1", "w3"),  # Mixtral experts (module-per-expert checkpoints)
)
# cross-attention: the query reads the decoder's states, the keys and values the encoder's
CROSS_ATTENTION = {"encoder_attn", "EncDecAttention", "crossattention"}


def unit_kind(module: nn.Module) -> str | None:
    """Which kind of unit a module is, or None when it is not one the executor serves."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear) or patches.is_patch_conv(module):  # (a patch embedding is a Linear over patches)
        return LINEAR
    if isinstance(module, Conv1D):
        return CONV1D
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    return None


@dataclasses.dataclass
class Unit:
    id: str
    kind: str
    weight: torch.Tensor  # linear [out, in]; conv1d [in, out]; embedding [num, dim]
    bias: torch.Tensor | None
    in_features: int  # embedding: number of embeddings
    out_features: int
    padding_idx: int | None = None
    tied_to: str = ""
    fingerprint: str = ""
    members: tuple["Unit", ...] = ()  # a group unit: its members, whose weights are row slices of its own
    group: str = ""  # a member unit: its group's id
    rows: tuple[int, int] = (0, 0)  # a member unit: its rows [a, b) of the group's weight
    act: nn.Module | None = None  # an MLP unit: its activation; its members are (gate/up group, down)
    act_backward: collections.abc.Callable | None = None  # an MLP unit: act's backward op, (grad, x, out) -> out (None: autograd)
    act_mul: collections.abc.Callable | None = None  # an MLP unit on a GPU: fused act(gate) * up, gate_up -> product (None: torch's ops)
    norms: tuple = ()  # a span unit: copies of its layer's post-attention norm and the next layer's input norm (proto/layer_span.py)

    def info(self) -> pb.UnitInfo:
        return pb.UnitInfo(
            id=self.id,
            kind=self.kind,
            in_features=self.in_features,
            out_features=self.out_features,
            has_bias=self.bias is not None,
            tied_to=self.tied_to,
            fingerprint=self.fingerprint,
            padding_idx=-1 if self.padding_idx is None else self.padding_idx,
            members=[m.id for m in self.members],
        )


class UnitTable:
    """All units of one model. Holds the weights; nothing else of the model is kept."""

    def __init__(self, model: nn.Module):
        self.units: dict[str, Unit] = {}
        owner_of: dict[int, str] = {}
        # torch's MultiheadAttention hands its out_proj's weight to F.multi_head_attention_forward
        # instead of calling it (SigLIP's attention-pooling head): such a Linear stays with the tenant
        read_by_parent = {f"{path}.out_proj" if path else "out_proj"
                          for path, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
        for path, module in model.named_modules():
            kind = unit_kind(module)
            if kind is None or path in read_by_parent:
                continue
            tied = owner_of.setdefault(id(module.weight), path)
            # a tied unit shares its owner's tensor object, so moving or counting dedupes it
            w = module.weight.detach() if tied == path else self.units[tied].weight
            if kind == LINEAR and w.dim() > 2:
                w = patches.linear_weight(w)
            b = getattr(module, "bias", None)
            if kind == LINEAR:
                d_out, d_in = w.shape
            elif kind == CONV1D:
                d_in, d_out = w.shape
            else:
                d_in, d_out = w.shape
            self.units[path] = Unit(
                id=path,
                kind=kind,
                weight=w,
                bias=None if b is None else b.detach(),
                in_features=d_in,
                out_features=d_out,
                padding_idx=getattr(module, "padding_idx", None) if kind == EMBEDDING else None,
                tied_to="" if tied == path else tied,
                fingerprint="" if w.is_meta else fingerprint(w),  # (a lazy built-in's: models.seeded_fingerprints)
            )
        if not self.units:
            raise ValueError(f"{type(model).__name__} has no Linear, Conv1D or Embedding modules to serve")
        self._unit_param_names = set()
        for path in self.units:
            module = model.get_submodule(path)
            for pname, _ in module.named_parameters(recurse=False):
                self._unit_param_names.add(f"{path}.{pname}")
        for path, module in model.named_modules():
            for pname in experts.expert_params(module):
                self._add_experts(path, pname, getattr(module, pname).detach())
        for members in sibling_sets(self.units.values()):
            self._add_group(model, members)
        probes: dict = {}  # (a model's blocks of one kind and shape, probed once where their weights are on the meta device)
        for path, module in model.named_modules():
            layout = gated_mlp.layout(module)
            if layout is not None:
                self._add_mlp(path, module, layout, probes)

    def _add_experts(self, path: str, name: str, weight: torch.Tensor) -> None:
        """One Linear unit per expert of a 3-D expert weight [experts, out, in] (proto/experts.py):
        each unit's weight is a view of it, so they cost no memory of their own."""
        for e in range(weight.shape[0]):
            uid = experts.expert_unit(path, name, e)
            self.units[uid] = Unit(id=uid, kind=LINEAR, weight=weight[e], bias=None, in_features=weight.shape[2],
                                   out_features=weight.shape[1], fingerprint="" if weight.is_meta else fingerprint(weight[e]))
        self._unit_param_names.add(f"{path}.{name}" if path else name)

    def _add_group(self, model: nn.Module, members: list[Unit]) -> None:
        """A group unit over `members`: its weight is theirs stacked, [sum of out, in]; theirs
        become row slices of it, so the group costs no memory."""
        parent, _, _ = members[0].id.rpartition(".")
        names = ",".join(m.id.rpartition(".")[2] for m in members)
        group = Unit(
            id=f"{parent}.{{{names}}}" if parent else f"{{{names}}}",
            kind=LINEAR,
            weight=torch.cat([m.weight for m in members]),
            bias=None if members[0].bias is None else torch.cat([m.bias for m in members]),
            in_features=members[0].in_features,
            out_features=sum(m.out_features for m in members),
            members=tuple(members),
        )
        group.fingerprint = "" if group.weight.is_meta else fingerprint(group.weight)
        start = 0
        for m in members:
            m.group, m.rows = group.id, (start, start + m.out_features)
            start += m.out_features
        _point_members(group)
        # the loaded model's parameters become the same slices, so loading a model holds one copy
        # of these weights at a time, not two (the model stays in use for the skeleton)
        for m in members:
            module = model.get_submodule(m.id)
            module.weight.data = m.weight
            if m.bias is not None:
                module.bias.data = m.bias
        self.units[group.id] = group

    def _add_mlp(self, path: str, module: nn.Module, layout: gated_mlp.Layout, probes: dict) -> None:
        """An MLP unit for a gated MLP block whose gate and up are one Linear unit (Phi-3's
        gate_up_proj) or two siblings that make a group, when a probe shows the unit's forward
        (runner.run) equal to the block's own. Its members: that unit (gate's columns, then
        up's) and down. Weights on the meta device (made later, where served) are probed as a
        stand-in block of random weights, once for all blocks of one kind, shape and dtype."""
        from symbiont.base_executor import runner

        *gate_up, down = (self.units.get(f"{path}.{n}") for n in layout.linears)
        if len(gate_up) == 2:
            gate, up = gate_up
            pair = gate and self.units.get(gate.group)
            if pair is None or pair.members != (gate, up):
                return
        else:
            (pair,) = gate_up
            if pair is None or pair.kind != LINEAR or pair.tied_to or pair.out_features % 2:
                return
        if down is None or down.tied_to:
            return
        act = getattr(module, layout.act)
        unit = Unit(id=path, kind=MLP, weight=None, bias=None, in_features=down.out_features, out_features=down.out_features,
                    members=(pair, down), act=act, act_backward=runner.act_backward_of(act, down.weight.dtype))
        unit.fingerprint = f"{pair.fingerprint}+{down.fingerprint}" if pair.fingerprint and down.fingerprint else ""
        if down.weight.is_meta or pair.weight.is_meta:
            key = (type(module).__name__, repr(act), tuple(pair.weight.shape), tuple(down.weight.shape), down.weight.dtype,
                   pair.bias is not None, down.bias is not None)
            if key not in probes:
                probes[key] = _probe_stand_in(unit, module, layout)
            if not probes[key]:
                return
        elif not _same_forward(unit, module, torch.Generator().manual_seed(0)):
            return
        self.units[path] = unit

    def add_spans(self, model: nn.Module) -> int:
        """A span unit (proto/layer_span.py) for each decoder layer whose o_proj is a Linear unit,
        whose MLP is an MLP unit and whose norms are of a known class that layer_span.norm computes
        bitwise, and, but for the last layer of its list, whose next layer's q/k/v are a group unit.
        Its members: o_proj, the MLP unit and that group; it keeps copies of the two norms (for
        their epsilons: the weights come with each call). Returns how many."""
        n = 0
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        paths = {id(m): p for p, m in model.named_modules()}
        for layers in lists:
            if not layers or not all(layer_span.own(m, layer_span.DECODERS) for m in layers):
                continue
            for i, layer in enumerate(layers):
                path = paths[id(layer)]
                o = self.units.get(f"{path}.{layer_span.O_PROJ}")
                mlp = self.units.get(f"{path}.{layer_span.MLP}")
                post = getattr(layer, layer_span.POST_NORM, None)
                if o is None or o.kind != LINEAR or o.group or o.tied_to or mlp is None or mlp.kind != MLP:
                    continue
                norms, members = [post], [o, mlp]
                if i + 1 < len(layers):
                    nxt = paths[id(layers[i + 1])]
                    qkv = self.units.get(f"{nxt}.{layer_span.QKV}")
                    if qkv is None or not qkv.members:
                        continue
                    norms.append(getattr(layers[i + 1], layer_span.INPUT_NORM, None))
                    members.append(qkv)
                if not all(layer_span.own(m, layer_span.NORMS) and not any(p.is_meta for p in m.parameters())
                           and layer_span.norm_matches(m, o.weight.dtype) for m in norms):
                    continue
                d_in, d_out, _ = layer_span.widths(o.out_features, o.in_features, members[2].out_features if len(members) > 2 else 0, o.weight.dtype)
                self.units[layer_span.span_id(path)] = Unit(
                    id=layer_span.span_id(path), kind=SPAN, weight=None, bias=None, in_features=d_in, out_features=d_out,
                    members=tuple(members), norms=tuple(copy.deepcopy(m).requires_grad_(False) for m in norms),
                    fingerprint="+".join(m.fingerprint for m in members) + "|" + layer_span.norms_print(norms))
                n += 1
        return n

    def __len__(self) -> int:
        return len(self.units)

    def get(self, unit_id: str) -> Unit | None:
        return self.units.get(unit_id)

    def keep(self, ids) -> None:
        """Drops every unit not in `ids` (a rank of a sharded executor keeps its own; a group or
        MLP unit is kept with its members, a tied unit with its owner)."""
        ids = set(ids)
        self.units = {k: u for k, u in self.units.items() if k in ids}

    def to(self, device: torch.device, fuse_act: bool = True) -> "UnitTable":
        """Moves the unit weights to `device`; on a GPU, with `fuse_act`, gated MLP units get the
        fused act(gate) * up where a probe finds it bitwise torch's (runner.act_mul_of)."""
        moved: dict[int, torch.Tensor] = {}
        for u in self.units.values():
            if u.kind == SPAN:  # (its members are moved as units; its norms are its own)
                u.norms = tuple(m.to(device) for m in u.norms)
            if u.group or u.kind in (MLP, SPAN):  # moved with its group, below; an MLP or span unit holds only units
                continue
            u.weight = moved.setdefault(id(u.weight), u.weight.to(device))
            if u.bias is not None:
                u.bias = u.bias.to(device)
        for u in self.units.values():
            if u.members and u.kind not in (MLP, SPAN):
                _point_members(u)
        from symbiont.base_executor import runner

        probed: dict[tuple, object] = {}  # (one probe per activation, dtype and width)
        for u in self.units.values():
            if u.kind == MLP:
                pair, down = u.members
                key = (type(u.act), repr(u.act), down.weight.dtype, pair.out_features // 2)
                if fuse_act and key not in probed:
                    probed[key] = runner.act_mul_of(u.act, key[2], torch.device(device), key[3])
                u.act_mul = probed[key] if fuse_act else None
        return self

    def is_unit_param(self, name: str) -> bool:
        return name in self._unit_param_names

    def parameter_count(self) -> int:
        seen, n = set(), 0
        for u in self.units.values():
            if u.group or u.kind in (MLP, SPAN):  # its tensors are slices of its group's, or its members'
                continue
            for t in (u.weight, u.bias):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    n += t.numel()
        return n


def sibling_sets(units) -> list[list[Unit]]:
    """Sets of sibling Linear units that read the same input: one parent module, names from
    ATTENTION_SIBLINGS / MLP_SIBLINGS (in cross-attention, keys and values only), the same input
    width and dtype, all with a bias or none; no tied weights."""
    units = list(units)
    shared = {u.tied_to for u in units if u.tied_to}
    children: dict[str, dict[str, Unit]] = {}
    for u in units:
        if u.kind == LINEAR and not u.members and not u.tied_to and u.id not in shared:
            parent, _, name = u.id.rpartition(".")
            children.setdefault(parent, {})[name] = u
    sets = []
    for parent, by_name in children.items():
        cross = any(part in CROSS_ATTENTION for part in parent.split("."))
        for names in tuple(n[1:] if cross else n for n in ATTENTION_SIBLINGS) + MLP_SIBLINGS:
            members = [by_name.get(n) for n in names]
            if None in members:
                continue
            if len({(m.in_features, m.weight.dtype, m.bias is None) for m in members}) == 1:
                sets.append(members)
    return sets


def _probe_stand_in(unit: Unit, module: nn.Module, layout: gated_mlp.Layout) -> bool:
    """UnitTable._add_mlp's probe for a block whose weights are on the meta device: a copy of it
    with random weights (gate's and up's rows of one tensor, as the group's), and the MLP unit over
    those, give bitwise the same forward. It holds the block's weights once, in their dtype."""
    pair, down = unit.members
    stand = copy.deepcopy(module)  # (meta parameters stay meta, real ones and buffers are copied)
    g = torch.Generator().manual_seed(0)
    *gate_up, last = (stand.get_submodule(n) for n in layout.linears)
    with torch.no_grad():
        pair_weight = torch.empty(tuple(pair.weight.shape), dtype=pair.weight.dtype).normal_(0.0, 0.02, generator=g)
        start = 0
        for mod in gate_up:
            n = mod.weight.shape[0]
            mod.weight = nn.Parameter(pair_weight[start:start + n], requires_grad=False)
            start += n
        for mod in stand.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if p.is_meta:
                    mod._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype).normal_(0.0, 0.02, generator=g),
                                                         requires_grad=False)
        members = tuple(dataclasses.replace(m, weight=mod.weight, bias=mod.bias) for m, mod in zip(pair.members, gate_up))
        probe = dataclasses.replace(unit, members=(
            dataclasses.replace(pair, weight=pair_weight, members=members),
            dataclasses.replace(down, weight=last.weight, bias=last.bias)))
    return _same_forward(probe, stand, g)


def _same_forward(unit: Unit, module: nn.Module, g: torch.Generator) -> bool:
    """Whether an MLP unit's forward (runner.run) is bitwise its block's own, on random rows."""
    from symbiont.base_executor import runner

    x = torch.randn(3, unit.in_features, generator=g).to(unit.members[1].weight)
    with torch.no_grad():
        return torch.equal(runner.run(unit, pb.FORWARD, x, exact=True), module(x))


def _point_members(group: Unit) -> None:
    """Makes each member's weight and bias the rows [a, b) of its group's (views, no copy)."""
    for m in group.members:
        a, b = m.rows
        m.weight = group.weight[a:b]
        m.bias = None if group.bias is None else group.bias[a:b]


def skeleton(model: nn.Module, table: UnitTable, dtype: torch.dtype, tokenizer_files: dict[str, bytes]) -> pb.SkeletonReply:
    """Everything but the units: config, tokenizer files, and the small weights (norms, biases of
    non-unit modules, persistent buffers) as safetensors bytes."""
    from safetensors.torch import save

    state = {
        name: t.detach().contiguous().cpu()
        for name, t in model.state_dict().items()
        if not table.is_unit_param(name)
    }
    # tied parameters appear under several names; safetensors refuses shared storage
    seen: dict[int, str] = {}
    for name in list(state):
        ptr = state[name].data_ptr()
        if ptr in seen and state[name].numel() > 0:
            state[name] = state[name].clone()
        seen[ptr] = name
    return pb.SkeletonReply(
        config_json=config_json(model),
        dtype=dtype_enum(dtype),
        tokenizer_files=tokenizer_files,
        weights=save(state),
    )


def config_json(model: nn.Module) -> str:
    d = model.config.to_dict()
    d["architectures"] = [type(model).__name__]
    return json.dumps(d, sort_keys=True, default=str)
