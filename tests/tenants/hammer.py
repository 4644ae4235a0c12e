"""One tenant of the concurrency test: hammers an executor with a mix of inference forwards
and LoRA training steps for a bounded time, checking every result against its own unsplit
copy of the model.

    python tests/tenants/hammer.py URL SEED GO_FILE SECONDS

Builds the reference (build_builtin("tiny-llama") + a seeded LoRA) and the same model with its
base virtualized at URL (LoRA added after virtualize for even seeds, before for odd ones),
prints `ready`, waits until GO_FILE exists, then for SECONDS picks at random:

  forward  no_grad, random batch and sequence length: logits must be bitwise equal;
  train    loss.backward() on inputs_embeds that require grad: logits bitwise, the input
           gradient and every LoRA gradient within 1e-5 relative.

Prints one JSON line {"seed", "forwards", "train_steps", "failures"} and exits 1 if any check
failed or anything raised.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback

import torch

from symbiont.base_executor.models import build_builtin
from symbiont import connect, virtualize

MODEL = "tiny-llama"
RTOL = 1e-5


def lora(base, seed: int):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + seed)
        return get_peft_model(base, config)


def relative_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    scale = ref.norm().item()
    return (ref - got).norm().item() / scale if scale else float((ref - got).abs().max())


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def main(url: str, seed: int, go_file: str, seconds: float) -> int:
    conn = connect(url, name=f"hammer-{seed}")
    ref = lora(build_builtin(MODEL), seed)
    if seed % 2 == 0:
        virt = virtualize(lora(build_builtin(MODEL), seed), conn)
    else:
        virt = lora(virtualize(build_builtin(MODEL), conn), seed)
    ref.eval()
    virt.eval()
    embed_ref = ref.get_base_model().model.embed_tokens
    embed_virt = virt.get_base_model().model.embed_tokens
    print("ready", flush=True)

    deadline = time.monotonic() + 120
    while not os.path.exists(go_file):
        if time.monotonic() > deadline:
            print(json.dumps({"seed": seed, "error": "never told to start"}), flush=True)
            return 1
        time.sleep(0.02)

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = {"forwards": 0, "train_steps": 0}
    failures: list[str] = []
    stop = time.monotonic() + seconds
    try:
        while time.monotonic() < stop and len(failures) < 5:
            batch, seq = rng.randint(1, 3), rng.randint(1, 24)
            ids = torch.randint(0, 256, (batch, seq), generator=gen)
            if rng.random() < 0.5:
                with torch.no_grad():
                    a, b = ref(input_ids=ids).logits, virt(input_ids=ids).logits
                if not torch.equal(a, b):
                    failures.append(f"forward {list(ids.shape)}: logits differ, max |diff| {(a - b).abs().max().item():.3e}")
                counts["forwards"] += 1
                continue
            with torch.no_grad():
                e_ref, e_virt = embed_ref(ids), embed_virt(ids)
            if not torch.equal(e_ref, e_virt):
                failures.append(f"train {list(ids.shape)}: embeddings differ")
            grads = []
            for model in (ref, virt):
                model.zero_grad(set_to_none=True)
                e = e_ref.clone().requires_grad_(True)
                out = model(inputs_embeds=e, labels=ids)
                out.loss.backward()
                grads.append((out.logits.detach(), e.grad, lora_grads(model)))
            (la, ga, lga), (lb, gb, lgb) = grads
            if not torch.equal(la, lb):
                failures.append(f"train {list(ids.shape)}: logits differ, max |diff| {(la - lb).abs().max().item():.3e}")
            # relative to the gradient's norm, as for the LoRA gradients: fused q/k/v (gate/up) make
            # one grad_x GEMM where the unsplit model adds three, so an element near zero may
            # differ by more than 1e-5 of itself
            if relative_error(ga, gb) > RTOL:
                failures.append(f"train {list(ids.shape)}: input gradient differs, relative {relative_error(ga, gb):.3e}")
            if lga.keys() != lgb.keys() or not lga:
                failures.append(f"train: LoRA parameters with gradients differ: {sorted(lga)} vs {sorted(lgb)}")
            for name in lga.keys() & lgb.keys():
                if relative_error(lga[name], lgb[name]) > RTOL:
                    failures.append(f"train {list(ids.shape)}: {name} gradient relative error {relative_error(lga[name], lgb[name]):.3e}")
            counts["train_steps"] += 1
    except Exception:
        failures.append(traceback.format_exc())
    conn.close()
    print(json.dumps({"seed": seed, **counts, "failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
