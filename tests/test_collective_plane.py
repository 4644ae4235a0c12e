"""A gRPC tenant's collective plane (`connect(url, plane="nccl")`, proto/collective.py): the call's
tensors by torch.distributed send/recv in a two-rank group of the tenant's own, the header and reply
in the gRPC stream. On CPUs the plane is gloo, so these tests run the plane's whole protocol (the
rendezvous, the ordering, refusals that keep both ranks in step, a tenant dying mid-call) in CI;
tests/test_gpu.py runs it over NCCL between two GPUs with NCCL's peer and shared-memory paths off."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from symbiont import connect, virtualize
from symbiont.base_executor.models import build_builtin
from symbiont.errors import InvalidCallError, MalformedMessageError, ShapeMismatchError
from symbiont.proto import executor_pb2 as pb
from tests.conftest import REPO, running_executor
from tests.models import assert_backward_matches, ids, lora_model
from tests.test_grpc import free_port

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


@pytest.fixture(scope="module")
def executor():
    port = free_port()
    with running_executor("tiny-llama", "--listen", f"grpc://127.0.0.1:{port}", "--insecure") as ex:
        ex.grpc = f"grpc://127.0.0.1:{port}"
        yield ex


def on_plane(conn) -> bool:
    return conn.transport._pair is not None


def test_a_tenant_on_the_plane_is_exact_beside_one_on_the_stream(executor):
    """Logits bitwise, greedy tokens equal, LoRA gradients within 1e-5 of the unsplit model: the
    plane moves the same bytes the stream would."""
    ref = build_builtin("tiny-llama")
    plane_conn, stream_conn = connect(executor.grpc, plane="nccl"), connect(executor.grpc, plane="stream")
    on, off = virtualize(build_builtin("tiny-llama"), plane_conn), virtualize(build_builtin("tiny-llama"), stream_conn)
    assert on_plane(plane_conn) and not on_plane(stream_conn)
    x = ids(2, 13)
    with torch.no_grad():
        want = ref(x).logits
        assert torch.equal(on(x).logits, want)
        assert torch.equal(off(x).logits, want)
    prompt = ids(1, 5, seed=3)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(on.generate(prompt, **kw), ref.generate(prompt, **kw))
    lref, lon = lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), connect(executor.grpc, plane="nccl"))
    assert_backward_matches(lref, lon, x)
    with connect(executor.url) as observer:
        placements = [t.placement for t in observer.stats().tenant_stats]
    assert placements.count("remote, gloo plane") == 2 and placements.count("remote") == 1
    for c in (plane_conn, stream_conn):
        c.close()


def test_the_catalog_offers_the_plane_and_auto_keeps_a_cpu_tenant_on_the_stream(executor):
    with connect(executor.grpc) as conn:
        assert conn.catalog().collective_plane == "gloo"
        conn.ensure_attached()
        assert not on_plane(conn)  # (auto: only a GPU tenant of another GPU's executor takes it)
    with pytest.raises(ValueError, match="plane must be one of"):
        connect(executor.grpc, plane="carrier-pigeon")
    with pytest.raises(ValueError, match="grpc://"):
        connect(executor.url, plane="nccl")


def test_refused_calls_keep_the_plane_in_step(executor):
    """A call the executor refuses after taking its bytes (unknown unit, wrong width) gets its typed
    error, and the next call's bytes are still the next call's."""
    d = build_builtin("tiny-llama").config.hidden_size
    unit = build_builtin("tiny-llama").model.layers[0].self_attn.o_proj
    with connect(executor.grpc, plane="nccl") as conn:
        conn.ensure_attached()
        t = conn.transport
        with pytest.raises(ShapeMismatchError):
            t.call("model.layers.0.mlp.down_proj", pb.FORWARD, torch.randn(3, 7), (3, 7), torch.float32, pb.TRAINING)
        with pytest.raises(InvalidCallError):
            t.call("no.such.unit", pb.FORWARD, torch.randn(3, 7), (3, 7), torch.float32, pb.TRAINING)
        x = torch.randn(5, d)
        y = t.call("model.layers.0.self_attn.o_proj", pb.FORWARD, x, (5, d), torch.float32, pb.TRAINING)
        torch.testing.assert_close(y, x @ unit.weight.T, rtol=1e-5, atol=1e-6)
        big = torch.randn(20000, d)  # ~5 MB each way: no chunks on the plane
        y = t.call("model.layers.0.self_attn.o_proj", pb.FORWARD, big, (20000, d), torch.float32, pb.TRAINING)
        torch.testing.assert_close(y, big @ unit.weight.T, rtol=1e-5, atol=1e-6)


def test_a_call_interrupted_between_its_reply_and_its_bytes_attaches_anew(executor, monkeypatch):
    """An interrupt after the OK reply, before the result's bytes are taken: the plane would be out
    of step, so the transport ends it and its stream; the next call attaches anew (a new plane) and
    is exact."""
    unit = build_builtin("tiny-llama").model.layers[0].self_attn.o_proj
    d = unit.in_features
    with connect(executor.grpc, plane="nccl") as conn:
        conn.ensure_attached()
        t = conn.transport
        first_id = t.tenant_id
        receive = type(t)._receive

        def interrupted(self, pair, reply):
            raise KeyboardInterrupt

        monkeypatch.setattr(type(t), "_receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            t.call("model.layers.0.self_attn.o_proj", pb.FORWARD, torch.randn(3, d), (3, d), torch.float32, pb.TRAINING)
        monkeypatch.setattr(type(t), "_receive", receive)
        x = torch.randn(4, d)
        with pytest.warns(RuntimeWarning, match="attached again"):
            y = t.call("model.layers.0.self_attn.o_proj", pb.FORWARD, x, (4, d), torch.float32, pb.TRAINING)
        torch.testing.assert_close(y, x @ unit.weight.T, rtol=1e-5, atol=1e-6)
        assert t.tenant_id != first_id and on_plane(conn)


def test_a_header_whose_bytes_cannot_be_known_ends_only_that_tenant(executor):
    """A call on the plane whose header does not say how many bytes come (a negative dimension):
    the executor cannot stay in step with that tenant, so it ends its stream with a typed error;
    another tenant on the plane carries on."""
    d = build_builtin("tiny-llama").config.hidden_size
    with connect(executor.grpc, plane="nccl") as bad, connect(executor.grpc, plane="nccl") as good:
        bad.ensure_attached()
        good.ensure_attached()
        raw = pb.CallRequest(call_id=7, unit="model.layers.0.self_attn.o_proj", op=pb.FORWARD, dtype=pb.FLOAT32,
                             shape=[-2, d], on_plane=True)
        bad.transport._requests.put(raw.SerializeToString())
        reply = pb.CallReply.FromString(next(bad.transport._replies))
        assert reply.status.code == pb.MALFORMED and "detached" in reply.status.message
        x = torch.randn(3, d)
        y = good.transport.call("model.layers.0.self_attn.o_proj", pb.FORWARD, x, (3, d), torch.float32, pb.TRAINING)
        assert y.shape == (3, d)
    assert "a call on a collective plane of shape [-2, 64]" in executor.log()


def test_a_tenant_killed_mid_call_on_the_plane_leaves_the_others_served(executor):
    """A tenant that sends a call's header and dies before its bytes come: the executor's receive
    for it is aborted when its stream ends, and another plane tenant's calls go on."""
    code = (
        "import os, torch\n"
        "from symbiont import connect\n"
        "from symbiont.proto import executor_pb2 as pb\n"
        f"c = connect('{executor.grpc}', plane='nccl', name='doomed')\n"
        "c.ensure_attached()\n"
        "t = c.transport\n"
        "raw = pb.CallRequest(call_id=1, unit='model.layers.0.self_attn.o_proj', op=pb.FORWARD, dtype=pb.FLOAT32,"
        " shape=[4, 64], on_plane=True)\n"
        "t._requests.put(raw.SerializeToString())\n"  # the header, never its bytes
        "import time; time.sleep(1.0)\n"
        "print('sent', flush=True)\n"
        "os._exit(0)\n"
    )
    d = build_builtin("tiny-llama").config.hidden_size
    with connect(executor.grpc, plane="nccl") as good:
        good.ensure_attached()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert "sent" in out.stdout, out.stderr
        deadline = time.monotonic() + 20
        with connect(executor.url) as observer:
            while any(t.name == "doomed" for t in observer.stats().tenant_stats):
                assert time.monotonic() < deadline, "the dead plane tenant is still attached"
                time.sleep(0.1)
        for _ in range(3):
            x = torch.randn(3, d)
            assert good.transport.call("model.layers.0.self_attn.o_proj", pb.FORWARD, x, (3, d), torch.float32,
                                       pb.TRAINING).shape == (3, d)


def test_an_executor_without_planes_refuses_one_and_auto_does_not_ask():
    port = free_port()
    with running_executor("tiny-llama", "--listen", f"grpc://127.0.0.1:{port}", "--insecure", "--no-collective-plane") as ex:
        url = f"grpc://127.0.0.1:{port}"
        with connect(url) as conn:
            assert conn.catalog().collective_plane == ""
        from symbiont.errors import ExecutorUnavailableError

        with pytest.raises(ExecutorUnavailableError, match="no collective plane"):
            connect(url, plane="nccl").ensure_attached()
    del ex


def test_a_malformed_plane_result_is_refused(executor):
    """The tenant refuses a reply to a plane call that comes in the stream instead (a broken executor)."""
    with connect(executor.grpc, plane="nccl") as conn:
        conn.ensure_attached()
        with pytest.raises(MalformedMessageError, match="answered in the stream"):
            conn.transport._receive(conn.transport._pair, pb.CallReply(call_id=1, dtype=pb.FLOAT32, shape=[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_gpu_tenant_of_another_gpu_takes_its_nccl_plane_as_if_from_another_host(monkeypatch):
    """Executor on cuda:0 over gRPC, tenant on cuda:1: by default ("auto") its calls' tensors go by
    NCCL. With NCCL's peer-to-peer and shared-memory paths off the bytes go the way they would between
    two hosts. Logits, greedy tokens and LoRA gradients as the unsplit model's on cuda:1; a tenant on
    the plane that dies between a header and its bytes leaves the other served. (Run this file in a
    pytest process of its own: NCCL reads its environment once per process.)"""
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("NCCL_SHM_DISABLE", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    tol = dict(rtol=1e-5, atol=1e-5)
    port, name, dev = free_port(), "tiny-llama", "cuda:1"
    with running_executor(name, "--device", "cuda:0", "--listen", f"grpc://127.0.0.1:{port}", "--insecure") as ex:
        url = f"grpc://127.0.0.1:{port}"
        conn = connect(url)
        ref = build_builtin(name).to(dev)
        virt = virtualize(build_builtin(name).to(dev), conn)
        assert on_plane(conn) and conn.transport._pair.backend == "nccl"
        x = ids(2, 13).to(dev)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, **tol)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1], **kw), virt.generate(x[:1], **kw))
        ref_l = lora_model(name, base=build_builtin(name).to(dev))
        virt_l = virtualize(lora_model(name, base=build_builtin(name).to(dev)), connect(url, plane="nccl"))
        assert_backward_matches(ref_l, virt_l, x, rtol=tol["rtol"])
        code = (
            "import os, torch\n"
            "from symbiont import connect\n"
            "from symbiont.proto import executor_pb2 as pb\n"
            f"c = connect('{url}', plane='nccl', name='doomed')\n"
            "c.ensure_attached(torch.device('cuda:1'))\n"
            "raw = pb.CallRequest(call_id=1, unit='model.layers.0.self_attn.o_proj', op=pb.FORWARD, dtype=pb.FLOAT32,"
            " shape=[4, 64], on_plane=True)\n"
            "c.transport._requests.put(raw.SerializeToString())\n"
            "import time; time.sleep(1.0)\n"
            "print('sent', flush=True)\n"
            "os._exit(0)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=REPO)
        assert "sent" in out.stdout, out.stderr
        deadline = time.monotonic() + 30
        with connect(ex.url) as observer:  # (over gRPC a tenant sees only its own row)
            while any(t.name == "doomed" for t in observer.stats().tenant_stats):
                assert time.monotonic() < deadline, "the dead plane tenant is still attached"
                time.sleep(0.2)
            with torch.no_grad():
                torch.testing.assert_close(virt(x).logits, ref(x).logits, **tol)
            assert "remote, nccl plane" in [t.placement for t in observer.stats().tenant_stats]
        conn.close()


def test_a_tenant_that_never_sends_its_bytes_does_not_hold_up_a_stopping_executor():
    """A live tenant sent a header on its plane and never the bytes: the plane's thread waits in
    its receive, and the executor still stops at once when asked (the thread is a daemon)."""
    from tests.conftest import Executor

    port = free_port()
    ex = Executor("tiny-llama", "--listen", f"grpc://127.0.0.1:{port}", "--insecure")
    conn = connect(f"grpc://127.0.0.1:{port}", plane="nccl", reconnect_s=0)
    conn.ensure_attached()
    raw = pb.CallRequest(call_id=1, unit="model.layers.0.self_attn.o_proj", op=pb.FORWARD, dtype=pb.FLOAT32,
                         shape=[4, 64], on_plane=True)
    conn.transport._requests.put(raw.SerializeToString())
    time.sleep(0.5)
    t0 = time.monotonic()
    assert ex.stop(timeout_s=20) == 0, ex.log()
    assert time.monotonic() - t0 < 15
