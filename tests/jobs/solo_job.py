"""A tenant job for the multi-tenant tests: `train` runs LoRA SGD steps, `generate` greedy
decodes a few prompts, `steps` too with its decoding steps replayed as CUDA graphs (a same-GPU
tenant: virtualize(step_graphs=True)), `csteps` with them captured from the compiled forward
(step_graphs="compiled"), `hsteps` as `steps` with the tenant's adapter hosted by the executor
(hosted_lora); each saves what it computed to --out."""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from symbiont.base_executor.models import build_builtin  # noqa: E402
from symbiont import virtualize  # noqa: E402
from tests.models import ids, lora_model  # noqa: E402


def barrier(folder: str | None, name: str, parties: int) -> None:
    """Waits until `parties` jobs have reached this point (each leaves a file in `folder`), so
    jobs that build their models at different speeds still run their loops at the same time."""
    if not folder:
        return
    open(os.path.join(folder, name), "w").close()  # (names differ per job)
    deadline = time.monotonic() + 120
    while len(os.listdir(folder)) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(os.listdir(folder))} of {parties} jobs reached the barrier")
        time.sleep(0.01)


def gpu_lora_model(url: str, device: str, seed: int):
    """A same-GPU tenant built from the executor's skeleton, LoRA on q and v with a rank that
    depends on the seed (8, 16, 32, 64 as in S2) and random A and B."""
    from peft import LoraConfig, get_peft_model

    from symbiont import connect

    base = connect(url).model(device=device, attn_implementation="eager")
    rank = 8 << (seed % 4)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        lora_dropout=0.0)
    return get_peft_model(base, config)


def train(url: str, steps: int, sync=lambda: None, device: str = "cpu", seed: int = 0) -> dict:
    if device == "cpu":
        model, seq = virtualize(lora_model("tiny-llama"), url), 8
    else:
        model, seq = gpu_lora_model(url, device, seed), 48
    sync()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for step in range(steps):
        x = ids(2, seq + step % 5, seed=100 + step + 1000 * seed).to(device)
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    out = {f"param:{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad}
    out.update({f"grad:{n}": p.grad.detach() for n, p in model.named_parameters() if p.requires_grad})
    out["losses"] = torch.stack(losses)
    out = {k: v.cpu() for k, v in out.items()}
    return out


def generate(url: str, prompts: int, sync=lambda: None, device: str = "cpu", seed: int = 0) -> dict:
    model = virtualize(build_builtin("tiny-llama").to(device), url)
    sync()
    out = {}
    for i in range(prompts):
        prompt = ids(1, 4 + i % 3, seed=200 + i + 1000 * seed).to(device)
        out[f"tokens:{i}"] = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            out[f"logits:{i}"] = model(out[f"tokens:{i}"]).logits
    return {k: v.cpu() for k, v in out.items()}


def hosted_lora(seed: int, base=None):
    """The adapter an `hsteps` job hosts: LoRA on q, k, v, o of a rank that depends on the seed
    (8, 16, 32, 64), random A and B (on `base`, or the built-in tiny-llama)."""
    from peft import LoraConfig, get_peft_model

    rank = 8 << (seed % 4)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False, lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(50 + seed)
        return get_peft_model(build_builtin("tiny-llama") if base is None else base, config)


def steps(url: str, prompts: int, sync=lambda: None, device: str = "cuda:0", seed: int = 0, graphs=True,
          hosted: bool = False) -> dict:
    if hosted:
        from symbiont import connect

        url = connect(url)
        url.host_adapter(f"mine{seed}", hosted_lora(seed), device=device)
    model = virtualize(build_builtin("tiny-llama").to(device), url, step_graphs=graphs,
                       **(dict(adapter=f"mine{seed}") if hosted else {}))
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True,
              output_scores=True, return_dict_in_generate=True)
    model.generate(ids(1, 6, seed=1000 * seed).to(device), **kw)  # (its steps captured before the others meet)
    sync()
    out = {}
    for i in range(prompts):
        got = model.generate(ids(1, 6, seed=300 + i + 1000 * seed).to(device), **kw)
        out[f"tokens:{i}"] = got.sequences
        out[f"scores:{i}"] = torch.stack(got.scores)
    out["replays"] = torch.tensor(model.forward.replays)
    return {k: v.cpu() for k, v in out.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--mode", choices=["train", "generate", "steps", "csteps", "hsteps"], required=True)
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--out", required=True)
    p.add_argument("--barrier", default=None, help="a folder the jobs meet in before their loops")
    p.add_argument("--parties", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cuda:N: a same-GPU tenant (train: built from the skeleton)")
    p.add_argument("--seed", type=int, default=0, help="the data (train on cuda: also the adapter's rank and init)")
    p.add_argument("--spin-warps", type=int, default=None, help="steps: warps of each handover's wait (graph_words.SPIN_WARPS)")
    a = p.parse_args()
    if a.spin_warps is not None:
        from symbiont.client.transports import graph_words

        graph_words.SPIN_WARPS = a.spin_warps
    sync = lambda: barrier(a.barrier, f"{a.mode}-{a.seed}", a.parties)  # noqa: E731
    compiled_steps = functools.partial(steps, graphs="compiled")
    hosted_steps = functools.partial(steps, hosted=True)
    result = {"train": train, "generate": generate, "steps": steps, "csteps": compiled_steps, "hsteps": hosted_steps}[a.mode](
        a.url, a.n, sync, a.device, a.seed)
    torch.save(result, a.out)
