"""PEFT LoRA adapters as the executor hosts them (base_executor/adapters.py): what a tenant's
`Connection.host_adapter` and the provider's `serve --adapters DIR` send, made from a PEFT
model's or a saved adapter directory's weights. Shared by both sides."""
from __future__ import annotations

import json
import pathlib

import torch

from symbiont.proto import codec
from symbiont.proto import executor_pb2 as pb


def peft_weights(state: dict[str, torch.Tensor], config: dict, adapter_name: str = "default") -> list[pb.AdapterWeight]:
    """The AdapterWeights of a PEFT LoRA adapter: its state dict (keys as PEFT saves them, or as a
    PeftModel holds them, of `adapter_name`) and its LoraConfig as a dict. Refuses what a plain
    low-rank delta cannot stand for."""
    peft_type = config.get("peft_type", "LORA")
    if str(getattr(peft_type, "value", peft_type)).upper() != "LORA" or config.get("use_dora"):
        raise ValueError("only plain LoRA adapters can be hosted (not DoRA, nor other PEFT methods)")
    alpha, alpha_pattern = float(config.get("lora_alpha", 8)), config.get("alpha_pattern") or {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        for part in ("lora_A", "lora_B"):
            path, marker, rest = key.partition(f".{part}.")
            if marker and rest in ("weight", f"{adapter_name}.weight"):
                path = path.removeprefix("base_model.model.")
                parts.setdefault(path, {})[part] = t
    if not parts:
        raise ValueError("the adapter holds no lora_A / lora_B weights")
    out = []
    for path, ab in sorted(parts.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"module {path!r} has {sorted(ab)} only")
        a, b = (ab[k].detach().contiguous().cpu() for k in ("lora_A", "lora_B"))
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"module {path!r}: LoRA of a {a.dim()}-d weight cannot be hosted")
        r = a.shape[0]
        mine = next((v for k, v in alpha_pattern.items() if path == k or path.endswith("." + k)), alpha)
        scale = float(mine) / (r**0.5 if config.get("use_rslora") else r)
        out.append(pb.AdapterWeight(unit=path, rank=r, dtype=codec.dtype_enum(a.dtype), a=_bytes(a), b=_bytes(b.to(a.dtype)), scale=scale))
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def load_peft_dir(directory: str | pathlib.Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A saved PEFT adapter: (its state dict, its adapter_config.json)."""
    directory = pathlib.Path(directory)
    config_path = directory / "adapter_config.json"
    if not config_path.exists():
        raise ValueError(f"{directory} holds no adapter_config.json (a PEFT adapter directory)")
    config = json.loads(config_path.read_text())
    if (directory / "adapter_model.safetensors").exists():
        from safetensors.torch import load_file

        state = load_file(str(directory / "adapter_model.safetensors"))
    elif (directory / "adapter_model.bin").exists():
        state = torch.load(directory / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{directory} holds no adapter_model.safetensors or adapter_model.bin")
    return state, config
