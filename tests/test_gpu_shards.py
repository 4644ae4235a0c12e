"""A sharded executor over two GPUs (marker `gpu`; skipped with fewer than two): ranks joined by
torch.distributed, a tenant on either GPU or the CPU at parity, a rank killed mid-call."""
from __future__ import annotations

import pytest
import torch

from symbiont import VirtLayer, connect, virtualize
from symbiont.base_executor.models import build_builtin
from symbiont.client.errors import ExecutorUnavailableError, NotAttachedError
from tests.conftest import Executor, running_executor
from tests.models import assert_backward_matches, ids, lora_model
from tests.test_shards import _children, _kill_rank_mid_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


@pytest.mark.parametrize("tenant,placement", [("cuda:0", "layers"), ("cuda:1", "layers"), ("cpu", "layers"),
                                              ("cuda:0", "tensor"), ("cuda:1", "tensor")])
def test_two_gpu_ranks_parity(tenant, placement):
    """Layers: layer 0 on cuda:0, layer 1 on cuda:1; a tenant on either GPU calls one rank on its
    own GPU and one as a peer; a CPU tenant both through page-locked host mailboxes. Tensor: rank
    0 on cuda:0 serves every call, its parts computed on both GPUs (NCCL)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    name = "tiny-llama"
    tol = dict(rtol=1e-5, atol=1e-5) if tenant != "cpu" else dict(rtol=1e-4, atol=1e-4)
    with running_executor(name, "--devices", "cuda:0,cuda:1", "--placement", placement) as ex:
        conn = connect(ex.url)
        ref = build_builtin(name).to(tenant)
        virt = virtualize(build_builtin(name).to(tenant), conn)
        if placement == "layers":
            assert [s.urls[0] for s in conn.catalog().shards] == [ex.url, ex.url + ".r1"]
            assert len({m.transport.url for m in virt.modules() if isinstance(m, VirtLayer)}) == 2
        if tenant != "cpu":
            assert all(t.area_device is not None for t in conn.transports), "a GPU tenant's mailboxes are device memory"
        x = ids(2, 13).to(tenant)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, **tol)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1], **kw), virt.generate(x[:1], **kw))
        ref_l = lora_model(name, base=build_builtin(name).to(tenant))
        virt_l = virtualize(lora_model(name, base=build_builtin(name).to(tenant)), ex.url)
        assert_backward_matches(ref_l, virt_l, x, rtol=tol["rtol"])
        big = ids(4, 200).to(tenant)  # the mailboxes grow, on both ranks
        with torch.no_grad():
            torch.testing.assert_close(virt(big).logits, ref(big).logits, **tol)
        conn.close()


def test_a_gpu_rank_killed_mid_call_gives_a_typed_error_not_a_hang():
    ex = Executor("tiny-llama", "--devices", "cuda:0,cuda:1")
    try:
        (rank1,) = _children(ex.pid)
        virt = virtualize(build_builtin("tiny-llama").cuda(), ex.url)
        x = ids(1, 8).cuda()
        with torch.no_grad():
            virt(x)
        # (its calls to rank 1 return early; the forward's end waits for their replies)
        failure = _kill_rank_mid_forward(rank1, virt, x, then=torch.cuda.synchronize)
        assert isinstance(failure, (ExecutorUnavailableError, NotAttachedError)), failure
        assert ex.proc.wait(60) == 1
        with pytest.raises(ExecutorUnavailableError):
            with torch.no_grad():
                virt(x)
    finally:
        ex.stop()


def test_a_checkpoint_read_rank_by_rank_on_two_gpus(tmp_path, dtype="float32"):
    """A save_pretrained directory served over two GPU ranks, each reading only its units
    (base_executor/checkpoint.py), whole-MLP units included: a tenant on cuda:0 loaded from the
    same directory passes the fingerprint check and matches the unsplit model."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    dt = getattr(torch, dtype)
    build_builtin("tiny-llama", dt).save_pretrained(tmp_path)
    with running_executor(str(tmp_path), "--devices", "cuda:0,cuda:1", "--dtype", dtype) as ex:
        conn = connect(ex.url)
        assert [u for u in conn.catalog().units if u.kind == "mlp"]
        ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dt).cuda()
        virt = virtualize(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dt).cuda(), conn)
        x = ids(2, 13).cuda()
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1], **kw), virt.generate(x[:1], **kw))
        assert ex.log().count("read the weights of") == 2
        conn.close()
