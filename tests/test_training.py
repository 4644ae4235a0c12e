"""Fine-tuning through the executor: a plain PyTorch loop, gradient checkpointing, the HF Trainer."""
from __future__ import annotations

import pytest
import torch

from symbiont import virtualize
from tests.models import assert_grads_close, enable_checkpointing, ids, lora_grads, lora_model


def test_plain_loop_loss_falls(executor):
    model = virtualize(lora_model("tiny-llama"), executor.url)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    x = ids(4, 16, seed=7)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3 and losses[-1] == min(losses), losses


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_parity(executor, reentrant):
    models = [lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), executor.url)]
    x = ids(2, 11, seed=8)
    for m in models:
        enable_checkpointing(m, reentrant)
        m(input_ids=x, labels=x).loss.backward()
    assert models[1].base_model.model.model.gradient_checkpointing
    assert_grads_close(lora_grads(models[0]), lora_grads(models[1]))


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.x = ids(n, 12, seed=11)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _train(model, out_dir) -> dict[str, torch.Tensor]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(6))
    result = trainer.train()
    assert result.global_step == 3
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_hf_trainer_parity(executor, tmp_path):
    ref = _train(lora_model("tiny-llama"), tmp_path / "ref")
    got = _train(virtualize(lora_model("tiny-llama"), executor.url), tmp_path / "virt")
    start = {n: p.detach() for n, p in lora_model("tiny-llama").named_parameters() if p.requires_grad}
    assert ref.keys() == got.keys()
    for n in ref:
        moved = (ref[n] - start[n]).norm().item()
        assert moved > 0, f"{n} did not train"
        assert (ref[n] - got[n]).norm().item() <= 1e-5 * max(moved, 1e-12) + 1e-6 * ref[n].norm().item(), n
