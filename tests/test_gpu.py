"""GPU tests (marker `gpu`, skipped without CUDA): an executor on a CUDA device serving CPU tenants."""
from __future__ import annotations

import pytest
import torch

from base_executor.models import build_builtin
from client import virtualize
from tests.conftest import running_executor
from tests.models import ARCHS, assert_grads_close, ids, lora_grads, lora_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ARCHS)
def test_cuda_executor_cpu_tenant_parity(name):
    """fp32 GEMMs on the GPU sum in another order than on the CPU: equal to rounding, same tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor(name, "--device", "cuda:0") as ex:
        ref = build_builtin(name)
        virt = virtualize(build_builtin(name), ex.url)
        x = ids(2, 13)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1], **kw), virt.generate(x[:1], **kw))
        ref_l, virt_l = lora_model(name), virtualize(lora_model(name), ex.url)
        for m in (ref_l, virt_l):
            m(input_ids=x, labels=x).loss.backward()
        assert_grads_close(lora_grads(ref_l), lora_grads(virt_l), rtol=1e-4)


def test_cuda_executor_bfloat16():
    with running_executor("tiny-llama", "--device", "cuda:0", "--dtype", "bfloat16") as ex:
        ref = build_builtin("tiny-llama", torch.bfloat16)
        virt = virtualize(build_builtin("tiny-llama", torch.bfloat16), ex.url)
        x = ids(1, 9)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits.float(), ref(x).logits.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-gemma2"])
def test_same_gpu_tenant_parity(name):
    """Tenant on the executor's GPU: CUDA IPC mailboxes, event-ordered, same kernels as unsplit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor(name, "--device", "cuda:0") as ex:
        ref = build_builtin(name).cuda()
        virt = virtualize(build_builtin(name).cuda(), ex.url)
        x = ids(2, 13).cuda()
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1], **kw), virt.generate(x[:1], **kw))
        ref_l, virt_l = lora_model(name, base=build_builtin(name).cuda()), virtualize(lora_model(name, base=build_builtin(name).cuda()), ex.url)
        for m in (ref_l, virt_l):
            m(input_ids=x, labels=x).loss.backward()
        assert_grads_close(lora_grads(ref_l), lora_grads(virt_l), rtol=1e-5)
        big = ids(4, 200).cuda()  # forces the device mailbox to grow
        with torch.no_grad():
            torch.testing.assert_close(virt(big).logits, ref(big).logits, rtol=1e-5, atol=1e-5)
        assert "CUDA IPC" in ex.log()


def test_two_placements_at_once():
    """A CPU tenant and a same-GPU tenant of one executor, concurrently, both exact."""
    import threading

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        cpu_ref, gpu_ref = build_builtin("tiny-llama"), build_builtin("tiny-llama").cuda()
        cpu_virt = virtualize(build_builtin("tiny-llama"), ex.url)
        gpu_virt = virtualize(build_builtin("tiny-llama").cuda(), ex.url)
        errors = []

        def loop(ref, virt, device):
            try:
                for i in range(20):
                    x = ids(2, 5 + i, seed=i).to(device)
                    with torch.no_grad():
                        torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=loop, args=a) for a in ((cpu_ref, cpu_virt, "cpu"), (gpu_ref, gpu_virt, "cuda"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_same_gpu_tenant_killed_mid_call():
    import os
    import subprocess
    import sys
    import time

    from client import connect
    from tests.conftest import REPO

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        victim = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "jobs", "gpu_loop_job.py"), ex.url],
                                  stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert victim.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        with connect(ex.url) as observer:
            before = observer.stats()
            assert before.tenants == 1 and before.mailbox_bytes > 0
            victim.kill()
            victim.wait()
            deadline = time.monotonic() + 10
            while observer.stats().tenants != 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            after = observer.stats()
        assert after.tenants == 0 and after.mailbox_bytes == 0
        assert "is gone" in ex.log()
        ref = build_builtin("tiny-llama").cuda()
        virt = virtualize(build_builtin("tiny-llama").cuda(), ex.url)  # the executor keeps serving
        x = ids(2, 9).cuda()
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
