"""A save_pretrained directory read tensor by tensor, for a rank of a sharded executor: the model is
built with its unit weights on the meta device, everything else (norms, biases, buffers) is read
from the checkpoint, and each rank then reads only the weights of the units it serves
(models.fill_units), so no process ever holds the whole model. The fingerprints of every unit are
computed from the elements they sample, read from the memory-mapped files (proto/fingerprint.py):
the same as the whole model's, at a few pages per unit.

`open_rank_only` says None where the directory is not such a checkpoint (no safetensors files, or
names, dtypes or weights this reading does not cover); the executor then loads the model whole."""
from __future__ import annotations

import json
import logging
import pathlib
import struct

import numpy as np
import torch

from symbiont.proto import meta
from symbiont.proto.fingerprint import digest, sample_indices

log = logging.getLogger("base_executor")

_NUMPY = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.uint16, torch.bfloat16),
          "F64": (np.float64, torch.float64)}


class Checkpoint:
    """The tensors of a directory's safetensors files: where each lies, read one at a time."""

    def __init__(self, path: pathlib.Path):
        index = path / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
        self._where: dict[str, tuple[pathlib.Path, dict, int]] = {}  # key -> (file, its header entry, data start)
        for name in files:
            f = path / name
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                self._where[key] = (f, entry, 8 + n)
        self._maps: dict[pathlib.Path, np.memmap] = {}

    @staticmethod
    def found(path: pathlib.Path) -> bool:
        return (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key][1]["shape"])

    def readable(self, key: str) -> bool:
        return key in self._where and self._where[key][1]["dtype"] in _NUMPY

    def tensor(self, key: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """The whole tensor, in `dtype` on `device` (one copy of it in host memory on the way)."""
        f, entry, start = self._where[key]
        np_dtype, torch_dtype = _NUMPY[entry["dtype"]]
        a, b = entry["data_offsets"]
        with open(f, "rb") as fh:
            fh.seek(start + a)
            raw = bytearray(fh.read(b - a))
        t = torch.frombuffer(raw, dtype=torch_dtype) if raw else torch.empty(0, dtype=torch_dtype)
        return t.view(entry["shape"]).to(device=device, dtype=dtype)

    def sample(self, key: str, flat: np.ndarray) -> torch.Tensor:
        """The elements at flat indices `flat` of a tensor, in its stored dtype: only their pages read."""
        f, entry, start = self._where[key]
        np_dtype, torch_dtype = _NUMPY[entry["dtype"]]
        mm = self._maps.get(f)
        if mm is None:
            mm = self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        a, b = entry["data_offsets"]
        values = np.frombuffer(mm, dtype=np_dtype, count=(b - a) // np.dtype(np_dtype).itemsize, offset=start + a)
        return torch.from_numpy(values[flat].copy()).view(torch_dtype)

    # ---- the executor's source of unit weights (models.fill_units) ------------------------------

    verb = "read"

    def weight(self, path: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = f"{path}.weight"
        if self.shape(key) != tuple(shape):
            raise ValueError(f"checkpoint tensor {key}: shape {self.shape(key)}, the model's unit {tuple(shape)}")
        return self.tensor(key, dtype, device)

    def fingerprints(self, table, device: torch.device) -> None:
        """Every unit's fingerprint, as the whole model's table would have it, from sampled elements."""
        from symbiont.base_executor import catalog as cat

        for u in table.units.values():
            if u.fingerprint or u.kind == cat.MLP or u.tied_to:
                continue
            parts = [(m.id, m.rows[0], m.rows[1]) for m in u.members] if u.members else [(u.id, 0, u.weight.shape[0])]
            shape = tuple(u.weight.shape)
            cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            flat = sample_indices(int(np.prod(shape))).numpy()
            rows = flat // cols
            sample = torch.empty(len(flat), dtype=u.weight.dtype)
            for path, a, b in parts:  # (a group's weight is its members' stacked along rows)
                sel = (rows >= a) & (rows < b)
                if sel.any():
                    sample[torch.from_numpy(sel)] = self.sample(f"{path}.weight", flat[sel] - a * cols).to(u.weight.dtype)
            u.fingerprint = digest(shape, u.weight.dtype, sample)
        for u in table.units.values():
            if u.tied_to and not u.fingerprint and u.tied_to in table.units:
                u.fingerprint = table.units[u.tied_to].fingerprint
            elif u.kind == cat.MLP and not u.fingerprint:
                u.fingerprint = "+".join(m.fingerprint for m in u.members)


def open_rank_only(path: pathlib.Path, dtype: torch.dtype):
    """(the model with its unit weights on the meta device and everything else read, the Checkpoint)
    for a directory this reading covers, else None (the reason logged)."""
    from transformers import AutoConfig, GenerationConfig

    from symbiont.base_executor import catalog as cat
    from symbiont.proto import experts
    from symbiont.proto.automodel import auto_model_class

    if not Checkpoint.found(path):
        return None
    ckpt = Checkpoint(path)
    config = AutoConfig.from_pretrained(path)
    with meta.parameters_on_meta(meta.matrices):
        model = auto_model_class(config).from_config(config, dtype=dtype).eval()
    why = None
    units = {id(m.weight) for _, m in model.named_modules() if cat.unit_kind(m) is not None}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # (a tied parameter: read under its first name)
            continue
        seen.add(id(p))
        module = model.get_submodule(name.rpartition(".")[0])
        if experts.expert_params(module) or p.dim() > 2:
            why = f"{name}: expert or multi-dimensional weights"
        elif not ckpt.readable(name):
            why = f"{name} is not a tensor of the checkpoint it can read"
        elif ckpt.shape(name) != tuple(p.shape):
            why = f"{name}: shape {ckpt.shape(name)} in the checkpoint, {tuple(p.shape)} in the model"
        elif p.is_meta and id(p) not in units:
            why = f"{name}: a weight of two or more dimensions that is not a unit's"
        if why:
            log.info("reading %s whole on every rank (%s)", path, why)
            return None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_meta:
                p.copy_(ckpt.tensor(name, p.dtype))
        for name, b in model.named_buffers():
            if name in ckpt:
                b.copy_(ckpt.tensor(name, b.dtype))
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model, ckpt
