"""The unit table: every frozen Linear, GPT-2 Conv1D, Embedding and lm_head of the served model,
keyed by module path, tied weights deduplicated; and the skeleton a tenant builds its model from."""
from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn

from proto import executor_pb2 as pb
from proto.codec import dtype_enum
from proto.fingerprint import fingerprint

LINEAR, CONV1D, EMBEDDING = "linear", "conv1d", "embedding"


def unit_kind(module: nn.Module) -> str | None:
    """Which kind of unit a module is, or None when it is not one the executor serves."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
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
        )


class UnitTable:
    """All units of one model. Holds the weights; nothing else of the model is kept."""

    def __init__(self, model: nn.Module):
        self.units: dict[str, Unit] = {}
        owner_of: dict[int, str] = {}
        for path, module in model.named_modules():
            kind = unit_kind(module)
            if kind is None:
                continue
            tied = owner_of.setdefault(id(module.weight), path)
            # a tied unit shares its owner's tensor object, so moving or counting dedupes it
            w = module.weight.detach() if tied == path else self.units[tied].weight
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
                fingerprint=fingerprint(w),
            )
        if not self.units:
            raise ValueError(f"{type(model).__name__} has no Linear, Conv1D or Embedding modules to serve")
        self._unit_params = {id(p) for u in self.units.values() for p in (u.weight, u.bias) if p is not None}
        self._unit_param_names = set()
        for path in self.units:
            module = model.get_submodule(path)
            for pname, _ in module.named_parameters(recurse=False):
                self._unit_param_names.add(f"{path}.{pname}")

    def __len__(self) -> int:
        return len(self.units)

    def get(self, unit_id: str) -> Unit | None:
        return self.units.get(unit_id)

    def to(self, device: torch.device) -> "UnitTable":
        moved: dict[int, torch.Tensor] = {}
        for u in self.units.values():
            u.weight = moved.setdefault(id(u.weight), u.weight.to(device))
            if u.bias is not None:
                u.bias = u.bias.to(device)
        return self

    def is_unit_param(self, name: str) -> bool:
        return name in self._unit_param_names

    def parameter_count(self) -> int:
        seen, n = set(), 0
        for u in self.units.values():
            for t in (u.weight, u.bias):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    n += t.numel()
        return n


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
