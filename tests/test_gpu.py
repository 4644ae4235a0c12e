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
