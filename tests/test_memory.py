"""The executor keeps no activations: its private memory stays flat while a tenant trains with
growing sequence lengths and several training steps in flight at once.

A model big enough for stored activations to show is saved to a temporary directory and
served from there (the built-in tiny models would hide a leak in allocator noise). The tenant
loads the same directory and virtualizes it. After a warm-up step at the largest length (the
executor's allocator and the tenant's mailbox reach their working size), the tenant runs
forwards at growing lengths, keeping every graph alive — gradient accumulation, so every
step is in flight at once — then one backward through all of them, and all of that twice. An executor that stored
each linear unit's input for its backward would hold all of those inputs at the end of the
forwards; the test computes those bytes from the catalog and requires the executor's growth
while the steps are in flight to stay far below them, and the second round to add nothing
beyond the first. (The executor hands its heap's free pages back before it reports its memory,
so transient buffers, a whole-MLP backward's for one, do not count.)
"""
from __future__ import annotations

import time

import torch

from symbiont import connect, virtualize
from tests.conftest import running_executor

BATCH = 2
LENGTHS = [64, 128, 192, 256, 320, 384, 448, 512]
FRACTION = 0.1  # growth must stay under this share of what storing activations would take


def _save_model(path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)


def _stored_bytes_per_token(catalog) -> int:
    """What keeping every linear unit's input for its backward costs per token."""
    itemsize = torch.empty((), dtype=torch.float32).element_size()
    return sum(u.in_features for u in catalog.units if u.kind != "embedding" and not u.members) * itemsize


def _ids(seq: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 512, (BATCH, seq), generator=g)


def _rss(observer) -> int:
    time.sleep(0.2)  # the executor answers stats from its control thread; let the data loop settle
    return observer.stats().rss_anon_bytes


def test_executor_memory_flat_while_tenant_trains_longer_sequences(tmp_path):
    from transformers import AutoModelForCausalLM

    _save_model(tmp_path)
    with running_executor(str(tmp_path)) as ex, connect(ex.url) as conn, connect(ex.url) as observer:
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
        virtualize(model, conn)
        per_token = _stored_bytes_per_token(conn.catalog())

        # warm-up: one full step at the largest length
        model(input_ids=_ids(LENGTHS[-1], 0), labels=_ids(LENGTHS[-1], 0)).loss.backward()
        model.zero_grad(set_to_none=True)
        baseline = _rss(observer)

        def accumulate() -> list[int]:
            """The steps, every one in flight, then one backward: the executor's memory after each
            forward, and after the backward."""
            samples, losses = [], []
            for step, seq in enumerate(LENGTHS, start=1):
                x = _ids(seq, step)
                losses.append(model(input_ids=x, labels=x).loss)  # the graph stays alive: the step is in flight
                samples.append(_rss(observer))
            torch.stack(losses).sum().backward()
            samples.append(_rss(observer))
            assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
            model.zero_grad(set_to_none=True)
            return samples

        samples = accumulate()
        again = accumulate()  # the same steps once more: nothing of the first may have stayed

        growth = max(samples) - baseline  # while the steps are in flight, and after their backward
        kept = max(again) - samples[-1]  # what a second round adds to the first's high-water mark
        stored = per_token * BATCH * sum(LENGTHS)
        print(
            f"executor private memory: baseline {baseline / 2**20:.1f} MiB, growth {growth / 2**20:.2f} MiB "
            f"(samples {[round((s - baseline) / 2**20, 1) for s in samples]} MiB, again "
            f"{[round((s - baseline) / 2**20, 1) for s in again]} MiB); storing activations for "
            f"the {len(LENGTHS)} steps in flight would take {stored / 2**20:.1f} MiB"
        )
        assert growth < FRACTION * stored, (
            f"the executor's private memory grew by {growth / 2**20:.1f} MiB while (or after) the tenant had "
            f"{BATCH * sum(LENGTHS)} tokens of training in flight; storing their activations would take "
            f"{stored / 2**20:.1f} MiB, and the limit is {FRACTION:.0%} of that"
        )
        assert kept < FRACTION * stored, (
            f"a second round of the same steps grew the executor's private memory by {kept / 2**20:.1f} MiB more"
        )
