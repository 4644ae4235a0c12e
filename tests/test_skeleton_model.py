"""connect(url).model(device=, dtype=, build=): a tenant built from the executor's skeleton alone.

The unit weights are never materialised anywhere: the peak memory of building a `llama-1b` tenant
is its non-unit weights, buffers and mailbox, not the model (a CPU test here, a GPU test with
torch's allocator peak in test_gpu.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from symbiont import RemoteWeight, connect
from tests.conftest import REPO, running_executor
from tests.models import ids

# what the tenant's peak memory may grow by beyond its non-unit weights, buffers and mailbox while
# it builds the model: the skeleton's decoded copy, the model's Python objects and the allocator's
# slack. Measured 2026-11-24 on a 2-core CPU machine: 8.6 MiB in all (the test prints it).
SLACK_BYTES = 64 << 20


class MyLlama(LlamaForCausalLM):
    """A user's own model class: the same modules as the served model, its own Python."""

    def __init__(self, config):
        super().__init__(config)
        self.built_by_user = True


def test_model_from_a_users_class_equals_the_default(executor_for):
    ex = executor_for("tiny-llama")
    with connect(ex.url) as a, connect(ex.url) as b:
        default = a.model(attn_implementation="eager")
        mine = b.model(build=MyLlama, attn_implementation="eager")
        assert isinstance(mine, MyLlama) and mine.built_by_user
        x = ids(2, 9)
        with torch.no_grad():
            assert torch.equal(default(x).logits, mine(x).logits)
        assert all(p.device.type == "cpu" for p in mine.parameters())


def test_model_in_another_dtype_is_refused(executor):
    with connect(executor.url) as conn:
        with pytest.raises(ValueError, match="serves torch.float32"):
            conn.model(dtype=torch.bfloat16)
        assert conn.model(dtype=torch.float32) is not None


def test_units_are_placeholders_on_the_tenants_device(executor):
    with connect(executor.url) as conn:
        model = conn.model()
        shims = [p for p in model.parameters() if isinstance(p, RemoteWeight)]
        assert shims and all(p.device.type == "cpu" for p in shims)
        with pytest.raises(RuntimeError, match="executor"):
            shims[0].sum()


@pytest.mark.slow
def test_llama_1b_cpu_tenant_peak_memory_is_the_non_unit_weights():
    """A CPU tenant of `llama-1b` (bf16: 2.5 GB of unit weights) built from the skeleton: its peak
    resident memory grows by its non-unit weights, buffers and mailbox plus a measured slack."""
    with running_executor("llama-1b", "--dtype", "bfloat16") as ex:
        out = subprocess.run(
            [sys.executable, os.path.join(REPO, "tests", "tenants", "skeleton_peak.py"), ex.url, "cpu"],
            capture_output=True, text=True, timeout=600, cwd=REPO,
        )
        assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["rss_after"] - r["rss_before"]
    bound = r["non_unit_bytes"] + r["buffer_bytes"] + r["mailbox_bytes"] + SLACK_BYTES
    unit_bytes = r["served_params"] * 2
    print(
        f"llama-1b CPU tenant: peak RSS grew {grew / 2**20:.1f} MiB building the model (non-unit weights "
        f"{r['non_unit_bytes'] / 2**20:.2f} MiB, buffers {r['buffer_bytes'] / 2**20:.2f} MiB, mailbox "
        f"{r['mailbox_bytes'] / 2**20:.1f} MiB; the unit weights would be {unit_bytes / 2**20:.0f} MiB)"
    )
    assert r["logits_finite"]
    assert grew <= bound, (
        f"building the tenant grew its peak memory by {grew / 2**20:.1f} MiB; the bound is non-unit weights "
        f"{r['non_unit_bytes'] / 2**20:.2f} + buffers {r['buffer_bytes'] / 2**20:.2f} + mailbox "
        f"{r['mailbox_bytes'] / 2**20:.1f} + slack {SLACK_BYTES / 2**20:.0f} MiB = {bound / 2**20:.1f} MiB"
    )
