"""Privacy evaluation of noise masking (client/privacy.py) against a real executor on this host.

1. Exactness: the masked model's logits against the unsplit model's, per noise scale.
2. Fine-tuning: a short LoRA run (the same batches) masked at each scale against unmasked: the
   losses' largest difference.
3. An executor-side attacker reconstructing one unit's inputs x from what it receives (x + n,
   every call of a set of prompts), by relative error |x_hat - x| / |x| (1.0: nothing learnt; 0:
   everything) and the mean cosine of x_hat with x per token:
   - `read`: x_hat = what it receives;
   - `basis known` (effects="executor": the executor multiplied the basis itself at set-up):
     project the basis's span out;
   - `PCA`: estimate the noise's span as the top-`rank` principal directions of everything
     received, project it out (the attacker knows the rank);
   - `known inputs`: the attacker knows the inputs of the first calls (public prompts, say),
     takes the noise's span from them and projects it out of the rest;
   each for the mask's rank and for full-rank noise (rank = the unit's input width).

    python benchmarks/privacy_eval.py [--model tiny-llama] [--unit model.layers.0.self_attn.o_proj]

Prints tables and writes benchmarks/out/privacy_eval.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from symbiont.client.privacy import NoiseMask  # noqa: E402
from symbiont.proto import executor_pb2 as pb  # noqa: E402


TARGETS = {"tiny-gpt2": ["c_attn"], "tiny-phi3": ["qkv_proj"]}  # LoRA targets where not q_proj, v_proj


class Recording(NoiseMask):
    """A NoiseMask that keeps, for one unit's forward calls, each input and what was sent."""

    def __init__(self, unit: str, **kw):
        super().__init__(**kw)
        self.unit, self.seen = unit, []

    def call(self, ref, x, op, send):
        if ref.unit_id != self.unit or op != pb.FORWARD:
            return super().call(ref, x, op, send)

        def spy(v, take):
            self.seen.append((x.detach().reshape(-1, x.shape[-1]).float().clone(), v.detach().reshape(-1, v.shape[-1]).float().clone()))
            return send(v, take)

        return super().call(ref, x, op, spy)


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def project_out(v: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """v with the span of basis's rows removed."""
    q, _ = torch.linalg.qr(basis.T)  # [d, k] orthonormal
    return v - (v @ q) @ q.T


def scores(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(x_hat, x, dim=-1).mean().item()
    return {"rel_err": rel(x_hat, x), "cos": cos}


def attacks(mask: Recording, known: int) -> dict:
    x = torch.cat([a for a, _ in mask.seen])
    v = torch.cat([b for _, b in mask.seen])
    basis = mask._units[mask.unit].n
    k = basis.shape[0]
    out = {"read": scores(x, v), "basis known": scores(x, project_out(v, basis))}
    if k < x.shape[1]:
        _, _, vh = torch.linalg.svd(v, full_matrices=False)
        out["PCA"] = scores(x, project_out(v, vh[:k]))
        n_known = (v[:known] - x[:known])  # the noise of the calls whose inputs it knows
        _, _, vk = torch.linalg.svd(n_known, full_matrices=False)
        out["known inputs"] = scores(x[known:], project_out(v[known:], vk[: min(k, known)]))
    return out


def main() -> int:
    from symbiont import virtualize, wait_for_executor
    from symbiont.base_executor.models import load_model

    def build_builtin(name):  # (a built-in random model or a checkpoint, e.g. smollm2-135m's real weights)
        return load_model(name).model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--unit", default="model.layers.0.self_attn.o_proj")
    p.add_argument("--scales", default="0.1,1,10,100")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--known", type=int, default=64, help="tokens whose inputs the 'known inputs' attacker knows")
    a = p.parse_args()
    scales = [float(s) for s in a.scales.split(",")]
    url = f"local://privacy-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", a.model, "--listen", url],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = {"model": a.model, "unit": a.unit, "rank": a.rank, "prompts": a.prompts, "tokens": a.tokens,
              "date": time.strftime("%Y-%m-%d"), "exactness": {}, "finetune": {}, "attacks": {}}
    try:
        wait_for_executor(url, 300, proc)
        ref = build_builtin(a.model)
        weights = ref.state_dict()
        vocab = ref.config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, vocab, (a.prompts, a.tokens), generator=g)

        # 1. exactness
        with torch.no_grad():
            want = ref(prompts[:4]).logits
            for s in scales:
                m = virtualize(build_builtin(a.model), url, mask=NoiseMask(scale=s, rank=a.rank, weights=weights))
                result["exactness"][s] = rel(m(prompts[:4]).logits, want)

        # 2. a short fine-tuning run, the same batches
        from peft import LoraConfig, get_peft_model

        def losses(mask) -> list[float]:
            torch.manual_seed(1)
            model = get_peft_model(build_builtin(a.model), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS.get(a.model, ["q_proj", "v_proj"])))
            model = virtualize(model, url, mask=mask) if mask is not False else virtualize(model, url, whole_mlp=False)
            opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
            out = []
            for step in range(a.steps):
                batch = prompts[(2 * step) % a.prompts : (2 * step) % a.prompts + 2]
                opt.zero_grad()
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                opt.step()
                out.append(loss.item())
            return out

        plain = losses(False)
        result["finetune"]["unmasked"] = plain
        for s in scales:
            got = losses(NoiseMask(scale=s, rank=a.rank, weights=weights))
            result["finetune"][s] = {"losses": got, "max_abs_diff": max(abs(x - y) for x, y in zip(got, plain))}

        # 3. attacks, for the mask's rank and full rank
        d_in = ref.get_submodule(a.unit).weight.shape[1]
        for rank in (a.rank, d_in):
            for s in scales:
                mask = Recording(a.unit, scale=s, rank=rank, weights=weights)
                m = virtualize(build_builtin(a.model), url, mask=mask)
                with torch.no_grad():
                    for i in range(0, a.prompts, 8):
                        m(prompts[i : i + 8])
                result["attacks"][f"rank {rank}, scale {s}"] = attacks(mask, a.known)
    finally:
        proc.terminate()
        proc.wait(60)

    path = REPO / "benchmarks" / "out" / "privacy_eval.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"\nprivacy eval: {a.model}, unit {a.unit}, rank {a.rank}, {a.prompts} prompts x {a.tokens} tokens")
    print("scale   logits rel err   fine-tuning |loss diff| max (of %d steps)" % a.steps)
    for s in scales:
        print(f"{s:>6g}   {result['exactness'][s]:14.2e}   {result['finetune'][s]['max_abs_diff']:.2e}")
    print("\nattacker's reconstruction of x: relative error (cosine)")
    names = ["read", "basis known", "PCA", "known inputs"]
    print(f"{'noise':24s}" + "".join(f"{n:>22s}" for n in names))
    for key, r in result["attacks"].items():
        print(f"{key:24s}" + "".join(f"{r[n]['rel_err']:>13.3f} ({r[n]['cos']:5.2f})" if n in r else f"{'-':>22s}" for n in names))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
