"""A vision task head on a shared vision-language model: one forward pass instead of decoding.

Builds a small LLaVA-style model (CLIP vision tower, projector, Llama) from a config with seeded
random weights, saves it, and starts `base-executor serve` on it. A tenant builds its model from
the executor alone (`connect(url).model()`: the vision tower's and projector's Linears are served,
and the patch convolution are served, the norms are the tenant's), puts a small classification head on the
hidden state of the prompt's last token, and trains the head together with a LoRA adapter on the
vision tower, through the executor, on a synthetic task: which quadrant of a 32 x 32 image holds a
bright square. Then it compares, per image, the head's answer (one forward pass) with generating
an answer of a few tokens as text (the way a chat model would say "top left"). CPU only; about a
minute on a 2-core machine.

    python examples/vision_head.py
    python examples/vision_head.py --steps 60 --answer-tokens 8
    python examples/vision_head.py --executor local://vlm   # a running executor of such a model
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

IMAGE_TOKEN, PATCHES, CLASSES = 250, 16, ("top left", "top right", "bottom left", "bottom right")


def tiny_llava(directory: str) -> None:
    """Saves a small LLaVA-style model with seeded random weights into `directory`."""
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                              patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-1)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(directory)


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n noisy 32 x 32 images, each with a bright 12 x 12 square in one quadrant; the quadrants."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    x = 0.3 * torch.randn(n, 3, 32, 32, generator=g)
    for i, q in enumerate(labels.tolist()):
        r, c = 16 * (q // 2) + 2, 16 * (q % 2) + 2
        x[i, :, r : r + 12, c : c + 12] += 2.0
    return x, labels


def prompt(n: int) -> torch.Tensor:
    """<bos> <image> x 16 "where is the square?" (made-up ids: the model has no tokenizer)."""
    question = torch.tensor([17, 42, 99, 7, 5])
    return torch.cat([torch.ones(1, dtype=torch.long), torch.full((PATCHES,), IMAGE_TOKEN), question]).expand(n, -1)


class Head(torch.nn.Module):
    """The task head: the prompt's last hidden state -> the four quadrants."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.out = torch.nn.Linear(width, len(CLASSES))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(hidden[:, -1]))


def run(url: str, steps: int, batch: int, answer_tokens: int) -> float:
    from peft import LoraConfig, get_peft_model

    from symbiont import connect

    conn = connect(url, name="vision-head")
    model = conn.model()  # built from the executor alone: no checkpoint here
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=r".*vision_tower.*(q_proj|v_proj)"))
    head = Head(model.config.text_config.hidden_size)
    params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        x, y = images(batch, seed=step)
        hidden = model(input_ids=prompt(batch), pixel_values=x, output_hidden_states=True).hidden_states[-1]
        loss = torch.nn.functional.cross_entropy(head(hidden), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps:
            print(f"step {step:3d}  loss {loss.item():.3f}  ({time.monotonic() - t0:.1f} s)", flush=True)

    model.eval()
    x, y = images(64, seed=10_000)  # held out
    with torch.no_grad():
        hidden = model(input_ids=prompt(len(x)), pixel_values=x, output_hidden_states=True).hidden_states[-1]
        accuracy = (head(hidden).argmax(-1) == y).float().mean().item()
        # one request per image, as a service sees them: the head's forward pass against decoding an answer
        t = time.perf_counter()
        for i in range(16):
            head(model(input_ids=prompt(1), pixel_values=x[i : i + 1], output_hidden_states=True).hidden_states[-1]).argmax(-1)
        head_ms = (time.perf_counter() - t) * 1e3 / 16
        t = time.perf_counter()
        for i in range(16):
            model.generate(input_ids=prompt(1), pixel_values=x[i : i + 1], max_new_tokens=answer_tokens,
                           min_new_tokens=answer_tokens, do_sample=False, pad_token_id=0)
        text_ms = (time.perf_counter() - t) * 1e3 / 16
    print(f"held-out accuracy of the head: {accuracy:.0%} (chance 25%)")
    print(f"per image, one request each: the head {head_ms:.1f} ms (one forward pass); an answer of {answer_tokens} tokens "
          f"as text {text_ms:.1f} ms ({text_ms / head_ms:.1f}x the head)")
    conn.close()
    return accuracy


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--executor", help="address of a running executor of a LLaVA-style model (default: start one)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--answer-tokens", type=int, default=4)
    a = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        executor, url = None, a.executor
        if url is None:
            tiny_llava(tmp)
            url = f"local://vision-head-{os.getpid()}"
            cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", tmp, "--listen", url]
            executor = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            threading.Thread(target=lambda: [print(f"[executor] {l}", end="", flush=True) for l in executor.stdout], daemon=True).start()
        try:
            from symbiont import wait_for_executor

            wait_for_executor(url, 300, executor)
            run(url, a.steps, a.batch, a.answer_tokens)
        finally:
            if executor is not None:
                executor.terminate()
                executor.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
