"""A save_pretrained directory read tensor by tensor, for a rank of a sharded executor: the model is
built with its unit weights on the meta device, everything else (norms, biases, buffers) is read
from the checkpoint, and each rank then reads only the weights of the units it serves
(models.fill_units), so no process ever holds the whole model. The fingerprints of every unit are
computed from the elements they sample, read from the memory-mapped files with read-ahead off
(proto/fingerprint.py): the same as the whole model's, at one page per sampled element.

`open_rank_only` says None where the directory is not such a checkpoint (no safetensors files, or
names, dtypes or weights this reading does not cover); the executor then loads the model whole."""
from __future__ import annotations

import json
import logging
import mmap
import pathlib
import struct

import numpy as np
import torch

from symbiont.proto import meta
from symbiont.proto.fingerprint import digest, sample_indices

log = logging.getLogger("base_executor")

MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one (a Git LFS pointer, a truncated file)

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
            size = f.stat().st_size
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8)) if size >= 8 else (size,)
                if not 0 < n <= min(MAX_HEADER, size - 8):
                    raise ValueError(f"{f}: not a safetensors file (header of {n} bytes in {size})")
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                a, b = entry["data_offsets"]
                numel = int(np.prod(entry["shape"])) if entry["shape"] else 1
                width = np.dtype(_NUMPY[entry["dtype"]][0]).itemsize if entry["dtype"] in _NUMPY else None
                if not 0 <= a <= b <= size - 8 - n or (width is not None and b - a != numel * width):
                    raise ValueError(f"{f}: tensor {key} lies outside the file or disagrees with its shape")
                self._where[key] = (f, entry, 8 + n)
        self._maps: dict[pathlib.Path, mmap.mmap] = {}

    @staticmethod
    def found(path: pathlib.Path) -> bool:
        return (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key][1]["shape"])

    def readable(self, key: str) -> bool:
        return key in self._where and self._where[key][1]["dtype"] in _NUMPY

    def tensor(self, key: str, dtype: torch.dtype, device: torch.device | str = "cpu",
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or its rows [a, b), in `dtype` on `device` (one copy of what is read in host
        memory on the way)."""
        f, entry, start = self._where[key]
        np_dtype, torch_dtype = _NUMPY[entry["dtype"]]
        shape = list(entry["shape"])
        a, b = entry["data_offsets"]
        if rows is not None and shape:  # (rows are contiguous: only theirs read)
            row_bytes = (b - a) // shape[0] if shape[0] else 0
            a, b = a + rows[0] * row_bytes, a + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        raw = bytearray(b - a)  # (read into: one copy in host memory, converted on the device)
        with open(f, "rb") as fh:
            fh.seek(start + a)
            if fh.readinto(raw) != b - a:
                raise ValueError(f"{f}: tensor {key} is cut short")
        t = torch.frombuffer(raw, dtype=torch_dtype) if raw else torch.empty(0, dtype=torch_dtype)
        return t.view(shape).to(device=device).to(dtype=dtype)

    def sample(self, key: str, flat: np.ndarray) -> torch.Tensor:
        """The elements at flat indices `flat` of a tensor, in its stored dtype: only their pages read."""
        f, entry, start = self._where[key]
        np_dtype, torch_dtype = _NUMPY[entry["dtype"]]
        mm = self._maps.get(f)
        if mm is None:
            with open(f, "rb") as fh:
                mm = self._maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_RANDOM"):  # (else the kernel reads ahead ~128 KiB around each sampled element)
                mm.madvise(mmap.MADV_RANDOM)
        a, b = entry["data_offsets"]
        values = np.frombuffer(mm, dtype=np_dtype, count=(b - a) // np.dtype(np_dtype).itemsize, offset=start + a)
        return torch.from_numpy(values[flat].copy()).view(torch_dtype)

    # ---- the executor's source of unit weights (models.fill_units) ------------------------------

    verb = "read"

    def part(self, path: str, shape: tuple[int, ...], rows: tuple[int, int], cols: tuple[int, int], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """Rows and columns of the unit's weight: only those rows read (all their columns, then kept)."""
        key = f"{path}.weight"
        if self.shape(key) != tuple(shape):
            raise ValueError(f"checkpoint tensor {key}: shape {self.shape(key)}, the model's unit {tuple(shape)}")
        t = self.tensor(key, dtype, device, rows)
        return t if cols == (0, shape[1]) else t[:, cols[0]:cols[1]].contiguous()

    def fingerprints(self, table, device: torch.device) -> None:
        """Every unit's fingerprint, as the whole model's table would have it, from sampled elements."""
        from symbiont.base_executor import catalog as cat

        for u in table.units.values():
            if u.fingerprint or u.kind in (cat.MLP, cat.SPAN) or u.tied_to:
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
        for mm in self._maps.values():  # (sampling is done: the maps go)
            mm.close()
        self._maps.clear()


def open_rank_only(path: pathlib.Path, dtype: torch.dtype):
    """(the model with its unit weights on the meta device and everything else read, the Checkpoint)
    for a directory this reading covers, else None (the reason logged)."""
    from transformers import AutoConfig, GenerationConfig

    from symbiont.base_executor import catalog as cat
    from symbiont.proto import experts
    from symbiont.proto.automodel import auto_model_class

    if not Checkpoint.found(path):
        return None
    try:
        ckpt = Checkpoint(path)
    except (OSError, ValueError, KeyError) as e:
        log.info("reading %s whole on every rank (%s)", path, e)
        return None
    config = AutoConfig.from_pretrained(path)
    with meta.parameters_on_meta(meta.matrices):
        model = auto_model_class(config).from_config(config, dtype=dtype).eval()
    why = None
    if getattr(config, "quantization_config", None) or model._keep_in_fp32_modules or getattr(model, "_keep_in_fp32_modules_strict", None):
        why = "quantized, or parameters transformers keeps in float32"
    units = {id(m.weight) for _, m in model.named_modules() if cat.unit_kind(m) is not None}
    seen = set()
    persistent = model.state_dict().keys()
    for name, p in model.named_parameters(remove_duplicate=False):
        if why:
            break
        if id(p) in seen:  # (a tied parameter: read under its first name; transformers unties it if both are saved)
            if name in ckpt:
                why = f"{name} is tied in the model and saved on its own"
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
    for name, b in model.named_buffers():
        if why:
            break
        if name in ckpt and name in persistent and (not ckpt.readable(name) or ckpt.shape(name) != tuple(b.shape)):
            why = f"buffer {name}: not readable, or shape {ckpt.shape(name)} in the checkpoint, {tuple(b.shape)} in the model"
    if why:
        log.info("reading %s whole on every rank (%s)", path, why)
        return None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_meta:
                p.copy_(ckpt.tensor(name, p.dtype))
        for name, b in model.named_buffers():
            if name in ckpt and name in persistent:  # (transformers ignores a saved non-persistent buffer)
                b.copy_(ckpt.tensor(name, b.dtype))
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model, ckpt
