"""DistributedDataParallel over virtualized models (what `torchrun` with the HF Trainer or a plain
loop does): two CPU processes over gloo, each a tenant of one executor. DDP reads every parameter
at start (it broadcasts them from rank 0) except those the model names in
`_ddp_params_and_buffers_to_ignore`; virtualize names the served placeholders there, so DDP wraps
the model, and the adapter gradients it averages equal those of DDP over the unsplit model."""
from __future__ import annotations


import pytest
import torch
import torch.multiprocessing as mp

from symbiont.base_executor.models import build_builtin
from tests.models import assert_grads_close, ids, lora_grads, lora_model

FLOWS = ("virtualize, then PEFT", "PEFT, then virtualize", "conn.model, then PEFT")


def _build(flow: str, url: str):
    """A LoRA tiny-llama served by `url`, made the way `flow` says (LoRA weights as lora_model's)."""
    from peft import get_peft_model

    from symbiont import connect, virtualize

    if flow == "PEFT, then virtualize":
        return virtualize(lora_model("tiny-llama"), url)
    ref = lora_model("tiny-llama")
    base = virtualize(build_builtin("tiny-llama"), url) if flow == "virtualize, then PEFT" else connect(url).model(device="cpu")
    model = get_peft_model(base, ref.peft_config["default"])
    model.load_state_dict({k: p.detach() for k, p in ref.named_parameters() if "lora_" in k}, strict=False)
    return model


def _worker(rank: int, world: int, port: int, url: str, flow: str, errors, gpus: bool = False) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if gpus else "gloo", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if gpus else torch.device("cpu")
        if gpus:
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = False
        x = ids(2, 7, seed=rank).to(device)  # each rank its own batch: DDP averages the gradients
        if gpus:  # (a tenant on each GPU: the executor's own, and a peer)
            from symbiont import virtualize

            got = virtualize(lora_model("tiny-llama", base=build_builtin("tiny-llama").to(device)), url)
        else:
            got = _build(flow, url)
        want = lora_model("tiny-llama", base=build_builtin("tiny-llama").to(device))
        for m in (want, got):
            DDP(m, device_ids=[rank] if gpus else None)(input_ids=x, labels=x).loss.backward()
        assert_grads_close(lora_grads(want), lora_grads(got), rtol=1e-4 if gpus else 1e-5)
        assert any(g.abs().sum() > 0 for g in lora_grads(got).values())
    except BaseException as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}"[:2000])
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flow", FLOWS)
def test_ddp_over_two_tenants_averages_the_unsplit_gradients(executor, flow):
    port = _free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.spawn(_worker, args=(2, port, executor.url, flow, errors), nprocs=2)
    except Exception:
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        pytest.fail("\n".join(messages) or "a rank failed")


@pytest.mark.gpu
def test_ddp_over_nccl_with_a_tenant_on_each_of_two_gpus():
    """DDP over NCCL, rank i on cuda:i, the executor on cuda:0: a same-GPU tenant and a peer-GPU
    tenant, their averaged adapter gradients as DDP over the unsplit models' (float32, TF32 off)."""
    import torch

    from tests.conftest import running_executor

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    errors = mp.get_context("spawn").SimpleQueue()
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        try:
            mp.spawn(_worker, args=(2, _free_port(), ex.url, "", errors, True), nprocs=2)
        except Exception:
            messages = []
            while not errors.empty():
                messages.append(errors.get())
            pytest.fail("\n".join(messages) or "a rank failed")


def test_the_names_ddp_skips_are_the_served_placeholders(executor):
    """What DDP reads from the model: every placeholder, by each of its names (tied weights too),
    also through the wrappers made after virtualize (a PeftModel, prompt tuning's too, and
    torch.compile's), and no parameter whose values are here; served_weight_names for others."""
    import peft

    from symbiont import served_weight_names, virtualize
    from symbiont.client.shim import RemoteWeight

    model = virtualize(build_builtin("tiny-llama"), executor.url)
    served = {n for n, p in model.named_parameters(remove_duplicate=False) if isinstance(p, RemoteWeight)}
    assert served and set(served_weight_names(model)) == served
    prompt = peft.get_peft_model(virtualize(build_builtin("tiny-llama"), executor.url),
                                 peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    for wrapper in (model, lora_model("tiny-llama", base=model), prompt, torch.compile(model)):
        skipped = set(wrapper._ddp_params_and_buffers_to_ignore)
        names = dict(wrapper.named_parameters(remove_duplicate=False))
        assert {n for n, p in names.items() if isinstance(p, RemoteWeight)} <= skipped, type(wrapper).__name__
        assert not skipped & {n for n, p in names.items() if not isinstance(p, RemoteWeight)}


def test_the_trainer_under_torchrun(executor, tmp_path):
    """examples/finetune_trainer.py started by `torchrun --nproc-per-node 2` on the CPU: the HF
    Trainer wraps the tenant's PEFT model in DistributedDataParallel (gloo) and trains it."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), "examples/finetune_trainer.py", "--executor", executor.url,
                          "--steps", "4", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("trained 4 steps") == 2, out.stdout[-3000:]


def _free_port() -> int:
    from tests.test_grpc import free_ports

    return free_ports(1)
