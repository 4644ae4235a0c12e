"""Coverage: which of transformers' causal-LM model types symbiont serves exactly (issue 22).

    python benchmarks/coverage.py [--kind causal-lm|image-text-to-text] [--types llama,opt,...] [--jobs 2] [--timeout 240] [--tag TAG]

`--kind image-text-to-text` walks the vision-language types the same way, their sub-configs shrunk
too, on text inputs (no image: tests/test_vlm.py checks a LLaVA with images).

Per model type, in a process of its own with a time limit: a tiny config (transformers' defaults
for the type, shrunk: 2 layers, width 64, 4 heads, vocab 256, few experts), the model built from it
with seeded random weights and run once ("constructible" when both work); saved and served by a
real `base-executor` process; a fresh copy virtualized; then against the unsplit model: logits
bitwise, greedy tokens identical, LoRA gradients (all linear layers, r 4, dropout off; the attention's
linear layers where the unsplit PEFT model cannot train all, said in the row) within 1e-5 relative,
the loss a cross-entropy of the logits against the next ids. Both sides use transformers' eager
experts implementation (served MoE experts run it in the tenant).
Prints a table and the counts; writes coverage_<tag>.json into --out.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SMALL = {  # every field a config has of these is set so; the rest keep transformers' defaults
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64, "word_embed_proj_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "kv_channels": 16,
    "vocab_size": 256, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "num_experts_per_token": 2,
}

# types whose config validates a relation the shrink above breaks: the fields that restore it
CONSISTENT = {
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},  # their sum is the depth (4)
    "zaya": {"num_experts_per_tok": 1},  # ZAYA routes each token to one expert only
}


IMAGE_TOKEN = 250  # a vision-language model's image token id in the shrunk vocabulary (text ids stay below it)


def tiny_config(model_type: str, nested: bool = False):
    """With `nested`, the sub-configs are shrunk too (a vision-language model's text, vision, ...
    configs; the causal-LM walk leaves them as its published figures were measured)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config, model_type)
    for name in list(vars(config)) if nested else []:
        sub = getattr(config, name, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type") and sub is not config:
            _shrink(sub, getattr(sub, "model_type", ""))
    vision = getattr(config, "vision_config", None) if nested else None
    text = getattr(config, "text_config", None)
    if isinstance(getattr(vision, "out_hidden_size", None), int) and isinstance(getattr(text, "hidden_size", None), int):
        vision.out_hidden_size = text.hidden_size  # (the vision merger's output feeds the shrunk text model)
    for key in ("image_token_id", "image_token_index") if nested else ():  # (inside the shrunk vocabulary:
        v = getattr(config, key, None)  # the image check's prompts carry it; text prompts stay below IMAGE_TOKEN)
        if isinstance(v, int) and v >= IMAGE_TOKEN:
            setattr(config, key, IMAGE_TOKEN)
    return config


def _shrink(config, model_type: str) -> None:
    for key, value in SMALL.items():
        if hasattr(config, key) and isinstance(getattr(config, key), int):
            try:
                setattr(config, key, value)
            except AttributeError:  # (a property computed from the others)
                pass
    for key in [k for k in vars(config) if k.endswith(("layer_types", "block_types", "attention_layers"))]:
        v = getattr(config, key, None)  # (per-layer lists follow the depth)
        if isinstance(v, list) and len(v) > 2:
            setattr(config, key, v[:2])
    depth = getattr(config, "num_hidden_layers", None)
    for key in [k for k in vars(config) if k.endswith("_per_layer")]:
        v = getattr(config, key)  # (per-layer sizes follow the depth and the shrunk size)
        if isinstance(v, list) and isinstance(depth, int) and v and isinstance(v[0], int):
            setattr(config, key, [SMALL.get(key[: -len("_per_layer")], v[0])] * depth)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and model_type.endswith("_text"):  # (a VLM's text config: its multimodal rotary
        # sections, where it has them, must fill the shrunk rotary width; the models' defaults fill 128)
        half = int(SMALL["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
        rope["mrope_section"] = [half - 2 * (half // 4), half // 4, half // 4]
    for key, value in CONSISTENT.get(model_type, {}).items():
        setattr(config, key, value)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v >= 256:
            setattr(config, key, 2)


def linear_names(model) -> list[str]:
    """The leaf names of the model's Linear layers but the lm_head."""
    from torch import nn

    return sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)} - {"lm_head"})


def lora_target_tiers(model) -> list:
    """LoRA targets to try, widest first: every linear layer, then the attention's linear layers
    (for models whose PEFT refuses some layers, or whose Linear returns a tuple)."""
    from torch import nn

    attention = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                        if isinstance(m, nn.Linear) and any(p in n for p in ("attn", "attention"))})
    return ["all-linear"] + ([attention] if attention else [])


def lora_step(model, targets, x) -> dict:
    """One LoRA forward and backward (seeded adapters, eval mode so no dropout draws differ) with
    the loss taken from the logits here (some models' own loss needs inputs beyond input_ids);
    the adapters' gradients."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.models import lora_grads

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        m = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    m.eval()
    logits = m(input_ids=x).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)).backward()
    return lora_grads(m)


def _image_inputs(model, config):
    """An image and a prompt holding as many image tokens as the model makes of it: the vision
    tower's features counted by the model's own get_image_features (no processor needed); raises
    when the model wants more than pixel_values (grids, sizes, masks) or names no image token."""
    import torch

    vision = getattr(config, "vision_config", None)
    size = getattr(vision, "image_size", None)
    token = getattr(config, "image_token_id", None)
    token = getattr(config, "image_token_index", None) if token is None else token
    merge, temporal = getattr(vision, "spatial_merge_size", None), getattr(vision, "temporal_patch_size", None)
    if token is not None and merge and temporal:  # Qwen2-VL's kind: flattened patches, their grid, token types
        grid = torch.tensor([[1, 2 * merge, 2 * merge]])
        channels = getattr(vision, "in_channels", getattr(vision, "num_channels", 3))
        pixels = torch.randn(int(grid.prod()), channels * temporal * vision.patch_size**2, generator=torch.Generator().manual_seed(5))
        ids = torch.cat([torch.ones(1, 1, dtype=torch.long), torch.full((1, int(grid.prod()) // merge**2), int(token)),
                         torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(6))], 1)
        image = dict(pixel_values=pixels, image_grid_thw=grid)
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # (M-RoPE's token types, where asked)
            image["mm_token_type_ids"] = (ids == token).int()
        return ids, image
    if size is None or token is None:
        raise ValueError("no vision_config.image_size or image token id")
    h, w = (size[0], size[1]) if isinstance(size, (list, tuple)) else (size, size)
    pixels = torch.randn(1, getattr(vision, "num_channels", 3), h, w, generator=torch.Generator().manual_seed(5))
    inner = model.model if hasattr(model.model if hasattr(model, "model") else None, "get_image_features") else model
    extra = {"image_sizes": torch.tensor([[h, w]])} if "image_sizes" in inspect.signature(inner.get_image_features).parameters else {}
    with torch.no_grad():
        feats = inner.get_image_features(pixel_values=pixels, **extra)
    if hasattr(feats, "pooler_output") and not isinstance(feats, torch.Tensor):
        feats = feats.pooler_output if feats.pooler_output is not None else feats[0]
    parts = feats if isinstance(feats, (list, tuple)) else [feats]
    n = sum(p.reshape(-1, p.shape[-1]).shape[0] for p in parts)
    ids = torch.cat([torch.ones(1, 1, dtype=torch.long), torch.full((1, n), int(token)),
                     torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(6))], 1)
    return ids, dict(pixel_values=pixels, **extra)


def images_check(load, url: str, config) -> str:
    """With an image through the vision tower (served Linears and patch convolution): "exact"
    (logits within 1e-4 of the unsplit model's, the same greedy tokens), or why not."""
    import torch

    from symbiont import virtualize

    ref = load()
    try:
        ids, image = _image_inputs(ref, config)
        with torch.no_grad():
            want = ref(input_ids=ids, **image).logits
    except Exception as e:
        return f"no image input built: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    virt = virtualize(load(), url)
    with torch.no_grad():
        got = virt(input_ids=ids, **image).logits
    if not torch.allclose(want, got, rtol=1e-4, atol=1e-4):
        return f"logits differ: max |diff| {(want - got).abs().max().item():.3e}"
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    if not torch.equal(ref.generate(input_ids=ids, **image, **kw), virt.generate(input_ids=ids, **image, **kw)):
        return "greedy tokens differ"
    return "exact"


def check(model_type: str, kind: str = "causal-lm") -> dict:
    """One type, in this process: the first stage that fails and why, or stage "exact"."""
    import torch

    from symbiont.proto.automodel import auto_model_class

    from symbiont import virtualize
    from tests.conftest import running_executor

    stage = "config"
    try:
        config = tiny_config(model_type, nested=kind != "causal-lm")
        auto = auto_model_class(config)
        if kind == "image-text-to-text":  # (a type in both mappings is walked here as the vision-language model)
            from transformers import AutoModelForImageTextToText as auto
        stage = "build"

        def build():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return auto.from_config(config).float().eval()

        ref = build()
        x = torch.randint(3, 256 if kind == "causal-lm" else IMAGE_TOKEN, (2, 9), generator=torch.Generator().manual_seed(1))
        stage = "forward"
        with torch.no_grad():
            want = ref(input_ids=x).logits
        with tempfile.TemporaryDirectory() as d:
            stage = "save"
            ref.save_pretrained(d)
            # both sides load the checkpoint, as a user does, with the eager experts implementation (served
            # experts run it in the tenant: proto/experts.py; grouped_mm's other kernel is equal to rounding)
            load = lambda: auto.from_pretrained(d, experts_implementation="eager").float().eval()  # noqa: E731
            ref = load()
            with torch.no_grad():
                want = ref(input_ids=x).logits
            stage = "serve"
            with running_executor(d) as ex:
                stage = "virtualize"
                virt = virtualize(load(), ex.url)
                stage = "logits"
                with torch.no_grad():
                    got = virt(input_ids=x).logits
                if not torch.equal(want, got):
                    return {"stage": stage, "why": f"max |diff| {(want - got).abs().max().item():.3e}"}
                stage = "generate"
                kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
                if not torch.equal(ref.generate(x[:1], **kw), virt.generate(x[:1], **kw)):
                    return {"stage": stage, "why": "greedy tokens differ"}
                stage = "lora"
                fresh_ref = load
                fresh_virt = lambda: virtualize(fresh_ref(), ex.url)  # noqa: E731
                want_g, targets, tiers, ref_failure = None, None, lora_target_tiers(ref), ""
                while tiers:  # the first the unsplit model can train
                    targets = tiers.pop(0)
                    try:
                        want_g = lora_step(fresh_ref(), targets, x)
                        break
                    except Exception as e:  # (the unsplit PEFT model's own failure: try narrower targets)
                        ref_failure = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                        refused = re.search(r"Incompatible modules: \{([^}]*)\}", str(e))
                        if refused and targets == "all-linear":  # (PEFT names the layers it refuses)
                            names = {n.strip(" '\"") for n in refused.group(1).split(",")}
                            tiers.insert(0, [n for n in linear_names(ref) if n not in names])
                if want_g is None:
                    return {"stage": "lora-ref", "why": f"the unsplit model cannot be fine-tuned with LoRA: {ref_failure}"}
                try:
                    got_g = lora_step(fresh_virt(), targets, x)
                except RuntimeError as e:  # LoRA on served expert weights is refused by name: say so, then
                    if "(ParamWrapper)" not in str(e) or targets != "all-linear":  # check LoRA on the Linears
                        raise
                    refusal = str(e).split(". ", 1)[-1][:160]
                    targets = linear_names(ref)
                    want_g, got_g = lora_step(fresh_ref(), targets, x), lora_step(fresh_virt(), targets, x)
                    ref_failure = f"all-linear LoRA includes the served expert weights, refused: {refusal}"
                if want_g.keys() != got_g.keys() or not want_g:
                    return {"stage": stage, "why": "the adapters' parameters differ"}
                for name, g in want_g.items():  # (a gradient that is zero on both sides is equal)
                    err, scale = (g - got_g[name]).norm().item(), g.norm().item()
                    if err > 1e-5 * scale or (scale == 0 and got_g[name].norm().item() != 0):
                        return {"stage": stage, "why": f"{name}: |diff| {err:.3e}, |grad| {scale:.3e}"}
                if targets != "all-linear" and ref_failure.startswith("all-linear LoRA includes"):
                    return {"stage": "exact-linears", "why": f"LoRA on {targets} ({ref_failure})"}
                images = ""
                if kind == "image-text-to-text":  # (its outcome is reported beside the text checks', not instead)
                    try:
                        images = images_check(load, ex.url, config)
                    except Exception as e:
                        images = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if targets != "all-linear":
                    return {"stage": "exact", "why": f"LoRA on {targets} (the unsplit model fails with all-linear: {ref_failure})",
                            "images": images}
        return {"stage": "exact", "why": "", "images": images}
    except Exception as e:  # the stage says how far it got
        return {"stage": stage, "why": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def run_one(model_type: str, timeout: float, kind: str = "causal-lm") -> dict:
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, __file__, "--one", model_type, "--kind", kind], capture_output=True, text=True,
                             timeout=timeout, cwd=REPO)
        lines = [l for l in out.stdout.splitlines() if l.startswith("result ")]
        r = json.loads(lines[-1][len("result "):]) if lines else {"stage": "crash", "why": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
    except subprocess.TimeoutExpired:
        r = {"stage": "timeout", "why": f"over {timeout:.0f} s"}
    return {"type": model_type, **r, "seconds": round(time.monotonic() - t0, 1)}


CONSTRUCTED = ("save", "serve", "virtualize", "logits", "generate", "lora", "lora-ref", "exact-linears", "exact")  # stages reached only by a built, running model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--types", default="", help="comma-separated model types (default: every type of --kind)")
    p.add_argument("--kind", default="causal-lm", choices=["causal-lm", "image-text-to-text"],
                   help="which of transformers' auto mappings to walk; image-text-to-text types are checked on text inputs")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    if a.one:
        print("result " + json.dumps(check(a.one, a.kind)), flush=True)
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    mapping = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if a.kind == "causal-lm" else MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    types = a.types.split(",") if a.types else sorted(mapping)
    rows = []
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        for r in pool.map(lambda t: run_one(t, a.timeout, a.kind), types):
            rows.append(r)
            print(f"{r['type']:<28} {r['stage']:<10} {r['seconds']:>6.1f}s  {r['why']}", flush=True)
    built = [r for r in rows if r["stage"] in CONSTRUCTED]
    exact = [r for r in rows if r["stage"] == "exact"]
    linears = [r for r in rows if r["stage"] == "exact-linears"]
    if linears:
        print(f"{len(linears)} more exact with LoRA on their Linears only (all-linear LoRA on served expert weights is refused)")
    print(f"\n{len(exact)} exact of {len(built)} constructible ({len(rows)} {a.kind} types; the rest fail to build or "
          f"run from a shrunk default config)")
    if a.kind == "image-text-to-text":
        with_images = [r for r in exact if r.get("images") and not r["images"].startswith("no image input")]
        print(f"with an image: {sum(r['images'] == 'exact' for r in with_images)} exact of the {len(with_images)} exact ones "
              f"whose image input the harness could build from pixel_values alone")
        for r in exact:
            print(f"  {r['type']:<28} images: {r.get('images')}")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"coverage_{a.tag}.json"
    path.write_text(json.dumps({"kind": a.kind, "exact": len(exact), "constructible": len(built), "types": len(rows), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
